#!/usr/bin/env python3
"""What NVMe offload costs a training step, side by side with its references.

One command runs, on the same directory and the same aio settings:
  - fio rw=readwrite (io_uring, O_DIRECT) at the engine's block size and queue
    depth: the bandwidth B of the path when reads and writes mix, as in a step;
  - `strata train` with everything in memory (ZeRO-3, offload none; with
    --backend cuda, stage 0 on the GPU) and with parameters and optimizer
    state on NVMe (ZeRO-3, offload nvme), at a sweep of tokens
    per step (micro-batch sizes), one rank, and the median step time of each
    after the warm-up steps; the NVMe run's bytes per step (read + written, from
    --metrics) over B is its I/O floor.
fio's own CPU time (user + system) per byte moved is measured too: moving
bytes costs the kernel CPU time, and on the CPU backend that time comes out
of the cores the model computes on. When the in-memory step keeps every core
busy, the NVMe step can be no shorter than the in-memory step plus the CPU
time fio needs for the step's bytes, divided by the cores: the bench prints
that bound next to (a), and each run's CPU time (from the child's rusage).
Then:
  (a) compute-bound: the largest tokens per step whose I/O floor is still at
      least 0.7 of the in-memory step time (hiding the I/O is necessary, not
      free); ratio NVMe step / in-memory step, target <= 1.10;
  (b) I/O-bound: one sequence of --io-seq-len tokens per step; ratio NVMe step / I/O floor,
      target <= 1.15;
  (c) the trace of (a)'s NVMe run: the fraction of io-lane time and of
      optimizer-lane time that overlaps compute-lane time (hidden under compute).

    benches/train_offload_bench.py --strata build/tools/strata --path /mnt/nvme0 \
        [--model small] [--seq-len 128] [--micro-batches 1,2,4,8,16] [--steps 12]

Needs fio. Prints a table and a JSON object (--json FILE writes it too).

With --formats fp32,bf16,int8 it instead runs the NVMe configuration (ZeRO-3,
parameters and optimizer state on NVMe) once per optimizer state format
(--optimizer-state-dtype) at each of --micro-batches, the formats alternating
over --rounds, and prints per format: the median step time after the warm-up
(the median over the rounds), its ratio against fp32 at the same tokens per
step, and the NVMe bytes read and written per step, measured (--metrics, the
mean of the steps after the warm-up) and the plan's (`strata plan --ops
--json`, as schedule_bench.py reads it). No fio; exits 1 when a measured mean
is more than 5% off the plan's.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from schedule_bench import plan_traffic  # noqa: E402  (the plan's bytes, read one way for both benches)



def cpu_kernels(strata):
    """The GEMM class, its threads and the AdamW SIMD path strata runs (`strata --version`)."""
    out = subprocess.run([strata, "--version"], capture_output=True, text=True).stdout
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.strip().startswith("CPU kernels:")), "?")

def child_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_fio(args, block, queue_depth):
    """fio rw=readwrite on the path; returns (read + write bytes per second, CPU seconds per byte)."""
    command = [
        args.fio, "--name=strata-train-floor", f"--filename={os.path.join(args.path, 'fio-train-floor.data')}",
        "--ioengine=io_uring", "--direct=1", "--rw=readwrite", f"--bs={block}", f"--iodepth={queue_depth}",
        f"--size={args.fio_size}", "--time_based", f"--runtime={args.fio_seconds}", "--thread",
        "--group_reporting", "--output-format=json",
    ]
    cpu_before = child_cpu_seconds()
    try:
        out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    finally:
        try:
            os.remove(os.path.join(args.path, "fio-train-floor.data"))
        except FileNotFoundError:
            pass
    job = json.loads(out[out.index("{"):])["jobs"][0]
    moved = job["read"]["io_bytes"] + job["write"]["io_bytes"]
    # The whole process's CPU time (rusage): io_uring's kernel workers are threads of
    # the process, which fio's own per-job usr/sys figures leave out.
    cpu_seconds = child_cpu_seconds() - cpu_before
    return job["read"]["bw_bytes"] + job["write"]["bw_bytes"], cpu_seconds / moved if moved else 0.0


def config_flags(args, micro_batch, offload, seq_len, state_dtype=None):
    """The model and configuration flags of a run, as `strata train` and `strata plan` take them."""
    flags = [
        "--model", args.model, "--backend", args.backend,
        "--seq-len", str(seq_len), "--micro-batch", str(micro_batch),
        # The CUDA backend keeps the state on the GPU at stage 0 only (one rank).
        "--zero-stage", "0" if args.backend == "cuda" and offload == "none" else "3",
        "--offload-param", offload, "--offload-optimizer", offload,
        "--aio-block-size", args.block_size, "--aio-queue-depth", str(args.queue_depth),
    ]
    if offload == "nvme":
        flags += ["--nvme-path", args.path]
    if state_dtype:
        flags += ["--optimizer-state-dtype", state_dtype]
    return flags


def run_train(args, micro_batch, offload, workdir, trace=None, seq_len=None, cpu=None, state_dtype=None):
    """One `strata train` run; returns the per-step metrics after the warm-up.
    With `cpu` (a dict), records the run's CPU seconds and wall seconds in it."""
    seq_len = seq_len or args.seq_len
    metrics = os.path.join(workdir, f"m-{offload}-{micro_batch}-{seq_len}-{state_dtype or 'fp32'}.jsonl")
    command = [args.strata, "train", "--data", args.data, "--steps", str(args.steps), "--metrics", metrics]
    command += config_flags(args, micro_batch, offload, seq_len, state_dtype)
    if trace:
        command += ["--trace", trace]
    cpu_before, wall_before = child_cpu_seconds(), time.monotonic()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if cpu is not None:
        cpu["cpu_s"] = child_cpu_seconds() - cpu_before
        cpu["wall_s"] = time.monotonic() - wall_before
    lines = [json.loads(line) for line in open(metrics)]
    return lines[args.warmup:]


