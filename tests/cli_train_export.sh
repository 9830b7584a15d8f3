#!/usr/bin/env bash
# `strata train --export` then `--init`: the exported weights are the final
# state (a run started from them sees, at its first step, the loss the
# finished run's weights give on that batch), and --init followed by --export
# with no steps writes back the same bytes. A directory export loads too.
# Usage: cli_train_export.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$strata" demo-data --out "$dir/data" --tokens 50000 --val-tokens 2000 >/dev/null

# One rank, one micro-batch per step: the eval batch (sequences 0-1 of the
# file) is the batch a fresh run's first step reads.
common=(--model tiny --backend cpu --seq-len 32 --micro-batch 2 --data "$dir/data/train.bin")
"$strata" train "${common[@]}" --steps 5 --zero-stage 3 --offload-optimizer nvme --nvme-path "$dir/swap" \
  --eval-data "$dir/data/train.bin" --eval-batches 1 --metrics "$dir/a.jsonl" \
  --export "$dir/a.safetensors" >"$dir/out" 2>"$dir/err"
check "train with --export exits 0" $?
grep -q "exported the weights (F32) to $dir/a.safetensors" "$dir/out"; check "export reported" $?
python3 - "$dir/a.safetensors" <<'PY'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + n])
names = set(header) - {"__metadata__"}
assert "model.embed_tokens.weight" in names and "lm_head.weight" in names, names
assert "model.layers.1.mlp.down_proj.weight" in names and "model.norm.weight" in names
assert all(v["dtype"] == "F32" for k, v in header.items() if k != "__metadata__")
PY
check "export: Hugging Face names, F32" $?

"$strata" train "${common[@]}" --steps 1 --init "$dir/a.safetensors" --metrics "$dir/b.jsonl" >/dev/null 2>"$dir/err"
check "train with --init exits 0" $?
python3 - "$dir/a.jsonl" "$dir/b.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
final, first = a[-1]["eval_loss"], b[0]["loss"]
assert abs(final - first) <= 1e-5 * final, (final, first)
assert first < a[0]["loss"] - 0.3, (a[0]["loss"], first)
PY
check "first loss from --init equals the exported state's loss on that batch" $?

"$strata" train "${common[@]}" --steps 0 --init "$dir/a.safetensors" --export "$dir/c.safetensors" >/dev/null 2>"$dir/err"
check "--steps 0 --init --export exits 0" $?
cmp -s "$dir/a.safetensors" "$dir/c.safetensors"; check "re-exported weights are byte-identical" $?

"$strata" train "${common[@]}" --steps 0 --init "$dir/a.safetensors" --export "$dir/hf" --export-dtype bf16 \
  >/dev/null 2>"$dir/err"
[ -f "$dir/hf/config.json" ] && [ -f "$dir/hf/model.safetensors" ]; check "directory export: config.json + model.safetensors" $?
"$strata" train "${common[@]}" --steps 1 --init "$dir/hf" >/dev/null 2>"$dir/err"
check "a bf16 Hugging Face directory loads with --init" $?

"$strata" train "${common[@]}" --steps 1 --init "$dir/absent.safetensors" >/dev/null 2>"$dir/err"
status=$?
[ $status -ne 0 ] && grep -q "absent.safetensors" "$dir/err" && [ "$(wc -l <"$dir/err")" -eq 1 ]
check "a missing --init file is one line naming it" $?
"$strata" train "${common[@]}" --steps 1 --export "$dir/no/such/dir/x.safetensors" >/dev/null 2>"$dir/err"
[ $? -eq 2 ] && grep -q "does not exist" "$dir/err"; check "an --export into a missing directory is refused before training" $?

# A mixture of experts (mixtral, 4 experts, top 2, the load-balancing loss in
# the loss) trains from the command line, reports its load-balancing loss, and
# exports under the released per-expert names; a run from the export starts
# where the first ended.
cat >"$dir/moe.json" <<'JSON'
{"model_type": "mixtral", "vocab_size": 256, "hidden_size": 48, "intermediate_size": 40,
 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
 "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": true,
 "router_aux_loss_coef": 0.05}
