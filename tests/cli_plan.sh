#!/usr/bin/env bash
# `strata plan` end to end: the table, the JSON, the exit status, the errors.
# Usage: cli_plan.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
json_get() {  # json_get EXPRESSION < json
  python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"
}

# A plan that fits: llama3.2-1b, bf16, stage 0, one rank, 80 GiB device, 1 TiB host.
out=$("$strata" plan --model llama3.2-1b --precision bf16 --device-mem-limit 80G --host-mem-limit 1T --json)
status=$?
check "fitting plan exits 0" $status
device=$(echo "$out" | json_get 'd["per_rank"]["device_bytes"]')
shard=$(echo "$out" | json_get 'd["shard_elements"]')
[ "$device" = "$((18 * shard))" ]; check "bf16 stage 0 is 18 bytes per padded parameter ($device)" $?
params=$(echo "$out" | json_get 'd["parameters"]')
[ "$params" = "1235814400" ]; check "llama3.2-1b has 1235814400 parameters" $?

# The families' presets: `strata plan` counts their published parameters exactly.
for preset_count in qwen2.5-0.5b:494032768 qwen2.5-1.5b:1543714304 qwen2.5-3b:3085938688 \
                    qwen2.5-7b:7615616512 qwen3-0.6b:596049920 qwen3-1.7b:1720574976 \
                    qwen3-4b:4022468096 qwen3-8b:8190735360 mistral-7b:7241732096 \
                    mistral-7b-v0.3:7248023552; do
  preset=${preset_count%%:*}
  params=$("$strata" plan --model "$preset" --json | json_get 'd["parameters"]')
  [ "$params" = "${preset_count##*:}" ]; check "$preset has ${preset_count##*:} parameters ($params)" $?
done

# The ZeRO paper's accounting for Llama 3 8B at stage 3 over 8 ranks: 16 * psi / 8.
out=$("$strata" plan --model llama3-8b --stage 3 --world-size 8 --precision bf16 --accounting zero --json \
      --device-mem-limit 80G --host-mem-limit 1T)
device=$(echo "$out" | json_get 'd["per_rank"]["device_bytes"]')
[ "$device" = "$((16 * 8030261248 / 8))" ]; check "ZeRO accounting 16 psi / 8 ($device)" $?

# A plan that does not fit exits 1, names the tier and suggests a change.
out=$("$strata" plan --model llama3-8b --precision bf16 --device-mem-limit 80G --host-mem-limit 1T)
status=$?
[ $status -eq 1 ]; check "overflowing plan exits 1" $?
grep -q "device .*DOES NOT FIT: over by" <<<"$out"; check "names the overflowing tier" $?
grep -q "smallest change that fits: --offload-optimizer cpu" <<<"$out"; check "suggests offloading the optimizer" $?

# --params and traffic with bandwidths.
out=$("$strata" plan --params 30e9 --stage 3 --world-size 4 --precision bf16 --net-bw 50GB/s \
      --device-mem-limit 80G --host-mem-limit 1T --json)
# A model of that size, in Llama's proportions, planned like any other.
n=$(echo "$out" | json_get 'd["parameters"]')
python3 -c "import sys; sys.exit(abs($n - 30e9) > 0.03 * 30e9)"; check "--params 30e9 plans a model of about 30e9 parameters ($n)" $?
zero=$(echo "$out" | json_get 'd["traffic"]["collective_bytes_zero"]')
[ "$zero" = "$((3 * 2 * n))" ]; check "stage 3 collective volume is 3 psi ($zero)" $?
per=$(echo "$out" | json_get 'round(d["per_rank_strata"]["device_bytes"] * d["world_size"] / d["parameters"], 2)')
[ "$per" = "18.0" ]; check "bf16 states on the device: 18 bytes per parameter on the node ($per)" $?
act=$(echo "$out" | json_get 'd["activations"]["saved_bytes"]')
[ "$act" -gt 0 ]; check "--params plans activations too ($act bytes)" $?
"$strata" plan --params 7B | head -1 | grep -q "^strata plan: llama-shaped (hidden [0-9]*, [0-9]* layers, vocab 32000)"
check "--params names the model's shape" $?
bw=$(echo "$out" | json_get 'int(d["traffic"]["intra_node_bandwidth"])')
[ "$bw" = "50000000000" ]; check "--net-bw 50GB/s is read (the link within the node)" $?
inter=$(echo "$out" | json_get 'd["traffic"]["inter_node_bytes"]')
[ "$inter" = "0" ]; check "one node: nothing crosses nodes ($inter)" $?

