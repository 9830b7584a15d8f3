#!/usr/bin/env bash
# `strata train --shuffle`: the order shows in --print-config and the run's
# header; it is not the file's order; every split of the same global batch
# (micro-batch, accumulation, ranks as threads) reads the same sequences, so
# the losses agree within fp32 rounding, far closer than another order comes;
# ranks as processes give the threads' run bitwise; a run saved inside its
# second pass over the data and resumed gives the straight run's losses and
# weights bitwise; the loss mask follows the order; a resume in another order
# is refused in one line.
# Usage: cli_train_shuffle.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
json_get() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$strata" demo-data --out "$dir/data" --tokens 100000 --val-tokens 2000 >/dev/null
# 40 sequences of 32 tokens (uint16): 4 sequences a step make a pass every 10 steps.
head -c $((2 * (40 * 32 + 1))) "$dir/data/train.bin" >"$dir/small.bin"
# Adam eps 1e-6: damps near-zero gradients, whose sign fp32 summation order
# decides, so runs that split the batch differently are compared on the data.
echo '{"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}' >"$dir/adam.json"
base=(--model tiny --backend cpu --seq-len 32 --lr 3e-3 --config "$dir/adam.json" --data "$dir/small.bin"
      --nvme-path "$dir/swap")
steps=24
# A fresh shuffle seed each run (the demo data are the same every time).
seed=${STRATA_TEST_SEED:-$(( (RANDOM << 15 | RANDOM) + 1 ))}  # STRATA_TEST_SEED reruns a seed
other_seed=$((seed + 1))
echo "shuffle seed $seed"
losses() { python3 -c 'import json,sys; print(" ".join(repr(json.loads(l)["loss"]) for l in open(sys.argv[1])))' "$1"; }
# The largest relative difference between two runs' losses, step by step.
loss_gap() {
  python3 - "$1" "$2" <<'PY'
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:3])
assert len(a) == len(b) and a, (len(a), len(b))
print(max(abs(x - y) / abs(y) for x, y in zip(a, b)))
PY
}
below() { python3 -c "import sys; sys.exit(0 if float(sys.argv[1]) < float(sys.argv[2]) else 1)" "$1" "$2"; }

# The configuration: the flag, its seed (default --seed), the file's key and --no-shuffle.
out=$("$strata" train "${base[@]}" --shuffle --seed 5 --print-config 2>/dev/null)
[ "$(echo "$out" | json_get 'd["strata"]["shuffle"], d["strata"]["shuffle_seed"]')" = "True 5" ]
check "--shuffle takes --seed as its seed in --print-config" $?
out=$("$strata" train "${base[@]}" --shuffle --shuffle-seed 9 --print-config 2>/dev/null)
[ "$(echo "$out" | json_get 'd["strata"]["shuffle_seed"]')" = "9" ]; check "--shuffle-seed sets it" $?
echo '{"strata": {"shuffle": true, "shuffle_seed": 3}}' >"$dir/shuffle.json"
out=$("$strata" train --model tiny --config "$dir/shuffle.json" --print-config 2>"$dir/err")
[ "$(echo "$out" | json_get 'd["strata"]["shuffle"], d["strata"]["shuffle_seed"]')" = "True 3" ]
check "strata.shuffle and strata.shuffle_seed read from the file" $?
[ ! -s "$dir/err" ]; check "no warning for the file's keys" $?
out=$("$strata" train --model tiny --config "$dir/shuffle.json" --no-shuffle --print-config 2>/dev/null)
[ "$(echo "$out" | json_get 'd["strata"]["shuffle"]')" = "False" ]; check "--no-shuffle overrides the file" $?
"$strata" train "${base[@]}" --shuffle-seed 9 --print-config >/dev/null 2>"$dir/err"
grep -q "shuffle-seed 9 has no effect" "$dir/err"; check "a seed without --shuffle is a warning" $?

# The straight run, shuffled, and the same run in the file's order or with another seed.
split() { "$strata" train "${base[@]}" --shuffle --shuffle-seed $seed "$@"; }
split --steps $steps --micro-batch 2 --grad-accum 2 --metrics "$dir/straight.jsonl" --export "$dir/straight.safetensors" \
  >"$dir/out" 2>"$dir/err"
