#!/usr/bin/env python3
"""`strata plan --tune` against measured runs, on this machine's CPU backend.

    python3 benches/tune_vs_measure.py --strata build/tools/strata --nvme-path DIR
            [--steps 8] [--rounds 2] [--profile FILE] [--json OUT]

At one token count (8 sequences of 64 tokens a step, the `small` preset:
few enough that where the state lives matters beside the compute), a fixed
grid of configurations (micro-batch x accumulation from 8 x 1 to 1 x 8, ZeRO
stages 0-3, parameters and optimizer state in memory, in host
memory and on NVMe, both schedules) is run by `strata train`, and so are the
flags given to the tuner (GIVEN below: the DeepSpeed-style offload run a user
starts from) and the tuner's first pick. The profile comes from `strata plan
--probe` alone, written before any run (nothing is fitted to the runs). It
prints every configuration's measured step (the median of the steps after
the first, the median over --rounds runs in alternating order) beside its
prediction, then the issue's two checks:

  pick      the tuner's first pick, measured, within 10% of the fastest
            configuration of the grid measured
  speed-up  the speed-up the tuner predicts for its pick over GIVEN
            (given_step_seconds / the pick's), against the measured one,
            within 15%

and exits 1 when either fails or the grid's measured steps span less than
1.5x (the grid would not test a choice). Python's standard library only.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

BASE = ["--model", "small", "--backend", "cpu", "--seq-len", "64"]
GIVEN = ["--micro-batch", "2", "--grad-accum", "4", "--zero-stage", "3", "--offload-param", "nvme",
         "--offload-optimizer", "nvme", "--schedule", "micro_batch"]


def grid():
    """(name, flags) at 8 sequences a step."""
    out = []
    for micro, accumulation in [(8, 1), (4, 2), (2, 4), (1, 8)]:
        size = ["--micro-batch", str(micro), "--grad-accum", str(accumulation)]
        orders = [["--schedule", "micro_batch"]] + ([["--schedule", "layer"]] if accumulation > 1 else [])
        for order in orders:
            for place, flags in [("s0", ["--zero-stage", "0"]),
                                 ("s3 nvme/nvme", ["--zero-stage", "3", "--offload-param", "nvme",
                                                   "--offload-optimizer", "nvme"])]:
                name = f"{place} {micro}x{accumulation}" + (f" {order[1]}" if accumulation > 1 else "")
                out.append((name, size + flags + (order if accumulation > 1 else [])))
    out.append(("s2 opt cpu 4x2", ["--micro-batch", "4", "--grad-accum", "2", "--zero-stage", "2",
                                   "--offload-optimizer", "cpu"]))
    out.append(("s3 cpu/cpu 2x4 layer", ["--micro-batch", "2", "--grad-accum", "4", "--zero-stage", "3",
                                         "--offload-param", "cpu", "--offload-optimizer", "cpu",
                                         "--schedule", "layer"]))
    return out


def run(command):
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\nfailed ({result.returncode}): {result.stderr.strip()[-600:]}")
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strata", required=True)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", help="use this profile instead of probing first")
    parser.add_argument("--json", help="write the table and the checks as JSON here")
    args = parser.parse_args()
    print("\n".join(run([args.strata, "--version"]).stdout.strip().splitlines()))
    with tempfile.TemporaryDirectory() as work:
        profile = args.profile or os.path.join(work, "profile.json")
        nvme = ["--nvme-path", args.nvme_path]
        if not args.profile:
            probe = run([args.strata, "plan", *BASE, *GIVEN, *nvme, "--probe", "--probe-out", profile])
            print(probe.stderr.strip())
        tuned = json.loads(run([args.strata, "plan", *BASE, *GIVEN, *nvme, "--hardware", profile, "--tune",
                                "--json"]).stdout)
        pick = tuned["candidates"][0]
        print(f"tuner: {tuned['tried']} tried, {tuned['fitting']} fit; first pick {pick['flags']} "
              f"({1e3 * pick['prediction']['step_seconds']:.1f} ms predicted, the given flags "
              f"{1e3 * tuned['given_step_seconds']:.1f} ms)")
        configs = grid() + [("given", GIVEN), ("tuner's pick", pick["flags"].split())]
        data = os.path.join(work, "demo")
        run([args.strata, "demo-data", "--out", data])
        measured = {name: [] for name, _ in configs}
        predicted = {}
        for round_ in range(args.rounds):
            for name, flags in (configs if round_ % 2 == 0 else list(reversed(configs))):
                metrics = os.path.join(work, "m.jsonl")
                run([args.strata, "train", *BASE, *flags, *nvme, "--hardware", profile, "--data",
                     os.path.join(data, "train.bin"), "--steps", str(args.steps), "--lr", "1e-3",
                     "--metrics", metrics])
                lines = [json.loads(line) for line in open(metrics)]
                measured[name].append(statistics.median(line["step_time_s"] for line in lines[1:]))
                predicted[name] = lines[-1]["predicted_step_time_s"]
    rows = []
    for name, flags in configs:
        m = statistics.median(measured[name])
        rows.append({"name": name, "flags": " ".join(flags), "measured_s": m, "predicted_s": predicted[name],
                     "rounds_s": measured[name]})
        print(f"{name:28s} measured {1e3 * m:8.1f} ms  predicted {1e3 * predicted[name]:8.1f} ms  "
              f"{100 * (predicted[name] - m) / m:+6.1f}%   rounds "
              f"{' '.join(f'{1e3 * x:.0f}' for x in measured[name])} ms", flush=True)
    by_name = {r["name"]: r for r in rows}
    grid_rows = rows[:len(configs) - 2]
    fastest = min(grid_rows, key=lambda r: r["measured_s"])
    slowest = max(grid_rows, key=lambda r: r["measured_s"])
    span = slowest["measured_s"] / fastest["measured_s"]
    picked = by_name["tuner's pick"]["measured_s"]
    pick_ratio = picked / fastest["measured_s"]
    predicted_speedup = tuned["given_step_seconds"] / pick["prediction"]["step_seconds"]
    measured_speedup = by_name["given"]["measured_s"] / picked
    speedup_error = predicted_speedup / measured_speedup - 1
    print(f"grid: {len(grid_rows)} configurations, measured {1e3 * fastest['measured_s']:.1f} ms "
          f"({fastest['name']}) to {1e3 * slowest['measured_s']:.1f} ms ({slowest['name']}): {span:.2f}x "
          f"(at least 1.5x)")
    print(f"pick: measured {1e3 * picked:.1f} ms, {100 * (pick_ratio - 1):+.1f}% from the grid's fastest "
          f"(bound +10%)")
    print(f"speed-up over the given flags: predicted {predicted_speedup:.2f}x, measured {measured_speedup:.2f}x, "
          f"{100 * speedup_error:+.1f}% (bound 15%)")
    ok = span >= 1.5 and pick_ratio <= 1.10 and abs(speedup_error) <= 0.15
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "span": span, "pick_ratio": pick_ratio, "predicted_speedup": predicted_speedup,
                       "measured_speedup": measured_speedup, "tuned": tuned, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
