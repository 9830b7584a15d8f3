#!/usr/bin/env bash
# `strata train`'s monitors end to end on the CPU: a DeepSpeed config's
# tensorboard and csv_monitor blocks (and --tensorboard DIR) on a short fp16
# run with NVMe offload and evaluations, checked against the run's metrics
# file by monitor_files_check.py (Python's standard library only): the event
# file's framing, CRCs and every scalar of every step, DeepSpeed's CSV layout
# byte for byte; a corrupted byte, a cut-short file and a changed CSV digit
# that the check catches; an enabled wandb block as one warning line; a
# directory that cannot be made refused in one line before training starts.
# Built without protobuf, --tensorboard is refused in one line and the CSV
# files are still checked.
# Usage: monitor_files.sh STRATA_BINARY REPO_ROOT ON|OFF (strata built with protobuf)
set -uo pipefail
strata="$1"
root="$2"
protobuf="$3"
source "$(dirname "$0")/check_support.sh"
check_files=(python3 "$root/tests/monitor_files_check.py")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

"$strata" demo-data --out "$dir/data" --tokens 100000 --val-tokens 10000 >/dev/null
check "demo-data writes train.bin and val.bin" $?

cat >"$dir/ds.json" <<JSON
{"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": true},
 "tensorboard": {"enabled": $([ "$protobuf" = ON ] && echo true || echo false),
                 "output_path": "$dir/tb", "job_name": "job"},
 "csv_monitor": {"enabled": true, "output_path": "$dir/csv", "job_name": "job"},
 "wandb": {"enabled": true, "project": "p"}}
JSON
run=(--model tiny --backend cpu --seq-len 32 --data "$dir/data/train.bin")
nvme=(--zero-stage 3 --offload-param nvme --offload-optimizer nvme --nvme-path "$dir/swap")
"$strata" train "${run[@]}" "${nvme[@]}" --config "$dir/ds.json" --steps 6 \
  --eval-data "$dir/data/val.bin" --eval-every 3 --eval-batches 2 --metrics "$dir/m.jsonl" \
  >"$dir/out" 2>"$dir/err"
check "train with the monitor blocks exits 0" $?
[ "$(wc -l <"$dir/err")" -eq 1 ] && grep -q "^warning: $dir/ds.json: wandb.enabled is true.*tensorboard" "$dir/err"
check "an enabled wandb block is one warning line naming tensorboard" $?
grep -q '"eval_loss"' "$dir/m.jsonl" && grep -q '"loss_scale"' "$dir/m.jsonl" &&
  grep -q '"nvme_written_bytes":[1-9]' "$dir/m.jsonl"
check "the run evaluates, scales the loss (fp16) and writes NVMe" $?

"${check_files[@]}" --metrics "$dir/m.jsonl" --csv "$dir/csv/job"
check "csv_monitor: DeepSpeed's files, header and rows, the metrics' values" $?
cp -r "$dir/csv/job" "$dir/csv-changed"
sed -i '2s/[0-9]\r$/x\r/' "$dir/csv-changed/Train_Samples_lr.csv"
"${check_files[@]}" --metrics "$dir/m.jsonl" --csv "$dir/csv-changed" >"$dir/csv-check" 2>&1
[ $? -eq 1 ] && grep -q "Train_Samples_lr.csv: differs from DeepSpeed's" "$dir/csv-check"
check "the check catches a changed CSV value" $?

