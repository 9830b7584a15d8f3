#!/usr/bin/env bash
# `strata launch -n N -- strata train ...`: each process trains one rank
# (Gloo on the CPU backend) and the run is bitwise the run of N ranks
# as threads of one process: losses, gradient norms, the validation loss, the
# exported weights and the checkpoint's state files. A run launched as
# processes resumes from a checkpoint written by threads; SIGTERM stops every
# rank after the same step with a checkpoint and no swap files left; a
# --world-size that disagrees with the launcher is refused in one line; a
# mixture reading its experts as routed gives the same bits as processes.
# On a machine with two GPUs or more: one process per GPU (NCCL) gives the
# losses of two ranks as threads sharing GPU 0, in ZeRO-Offload (stage 2,
# optimizer in host memory) and with everything on the GPUs.
# Usage: cli_train_launch.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$strata" demo-data --out "$dir/data" --tokens 100000 --val-tokens 4000 >/dev/null

base=(--model tiny --backend cpu --seq-len 32 --micro-batch 2 --lr 3e-3 --data "$dir/data/train.bin"
      --zero-stage 3 --offload-param nvme --offload-optimizer nvme
      --eval-data "$dir/data/val.bin" --eval-batches 2)
losses() { python3 -c 'import json,sys; print(" ".join(repr((j["loss"], j["grad_norm"], j.get("eval_loss"))) for j in map(json.loads, open(sys.argv[1]))))' "$1"; }

# Two ranks as threads, then as processes.
"$strata" train "${base[@]}" --world-size 2 --steps 4 --nvme-path "$dir/swap-t" --save "$dir/ckpt-t" \
  --export "$dir/threads.safetensors" --metrics "$dir/threads.jsonl" >"$dir/threads.out" 2>&1
check "2 ranks as threads" $?
timeout 300 "$strata" launch -n 2 -- "$strata" train "${base[@]}" --steps 4 --nvme-path "$dir/swap-p" \
  --save "$dir/ckpt-p" --export "$dir/procs.safetensors" --metrics "$dir/procs.jsonl" >"$dir/procs.out" 2>&1
check "2 ranks as processes (strata launch)" $?
grep -q "one process each" "$dir/procs.out"; check "rank 0 says it runs as processes" $?
[ "$(grep -c "^trained" "$dir/procs.out")" -eq 1 ]; check "only rank 0 prints the summary" $?
[ -n "$(losses "$dir/threads.jsonl")" ] && [ "$(losses "$dir/threads.jsonl")" = "$(losses "$dir/procs.jsonl")" ]
check "losses, gradient norms and validation loss bitwise equal" $?
cmp -s "$dir/threads.safetensors" "$dir/procs.safetensors"; check "exported weights byte-identical" $?
same=0
for f in master.bin m.bin v.bin; do cmp -s "$dir/ckpt-t/step-4/$f" "$dir/ckpt-p/step-4/$f" || same=1; done
check "checkpoint state files byte-identical (every rank wrote its part)" $same
[ -z "$(ls -A "$dir/swap-p")" ]; check "no swap files left" $?
# The bytes Gloo sent for rank 0 in each step are what the plan counts per rank.
planned=$("$strata" plan --model tiny --backend cpu --seq-len 32 --micro-batch 2 --zero-stage 3 \
  --offload-param nvme --offload-optimizer nvme --nvme-path "$dir" --world-size 2 --json |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["traffic"]["collective_bytes"])')
sent=$(python3 -c 'import json,sys; print(" ".join(sorted({str(json.loads(l)["network_bytes"]) for l in open(sys.argv[1])})))' "$dir/procs.jsonl")
[ -n "$planned" ] && [ "$sent" = "$planned" ]
check "network bytes per step counted by Gloo ($sent) equal the plan's ($planned)" $?

# Processes resume what threads saved: steps 3-4 again, from step 2.
"$strata" train "${base[@]}" --world-size 2 --steps 2 --nvme-path "$dir/swap-t" --save "$dir/ckpt-2" \
  >/dev/null 2>&1
timeout 300 "$strata" launch -n 2 -- "$strata" train "${base[@]}" --steps 4 --nvme-path "$dir/swap-p" \
  --resume "$dir/ckpt-2" --metrics "$dir/resumed.jsonl" >"$dir/resumed.out" 2>&1
check "processes resume a checkpoint of threads" $?
[ "$(losses "$dir/resumed.jsonl")" = "$(losses "$dir/threads.jsonl" | cut -d' ' -f7-)" ]
check "the resumed steps are the straight run's, bitwise" $?

