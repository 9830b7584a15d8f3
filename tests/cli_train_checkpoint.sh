#!/usr/bin/env bash
# Checkpoints through the command line: --save / --resume give the straight
# run's weights bitwise (same world size, other offload) or within fp32
# tolerance (other world size); SIGTERM saves and exits 143; a run killed
# with SIGKILL at random moments, resumed each time from its newest
# checkpoint, ends where an uninterrupted run ends, and the swap files of the
# killed runs are removed; a damaged checkpoint is refused in one line;
# `strata export` writes what `--init` reads back.
# Usage: cli_train_checkpoint.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$strata" demo-data --out "$dir/data" --tokens 100000 --val-tokens 2000 >/dev/null

# Adam eps 1e-6: damps near-zero gradients, whose sign fp32 summation order
# decides, so the resharded run is compared on the engine's arithmetic.
echo '{"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}' >"$dir/adam.json"
base=(--model tiny --backend cpu --seq-len 32 --lr 3e-3 --config "$dir/adam.json" --data "$dir/data/train.bin"
      --nvme-path "$dir/swap")
common=("${base[@]}" --micro-batch 2 --grad-accum 2)
nvme=(--zero-stage 3 --offload-param nvme --offload-optimizer nvme)
steps=8

"$strata" train "${common[@]}" "${nvme[@]}" --steps $steps --export "$dir/straight.safetensors" \
  >"$dir/out" 2>"$dir/err"
check "straight run" $?

# Stop after 3, resume to 8 with other offload settings, same world size.
"$strata" train "${common[@]}" "${nvme[@]}" --steps 3 --save "$dir/ck" >"$dir/out" 2>"$dir/err"
check "save at the end of a run" $?
grep -q "saved checkpoint $dir/ck/step-3" "$dir/out"; check "the checkpoint is named" $?
[ -f "$dir/ck/step-3/manifest.json" ]; check "step-3 has a manifest" $?
"$strata" train "${common[@]}" --zero-stage 1 --offload-optimizer cpu --steps $steps --resume "$dir/ck" \
  --export "$dir/resumed.safetensors" >"$dir/out" 2>"$dir/err"
check "resume with stage 1, optimizer on cpu" $?
grep -q "resuming $dir/ck/step-3" "$dir/out"; check "resume names the checkpoint" $?
cmp -s "$dir/straight.safetensors" "$dir/resumed.safetensors"
check "resumed weights equal the straight run's bitwise" $?

# Another world size: within fp32 tolerance (same global batch of 4 sequences).
"$strata" train "${base[@]}" --micro-batch 1 --grad-accum 2 --world-size 2 --steps $steps --resume "$dir/ck/step-3" \
  --export "$dir/two.safetensors" >"$dir/out" 2>"$dir/err"
