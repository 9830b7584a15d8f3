#!/usr/bin/env bash
# `strata train --print-config`: a DeepSpeed file merged with flags, warnings
# for unknown keys, one-line errors with file, line and column.
# Usage: cli_train_config.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
json_get() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

cat > "$dir/ds.json" <<'JSON'
{
  "train_batch_size": 32,
  "gradient_accumulation_steps": 4,
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true}},
  "flops_profiler": {"enabled": false}
}
JSON
out=$("$strata" train --config "$dir/ds.json" --world-size 2 --lr 3e-4 --print-config 2>"$dir/err")
check "print-config exits 0" $?
[ "$(echo "$out" | json_get 'd["train_micro_batch_size_per_gpu"]')" = "4" ]; check "micro batch derived: 32 / (4 * 2)" $?
[ "$(echo "$out" | json_get 'd["optimizer"]["params"]["lr"]')" = "0.0003" ]; check "--lr overrides the file" $?
[ "$(echo "$out" | json_get 'd["strata"]["precision"]')" = "bf16" ]; check "precision from bf16.enabled" $?
[ "$(echo "$out" | json_get 'd["aio"]["queue_depth"]')" = "8" ]; check "aio defaults filled in" $?
grep -q "unknown key 'flops_profiler' ignored" "$dir/err"; check "unknown key warned" $?

"$strata" train --config "$dir/ds.json" --world-size 3 --print-config >/dev/null 2>"$dir/err"
status=$?
[ $status -eq 2 ]; check "inconsistent batch exits 2" $?
grep -q "32 != 1 \* 4 \* 3\|train_batch_size must equal" "$dir/err"; check "batch equation shown" $?

printf '{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 3,}\n}\n' > "$dir/bad.json"
"$strata" train --config "$dir/bad.json" --print-config >/dev/null 2>"$dir/err"
grep -q "bad.json:3:.*malformed JSON" "$dir/err"; check "malformed JSON gives line and column" $?
[ "$(wc -l < "$dir/err")" -eq 1 ]; check "one line" $?

"$strata" train --config "$dir/absent.json" --print-config >/dev/null 2>"$dir/err"
grep -q "absent.json" "$dir/err"; check "missing file named" $?

out=$("$strata" train --model tiny --print-config 2>/dev/null)
[ "$(echo "$out" | json_get 'd["strata"]["parameters"]')" = "190944" ]; check "model named in the effective config" $?

# Training needs data: without --data it refuses in one line, saying how to get some.
"$strata" train --model tiny --backend cpu >/dev/null 2>"$dir/err"
[ $? -eq 2 ] && grep -q "\-\-data FILE is required" "$dir/err"; check "train without --data refuses" $?

# --help: flags grouped, each with its default and the DeepSpeed key it overrides.
help=$("$strata" train --help)
for group in "Model and data:" "Batch, precision and optimizer:" "ZeRO and offload:" "NVMe I/O:" \
             "Memory budgets:" "Output:"; do
  grep -q "^$group" <<<"$help"; check "help group $group" $?
done
grep -q -- "--zero-stage.*zero_optimization.stage; default 0" <<<"$help" &&
  grep -q -- "--micro-batch.*train_micro_batch_size_per_gpu; default 1" <<<"$help" &&
  grep -q -- "--aio-queue-depth.*aio.queue_depth; default 8" <<<"$help"
check "help shows defaults and DeepSpeed keys" $?

finish_checks