# SIGTERM reaches every rank through launch; they stop after the same step and save.
# (--foreground: timeout would otherwise signal its process group too, and a
# second signal makes launch kill the ranks without waiting.)
timeout --foreground 300 "$strata" launch -n 2 -- "$strata" train "${base[@]}" --steps 100000 --nvme-path "$dir/swap-s" \
  --save "$dir/ckpt-s" >"$dir/stopped.out" 2>&1 &
launcher=$!
for _ in $(seq 1 200); do grep -q "^step" "$dir/stopped.out" 2>/dev/null && break; sleep 0.1; done
kill -TERM $launcher
wait $launcher
ls -d "$dir"/ckpt-s/step-* >/dev/null 2>&1; check "SIGTERM: a checkpoint was saved" $?
[ -z "$(ls -A "$dir/swap-s" 2>/dev/null)" ]; check "SIGTERM: no swap files left" $?

# A rank killed mid-run: the other fails at once (not after its timeout) in
# one line naming it.
timeout --foreground 300 "$strata" launch -n 2 -- "$strata" train "${base[@]}" --steps 100000 \
  --nvme-path "$dir/swap-k" >"$dir/killed.out" 2>&1 &
launcher=$!
for _ in $(seq 1 200); do grep -q "^step" "$dir/killed.out" 2>/dev/null && break; sleep 0.1; done
rank1=""
for pid in $(pgrep -f -- "--nvme-path $dir/swap-k"); do  # timeout, the launcher, the ranks
  tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "RANK=1" && rank1=$pid
done
killed_at=$(date +%s)
[ -n "$rank1" ] && kill -KILL "$rank1"
wait $launcher
waited=$(( $(date +%s) - killed_at ))
grep -E "GlooComm .* on rank 0: rank 1 closed the connection" "$dir/killed.out" | head -1 >"$dir/killed.line"
[ -n "$rank1" ] && [ -s "$dir/killed.line" ] && [ "$waited" -lt 60 ]
check "a rank killed mid-step: rank 0 fails within ${waited} s in a line naming rank 1" $?

# kill -9 of both ranks, then a resume from the newest checkpoint: the
# steps after it are the straight run's, bitwise.
"$strata" train "${base[@]}" --world-size 2 --steps 12 --nvme-path "$dir/swap-t" \
  --metrics "$dir/straight12.jsonl" >/dev/null 2>&1
timeout --foreground 300 "$strata" launch -n 2 -- "$strata" train "${base[@]}" --steps 12 \
  --nvme-path "$dir/swap-9" --save "$dir/ckpt-9" --save-every 2 >"$dir/nine.out" 2>&1 &
launcher=$!
for _ in $(seq 1 300); do ls -d "$dir"/ckpt-9/step-4 >/dev/null 2>&1 && break; sleep 0.1; done
pkill -KILL -f -- "--nvme-path $dir/swap-9"  # timeout, the launcher and both ranks at once
wait $launcher 2>/dev/null
timeout 300 "$strata" launch -n 2 -- "$strata" train "${base[@]}" --steps 12 --nvme-path "$dir/swap-9" \
  --resume "$dir/ckpt-9" --metrics "$dir/resumed9.jsonl" >"$dir/resumed9.out" 2>&1
check "kill -9 of both ranks: they resume from the newest checkpoint" $?
resumed=$(losses "$dir/resumed9.jsonl")
count=$(echo "$resumed" | wc -w)
[ -n "$resumed" ] && [ "$resumed" = "$(losses "$dir/straight12.jsonl" | tr ' ' '\n' | tail -n "$count" | paste -sd' ')" ]
check "kill -9 and resume at 2 processes: the resumed steps are the straight run's, bitwise" $?

# The launcher's world size is the one that counts.
WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=1 \
  "$strata" train "${base[@]}" --world-size 3 --steps 1 --nvme-path "$dir/swap-x" >/dev/null 2>"$dir/err"
[ $? -eq 2 ] && [ "$(wc -l <"$dir/err")" -eq 1 ] && grep -q -- "--world-size 3 but launched as 2" "$dir/err"
check "a --world-size other than the launcher's is refused in one line" $?

# A mixture with its experts read as routed: the ranks join their routings
# (core/plan/expert_fetch.h), as processes and as threads, bitwise, and as
# reading every expert; both record the joined routing.
cat > "$dir/moe.json" <<'JSON'
{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
 "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 16,
 "num_experts_per_tok": 1, "norm_topk_prob": true, "decoder_sparse_step": 1,
 "mlp_only_layers": [], "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "tie_word_embeddings": false,
 "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
 "hidden_act": "silu", "torch_dtype": "float32"}
