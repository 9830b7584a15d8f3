#!/usr/bin/env python3
"""Optional interoperability check with Hugging Face transformers (not part of ctest).

1. strata initialises a model and writes it (config.json + safetensors, sharded);
   transformers' LlamaForCausalLM.from_pretrained loads it and its logits are
   compared with strata's on the same tokens.
2. transformers saves a randomly initialised Llama (save_pretrained); strata's
   reference driver loads that directory and its logits are compared too.
Needs transformers and safetensors (e.g. in a virtualenv with system site
packages); exits 77 when they are missing.
3. `strata train --save` trains a small model (tied and untied), `strata export`
   writes the checkpoint as a Hugging Face directory; transformers loads it and
   its logits are compared with strata's own forward of that directory.
Usage: python tests/model_transformers_check.py --drivers BUILD/tests/drivers [--strata BUILD/tools/strata]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    import transformers
except ImportError as e:
    print(f"skipping: {e}")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_ref  # noqa: E402


def check_exported_checkpoints(args, work, config, tokens_path, inputs, T):
    """A trained checkpoint, exported, in transformers: tied and untied."""
    ok = True
    data = os.path.join(work, "train.bin")
    np.random.default_rng(3).integers(0, config["vocab_size"], size=20000, dtype=np.uint16).tofile(data)
    for tied in (True, False):
        name = "tied" if tied else "untied"
        model_dir = os.path.join(work, f"model-{name}")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(dict(config, tie_word_embeddings=tied), f)
        save = os.path.join(work, f"ck-{name}")
        subprocess.run([args.strata, "train", "--model", model_dir, "--data", data, "--steps", "4",
                        "--seq-len", "32", "--micro-batch", "2", "--lr", "1e-2", "--zero-stage", "3",
                        "--offload-optimizer", "nvme", "--nvme-path", os.path.join(work, "swap"),
                        "--save", save], check=True, capture_output=True)
        exported = os.path.join(work, f"exported-{name}")
        subprocess.run([args.strata, "export", save, "--out", exported], check=True, capture_output=True)
        out_dir = os.path.join(work, f"exported-{name}-out")
        subprocess.run([os.path.join(args.drivers, "model_ref"), exported, tokens_path, "1", str(T), "1", out_dir],
                       check=True)
        strata_logits = model_ref.read_safetensors(os.path.join(out_dir, "outputs.safetensors"))["logits"]
        hf = transformers.LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)
        with torch.no_grad():
            hf_logits = hf(inputs).logits
        err = model_ref.rel_error(strata_logits, hf_logits)
        print(f"exported {name} checkpoint in transformers: logits relative error {err:.2e}")
        ok = ok and err <= 1e-5
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--drivers", required=True)
    parser.add_argument("--strata")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="strata-hf-") as work:
        config = {"vocab_size": 211, "hidden_size": 72, "intermediate_size": 120, "num_hidden_layers": 2,
                  "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12,
                  "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                  "tie_word_embeddings": True, "model_type": "llama", "hidden_act": "silu",
                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}
        with open(os.path.join(work, "config.json"), "w") as f:
            json.dump(config, f)
        T = 40
        tokens = torch.randint(0, config["vocab_size"], (T + 1,))
        tokens_path = os.path.join(work, "tokens.u32")
        tokens.numpy().astype(np.uint32).tofile(tokens_path)
        inputs = tokens[:T][None]

        # strata -> transformers
        export_dir = os.path.join(work, "export")
        subprocess.run([os.path.join(args.drivers, "model_export"), os.path.join(work, "config.json"), "5",
                        "bf16", "40000", tokens_path, str(T), export_dir], check=True)
        print("strata wrote:", sorted(os.listdir(export_dir)))
        hf = transformers.LlamaForCausalLM.from_pretrained(export_dir, torch_dtype=torch.float32)
        with torch.no_grad():
            hf_logits = hf(inputs).logits
        strata_logits = model_ref.read_safetensors(os.path.join(work, "strata_logits.safetensors"))["logits"]
        err = model_ref.rel_error(strata_logits, hf_logits)
        print(f"strata checkpoint in transformers {transformers.__version__}: logits relative error {err:.2e}")
        ok = ok and err <= 1e-5

        # transformers -> strata
        torch.manual_seed(1)
        hf_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
        hf_config.tie_word_embeddings = False
        hf_model = transformers.LlamaForCausalLM(hf_config)
        hf_dir = os.path.join(work, "hf")
        hf_model.save_pretrained(hf_dir, max_shard_size="100KB", safe_serialization=True)
        print("transformers wrote:", sorted(os.listdir(hf_dir)))
        out_dir = os.path.join(work, "hf-out")
        subprocess.run([os.path.join(args.drivers, "model_ref"), hf_dir, tokens_path, "1", str(T), "1", out_dir],
                       check=True)
        with torch.no_grad():
            hf_logits = hf_model(inputs).logits
        strata_logits = model_ref.read_safetensors(os.path.join(out_dir, "outputs.safetensors"))["logits"]
        err = model_ref.rel_error(strata_logits, hf_logits)
        print(f"transformers checkpoint in strata: logits relative error {err:.2e}")
        ok = ok and err <= 1e-5
        if args.strata:
            ok = check_exported_checkpoints(args, work, config, tokens_path, inputs, T) and ok
    print("model_transformers_check: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
