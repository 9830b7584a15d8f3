#!/usr/bin/env python3
"""strata nvme-bench against fio, side by side, on the same directory and settings.

Each round runs fio (io_uring, direct=1, fixedbufs, registerfiles; end_fsync=1
for the write) and `strata nvme-bench --json` one after the other, alternating
which goes first, and prints per round and as medians: GB/s (1e9 bytes/s) for
write and read, the ratio strata/fio, CPU seconds per GB moved, and the bytes
the kernel accounted to strata's process (/proc/self/io) against the bytes it
asked for. Target: median ratio >= 0.95 in both directions.

    benches/nvme_vs_fio.py --strata build/tools/strata --path /mnt/nvme0 \
        --size 4G --block-size 1M --queue-depth 32 --threads 1 --rounds 5
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def run_fio(args, direction, size, block):
    """One fio job group; returns (GB/s, CPU seconds) as fio reports them."""
    threads = args.threads
    per_job = size // threads // block * block
    command = [
        args.fio, "--name=strata-vs-fio", f"--filename={os.path.join(args.path, 'fio-vs-strata.data')}",
        "--ioengine=io_uring", "--direct=1", "--fixedbufs", "--registerfiles",
        f"--rw={direction}", f"--bs={block}", f"--iodepth={args.queue_depth}",
        f"--numjobs={threads}", f"--size={per_job}", f"--offset_increment={per_job}",
        "--thread", "--group_reporting", "--output-format=json",
    ]
    if direction == "write":
        command.append("--end_fsync=1")
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    job = json.loads(result.stdout[result.stdout.index("{"):])["jobs"][0]
    side = job[direction]
    gb_per_s = side["bw_bytes"] / 1e9
    # usr_cpu / sys_cpu are percentages of one CPU over the job's runtime, per job.
    cpu_seconds = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000 * threads
    return gb_per_s, cpu_seconds, side["io_bytes"]


def run_fio_pair(args, size, block):
    try:
        write = run_fio(args, "write", size, block)
        read = run_fio(args, "read", size, block)
    finally:
        path = os.path.join(args.path, "fio-vs-strata.data")
        if os.path.exists(path):
            os.remove(path)
    return {"write": write, "read": read}


def run_strata(args, size, block):
    command = [args.strata, "nvme-bench", "--path", args.path, "--size", str(size), "--block-size",
               str(block), "--queue-depth", str(args.queue_depth), "--threads", str(args.threads), "--json"]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    run = json.loads(result.stdout)
    return {d: (run[d]["gb_per_s"], run[d]["cpu_seconds"], run[d]["bytes"], run[d]["kernel_bytes"])
            for d in ("write", "read")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strata", required=True, help="path of the strata binary")
    parser.add_argument("--path", required=True, help="directory on the NVMe device")
    parser.add_argument("--size", default="4G")
    parser.add_argument("--block-size", default="1M")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fio", default=shutil.which("fio") or "fio")
    parser.add_argument("--json", help="also write every measurement to this file")
    args = parser.parse_args()
    size, block = parse_size(args.size), parse_size(args.block_size)
    size = size // block * block

    print(f"fio vs strata nvme-bench: {size / 2**30:.2f} GiB, block {block >> 10} KiB, "
          f"queue depth {args.queue_depth}, {args.threads} thread(s), {args.rounds} rounds, {args.path}")
    print(f"{'round':>5} {'first':>6} | {'fio W':>7} {'strata W':>8} {'ratio':>6} | "
          f"{'fio R':>7} {'strata R':>8} {'ratio':>6} | {'CPU s/GB W fio/strata':>22} {'R fio/strata':>13}")
    rounds = []
    for round_index in range(args.rounds):
        strata_first = round_index % 2 == 1
        if strata_first:
            strata = run_strata(args, size, block)
            fio = run_fio_pair(args, size, block)
        else:
            fio = run_fio_pair(args, size, block)
            strata = run_strata(args, size, block)
        row = {"fio": fio, "strata": strata}
        rounds.append(row)
        gb = size / 1e9
        print(f"{round_index + 1:>5} {'strata' if strata_first else 'fio':>6} | "
              f"{fio['write'][0]:7.2f} {strata['write'][0]:8.2f} {strata['write'][0] / fio['write'][0]:6.3f} | "
              f"{fio['read'][0]:7.2f} {strata['read'][0]:8.2f} {strata['read'][0] / fio['read'][0]:6.3f} | "
              f"{fio['write'][1] / gb:10.3f} / {strata['write'][1] / gb:.3f} "
              f"{fio['read'][1] / gb:7.3f} / {strata['read'][1] / gb:.3f}", flush=True)

    print()
    ok = True
    for direction in ("write", "read"):
        ratios = [r["strata"][direction][0] / r["fio"][direction][0] for r in rounds]
        median_ratio = statistics.median(ratios)
        fio_median = statistics.median(r["fio"][direction][0] for r in rounds)
        strata_median = statistics.median(r["strata"][direction][0] for r in rounds)
        fio_cpu = statistics.median(r["fio"][direction][1] for r in rounds) / (size / 1e9)
        strata_cpu = statistics.median(r["strata"][direction][1] for r in rounds) / (size / 1e9)
        accounted = [r["strata"][direction][3] for r in rounds]
        requested = rounds[0]["strata"][direction][2]
        ok &= median_ratio >= 0.95
        print(f"{direction:>5}: median strata/fio = {median_ratio:.3f} "
              f"(fio {fio_median:.2f} GB/s, strata {strata_median:.2f} GB/s); "
              f"CPU s/GB fio {fio_cpu:.3f}, strata {strata_cpu:.3f}; "
              f"strata /proc/self/io {direction}_bytes {sorted(set(accounted))} for {requested} requested")
    print(f"target (median ratio >= 0.95 both ways): {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"size": size, "block_size": block, "queue_depth": args.queue_depth,
                       "threads": args.threads, "rounds": rounds}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
