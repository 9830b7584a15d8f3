#!/usr/bin/env python3
"""Forward + backward of a ~30M-parameter Llama: strata's CPU backend against PyTorch.

Both run the same weights (written once as safetensors), the same sequence
length and the same number of threads, in one run; the script prints the time
of each and the ratio strata / PyTorch (below 1 means strata is faster).
strata checkpoints every unit (each layer's forward runs again inside its
backward); PyTorch is timed both plainly and with the same per-layer
checkpointing (torch.utils.checkpoint), so both comparisons are visible.

Usage: /usr/bin/python3 benches/model_vs_torch.py --bench BUILD/benches/model_bench
           [--threads N] [--seq 256] [--batch 1] [--iterations 5]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import model_ref  # noqa: E402  (the reference Llama and safetensors helpers)

CONFIG = {"vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "rope_scaling": None, "model_type": "llama",
          "architectures": ["LlamaForCausalLM"], "hidden_act": "silu"}


def torch_step(params, inputs, targets, checkpointed):
    if not checkpointed:
        _, loss = model_ref.reference_forward(params, CONFIG, inputs, targets)
    else:
        _, loss = checkpointed_forward(params, inputs, targets)
    loss.backward()
    return loss


def checkpointed_forward(p, inputs, targets):
    """model_ref.reference_forward with every decoder layer under torch.utils.checkpoint."""
    import math
    import torch.nn.functional as F
    cfg = CONFIG
    B, T = inputs.shape
    H, KV, D, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    inv_freq = model_ref.inv_freq_of(cfg)
    freqs = torch.outer(torch.arange(T).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.ones(T, T, dtype=torch.bool).tril()

    def layer(x, i):
        w = lambda n: p[f"model.layers.{i}.{n}.weight"]
        h = model_ref.rmsnorm(x, w("input_layernorm"), eps)
        q = (h @ w("self_attn.q_proj").T).view(B, T, H, D).transpose(1, 2)
        k = (h @ w("self_attn.k_proj").T).view(B, T, KV, D).transpose(1, 2)
        v = (h @ w("self_attn.v_proj").T).view(B, T, KV, D).transpose(1, 2)
        q = q * cos + model_ref.rotate_half(q) * sin
        k = k * cos + model_ref.rotate_half(k) * sin
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        s = ((q @ k.transpose(-1, -2)) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
        y = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(B, T, H * D)
        x = x + y @ w("self_attn.o_proj").T
        h = model_ref.rmsnorm(x, w("post_attention_layernorm"), eps)
        return x + (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T

    x = p["model.embed_tokens.weight"][inputs]
    for i in range(cfg["num_hidden_layers"]):
        x = torch.utils.checkpoint.checkpoint(layer, x, i, use_reentrant=False)
    x = model_ref.rmsnorm(x, p["model.norm.weight"], eps)
    logits = x @ p["lm_head.weight"].T
    return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def time_torch(params, inputs, targets, iterations, checkpointed):
    """(min wall, median wall, median process CPU) seconds per step."""
    torch_step(params, inputs, targets, checkpointed)  # warm-up
    times, cpu = [], []
    for _ in range(iterations):
        start, cpu_start = time.perf_counter(), time.process_time()
        torch_step(params, inputs, targets, checkpointed)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    return min(times), sorted(times)[len(times) // 2], sorted(cpu)[len(cpu) // 2]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", required=True, help="the built model_bench binary")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    params = {n: (1.0 + 0.1 * torch.randn(s, generator=generator)) if len(s) == 1 else
              0.02 * torch.randn(s, generator=generator)
              for n, s in model_ref.parameter_shapes(CONFIG).items()}
    count = sum(t.numel() for t in params.values())
    with tempfile.TemporaryDirectory(prefix="strata-bench-") as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(CONFIG, f)
        model_ref.write_checkpoint(model_dir, params, "F32", 1)
        run = subprocess.run([args.bench, f"--model={model_dir}", f"--batch={args.batch}", f"--seq={args.seq}",
                              f"--threads={args.threads}", "--benchmark_format=json",
                              f"--benchmark_repetitions={args.iterations}", "--benchmark_min_time=0.01"],
                             capture_output=True, text=True, check=True)
    report = json.loads(run.stdout)
    runs = [b for b in report["benchmarks"] if b.get("run_type") == "iteration"]
    cpu_kernels = report["context"].get("cpu_kernels", "?")
    strata_times = sorted(b["real_time"] / 1000.0 for b in runs)  # ms -> s
    strata_min, strata_median = strata_times[0], strata_times[len(strata_times) // 2]
    strata_cpus = sorted(b["process_cpu_s"] for b in runs)
    strata_cpu = strata_cpus[len(strata_cpus) // 2]

    leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    tokens = torch.randint(0, CONFIG["vocab_size"], (args.batch, args.seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    torch_min, torch_median, torch_cpu = time_torch(leaves, inputs, targets, args.iterations, False)
    ckpt_min, ckpt_median, ckpt_cpu = time_torch(leaves, inputs, targets, args.iterations, True)

    print(f"model: {count / 1e6:.1f}M parameters, batch {args.batch} x seq {args.seq}, {args.threads} threads, "
          f"torch {torch.__version__}")
    print(f"strata CPU kernels: {cpu_kernels}")
    print("wall time per step (min, median) and process CPU time (median; robust on a busy machine):")
    rows = [("strata CPU (unit checkpointing)", strata_min, strata_median, strata_cpu),
            ("PyTorch (no checkpointing)", torch_min, torch_median, torch_cpu),
            ("PyTorch (per-layer checkpointing)", ckpt_min, ckpt_median, ckpt_cpu)]
    for name, low, mid, cpu in rows:
        print(f"  {name:34s} min {low * 1e3:8.1f} ms  median {mid * 1e3:8.1f} ms  cpu {cpu * 1e3:8.1f} ms")
    print(f"ratio strata / PyTorch, wall (min): {strata_min / torch_min:.2f} vs no checkpointing, "
          f"{strata_min / ckpt_min:.2f} vs the same checkpointing")
    print(f"ratio strata / PyTorch, CPU time  : {strata_cpu / torch_cpu:.2f} vs no checkpointing, "
          f"{strata_cpu / ckpt_cpu:.2f} vs the same checkpointing (below 1: strata is faster)")


if __name__ == "__main__":
    main()
