#!/usr/bin/env python3
"""The streamed AdamW step over NVMe-resident state against its I/O floor and
against the same step in memory, in one run on one path.

1. fio measures the drive for the step's mix: rw=readwrite (half reads, half
   writes), the same block size and queue depth, io_uring, direct=1, on the
   same directory. The floor is the bytes the step moves divided by fio's
   combined (read + write) bandwidth.
2. tiers_streamed_optimizer_bench runs StreamedStep (state on NVMe, host
   buffers <= 256 MiB) and then, in a second process, InMemoryStep.
3. Prints seconds per step, the ratios, and the peak resident memory of the
   streamed process. Targets: streamed <= 1.15x the floor, peak RSS < 1 GiB.

    benches/tiers_streamed_optimizer.py --bench build/benches/tiers_streamed_optimizer_bench \
        --path /mnt/nvme0 --state-gib 9 --block-size 1M --queue-depth 16

Every file it writes under --path is removed at the end.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def run_fio(args, size, block):
    data = os.path.join(args.path, "strata-fio-floor.data")
    command = [
        args.fio, "--name=strata-floor", f"--filename={data}", "--ioengine=io_uring",
        "--direct=1", "--rw=readwrite", f"--bs={block}", f"--iodepth={args.queue_depth}",
        f"--size={size}", f"--runtime={args.fio_seconds}", "--time_based", "--output-format=json",
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=True)
    finally:
        if os.path.exists(data):
            os.remove(data)
    job = json.loads(result.stdout[result.stdout.index("{"):])["jobs"][0]
    return job["read"]["bw_bytes"], job["write"]["bw_bytes"]


def run_bench(args, name, block):
    env = dict(os.environ, STRATA_BENCH_PATH=args.path, STRATA_BENCH_STATE_GIB=str(args.state_gib),
               STRATA_BENCH_BLOCK_SIZE=str(block), STRATA_BENCH_QUEUE_DEPTH=str(args.queue_depth),
               STRATA_BENCH_BUFFERS=str(args.buffers), STRATA_BENCH_CHUNK=str(args.chunk))
    result = subprocess.run([args.bench, f"--benchmark_filter=^{name}", "--benchmark_format=json"],
                            capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.exit(f"{name} failed: {result.stderr.strip()}")
    sys.stderr.write(result.stderr)
    run = json.loads(result.stdout)["benchmarks"][0]
    if run.get("error_occurred"):
        sys.exit(f"{name} failed: {run.get('error_message')}")
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", required=True, help="the tiers_streamed_optimizer_bench binary")
    parser.add_argument("--path", required=True, help="directory on the NVMe drive")
    parser.add_argument("--state-gib", type=int, default=9, help="master + m + v, GiB (default 9)")
    parser.add_argument("--block-size", default="1M")
    parser.add_argument("--queue-depth", type=int, default=16)
    parser.add_argument("--buffers", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=1 << 22, help="elements per chunk (default 2^22)")
    parser.add_argument("--fio", default="fio")
    parser.add_argument("--fio-seconds", type=int, default=30)
    args = parser.parse_args()
    block = parse_size(args.block_size)
    state = args.state_gib << 30
    free = shutil.disk_usage(args.path).free
    if free < 2 * state + (2 << 30):
        sys.exit(f"{args.path} has {free / 2**30:.1f} GiB free; the run needs {2 * state / 2**30 + 2:.0f} GiB "
                 "(state file and fio file); use --state-gib or another path")
    buffer_bytes = args.buffers * args.chunk * 12
    if buffer_bytes > 256 << 20:
        print(f"note: host buffers are {buffer_bytes / 2**20:.0f} MiB (> 256 MiB)")

    read_bw, write_bw = run_fio(args, state, block)
    streamed = run_bench(args, "StreamedStep", block)
    memory = run_bench(args, "InMemoryStep", block)

    moved = streamed["moved_bytes_per_step"]
    floor = moved / (read_bw + write_bw)
    step = streamed["real_time"]
    in_memory = memory["real_time"]
    gib = 1 << 30
    print(f"state (master + m + v)   {streamed['state_bytes'] / gib:.2f} GiB on {args.path}, "
          f"{args.block_size} blocks, queue depth {args.queue_depth}")
    print(f"host buffers             {streamed['host_buffer_bytes'] / 2**20:.0f} MiB "
          f"({args.buffers} x {args.chunk} elements x 12 bytes)")
    print(f"fio rw=readwrite         read {read_bw / 1e9:.2f} GB/s + write {write_bw / 1e9:.2f} GB/s")
    print(f"bytes moved per step     {moved / 1e9:.2f} GB")
    print(f"I/O floor                {floor:.2f} s")
    print(f"streamed step            {step:.2f} s  ({step / floor:.3f}x the floor; target <= 1.15x)")
    print(f"  waiting for reads      {streamed['read_wait_s']:.2f} s, for write-backs "
          f"{streamed['write_wait_s']:.2f} s, in AdamW {streamed['visit_s']:.2f} s")
    print(f"in-memory step           {in_memory:.2f} s  (streamed / in-memory {step / in_memory:.1f}x)")
    print(f"peak RSS, streamed       {streamed['peak_rss_bytes'] / 2**20:.0f} MiB (target < 1024 MiB)")
    print(f"peak RSS, in-memory      {memory['peak_rss_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
