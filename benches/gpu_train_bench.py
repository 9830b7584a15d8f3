#!/usr/bin/env python3
"""Training throughput on one GPU: strata against PyTorch, side by side in one run.

Both sides train the same model (default: the `llama3.2-1b` preset, Llama 3.2 1B
shapes with tied embeddings and llama3 RoPE scaling) on the same tokens, with the
same micro-batch and sequence length, in bf16 compute with fp32 master weights
and AdamW (lr 1e-3, betas 0.9/0.999, eps 1e-8, no weight decay, no clipping:
strata's defaults):

  memory   everything on the GPU.
           strata: `strata train --backend cuda --precision bf16 --zero-stage 0`.
           PyTorch: the model below in plain torch (fp32 parameters, bf16
           autocast, SDPA causal attention, no activation checkpointing unless
           --torch-checkpoint) with torch.optim.AdamW(fused=True) on the GPU.
           Target: strata / PyTorch >= 1.0x.
  offload  parameters and optimizer state homed in pinned host memory.
           strata: --zero-stage 3 --offload-param cpu --offload-optimizer cpu,
           with --device-mem-limit below the training state (default: the
           plan's device peak + 10%, read from --print-plan); with --nvme-path,
           also a row with both homed on NVMe there. Without --quick, also
           ZeRO-Offload (--zero-stage 2 --offload-optimizer cpu: parameters on
           the GPU, gradients and optimizer in host memory) under its own
           plan's peak + 10%, with its own ratio.
           PyTorch: FSDP2 (fully_shard per decoder layer and on the root) with
           CPUOffloadPolicy(pin_memory=True) and MixedPrecisionPolicy(bf16
           params, fp32 reduce) in a one-process NCCL group, AdamW(fused=True)
           on the CPU parameters (fused AdamW on the CPU needs torch >= 2.4;
           older versions fall back to foreach, and the row says so).
           Target: strata / FSDP2 >= 2x.

The precision choice: strata computes in bf16 from fp32 master weights; the fair
PyTorch counterpart is bf16 autocast over fp32 parameters (memory case) and
FSDP2's bf16 param_dtype over fp32 sharded parameters (offload case), both with
AdamW on the fp32 copy.

tokens/s is the median over the steps after the warm-up (strata's from its
--metrics file, field tokens_per_s). MFU = (6 N + 6 L H T) FLOPs per token x
tokens/s over the bf16 matmul rate cuBLAS reaches on this GPU, measured in the
same run (torch.matmul of 8192^3 bf16 matrices, CUDA events, after warm-up).
N parameters, L layers, H hidden size, T sequence length.

A strata run that exits with status 1 or 2 before its first step (it refused
the placement, e.g. `--backend cuda` with state kept on the GPU) is recorded as
"refused: <its message>"; the other rows still run. The exit status is 1 only
when a row failed otherwise (crash, timeout, no metrics).

    python3 benches/gpu_train_bench.py --strata build/tools/strata [--quick] \
        [--only memory|offload] [--nvme-path DIR] [--json OUT.json]
    python3 benches/gpu_train_bench.py --device cpu --strata build/tools/strata   # smoke test, no GPU

--device cpu runs the `tiny` preset for 2 steps after 1 warm-up step: strata
with --backend cpu, PyTorch on the CPU (bf16 autocast when available), FSDP2
only when this torch has it (else the row says "FSDP2 not available in this
torch"). It checks the script, not the figures.
"""
import argparse
import array
import contextlib
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