check "shuffled run" $?
grep -q "^data: 40 sequences, shuffled with seed $seed, a new order every pass" "$dir/out"
check "the header names the order and its seed" $?
"$strata" train "${base[@]}" --steps $steps --micro-batch 2 --grad-accum 2 --metrics "$dir/sequential.jsonl" \
  >/dev/null 2>&1
"$strata" train "${base[@]}" --steps $steps --micro-batch 2 --grad-accum 2 --shuffle --shuffle-seed $other_seed \
  --metrics "$dir/reseeded.jsonl" >/dev/null 2>&1
[ "$(losses "$dir/straight.jsonl" | cut -d' ' -f1)" != "$(losses "$dir/sequential.jsonl" | cut -d' ' -f1)" ]
check "the first step reads other sequences than the file's order" $?
other=$(loss_gap "$dir/straight.jsonl" "$dir/sequential.jsonl")
reseeded=$(loss_gap "$dir/straight.jsonl" "$dir/reseeded.jsonl")
echo "  losses against the file's order: up to $other apart; against seed $other_seed: up to $reseeded"

# Other splits of the same global batch of 4 sequences.
split --steps $steps --micro-batch 4 --grad-accum 1 --metrics "$dir/wide.jsonl" >/dev/null 2>&1
check "micro-batch 4" $?
split --steps $steps --micro-batch 1 --grad-accum 2 --world-size 2 --metrics "$dir/two.jsonl" >/dev/null 2>&1
check "2 ranks as threads" $?
split --steps $steps --micro-batch 1 --grad-accum 1 --world-size 4 --zero-stage 3 --metrics "$dir/four.jsonl" >/dev/null 2>&1
check "4 ranks, stage 3" $?
for run in wide two four; do
  gap=$(loss_gap "$dir/$run.jsonl" "$dir/straight.jsonl")
  echo "  $run: losses within $gap of the straight run's"
  # Other splits round differently, and training amplifies that over the steps
  # (seen here: 2e-8 to 1e-4, depending on the seed); another order is 100x further.
  below "$gap" 1e-3 && below "$gap" "$(python3 -c "print($other / 100)")"
  check "$run reads the straight run's sequences (losses within 1e-3, 100x closer than another order)" $?
done

# Ranks as processes: each process draws the same order as the threads.
timeout 300 "$strata" launch -n 2 -- "$strata" train "${base[@]}" --steps $steps --shuffle --shuffle-seed $seed \
  --micro-batch 1 --grad-accum 2 --nvme-path "$dir/swap-p" --metrics "$dir/procs.jsonl" >/dev/null 2>&1
check "2 ranks as processes" $?
[ -n "$(losses "$dir/two.jsonl")" ] && [ "$(losses "$dir/procs.jsonl")" = "$(losses "$dir/two.jsonl")" ]
check "processes give the threads' losses bitwise" $?

# Saved at step 13, inside the second pass, and resumed to the end.
split --micro-batch 2 --grad-accum 2 --steps 13 --save "$dir/ck" >/dev/null 2>&1
check "save at step 13" $?
[ "$(json_get 'd["data_order"]["shuffle"], d["data_order"]["shuffle_seed"], d["sequence_offset"]' \
     <"$dir/ck/step-13/state.json")" = "True $seed 52" ]
check "the checkpoint records the order, its seed and the offset" $?
split --steps $steps --micro-batch 2 --grad-accum 2 --resume "$dir/ck" --metrics "$dir/resumed.jsonl" \
  --export "$dir/resumed.safetensors" >/dev/null 2>&1
check "resume" $?
[ "$(losses "$dir/resumed.jsonl")" = "$(losses "$dir/straight.jsonl" | cut -d' ' -f14-)" ]
check "the resumed steps are the straight run's, bitwise" $?
cmp -s "$dir/straight.safetensors" "$dir/resumed.safetensors"
check "the resumed weights are the straight run's, bitwise" $?