check "resume with 2 ranks" $?
python3 - "$dir/straight.safetensors" "$dir/two.safetensors" <<'PY'
import json, math, struct, sys
def load(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        out[name] = struct.unpack(f"<{(e - b) // 4}f", data[8 + n + b:8 + n + e])
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
worst = 0.0
for name in a:
    diff = math.sqrt(sum((x - y) ** 2 for x, y in zip(a[name], b[name])))
    norm = math.sqrt(sum(y * y for y in b[name]))
    worst = max(worst, diff / max(norm, 1e-30))
print(f"  worst per-tensor relative error after resharding: {worst:.2e}")
sys.exit(0 if worst < 1e-5 else 1)
PY
check "resharded run within fp32 tolerance" $?

# SIGTERM: the step under way finishes, a checkpoint is saved, exit 143.
"$strata" train "${common[@]}" "${nvme[@]}" --steps 100000 --save "$dir/term" --metrics "$dir/term.jsonl" \
  >"$dir/out" 2>"$dir/err" &
pid=$!
for _ in $(seq 1 200); do [ -s "$dir/term.jsonl" ] && break; sleep 0.1; done
kill -TERM $pid
wait $pid
status=$?
[ $status -eq 143 ]; check "SIGTERM exits 143 (got $status)" $?
grep -q "stopped by SIGTERM after step" "$dir/out"; check "SIGTERM is reported" $?
ls "$dir/term" | grep -q "^step-"; check "SIGTERM saved a checkpoint" $?
[ -z "$(ls "$dir/swap" 2>/dev/null | grep '\.swap$')" ]; check "no swap file left after SIGTERM" $?

# SIGKILL at random moments (also while a checkpoint is being written: one
# is saved after every step), resuming from the newest checkpoint each time.
# Long enough (about 7 s uninterrupted here) that several kills land before
# the last run finishes.
long=400
"$strata" train "${common[@]}" "${nvme[@]}" --steps $long --export "$dir/long.safetensors" >/dev/null 2>&1
rm -rf "$dir/kill"
kills=0
for attempt in $(seq 1 40); do
  latest=$(ls -d "$dir/kill"/step-* 2>/dev/null | sed 's/.*step-//' | sort -n | tail -1)
  [ "${latest:-0}" -ge $long ] && break
  resume=()
  [ -n "$latest" ] && resume=(--resume "$dir/kill")
  "$strata" train "${common[@]}" "${nvme[@]}" --steps $long --save "$dir/kill" --save-every 1 --keep 2 \
    "${resume[@]}" >"$dir/kill.out" 2>"$dir/kill.err" &
  pid=$!
  # 0.1 to 1.2 s: on a loaded machine a run may need most of that to start.
  sleep "$((RANDOM % 2)).$((RANDOM % 10 + 1))"
  if kill -KILL $pid 2>/dev/null; then kills=$((kills + 1)); fi
  wait $pid 2>/dev/null
done
echo "  killed $kills runs"
[ $kills -ge 3 ]; check "several runs were killed" $?
# Resume from the newest checkpoint (none when every run was killed before its first save).
resume=()
ls -d "$dir/kill"/step-* >/dev/null 2>&1 && resume=(--resume "$dir/kill")
"$strata" train "${common[@]}" "${nvme[@]}" --steps $long "${resume[@]}" --save "$dir/kill" \
  --export "$dir/killed.safetensors" >"$dir/out" 2>"$dir/err"
check "the last resume succeeds" $?
cmp -s "$dir/long.safetensors" "$dir/killed.safetensors"
check "after the kills the weights equal the uninterrupted run's" $?
[ -z "$(ls "$dir/swap" | grep '\.swap$')" ]; check "the killed runs' swap files are gone" $?
[ -z "$(ls -A "$dir/kill" | grep '^\.tmp')" ]; check "no unfinished checkpoint is left" $?

# A damaged checkpoint is refused in one line, naming the file.
cp -r "$dir/ck/step-3" "$dir/bad"
printf '\xff' | dd of="$dir/bad/m.bin" bs=1 seek=100 conv=notrunc status=none
err=$("$strata" train "${common[@]}" --steps $steps --resume "$dir/bad" 2>&1 >/dev/null)
status=$?
[ $status -ne 0 ] && grep -q "m.bin: CRC32C" <<<"$err"; check "a flipped byte is detected" $?
[ "$(echo "$err" | wc -l)" -eq 1 ]; check "the refusal is one line" $?
err=$("$strata" train "${common[@]}" --steps $steps --resume "$dir/nothing-here" 2>&1 >/dev/null)
grep -q "no such directory" <<<"$err"; check "a missing --resume directory is named" $?

# strata export: a Hugging Face directory that --init reads back.
"$strata" export "$dir/ck" --out "$dir/hf" >"$dir/out" 2>"$dir/err"
check "strata export exits 0" $?
[ -f "$dir/hf/config.json" ] && [ -f "$dir/hf/model.safetensors" ]; check "config.json and safetensors written" $?
"$strata" train "${common[@]}" "${nvme[@]}" --steps 3 --export "$dir/three.safetensors" >/dev/null 2>&1
"$strata" train "${common[@]}" --steps 0 --init "$dir/hf" --export "$dir/roundtrip.safetensors" >/dev/null 2>&1
cmp -s "$dir/three.safetensors" "$dir/roundtrip.safetensors"
check "export then --init gives the checkpoint's weights" $?
"$strata" export "$dir/ck" --out "$dir/hf16" --dtype bf16 --max-shard-size 64K >/dev/null 2>&1
[ -f "$dir/hf16/model.safetensors.index.json" ]; check "sharded bf16 export has an index" $?

finish_checks