JSON
moe=(--model "$dir/moe.json" --backend cpu --seq-len 4 --micro-batch 1 --grad-accum 2 --lr 3e-3
     --data "$dir/data/train.bin" --zero-stage 3 --offload-param nvme --offload-optimizer nvme
     --layer-pieces 2 --steps 3 --hardware none)
routings() { python3 -c 'import json,sys; print(" ".join(json.dumps(j["routing"], sort_keys=True) for j in map(json.loads, open(sys.argv[1]))))' "$1"; }
"$strata" train "${moe[@]}" --world-size 2 --nvme-path "$dir/swap-mt" --metrics "$dir/moe-t.jsonl" \
    >"$dir/moe-t.out" 2>&1 &&
  timeout 300 "$strata" launch -n 2 -- "$strata" train "${moe[@]}" --nvme-path "$dir/swap-mp" \
    --metrics "$dir/moe-p.jsonl" >"$dir/moe-p.out" 2>&1 &&
  "$strata" train "${moe[@]}" --world-size 2 --nvme-path "$dir/swap-ma" --expert-fetch all \
    --metrics "$dir/moe-a.jsonl" >/dev/null 2>&1
check "a routed mixture at 2 ranks, as threads, as processes and reading every expert" $?
grep -q "^expert fetch: routed" "$dir/moe-p.out"; check "the processes read the experts as routed" $?
[ -n "$(losses "$dir/moe-t.jsonl")" ] && [ "$(losses "$dir/moe-t.jsonl")" = "$(losses "$dir/moe-p.jsonl")" ] &&
  [ "$(losses "$dir/moe-t.jsonl")" = "$(losses "$dir/moe-a.jsonl")" ]
check "routed at 2 ranks: the losses of reading every expert, threads and processes bitwise" $?
[ -n "$(routings "$dir/moe-t.jsonl")" ] && [ "$(routings "$dir/moe-t.jsonl")" = "$(routings "$dir/moe-p.jsonl")" ]
check "threads and processes record the same joined routing" $?
# Deferred expert updates at 2 processes: each replays its shard's part of
# the experts its share brings (core/plan/expert_update.h), the eager bits.
timeout 300 "$strata" launch -n 2 -- "$strata" train "${moe[@]}" --nvme-path "$dir/swap-md" \
  --expert-update deferred --metrics "$dir/moe-d.jsonl" >"$dir/moe-d.out" 2>&1
check "deferred expert updates at 2 processes" $?
grep -q "^expert update: deferred" "$dir/moe-d.out"; check "the processes defer idle experts' updates" $?
[ -n "$(losses "$dir/moe-d.jsonl")" ] && [ "$(losses "$dir/moe-d.jsonl")" = "$(losses "$dir/moe-t.jsonl")" ]
check "deferred at 2 processes: the eager threads' losses and norms, bitwise" $?

# Several GPUs: a process per GPU through NCCL against threads sharing one GPU.
# Two ranks add each element once, so the sums and the results are bitwise equal.
gpus=$("$strata" --version | grep -c "^  GPU [0-9]")
if [ "$gpus" -ge 2 ]; then
  for optimizer in cpu none; do
    gpu=(--model tiny --backend cuda --seq-len 32 --micro-batch 2 --lr 3e-3 --data "$dir/data/train.bin"
         --zero-stage 2 --offload-optimizer "$optimizer" --steps 3)
    "$strata" train "${gpu[@]}" --world-size 2 --metrics "$dir/gpu-t-$optimizer.jsonl" >/dev/null 2>&1
    check "GPU, optimizer $optimizer: 2 ranks as threads on one GPU" $?
    timeout 300 "$strata" launch -n 2 -- "$strata" train "${gpu[@]}" \
      --metrics "$dir/gpu-p-$optimizer.jsonl" >"$dir/gpu-p-$optimizer.out" 2>&1
    check "GPU, optimizer $optimizer: one process per GPU (NCCL)" $?
    [ -n "$(losses "$dir/gpu-t-$optimizer.jsonl")" ] &&
      [ "$(losses "$dir/gpu-t-$optimizer.jsonl")" = "$(losses "$dir/gpu-p-$optimizer.jsonl")" ]
    check "GPU, optimizer $optimizer: losses and gradient norms bitwise equal" $?
  done
else
  echo "skipped: the multi-GPU checks need two GPUs, found $gpus"
fi

finish_checks
