#!/usr/bin/env python3
"""Optional check with TensorBoard's own reader (not part of ctest): the event
files `strata train` writes, read by the `tensorboard` package's
EventAccumulator (tensorboard.backend.event_processing), hold every scalar of
every step that the run's metrics file holds, at the step's samples (the
metrics' sequence_offset), equal as float32: Train/Samples/train_loss,
eval_loss (when evaluated), lr, grad_norm, loss_scale (fp16), tokens_per_s,
step_time_s and nvme_gb_per_s; and no other tag. The suite's own check,
monitor_files_check.py, decodes the same files with the standard library.

With --strata, runs `strata train` itself in a scratch folder (the tiny model
on demo data, fp16, ZeRO-3 with parameters and optimizer state on NVMe, an
evaluation every 3 steps) with --tensorboard and --metrics; with --logdir
and --metrics, checks an earlier run.
Needs tensorboard (a virtual environment with tensorboard from PyPI); exits 77
when it cannot be imported.
Usage: python tests/tensorboard_reader_check.py --strata BUILD/tools/strata [--steps N]
       python tests/tensorboard_reader_check.py --logdir DIR --metrics FILE.jsonl
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile


def expected_scalars(metrics_path):
    """{tag: {step: value or None}} from the metrics file, as strata's monitors write them."""
    scalars = {}
    for line in open(metrics_path):
        m = json.loads(line)
        step = m["sequence_offset"]
        seconds = m["step_time_s"]
        values = {"train_loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                  "tokens_per_s": m["tokens_per_s"], "step_time_s": seconds,
                  "nvme_gb_per_s": (m["nvme_read_bytes"] + m["nvme_written_bytes"]) / seconds / 1e9
                  if seconds > 0 else 0.0}
        if "eval_loss" in m:
            values["eval_loss"] = m["eval_loss"]
        if "loss_scale" in m:
            values["loss_scale"] = m["loss_scale"]
        for name, value in values.items():
            scalars.setdefault("Train/Samples/" + name, {})[step] = value
    return scalars


def float32(value):
    return struct.unpack("<f", struct.pack("<f", value))[0]


def check(logdir, metrics_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(logdir, size_guidance={"scalars": 0})  # keep every value
    accumulator.Reload()
    expected = expected_scalars(metrics_path)
    tags = sorted(accumulator.Tags()["scalars"])
    failures = []
    if tags != sorted(expected):
        failures.append(f"tags {tags}, the metrics make {sorted(expected)}")
    compared = 0
    for tag in sorted(expected):
        if tag not in tags:
            continue
        got = {event.step: event.value for event in accumulator.Scalars(tag)}
        if sorted(got) != sorted(expected[tag]):
            failures.append(f"{tag}: steps {sorted(got)}, the metrics make {sorted(expected[tag])}")
            continue
        for step, want in expected[tag].items():
            value = got[step]
            ok = not math.isfinite(value) if want is None else value == float32(want)
            if not ok:
                failures.append(f"{tag} at step {step}: {value!r}, the metrics say {want!r}")
            compared += 1
    steps = len(next(iter(expected.values()))) if expected else 0
    for failure in failures:
        print("FAIL", failure)
    if not failures:
        print(f"tensorboard's EventAccumulator read {compared} scalars ({len(tags)} tags over "
              f"{steps} steps) from {logdir}; each equals the metrics' value as float32")
    return 1 if failures else 0


def run_strata(strata, steps, scratch):
    data = os.path.join(scratch, "data")
    subprocess.run([strata, "demo-data", "--out", data, "--tokens", "200000", "--val-tokens", "20000"],
                   check=True, stdout=subprocess.DEVNULL)
    logdir, metrics = os.path.join(scratch, "tb"), os.path.join(scratch, "m.jsonl")
    subprocess.run([strata, "train", "--model", "tiny", "--backend", "cpu", "--seq-len", "32",
                    "--micro-batch", "2", "--precision", "fp16", "--zero-stage", "3",
                    "--offload-param", "nvme", "--offload-optimizer", "nvme",
                    "--nvme-path", os.path.join(scratch, "swap"),
                    "--data", os.path.join(data, "train.bin"),
                    "--eval-data", os.path.join(data, "val.bin"), "--eval-every", "3",
                    "--eval-batches", "2", "--steps", str(steps),
                    "--tensorboard", logdir, "--metrics", metrics],
                   check=True, stdout=subprocess.DEVNULL)
    print(f"strata train: {steps} steps, fp16, NVMe offload, eval every 3 steps")
    return logdir, metrics


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strata", help="the strata command: run a short training first")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--logdir", help="a --tensorboard directory of an earlier run")
    parser.add_argument("--metrics", help="that run's --metrics file")
    args = parser.parse_args()
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        print("tensorboard is not installed (pip install tensorboard); skipped")
        return 77
    print(f"tensorboard {tensorboard.__version__}")
    if args.strata:
        with tempfile.TemporaryDirectory() as scratch:
            return check(*run_strata(args.strata, args.steps, scratch))
    if not (args.logdir and args.metrics):
        parser.error("give --strata, or --logdir and --metrics")
    return check(args.logdir, args.metrics)


if __name__ == "__main__":
    sys.exit(main())
