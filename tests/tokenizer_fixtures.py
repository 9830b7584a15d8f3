#!/usr/bin/env python3
"""Test tokenizers for prep/tokenizer.h, made with Hugging Face `tokenizers`.

Not part of the test suite: it needs the PyPI package `tokenizers`, which the
suite does not. Two jobs:

  tokenizer_fixtures.py generate
      Trains small tokenizers on generated text, one of each shape strata reads,
      and writes them with a tokenizer_config.json (bos/eos, chat template)
      under tests/fixtures/tokenizers/<name>/:
        llama3   Split regex + ByteLevel, ignore_merges, a BOS template
        qwen2    its regex, NFC, a non-special added token
        gpt2     ByteLevel with its own regex, merges in the older "a b" form
        llama2   a SentencePiece BPE model (byte_fallback) converted the way
                 transformers' LlamaConverter converts Llama 2's: Prepend("▁") +
                 Replace(" ", "▁"), ByteFallback/Fuse/Strip decoder, Llama 2's
                 chat template
        mistral  the same converted without legacy (Mistral v0.3's shape):
                 Metaspace(prepend_scheme first, split false), Mistral's template
        spbpe    SentencePieceBPETokenizer (NFKC, Metaspace always) given byte
                 fallback and <0x00>..<0xFF>, a BOS/EOS template
        smollm   byte-level BPE over a restricted alphabet (bytes missing from
                 the vocabulary become the unk token) with Digits + ByteLevel
        wordish  NFKC + Lowercase + Strip, WhitespaceSplit, Punctuation, a Split
                 string, Digits; added tokens with lstrip, rstrip, single_word;
                 fuse_unk false; no decoder
      then the ids `tokenizers` gives for a fixed list of tricky inputs, and
      what it decodes them to, to tests/fixtures/tokenizers/expected_ids.json,
      which tests/tokenizer_test.cpp compares strata's with. Needs
      `tokenizers`, `sentencepiece`, `protobuf` and `transformers`.
      Deterministic for given versions of them.

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

# Llama 2's chat template as its tokenizer_config.json ships it.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
# Mistral 7B Instruct v0.1's.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

KINDS = ["llama3", "qwen2", "gpt2", "llama2", "mistral", "spbpe", "smollm", "wordish"]
# The kinds with a chat template, and whether their template takes a system message.
CHAT_KINDS = {"llama3": True, "qwen2": True, "llama2": True, "mistral": False}

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
        "<s>[INST] hi [/INST] ok</s>", "  <s>  x", "▁already ▁marked", "[INST]", "ctrl \x04\x07 bytes\x7f",
        "<mask> a <mask>b", "x<mask>", "[new] [new]er un[new] [NEW]", "<x>  y", "ﬁ ① Ⅻ ｆｕｌｌ",
        "İstanbul ΣΑΣ ß", "a-b--c", "  padded both  ", "١٢٣ ४५६ ٤", "\u00a0\u2003 thin",
    ]


def build(kind, texts, work):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers, Regex, AddedToken
    if kind in ("llama2", "mistral"):
        return converted_sentencepiece(texts, work, legacy=(kind == "llama2"))
    if kind == "spbpe":
        return sentencepiece_bpe(texts)
    if kind == "smollm":
        tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders_byte_level()
        trainer = trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                      special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
        # No initial alphabet, printable ASCII text: the other bytes have no entry.
        tok.train_from_iterator(["".join(c for c in t if " " <= c <= "~") for t in texts], trainer)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return tok
    if kind == "wordish":
        from tokenizers import decoders
        tok = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=False))
        tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip()])
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split("-", behavior="merged_with_previous"),
            pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=False)])
        trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False, special_tokens=["[UNK]"],
                                      limit_alphabet=120)
        tok.train_from_iterator(texts, trainer)
        tok.add_special_tokens([AddedToken("<mask>", lstrip=True, normalized=False)])
        tok.add_tokens([AddedToken("[new]", single_word=True, normalized=True),
                        AddedToken("<x>", rstrip=True, normalized=False)])
        return tok
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
    tok.decoder = decoders_byte_level()
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


def decoders_byte_level():
    from tokenizers import decoders
    return decoders.ByteLevel()


def bos_template(tok, bos, eos=None):
    from tokenizers import processors
    single = f"{bos} $A" + (f" {eos}" if eos else "")
    specials = [(bos, tok.token_to_id(bos))] + ([(eos, tok.token_to_id(eos))] if eos else [])
    return processors.TemplateProcessing(single=single, pair=f"{single} $B:1", special_tokens=specials)


def converted_sentencepiece(texts, work, legacy):
    """A sentencepiece BPE model converted as transformers converts Llama 2's (legacy) or Mistral v0.3's."""
    import sentencepiece
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import LlamaConverter
    corpus = os.path.join(work, "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(t.replace("\r", " ") + "\n")
    prefix = os.path.join(work, "sp-legacy" if legacy else "sp")
    # Llama 2's training settings: byte fallback, split digits, no normalization, keep spaces.
    sentencepiece.SentencePieceTrainer.train(
        input=corpus, model_prefix=prefix, vocab_size=900, model_type="bpe", byte_fallback=True,
        split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, character_coverage=0.995, minloglevel=2,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1)

    class Original:  # what LlamaConverter reads of a slow LlamaTokenizer
        vocab_file = prefix + ".model"
        add_prefix_space = True

        def __init__(self):
            self.legacy = legacy
            self.processor = sentencepiece.SentencePieceProcessor(model_file=self.vocab_file)

        def convert_ids_to_tokens(self, i):
            return self.processor.id_to_piece(i)

    class Converter(LlamaConverter):
        # transformers 5's SpmConverter.tokenizer no longer runs its extractor for
        # BPE; this is what it did: the vocabulary in piece order, merges by score.
        def tokenizer(self, proto):
            from tokenizers import Tokenizer, models
            from transformers.convert_slow_tokenizer import generate_merges
            vocab_scores = self.vocab(proto)
            vocab = {word: i for i, (word, _) in enumerate(vocab_scores)}
            return Tokenizer(models.BPE(vocab, generate_merges(vocab, vocab_scores),
                                        unk_token=proto.trainer_spec.unk_piece, fuse_unk=True,
                                        byte_fallback=True, dropout=None))

    tok = Converter(Original()).converted()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ["<unk>", "<s>", "</s>"]])
    if not legacy:  # Mistral v0.3's control tokens
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ["[INST]", "[/INST]"]])
    tok.post_processor = bos_template(tok, "<s>")
    return tok


def sentencepiece_bpe(texts):
    from tokenizers import SentencePieceBPETokenizer, Tokenizer, decoders
    sp = SentencePieceBPETokenizer(unk_token="<unk>", fuse_unk=True)
    sp.train_from_iterator(texts, vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=150,
                           show_progress=False)
    data = json.loads(sp.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    data["decoder"] = {"type": "Sequence", "decoders": [data["decoder"], {"type": "ByteFallback"},
                                                           {"type": "Fuse"}]}
    tok = Tokenizer.from_str(json.dumps(data))
    tok.post_processor = bos_template(tok, "<s>", "</s>")
    return tok


def generate(args):
    from tokenizers import Tokenizer
    rng = random.Random(20261201)
    texts = [generated_text(rng, 200) for _ in range(400)]
    expected = {}
    with tempfile.TemporaryDirectory() as work:
        for kind in KINDS:
            expected[kind] = write_fixture(kind, build(kind, texts, work))
    with open(os.path.join(FIXTURES, "expected_ids.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"expected ids of {len(tricky_inputs())} inputs per tokenizer -> {FIXTURES}/expected_ids.json")


def write_fixture(kind, tok):
    from tokenizers import Tokenizer
    folder = os.path.join(FIXTURES, kind)
    os.makedirs(folder, exist_ok=True)
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
    elif kind in ("llama2", "mistral", "spbpe"):
        config.update(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        if kind != "spbpe":
            config.update(chat_template=LLAMA2_TEMPLATE if kind == "llama2" else MISTRAL_TEMPLATE)
    elif kind == "wordish":
        config.update(bos_token=None, eos_token="[UNK]", unk_token="[UNK]")
    else:
        config.update(bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
        f.write("\n")
    loaded = Tokenizer.from_file(path)
    entries = []
    for t in tricky_inputs():
        ids = loaded.encode(t).ids
        entries.append({"text": t, "ids": ids,
                        "ids_without_special": loaded.encode(t, add_special_tokens=False).ids,
                        "decoded": loaded.decode(ids, skip_special_tokens=False),
                        "decoded_without_special": loaded.decode(ids, skip_special_tokens=True)})
    print(f"{kind}: vocabulary {loaded.get_vocab_size()}, {len(data['model']['merges'])} merges -> {path}")
    return entries


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
                "<tool_call>", "<|end_header_id|>", "<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<mask>",
                "[new]", "<x>"]
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
        elif r < 0.92:  # control bytes
            parts.append("".join(chr(rng.choice([rng.randrange(0, 32), 127])) for _ in range(rng.randrange(1, 4))))
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
        for kind in KINDS:
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
        system = bool(messages)
        for turn in range(rng.randrange(1, 5)):
            messages.append({"role": "user", "content": random_document(rng)[:rng.randrange(1, 400)]})
            messages.append({"role": "assistant", "content": random_document(rng)[:rng.randrange(1, 400)]})
        conversations.append((system, messages))
    failures = 0
    for kind, takes_system in CHAT_KINDS.items():
        # Templates that refuse a system message (Mistral's) get the conversations without one.
        chats = [m for system, m in conversations if takes_system or not system]
        path = os.path.join(work, f"chats-{kind}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for messages in chats:
                f.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
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
        theirs, lengths = [], []
        for messages in chats:
            theirs += list(hf.apply_chat_template(messages, tokenize=True, return_dict=False)) + [eos]
            lengths.append(len(theirs))
        same = ours == theirs
        failures += not same
        wrong = wrong_targets(hf, chats, ours, mask, lengths) if same else len(chats)
        failures += wrong > 0
        print(f"chat {kind}: targets are the assistant's replies and their end tokens in "
              f"{len(chats) - wrong}/{len(chats)} conversations")
        print(f"chat {kind}: {len(chats)} conversations, {len(theirs)} tokens from apply_chat_template, "
              f"strata {len(ours)} ({100 * sum(mask) / len(mask):.1f}% targets): {'EQUAL' if same else 'DIFFERENT'}")
    return failures


def wrong_targets(hf, chats, ids, mask, ends):
    """How many conversations' targets are not exactly their assistant replies.

    The targets of a conversation must be one run per assistant message whose
    text (decoded, whitespace ignored) ends with the reply and an end-of-turn
    token; a run may begin with one token that BPE joined across the boundary.
    """
    def squeeze(text):
        return "".join(unicodedata.normalize("NFC", text).split())
    wrong, at = 0, 0
    for messages, end in zip(chats, ends):
        runs, run = [], []
        for k in range(at, end):
            if mask[k]:
                run.append(ids[k])
            elif run:
                runs.append(run)
                run = []
        if run:
            runs.append(run)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        ok = len(runs) == len(replies)
        for reply, run in zip(replies, runs):
            text = squeeze(hf.decode(run))
            ends = [squeeze(hf.decode([run[-1]]))]
            ok = ok and run[-1] in hf.all_special_ids and text.endswith(squeeze(reply) + ends[0]) and \
                len(text) - len(squeeze(reply) + ends[0]) <= len(squeeze(hf.decode(run[:1])))
        wrong += not ok
        at = end
    return wrong


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