JSON
moe=(--model "$dir/moe.json" --backend cpu --seq-len 32 --micro-batch 2 --grad-accum 2 --data "$dir/data/train.bin")
"$strata" train "${moe[@]}" --steps 4 --zero-stage 3 --offload-param nvme --offload-optimizer nvme \
  --nvme-path "$dir/swap" --eval-data "$dir/data/train.bin" --eval-batches 1 --metrics "$dir/moe.jsonl" \
  --export "$dir/moe-hf" >"$dir/out" 2>"$dir/err"
check "a mixture trains with everything on NVMe" $?
grep -q " aux " "$dir/out"; check "the progress line shows the load-balancing loss" $?
python3 - "$dir/moe.jsonl" "$dir/moe-hf" <<'PY'
import json, os, struct, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
assert all(2.0 * 0.5 < l["aux_loss"] <= 4.0 for l in lines), [l["aux_loss"] for l in lines]
data = open(os.path.join(sys.argv[2], "model.safetensors"), "rb").read()
names = set(json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])) - {"__metadata__"}
for e in range(4):
    for w in ("w1", "w2", "w3"):
        assert f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" in names, (e, w)
assert "model.layers.0.block_sparse_moe.gate.weight" in names
config = json.load(open(os.path.join(sys.argv[2], "config.json")))
assert config["architectures"] == ["MixtralForCausalLM"] and config["num_local_experts"] == 4, config
PY
check "aux_loss in the metrics; the export under the released expert names" $?
"$strata" train "${moe[@]}" --steps 1 --init "$dir/moe-hf" --metrics "$dir/moe-b.jsonl" >/dev/null 2>"$dir/err"
check "a mixture's export loads with --init" $?
python3 - "$dir/moe.jsonl" "$dir/moe-b.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert b[0]["loss"] < a[0]["loss"], (a[0]["loss"], b[0]["loss"])
PY
check "the run from the export starts below the first run's first loss" $?

# The embedding and the head cut along the vocabulary: the plan lists the
# chunks, training saves a checkpoint whose export (and --export) holds the
# whole tensors, and a tied model is refused in one line.
cat >"$dir/untied.json" <<'JSON'
{"model_type": "llama", "vocab_size": 300, "hidden_size": 32, "intermediate_size": 48,
 "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
 "max_position_embeddings": 64, "tie_word_embeddings": false}
JSON
placed=(--model "$dir/untied.json" --backend cpu --seq-len 32 --micro-batch 2 --zero-stage 3
        --offload-param nvme --offload-optimizer nvme --nvme-path "$dir/swap")
cut=("${placed[@]}" --data "$dir/data/train.bin")
"$strata" plan "${placed[@]}" --vocab-chunks 3 --ops >"$dir/out" 2>"$dir/err"
check "strata plan --vocab-chunks exits 0" $?
grep -q "gather(head.2)" "$dir/out" && grep -q "logits of the vocabulary-cut head" "$dir/out"
check "the plan lists the chunks and their logits" $?
"$strata" train "${cut[@]}" --steps 3 --vocab-chunks 3 --save "$dir/cut-ck" --metrics "$dir/cut.jsonl" \
  --export "$dir/cut.safetensors" >"$dir/out" 2>"$dir/err"
check "a run with --vocab-chunks 3 trains, saves and exports" $?
"$strata" train "${cut[@]}" --steps 3 --metrics "$dir/whole.jsonl" --export "$dir/whole.safetensors" \
  >/dev/null 2>"$dir/err"
check "the same run with whole units" $?
"$strata" export "$dir/cut-ck" --out "$dir/cut-hf" >/dev/null 2>"$dir/err"
check "strata export of the cut run's checkpoint" $?
python3 - "$dir/cut.safetensors" "$dir/whole.safetensors" "$dir/cut-hf/model.safetensors" \
  "$dir/cut.jsonl" "$dir/whole.jsonl" <<'PY'