# The loss mask follows the shuffled order: random tokens and mask bytes, and
# each step counts the targets the mask keeps in the sequences that the
# order, computed here from its definition (core/data/sequence_order.h), reads.
cat >"$dir/order.py" <<'PY'
import json, random, struct, sys
M = (1 << 64) - 1
def mix(z):  # splitmix64's output function
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M
    return z ^ (z >> 31)
def output(state, n):
    return mix((state + (n + 1) * 0x9e3779b97f4a7c15) & M)
def shuffled(seed, e, index, n):  # swap-or-not, 90 rounds
    if n <= 1:
        return 0
    key, x = output(mix(seed), e), index
    for r in range(90):
        pivot = (output(key, 2 * r) * n) >> 64
        partner = (pivot - x) % n
        if mix(output(key, 2 * r + 1) ^ max(x, partner)) >> 63:
            x = partner
    return x
mode, path = sys.argv[1], sys.argv[2]
T, S, per_step = 32, 40, 4
if mode == "write":
    rng = random.Random(int(sys.argv[3]))
    tokens = [rng.randrange(256) for _ in range(S * T + 1)]
    open(path + ".bin", "wb").write(struct.pack(f"<{len(tokens)}H", *tokens))
    open(path + ".mask", "wb").write(bytes(rng.randrange(2) for _ in tokens))
else:  # expected loss_tokens of each step, for shuffle seed argv[3] ("-": the file's order)
    mask, steps = open(path + ".mask", "rb").read(), int(sys.argv[4])
    kept = [sum(mask[j * T + 1:j * T + T + 1]) for j in range(S)]
    order = (lambda i: i % S) if sys.argv[3] == "-" else (lambda i: shuffled(int(sys.argv[3]), i // S, i % S, S))
    print(" ".join(str(sum(kept[order(i)] for i in range(s * per_step, (s + 1) * per_step))) for s in range(steps)))
PY
counted() { python3 -c 'import json,sys; print(" ".join(str(json.loads(l)["loss_tokens"]) for l in open(sys.argv[1])))' "$1"; }
python3 "$dir/order.py" write "$dir/masked" "$seed"
masked=(--model tiny --backend cpu --seq-len 32 --data "$dir/masked.bin" --loss-mask "$dir/masked.mask"
        --grad-accum 2 --steps 25)
"$strata" train "${masked[@]}" --micro-batch 2 --metrics "$dir/masked-seq.jsonl" >/dev/null 2>&1
[ "$(counted "$dir/masked-seq.jsonl")" = "$(python3 "$dir/order.py" count "$dir/masked" - 25)" ]
check "in the file's order, each step counts the mask's targets of its sequences" $?
"$strata" train "${masked[@]}" --shuffle --shuffle-seed $seed --world-size 2 --micro-batch 1 \
  --metrics "$dir/masked-shuffled.jsonl" >/dev/null 2>&1
[ "$(counted "$dir/masked-shuffled.jsonl")" = "$(python3 "$dir/order.py" count "$dir/masked" $seed 25)" ]
check "shuffled, each step counts the mask's targets of the sequences the order names" $?

# A resume in another order is refused in one line that says what to pass.
err=$("$strata" train "${base[@]}" --steps $steps --micro-batch 2 --grad-accum 2 --shuffle \
  --shuffle-seed $other_seed --resume "$dir/ck" 2>&1 >/dev/null)
status=$?
[ $status -ne 0 ] && grep -q "shuffled with seed $seed but this run reads them shuffled with seed $other_seed; pass --shuffle --shuffle-seed $seed" <<<"$err"
check "another seed is refused, naming the checkpoint's" $?
[ "$(echo "$err" | wc -l)" -eq 1 ]; check "the refusal is one line" $?
err=$("$strata" train "${base[@]}" --steps $steps --micro-batch 2 --grad-accum 2 --resume "$dir/ck" 2>&1 >/dev/null)
grep -q "in sequential order; pass --shuffle --shuffle-seed $seed" <<<"$err"
check "resuming without --shuffle is refused" $?

finish_checks
