#!/usr/bin/env bash
# A mixture's expected NVMe reads from a run's routing: `strata train
# --metrics` records each step's routing when the experts are read as routed,
# and `strata plan --routing FILE` replays it; with the optimizer in host
# memory every NVMe read is a parameter's, so the plan's mean is the run's.
# With the optimizer on NVMe and --expert-update deferred, the replay counts
# fewer bytes per step than the eager update's; with a hardware profile the
# step-time model predicts each recorded step from its own bytes, below the
# worst case. Refusals name what to change, in one line.
# Usage: cli_plan_routing.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$strata" demo-data --out "$dir/data" --tokens 20000 --val-tokens 2000 >/dev/null

# 8 experts, top 1, 8 tokens a micro-batch: each micro-batch reaches few experts.
cat >"$dir/moe.json" <<'JSON'
{"model_type": "mixtral", "vocab_size": 256, "hidden_size": 48, "intermediate_size": 64,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "num_local_experts": 8, "num_experts_per_tok": 1, "output_router_logits": true,
 "router_aux_loss_coef": 0.02}
JSON
base=(--model "$dir/moe.json" --backend cpu --seq-len 8 --micro-batch 1 --zero-stage 3
  --offload-param nvme --offload-optimizer cpu --nvme-path "$dir/swap")
shape=("${base[@]}" --grad-accum 3 --layer-pieces 2)
"$strata" train "${shape[@]}" --data "$dir/data/train.bin" --steps 4 --hardware none \
  --metrics "$dir/m.jsonl" >"$dir/out" 2>"$dir/err"
check "a routed run trains" $?
grep -q "expert fetch: routed" "$dir/out"; check "train says the experts are read as routed" $?

"$strata" plan "${shape[@]}" --routing "$dir/m.jsonl" --json >"$dir/plan.json" 2>"$dir/err"
check "strata plan --routing exits 0" $?
python3 - "$dir/m.jsonl" "$dir/plan.json" <<'PY'
import json, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
assert all(len(s["routing"]) == 2 for s in steps), steps[0].get("routing")
masks = [m for s in steps for unit in s["routing"].values() for m in unit]
assert all(len(m) == 8 and set(m) <= {"0", "1"} for m in masks), masks
assert any("0" in m for m in masks), "every expert reached: the check shows nothing"
read = [s["nvme_read_bytes"] for s in steps]
r = json.load(open(sys.argv[2]))["recorded_routing"]
assert r["steps"] == len(steps), r
assert r["mean_parameter_read_bytes"] == sum(read) // len(read), (r, read)
assert r["least_parameter_read_bytes"] == min(read) and r["most_parameter_read_bytes"] == max(read), (r, read)
assert r["most_parameter_read_bytes"] < r["worst_parameter_read_bytes"], r
PY
check "the plan's replay of the recorded routing is the run's NVMe reads" $?
"$strata" plan "${shape[@]}" --routing "$dir/m.jsonl" >"$dir/table" 2>"$dir/err" &&
  grep -q "NVMe parameter reads per step with the routing .* recorded (4 steps): mean" "$dir/table"
check "the table prints the recorded case" $?

# Deferred expert updates: with the optimizer on NVMe an expert no token
# reached waits for its steps; the replay of the routing counts fewer bytes
# per step than the eager update's, and a worst step that replays every expert.
deferred=(--model "$dir/moe.json" --backend cpu --seq-len 8 --micro-batch 1 --zero-stage 3
  --offload-param nvme --offload-optimizer nvme --nvme-path "$dir/swap" --grad-accum 3
  --layer-pieces 2)
"$strata" train "${deferred[@]}" --expert-update deferred --data "$dir/data/train.bin" --steps 4 \
  --hardware none --metrics "$dir/d.jsonl" >"$dir/dout" 2>"$dir/err"
check "a run with deferred expert updates trains" $?
grep -q "expert update: deferred" "$dir/dout"; check "train says the updates are deferred" $?
"$strata" plan "${deferred[@]}" --expert-update deferred --routing "$dir/d.jsonl" --json \
  >"$dir/dplan.json" 2>"$dir/err" &&
  "$strata" plan "${deferred[@]}" --routing "$dir/d.jsonl" --json >"$dir/eplan.json" 2>"$dir/err"