# Hugging Face config.json fields of strata's presets (core/model/model_config.cpp).
PRESETS = {
    "llama3.2-1b": {
        "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}},
    "tiny": {
        "vocab_size": 256, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "rope_scaling": None},
    "small": {
        "vocab_size": 256, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "rope_scaling": None},
}
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # strata's defaults
MATMUL_N = 8192
RESULT_TAG = "GPU_TRAIN_BENCH_RESULT "


def load_config(model):
    if model in PRESETS:
        return dict(PRESETS[model])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    with open(path) as f:
        cfg = json.load(f)
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("rms_norm_eps", 1e-5)
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("tie_word_embeddings", False)
    cfg.setdefault("rope_scaling", None)
    return cfg


def parameter_count(cfg):
    C, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layer = C * H * D + 2 * C * KV * D + H * D * C + 3 * C * I + 2 * C
    return V * C + L * layer + C + (0 if cfg["tie_word_embeddings"] else V * C)


def flops_per_token(cfg, params, seq_len):
    return 6 * params + 6 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq_len


# --- the PyTorch side (imported only in worker processes) ------------------------


def torch_model_classes(torch):
    """The Llama of Hugging Face's LlamaForCausalLM, in plain torch (core/README.md, model)."""
    import torch.nn as nn
    import torch.nn.functional as F
    import torch.utils.checkpoint

    def inv_freq_of(cfg):
        D, base = cfg["head_dim"], cfg["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        rs = cfg.get("rope_scaling")
        if rs and rs.get("rope_type", rs.get("type")) == "llama3":  # transformers' _compute_llama3_parameters
            factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
            old = rs["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old / low, old / high
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            inv_freq = torch.where(medium, smoothed, scaled)
        return inv_freq

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    has_sdpa = hasattr(F, "scaled_dot_product_attention")
    version = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2])
    has_gqa = version >= (2, 5)  # scaled_dot_product_attention(enable_gqa=...)

    class RMSNorm(nn.Module):
        def __init__(self, size, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(size))
            self.eps = eps

        def forward(self, x):  # as transformers' LlamaRMSNorm: in fp32, weight times the input dtype
            dtype = x.dtype
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x.to(dtype)

    class DecoderLayer(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            C, I = cfg["hidden_size"], cfg["intermediate_size"]
            self.H, self.KV, self.D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
            self.input_layernorm = RMSNorm(C, cfg["rms_norm_eps"])
            self.q_proj = nn.Linear(C, self.H * self.D, bias=False)
            self.k_proj = nn.Linear(C, self.KV * self.D, bias=False)
            self.v_proj = nn.Linear(C, self.KV * self.D, bias=False)
            self.o_proj = nn.Linear(self.H * self.D, C, bias=False)
            self.post_attention_layernorm = RMSNorm(C, cfg["rms_norm_eps"])
            self.gate_proj = nn.Linear(C, I, bias=False)
            self.up_proj = nn.Linear(C, I, bias=False)
            self.down_proj = nn.Linear(I, C, bias=False)

        def attention(self, q, k, v):  # (B, H, T, D), (B, KV, T, D) x 2
            if has_sdpa and has_gqa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            k = k.repeat_interleave(self.H // self.KV, dim=1)  # query head h reads kv head h // (H / KV)
            v = v.repeat_interleave(self.H // self.KV, dim=1)
            if has_sdpa:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            T = q.shape[2]
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.D)
            mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

        def forward(self, x, cos, sin):  # x (B, T, C); cos, sin (T, D)
            B, T, _ = x.shape
            h = self.input_layernorm(x)
            q = self.q_proj(h).view(B, T, self.H, self.D).transpose(1, 2)
            k = self.k_proj(h).view(B, T, self.KV, self.D).transpose(1, 2)
            v = self.v_proj(h).view(B, T, self.KV, self.D).transpose(1, 2)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            y = self.attention(q, k, v).transpose(1, 2).reshape(B, T, self.H * self.D)
            x = x + self.o_proj(y)
            h = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    class Llama(nn.Module):
        def __init__(self, cfg, checkpoint_layers=False):
            super().__init__()
            V, C = cfg["vocab_size"], cfg["hidden_size"]
            self.embed_tokens = nn.Embedding(V, C)
            self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg["num_hidden_layers"]))
            self.norm = RMSNorm(C, cfg["rms_norm_eps"])
            self.lm_head = nn.Linear(C, V, bias=False)
            if cfg["tie_word_embeddings"]:
                self.lm_head.weight = self.embed_tokens.weight
            self.register_buffer("inv_freq", inv_freq_of(cfg), persistent=False)
            self.checkpoint_layers = checkpoint_layers
            for name, p in self.named_parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, inputs, targets):  # (B, T) token ids each
            T = inputs.shape[1]
            positions = torch.arange(T, device=inputs.device, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq.to(inputs.device).float())  # (T, D/2), in fp32
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            x = self.embed_tokens(inputs)
            for layer in self.layers:
                if self.checkpoint_layers:
                    x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
                else:
                    x = layer(x, cos, sin)
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))

    return Llama


