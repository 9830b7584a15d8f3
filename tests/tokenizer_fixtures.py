#!/usr/bin/env python3
"""Test tokenizers for prep/tokenizer.h, made with Hugging Face `tokenizers`.

Not part of the test suite: it needs the PyPI package `tokenizers`, which the
suite does not. Two jobs:

  tokenizer_fixtures.py generate
      Trains three small byte-level BPE tokenizers on generated text, the kinds
      strata reads (Llama 3: Split regex + ByteLevel, ignore_merges, a BOS
      template; Qwen2: its regex, NFC, a non-special added token; GPT-2:
      ByteLevel with its own regex, merges in the older "a b" form) and writes
      them with a tokenizer_config.json (bos/eos, chat template) under
      tests/fixtures/tokenizers/<name>/, then the ids `tokenizers` gives for a fixed
      list of tricky inputs to tests/fixtures/tokenizers/expected_ids.json, which
      tests/tokenizer_test.cpp compares strata's ids with. Deterministic for a
      given `tokenizers` version.

  tokenizer_fixtures.py compare --strata BUILD/tools/strata [--megabytes N] [--seed S]
      Writes N MB of random text (all the hard cases mixed: scripts, digits,
      contractions, whitespace runs, newlines, emoji, combining marks, special
      tokens inside words, random characters that Unicode 3.2 assigned, or any
      with --any-code-points) as JSONL documents, tokenizes it with
      `strata prepare-data` and with `tokenizers`, and prints, per tokenizer,
      how many documents and tokens are equal; then random conversations
      through `strata prepare-data --format chat` against transformers'
      apply_chat_template(tokenize=True) (where transformers is installed).
      Exits 1 on any difference.
"""
import argparse
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "tokenizers")

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

WORDS = ["the", "a", "model", "token", "learns", "from", "data", "while", "it", "runs", "fast",
         "on", "GPUs", "and", "NVMe", "offload", "memory", "host", "parameters", "gradients",
         "don't", "I'm", "you're", "we'll", "they've", "she'd", "it's", "HELLO", "World"]
PIECES = ["café", "naïve", "Ünïcödé", "straße", "日本語のテキスト", "中文分词", "한국어", "Привет мир",
          "مرحبا", "שלום", "ελληνικά", "हिन्दी", "🙂", "👍🏽", "🚀🚀", "👨‍👩‍👧", "e\u0301", "A\u030a",
          "12345", "3.14159", "1,000,000", "0x1F", "2026-12-01", "$19.99", "100%", "#tag", "@user",
          "foo_bar", "camelCaseWord", "snake_case", "C++", "a->b", "x==y", "(paren)", "[br]",
          "{json: 1}", "...", "!!!", "???", "--", "\t", "\t\t", "  ", "   ", "\n", "\n\n", "\r\n",
          " \n ", "\u00a0", "\u3000", "’s", "'S", "'LL"]


def generated_text(rng, words):
    out = []
    for _ in range(words):
        r = rng.random()
        if r < 0.7:
            out.append(rng.choice(WORDS))
        elif r < 0.95:
            out.append(rng.choice(PIECES))
        else:
            out.append(str(rng.randrange(10 ** rng.randrange(1, 8))))
        out.append(rng.choice([" ", " ", " ", " ", "", "\n", ", ", ". ", "  "]))
    return "".join(out)


def tricky_inputs():
    return [
        "", " ", "a", "Hello, world!", "Hello world\n", "  leading spaces", "trailing spaces   ",
        "tabs\tand\t\ttabs", "line one\nline two\n\nline four\r\nwindows\r\n", "\n\n\n", "   \n  \n",
        "1234567890 12 123 1234 12345", "3.14159 and 2.71828, 1,000,000", "x=1;y=22;z=333",
        "I'm sure you're right, they've said we'll go; it's HE'S and THEY'LL", "don't can't won't",
        "’quoted’ “double” «guillemets»", "café naïve Ünïcödé straße", "e\u0301 vs \u00e9, A\u030a vs \u00c5",
        "日本語のテキストと中文分词", "한국어 텍스트", "Привет, мир!", "مرحبا بالعالم", "हिन्दी पाठ",
        "emoji 🙂👍🏽🚀 family 👨‍👩‍👧 flags 🇫🇷", "non\u00a0breaking\u3000space", "zero\u200bwidth",
        "<|begin_of_text|>", "text <|end_of_text|> more", "a<|eot_id|>b<|eot_id|><|eot_id|>c",
        "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|>x<|endoftext|>", "<tool_call>{\"a\": 1}</tool_call>",
        "<|not_a_token|> <|im_star", "def f(x):\n    return x ** 2  # square\n",
        "{\"key\": [1, 2, 3], \"nested\": {\"k\": null}}", "a" * 300, " " * 40 + "x", "😀" * 20,
        "MixedCASE camelCase snake_case kebab-case SCREAMING_CASE",
    ]


