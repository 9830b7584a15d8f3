#!/usr/bin/env python3
"""Layer-major's once-per-step reduction against the micro-batch order.

  benches/reduce_once_bench.py [--strata build/tools/strata] [--out build/reduce-once]

Two parts, each run side by side in one command:

1. Drift: 200 steps of the `tiny` preset at 2 and 3 ranks (threads of one
   process), stage 3, 4 micro-batches, once in the micro-batch order and once
   layer-major. The two sum every gradient in another order (core/README.md,
   "Numbers at more than one rank"); printed: the largest relative loss
   difference over the steps, at the last step, and the largest per-tensor
   relative error of the exported weights.
2. Speed and bytes: the `small` preset at 8 micro-batches in 2 processes
   (`strata launch -n 2`, the ranks over Gloo on this machine), stage 3 with
   the optimizer on the CPU, both orders: median step time after a warm-up,
   the layer-major / micro-batch ratio, and each run's network bytes per
   step as the communicators counted them (`network_bytes` in --metrics)
   beside what `strata plan` counts for the same run.
"""
import argparse
import json
import os
import statistics
import struct
import subprocess
import sys


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_safetensors(path):
    """name -> list of floats (fp32 tensors only: strata exports fp32 here)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if meta["dtype"] != "F32":
            raise SystemExit(f"{path}: {name} is {meta['dtype']}, expected F32")
        out[name] = struct.unpack(f"<{(end - begin) // 4}f", data[begin:end])
    return out


def relative_error(a, b):
    diff = sum((x - y) * (x - y) for x, y in zip(a, b)) ** 0.5
    norm = sum(y * y for y in b) ** 0.5
    return diff / max(norm, 1e-30)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strata", default="build/tools/strata")
    parser.add_argument("--out", default="build/reduce-once")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    strata = os.path.abspath(args.strata)
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "demo")
    if not os.path.exists(os.path.join(data, "train.bin")):
        run([strata, "demo-data", "--out", data])
    train_bin = os.path.join(data, "train.bin")
    version = subprocess.run([strata, "--version"], capture_output=True, text=True).stdout.strip()
    print(version.replace("\n", "; "))

    print("\n## Drift over", args.steps, "steps (tiny, stage 3, 4 micro-batches, ranks as threads)")
    print("(the baseline row: the micro-batch order at W ranks against one rank with W times the")
    print(" micro-batches, the same sequences each step: another summation order of the same terms)")
    print(f"{'ranks':>5} {'compared':>28} {'max loss rel diff':>18} {'last step':>12} "
          f"{'weights rel err':>16}")

    def train(world, accum, schedule):
        tag = f"w{world}-g{accum}-{schedule}"
        metrics = os.path.join(args.out, tag + ".jsonl")
        export = os.path.join(args.out, tag + ".safetensors")
        run([strata, "train", "--model", "tiny", "--backend", "cpu", "--data", train_bin,
             "--seq-len", "64", "--micro-batch", "2", "--grad-accum", str(accum),
             "--world-size", str(world), "--zero-stage", "3", "--steps", str(args.steps),
             "--lr", "3e-3", "--schedule", schedule, "--hardware", "none",
             "--metrics", metrics, "--export", export], stdout=subprocess.DEVNULL)
        return read_metrics(metrics), read_safetensors(export)

    def compare(world, what, a, b):
        diffs = [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a[0], b[0])]
        errors = [relative_error(a[1][n], b[1][n]) for n in b[1]]
        print(f"{world:>5} {what:>28} {max(diffs):>18.3e} {diffs[-1]:>12.3e} {max(errors):>16.3e}",
              flush=True)

    for world in (2, 3):
        micro, layer = train(world, 4, "micro_batch"), train(world, 4, "layer")
        compare(world, "layer-major / micro-batch", layer, micro)
        compare(world, "baseline: W ranks / 1 rank", micro, train(1, 4 * world, "micro_batch"))

    print("\n## Step time and network bytes: small, 8 micro-batches, 2 processes over Gloo")
    common = ["--model", "small", "--seq-len", "128", "--micro-batch", "2", "--grad-accum", "8",
              "--zero-stage", "3", "--offload-optimizer", "cpu"]
    times = {}
    for schedule in ("micro_batch", "layer"):
        metrics = os.path.join(args.out, f"launch-{schedule}.jsonl")
        run([strata, "launch", "-n", "2", "--", strata, "train", *common, "--backend", "cpu",
             "--data", train_bin, "--steps", "12",
             "--lr", "3e-3", "--schedule", schedule, "--hardware", "none",
             "--metrics", metrics], stdout=subprocess.DEVNULL)
        lines = read_metrics(metrics)[2:]
        plan = json.loads(subprocess.run(
            [strata, "plan", *common, "--backend", "cpu", "--world-size", "2", "--schedule",
             schedule, "--json"], capture_output=True, text=True, check=True).stdout)
        planned = plan["traffic"]["collective_bytes"]
        times[schedule] = statistics.median(l["step_time_s"] for l in lines)
        sent = statistics.median(l["network_bytes"] for l in lines)
        print(f"{schedule:>12}: median step {times[schedule] * 1e3:.1f} ms, network "
              f"{sent / 2**20:.2f} MiB per step and rank (plan: "
              f"{planned / 2**20:.2f} MiB)", flush=True)
    print(f"layer-major / micro-batch step time: {times['layer'] / times['micro_batch']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
