#!/usr/bin/env python3
"""The layer-major schedule against the micro-batch order, side by side.

One command trains the same model, data and placement with `--schedule
micro_batch` and `--schedule layer` at each gradient accumulation of a sweep,
alternating the two, and prints per run:
  - the NVMe bytes read and written per step, measured (--metrics, the mean
    of the steps after the warm-up), against the plan's (`strata plan --ops
    --json`). A step's optimizer overlaps the next step's forward, so a
    single step's count can hold some of its neighbour's bytes; the mean
    over the steps is the plan's (tests/engine_schedule_test.cpp checks the
    whole run's bytes for equality);
  - the parameter bytes fetched per step (the plan's fetches): with the
    layer-major schedule they do not grow with the accumulation;
  - the activation bytes the plan keeps in memory for the backward (with
    --activation-home nvme the spilled ones travel in the NVMe bytes);
  - the median step time after the warm-up (the median over --rounds runs of
    each, alternating), and the ratio layer / micro_batch (target <= 0.6 at
    accumulation 8 with parameters and optimizer on NVMe).
With --backend cuda (a GPU) the plan's PCIe bytes per step and the tokens/s
of both are printed too.

    benches/schedule_bench.py --strata build/tools/strata --path DIR \
        [--model small] [--seq-len 128] [--micro-batch 4] [--accums 1,2,4,8] [--steps 6]

Prints a table and a JSON object (--json FILE writes it too); exits 1 when a
measured mean is more than 5% off the plan's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile



def cpu_kernels(strata):
    """The GEMM class, its threads and the AdamW SIMD path strata runs (`strata --version`)."""
    out = subprocess.run([strata, "--version"], capture_output=True, text=True).stdout
    return next((l.split(":", 1)[1].strip() for l in out.splitlines() if l.strip().startswith("CPU kernels:")), "?")

def common_flags(args, accum, schedule):
    return [
        "--model", args.model, "--backend", args.backend, "--seq-len", str(args.seq_len),
        "--micro-batch", str(args.micro_batch), "--grad-accum", str(accum),
        "--zero-stage", "3", "--offload-param", args.offload, "--offload-optimizer", args.offload,
        "--nvme-path", args.path, "--schedule", schedule,
    ] + (["--activation-home", args.activation_home] if args.activation_home else [])


def plan_traffic(strata, flags):
    """The engine's plan of one step (`strata plan --ops --json FLAGS`, FLAGS as `strata train`
    takes them): NVMe bytes, parameter fetches, PCIe and the activations kept."""
    out = subprocess.run([strata, "plan", "--ops", "--json"] + flags,
                         check=True, capture_output=True, text=True).stdout
    plan = json.loads(out)
    roles = ("saved_inputs", "activation_gradient", "gpu_saved_inputs",
             "gpu_activation_gradient", "activation_spill")
    kept = sum(b["bytes"] for b in plan["buffers"] if b["role"] in roles and b["tier"] != "nvme")
    return {
        "nvme_read": plan["nvme_bytes_per_step"]["read"],
        "nvme_written": plan["nvme_bytes_per_step"]["written"],
        "fetched": sum(op["bytes"] for op in plan["ops"] if op["op"] == "fetch"),
        "pcie_h2d": plan["link_bytes_per_step"]["pcie_h2d"],
        "pcie_d2h": plan["link_bytes_per_step"]["pcie_d2h"],
        "activations": kept,
    }


def planned(args, accum, schedule):
    return plan_traffic(args.strata, common_flags(args, accum, schedule))


def train(args, accum, schedule, workdir):
    metrics = os.path.join(workdir, f"m-{schedule}-{accum}.jsonl")
    command = [args.strata, "train", "--data", args.data, "--steps", str(args.steps),
               "--metrics", metrics] + common_flags(args, accum, schedule)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = [json.loads(line) for line in open(metrics)][args.warmup:]
    return {
        "step_s": statistics.median(l["step_time_s"] for l in lines),
        "tokens_per_s": statistics.median(l["tokens_per_s"] for l in lines),
        "nvme_read": statistics.mean(l["nvme_read_bytes"] for l in lines),
        "nvme_written": statistics.mean(l["nvme_written_bytes"] for l in lines),
    }


def mib(n):
    return f"{n / 2**20:.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strata", default="build/tools/strata")
    parser.add_argument("--path", required=True, help="NVMe directory for the swap files")
    parser.add_argument("--data", help="token file (default: strata demo-data in a temporary directory)")
    parser.add_argument("--model", default="small")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--offload", default="nvme", choices=["cpu", "nvme"],
                        help="home of the parameters and the optimizer state")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accums", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--rounds", type=int, default=3,
                        help="runs of each schedule, alternating; the median of their medians")
    parser.add_argument("--activation-home", choices=["auto", "device", "host", "nvme"],
                        help="where layer-major keeps its checkpoints (default: the plan's choice); "
                             "'activations' counts those in memory, NVMe traffic the spills")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    os.makedirs(args.path, exist_ok=True)

    with tempfile.TemporaryDirectory() as workdir:
        if not args.data:
            subprocess.run([args.strata, "demo-data", "--out", workdir], check=True, capture_output=True)
            args.data = os.path.join(workdir, "train.bin")
        rows, mismatches = [], []
        for accum in [int(a) for a in args.accums.split(",")]:
            row = {"accum": accum}
            plans = {s: planned(args, accum, s) for s in ("micro_batch", "layer")}
            # Rounds alternate the two so drift on a shared machine falls on both.
            runs = {"micro_batch": [], "layer": []}
            for r in range(args.rounds):
                for schedule in (("micro_batch", "layer") if r % 2 == 0 else ("layer", "micro_batch")):
                    runs[schedule].append(train(args, accum, schedule, workdir))
            for schedule in ("micro_batch", "layer"):
                plan = plans[schedule]
                rounds = runs[schedule]
                run = {
                    "step_s": statistics.median(x["step_s"] for x in rounds),
                    "tokens_per_s": statistics.median(x["tokens_per_s"] for x in rounds),
                    "nvme_read": statistics.mean(x["nvme_read"] for x in rounds),
                    "nvme_written": statistics.mean(x["nvme_written"] for x in rounds),
                }
                for kind in ("nvme_read", "nvme_written"):
                    # Within 5%: what a neighbouring step's overlap can shift into the window.
                    if abs(run[kind] - plan[kind]) > 0.05 * max(plan[kind], 1):
                        mismatches.append(f"{schedule} x{accum}: {kind} measured {run[kind]:.0f} "
                                          f"per step against the plan's {plan[kind]}")
                row[schedule] = {"plan": plan, "step_s": run["step_s"],
                                 "tokens_per_s": run["tokens_per_s"],
                                 "nvme_read_measured": run["nvme_read"],
                                 "nvme_written_measured": run["nvme_written"]}
            row["ratio"] = row["layer"]["step_s"] / row["micro_batch"]["step_s"]
            rows.append(row)

    print(f"strata CPU kernels: {cpu_kernels(args.strata)}")
    print(f"schedule bench: {args.model}, {args.micro_batch} x {args.seq_len} tokens per micro-batch, "
          f"ZeRO-3, parameters and optimizer on {args.offload}, {args.backend} backend, "
          f"activations {args.activation_home or 'auto'}, "
          f"median of {args.rounds} rounds of {args.steps - args.warmup} steps")
    header = (f"{'accum':>5}  {'schedule':<11} {'NVMe read MiB':>13} {'(plan)':>9} {'written':>9} "
              f"{'(plan)':>9} {'fetched':>9} {'activations':>11}")
    if args.backend == "cuda":
        header += f" {'PCIe h2d':>9} {'d2h':>9} {'tokens/s':>9}"
    header += f" {'step s':>8} {'layer/micro':>11}"
    print(header)
    for row in rows:
        for schedule in ("micro_batch", "layer"):
            r, p = row[schedule], row[schedule]["plan"]
            line = (f"{row['accum']:>5}  {schedule:<11} {mib(r['nvme_read_measured']):>13} "
                    f"{mib(p['nvme_read']):>9} {mib(r['nvme_written_measured']):>9} "
                    f"{mib(p['nvme_written']):>9} {mib(p['fetched']):>9} {mib(p['activations']):>11}")
            if args.backend == "cuda":
                line += f" {mib(p['pcie_h2d']):>9} {mib(p['pcie_d2h']):>9} {r['tokens_per_s']:>9.0f}"
            line += f" {r['step_s']:>8.3f}"
            if schedule == "layer":
                line += f" {row['ratio']:>11.2f}"
            print(line)
    last = rows[-1]
    print(f"target: layer / micro_batch step time <= 0.6 at accumulation {last['accum']}: "
          f"{last['ratio']:.2f} ({'met' if last['ratio'] <= 0.6 else 'NOT met'})")
    for m in mismatches:
        print("MISMATCH " + m)
    print("measured NVMe bytes per step (mean) within 5% of the plan's: " +
          ("yes" if not mismatches else "NO"))
    result = {"args": vars(args), "rows": rows, "mismatches": mismatches}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