def build_model(torch, Llama, cfg, device, **options):
    """The model with its parameters made and initialised on the device (fast for 1B parameters)."""
    if device != "cpu" and hasattr(torch.device(device), "__enter__"):  # torch >= 2.0: a default-device context
        with torch.device(device):
            return Llama(cfg, **options)
    return Llama(cfg, **options).to(device)


def batches(torch, path, micro_batch, seq_len, device):
    """Micro-batches of (inputs, targets) read in order from the uint32 token file (wrapping)."""
    data = torch.frombuffer(bytearray(open(path, "rb").read()), dtype=torch.int32).long()
    per = micro_batch * (seq_len + 1)
    count = data.numel() // per
    i = 0
    while True:
        chunk = data[(i % count) * per:(i % count + 1) * per].view(micro_batch, seq_len + 1).to(device)
        yield chunk[:, :-1], chunk[:, 1:]
        i += 1


def sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def make_adamw(torch, params, fused_wanted, where):
    """AdamW with strata's defaults, fused when this torch has it for the parameters' device."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        fused_devices = _get_fused_kernels_supported_devices()
    except ImportError:
        fused_devices = []
    params = list(params)
    if fused_wanted and where in fused_devices:
        try:
            return torch.optim.AdamW(params, fused=True, **ADAMW), "fused", ""
        except (RuntimeError, TypeError, ValueError) as e:
            note = f"fused AdamW refused: {str(e).splitlines()[0][:80]}"
    else:
        note = f"no fused AdamW on {where} in torch {torch.__version__} (needs 2.4 on the CPU)"
    try:
        return torch.optim.AdamW(params, foreach=True, **ADAMW), "foreach", note
    except (RuntimeError, TypeError):
        return torch.optim.AdamW(params, **ADAMW), "loop", note


class Optimizer:
    """make_adamw's optimizer; a fused one that fails on its first step is replaced by foreach (no state yet)."""

    def __init__(self, torch, params, where):
        self.torch, self.params, self.where = torch, list(params), where
        self.optimizer, self.kind, self.note = make_adamw(torch, self.params, True, where)
        self.steps = 0

    def step(self):
        try:
            self.optimizer.step()
        except (RuntimeError, NotImplementedError) as e:
            if self.kind != "fused" or self.steps > 0:
                raise
            grads = [p.grad for p in self.params]
            self.optimizer, self.kind, _ = make_adamw(self.torch, self.params, False, self.where)
            self.note = f"fused AdamW failed on its first step ({str(e).splitlines()[0][:80]}); foreach"
            for p, g in zip(self.params, grads):
                p.grad = g
            self.optimizer.step()
        self.steps += 1

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)


