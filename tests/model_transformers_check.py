#!/usr/bin/env python3
"""Optional interoperability check with Hugging Face transformers (not part of ctest),
for each family strata computes (llama, qwen2, qwen3, mistral) on a small random
config with odd sizes:

1. transformers saves a random model of the family (save_pretrained, sharded;
   biases and norm weights random, not their initial values); strata's
   reference driver loads that directory and computes logits, loss and every
   parameter gradient on two sequences, each compared with transformers' own
   forward and backward (fp32, relative error per tensor at most 1e-5).
2. strata initialises a model of the family and writes it (config.json +
   safetensors, sharded); transformers' AutoModelForCausalLM loads it as the
   family's class (Qwen2ForCausalLM, ...) and its logits are compared with
   strata's on the same tokens.
3. With --strata: `strata train --save` trains the family's model (tied and
   untied), `strata export` writes the checkpoint as a Hugging Face directory;
   transformers loads it and its logits are compared with strata's forward of
   that directory.
Needs transformers and safetensors (a virtual environment with PyPI
transformers); exits 77 when they are missing.
Usage: python tests/model_transformers_check.py --drivers BUILD/tests/drivers [--strata BUILD/tools/strata]
       [--families qwen2,qwen3]
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


# One small config per family, sizes odd where the rotary embedding allows.
FAMILY_CONFIGS = {
    "llama": {"vocab_size": 211, "hidden_size": 72, "intermediate_size": 120, "num_hidden_layers": 2,
              "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": True, "hidden_act": "silu",
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    # Qwen2: q/k/v biases, head_dim derived (70 / 5 = 14), tied.
    "qwen2": {"vocab_size": 199, "hidden_size": 70, "intermediate_size": 118, "num_hidden_layers": 2,
              "num_attention_heads": 5, "num_key_value_heads": 1, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
              "use_sliding_window": False, "hidden_act": "silu"},
    # Qwen3: q/k norms per head, head_dim 18 with 3 heads on hidden 46, untied.
    "qwen3": {"vocab_size": 203, "hidden_size": 46, "intermediate_size": 94, "num_hidden_layers": 2,
              "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 18,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
              "hidden_act": "silu"},
    # Mistral: a window of 9 keys, shorter than the sequences.
    "mistral": {"vocab_size": 197, "hidden_size": 60, "intermediate_size": 98, "num_hidden_layers": 2,
                "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 10,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "sliding_window": 9, "hidden_act": "silu"},
}
TOLERANCE = 1e-5


def hf_model(family, config, seed):
    """A transformers model of the family with random weights: biases well away from zero,
    norms near one, so that every feature shows in the outputs."""
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(family, **config)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model.float().eval()


def check_transformers_in_strata(args, work, family, config):
    """transformers writes a model; strata's CPU backend computes logits, loss and every
    gradient on it; all within 1e-5 of transformers' own in fp32."""
    model = hf_model(family, config, seed=17)
    hf_dir = os.path.join(work, f"hf-{family}")
    model.save_pretrained(hf_dir, max_shard_size="100KB", safe_serialization=True)
    B, T = 2, 23
    tokens = torch.randint(0, config["vocab_size"], (B * T + 1,))
    tokens_path = os.path.join(work, f"tokens-{family}.u32")
    tokens.numpy().astype(np.uint32).tofile(tokens_path)
    rows = torch.stack([tokens[b * T:b * T + T + 1] for b in range(B)])
    inputs, targets = rows[:, :-1], rows[:, 1:]
    out_dir = os.path.join(work, f"hf-{family}-out")
    run = subprocess.run([os.path.join(args.drivers, "model_ref"), hf_dir, tokens_path, str(B), str(T), "1",
                          out_dir], capture_output=True, text=True)
    if run.returncode != 0:
        print(f"{family}: strata could not read transformers' directory: {run.stderr.strip()}")
        return False
    outputs = model_ref.read_safetensors(os.path.join(out_dir, "outputs.safetensors"))
    grads = model_ref.read_checkpoint(os.path.join(out_dir, "grads"))
    model.zero_grad()
    logits = model(inputs).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    errors = {"logits": model_ref.rel_error(outputs["logits"], logits.detach()),
              "loss": model_ref.rel_error(outputs["loss"], loss.detach().reshape(1))}
    params = dict(model.named_parameters())
    tied = config["tie_word_embeddings"]
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    if set(grads) != expected:
        print(f"{family}: gradient names differ: strata only {sorted(set(grads) - expected)}, "
              f"transformers only {sorted(expected - set(grads))}")
        return False
    for name in expected:
        errors["grad " + name] = model_ref.rel_error(grads[name], params[name].grad)
    grad_worst = max(v for k, v in errors.items() if k.startswith("grad"))
    ok = all(v <= TOLERANCE for v in errors.values())
    print(f"{family} ({type(model).__name__}) in strata: relative error logits {errors['logits']:.2e}, "
          f"loss {errors['loss']:.2e}, worst of {len(expected)} gradients {grad_worst:.2e} "
          f"-> {'ok' if ok else 'FAIL'}")
    if not ok:
        for k, v in sorted(errors.items(), key=lambda kv: -kv[1])[:6]:
            print(f"    {k}: {v:.3e}")
    return ok