def median_step(lines):
    return statistics.median(l["step_time_s"] for l in lines)


def union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def overlap(a, b):
    """Total length of the intersection of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, end - start)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def hidden_fractions(trace_path, warmup):
    """Per lane (io, optimizer): time overlapping the compute lane / lane busy time, after the warm-up."""
    events = [e for e in json.load(open(trace_path))["traceEvents"]
              if e["ph"] == "X" and e["args"]["step"] >= warmup]
    result = {}
    for rank in sorted({e["pid"] for e in events}):
        lanes = {}
        for e in events:
            if e["pid"] == rank:
                lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
        compute = union(lanes.get(2, []))
        for tid, name in ((0, "io"), (1, "comm"), (3, "optimizer")):
            busy = union(lanes.get(tid, []))
            length = sum(end - start for start, end in busy)
            result[name] = overlap(busy, compute) / length if length > 0 else None
            result[name + "_busy_s"] = length / 1e6
        result["compute_busy_s"] = sum(end - start for start, end in compute) / 1e6
        break  # one rank
    return result


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def compare_formats(args, workdir):
    """--formats: the NVMe run once per optimizer state format at each micro-batch size."""
    formats = args.formats.split(",")
    base = "fp32" if "fp32" in formats else formats[0]
    rows, mismatches = [], []
    for micro_batch in [int(m) for m in args.micro_batches.split(",")]:
        plans = {f: plan_traffic(args.strata, config_flags(args, micro_batch, "nvme", args.seq_len, f))
                 for f in formats}
        # Rounds alternate the order so drift on a shared machine falls on every format.
        runs = {f: [] for f in formats}
        for r in range(args.rounds):
            for f in (formats if r % 2 == 0 else formats[::-1]):
                lines = run_train(args, micro_batch, "nvme", workdir, state_dtype=f)
                runs[f].append({
                    "step_s": median_step(lines),
                    "nvme_read": statistics.mean(l["nvme_read_bytes"] for l in lines),
                    "nvme_written": statistics.mean(l["nvme_written_bytes"] for l in lines),
                })
        group = []
        for f in formats:
            row = {"format": f, "micro_batch": micro_batch, "tokens_per_step": micro_batch * args.seq_len,
                   "step_s": statistics.median(x["step_s"] for x in runs[f]),
                   "step_s_rounds": [x["step_s"] for x in runs[f]],
                   "nvme_read_measured": statistics.mean(x["nvme_read"] for x in runs[f]),
                   "nvme_written_measured": statistics.mean(x["nvme_written"] for x in runs[f]),
                   "nvme_read_plan": plans[f]["nvme_read"], "nvme_written_plan": plans[f]["nvme_written"]}
            for kind in ("nvme_read", "nvme_written"):
                measured, plan = row[kind + "_measured"], row[kind + "_plan"]
                # Within 5%: what a neighbouring step's overlap can shift into the window.
                if abs(measured - plan) > 0.05 * max(plan, 1):
                    mismatches.append(f"{f} x{micro_batch}: {kind} measured {measured:.0f} per step "
                                      f"against the plan's {plan}")
            group.append(row)
        for row in group:
            row["ratio_to_" + base] = row["step_s"] / next(r["step_s"] for r in group if r["format"] == base)
        rows += group

    mib = lambda n: f"{n / 2**20:.2f}"
    print(f"formats: {args.model}, seq-len {args.seq_len}, ZeRO-3 with parameters and optimizer state on "
          f"NVMe ({args.path}), {args.backend} backend, {os.cpu_count()} cores; median step time of "
          f"{args.steps - args.warmup} steps after {args.warmup}, median of {args.rounds} rounds; NVMe "
          f"bytes: mean per step after the warm-up, and the plan's")
    print(f"{'tokens/step':>11}  {'state':<5} {'step s':>7} {'/' + base:>6} {'read MiB':>9} {'(plan)':>8} "
          f"{'written MiB':>11} {'(plan)':>8}")
    for row in rows:
        print(f"{row['tokens_per_step']:>11}  {row['format']:<5} {row['step_s']:>7.3f} "
              f"{row['ratio_to_' + base]:>6.2f} {mib(row['nvme_read_measured']):>9} "
              f"{mib(row['nvme_read_plan']):>8} {mib(row['nvme_written_measured']):>11} "
              f"{mib(row['nvme_written_plan']):>8}")
    for m in mismatches:
        print("MISMATCH " + m)
    print("measured NVMe bytes per step (mean) within 5% of the plan's: " + ("yes" if not mismatches else "NO"))
    result = {"args": vars(args), "formats": rows, "mismatches": mismatches}
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    print(json.dumps(result))
    return 1 if mismatches else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strata", default="build/tools/strata")
    parser.add_argument("--path", required=True, help="NVMe directory (swap files and fio's file)")
    parser.add_argument("--data", help="token file (default: strata demo-data in a temporary directory)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the in-memory run keeps the state on the GPU (stage 0), the NVMe run "
                             "computes on the GPU with the state on NVMe (stage 3)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batches", default="1,2,3,4,6,8,16")
    parser.add_argument("--io-seq-len", type=int, default=16, help="tokens per step of the I/O-bound case")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--block-size", default="1M")
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--fio", default=shutil.which("fio") or "fio")
    parser.add_argument("--fio-size", default="1G")
    parser.add_argument("--fio-seconds", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--formats",
                        help="optimizer state formats, e.g. fp32,bf16,int8: compare them on the NVMe "
                             "run at each of --micro-batches instead of the offload analysis")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --formats: runs of each format, alternating; the median of their medians")
    args = parser.parse_args()
    print(f"strata CPU kernels: {cpu_kernels(args.strata)}")
    os.makedirs(args.path, exist_ok=True)

    with tempfile.TemporaryDirectory() as workdir:
        if not args.data:
            subprocess.run([args.strata, "demo-data", "--out", workdir, "--tokens", "1000000"], check=True,
                           stdout=subprocess.DEVNULL)
            args.data = os.path.join(workdir, "train.bin")
        if args.formats:
            return compare_formats(args, workdir)
        bandwidth, fio_cpu_per_byte = run_fio(args, parse_size(args.block_size), args.queue_depth)
        cores = os.cpu_count() or 1
        print(f"fio rw=readwrite bs={args.block_size} iodepth={args.queue_depth} on {args.path}: "
              f"{bandwidth / 1e9:.3f} GB/s (read + write), {fio_cpu_per_byte * 1e9:.2f} CPU-s per GB "
              f"moved; {cores} cores")
        rows = []
        print(f"{'tokens/step':>11} {'in-memory s':>11} {'nvme s':>9} {'MB/step':>8} {'floor s':>8} "
              f"{'floor/mem':>9} {'nvme/mem':>8} {'nvme/floor':>10} {'cpu bound':>9} {'cores busy':>10}")
        # The I/O-bound case first (one short sequence per step), then the sweep.
        shapes = [(1, args.io_seq_len)] + [(int(m), args.seq_len) for m in args.micro_batches.split(",")]
        for micro_batch, seq_len in shapes:
            memory_cpu, nvme_cpu = {}, {}
            memory = median_step(run_train(args, micro_batch, "none", workdir, seq_len=seq_len, cpu=memory_cpu))
            nvme_lines = run_train(args, micro_batch, "nvme", workdir, seq_len=seq_len, cpu=nvme_cpu)
            nvme = median_step(nvme_lines)
            moved = statistics.median(l["nvme_read_bytes"] + l["nvme_written_bytes"] for l in nvme_lines)
            floor = moved / bandwidth
            row = {"micro_batch": micro_batch, "seq_len": seq_len, "tokens_per_step": micro_batch * seq_len,
                   "in_memory_step_s": memory, "nvme_step_s": nvme, "nvme_bytes_per_step": moved,
                   "io_floor_s": floor, "floor_over_memory": floor / memory, "nvme_over_memory": nvme / memory,
                   "nvme_over_floor": nvme / floor if floor > 0 else None,
                   # The kernel's CPU time for the step's bytes (as fio pays it), out of every core.
                   "cpu_bound_over_memory": 1 + fio_cpu_per_byte * moved / (cores * memory),
                   "in_memory_cores_busy": memory_cpu["cpu_s"] / memory_cpu["wall_s"],
                   "nvme_cores_busy": nvme_cpu["cpu_s"] / nvme_cpu["wall_s"],
                   "run_cpu_s": {"memory": memory_cpu["cpu_s"], "nvme": nvme_cpu["cpu_s"]}}
            rows.append(row)
            print(f"{row['tokens_per_step']:>11} {memory:>11.4f} {nvme:>9.4f} {moved / 1e6:>8.1f} {floor:>8.4f} "
                  f"{row['floor_over_memory']:>9.2f} {row['nvme_over_memory']:>8.3f} {row['nvme_over_floor']:>10.3f} "
                  f"{row['cpu_bound_over_memory']:>9.3f} {row['in_memory_cores_busy']:>4.2f}/{row['nvme_cores_busy']:<4.2f}")

        qualifying = [r for r in rows if r["floor_over_memory"] >= 0.7]
        compute_case = max(qualifying, key=lambda r: r["tokens_per_step"]) if qualifying else \
            max(rows, key=lambda r: r["tokens_per_step"])
        io_case = min(rows, key=lambda r: r["tokens_per_step"])
        trace = os.path.join(workdir, "a.json")
        run_train(args, compute_case["micro_batch"], "nvme", workdir, trace=trace, seq_len=compute_case["seq_len"])
        hidden = hidden_fractions(trace, args.warmup)

    result = {
        "fio_readwrite_bytes_per_s": bandwidth,
        "fio_cpu_seconds_per_byte": fio_cpu_per_byte,
        "cores": cores,
        "rows": rows,
        "a_compute_bound": {**compute_case, "condition_floor_at_least_0.7_of_memory": bool(qualifying),
                            "ratio": compute_case["nvme_over_memory"], "target": 1.10},
        "b_io_bound": {**io_case, "ratio": io_case["nvme_over_floor"], "target": 1.15},
        "c_hidden_under_compute": hidden,
    }
    a, b = result["a_compute_bound"], result["b_io_bound"]
    print(f"(a) compute-bound, {a['tokens_per_step']} tokens/step (floor {a['floor_over_memory']:.2f} of the "
          f"in-memory step{'' if qualifying else ', below 0.7: no size qualified'}): NVMe / in-memory = "
          f"{a['ratio']:.3f} (target <= 1.10; the kernel's CPU for its bytes bounds it at "
          f"{a['cpu_bound_over_memory']:.3f} here, the in-memory run keeping {a['in_memory_cores_busy']:.2f} "
          f"of {cores} cores busy)")
    print(f"(b) I/O-bound, {b['tokens_per_step']} tokens/step: NVMe step / I/O floor = {b['ratio']:.3f} "
          f"(target <= 1.15)")
    fmt = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"
    print(f"(c) trace of (a), share of each lane's busy time that overlaps compute: io {fmt(hidden.get('io'))} "
          f"of {hidden.get('io_busy_s', 0):.3f} s, comm {fmt(hidden.get('comm'))} of {hidden.get('comm_busy_s', 0):.3f} s, "
          f"optimizer {fmt(hidden.get('optimizer'))} of {hidden.get('optimizer_busy_s', 0):.3f} s; compute busy "
          f"{hidden.get('compute_busy_s', 0):.3f} s (the io lane only starts fetches; the streamed optimizer's "
          f"NVMe reads and writes run on the optimizer lane)")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
