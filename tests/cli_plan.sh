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
zero=$(echo "$out" | json_get 'd["traffic"]["collective_bytes_zero"]')
[ "$zero" = "$((3 * 2 * 30000000000))" ]; check "stage 3 collective volume is 3 psi ($zero)" $?
per=$(echo "$out" | json_get 'round(d["bytes_per_parameter"]["device"], 2)')
[ "$per" = "18.0" ]; check "bf16 states on the device: 18 bytes per parameter on the node ($per)" $?
bw=$(echo "$out" | json_get 'int(d["traffic"]["net_bandwidth"])')
[ "$bw" = "50000000000" ]; check "--net-bw 50GB/s is read" $?

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
out=$("$strata" plan --model tiny --schedule --stage 3 --offload-param nvme --offload-optimizer nvme \
      --nvme-path . --world-size 2 --grad-accum 2 --micro-batch 1 2>&1)
grep -q "fetch(layers.0) mb 0 .* io" <<<"$out" && grep -q "gather(head) mb 1" <<<"$out" &&
  grep -q "^ *[0-9]* *exchange" <<<"$out" && grep -q "optimizer(embedding)" <<<"$out"
check "--schedule prints every kind of operation" $?
grep -q "NVMe traffic per step and rank: [0-9.]* [KM]iB read" <<<"$out"; check "--schedule prints NVMe traffic" $?
"$strata" plan --model tiny --schedule --json --stage 3 --world-size 2 | python3 -c 'import json,sys; j=json.load(sys.stdin); assert j["ops"] and j["peak_bytes"]["device"] > 0'
check "--schedule --json parses" $?
# The schedule for a GPU, planned on any machine: the state stays off the device when offloaded,
# ZeRO-Offload keeps the parameters there and passes the CPU optimizer's output through host memory.
if "$strata" --version | grep -q "CUDA backend: not built"; then
  "$strata" plan --model tiny --schedule --backend cuda --stage 3 --offload-param cpu \
    --offload-optimizer cpu 2>&1 >/dev/null | grep -q "built without CUDA"
  check "--schedule --backend cuda refused by a CPU-only build" $?
else
  out=$("$strata" plan --model tiny --schedule --backend cuda --stage 3 --offload-param cpu --offload-optimizer cpu)
  grep -q "device parameter slots" <<<"$out" && ! grep -qE "^ *device .*(Adam|fp32 master|parameters \()" <<<"$out"
  check "--schedule --backend cuda: a device working set, the state off the device" $?
  out=$("$strata" plan --model tiny --schedule --backend cuda --stage 2 --world-size 2 --offload-optimizer cpu)
  grep -qE "^ *device .*parameters \(" <<<"$out" && grep -qE "^ *host .*Adam m" <<<"$out" &&
    grep -q "new parameters on their way to the GPU" <<<"$out" &&
    grep -q "parameter all-gather staging" <<<"$out" && ! grep -q "device parameter slots" <<<"$out"
  check "--schedule --backend cuda: ZeRO-Offload keeps the parameters on the device" $?
fi
err=$("$strata" plan --params 7B --schedule 2>&1 >/dev/null)
grep -q -- "--schedule needs --model" <<<"$err"; check "--schedule without a model refused" $?

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

finish_checks
