#!/usr/bin/env bash
# The step-time model on the command line: `strata plan --hardware PRESET`
# prints a prediction (and --json's `prediction`), --timeline writes a trace
# in the form of `strata train --trace`, --tune prints the fastest plans with
# their flags and DeepSpeed config, --probe writes a profile that --hardware
# reads back, a bad preset or profile is one line naming it and the key, and
# `strata train --hardware FILE` reports the prediction beside the
# measurement in its summary and its metrics; a mixture read as routed is
# predicted for an even routing too. No timing is checked.
# Usage: cli_step_model.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export XDG_CACHE_HOME="$dir/cache"  # this test's probes stay in it

plan=(plan --model small --backend cpu --seq-len 64 --micro-batch 2 --zero-stage 3
      --offload-param cpu --offload-optimizer cpu)

"$strata" "${plan[@]}" --probe --probe-out "$dir/profile.json" >"$dir/out" 2>"$dir/err"
check "--probe exits 0" $?
grep -q "probe: units at B=2 T=64" "$dir/err" && grep -q "probe: wrote $dir/profile.json" "$dir/err"
check "--probe says what it measured and where it wrote the profile" $?
grep -q "^predicted on probe of " "$dir/out"
check "--probe predicts with the profile it made" $?

# With an NVMe path the probe measures the drive three ways: reads, writes,
# and both at once (the streamed optimizer's pattern), each a rate above 0.
mkdir -p "$dir/swap"
"$strata" plan --model small --backend cpu --seq-len 64 --micro-batch 2 --zero-stage 3 \
  --offload-param nvme --offload-optimizer nvme --nvme-path "$dir/swap" --probe \
  --probe-out "$dir/nvme-profile.json" >"$dir/out" 2>"$dir/err"
[ $? -eq 0 ] && grep -q "probe: NVMe under $dir/swap: read .* GB/s, write .* GB/s, both at once .* GB/s" \
  "$dir/err"
check "--probe with --nvme-path measures reads, writes and both at once" $?
python3 - "$dir/nvme-profile.json" <<'PY'
import json, sys
drives = json.load(open(sys.argv[1]))["nvme"]
assert len(drives) == 1 and all(drives[0][k] > 0 for k in ("read_gbps", "write_gbps", "mixed_gbps")), drives
PY
check "the probed profile holds the drive's read, write and mixed rates" $?

"$strata" "${plan[@]}" --hardware "$dir/profile.json" --json >"$dir/plan.json" 2>"$dir/err"
python3 - "$dir/plan.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))["prediction"]
assert p["step_seconds"] > 0 and p["first_step_seconds"] > 0, p
assert set(p["lane_busy_seconds"]) == {"io", "comm", "compute", "optimizer", "activations"}, p
assert p["bound_lane"] in p["lane_busy_seconds"], p
PY
check "--json holds the prediction: step times, lanes, what bounds it" $?

"$strata" "${plan[@]}" --hardware "$dir/profile.json" --timeline "$dir/timeline.json" >/dev/null 2>&1
python3 - "$dir/timeline.json" <<'PY'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
ops = [e for e in events if e["ph"] == "X"]
assert ops and all(e["dur"] >= 0 and "step" in e["args"] for e in ops), ops[:3]
assert {e["args"]["step"] for e in ops} == {0, 1, 2, 3}
assert any(e["ph"] == "M" and e["args"].get("name") == "compute" for e in events)
PY
check "--timeline writes the simulated steps as a trace" $?

"$strata" "${plan[@]}" --grad-accum 2 --hardware "$dir/profile.json" --tune >"$dir/tune" 2>&1
check "--tune exits 0" $?
[ "$(grep -c '^   strata train --micro-batch' "$dir/tune")" = 5 ] &&
  [ "$(grep -c '^   DeepSpeed config: {' "$dir/tune")" = 5 ] && grep -q "configurations tried" "$dir/tune"
check "--tune prints the five fastest, each with flags and a DeepSpeed config" $?
python3 - "$dir/tune" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    if line.startswith("   DeepSpeed config: "):
        c = json.loads(line[len("   DeepSpeed config: "):])
        assert c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] == 4, c
PY
check "--tune keeps the tokens per step (micro-batch x accumulation = 4)" $?
"$strata" "${plan[@]}" --grad-accum 2 --hardware "$dir/profile.json" --tune --json >"$dir/tune.json" 2>&1
python3 - "$dir/tune.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
c = t["candidates"]
assert len(c) == 5 and t["fitting"] >= 5 and t["tried"] >= t["fitting"] and t["given_step_seconds"] > 0, t
steps = [x["prediction"]["step_seconds"] for x in c]
assert steps == sorted(steps) and all(x["flags"].startswith("--micro-batch") for x in c), steps
assert all(x["deepspeed_config"]["train_micro_batch_size_per_gpu"] *
           x["deepspeed_config"]["gradient_accumulation_steps"] == 4 for x in c)
