#!/usr/bin/env python3
"""The step-time model against measured runs, on this machine's CPU backend.

    python3 benches/predict_vs_measure.py --strata build/tools/strata --nvme-path DIR
            [--steps 10] [--rounds 2] [--only N,M] [--profile FILE | --probe-once] [--json OUT]
            [--keep-profiles DIR]

Each round starts with `strata plan --probe`, which measures this machine
into a profile (the units at the bench's shapes, AdamW per state format, host
copies, NVMe under DIR), written before the round's runs and never changed by
them: nothing is fitted to the runs. (A probe per round, because a shared
machine's speed drifts by more than the bounds within the minutes a bench
takes; the probes' unit rates are printed, so the drift shows.
--probe-once probes before the first round only.) Then for each configuration below (fixed here: ZeRO stages 0-3,
parameters and optimizer state on the device, in host memory or on NVMe,
accumulation 1-8, both schedules, the activation homes, fp32/bf16/int8
optimizer state, 1-3 in-process ranks; the `small` preset at 8 x 128 tokens a
micro-batch; and the `small-moe` mixture, everything on NVMe, with whole
layers, routed expert reads and deferred expert updates, its own probe at its
shapes) it runs `strata train --hardware PROFILE --trace --metrics` and
compares:

  step time   the median of the measured steps after the first, against the
              prediction in the metrics (predicted_step_time_s); for a mixture
              that reads only its routed experts, against the prediction with
              the run's recorded routing (`strata plan --routing METRICS`: the
              plan's own is the worst case, every expert read and updated)
  lane busy   each lane's busy time per step in the trace (steps after the
              first), against `strata plan --hardware PROFILE --json`'s

each configuration --rounds times (default 2, in alternating order, the
measured and the predicted step the medians over the rounds), and prints a
table, the median and worst |predicted - measured| / measured,
and exits 1 when the median passes 10% or the worst 25% (the issue's bounds).
Python's standard library only.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

MODEL = "small"  # unless a configuration names its own --model
BASE = ["--backend", "cpu", "--seq-len", "128", "--micro-batch", "8"]

# name, flags. Each is a distinct placement, schedule or size of the step.
CONFIGS = [
    ("s0 device", ["--zero-stage", "0"]),
    ("s0 G8 micro", ["--zero-stage", "0", "--grad-accum", "8", "--schedule", "micro_batch"]),
    ("s0 G8 layer", ["--zero-stage", "0", "--grad-accum", "8", "--schedule", "layer"]),
    ("s1 opt cpu", ["--zero-stage", "1", "--offload-optimizer", "cpu"]),
    ("s2 opt cpu G2", ["--zero-stage", "2", "--offload-optimizer", "cpu", "--grad-accum", "2"]),
    ("s2 opt nvme G2", ["--zero-stage", "2", "--offload-optimizer", "nvme", "--grad-accum", "2"]),
    ("s3 cpu/cpu", ["--zero-stage", "3", "--offload-param", "cpu", "--offload-optimizer", "cpu"]),
    ("s3 cpu/cpu G4 layer", ["--zero-stage", "3", "--offload-param", "cpu", "--offload-optimizer", "cpu",
                             "--grad-accum", "4", "--schedule", "layer"]),
    ("s3 nvme/nvme", ["--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer", "nvme"]),
    ("s3 nvme/nvme G4 micro", ["--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer", "nvme",
                               "--grad-accum", "4", "--schedule", "micro_batch"]),
    ("s3 nvme/nvme G4 layer", ["--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer", "nvme",
                               "--grad-accum", "4", "--schedule", "layer"]),
    ("s3 nvme/nvme G8 layer act host", ["--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer",
                                        "nvme", "--grad-accum", "8", "--schedule", "layer",
                                        "--activation-home", "host"]),
    ("s3 nvme/nvme G8 layer act nvme", ["--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer",
                                        "nvme", "--grad-accum", "8", "--schedule", "layer",
                                        "--activation-home", "nvme"]),
    ("s3 nvme/nvme bf16 state G2", ["--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer",
                                    "nvme", "--grad-accum", "2", "--optimizer-state-dtype", "bf16"]),
    ("s3 nvme/nvme int8 state G2", ["--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer",
                                    "nvme", "--grad-accum", "2", "--optimizer-state-dtype", "int8"]),
    ("s3 cpu/cpu int8 state", ["--zero-stage", "3", "--offload-param", "cpu", "--offload-optimizer", "cpu",
                               "--optimizer-state-dtype", "int8"]),
    ("s1 W2", ["--zero-stage", "1", "--world-size", "2"]),
    ("s2 W2 opt cpu G2", ["--zero-stage", "2", "--world-size", "2", "--offload-optimizer", "cpu",
                          "--grad-accum", "2"]),
    ("s3 W2 cpu/cpu", ["--zero-stage", "3", "--world-size", "2", "--offload-param", "cpu",
                       "--offload-optimizer", "cpu"]),
    ("s3 W2 nvme/nvme G2 layer", ["--zero-stage", "3", "--world-size", "2", "--offload-param", "nvme",
                                  "--offload-optimizer", "nvme", "--grad-accum", "2", "--schedule", "layer"]),
    ("s1 W3", ["--zero-stage", "1", "--world-size", "3"]),
    ("s3 W3 nvme/nvme", ["--zero-stage", "3", "--world-size", "3", "--offload-param", "nvme",
                         "--offload-optimizer", "nvme"]),
    ("moe s3 nvme/nvme", ["--model", "small-moe", "--zero-stage", "3", "--offload-param", "nvme",
                          "--offload-optimizer", "nvme"]),
    ("moe s3 nvme/nvme routed", ["--model", "small-moe", "--zero-stage", "3", "--offload-param", "nvme",
                                 "--offload-optimizer", "nvme", "--layer-pieces", "2"]),
    ("moe s3 nvme/nvme deferred", ["--model", "small-moe", "--zero-stage", "3", "--offload-param", "nvme",
                                   "--offload-optimizer", "nvme", "--layer-pieces", "2",
                                   "--expert-update", "deferred"]),
]


def model_of(flags):
    """The configuration's model: its own --model, else MODEL."""
    return flags[flags.index("--model") + 1] if "--model" in flags else MODEL


