#!/usr/bin/env python3
"""The engine against PyTorch: several AdamW steps of a small grouped-query
Llama (llama3 rope scaling), 2 ranks, gradient accumulation 2, ZeRO stage 3
with parameters and optimizer state on NVMe, gradient clipping and weight
decay. Per-step losses and final weights must agree within 1e-5 relative
(per tensor). The reference is an independent PyTorch model (tests/model_ref.py)
trained with torch.optim.AdamW on the same global batches (core/README.md, model).

Exit 77 (skipped) when torch is missing or no directory here supports O_DIRECT.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model_ref  # noqa: E402  (skips with 77 when torch is missing)
from model_ref import np, torch, F  # noqa: E402

TOLERANCE = 1e-5
WORLD, MICRO, ACCUM, SEQ, STEPS = 2, 2, 2, 16, 4
# Adam divides each element's gradient by its own magnitude (plus eps), so an
# element whose gradient is a near-total cancellation (|g| around 1e-8, where
# fp32 summation order decides even its sign) moves by up to lr whichever way
# the rounding went. With eps 1e-8 one such element in a seed out of ten put a
# tensor at 2.5e-5; eps 1e-6 (a common choice for large models) damps updates
# of gradients below 1e-6, so the comparison measures the engine, not that.
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-3, (0.9, 0.95), 1e-6, 0.1, 1.0

CONFIG = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
}


def global_batch(tokens, step):
    """Sequences of step `step` in section 5's order: every (micro, rank, row)."""
    sequences = (len(tokens) - 1) // SEQ
    offset = step * ACCUM * WORLD * MICRO
    rows = [(offset + (m * WORLD + r) * MICRO + b) % sequences
            for m in range(ACCUM) for r in range(WORLD) for b in range(MICRO)]
    inputs = torch.stack([torch.from_numpy(tokens[j * SEQ:j * SEQ + SEQ].astype(np.int64)) for j in rows])
    targets = torch.stack([torch.from_numpy(tokens[j * SEQ + 1:j * SEQ + SEQ + 1].astype(np.int64)) for j in rows])
    return inputs, targets


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir")
    parser.add_argument("--drivers", required=True)
    parser.add_argument("--strata")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"engine_ref: seed {seed} (rerun with --seed {seed}); torch {torch.__version__}")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    driver = os.path.join(args.drivers, "engine_train")

    with tempfile.TemporaryDirectory(prefix="strata-engine-ref-") as work:
        model_dir = os.path.join(work, "model")
        os.makedirs(model_dir)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        params = {}
        for name, shape in model_ref.parameter_shapes(CONFIG).items():
            if len(shape) == 1:
                params[name] = 1.0 + 0.1 * torch.randn(shape)
            else:
                params[name] = 0.05 * torch.randn(shape)
        model_ref.write_checkpoint(model_dir, params, "F32", 1)

        tokens = rng.integers(0, CONFIG["vocab_size"], size=4097, dtype=np.uint16)
        data = os.path.join(work, "tokens.bin")
        tokens.tofile(data)
        nvme = os.path.join(work, "nvme")
        os.makedirs(nvme)
        ds = {
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                       "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "buffer_count": 2},
                "sub_group_size": 8192},
            "aio": {"block_size": 65536, "queue_depth": 8},
            "strata": {"seq_len": SEQ},
        }
        config = os.path.join(work, "ds.json")
        with open(config, "w") as f:
            json.dump(ds, f)
        out = os.path.join(work, "out")
        report = os.path.join(work, "report.json")
        run = subprocess.run([driver, "--model", model_dir, "--init", model_dir, "--config", config,
                              "--data", data, "--steps", str(STEPS), "--world", str(WORLD),
                              "--out", out, "--report", report], capture_output=True, text=True)
        print(run.stdout, end="")
        if run.returncode != 0:
            if "O_DIRECT" in run.stderr:
                print(f"skipping: {run.stderr.strip()}")
                return 77
            print(run.stderr, end="")
            print("engine_ref: FAIL (the driver failed)")
            return 1
        with open(report) as f:
            result = json.load(f)
        trained = model_ref.read_checkpoint(out)

    # The reference: one process, the whole global batch at once (mean over its tokens).
    p = {n: t.clone().double().float().requires_grad_(True) for n, t in params.items()}
    decay = [t for t in p.values() if t.dim() == 2]
    no_decay = [t for t in p.values() if t.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=LR, betas=BETAS, eps=EPS)
    ok = True
    for step in range(STEPS):
        inputs, targets = global_batch(tokens, step)
        optimizer.zero_grad()
        _, loss = model_ref.reference_forward(p, CONFIG, inputs, targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(list(p.values()), CLIP)
        optimizer.step()
        got, want = result["losses"][step], loss.item()
        error = abs(got - want) / abs(want)
        grad_error = abs(result["grad_norms"][step] - norm.item()) / norm.item()
        status = "ok" if error <= TOLERANCE and grad_error <= 1e-4 else "FAIL"
        ok = ok and status == "ok"
        print(f"step {step + 1}: loss strata {got:.7f} torch {want:.7f} rel {error:.2e}; "
              f"grad norm rel {grad_error:.2e} {status}")
    worst_name, worst = "", 0.0
    for name, tensor in p.items():
        error = model_ref.rel_error(trained[name], tensor.detach())
        if error > worst:
            worst_name, worst = name, error
    weights_ok = worst <= TOLERANCE
    ok = ok and weights_ok
    print(f"final weights: worst per-tensor relative error {worst:.2e} ({worst_name}) "
          f"{'ok' if weights_ok else 'FAIL'}")
    print(f"NVMe bytes read {result['nvme_read_bytes']}, written {result['nvme_written_bytes']}")
    if result["nvme_read_bytes"] <= 0 or result["nvme_written_bytes"] <= 0:
        print("FAIL: nothing moved through NVMe")
        ok = False
    print("engine_ref: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