def check_strata_in_transformers(args, work, family, config):
    """strata initialises and writes a model; transformers loads it as the family's class."""
    family_dir = os.path.join(work, f"strata-{family}")
    os.makedirs(family_dir)
    with open(os.path.join(family_dir, "config.json"), "w") as f:
        json.dump(dict(config, model_type=family), f)
    T = 40
    tokens = torch.randint(0, config["vocab_size"], (T + 1,))
    tokens_path = os.path.join(family_dir, "tokens.u32")
    tokens.numpy().astype(np.uint32).tofile(tokens_path)
    export_dir = os.path.join(family_dir, "export")
    subprocess.run([os.path.join(args.drivers, "model_export"), os.path.join(family_dir, "config.json"), "5",
                    "bf16", "40000", tokens_path, str(T), export_dir], check=True, capture_output=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    expected_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "mistral": "MistralForCausalLM"}[family]
    with torch.no_grad():
        hf_logits = hf(tokens[:T][None]).logits
    strata_logits = model_ref.read_safetensors(os.path.join(family_dir, "strata_logits.safetensors"))["logits"]
    err = model_ref.rel_error(strata_logits, hf_logits)
    ok = err <= TOLERANCE and type(hf).__name__ == expected_class
    print(f"{family}: strata's checkpoint in transformers loads as {type(hf).__name__}: logits relative "
          f"error {err:.2e} -> {'ok' if ok else 'FAIL'}")
    if ok and args.strata:
        ok = check_exported_checkpoints(args, family_dir, family, config, tokens_path, tokens[:T][None], T)
    return ok


def check_exported_checkpoints(args, work, family, config, tokens_path, inputs, T):
    """A trained checkpoint (biases and norms moved off their initial values), exported, in
    transformers: tied and untied."""
    ok = True
    data = os.path.join(work, "train.bin")
    np.random.default_rng(3).integers(0, config["vocab_size"], size=20000, dtype=np.uint16).tofile(data)
    for tied in (True, False):
        name = "tied" if tied else "untied"
        model_dir = os.path.join(work, f"model-{name}")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(dict(config, model_type=family, tie_word_embeddings=tied), f)
        save = os.path.join(work, f"ck-{name}")
        subprocess.run([args.strata, "train", "--model", model_dir, "--data", data, "--steps", "4",
                        "--seq-len", "32", "--micro-batch", "2", "--lr", "1e-2", "--zero-stage", "3",
                        "--offload-optimizer", "nvme", "--nvme-path", os.path.join(work, "swap"),
                        "--save", save], check=True, capture_output=True)
        exported = os.path.join(work, f"exported-{name}")
        subprocess.run([args.strata, "export", save, "--out", exported], check=True, capture_output=True)
        out_dir = os.path.join(work, f"exported-{name}-out")
        subprocess.run([os.path.join(args.drivers, "model_ref"), exported, tokens_path, "1", str(T), "1", out_dir],
                       check=True, capture_output=True)
        strata_logits = model_ref.read_safetensors(os.path.join(out_dir, "outputs.safetensors"))["logits"]
        hf = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
        with torch.no_grad():
            hf_logits = hf(inputs).logits
        err = model_ref.rel_error(strata_logits, hf_logits)
        print(f"{family}: trained and exported {name} checkpoint in transformers ({type(hf).__name__}): "
              f"logits relative error {err:.2e}")
        ok = ok and err <= TOLERANCE
    return ok


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--drivers", required=True)
    parser.add_argument("--strata")
    parser.add_argument("--families", default=",".join(FAMILY_CONFIGS))
    args = parser.parse_args()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    torch.manual_seed(1)
    ok = True
    with tempfile.TemporaryDirectory(prefix="strata-hf-") as work:
        for family in args.families.split(","):
            config = FAMILY_CONFIGS[family]
            ok = check_transformers_in_strata(args, work, family, config) and ok
            ok = check_strata_in_transformers(args, work, family, config) and ok
    print("model_transformers_check: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