# NVMe free space is read from the directory given.
nvme_dir=$(mktemp -d)
out=$("$strata" plan --model tiny --stage 3 --offload-optimizer nvme --offload-param nvme \
      --nvme-path "$nvme_dir" --host-mem-limit 1G --device-mem-limit 1G --json)
check "tiny with everything on NVMe fits" $?
src=$(echo "$out" | json_get '[b for b in d["budgets"] if b["tier"]=="nvme"][0]["budget_source"]')
[ "$src" = "free under the NVMe paths" ]; check "NVMe budget detected from the directory" $?
rmdir "$nvme_dir"

# Errors: one line, exit 2, naming the problem.
err=$("$strata" plan --model llama3-8b --stage 2 --offload-param cpu 2>&1 >/dev/null)
status=$?
[ $status -eq 2 ] && grep -q "needs ZeRO stage 3" <<<"$err"; check "offload_param below stage 3 refused" $?
[ "$(echo "$err" | wc -l)" -eq 1 ]; check "error is one line" $?
err=$("$strata" plan --model nonesuch 2>&1 >/dev/null)
grep -q "not a preset and no such file" <<<"$err"; check "unknown model named" $?
err=$("$strata" plan --params lots 2>&1 >/dev/null)
grep -q -- "--params: 'lots' is not a count" <<<"$err"; check "bad --params named" $?
err=$("$strata" plan --model tiny --device-mem-limit 12X 2>&1 >/dev/null)
grep -q -- "--device-mem-limit" <<<"$err"; check "bad size flag named" $?

# The engine's per-step schedule of a real model.
out=$("$strata" plan --model tiny --ops --stage 3 --offload-param nvme --offload-optimizer nvme \
      --nvme-path . --world-size 2 --grad-accum 2 --micro-batch 1 --schedule micro_batch 2>&1)
grep -q "fetch(layers.0) mb 0 .* io" <<<"$out" && grep -q "gather(head) mb 1" <<<"$out" &&
  grep -q "^ *[0-9]* *exchange" <<<"$out" && grep -q "optimizer(embedding)" <<<"$out"
check "--ops prints every kind of operation" $?
grep -q "NVMe traffic per step and rank: [0-9.]* [KM]iB read" <<<"$out"; check "--ops prints NVMe traffic" $?
"$strata" plan --model tiny --ops --json --stage 3 --world-size 2 | python3 -c 'import json,sys; j=json.load(sys.stdin); assert j["ops"] and j["peak_bytes"]["device"] > 0'
check "--ops --json parses" $?
# The schedule for a GPU, planned on any machine: the state stays off the device when offloaded,
# ZeRO-Offload keeps the parameters there and passes the CPU optimizer's output through host memory.
if "$strata" --version | grep -q "CUDA backend: not built"; then
  # The refusal exits 2; under pipefail a pipe into grep would report that, not grep's match.
  refusal=$("$strata" plan --model tiny --ops --backend cuda --stage 3 --offload-param cpu \
    --offload-optimizer cpu 2>&1 >/dev/null)
  grep -q "built without CUDA" <<<"$refusal"
  check "--ops --backend cuda refused by a CPU-only build" $?
else
  out=$("$strata" plan --model tiny --ops --backend cuda --stage 3 --offload-param cpu --offload-optimizer cpu)
  grep -q "device parameter slots" <<<"$out" && ! grep -qE "^ *device .*(Adam|fp32 master|parameters \()" <<<"$out"
  check "--ops --backend cuda: a device working set, the state off the device" $?
  out=$("$strata" plan --model tiny --ops --backend cuda --stage 2 --world-size 2 --offload-optimizer cpu)
  grep -qE "^ *device .*parameters \(" <<<"$out" && grep -qE "^ *host .*Adam m" <<<"$out" &&
    grep -q "new parameters on their way to the GPU" <<<"$out" &&
    grep -q "parameter all-gather staging" <<<"$out" && ! grep -q "device parameter slots" <<<"$out"
  check "--ops --backend cuda: ZeRO-Offload keeps the parameters on the device" $?
fi
err=$("$strata" plan --params 7B --ops 2>&1 >/dev/null)
grep -q -- "--ops needs --model" <<<"$err"; check "--ops without a model refused" $?

