#!/usr/bin/env bash
# `strata prepare-data`: text and JSONL documents tokenized with a model
# directory's tokenizer.json into an llm.c token file (uint16, or uint32 when
# the vocabulary needs it) and a loss mask; the ids equal the fixture
# tokenizer's expected ids; --val-fraction, --append-eos, --no-special-tokens;
# `strata train --data` picks the mask up, says so, and counts only its
# targets (and --eval-data's in the validation loss); each input error is one line naming what and where, and leaves the
# outputs as they were.
# Chat JSONL is rendered with the model's chat template, only the assistant's
# tokens being targets.
# Usage: cli_prepare_data.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
root="$2"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fixtures="$root/tests/fixtures/tokenizers"

# A model directory: the Llama-kind test tokenizer and a small Llama of its vocabulary.
mkdir -p "$dir/model"
cp "$fixtures/llama3/tokenizer.json" "$fixtures/llama3/tokenizer_config.json" "$dir/model/"
cat >"$dir/model/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 700,
 "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
 "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
 "rope_theta": 10000.0, "tie_word_embeddings": false, "hidden_act": "silu"}
JSON

# Reads an llm.c shard: prints "width count id id ...".
read_shard() {
  python3 - "$1" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
magic, version, count = struct.unpack("<3i", data[:12])
width = {20240520: 2, 20240801: 4}[magic]
ids = struct.unpack(f"<{count}{'H' if width == 2 else 'I'}", data[1024:])
assert len(data) == 1024 + width * count
print(width, count, *ids)
PY
}

# Text: each file one document; its ids are those `tokenizers` gave (expected_ids.json).
python3 - "$fixtures/expected_ids.json" "$dir" <<'PY'
import json, sys
entries = json.load(open(sys.argv[1]))["llama3"]
chosen = [e for e in entries if len(e["text"]) > 10][:3]
for i, e in enumerate(chosen):
    open(f"{sys.argv[2]}/doc{i}.txt", "w", encoding="utf-8", newline="").write(e["text"])
open(f"{sys.argv[2]}/expected.txt", "w").write(" ".join(str(t) for e in chosen for t in e["ids"]))
with open(f"{sys.argv[2]}/docs.jsonl", "w", encoding="utf-8") as f:
    for e in chosen:
        f.write(json.dumps({"id": 1, "text": e["text"]}, ensure_ascii=False) + "\n\n")
PY
"$strata" prepare-data --model-dir "$dir/model" --input "$dir/doc0.txt" "$dir/doc1.txt" "$dir/doc2.txt" \
  --out "$dir/text" >"$dir/out" 2>"$dir/err"
check "text exits 0" $?
grep -q "prepare-data: 3 documents, .* tokens, 100.0% targets .*uint16, vocabulary 700" "$dir/out"
check "the summary names documents, tokens, targets and the dtype" $?
read -r width count ids < <(read_shard "$dir/text/train.bin")
[ "$width" = 2 ] && [ "$ids" = "$(cat "$dir/expected.txt")" ]
check "text: the ids of tokenizers, each document after <|begin_of_text|>" $?
[ "$(stat -c %s "$dir/text/train.mask")" = "$count" ] && python3 -c "
import sys; assert set(open(sys.argv[1], 'rb').read()) == {1}" "$dir/text/train.mask"
check "text: one mask byte per token, all targets" $?

"$strata" prepare-data --model-dir "$dir/model" --input "$dir/docs.jsonl" --format jsonl \
  --out "$dir/jsonl" >/dev/null 2>&1
cmp -s "$dir/jsonl/train.bin" "$dir/text/train.bin"
check "jsonl: the same documents give the same file (blank lines skipped)" $?

# --append-eos, --no-special-tokens, --val-fraction (every 1/F-th document).
python3 -c "
import json, sys
with open(sys.argv[1], 'w') as f:
    for i in range(40): f.write(json.dumps({'text': f'document {i} says hello'}) + '\n')" "$dir/many.jsonl"
"$strata" prepare-data --model-dir "$dir/model" --input "$dir/many.jsonl" --format jsonl --out "$dir/split" \
  --val-fraction 0.25 --append-eos --no-special-tokens >"$dir/out" 2>&1