check "strata plan --routing replays both updates" $?
python3 - "$dir/dplan.json" "$dir/eplan.json" <<'PY'
import json, sys
d, e = (json.load(open(f)) for f in sys.argv[1:3])
assert d["expert_update"].startswith("deferred:"), d["expert_update"]
assert e["expert_update"].startswith("eager:"), e["expert_update"]
rd, re_ = d["recorded_routing"], e["recorded_routing"]
assert rd["mean_parameter_read_bytes"] == re_["mean_parameter_read_bytes"], (rd, re_)
moved = lambda r: r["mean_nvme_read_bytes"] + r["mean_nvme_written_bytes"]
assert moved(rd) < moved(re_), (rd, re_)
assert rd["worst_nvme_written_bytes"] > re_["worst_nvme_written_bytes"], (rd, re_)
assert rd["most_nvme_read_bytes"] <= rd["worst_nvme_read_bytes"], rd
assert rd["most_nvme_written_bytes"] <= rd["worst_nvme_written_bytes"], rd
# Each plan replays the routing under the other update too: the other plan's own figures.
keys = [k for k in rd if k.endswith("nvme_read_bytes") or k.endswith("nvme_written_bytes")]
for plan, other, name in ((re_, rd, "deferred"), (rd, re_, "eager")):
    o = plan["other_expert_update"]
    assert o["expert_update"] == name and o["changes_plan"] and o["fits"], o
    assert all(o[k] == other[k] for k in keys), (o, other)
PY
check "deferred updates move fewer bytes for the recorded routing" $?
"$strata" plan "${deferred[@]}" --routing "$dir/d.jsonl" >"$dir/etable" 2>"$dir/err" &&
  grep -q "with --expert-update deferred instead: NVMe per step read mean .*% of this plan's" \
    "$dir/etable"
check "the eager plan's table prints what deferred updates would move" $?
# At two ranks (threads) each rank moves its shard's part: the plan's
# recorded steps, the most any one rank moves, lie between the run's mean
# per rank and its mean for both ranks, and within the worst step.
"$strata" train "${deferred[@]}" --expert-update deferred --data "$dir/data/train.bin" --steps 4 \
  --hardware none --world-size 2 --metrics "$dir/d2.jsonl" >"$dir/d2out" 2>"$dir/err" &&
  "$strata" plan "${deferred[@]}" --expert-update deferred --world-size 2 \
    --routing "$dir/d2.jsonl" --json >"$dir/d2plan.json" 2>"$dir/err"
check "deferred updates at 2 ranks train, and strata plan --routing replays them" $?
python3 - "$dir/d2out" "$dir/d2plan.json" <<'PY'
import json, re, sys
units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
m = re.search(r"^nvme: read ([0-9.]+) (\w+), written ([0-9.]+) (\w+)", open(sys.argv[1]).read(), re.M)
read, written = float(m[1]) * units[m[2]] / 4, float(m[3]) * units[m[4]] / 4  # a step, both ranks
r = json.load(open(sys.argv[2]))["recorded_routing"]
assert r["steps"] == 4, r
for mean, worst, run in (("mean_nvme_read_bytes", "worst_nvme_read_bytes", read),
                         ("mean_nvme_written_bytes", "worst_nvme_written_bytes", written)):
    # one rank's: about half the two ranks' bytes, not their sum
    assert run / 2 * 0.99 <= r[mean] <= run * 0.75, (mean, r[mean], run)
    assert r[mean] <= r[worst], (mean, r)
PY
check "at 2 ranks the recorded steps' bytes are one rank's part of the run's" $?
# Where the flag would change nothing the plan says so, with the reason.
if ! "$strata" --version | grep -q "CUDA backend: not built"; then
  "$strata" plan --model "$dir/moe.json" --backend cuda --seq-len 8 --micro-batch 1 \
    --zero-stage 3 --offload-param nvme --offload-optimizer none --nvme-path "$dir/swap" \
    --grad-accum 3 --layer-pieces 2 --routing "$dir/d.jsonl" >"$dir/gtable" 2>"$dir/err" && grep -q "^--expert-update deferred would not change this \
plan: eager: .*(the optimizer state is on the GPU" "$dir/gtable"
  check "a GPU-homed optimizer: the other update would change nothing, and why" $?
fi
"$strata" plan "${deferred[@]}" --expert-update deferred --routing "$dir/d.jsonl" >"$dir/dtable" \
  2>"$dir/err" && grep -q "NVMe per step with that routing and deferred expert updates" "$dir/dtable"
check "the table prints the deferred case" $?

