#!/usr/bin/env bash
# `strata train` refuses what cannot work before training starts, each time
# with one line on stderr that says what, where and what to do, and a
# non-zero exit: a missing data file, a plan that does not fit the budgets,
# an unwritable NVMe path, a GPU backend where there is none, bad masks, a
# model config.json asking for what no family computes.
# Usage: cli_train_refusals.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$strata" demo-data --out "$dir/data" --tokens 20000 --val-tokens 2000 >/dev/null
common=(--model tiny --backend cpu --seq-len 32 --micro-batch 2 --steps 2)

# refuse NAME EXPECTED_STATUS PATTERN -- ARGS...: exit status, one line, the pattern in it.
refuse() {
  local name="$1" expected="$2" pattern="$3"
  shift 4
  "$strata" train "$@" >"$dir/out" 2>"$dir/err"
  local status=$?
  local ok=0
  [ "$status" -eq "$expected" ] || ok=1
  [ "$(wc -l <"$dir/err")" -eq 1 ] || ok=1
  grep -q -- "$pattern" "$dir/err" || ok=1
  [ $ok -eq 0 ] || { echo "  status $status, stderr:"; sed 's/^/    /' "$dir/err"; }
  check "$name" $ok
}

refuse "missing data file" 2 "absent.bin" -- "${common[@]}" --data "$dir/absent.bin"
refuse "no --data" 2 "demo-data" -- "${common[@]}"
"$strata" demo-data --out "$dir/short" --tokens 20 --val-tokens 20 >/dev/null
refuse "data shorter than one sequence" 2 "fewer than one sequence" -- "${common[@]}" --data "$dir/short/train.bin"
refuse "plan does not fit --device-mem-limit" 1 "does not fit.*--device-mem-limit" -- \
  "${common[@]}" --data "$dir/data/train.bin" --device-mem-limit 1M
refuse "plan does not fit --host-mem-limit" 1 "does not fit.*--host-mem-limit" -- \
  "${common[@]}" --data "$dir/data/train.bin" --offload-optimizer cpu --host-mem-limit 64K
: >"$dir/file"
refuse "NVMe path that cannot be created" 2 "nvme-path $dir/file/swap" -- \
  "${common[@]}" --data "$dir/data/train.bin" --offload-optimizer nvme --nvme-path "$dir/file/swap"
refuse "NVMe path that is a file" 2 "nvme-path $dir/file" -- \
  "${common[@]}" --data "$dir/data/train.bin" --offload-optimizer nvme --nvme-path "$dir/file"
refuse "loss mask of the wrong size" 2 "one byte per token" -- \
  "${common[@]}" --data "$dir/data/train.bin" --loss-mask "$dir/file"
refuse "--eval-every without --eval-data" 2 "needs --eval-data" -- \
  "${common[@]}" --data "$dir/data/train.bin" --eval-every 2
refuse "unwritable --metrics" 2 "metrics $dir/file/m.jsonl" -- \
  "${common[@]}" --data "$dir/data/train.bin" --metrics "$dir/file/m.jsonl"
refuse "no --model" 2 "model" -- --data "$dir/data/train.bin"

# --backend cuda on a machine without a usable GPU: refused in one line, pointing at --backend cpu.
if "$strata" --version | grep -q "GPUs: none"; then
  "$strata" train --model tiny --backend cuda --zero-stage 2 --seq-len 32 --steps 1 \
    --data "$dir/data/train.bin" >/dev/null 2>"$dir/err"
  [ $? -eq 2 ] && [ "$(wc -l <"$dir/err")" -eq 1 ] && grep -q -- "--backend cpu" "$dir/err"
  check "--backend cuda without a GPU" $?
fi

# A config.json asking for what no family computes: one line naming the file and the key.
model_common=(--backend cpu --seq-len 32 --micro-batch 2 --steps 2 --data "$dir/data/train.bin")
shape='"vocab_size": 256, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 1, "num_attention_heads": 4'
echo "{\"model_type\": \"qwen2_moe\", $shape, \"num_experts\": 8}" >"$dir/moe.json"
refuse "shared experts" 2 "moe.json: shared_expert_intermediate_size" -- --model "$dir/moe.json" "${model_common[@]}"
echo "{\"model_type\": \"gpt_oss\", $shape, \"num_local_experts\": 8}" >"$dir/gpt_oss.json"
refuse "another model_type" 2 "gpt_oss.json: model_type" -- --model "$dir/gpt_oss.json" "${model_common[@]}"
echo "{\"model_type\": \"mixtral\", $shape, \"router_jitter_noise\": 0.1}" >"$dir/jitter.json"
refuse "router jitter" 2 "jitter.json: router_jitter_noise" -- --model "$dir/jitter.json" "${model_common[@]}"
echo "{\"model_type\": \"mistral\", $shape, \"num_local_experts\": 8}" >"$dir/experts.json"
refuse "mixture-of-experts keys" 2 "experts.json: num_local_experts" -- \
  --model "$dir/experts.json" "${model_common[@]}"
echo "{\"model_type\": \"llama\", $shape, \"attention_bias\": true}" >"$dir/bias.json"
refuse "attention_bias on llama" 2 "bias.json: attention_bias" -- --model "$dir/bias.json" "${model_common[@]}"
echo "{\"model_type\": \"qwen2\", $shape, \"use_sliding_window\": true}" >"$dir/window.json"
refuse "use_sliding_window on qwen2" 2 "window.json: use_sliding_window" -- \
  --model "$dir/window.json" "${model_common[@]}"
echo "{\"model_type\": \"qwen3\", $shape, \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}}" \
  >"$dir/yarn.json"
refuse "rope_scaling yarn" 2 "yarn.json: rope_scaling.rope_type" -- --model "$dir/yarn.json" "${model_common[@]}"

# A plan that does not fit is refused before the swap file is made.
"$strata" train "${common[@]}" --data "$dir/data/train.bin" --offload-optimizer nvme --nvme-path "$dir/swap" \
  --device-mem-limit 1M >/dev/null 2>&1
[ -z "$(ls -A "$dir/swap")" ]; check "a refused plan writes nothing under the NVMe path" $?

finish_checks