import json, struct, sys
def header(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    return {k: v["shape"] for k, v in json.loads(data[8:8 + n]).items() if k != "__metadata__"}
cut, whole, exported = header(sys.argv[1]), header(sys.argv[2]), header(sys.argv[3])
assert cut == whole == exported, (cut, whole)
assert cut["model.embed_tokens.weight"] == [300, 32] and cut["lm_head.weight"] == [300, 32]
a = [json.loads(l)["loss"] for l in open(sys.argv[4])]
b = [json.loads(l)["loss"] for l in open(sys.argv[5])]
assert all(abs(x - y) <= 1e-5 * y for x, y in zip(a, b)), (a, b)
PY
check "whole tensors in both exports; the losses agree with whole units" $?
sed 's/"tie_word_embeddings": false/"tie_word_embeddings": true/' "$dir/untied.json" >"$dir/tied.json"
err=$("$strata" train --model "$dir/tied.json" --backend cpu --seq-len 32 --micro-batch 2 \
  --data "$dir/data/train.bin" --steps 1 --vocab-chunks 2 2>&1 >/dev/null)
status=$?
[ $status -ne 0 ] && grep -q "tie_word_embeddings" <<<"$err" && [ "$(echo "$err" | wc -l)" -eq 1 ]
check "a tied model with --vocab-chunks is refused in one line" $?

# Each layer's attention and MLP as units of their own: the plan lists the
# pieces, a run trains, saves, resumes whole and exports the same tensors,
# with the losses of whole layers (gradient_clipping is off by default: bitwise).
"$strata" plan "${placed[@]}" --layer-pieces 2 --ops >"$dir/out" 2>"$dir/err" &&
  "$strata" plan "${placed[@]}" --layer-pieces 2 >"$dir/table" 2>>"$dir/err"
check "strata plan --layer-pieces exits 0" $?
grep -q "gather(layers.1.mlp)" "$dir/out" && grep -q "layer pieces: 2 (given)" "$dir/table"
check "the plan lists the pieces" $?
"$strata" train "${cut[@]}" --steps 3 --layer-pieces 2 --save "$dir/pieces-ck" \
  --metrics "$dir/pieces.jsonl" --export "$dir/pieces.safetensors" >"$dir/out" 2>"$dir/err"
check "a run with --layer-pieces 2 trains, saves and exports" $?
grep -q "^layer pieces: 2 (given)" "$dir/out"
check "train says the layers are in pieces" $?
"$strata" train "${cut[@]}" --steps 4 --layer-pieces 1 --resume "$dir/pieces-ck" \
  --metrics "$dir/resumed.jsonl" >/dev/null 2>"$dir/err"
check "whole layers resume the pieces' checkpoint" $?
python3 - "$dir/pieces.safetensors" "$dir/whole.safetensors" "$dir/pieces.jsonl" \
  "$dir/whole.jsonl" "$dir/resumed.jsonl" <<'PY'
import json, struct, sys
def header(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    return {k: v["shape"] for k, v in json.loads(data[8:8 + n]).items() if k != "__metadata__"}
assert header(sys.argv[1]) == header(sys.argv[2])
a = [json.loads(l)["loss"] for l in open(sys.argv[3])]
b = [json.loads(l)["loss"] for l in open(sys.argv[4])]
assert a == b, (a, b)
resumed = [json.loads(l) for l in open(sys.argv[5])]
assert [r["step"] for r in resumed] == [4], resumed
PY
check "the pieces' losses are whole layers' bits; the resume goes on at step 4" $?
err=$("$strata" train "${cut[@]}" --steps 1 --layer-pieces 3 2>&1 >/dev/null)
status=$?
[ $status -ne 0 ] && grep -q "\-\-layer-pieces: expected auto, 1 or 2, got '3'" <<<"$err" &&
  [ "$(echo "$err" | wc -l)" -eq 1 ]
check "--layer-pieces 3 is refused in one line" $?

finish_checks