# With a hardware profile the step-time model predicts each recorded step with
# its own bytes: on average below the worst case's prediction. This machine's
# probe must work (a CPU plan takes a CPU profile); the comparison runs on
# that profile with fixed figures (NVMe at 50 us a request), because a probe
# measured while other tests run can find a drive slow to answer, and a
# routed step reads its experts in more reads on the compute lane than the
# worst case (each micro-batch's forward reads the experts new to it, where
# the worst case's first forward reads them all), each costing the drive's
# latency there: at 5 ms a request the recorded routing's mean is
# predicted 7% above the worst case (measured with this test's run), as the
# engine would wait for those reads too.
"$strata" plan "${deferred[@]}" --expert-update deferred --routing "$dir/d.jsonl" \
  --probe --probe-out "$dir/probe.json" --json >"$dir/hplan.json" 2>"$dir/err"
probed=$?
[ $probed -eq 0 ] || cat "$dir/err"
check "strata plan --routing --probe exits 0" $probed
python3 - "$dir/probe.json" "$dir/fixed.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
p["name"] = "fixed figures"
p["compute"]["matmul_tflops"]["fp32"] = 0.02
p["compute"]["memory_gbps"] = p["host"]["memcpy_gbps"] = 20.0
u = p["cpu_units"]
u["layer_forward_gflops"] = u["layer_backward_gflops"] = u["head_gflops"] = 20.0
u["rank_shares"] = [1.0, 0.5, 0.34, 0.25]
p["host"]["adamw_mparams_per_s"] = {"fp32": 2000.0, "bf16": 3000.0, "int8": 3000.0}
p["nvme"] = [{"read_gbps": 2.0, "write_gbps": 2.0, "latency_us": 50.0}]
json.dump(p, open(sys.argv[2], "w"))
PY
"$strata" plan "${deferred[@]}" --expert-update deferred --routing "$dir/d.jsonl" \
  --hardware "$dir/fixed.json" --json >"$dir/hplan.json" 2>"$dir/err"
check "strata plan --routing --hardware exits 0" $?
python3 - "$dir/hplan.json" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
worst = p["prediction"]["step_seconds"]
s = p["recorded_routing"]["predicted_seconds_per_step"]
print(f"predicted with the recorded routing {s}, worst case {worst}")
# (Each recorded step moves fewer bytes than the worst case; its simulated
# step is not bound to be shorter, as a list schedule's need not be when
# operations shorten, so only the mean is held below it.)
assert 0 < s["least"] <= s["mean"] <= s["most"], (s, worst)
assert s["mean"] < worst, (s, worst)
PY
check "the recorded routing's predicted step is shorter than the worst case's" $?
"$strata" plan "${deferred[@]}" --expert-update deferred --routing "$dir/d.jsonl" \
  --hardware "$dir/probe.json" >"$dir/htable" 2>"$dir/err" &&
  grep -q "^predicted with that routing: .* per step on average (least .*, most .*) over 4 steps" \
    "$dir/htable"
check "the table prints the recorded routing's prediction" $?

one_line_refusal() {  # NAME EXPECTED ARGS...
  local name="$1" expected="$2"
  shift 2
  local err
  err=$("$strata" plan "$@" 2>&1 >/dev/null)
  [ $? -eq 2 ] && grep -qF -- "$expected" <<<"$err" && [ "$(echo "$err" | wc -l)" -eq 1 ]
  check "$name" $?
}
one_line_refusal "another gradient accumulation is refused" "plan with --grad-accum 3" \
  "${base[@]}" --grad-accum 2 --layer-pieces 2 --routing "$dir/m.jsonl"
one_line_refusal "a plan that reads every expert is refused" "this plan reads every expert" \
  "${base[@]}" --grad-accum 3 --layer-pieces 1 --routing "$dir/m.jsonl"
one_line_refusal "a missing file is refused" "cannot open it" \
  "${shape[@]}" --routing "$dir/none.jsonl"
head -c 40 "$dir/m.jsonl" >"$dir/cut.jsonl"
one_line_refusal "a line cut short is refused with its number" "cut.jsonl line 1: not a JSON object" \
  "${shape[@]}" --routing "$dir/cut.jsonl"
"$strata" train "${shape[@]}" --data "$dir/data/train.bin" --steps 1 --hardware none --expert-fetch all \
  --metrics "$dir/all.jsonl" >/dev/null 2>&1
one_line_refusal "a run that recorded no routing is refused" "no step records a routing" \
  "${shape[@]}" --routing "$dir/all.jsonl"
one_line_refusal "an unknown --expert-update is refused" "--expert-update: expected eager or deferred" \
  "${deferred[@]}" --expert-update sometimes

finish_checks
