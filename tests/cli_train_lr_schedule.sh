#!/usr/bin/env bash
# `strata train --lr-schedule constant|warmup|linear|cosine` with --warmup-steps,
# --warmup-type and --min-lr-ratio: the learning rate of every step (--metrics)
# is DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR, computed here
# from DeepSpeed's definitions; flags override the config file key by key;
# bad values and schedules that cannot run are one line on stderr, exit 2.
# Usage: cli_train_lr_schedule.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$strata" demo-data --out "$work/demo" --tokens 20000 >/dev/null 2>&1
check "demo data written" $?

steps=12
# run NAME FLAGS...: a short run of the tiny preset writing $work/NAME.jsonl.
run() {
  local name="$1"
  shift
  "$strata" train --model tiny --backend cpu --data "$work/demo/train.bin" --seq-len 32 \
    --micro-batch 2 --steps "$steps" --metrics "$work/$name.jsonl" "$@" \
    >"$work/$name.out" 2>&1
  check "$name: trains ($*)" $?
}

# expect_lr NAME SCHEDULE LR WARMUP WARMUP_TYPE MIN_RATIO [TOTAL]: every step's
# lr in NAME.jsonl is DeepSpeed's, where the k-th step runs at the rate after
# k - 2 scheduler steps (the scheduler steps after each optimizer step).
expect_lr() {
  python3 - "$work/$1.jsonl" "${@:2}" "$steps" <<'PY'
import json, math, sys
path, schedule, lr, warmup, warmup_type, min_ratio = sys.argv[1:7]
lr, warmup, min_ratio = float(lr), int(warmup), float(min_ratio)
total = int(sys.argv[7])  # the file's total_num_steps when given, else --steps (the last argument)
W = max(2, warmup)

def warm(i):  # 0 -> 1 over the warm-up
    return math.log(i + 1) / math.log(W) if warmup_type == "log" else i / W

def rate(i):
    if schedule == "constant":
        return lr
    if schedule in ("warmup", "linear"):  # WarmupLR, WarmupDecayLR: min_lr + (max_lr - min_lr) * gamma
        lo = min_ratio * lr if schedule == "linear" else 0.0
        if i < 0:
            return lo
        if i < W:
            gamma = warm(i)
        elif schedule == "linear":
            gamma = max(0.0, (total - i) / max(1.0, total - W))
        else:
            gamma = 1.0
        return lo + (lr - lo) * gamma
    # WarmupCosineLR: lr * ratio, warmup_min_ratio 0.
    if i < 0:
        return 0.0
    if i < W:
        return lr * warm(i)
    progress = min(1.0, (i - W + 1) / max(1, total - W))
    return lr * max(0.0, min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

rows = [json.loads(line) for line in open(path)]
assert len(rows) == int(sys.argv[-1]), f"{len(rows)} steps in {path}"
for row in rows:
    want = rate(row["step"] - 2)
    if abs(row["lr"] - want) > 1e-12 * max(lr, 1e-30):
        sys.exit(f"step {row['step']}: lr {row['lr']!r}, expected {want!r}")
print(" ".join(f"{row['lr']:.3e}" for row in rows))
PY
}

run constant --lr 0.01
expect_lr constant constant 0.01 1 log 0
check "constant: every step at --lr" $?
run warmup --lr-schedule warmup --warmup-steps 5 --lr 0.01
expect_lr warmup warmup 0.01 5 log 0
check "warmup: WarmupLR, log warm-up from 0 to --lr over 5 steps, then --lr" $?
run linear --lr-schedule linear --warmup-steps 4 --warmup-type linear --min-lr-ratio 0.2 --lr 0.01
expect_lr linear linear 0.01 4 linear 0.2
check "linear: WarmupDecayLR from 0.2 x --lr up to --lr and down to it at --steps" $?
run cosine --lr-schedule cosine --warmup-steps 3 --min-lr-ratio 0.1 --lr 0.01
expect_lr cosine cosine 0.01 3 log 0.1
check "cosine: WarmupCosineLR to 0.1 x --lr over --steps" $?
run cosine_default --lr-schedule cosine --warmup-steps 2 --warmup-type linear --lr 0.02
expect_lr cosine_default cosine 0.02 2 linear 0.0001
check "cosine without --min-lr-ratio: DeepSpeed's cos_min_ratio 1e-4" $?
# The schedules differ from each other where they should (the checks above cannot all pass on one rate).
[ "$(sed -n 10p "$work/linear.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["lr"])')" != \
  "$(sed -n 10p "$work/cosine.jsonl" | python3 -c 'import json,sys; print(json.load(sys.stdin)["lr"])')" ]
check "linear and cosine differ at step 10" $?

# Flags override the file's scheduler key by key: its cos_min_ratio stays, the warm-up is the flag's.
cat >"$work/ds.json" <<'JSON'
{"optimizer": {"type": "AdamW", "params": {"lr": 0.005}},
 "scheduler": {"type": "WarmupCosineLR",
               "params": {"warmup_num_steps": 6, "warmup_type": "linear", "cos_min_ratio": 0.5}}}
JSON
run file_cosine --config "$work/ds.json" --warmup-steps 3
expect_lr file_cosine cosine 0.005 3 linear 0.5
check "--warmup-steps over the file's WarmupCosineLR, its other keys kept" $?
run file_constant --config "$work/ds.json" --lr-schedule constant
expect_lr file_constant constant 0.005 1 log 0
check "--lr-schedule constant turns the file's schedule off" $?
# A type the file does not have peaks at the optimizer's lr (not WarmupDecayLR's default 1e-3).
run file_linear --config "$work/ds.json" --lr-schedule linear --warmup-steps 3 --min-lr-ratio 0.5
expect_lr file_linear linear 0.005 3 linear 0.5
check "--lr-schedule linear over the file's cosine: peaks at its lr, keeps its warmup_type" $?
# A file's total_num_steps is kept over --steps.
cat >"$work/total.json" <<'JSON'
{"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 8}}}
JSON
run file_total --config "$work/total.json" --lr 0.01 --warmup-steps 2 --warmup-type linear
expect_lr file_total linear 0.01 2 linear 0 8
check "the file's total_num_steps over --steps, --lr the peak" $?

# expect_error NAMED ARGS...: `strata train ARGS...` fails in one line naming NAMED, exit 2.
expect_error() {
  local named="$1"
  shift
  "$strata" train --model tiny --backend cpu --data "$work/demo/train.bin" --seq-len 32 "$@" \
    >"$work/out" 2>"$work/err"
  local status=$?
  [ $status -eq 2 ] && [ "$(wc -l <"$work/err")" -eq 1 ] && grep -qF -- "$named" "$work/err" &&
    [[ "$(cat "$work/err")" == "strata train: "* ]]
  check "$* -> exit 2, one line naming '$named' (got $status: $(cat "$work/err"))" $?
}
expect_error "--lr-schedule: expected constant, warmup, linear or cosine" --lr-schedule step
expect_error "--warmup-steps: expected a number of steps >= 1" --lr-schedule cosine --warmup-steps -5
expect_error "--warmup-steps: expected a number of steps >= 1" --lr-schedule warmup --warmup-steps 0
expect_error "--warmup-type: expected log or linear" --lr-schedule cosine --warmup-type exp
expect_error "--min-lr-ratio: expected a fraction of the peak lr in [0, 1], got 1.5" \
  --lr-schedule cosine --warmup-steps 2 --min-lr-ratio 1.5
expect_error "--min-lr-ratio: expected a fraction" --lr-schedule linear --warmup-steps 2 --min-lr-ratio -0.1
expect_error "--min-lr-ratio: WarmupLR (--lr-schedule warmup) does not decay" \
  --lr-schedule warmup --min-lr-ratio 0.1
expect_error "--min-lr-ratio: a constant learning rate does not decay" --min-lr-ratio 0.1
expect_error "--warmup-steps: the learning rate is constant" --warmup-steps 10
expect_error "--warmup-type: the learning rate is constant" --lr-schedule constant --warmup-type linear
expect_error "--lr-schedule cosine decays over --steps, and --steps 0 runs no step" \
  --lr-schedule cosine --warmup-steps 2 --steps 0
expect_error "--lr-schedule linear: the warm-up of 1000 steps (DeepSpeed's default) leaves no step of --steps 100" \
  --lr-schedule linear --steps 100
expect_error "give --warmup-steps below 20" --lr-schedule cosine --warmup-steps 20 --steps 20
expect_error "--warmup-steps = ten" --lr-schedule cosine --warmup-steps ten

# --print-config shows the DeepSpeed section the flags make.
sched=$("$strata" train --lr-schedule linear --warmup-steps 7 --min-lr-ratio 0.1 --lr 0.002 \
  --print-config | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)["scheduler"], sort_keys=True))')
[ "$sched" = '{"params": {"total_num_steps": 0, "warmup_max_lr": 0.002, "warmup_min_lr": 0.0002, "warmup_num_steps": 7, "warmup_type": "log"}, "type": "WarmupDecayLR"}' ]
check "--print-config: the scheduler section the flags made ($sched)" $?

help=$("$strata" train --help)
grep -q -- "--lr-schedule.*WarmupCosineLR" <<<"$help" && grep -q -- "--min-lr-ratio" <<<"$help"
check "train --help lists the schedule flags" $?

finish_checks