def timed_steps(torch, device, step, warmup, steps):
    """Runs warmup + steps calls of step(); returns the measured steps' wall times."""
    times = []
    for i in range(warmup + steps):
        sync(torch, device)
        start = time.perf_counter()
        step()
        sync(torch, device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def train_steps(torch, spec, model, optimizer, precision):
    """Trains spec's warm-up and measured steps on spec's tokens, each forward
    under the context `precision`; returns the row's step times, losses,
    AdamW kind and peak device memory."""
    device = spec["device"]
    data = batches(torch, spec["data"], spec["micro_batch"], spec["seq_len"], device)
    losses = []

    def step():
        inputs, targets = next(data)
        with precision:
            loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = timed_steps(torch, device, step, spec["warmup"], spec["steps"])
    return {"step_times_s": times, "losses": [float(l) for l in losses], "adamw": optimizer.kind,
            "adamw_note": optimizer.note,
            "peak_device_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}


def worker_peak(torch, spec):
    """bf16 torch.matmul rate (FLOP/s) on the GPU, timed with CUDA events after warm-up."""
    n = spec.get("n", MATMUL_N)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    iterations, best = 30, 0.0
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            torch.matmul(a, b, out=c)
        end.record()
        end.synchronize()
        best = max(best, 2.0 * n ** 3 * iterations / (start.elapsed_time(end) / 1e3))
    return {"matmul_bf16_flops_per_s": best, "n": n, "device": torch.cuda.get_device_name(0)}


def worker_torch_memory(torch, spec):
    device, cfg = spec["device"], spec["config"]
    torch.manual_seed(0)
    if device == "cpu":
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    Llama = torch_model_classes(torch)
    model = build_model(torch, Llama, cfg, device, checkpoint_layers=spec["torch_checkpoint"])
    optimizer = Optimizer(torch, model.parameters(), device)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16)
    return {**train_steps(torch, spec, model, optimizer, autocast),
            "parameters": sum(p.numel() for p in model.parameters()),
            "precision": "fp32 parameters, bf16 autocast" + (", per-layer checkpointing" if spec["torch_checkpoint"]
                                                              else "")}


def import_fsdp2():
    try:  # torch >= 2.6
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    except Exception:
        try:  # torch 2.4 and 2.5
            from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        except Exception:  # ImportError, or an old torch's distributed package failing to import
            return None
    return fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy


def worker_fsdp2(torch, spec):
    fsdp = import_fsdp2()
    if fsdp is None:
        return {"skipped": f"FSDP2 not available in this torch ({torch.__version__})"}
    fully_shard, CPUOffloadPolicy, MixedPrecisionPolicy = fsdp
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    device, cfg = spec["device"], spec["config"]
    if device == "cuda":
        torch.cuda.set_device(0)
    # One process, one rank: an in-memory store, no address or port.
    group = {"backend": "nccl" if device == "cuda" else "gloo", "store": dist.HashStore(), "rank": 0, "world_size": 1}
    try:
        dist.init_process_group(**group, **({"device_id": torch.device("cuda", 0)} if device == "cuda" else {}))
    except TypeError:  # torch < 2.3 has no device_id
        dist.init_process_group(**group)
    try:
        mesh = init_device_mesh(device, (1,))
        torch.manual_seed(0)
        Llama = torch_model_classes(torch)
        model = build_model(torch, Llama, cfg, device)  # fully_shard moves the shards to the host
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # On the CPU (smoke test) the parameters are on the host already: no offload policy.
        options = {"mesh": mesh, "mp_policy": mixed}
        if device == "cuda":
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
        for layer in model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        where = {p.device.type for p in model.parameters()}
        optimizer = Optimizer(torch, model.parameters(), "cpu")
        return {**train_steps(torch, spec, model, optimizer, contextlib.nullcontext()),
                "parameter_devices": sorted(where),
                "precision": "fp32 sharded parameters on the host, bf16 param_dtype, fp32 reduce_dtype"}
    finally:
        dist.destroy_process_group()


def worker_main(kind, spec_path):
    import torch
    with open(spec_path) as f:
        spec = json.load(f)
    result = {"peak": worker_peak, "torch": worker_torch_memory, "fsdp2": worker_fsdp2}[kind](torch, spec)
    result["torch_version"] = torch.__version__
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


# --- the driver ------------------------------------------------------------------


def last_line(text):
    lines = [l.strip() for l in (text or "").splitlines() if l.strip()]
    return lines[-1] if lines else ""


def run_worker(args, kind, spec, workdir):
    """Runs one PyTorch case in its own process (its own CUDA context and allocator)."""
    spec_path = os.path.join(workdir, f"spec-{kind}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    command = [args.python, os.path.abspath(__file__), "--worker", kind, "--worker-spec", spec_path]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "message": f"timed out after {args.run_timeout} s"}
    for line in run.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            if "skipped" in result:
                return {"status": "skipped", "message": result["skipped"], **result}
            return {"status": "ok", **result}
    message = last_line(run.stderr) or last_line(run.stdout) or "no output"
    with open(os.path.join(workdir, f"{kind}.log"), "w") as f:
        f.write(run.stdout + run.stderr)
    return {"status": "failed", "message": f"exit {run.returncode}: {message}"}


def strata_command(args, backend, extra):
    return [args.strata, "train", "--model", args.model, "--backend", backend, "--precision", "bf16",
            "--data", args.data, "--data-format", "uint32", "--micro-batch", str(args.micro_batch),
            "--seq-len", str(args.seq_len), "--steps", str(args.warmup + args.steps)] + extra


def run_strata(args, backend, workdir, name, extra):
    metrics = os.path.join(workdir, f"metrics-{name}.jsonl")
    command = strata_command(args, backend, extra + ["--metrics", metrics])
    if os.path.exists(metrics):
        os.remove(metrics)
    row = {"command": " ".join(command)}
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=args.run_timeout)
    except subprocess.TimeoutExpired:
        return {**row, "status": "failed", "message": f"timed out after {args.run_timeout} s"}
    except OSError as e:
        return {**row, "status": "failed", "message": f"cannot run {args.strata}: {e}"}
    lines = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
    if run.returncode != 0:
        message = last_line(run.stderr) or last_line(run.stdout)
        # Exit 2 (the input) or 1 (the run) before any step: strata said no up front.
        status = "refused" if run.returncode in (1, 2) and not lines else "failed"
        return {**row, "status": status, "exit_status": run.returncode, "message": message}
    measured = lines[args.warmup:]
    if not measured:
        return {**row, "status": "failed", "message": f"{len(lines)} steps in {metrics}, none after the warm-up"}
    return {**row, "status": "ok", "tokens_per_s": statistics.median(l["tokens_per_s"] for l in measured),
            "step_time_s": statistics.median(l["step_time_s"] for l in measured),
            "losses": [l["loss"] for l in lines], "summary": last_line(run.stdout)}


def parse_bytes(text, unit):
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit]
    return float(text) * scale