def build(kind, texts):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers, Regex, AddedToken
    if kind == "llama3":
        tok = Tokenizer(models.BPE(ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>"]
        vocab = 700
    elif kind == "qwen2":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        vocab = 650
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        specials = ["<|endoftext|>"]
        vocab = 600
    trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if kind == "llama3":
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                          special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if kind == "qwen2":
        tok.add_tokens([AddedToken("<tool_call>", normalized=False, special=False),
                        AddedToken("</tool_call>", normalized=False, special=False)])
    return tok


def generate(args):
    from tokenizers import Tokenizer
    rng = random.Random(20261201)
    texts = [generated_text(rng, 200) for _ in range(400)]
    expected = {}
    for kind in ["llama3", "qwen2", "gpt2"]:
        folder = os.path.join(FIXTURES, kind)
        os.makedirs(folder, exist_ok=True)
        tok = build(kind, texts)
        data = json.loads(tok.to_str())
        if kind == "gpt2":  # the older form of merges: "a b" strings
            data["model"]["merges"] = [" ".join(m) for m in data["model"]["merges"]]
        path = os.path.join(folder, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, ensure_ascii=False, indent=1)
            f.write("\n")
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if kind == "llama3":
            config.update(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)
        elif kind == "qwen2":
            config.update(bos_token=None, eos_token="<|im_end|>")
            with open(os.path.join(folder, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(QWEN2_TEMPLATE)
        else:
            config.update(bos_token="<|endoftext|>", eos_token="<|endoftext|>")
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=1)
            f.write("\n")
        loaded = Tokenizer.from_file(path)
        expected[kind] = [{"text": t,
                           "ids": loaded.encode(t).ids,
                           "ids_without_special": loaded.encode(t, add_special_tokens=False).ids}
                          for t in tricky_inputs()]
        print(f"{kind}: vocabulary {loaded.get_vocab_size()}, {len(data['model']['merges'])} merges -> {path}")
    with open(os.path.join(FIXTURES, "expected_ids.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"expected ids of {len(tricky_inputs())} inputs per tokenizer -> {FIXTURES}/expected_ids.json")


def random_code_point(rng, any_code_point):
    # By default a character Unicode 3.2 already assigned: the character tables
    # of the libraries differ on later ones (tokenizers' Oniguruma knows
    # Unicode 16 letters such as U+1C89 that Debian's does not, and its NFC
    # tables are older than ICU's), which --any-code-points shows.
    while True:
        c = chr(rng.choice([rng.randrange(0x20, 0x2000), rng.randrange(0x3000, 0xD7FF),
                            rng.randrange(0x1F300, 0x1FAFF)]))
        if any_code_point or unicodedata.ucd_3_2_0.category(c) != "Cn":
            return c


def random_document(rng, any_code_point=False):
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
                "<tool_call>", "<|end_header_id|>"]
    parts = []
    for _ in range(rng.randrange(1, 400)):
        r = rng.random()
        if r < 0.5:
            parts.append(rng.choice(WORDS))
        elif r < 0.8:
            parts.append(rng.choice(PIECES))
        elif r < 0.85:
            parts.append(rng.choice(specials))
        elif r < 0.9:
            parts.append(str(rng.randrange(10 ** rng.randrange(1, 12))))
        elif r < 0.95:  # random code points from the BMP and beyond
            parts.append("".join(random_code_point(rng, any_code_point) for _ in range(rng.randrange(1, 6))))
        else:
            parts.append(rng.choice([" " * rng.randrange(1, 9), "\n" * rng.randrange(1, 4), "\t", " \n"]))
        parts.append(rng.choice([" ", " ", "", "\n", ", ", ". ", "  ", "'s ", "'ll "]))
    return "".join(parts)


def compare(args):
    from tokenizers import Tokenizer
    rng = random.Random(args.seed)
    documents, size = [], 0
    while size < args.megabytes * 1e6:
        documents.append(random_document(rng, args.any_code_points))
        size += len(documents[-1].encode())
    failures = 0
    with tempfile.TemporaryDirectory() as work:
        jsonl = os.path.join(work, "random.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for d in documents:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        print(f"seed {args.seed}: {len(documents)} documents, {size / 1e6:.1f} MB of random text")
        for kind in ["llama3", "qwen2", "gpt2"]:
            folder = os.path.join(FIXTURES, kind)
            out = os.path.join(work, kind)
            subprocess.run([args.strata, "prepare-data", "--model-dir", folder, "--input", jsonl,
                            "--format", "jsonl", "--out", out, "--append-eos"],
                           check=True, stdout=subprocess.DEVNULL)
            with open(os.path.join(out, "train.bin"), "rb") as f:
                header = struct.unpack("<256i", f.read(1024))
                width = "H" if header[0] == 20240520 else "I"
                ours = list(struct.unpack(f"<{header[2]}{width}", f.read()))
            tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
            config = json.load(open(os.path.join(folder, "tokenizer_config.json")))
            eos = tok.token_to_id(config["eos_token"])
            encoded = [e.ids + [eos] for e in tok.encode_batch(documents)]
            theirs = [t for ids in encoded for t in ids]
            # Document by document: both sides split at their eos tokens (each
            # document ends with one and may hold more), so that a difference
            # in one document does not shift the rest.
            def segments(ids):
                out, current = [], []
                for t in ids:
                    current.append(t)
                    if t == eos:
                        out.append(current)
                        current = []
                return out
            mine = segments(ours)
            equal_docs, equal_tokens, first_difference, k = 0, 0, None, 0
            for i, ids in enumerate(encoded):
                theirs_doc = segments(ids)
                ours_doc = mine[k:k + len(theirs_doc)]
                k += len(theirs_doc)
                if ours_doc == theirs_doc:
                    equal_docs += 1
                    equal_tokens += len(ids)
                elif first_difference is None:
                    flat = [t for seg in ours_doc for t in seg]
                    at = next((j for j, (a, b) in enumerate(zip(flat, ids)) if a != b), min(len(flat), len(ids)))
                    first_difference = (f"first difference: document {i}, token {at}: strata {flat[at:at + 5]}, "
                                        f"tokenizers {ids[at:at + 5]} ({tok.decode(ids[at:at + 5])!r})")
            same = ours == theirs
            failures += not same
            print(f"{kind}: {equal_docs}/{len(documents)} documents ({equal_tokens}/{len(theirs)} tokens) "
                  f"equal (strata wrote {len(ours)} tokens): {'EQUAL' if same else 'DIFFERENT'}")
            if first_difference:
                print("  " + first_difference)
        failures += compare_chats(args, rng, work)
    return 1 if failures else 0


def compare_chats(args, rng, work):
    """`--format chat` against transformers' apply_chat_template(tokenize=True)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        print("chat: transformers is not installed here; not compared")
        return 0
    conversations = []
    for _ in range(args.conversations):
        messages = [{"role": "system", "content": random_document(rng)[:rng.randrange(1, 200)]}] \
            if rng.random() < 0.3 else []
        for turn in range(rng.randrange(1, 5)):
            messages.append({"role": "user", "content": random_document(rng)[:rng.randrange(1, 400)]})
            messages.append({"role": "assistant", "content": random_document(rng)[:rng.randrange(1, 400)]})
        conversations.append(messages)
    path = os.path.join(work, "chats.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for messages in conversations:
            f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
    failures = 0
    for kind in ["llama3", "qwen2"]:  # the kinds whose fixtures have a chat template
        folder = os.path.join(FIXTURES, kind)
        out = os.path.join(work, "chat-" + kind)
        subprocess.run([args.strata, "prepare-data", "--model-dir", folder, "--input", path,
                        "--format", "chat", "--out", out, "--append-eos"], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "train.bin"), "rb") as f:
            header = struct.unpack("<256i", f.read(1024))
            ours = list(struct.unpack(f"<{header[2]}{'H' if header[0] == 20240520 else 'I'}", f.read()))
        mask = open(os.path.join(out, "train.mask"), "rb").read()
        hf = AutoTokenizer.from_pretrained(folder)
        eos = hf.convert_tokens_to_ids(json.load(open(os.path.join(folder, "tokenizer_config.json")))["eos_token"])
        theirs = []
        for messages in conversations:
            theirs += list(hf.apply_chat_template(messages, tokenize=True, return_dict=False)) + [eos]
        same = ours == theirs
        failures += not same
        print(f"chat {kind}: {len(conversations)} conversations, {len(theirs)} tokens from apply_chat_template, "
              f"strata {len(ours)} ({100 * sum(mask) / len(mask):.1f}% targets): {'EQUAL' if same else 'DIFFERENT'}")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("generate")
    c = sub.add_parser("compare")
    c.add_argument("--strata", required=True)
    c.add_argument("--megabytes", type=float, default=20)
    c.add_argument("--conversations", type=int, default=2000)
    c.add_argument("--any-code-points", action="store_true",
                   help="random characters from every code point, recent ones included")
    c.add_argument("--seed", type=int, default=random.SystemRandom().randrange(1 << 31))
    args = parser.parse_args()
    if args.command == "generate":
        generate(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