check "--val-fraction exits 0" $?
grep -q "30 documents.*train.bin.*10 documents.*val.bin" "$dir/out"; check "a quarter of the documents go to val.bin" $?
bos=$(python3 -c "import json,sys; print([t['id'] for t in json.load(open(sys.argv[1]))['added_tokens'] if t['content']=='<|begin_of_text|>'][0])" "$dir/model/tokenizer.json")
eos=$(python3 -c "import json,sys; print([t['id'] for t in json.load(open(sys.argv[1]))['added_tokens'] if t['content']=='<|eot_id|>'][0])" "$dir/model/tokenizer.json")
read -r width count ids < <(read_shard "$dir/split/val.bin")
eos_count=$(echo "$ids" | tr ' ' '\n' | grep -cx "$eos")
[ "$eos_count" = 10 ] && ! grep -q " $bos " <<<" $ids " && [ "${ids##* }" = "$eos" ]
check "--append-eos ends each document with eos_token; --no-special-tokens drops the BOS" $?

# uint32 when the vocabulary needs it: an added token with id 70000.
mkdir -p "$dir/big"
python3 - "$dir/model/tokenizer.json" "$dir/big/tokenizer.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
t["added_tokens"].append({"id": 70000, "content": "<|big|>", "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True})
json.dump(t, open(sys.argv[2], "w"))
PY
printf 'a <|big|> b' >"$dir/big.txt"
"$strata" prepare-data --model-dir "$dir/big" --input "$dir/big.txt" --out "$dir/big/out" >"$dir/out" 2>&1
read -r width count ids < <(read_shard "$dir/big/out/train.bin")
[ "$width" = 4 ] && grep -q " 70000 " <<<" $ids " && grep -q "uint32, vocabulary 70001" "$dir/out"
check "a vocabulary past 65536 gives uint32 tokens" $?

# strata train picks train.mask up next to train.bin, says so, and counts only its targets.
python3 -c "
import json, sys
with open(sys.argv[1], 'w') as f:
    for i in range(300): f.write(json.dumps({'text': f'the model {i} learns from data while it runs'}) + '\n')" "$dir/train.jsonl"
"$strata" prepare-data --model-dir "$dir/model" --input "$dir/train.jsonl" --format jsonl --out "$dir/data" >/dev/null 2>&1
train=(train --model "$dir/model" --backend cpu --seq-len 32 --micro-batch 2 --steps 2 --data "$dir/data/train.bin")
"$strata" "${train[@]}" --metrics "$dir/all.jsonl" >"$dir/out" 2>"$dir/err"
check "train on prepared data exits 0" $?
grep -q "loss mask: $dir/data/train.mask (found next to --data): 100.0% of the tokens are targets" "$dir/out"
check "train names the mask it found" $?
python3 - "$dir/data/train.mask" <<'PY'
import sys
mask = bytearray(open(sys.argv[1], "rb").read())
for i in range(0, len(mask), 2): mask[i] = 0
open(sys.argv[1], "wb").write(mask)
PY
"$strata" "${train[@]}" --metrics "$dir/half.jsonl" >"$dir/out" 2>"$dir/err"
python3 -c "
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
h = [json.loads(l) for l in open(sys.argv[2])]
assert all(x['loss_tokens'] == 64 for x in a), a
assert all(x['loss_tokens'] == 32 for x in h), h" "$dir/all.jsonl" "$dir/half.jsonl"
check "masked positions do not count in the loss" $?
"$strata" "${train[@]}" --loss-mask none --metrics "$dir/none.jsonl" >"$dir/out" 2>&1
! grep -q "loss mask" "$dir/out" && python3 -c "
import json, sys; assert all(json.loads(l)['loss_tokens'] == 64 for l in open(sys.argv[1]))" "$dir/none.jsonl"
check "--loss-mask none ignores it" $?

# Chat: rendered with the template of tokenizer_config.json (a string, or the
# "default" of a list) or chat_template.jinja; only the assistant's reply and
# its end-of-turn token are targets.
cat >"$dir/chat.jsonl" <<'JSON'
{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]}
{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4, of course."}, {"role": "user", "content": "Thanks"}]}
JSON
# Prints the text of the target tokens of a prepared file, conversation by conversation.
targets_text() {
  python3 - "$1" "$2/train.bin" "$2/train.mask" <<'PY'
import json, struct, sys
t = json.load(open(sys.argv[1]))
chars = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
byte_of = {c: c for c in chars}
byte_of.update({256 + n: b for n, b in enumerate(b for b in range(256) if b not in chars)})
text = {i: bytes(byte_of[ord(c)] for c in tok) for tok, i in t["model"]["vocab"].items()}
text.update({a["id"]: a["content"].encode() for a in t["added_tokens"]})
data = open(sys.argv[2], "rb").read()
count = struct.unpack("<3i", data[:12])[2]
ids = struct.unpack(f"<{count}H", data[1024:])
mask = open(sys.argv[3], "rb").read()
print(repr(b"".join(text[i] if m else b"|" for i, m in zip(ids, mask)).decode()))
PY
}
"$strata" prepare-data --model-dir "$dir/model" --input "$dir/chat.jsonl" --format chat --out "$dir/chat" >"$dir/out" 2>&1
check "chat exits 0" $?
grep -q "2 documents, .* tokens, [0-9.]*% targets" "$dir/out" && ! grep -q "100.0% targets" "$dir/out"
check "chat: the summary gives the share of targets" $?
targets_text "$dir/model/tokenizer.json" "$dir/chat" | grep -q "|Paris.<|eot_id|>|*4, of course.<|eot_id|>|*'$"
check "chat: only the assistant's replies and their <|eot_id|> are targets" $?
mkdir -p "$dir/listed"
cp "$dir/model/tokenizer.json" "$dir/listed/"
python3 - "$dir/model/tokenizer_config.json" "$dir/listed/tokenizer_config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["chat_template"] = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
                      {"name": "default", "template": c["chat_template"]}]
json.dump(c, open(sys.argv[2], "w"))
PY
"$strata" prepare-data --model-dir "$dir/listed" --input "$dir/chat.jsonl" --format chat --out "$dir/listed/out" >/dev/null 2>&1 &&
  cmp -s "$dir/listed/out/train.bin" "$dir/chat/train.bin" && cmp -s "$dir/listed/out/train.mask" "$dir/chat/train.mask"
check "chat: the \"default\" template of a list" $?
mkdir -p "$dir/jinja"
cp "$dir/model/tokenizer.json" "$dir/jinja/"
python3 - "$dir/model/tokenizer_config.json" "$dir/jinja" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
open(sys.argv[2] + "/chat_template.jinja", "w").write(c.pop("chat_template"))
json.dump(c, open(sys.argv[2] + "/tokenizer_config.json", "w"))
PY
"$strata" prepare-data --model-dir "$dir/jinja" --input "$dir/chat.jsonl" --format chat --out "$dir/jinja/out" >/dev/null 2>&1 &&
  cmp -s "$dir/jinja/out/train.bin" "$dir/chat/train.bin"
check "chat: chat_template.jinja" $?

# The validation file's mask counts in the validation loss: half its targets kept,
# half the tokens counted; none kept is an error.
"$strata" prepare-data --model-dir "$dir/model" --input "$dir/train.jsonl" --format jsonl --out "$dir/vdata" \
  --val-fraction 0.5 >/dev/null 2>&1
eval_run=(train --model "$dir/model" --backend cpu --seq-len 32 --micro-batch 2 --steps 1
          --data "$dir/vdata/train.bin" --eval-data "$dir/vdata/val.bin" --eval-batches 2)
python3 - "$dir/vdata/val.mask" <<'PY'
import sys
mask = bytearray(open(sys.argv[1], "rb").read())
for i in range(0, len(mask), 2): mask[i] = 0
open(sys.argv[1], "wb").write(mask)
PY
"$strata" "${eval_run[@]}" >"$dir/out" 2>"$dir/err"
[ $? -eq 0 ] && grep -q "eval loss mask: $dir/vdata/val.mask (found next to --eval-data)" "$dir/out" &&
  grep -q "eval at step 1: loss [0-9.]* over 64 tokens" "$dir/out"
check "the eval file's mask: half of 2 x 2 x 32 targets counted" $?
python3 -c "import os, sys; n = os.path.getsize(sys.argv[1]); open(sys.argv[1], 'wb').write(bytes(n))" "$dir/vdata/val.mask"
"$strata" "${eval_run[@]}" >/dev/null 2>"$dir/err"
[ $? -eq 1 ] && grep -q "keeps no target" "$dir/err" && [ "$(wc -l <"$dir/err")" -eq 1 ]
check "an eval mask that keeps nothing is refused in one line" $?

# Errors: one line, exit 2, naming what and where; nothing half-written.
refuse() {  # NAME PATTERN -- ARGS
  local name="$1" pattern="$2"
  shift 3
  "$strata" prepare-data "$@" >/dev/null 2>"$dir/err"
  local status=$?
  [ $status -eq 2 ] && grep -q -- "$pattern" "$dir/err" && [ "$(wc -l <"$dir/err")" -eq 1 ]
  local result=$?  # before the substitution below, which sets $? again
  check "$name (exit $status: $(head -c 160 "$dir/err"))" $result
}
before=$(md5sum "$dir/data/train.bin" "$dir/data/train.mask")
mkdir -p "$dir/empty"
refuse "an unknown --format" "--format" -- \
  --model-dir "$dir/model" --input "$dir/train.jsonl" --format yaml --out "$dir/data"
refuse "a directory without tokenizer.json" "--model-dir $dir/empty: no tokenizer.json" -- \
  --model-dir "$dir/empty" --input "$dir/train.jsonl" --format jsonl --out "$dir/data"
printf '{"text": "fine"}\n{"text": "broken\n' >"$dir/bad.jsonl"
refuse "malformed JSONL names file:line" "$dir/bad.jsonl:2: not valid JSON" -- \
  --model-dir "$dir/model" --input "$dir/bad.jsonl" --format jsonl --out "$dir/data"
printf '{"text": "fine"}\n\n{"body": "no text"}\n' >"$dir/field.jsonl"
refuse "a missing field names the line" "$dir/field.jsonl:3: no \"text\" field" -- \
  --model-dir "$dir/model" --input "$dir/field.jsonl" --format jsonl --out "$dir/data"
refuse "--text-field names another field" "$dir/field.jsonl:1: no \"body\" field" -- \
  --model-dir "$dir/model" --input "$dir/field.jsonl" --format jsonl --out "$dir/data" --text-field body
mkdir -p "$dir/notemplate"
cp "$fixtures/gpt2/tokenizer.json" "$fixtures/gpt2/tokenizer_config.json" "$dir/notemplate/"
refuse "a chat without a template" "has no chat template" -- \
  --model-dir "$dir/notemplate" --input "$dir/chat.jsonl" --format chat --out "$dir/data"
printf '{"messages": [{"role": "user", "content": "hi"}]}\n{"text": "not a chat"}\n' >"$dir/nochat.jsonl"
refuse "a chat line without messages names the line" "$dir/nochat.jsonl:2: no \"messages\" field" -- \
  --model-dir "$dir/model" --input "$dir/nochat.jsonl" --format chat --out "$dir/data"
printf '{"messages": [{"role": "user", "content": "hi"}, "not a message"]}\n' >"$dir/badchat.jsonl"
refuse "a conversation the template cannot render names the line" "$dir/badchat.jsonl:1: " -- \
  --model-dir "$dir/model" --input "$dir/badchat.jsonl" --format chat --out "$dir/data"
printf 'ok \xff bad' >"$dir/latin1.txt"
refuse "invalid UTF-8 names the byte" "$dir/latin1.txt: invalid UTF-8 at byte 3" -- \
  --model-dir "$dir/model" --input "$dir/latin1.txt" --out "$dir/data"
refuse "a missing input" "--input $dir/absent.txt: no such file" -- \
  --model-dir "$dir/model" --input "$dir/absent.txt" --out "$dir/data"
refuse "--append-eos without an eos_token" "tokenizer_config.json: missing; --append-eos needs its eos_token" -- \
  --model-dir "$dir/big" --input "$dir/big.txt" --out "$dir/data" --append-eos
touch "$dir/file"
refuse "an output that cannot be a directory" "--out $dir/file/out: cannot create" -- \
  --model-dir "$dir/model" --input "$dir/big.txt" --out "$dir/file/out"
python3 - "$dir/model/tokenizer.json" "$dir/empty/tokenizer.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
t["normalizer"] = {"type": "BertNormalizer"}  # WordPiece models', which strata does not read
json.dump(t, open(sys.argv[2], "w"))
PY
refuse "an unsupported tokenizer names the key" "tokenizer.json: normalizer.type" -- \
  --model-dir "$dir/empty" --input "$dir/big.txt" --out "$dir/data"
[ "$(md5sum "$dir/data/train.bin" "$dir/data/train.mask")" = "$before" ]
check "refused runs leave the earlier outputs intact" $?
mkdir -p "$dir/clash/train.bin"
"$strata" prepare-data --model-dir "$dir/model" --input "$dir/big.txt" --out "$dir/clash" >/dev/null 2>"$dir/err"
[ $? -eq 1 ] && grep -q "$dir/clash/train.bin" "$dir/err" && [ "$(wc -l <"$dir/err")" -eq 1 ] &&
  [ -z "$(ls "$dir/clash" | grep -v '^train.bin$')" ]
check "an output that cannot be written: exit 1, one line, nothing left beside it ($(head -c 120 "$dir/err"))" $?
if [ "$(id -u)" -ne 0 ]; then
  mkdir -p "$dir/readonly" && chmod 500 "$dir/readonly"
  refuse "an unwritable output" "not writable" -- \
    --model-dir "$dir/model" --input "$dir/big.txt" --out "$dir/readonly"
fi
finish_checks