# The layer-major schedule: each unit gathered once for the forward and once for the backward.
out=$("$strata" plan --model tiny --ops --stage 3 --offload-param nvme --offload-optimizer nvme \
      --nvme-path . --grad-accum 4 --micro-batch 1 --schedule layer 2>&1)
grep -q "^schedule layer: activations of 4 micro-batches kept in device memory" <<<"$out" &&
  [ "$(grep -c "gather(layers.0)" <<<"$out")" = 2 ] && [ "$(grep -c "forward(layers.0)" <<<"$out")" = 4 ]
check "--schedule layer: one gather per unit and pass" $?
# auto: with parameters on NVMe and several micro-batches the layer-major order moves less.
out=$("$strata" plan --model tiny --stage 3 --offload-param nvme --offload-optimizer nvme \
      --nvme-path . --grad-accum 4 --micro-batch 1 2>&1)
grep -q "^schedule: layer: it moves .* through NVMe per step where the micro-batch order moves" <<<"$out" &&
  grep -q "^  micro_batch " <<<"$out" && grep -q "^  layer " <<<"$out"
check "auto picks layer for NVMe parameters, both schedules listed" $?
out=$("$strata" plan --model tiny --grad-accum 4 --backend cpu 2>&1)
grep -q "^schedule: micro_batch: no link carries parameters" <<<"$out"; check "auto keeps micro_batch when nothing moves" $?
out=$("$strata" plan --model tiny --grad-accum 4 --backend cpu --schedule layer --json 2>&1)
python3 -c 'import json,sys; j=json.loads(sys.argv[1]); assert j["schedule"]["chosen"] == "layer" and len(j["schedule"]["options"]) == 2' "$out"
check "--schedule layer --json names the choice and both options" $?
# Asked for, layer-major activations that do not fit: the suggestion is the micro-batch order.
out=$("$strata" plan --model small --backend cpu --schedule layer --grad-accum 16 --micro-batch 8 \
      --seq-len 128 --device-mem-limit 100M --host-mem-limit 60M 2>&1)
grep -q "smallest change that fits: --schedule micro_batch" <<<"$out"
check "layer-major activations over the budget suggest --schedule micro_batch" $?
# Neither device nor host memory holds 16 micro-batches' checkpoints: auto spills them to NVMe,
# two levels of slots stay on the device, and the op list moves each one out and back.
out=$("$strata" plan --model small --backend cpu --grad-accum 16 --micro-batch 8 --seq-len 256 \
      --device-mem-limit 200M --host-mem-limit 150M --stage 3 --offload-param nvme \
      --offload-optimizer nvme --nvme-path . --json 2>&1)
python3 -c 'import json,sys; j=json.loads(sys.argv[1]); s=j["schedule"]; assert (s["chosen"], s["activation_home"]) == ("layer", "nvme"), s; assert j["fits"]' "$out"
check "auto spills layer-major activations to NVMe when memory holds neither" $?
out=$("$strata" plan --model small --backend cpu --grad-accum 16 --micro-batch 8 --seq-len 256 \
      --device-mem-limit 200M --host-mem-limit 150M --stage 3 --offload-param nvme \
      --offload-optimizer nvme --nvme-path . 2>&1)
grep -q "^schedule: layer: .* more activations (96.00 MiB of them on NVMe)" <<<"$out" &&
  grep -q "^  layer .* 96.00 MiB  yes" <<<"$out"
check "the schedule table shows the activations on NVMe" $?
out=$("$strata" plan --model tiny --ops --stage 3 --offload-param nvme --offload-optimizer nvme \
      --nvme-path . --grad-accum 3 --micro-batch 1 --schedule layer --activation-home nvme 2>&1)
