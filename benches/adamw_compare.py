#!/usr/bin/env python3
"""Side-by-side CPU AdamW: strata vs the bandwidth ceiling vs DeepSpeed vs PyTorch.

    PYTHON benches/adamw_compare.py --bench BUILD/benches/adamw_bench [--threads T] [--params N]

Run it with an interpreter that has torch (and deepspeed, for DeepSpeed's CPU
Adam); whatever is missing is reported and left out. In one run, on N
parameters (default 64 Mi) and T threads (default: all cores):

  strata fp32   adamw_bench AdamWStep/fp32: fp32 gradient, no copy (28 B/param)
  strata mixed  adamw_bench AdamWStep/mixed: bf16 gradient in, bf16 copy out (28 B/param)
  ceiling       adamw_bench Ceiling/*: the same reads and in-place writes, plain loop
  DeepSpeed     deepspeed.ops.adam.DeepSpeedCPUAdam (OMP_NUM_THREADS=T) on fp32
                params/grads (28 B/param); mixed = its step followed by the
                separate fp32 -> bf16 copy of the parameters, as ZeRO-Offload
                does (28 + 6 = 34 B/param)
  torch         torch.optim.AdamW (fused=True where this torch has it, else the
                default), torch.set_num_threads(T)

The methods run in interleaved rounds; each ratio is printed from the best
rates and as the median of the per-round ratios, so that other load on the
machine disturbs them less. Every array holds random
data. Prints parameters/s, GB/s (10^9 bytes, counted
as the bytes each method must move) and every ratio.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def parse_count(text):
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def run_strata(bench, params, threads, min_time):
    command = [bench, f"--params={params}", f"--threads={threads}",
               "--benchmark_format=json", f"--benchmark_min_time={min_time}",
               "--benchmark_filter=AdamWStep|Ceiling"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"adamw_bench failed: {result.stderr.strip()}")
    report = json.loads(result.stdout)
    rates = {}
    for entry in report["benchmarks"]:
        name = entry["name"].split("/real_time")[0]
        rates[name] = entry["params_per_s"]
    simd = report["context"].get("simd", "?")
    return rates, simd


def median_rate(step, params, warmup=2, repeats=5):
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return params / statistics.median(times)


def setup_deepspeed(torch, params):
    """Returns ({name: step function}, None) or (None, why DeepSpeed is left out)."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # ImportError, or the op failing to build
        return None, f"deepspeed not usable here: {error}"
    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params) * 1e-2
    try:
        optimizer = DeepSpeedCPUAdam([p], lr=1e-4, weight_decay=0.01, adamw_mode=True)
    except Exception as error:
        return None, f"DeepSpeedCPUAdam could not be built: {error}"
    copy = torch.empty(params, dtype=torch.bfloat16)

    def step_and_copy():
        optimizer.step()
        copy.copy_(p.data)

    return {"fp32": optimizer.step, "mixed": step_and_copy}, None


def setup_torch(torch, params):
    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params) * 1e-2
    label = "torch.optim.AdamW"
    try:
        optimizer = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, fused=True)
        optimizer.step()
        label += " (fused)"
    except Exception:
        optimizer = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01)
    return optimizer.step, label


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", required=True, help="path to the adamw_bench binary")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--params", default="64M", help="parameter count (k, M, G suffixes: 2^10...)")
    parser.add_argument("--min-time", default="1", help="Google Benchmark min time per case, seconds")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; the best rate of each method is kept")
    args = parser.parse_args()
    params = parse_count(args.params)
    threads = args.threads
    os.environ["OMP_NUM_THREADS"] = str(threads)

    print(f"CPU AdamW, {params} parameters ({params / 2**20:.0f} Mi), {threads} threads, "
          f"best of {args.rounds} interleaved rounds")
    others = {}  # name -> step function
    torch_label = None
    try:
        import torch
        torch.set_num_threads(threads)
        print(f"torch {torch.__version__}")
        deepspeed, why = setup_deepspeed(torch, params)
        if deepspeed is None:
            print(f"DeepSpeed: left out ({why})")
        else:
            others["DeepSpeed fp32"] = deepspeed["fp32"]
            others["DeepSpeed mixed"] = deepspeed["mixed"]
        torch_step, torch_label = setup_torch(torch, params)
        others["torch"] = torch_step
    except ImportError as error:
        print(f"torch: left out ({error})")

    best = {}
    per_round = []  # the rates of each round, for per-round ratios
    simd = "?"
    for round_index in range(args.rounds):
        strata, simd = run_strata(args.bench, params, threads, args.min_time)
        measured = dict(strata)
        for name, step in others.items():
            measured[name] = median_rate(step, params)
        print(f"round {round_index + 1}: " +
              ", ".join(f"{name} {rate / 1e9:.3f}" for name, rate in measured.items()) +
              " G params/s")
        per_round.append(measured)
        for name, rate in measured.items():
            best[name] = max(best.get(name, 0.0), rate)
    strata = best
    deepspeed = None
    if "DeepSpeed fp32" in best:
        deepspeed = {"fp32": best["DeepSpeed fp32"], "mixed": best["DeepSpeed mixed"]}
    torch_rate = best.get("torch")
    rows = [("strata fp32", strata["AdamWStep/fp32"], 28),
            ("strata mixed (bf16 in, bf16 copy out)", strata["AdamWStep/mixed"], 28),
            ("ceiling fp32 (same reads/writes)", strata["Ceiling/fp32"], 28),
            ("ceiling mixed (same reads/writes)", strata["Ceiling/mixed"], 28)]
    if deepspeed:
        rows += [("DeepSpeedCPUAdam fp32", deepspeed["fp32"], 28),
                 ("DeepSpeedCPUAdam + fp32->bf16 copy", deepspeed["mixed"], 34)]
    if torch_rate:
        rows.append((f"{torch_label} fp32", torch_rate, 28))

    print(f"strata SIMD path: {simd}")
    print(f"{'method':44s} {'G params/s':>11s} {'GB/s':>8s}")
    for name, rate, bytes_per_param in rows:
        print(f"{name:44s} {rate / 1e9:11.3f} {rate * bytes_per_param / 1e9:8.2f}")

    # Each ratio twice: from the best rates, and the median of the ratios
    # within each round (methods of one round run seconds apart).
    names = [("strata fp32 / ceiling fp32", "AdamWStep/fp32", "Ceiling/fp32"),
             ("strata mixed / ceiling mixed", "AdamWStep/mixed", "Ceiling/mixed")]
    if deepspeed:
        names += [("strata fp32 / DeepSpeed fp32", "AdamWStep/fp32", "DeepSpeed fp32"),
                  ("strata mixed / DeepSpeed step+copy", "AdamWStep/mixed", "DeepSpeed mixed"),
                  ("DeepSpeed fp32 / ceiling fp32", "DeepSpeed fp32", "Ceiling/fp32")]
    if torch_rate:
        names.append((f"strata fp32 / {torch_label}", "AdamWStep/fp32", "torch"))
        if deepspeed:
            names.append((f"DeepSpeed fp32 / {torch_label}", "DeepSpeed fp32", "torch"))
    print(f"ratios: {'':44s} {'best':>6s} {'median of rounds':>17s}")
    for label, a, b in names:
        median = statistics.median(r[a] / r[b] for r in per_round)
        print(f"  {label:50s} {best[a] / best[b]:6.3f} {median:17.3f}")

if __name__ == "__main__":
    main()
