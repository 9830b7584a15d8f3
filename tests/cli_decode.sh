#!/usr/bin/env bash
# `strata decode` reads back what `strata prepare-data` wrote, as `tokenizers`
# decodes it (expected_ids.json holds its decodings of the fixture
# tokenizers' ids), for a SentencePiece-style tokenizer (Llama 2's shape:
# Prepend/Replace normalizer, byte fallback, a Replace/ByteFallback/Fuse/Strip
# decoder) and a byte-level one; --tokens shows each token with its mask;
# --ids decodes ids given on the command line; an id the tokenizer lacks and
# a --start past the file are one-line errors. `prepare-data --stats` prints
# tokens per document and the unk share, and warns when the tokenizer does not
# fit the text (SmolLM's shape: a byte-level vocabulary without most bytes).
# Usage: cli_decode.sh STRATA_BINARY REPO_ROOT
set -uo pipefail
strata="$1"
root="$2"
source "$(dirname "$0")/check_support.sh"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
fixtures="$root/tests/fixtures/tokenizers"

# Per kind: the fixture's tricky inputs that decode back to what tokenizers decodes.
for kind in llama2 gpt2; do
  python3 - "$fixtures/expected_ids.json" "$kind" "$dir" <<'PY'
import json, sys
entries = [e for e in json.load(open(sys.argv[1]))[sys.argv[2]] if len(e["text"]) > 5][:12]
out = sys.argv[3] + "/" + sys.argv[2]
with open(out + ".jsonl", "w", encoding="utf-8") as f:
    for e in entries:
        f.write(json.dumps({"text": e["text"]}, ensure_ascii=False) + "\n")
# tokenizers' decode of all the documents' ids at once, as strata decodes the whole file.
with open(out + ".ids", "w") as f:
    f.write(",".join(str(t) for e in entries for t in e["ids"]))
PY
  "$strata" prepare-data --model-dir "$fixtures/$kind" --input "$dir/$kind.jsonl" --format jsonl \
    --out "$dir/$kind" >/dev/null 2>&1
  check "$kind: prepare-data exits 0" $?
  "$strata" decode --model-dir "$fixtures/$kind" --input "$dir/$kind/train.bin" >"$dir/$kind.file.txt" 2>"$dir/err"
  check "$kind: decode of the file exits 0" $?
  "$strata" decode --model-dir "$fixtures/$kind" --ids "$(cat "$dir/$kind.ids")" >"$dir/$kind.ids.txt" 2>&1
  cmp -s "$dir/$kind.file.txt" "$dir/$kind.ids.txt"
  check "$kind: decoding the file equals decoding the ids tokenizers gave" $?
  /usr/bin/env python3 - "$fixtures/$kind/tokenizer.json" "$dir/$kind.ids" "$dir/$kind.file.txt" "$kind" \
    "$fixtures/expected_ids.json" <<'PY'
import json, sys
# Without the tokenizers package: each document's decoding by tokenizers is in
# expected_ids.json; decoders that work token by token (llama2 fuses all the
# tokens, so a document boundary is only a boundary of strings) join them.
entries = [e for e in json.load(open(sys.argv[5]))[sys.argv[4]] if len(e["text"]) > 5][:12]
ours = open(sys.argv[3], encoding="utf-8", newline="").read()
expected = "".join(e["decoded"] for e in entries)
if not expected.endswith("\n"):
    expected += "\n"
if sys.argv[4] == "gpt2":
    assert ours == expected, (ours[:200], expected[:200])
else:
    # Llama 2's decoder strips one leading space of the whole text only.
    assert ours.replace(" ", "") == expected.replace(" ", ""), (ours[:200], expected[:200])
    assert ours.startswith(entries[0]["decoded"]), (ours[:80], entries[0]["decoded"][:80])
PY
  check "$kind: decode gives tokenizers' text" $?
done

"$strata" decode --model-dir "$fixtures/llama2" --input "$dir/llama2/train.bin" --tokens --count 6 \
  >"$dir/tokens" 2>&1
[ "$(wc -l <"$dir/tokens")" = 6 ] && head -1 "$dir/tokens" | grep -qP '^0\t1\t1\t"<s>"\t"<s>"$'
check "--tokens: position, id, mask, token and text, one line each" $?
"$strata" decode --model-dir "$fixtures/llama2" --input "$dir/llama2/train.bin" --skip-special-tokens \
  | grep -q "<s>"
[ $? -ne 0 ]
check "--skip-special-tokens leaves <s> out" $?

"$strata" decode --model-dir "$fixtures/llama2" --ids 1,5,99999 >"$dir/out" 2>"$dir/err"
[ $? -eq 2 ] && [ "$(wc -l <"$dir/err")" = 1 ] &&
  grep -q "token 2 is id 99999, which .*llama2/tokenizer.json does not have (vocabulary 900)" "$dir/err"
check "an id the tokenizer lacks: one line naming its position and the tokenizer" $?
"$strata" decode --model-dir "$fixtures/llama2" --input "$dir/llama2/train.bin" --start 100000 \
  >"$dir/out" 2>"$dir/err"
[ $? -eq 2 ] && [ "$(wc -l <"$dir/err")" = 1 ] && grep -q -- "--start 100000: .* holds .* tokens" "$dir/err"
check "--start past the end: one line" $?
"$strata" decode --model-dir "$dir/absent" --ids 1 >"$dir/out" 2>"$dir/err"
[ $? -eq 2 ] && [ "$(wc -l <"$dir/err")" = 1 ] && grep -q "absent/tokenizer.json" "$dir/err"
check "a missing tokenizer: one line naming it" $?

# --stats: SmolLM's shape on text it does not fit (its vocabulary lacks non-ASCII bytes).
python3 -c "
import json, sys
with open(sys.argv[1], 'w') as f:
    f.write(json.dumps({'text': 'plain ascii text, 12345'}) + '\n')
    f.write(json.dumps({'text': 'ünïcödé 日本語 ' * 3}, ensure_ascii=False) + '\n')
    f.write(json.dumps({'text': 'more plain text'}) + '\n')" "$dir/unfit.jsonl"
"$strata" prepare-data --model-dir "$fixtures/smollm" --input "$dir/unfit.jsonl" --format jsonl \
  --out "$dir/unfit" --append-eos --stats >"$dir/out" 2>&1
check "--stats exits 0" $?
grep -q "prepare-data --stats: 3 documents; tokens per document: mean .*, median .*, largest" "$dir/out"
check "--stats prints tokens per document" $?
python3 - "$dir/out" "$dir/unfit/train.bin" <<'PY'
import re, struct, sys
out = open(sys.argv[1]).read()
data = open(sys.argv[2], "rb").read()
count = struct.unpack("<3i", data[:12])[2]
ids = struct.unpack(f"<{count}H", data[1024:])
unk = 0  # <|endoftext|>, SmolLM's unk and eos: the three appended ones are not unk
m = re.search(r"(\d+) unk tokens \(<\|endoftext\|>\) of (\d+): ([\d.]+)%; more than 1%", out)
assert m, out
assert int(m.group(1)) == ids.count(unk) - 3 and int(m.group(2)) == count, (m.groups(), ids.count(unk), count)
PY
check "--stats counts the unk tokens (not the appended eos) and says the tokenizer does not fit" $?

finish_checks