PY
check "--tune --json: the five fastest in order, each with flags, DeepSpeed config and prediction" $?
python3 - "$dir/profile.json" <<'PY'
import json, sys
shares = json.load(open(sys.argv[1]))["cpu_units"]["rank_shares"]
assert len(shares) == 4 and shares[0] == 1 and all(0 < s <= 1 for s in shares), shares
PY
check "the probe measures each rank's share with 1-4 ranks computing at once" $?

if "$strata" --version | grep -q "CUDA backend: built"; then
  "$strata" plan --model llama3-8b --backend cuda --precision bf16 --zero-stage 3 \
    --offload-param nvme --offload-optimizer nvme --nvme-path "$dir" --nvme-limit 8T \
    --host-mem-limit 512G --seq-len 4096 --grad-accum 2 --hardware h100-sxm/gen5x2 >"$dir/out" 2>&1
  grep -q "predicted on h100-sxm with 2 Gen5 NVMe drives: .* MFU" "$dir/out" &&
    grep -q "SSD wear: .*rated TBW lasts" "$dir/out"
  check "a GPU preset predicts MFU and the drives' wear" $?
fi

refuse() {  # NAME PATTERN ARGS...
  local name="$1" pattern="$2"
  shift 2
  "$strata" "$@" >/dev/null 2>"$dir/err"
  local status=$?
  [ $status -eq 2 ] && grep -q -- "$pattern" "$dir/err" && [ "$(wc -l <"$dir/err")" -eq 1 ]
  local result=$?  # before the substitution below, which sets $? again
  check "$name (exit $status: $(head -c 160 "$dir/err"))" $result
}
refuse "an unknown preset names it and the presets" "h100: neither a preset (h100-sxm, h200" \
  "${plan[@]}" --hardware h100
refuse "a bad drive set names it" "gen3x1" "${plan[@]}" --hardware h100-sxm/gen3x1
printf '{"compute": {"matmul_tflops": {"fp32": 1}}, "netwrk": {}}' >"$dir/bad.json"
refuse "a profile with an unknown key names the file and key" "bad.json: netwrk" \
  "${plan[@]}" --hardware "$dir/bad.json"
printf '{"compute": {"matmul_tflops": {"fp32": "fast"}}}' >"$dir/bad2.json"
refuse "a value of the wrong type names the key" "compute.matmul_tflops.fp32" \
  "${plan[@]}" --hardware "$dir/bad2.json"
refuse "--tune without a profile" "--tune needs a hardware profile" "${plan[@]}" --tune
if "$strata" --version | grep -q "GPUs: none"; then
  refuse "--probe --backend cuda without a GPU says so and names the presets" \
    "--probe --backend cuda: .*--hardware PRESET predicts for a GPU" \
    plan --model small --backend cuda --zero-stage 0 --probe
fi

"$strata" demo-data --out "$dir/data" >/dev/null 2>&1
"$strata" train --model small --backend cpu --seq-len 64 --micro-batch 2 --steps 4 \
  --data "$dir/data/train.bin" --hardware "$dir/profile.json" --metrics "$dir/m.jsonl" >"$dir/out" 2>&1
check "train with --hardware exits 0" $?
grep -q "^step-time model ($dir/profile.json): predicted" "$dir/out" &&
  grep -q "^step time: measured .* (median after the first), predicted .* on probe of" "$dir/out"
check "train prints the prediction before the first step and beside the measurement at the end" $?
python3 - "$dir/m.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert len(lines) == 4 and all(l["predicted_step_time_s"] > 0 and l["predicted_by"] for l in lines)
PY
check "every metrics line holds the predicted step time and the profile" $?
# A mixture read as routed, its updates deferred, 8 tokens a micro-batch: the
# plan predicts its worst case and an even routing's step; the run predicts
# an even routing's and, at the end, its own routing's.
moe=(--model small-moe --backend cpu --seq-len 8 --micro-batch 1 --grad-accum 4 --zero-stage 3
     --offload-param nvme --offload-optimizer nvme --nvme-path "$dir/swap" --layer-pieces 2
     --expert-update deferred --hardware "$dir/profile.json")