def planned_device_peak(args, backend, extra):
    """The plan's device bytes per rank for this placement (`--print-plan`), or None."""
    try:
        run = subprocess.run(strata_command(args, backend, extra + ["--print-plan"]), capture_output=True, text=True)
    except OSError:
        return None
    for line in run.stdout.splitlines():
        m = re.match(r"\s*device\s+([\d.]+)\s*(B|KiB|MiB|GiB|TiB)\s+total", line)
        if m:
            return parse_bytes(m.group(1), m.group(2))
    return None


def strata_parameters(args):
    try:
        run = subprocess.run([args.strata, "train", "--model", args.model, "--print-config"], capture_output=True,
                             text=True)
        return int(json.loads(run.stdout)["strata"]["parameters"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_tokens(path, count, vocab, seed=0):
    rng = random.Random(seed)
    tokens = array.array("I", (rng.randrange(vocab) for _ in range(count)))
    with open(path, "wb") as f:
        tokens.tofile(f)


def fmt_rate(row):
    return f"{row['tokens_per_s']:,.0f}" if row.get("status") == "ok" else "-"


def row_note(row):
    if row.get("status") == "ok":
        return row.get("note", "")
    return f"{row['status']}: {row.get('message', '')}"


def ratio(a, b):
    if a.get("status") == "ok" and b.get("status") == "ok" and b["tokens_per_s"] > 0:
        return a["tokens_per_s"] / b["tokens_per_s"]
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strata", default="build/tools/strata", help="the strata command")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke test of this script (tiny model, strata --backend cpu)")
    parser.add_argument("--model", help="preset (llama3.2-1b, tiny, small) or config.json (default: llama3.2-1b; "
                                         "tiny with --device cpu)")
    parser.add_argument("--micro-batch", type=int, help="sequences per step (default 4; 2 with --device cpu)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048; 64 with --device cpu)")
    parser.add_argument("--steps", type=int, help="measured steps (default 10; 4 with --quick; 2 with --device cpu)")
    parser.add_argument("--warmup", type=int, help="steps before the measured ones (default 3; 2 with --quick; "
                                                   "1 with --device cpu)")
    parser.add_argument("--quick", action="store_true", help="few steps: both cases in about 2 minutes on an H200")
    parser.add_argument("--only", choices=("memory", "offload"), help="run one case")
    parser.add_argument("--nvme-path", help="also run strata's offload case with both homes on NVMe here")
    parser.add_argument("--device-mem-limit", help="strata's --device-mem-limit in the offload case (default: the "
                                                   "plan's device peak + 10%%)")
    parser.add_argument("--torch-checkpoint", action="store_true",
                        help="PyTorch (memory case) recomputes each layer in backward, as strata does")
    parser.add_argument("--run-timeout", type=int, help="seconds per run (default 600; 120 with --quick)")
    parser.add_argument("--python", default=sys.executable, help="Python with torch for the PyTorch side")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--worker", choices=("peak", "torch", "fsdp2"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, args.worker_spec)

    smoke = args.device == "cpu"
    default = lambda value, gpu, quick, cpu: value if value is not None else (cpu if smoke else quick if args.quick
                                                                                else gpu)
    args.model = default(args.model, "llama3.2-1b", "llama3.2-1b", "tiny")
    args.micro_batch = default(args.micro_batch, 4, 4, 2)
    args.seq_len = default(args.seq_len, 2048, 2048, 64)
    args.steps = default(args.steps, 10, 4, 2)
    args.warmup = default(args.warmup, 3, 2, 1)
    args.run_timeout = default(args.run_timeout, 600, 120, 300)
    backend = "cpu" if smoke else "cuda"
    cfg = load_config(args.model)
    params = parameter_count(cfg)
    reported = strata_parameters(args)
    if reported is None:
        print(f"gpu_train_bench: `{args.strata} train --model {args.model} --print-config` failed; "
              "is --strata right?")
        return 2
    mismatch = reported != params
    if mismatch:
        print(f"gpu_train_bench: WARNING: strata reports {reported} parameters for {args.model}, this script's "
              f"PyTorch model has {params}: the two sides differ")
    tokens_per_step = args.micro_batch * args.seq_len
    model_flops = flops_per_token(cfg, params, args.seq_len)
    training_state = 18 * params  # bf16 params + fp32 grads, master, m, v (core/README.md, plan)
    cases = [args.only] if args.only else ["memory", "offload"]
    started = time.time()

    with tempfile.TemporaryDirectory(prefix="strata-gpu-bench-") as workdir:
        args.data = os.path.join(workdir, "tokens.u32")
        write_tokens(args.data, (args.warmup + args.steps + 2) * args.micro_batch * (args.seq_len + 1),
                     cfg["vocab_size"])
        spec = {"device": args.device, "config": cfg, "data": args.data, "micro_batch": args.micro_batch,
                "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
                "torch_checkpoint": args.torch_checkpoint}
        peak = run_worker(args, "peak", {}, workdir) if not smoke else {"status": "skipped",
                                                                        "message": "no GPU (--device cpu)"}
        peak_rate = peak.get("matmul_bf16_flops_per_s") if peak["status"] == "ok" else None
        rows = []

        def add(case, name, row, note=""):
            row = {"case": case, "name": name, **row}
            if note and row.get("status") == "ok":
                row["note"] = note
            if row.get("status") == "ok":
                if "tokens_per_s" not in row:
                    row["step_time_s"] = statistics.median(row["step_times_s"])
                    row["tokens_per_s"] = tokens_per_step / row["step_time_s"]
                row["mfu"] = model_flops * row["tokens_per_s"] / peak_rate if peak_rate else None
            rows.append(row)
            print(f"  {case:8s} {name:44s} {fmt_rate(row):>12s} tokens/s  {row_note(row)}", flush=True)
            return row

        print(f"gpu_train_bench: {args.model} ({params / 1e6:.1f}M parameters), {args.micro_batch} x "
              f"{args.seq_len} tokens per step, bf16, {args.steps} steps after {args.warmup} warm-up; "
              f"strata --backend {backend}", flush=True)
        memory_strata = memory_torch = offload_strata = offload_fsdp = offload_zero = None
        if "memory" in cases:
            memory_strata = add("memory", f"strata --backend {backend}, all on device",
                                run_strata(args, backend, workdir, "memory", ["--zero-stage", "0"]))
            torch_row = run_worker(args, "torch", spec, workdir)
            memory_torch = add("memory", f"PyTorch, autocast bf16, AdamW {torch_row.get('adamw', '')}", torch_row,
                               "; ".join(filter(None, [torch_row.get("precision"), torch_row.get("adamw_note")])))
        if "offload" in cases:
            placement = ["--zero-stage", "3", "--offload-param", "cpu", "--offload-optimizer", "cpu"]
            limit = args.device_mem_limit
            limit_note = "--device-mem-limit " + (limit or "")
            if not limit:
                device_peak = planned_device_peak(args, backend, placement)
                if device_peak:
                    limit = f"{math.ceil(device_peak * 1.10 / (1 << 20))}M"
                    below = "" if device_peak * 1.10 < training_state else ", not below it"
                    limit_note = (f"--device-mem-limit {limit} (plan peak + 10%; training state "
                                  f"{training_state / (1 << 20):,.0f}M{below})")
                else:
                    limit_note = "no --device-mem-limit: --print-plan gave no device total"
            extra = ["--device-mem-limit", limit] if limit else []
            offload_strata = add("offload", f"strata --backend {backend}, ZeRO-3 offload cpu",
                                 run_strata(args, backend, workdir, "offload-cpu", placement + extra), limit_note)
            if not args.quick:
                zero_offload = ["--zero-stage", "2", "--offload-optimizer", "cpu"]
                zo_peak = None if args.device_mem_limit else planned_device_peak(args, backend, zero_offload)
                zo_limit = args.device_mem_limit or (f"{math.ceil(zo_peak * 1.10 / (1 << 20))}M" if zo_peak else None)
                zo_extra = ["--device-mem-limit", zo_limit] if zo_limit else []
                offload_zero = add("offload", f"strata --backend {backend}, ZeRO-Offload cpu",
                                   run_strata(args, backend, workdir, "zero-offload", zero_offload + zo_extra),
                                   f"--device-mem-limit {zo_limit}" if zo_limit else "no --device-mem-limit")
            if args.nvme_path:
                nvme = ["--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer", "nvme",
                        "--nvme-path", args.nvme_path]
                add("offload", f"strata --backend {backend}, ZeRO-3 offload nvme",
                    run_strata(args, backend, workdir, "offload-nvme", nvme + extra), limit_note)
            fsdp_row = run_worker(args, "fsdp2", spec, workdir)
            offload_fsdp = add("offload", f"PyTorch FSDP2 CPU offload, AdamW {fsdp_row.get('adamw', '')}", fsdp_row,
                               "; ".join(filter(None, [fsdp_row.get("precision"), fsdp_row.get("adamw_note")])))

    ratios = {}
    if memory_strata is not None:
        ratios["memory"] = {"strata_over_pytorch": ratio(memory_strata, memory_torch), "target": 1.0}
    if offload_strata is not None:
        ratios["offload"] = {"strata_over_fsdp2": ratio(offload_strata, offload_fsdp), "target": 2.0}
    if offload_zero is not None:
        ratios["zero-offload"] = {"strata_over_fsdp2": ratio(offload_zero, offload_fsdp), "target": 2.0}

    print()
    device_name = peak.get("device") or ("cpu (smoke test)" if smoke else "not named (the matmul run failed)")
    torch_version = next((r["torch_version"] for r in [peak] + rows if r.get("torch_version")), "?")
    print(f"device: {device_name}; torch {torch_version}; {time.time() - started:.0f} s")
    if peak_rate:
        print(f"cuBLAS bf16 matmul {MATMUL_N}^3: {peak_rate / 1e12:.1f} TFLOP/s (the MFU denominator); model "
              f"{model_flops / 1e9:.2f} GFLOP per token (6N + 6LHT)")
    else:
        print(f"matmul rate: {peak.get('message', 'not measured')}; MFU not computed")
    print(f"{'case':8s} {'run':44s} {'tokens/s':>12s} {'step s':>8s} {'MFU':>6s} {'loss':>13s}")
    for row in rows:
        ok = row.get("status") == "ok"
        mfu = f"{100 * row['mfu']:.1f}%" if ok and row.get("mfu") is not None else "-"
        step = f"{row['step_time_s']:.3f}" if ok else "-"
        losses = row.get("losses") or []
        loss = f"{losses[0]:.2f} -> {losses[-1]:.2f}" if ok and losses else "-"
        text = f"{row['case']:8s} {row['name'][:44]:44s} {fmt_rate(row):>12s} {step:>8s} {mfu:>6s} {loss:>13s}"
        print(text if ok else f"{text}  {row_note(row)[:160]}")
    for case, r in ratios.items():
        value = next(v for k, v in r.items() if k != "target")
        print(f"{case:12s} ratio strata / {'PyTorch' if case == 'memory' else 'FSDP2':7s}: "
              f"{'n/a' if value is None else f'{value:.2f}x'} (target >= {r['target']:.1f}x)")

    failed = [r for r in rows if r.get("status") == "failed"]
    if args.json:
        result = {"model": args.model, "config": cfg, "parameters": params, "strata_parameters": reported,
                  "parameter_mismatch": mismatch, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                  "tokens_per_step": tokens_per_step, "steps": args.steps, "warmup": args.warmup,
                  "device": device_name, "torch": torch_version, "backend": backend, "flops_per_token": model_flops,
                  "matmul_bf16_flops_per_s": peak_rate, "training_state_bytes": training_state,
                  "rows": rows, "ratios": ratios, "failed_rows": len(failed), "seconds": time.time() - started}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if failed or mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