def with_model(flags):
    return flags if "--model" in flags else ["--model", MODEL, *flags]


LANES = ["io", "comm", "compute", "optimizer", "activations"]


def run(command, **kwargs):
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\nfailed ({result.returncode}): {result.stderr.strip()[-600:]}")
    return result


def trace_lane_busy(path, steps):
    """Seconds each lane of rank 0 worked per step in a strata train trace, steps after the first."""
    text = open(path).read().rstrip()
    if not text.endswith("]}"):
        text = text.rstrip(",\n") + "]}"
    events = json.loads(text)["traceEvents"]
    busy = {lane: 0.0 for lane in LANES}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") != 0 or e["args"].get("step", 0) < 1:
            continue
        busy[LANES[e["tid"]]] += e["dur"] / 1e6
    return {lane: seconds / (steps - 1) for lane, seconds in busy.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strata", required=True)
    parser.add_argument("--nvme-path", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of every configuration, in alternating order; the measured step "
                             "is the median over them (the machine's load changes under a bench)")
    parser.add_argument("--only", help="comma-separated indices of the configurations to run")
    parser.add_argument("--profile", help="use this profile instead of probing")
    parser.add_argument("--probe-once", action="store_true", help="probe before the first round only")
    parser.add_argument("--json", help="write the table as JSON here")
    parser.add_argument("--keep-profiles", help="copy each round's probed profiles into this directory")
    args = parser.parse_args()
    chosen = [CONFIGS[int(i)] for i in args.only.split(",")] if args.only else CONFIGS
    version = run([args.strata, "--version"]).stdout.strip().splitlines()
    print("\n".join(version))
    with tempfile.TemporaryDirectory() as work:
        data = os.path.join(work, "demo")
        run([args.strata, "demo-data", "--out", data])
        measured_steps = {name: [] for name, _ in chosen}
        predicted_steps = {name: [] for name, _ in chosen}
        lane_rounds = {name: [] for name, _ in chosen}
        planned_rounds = {name: [] for name, _ in chosen}
        models = sorted({model_of(flags) for _, flags in chosen}, key=lambda m: m != MODEL)
        for round_ in range(args.rounds):
            profiles = {}
            for model in models:  # each model's units probed at its own shapes
                profiles[model] = args.profile
                if args.profile:
                    continue
                profiles[model] = os.path.join(work, f"profile-{round_ if not args.probe_once else 0}-{model}.json")
                if round_ == 0 or not args.probe_once:
                    probe = run([args.strata, "plan", "--model", model, *BASE, "--zero-stage", "3",
                                 "--offload-param", "nvme", "--offload-optimizer", "nvme", "--nvme-path",
                                 args.nvme_path, "--probe", "--probe-out", profiles[model]])
                    print(f"round {round_ + 1}: " + probe.stderr.strip().replace("\n", f"\nround {round_ + 1}: "),
                          flush=True)
                    if args.keep_profiles:
                        os.makedirs(args.keep_profiles, exist_ok=True)
                        shutil.copy(profiles[model], args.keep_profiles)
            order = chosen if round_ % 2 == 0 else list(reversed(chosen))
            for name, flags in order:
                common = [*BASE, *with_model(flags), "--nvme-path", args.nvme_path, "--hardware",
                          profiles[model_of(flags)]]
                planned_rounds[name].append(
                    json.loads(run([args.strata, "plan", *common, "--json"]).stdout)["prediction"])
                metrics, trace = os.path.join(work, "m.jsonl"), os.path.join(work, "t.json")
                run([args.strata, "train", *common, "--data", os.path.join(data, "train.bin"), "--steps",
                     str(args.steps), "--lr", "1e-3", "--metrics", metrics, "--trace", trace])
                lines = [json.loads(line) for line in open(metrics)]
                measured_steps[name].append(statistics.median(line["step_time_s"] for line in lines[1:]))
                if "--layer-pieces" in flags:  # routed reads: the run's routing, not the worst case
                    replay = json.loads(run([args.strata, "plan", *common, "--routing", metrics,
                                             "--json"]).stdout)["recorded_routing"]
                    predicted_steps[name].append(replay["predicted_seconds_per_step"]["mean"])
                else:
                    predicted_steps[name].append(lines[-1]["predicted_step_time_s"])
                lane_rounds[name].append(trace_lane_busy(trace, args.steps))
        rows = []
        for name, flags in chosen:
            planned = planned_rounds[name][-1]
            planned["lane_busy_seconds"] = {
                lane: statistics.median(p["lane_busy_seconds"][lane] for p in planned_rounds[name])
                for lane in LANES}
            predicted = statistics.median(predicted_steps[name])
            measured = statistics.median(measured_steps[name])
            lanes = {lane: statistics.median(r[lane] for r in lane_rounds[name]) for lane in LANES}
            row = {"name": name, "flags": " ".join(flags), "measured_s": measured, "predicted_s": predicted,
                   "error": (predicted - measured) / measured, "rounds_s": measured_steps[name],
                   "predicted_rounds_s": predicted_steps[name],
                   "first_predicted_s": planned["first_step_seconds"],
                   "lanes_measured": lanes, "lanes_predicted": planned["lane_busy_seconds"],
                   "bound": f"{planned['bound_lane']} / {planned['bound_resource']}"}
            rows.append(row)
            print(f"{name:32s} measured {1e3 * measured:8.1f} ms  predicted {1e3 * predicted:8.1f} ms  "
                  f"{100 * row['error']:+6.1f}%   compute {1e3 * lanes['compute']:7.1f} / "
                  f"{1e3 * planned['lane_busy_seconds']['compute']:7.1f} ms  optimizer "
                  f"{1e3 * lanes['optimizer']:6.1f} / {1e3 * planned['lane_busy_seconds']['optimizer']:6.1f} ms  "
                  f"rounds {' '.join(f'{1e3 * x:.0f}' for x in measured_steps[name])} ms (predicted "
                  f"{' '.join(f'{1e3 * x:.0f}' for x in predicted_steps[name])})  "
                  f"bound {row['bound']}", flush=True)
    errors = sorted(abs(r["error"]) for r in rows)
    median, worst = statistics.median(errors), errors[-1]
    print(f"{len(rows)} configurations: median |predicted - measured| / measured {100 * median:.1f}%, "
          f"worst {100 * worst:.1f}% (bounds 10% and 25%)")
    for lane in ("compute", "optimizer", "io"):
        lane_errors = sorted(abs(r["lanes_predicted"][lane] - r["lanes_measured"][lane]) / r["lanes_measured"][lane]
                             for r in rows if r["lanes_measured"][lane] > 0.002)
        if lane_errors:
            print(f"  the {lane} lane's busy time, where over 2 ms a step ({len(lane_errors)} configurations): "
                  f"median |predicted - trace| / trace {100 * statistics.median(lane_errors):.1f}%, "
                  f"worst {100 * lane_errors[-1]:.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if median <= 0.10 and worst <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