grep -q "^schedule layer: activations of 3 micro-batches in device slots of 2 levels" <<<"$out" &&
  [ "$(grep -c " spill(" <<<"$out")" = "$(grep -c " restore(" <<<"$out")" ] &&
  grep -q "spill(embedding) mb 2 .*activations" <<<"$out" &&
  grep -q "saved inputs spilled" <<<"$out"
check "--activation-home nvme: spills and restores on the activations lane" $?
out=$("$strata" plan --model tiny --ops --stage 3 --offload-param nvme --offload-optimizer nvme \
      --nvme-path . --micro-batch 1 --activation-home nvme 2>&1)
grep -q "^schedule micro_batch: activations in device slots of 2 levels, 1 level spilled to nvme" <<<"$out" &&
  [ "$(grep -c " spill(" <<<"$out")" = "$(grep -c " restore(" <<<"$out")" ] &&
  grep -q "spill(embedding) mb 0 .*activations" <<<"$out" &&
  grep -q "saved inputs spilled (1 level)" <<<"$out"
check "one micro-batch spills and restores too" $?
config=$(mktemp)
printf '{"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"cpu_checkpointing": true}}' \
  >"$config"
out=$("$strata" plan --model tiny --config "$config" --backend cuda 2>&1)
grep -q "^schedule: micro_batch: .*, saved inputs in host memory (given)" <<<"$out"
check "DeepSpeed's cpu_checkpointing keeps the saved inputs in host memory" $?
rm -f "$config"
# Given a home that does not fit, the smallest change is another home.
out=$("$strata" plan --model small --backend cpu --grad-accum 16 --micro-batch 8 --seq-len 256 \
      --device-mem-limit 200M --host-mem-limit 150M --stage 3 --offload-param nvme \
      --offload-optimizer nvme --nvme-path . --schedule layer --activation-home device 2>&1)
grep -q "smallest change that fits: --activation-home nvme" <<<"$out"
check "layer-major activations that do not fit their home suggest another home" $?
err=$("$strata" plan --model tiny --activation-home disk 2>&1 >/dev/null)
grep -q -- "--activation-home: expected auto, device, host or nvme, got 'disk'" <<<"$err"
check "bad --activation-home named" $?
err=$("$strata" plan --model tiny --schedule sideways 2>&1 >/dev/null)
grep -q -- "--schedule: expected auto, micro_batch or layer, got 'sideways'" <<<"$err"; check "bad --schedule named" $?

# Llama 3 70B in bf16 on one 80 GB GPU with 256 GB of host memory and NVMe:
# the fp32 gradients do not fit the host with everything else, so auto puts
# them on NVMe (exact), and the plan fits (on a node with 4 TB of NVMe).
nvme_dir=$(mktemp -d)
trap 'rm -rf "$nvme_dir"' EXIT
nvme=(--nvme-path "$nvme_dir" --nvme-limit 4T)
out=$("$strata" plan --model llama3-70b --precision bf16 --stage 3 --offload-param nvme \
      --offload-optimizer nvme --device-mem-limit 80G --host-mem-limit 256G "${nvme[@]}" --json)
check "llama3-70b on one GPU with NVMe fits" $?
home=$(echo "$out" | json_get 'd["gradient_home"]')
[ "$home" = "nvme" ]; check "auto puts its gradients on NVMe ($home)" $?
fp32_read=$(echo "$out" | json_get 'd["traffic"]["nvme_read_bytes"]')
out=$("$strata" plan --model llama3-70b --precision bf16 --stage 3 --offload-param nvme \
      --offload-optimizer nvme --device-mem-limit 80G --host-mem-limit 256G \
      --optimizer-state-dtype int8 "${nvme[@]}" --json)
int8_read=$(echo "$out" | json_get 'd["traffic"]["nvme_read_bytes"]')
[ "$int8_read" -lt "$fp32_read" ]; check "int8 state reads less from NVMe ($int8_read < $fp32_read)" $?
out=$("$strata" plan --model llama3-70b --precision bf16 --stage 3 --offload-param nvme \
      --offload-optimizer nvme --device-mem-limit 80G --host-mem-limit 256G "${nvme[@]}")
grep -q "gradients on NVMe, fp32 (auto: " <<<"$out"; check "the table says where the gradients went and why" $?
grep -q "model states per parameter (node, bytes): " <<<"$out"; check "bytes per parameter of each state" $?
err=$("$strata" plan --model tiny --gradient-home nvme --offload-optimizer cpu 2>&1 >/dev/null)
grep -q "strata.gradient_home nvme" <<<"$err"; check "NVMe gradients without the optimizer on NVMe refused" $?

# Across nodes (the issue's two plans): host memory and NVMe per node, the
# collectives within each node and then across the nodes, traffic per link.
if "$strata" --version | grep -q "CUDA backend: not built"; then backend=cpu; else backend=cuda; fi
backend=${STRATA_TEST_BACKEND:-$backend}  # cpu: what a build without CUDA runs
predict=(); [ "$backend" = cuda ] && predict=(--hardware h100-sxm)
links=(--net-bw 450GB/s --internode-bw 50GB/s --pcie-bw 54.4GB/s --nvme-bw 7GB/s)
node=(--device-mem-limit 80GB --host-mem-limit 1TB --nvme-path "$nvme_dir" --nvme-limit 1TB)
out=$("$strata" plan --model llama3-70b --backend $backend --precision bf16 --stage 3 \
      --offload-optimizer cpu --nodes 2 --gpus-per-node 8 "${node[@]}" "${links[@]}")
check "llama3-70b on 2 nodes x 8 GPUs fits" $?
grep -q "world size 16 (2 nodes x 8 ranks)" <<<"$out" &&
  grep -q "^  host    needs .* (per node, given): fits" <<<"$out" &&
  grep -q "^traffic per step and rank (collectives within each node of 8 ranks, then across the 2 nodes)" <<<"$out" &&
  grep -q "^  intra-node  .* at 419.10 GiB/s: " <<<"$out" && grep -q "^  inter-node  .* at 46.57 GiB/s: " <<<"$out" &&
  grep -q "^  slowest link: [A-Za-z-]* (.* per step)" <<<"$out"
check "llama3-70b 2x8 prints per-node budgets, traffic per link and the slowest" $?
out=$("$strata" plan --model llama3-70b --backend $backend --precision bf16 --stage 3 \
      --offload-optimizer cpu --nodes 2 --gpus-per-node 8 "${node[@]}" "${links[@]}" --json)
python3 -c '
import json, sys
d = json.loads(sys.argv[1]); t = d["traffic"]
assert (d["nodes"], d["ranks_per_node"], d["world_size"]) == (2, 8, 16), d["nodes"]
# A ring within the node carries n(g - 1) = 14 parts of every 15 a flat ring sends, one across nodes 1.
assert t["intra_node_bytes"] == 14 * t["inter_node_bytes"], t
assert t["collective_bytes"] == t["intra_node_bytes"] + t["inter_node_bytes"], t
assert t["slowest_link"] in ("intra-node", "inter-node", "PCIe", "NVMe"), t
' "$out"
check "llama3-70b 2x8 --json: bytes per link, 14 to 1 within and across nodes" $?
out=$("$strata" plan --model llama3.1-405b --backend $backend --precision bf16 --stage 3 \
      --offload-param cpu --offload-optimizer nvme --optimizer-state-dtype bf16 \
      --nodes 4 --gpus-per-node 8 "${node[@]}" "${links[@]}" "${predict[@]}")
status=$?
[ "$backend" = cpu ] || [ $status -eq 0 ]; check "llama3.1-405b on 4 nodes x 8 GPUs fits (bf16 m and v)" $?
grep -q "^strata plan: llama3.1-405b (405.85 B parameters, 128 units)" <<<"$out" &&
  grep -q "^  inter-node  .* at 46.57 GiB/s: " <<<"$out" &&
  grep -q "^  slowest link: [A-Za-z-]* (.* per step)" <<<"$out"
check "llama3.1-405b 4x8 prints traffic per link and the slowest" $?
if [ "$backend" = cuda ]; then
  grep -q "^  slowest link: NVMe" <<<"$out" && grep -q "resources busy per step: .*inter-node link" <<<"$out" &&
    grep -q "bytes per step and rank: .*intra-node .*; inter-node " <<<"$out"
  check "llama3.1-405b 4x8: NVMe bounds its traffic, the prediction costs both links" $?
fi
# Without bf16 state it does not fit four such nodes; the suggestion is more nodes.
out=$("$strata" plan --model llama3.1-405b --backend $backend --precision bf16 --stage 3 \
      --offload-param cpu --offload-optimizer nvme --nodes 4 --gpus-per-node 8 "${node[@]}")
[ $? -eq 1 ] && grep -q "^  nvme    needs .* (per node, given): DOES NOT FIT" <<<"$out"
check "llama3.1-405b 4x8 with fp32 m and v overflows each node's NVMe" $?
# The world's shape: one line naming both when they disagree.
err=$("$strata" plan --model tiny --nodes 2 --gpus-per-node 8 --world-size 8 2>&1 >/dev/null)
[ $? -eq 2 ] && [ "$(echo "$err" | wc -l)" -eq 1 ] &&
  grep -q -- "--world-size 8 disagrees with --nodes 2 x --gpus-per-node 8 = 16 ranks" <<<"$err"
check "--world-size that disagrees with --nodes x --gpus-per-node refused in one line" $?
err=$("$strata" plan --model tiny --world-size 6 --gpus-per-node 4 2>&1 >/dev/null)
[ $? -eq 2 ] && [ "$(echo "$err" | wc -l)" -eq 1 ] && grep -q -- "--gpus-per-node 4: world size 6" <<<"$err"
check "a world that is not whole nodes refused in one line" $?
err=$("$strata" plan --model tiny --nodes 0 2>&1 >/dev/null)
[ $? -eq 2 ] && grep -q -- "--nodes 0: a plan needs at least one node" <<<"$err"; check "--nodes 0 refused" $?
err=$("$strata" plan --model tiny --nodes 2 --gpus-per-node 1 --internode-bw fast 2>&1 >/dev/null)
[ $? -eq 2 ] && grep -q -- "--internode-bw" <<<"$err"; check "bad --internode-bw named" $?
out=$("$strata" plan --model tiny --world-size 4 --gpus-per-node 2 --json)
python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert (d["nodes"], d["ranks_per_node"]) == (2, 2)' "$out"
check "--world-size with --gpus-per-node gives the nodes" $?

# Pieces smaller than a layer (the README's figures): a GPT-3-shaped Llama of
# 172B parameters plans to fit one 24 GB GPU in bf16 at 1 x 4096 tokens with
# everything on NVMe once `auto` cuts its layers and vocabulary (the saved
# inputs spilled to host memory), and does not in whole units; at 1 x 2048
# tokens whole layers fit once their saved inputs are spilled, and do not
# with the saved inputs kept on the device; the mixtures' presets fit one 80
# GB GPU.
if [ "$backend" = cuda ]; then
  gpt3="$nvme_dir"
  echo '{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 12288,
    "intermediate_size": 36864, "num_hidden_layers": 100, "num_attention_heads": 96,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": false}' >"$gpt3/gpt3-172b.json"
  gpt3_flags=(--model "$gpt3/gpt3-172b.json" --backend cuda --precision bf16 --stage 3
              --offload-param nvme --offload-optimizer nvme --micro-batch 1
              --device-mem-limit 24G --host-mem-limit 256G --nvme-limit 8T --nvme-path "$gpt3")
  out=$("$strata" plan "${gpt3_flags[@]}" --seq-len 4096)
  [ $? -eq 0 ] && grep -q "^  vocabulary chunks: 2 (auto" <<<"$out" &&
    grep -q "^  layer pieces: 2 (auto" <<<"$out" && grep -q "^  verdict: fits" <<<"$out" &&
    grep -q "^schedule: micro_batch: .*, saved inputs in host memory (the device has no room" <<<"$out"
  check "a 172B GPT-3-shaped Llama fits one 24 GB GPU in pieces" $?
  out=$("$strata" plan "${gpt3_flags[@]}" --seq-len 4096 --layer-pieces 1 --vocab-chunks 1)
  [ $? -eq 1 ] && grep -q "^  device  needs .*: DOES NOT FIT" <<<"$out"
  check "the same in whole units does not fit" $?
  out=$("$strata" plan "${gpt3_flags[@]}" --seq-len 2048 --layer-pieces 1)
  [ $? -eq 0 ] && grep -q "^  saved inputs spilled (99 levels) " <<<"$out" &&
    grep -q "^  verdict: fits" <<<"$out"
  check "at 2048 tokens whole layers fit with their saved inputs spilled" $?
  out=$("$strata" plan "${gpt3_flags[@]}" --seq-len 2048 --layer-pieces 1 --activation-home device)
  [ $? -eq 1 ] && grep -q "smallest change that fits: --activation-home host" <<<"$out"
  check "kept on the device they do not, and the plan says where they would fit" $?
  for preset in qwen3-30b-a3b mixtral-8x7b; do
    out=$("$strata" plan --model $preset --backend cuda --precision bf16 --stage 3 --offload-param cpu \
          --offload-optimizer nvme --device-mem-limit 80G --host-mem-limit 256G --nvme-limit 4T \
          --nvme-path "$gpt3")
    [ $? -eq 0 ] && grep -q "^  verdict: fits" <<<"$out"
    check "$preset fits one 80 GB GPU with 256 GB host and NVMe" $?
  done
fi

finish_checks