"$strata" plan "${moe[@]}" >"$dir/out" 2>&1 &&
  grep -q "^predicted on probe of " "$dir/out" &&
  grep -q "^predicted with an even routing (each token's 2 experts drawn uniformly, 8 steps): .* per step on average (least .*, most .*), NVMe .* read and .* written per step; the prediction above is the worst case" "$dir/out"
check "plan predicts a routed mixture's worst case and an even routing's step" $?
"$strata" plan "${moe[@]}" --json >"$dir/moe.json" 2>"$dir/err"
python3 - "$dir/moe.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
even, worst = j["even_routing"], j["prediction"]
assert even["steps"] == 8 and 0 < even["predicted_seconds_per_step"]["mean"] <= worst["step_seconds"], (even, worst)
assert 0 < even["nvme_read_per_step"] and 0 < even["nvme_written_per_step"], even
PY
check "--json holds the even routing's prediction, within the worst case" $?
"$strata" train "${moe[@]}" --steps 4 --data "$dir/data/train.bin" >"$dir/out" 2>&1 &&
  grep -q "^step-time model ($dir/profile.json, an even routing's step): predicted" "$dir/out" &&
  grep -q "^  (that prediction is an even routing's; with this run's routing, step by step: .*, [-+][0-9.]*%)" "$dir/out"
check "train predicts a routed mixture's even routing, then its own routing's step" $?
"$strata" train --model small --backend cpu --seq-len 64 --micro-batch 2 --steps 1 \
  --data "$dir/data/train.bin" --hardware none >"$dir/out" 2>&1
! grep -q "step-time model" "$dir/out"
check "--hardware none predicts nothing" $?

# A cached probe an older strata wrote (or a damaged one) is only a default:
# plan warns and predicts nothing, train probes again and rewrites it.
cache="$XDG_CACHE_HOME/strata/hardware-$(hostname).json"
mkdir -p "$(dirname "$cache")"
printf '{"cpu_units": {"one_thread_share": 0.7}}' >"$cache"
"$strata" "${plan[@]}" >"$dir/out" 2>"$dir/err"
status=$?
[ $status -eq 0 ] && grep -q "warning: the cached probe is unusable (.*one_thread_share" "$dir/err" &&
  ! grep -q "^predicted on" "$dir/out"
check "plan with an unusable cached probe warns and predicts nothing (exit $status)" $?
"$strata" train --model small --backend cpu --seq-len 64 --micro-batch 2 --steps 2 \
  --data "$dir/data/train.bin" >"$dir/out" 2>&1
grep -q "^step-time model: the cached probe is unusable (.*); probing again" "$dir/out" &&
  grep -q "^step-time model ($cache): predicted" "$dir/out"
check "train with an unusable cached probe probes again and predicts" $?
"$strata" "${plan[@]}" >"$dir/out" 2>&1
grep -q "^predicted on probe of" "$dir/out"
check "the probe train wrote is the cache plan reads next" $?
"$strata" "${plan[@]}" --hardware none >"$dir/out" 2>&1
[ $? -eq 0 ] && grep -q "^(no step-time prediction" "$dir/out" && ! grep -q "^predicted on" "$dir/out"
check "plan --hardware none predicts nothing, a cached probe or not" $?
refuse "--tune with --hardware none" "--tune needs a hardware profile" "${plan[@]}" --tune --hardware none

# The first run at new shapes probes its units with half the run's planned
# memory: a model whose 8 probed layers alone (100 MiB each with their
# gradients) would outgrow the run's own buffers (everything on NVMe, the
# layers in pieces: 0.43 GiB planned) peaks no higher in its first, probing,
# run than in the next, which reads the cache (a probe of 1 GiB of layers made
# the first run's peak 65% higher).
cat >"$dir/wide.json" <<'JSON'
{"model_type": "llama", "vocab_size": 256, "hidden_size": 1024, "intermediate_size": 2816,
 "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8}
JSON
peak_rss() {  # peak resident KiB of the command
  python3 -c 'import resource, subprocess, sys
sys.exit(subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
         or print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))' "$@"
}
wide=(train --model "$dir/wide.json" --backend cpu --seq-len 32 --micro-batch 2 --steps 1
  --zero-stage 3 --offload-param nvme --offload-optimizer nvme --gradient-home nvme
  --layer-pieces 2 --nvme-path "$dir/swap-wide" --data "$dir/data/train.bin")
first=$(peak_rss "$strata" "${wide[@]}") && later=$(peak_rss "$strata" "${wide[@]}") &&
  echo "peak RSS: probing run $first KiB, cached run $later KiB" &&
  [ "$first" -le $((later + later * 15 / 100)) ]
check "a first run's probe does not raise its peak memory above the next run's" $?

finish_checks