if [ "$protobuf" = ON ]; then
  events=("$dir"/tb/job/events.out.tfevents.*)
  [ ${#events[@]} -eq 1 ] && [[ "$(basename "${events[0]}")" =~ ^events\.out\.tfevents\.[0-9]{10}\.[^/]+\.[0-9]+\.[0-9]+$ ]]
  check "one event file in output_path/job_name, named as TensorBoard names them" $?
  grep -q "^tensorboard: ${events[0]}" "$dir/out"
  check "the run names its event file" $?
  "${check_files[@]}" --metrics "$dir/m.jsonl" --events "${events[0]}"
  check "tensorboard: every record's CRCs, every scalar of every step as in the metrics" $?

  # A flipped byte inside a later record, in a length, and a file cut short are caught.
  size=$(stat -c %s "${events[0]}")
  python3 - "${events[0]}" "$dir/flipped" "$dir/length" "$dir/short" <<'PY'
import sys
data = bytearray(open(sys.argv[1], "rb").read())
flipped = bytearray(data); flipped[len(data) // 2] ^= 0x01
open(sys.argv[2], "wb").write(flipped)
length = bytearray(data); length[0] ^= 0x01  # the first record's length
open(sys.argv[3], "wb").write(length)
open(sys.argv[4], "wb").write(data[:-3])
PY
  "${check_files[@]}" --metrics "$dir/m.jsonl" --events "$dir/flipped" >"$dir/c1" 2>&1
  [ $? -eq 1 ] && grep -q "CRC" "$dir/c1"
  check "the check catches a flipped byte (of $size) by its CRC" $?
  "${check_files[@]}" --metrics "$dir/m.jsonl" --events "$dir/length" >"$dir/c2" 2>&1
  [ $? -eq 1 ] && grep -q "length's CRC" "$dir/c2"
  check "the check catches a changed length by its CRC" $?
  "${check_files[@]}" --metrics "$dir/m.jsonl" --events "$dir/short" >"$dir/c3" 2>&1
  [ $? -eq 1 ] && grep -q "cut short" "$dir/c3"
  check "the check catches a file cut short" $?

  # --tensorboard DIR: the events in DIR itself, over the file's block; fp32, no NVMe.
  "$strata" train "${run[@]}" --config "$dir/ds.json" --precision fp32 --steps 3 \
    --tensorboard "$dir/flag-tb" --metrics "$dir/m2.jsonl" >/dev/null 2>&1
  check "train --tensorboard DIR exits 0" $?
  flag_events=("$dir"/flag-tb/events.out.tfevents.*)
  [ ${#flag_events[@]} -eq 1 ] && "${check_files[@]}" --metrics "$dir/m2.jsonl" --events "${flag_events[0]}"
  check "--tensorboard DIR: the events in DIR, as in the metrics (no loss_scale in fp32)" $?
fi

# A directory that cannot be made is refused in one line before training starts.
touch "$dir/plain-file"
"$strata" train "${run[@]}" --steps 2 --tensorboard "$dir/plain-file/tb" >"$dir/out3" 2>"$dir/err3"
status=$?
if [ "$protobuf" = ON ]; then
  [ $status -eq 2 ] && [ "$(wc -l <"$dir/err3")" -eq 1 ] &&
    grep -q "^strata train: --tensorboard: $dir/plain-file/tb: cannot create the directory: .*; name a directory" "$dir/err3" &&
    ! grep -q "^step" "$dir/out3"
  check "an unusable --tensorboard directory: exit 2, one line, before any step" $?
else
  [ $status -eq 2 ] && [ "$(wc -l <"$dir/err3")" -eq 1 ] && grep -q "without protobuf" "$dir/err3"
  check "built without protobuf, --tensorboard is refused in one line" $?
fi
sed "s|\"output_path\": \"$dir/csv\"|\"output_path\": \"$dir/plain-file\"|" "$dir/ds.json" >"$dir/bad.json"
"$strata" train "${run[@]}" --config "$dir/bad.json" --steps 2 >"$dir/out4" 2>"$dir/err4"
[ $? -eq 2 ] && grep -q "^strata train: $dir/bad.json: csv_monitor: $dir/plain-file/job: cannot create the directory" "$dir/err4" &&
  [ "$(grep -c "^strata train" "$dir/err4")" -eq 1 ] && ! grep -q "^step" "$dir/out4"
check "an unusable csv_monitor directory: exit 2, one line naming the file and block" $?

finish_checks
