#!/usr/bin/env python3
"""Side-by-side tokenization speed: strata's tokenizer vs Hugging Face `tokenizers`.

    PYTHON benches/tokenizer_compare.py --bench BUILD/benches/tokenizer_bench
           [--tokenizer DIR] [--megabytes N] [--rounds R]

Run it with an interpreter that has the PyPI package `tokenizers`. On N MB
(default 20) of random documents made by tests/tokenizer_fixtures.py's
generator (words, scripts, digits, whitespace runs, emoji, special tokens),
with the tokenizer.json in DIR (default: each test tokenizer in
tests/fixtures/tokenizers, one of each shape strata reads: byte-level BPE of
the Llama 3, Qwen2, GPT-2 and SmolLM kinds, SentencePiece-style BPE of the
Llama 2, Mistral and SentencePieceBPETokenizer kinds, and a lowercasing
word-splitting one), it times, in R interleaved rounds (default 3):

  strata             tokenizer_bench: Tokenizer::encode per document, one thread
  tokenizers 1 thr   Tokenizer.encode(text, add_special_tokens=False) per document
  tokenizers batch   Tokenizer.encode_batch(documents) on every core (its Rayon pool)

Both keep their word caches between rounds (each side runs one warm-up pass
first). It checks that both give the same number of tokens, and prints MB/s,
tokens/s and the ratios strata / tokenizers from the best round of each. The
test tokenizers have a few hundred merges, so their tokens are short; a real
vocabulary gives fewer, longer tokens per byte.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import tokenizer_fixtures  # noqa: E402


def run_strata(bench, tokenizer_json, documents_path):
    command = [bench, f"--tokenizer={tokenizer_json}", f"--documents={documents_path}",
               "--benchmark_min_time=1x", "--benchmark_repetitions=1", "--benchmark_format=json",
               "--benchmark_min_warmup_time=0.5"]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"tokenizer_bench failed: {result.stderr.strip()}")
    entry = json.loads(result.stdout)["benchmarks"][0]
    if "error_message" in entry:
        raise SystemExit(f"tokenizer_bench: {entry['error_message']}")
    return entry["bytes_per_second"], entry["tokens_per_second"], int(entry["tokens"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bench", required=True)
    parser.add_argument("--tokenizer", action="append")
    parser.add_argument("--megabytes", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("tokenizers is not installed here (pip install tokenizers); nothing to compare with")
    folders = args.tokenizer or [os.path.join(ROOT, "tests", "fixtures", "tokenizers", k)
                                 for k in tokenizer_fixtures.KINDS]
    rng = random.Random(args.seed)
    documents, size = [], 0
    while size < args.megabytes * 1e6:
        documents.append(tokenizer_fixtures.random_document(rng))
        size += len(documents[-1].encode())
    print(f"{len(documents)} documents, {size / 1e6:.1f} MB; {args.rounds} rounds; {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "documents.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for d in documents:
                f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        for folder in folders:
            tokenizer_json = os.path.join(folder, "tokenizer.json")
            hf = Tokenizer.from_file(tokenizer_json)
            hf.encode_batch(documents[:200], add_special_tokens=False)
            best = {"strata": 0.0, "tokenizers 1 thr": 0.0, "tokenizers batch": 0.0}
            counts = {}
            for round_ in range(args.rounds):
                order = ["strata", "hf1", "hfb"] if round_ % 2 == 0 else ["hfb", "hf1", "strata"]
                for who in order:
                    if who == "strata":
                        _, tokens_per_second, counts["strata"] = run_strata(args.bench, tokenizer_json, path)
                        best["strata"] = max(best["strata"], tokens_per_second)
                    elif who == "hf1":
                        start = time.perf_counter()
                        tokens = sum(len(hf.encode(d, add_special_tokens=False).ids) for d in documents)
                        best["tokenizers 1 thr"] = max(best["tokenizers 1 thr"], tokens / (time.perf_counter() - start))
                        counts["tokenizers"] = tokens
                    else:
                        start = time.perf_counter()
                        tokens = sum(len(e.ids) for e in hf.encode_batch(documents, add_special_tokens=False))
                        best["tokenizers batch"] = max(best["tokenizers batch"], tokens / (time.perf_counter() - start))
            same = counts["strata"] == counts["tokenizers"]
            tokens_per_byte = counts["tokenizers"] / size
            print(f"{os.path.basename(folder)}: {counts['tokenizers']} tokens "
                  f"({'same count' if same else 'DIFFERENT count: ' + str(counts['strata'])})")
            for name, rate in best.items():
                print(f"  {name:18s} {rate / 1e6:7.2f} M tokens/s  {rate / tokens_per_byte / 1e6:7.1f} MB/s")
            print(f"  ratio strata / tokenizers: {best['strata'] / best['tokenizers 1 thr']:.2f} (one thread each), "
                  f"{best['strata'] / best['tokenizers batch']:.2f} (strata one thread vs tokenizers on all cores)")


if __name__ == "__main__":
    main()
