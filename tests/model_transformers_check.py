#!/usr/bin/env python3
"""Optional interoperability check with Hugging Face transformers (not part of ctest).

1. strata initialises a model and writes it (config.json + safetensors, sharded);
   transformers' LlamaForCausalLM.from_pretrained loads it and its logits are
   compared with strata's on the same tokens.
2. transformers saves a randomly initialised Llama (save_pretrained); strata's
   reference driver loads that directory and its logits are compared too.
Needs transformers and safetensors (e.g. in a virtualenv with system site
packages); exits 77 when they are missing.
Usage: python tests/model_transformers_check.py --drivers BUILD/tests/drivers
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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--drivers", required=True)
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
    print("model_transformers_check: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
