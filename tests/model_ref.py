#!/usr/bin/env python3
"""Reference test: strata's CPU backend against an independent model in PyTorch,
for each family strata computes (llama, qwen2, qwen3, mistral, and the
mixtures of experts mixtral and qwen3_moe).

Fresh random weights and tokens on every run (the seed is printed; pass --seed
to repeat one). For each case the weights go to strata through safetensors
files (F32, BF16 or F16, single or sharded) and a config.json; strata's driver
returns logits, loss and every parameter gradient through safetensors as well.
Each is compared by per-tensor relative error |a - b| / |b| against PyTorch in
fp32; the test fails above 1e-5.

The reference follows Hugging Face's LlamaForCausalLM (kernels/README.md):
RMSNorm in fp32, rotate_half rotary embeddings with llama3 scaling, grouped-
query attention, SwiGLU, tied or untied lm_head, mean cross-entropy; and the
families' differences as transformers' classes have them: Qwen2's biases on
q, k and v; Qwen3's RMSNorm on each head of q and k before the rotary
embedding, with a head_dim unrelated to hidden_size / heads; Mistral's
sliding window (query i sees keys j with i - window < j <= i); the mixtures'
sparse layers (softmax router, top k, renormalised or not, SwiGLU experts
under the released checkpoints' per-expert names; dense layers among them by
mlp_only_layers and decoder_sparse_step) and transformers'
load_balancing_loss_func per micro-batch, in the loss with
output_router_logits.
Exit codes: 0 pass, 1 fail, 77 skipped (no torch).
"""
import argparse
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:  # pragma: no cover
    print(f"skipping: {e}")
    sys.exit(77)

TOLERANCE = 1e-5

# --- safetensors, written and read with struct + json --------------------------

NP_DTYPES = {"F32": np.float32, "F16": np.float16}


def tensor_bytes(tensor, dtype):
    t = tensor.detach().contiguous()
    if dtype == "BF16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    return t.numpy().astype(NP_DTYPES[dtype]).tobytes()


def write_safetensors(path, tensors, dtype):
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        blob = tensor_bytes(t, dtype)
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        assert info["dtype"] == "F32", info
        array = np.frombuffer(data[begin:end], dtype=np.float32).reshape(info["shape"])
        out[name] = torch.from_numpy(array.copy())
    return out


def read_checkpoint(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(directory, "model.safetensors"))
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for name in files:
        out.update(read_safetensors(os.path.join(directory, name)))
    return out


def write_checkpoint(directory, tensors, dtype, shards):
    names = list(tensors)
    if shards == 1:
        write_safetensors(os.path.join(directory, "model.safetensors"), tensors, dtype)
        return
    weight_map, per = {}, math.ceil(len(names) / shards)
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per:(s + 1) * per]}
        write_safetensors(os.path.join(directory, file), part, dtype)
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


# --- the reference model --------------------------------------------------------


def head_dim_of(cfg):
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def inv_freq_of(cfg):
    D, base = head_dim_of(cfg), cfg["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    rs = cfg.get("rope_scaling")
    if rs:  # transformers' _compute_llama3_parameters
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


def rmsnorm(x, weight, eps):
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


MOE_FAMILIES = ("mixtral", "qwen3_moe")


def num_experts(cfg):
    return cfg["num_local_experts"] if cfg["model_type"] == "mixtral" else cfg["num_experts"]


def layer_is_sparse(cfg, i):
    if cfg["model_type"] not in MOE_FAMILIES:
        return False
    if i in (cfg.get("mlp_only_layers") or []):
        return False
    return (i + 1) % cfg.get("decoder_sparse_step", 1) == 0


def expert_names(cfg, pre):
    """The router's and each expert's (gate, up, down) names, as the released checkpoints have them."""
    mixtral = cfg["model_type"] == "mixtral"
    moe = pre + ("block_sparse_moe." if mixtral else "mlp.")
    parts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    return moe + "gate.weight", [[f"{moe}experts.{e}.{n}.weight" for n in parts] for e in range(num_experts(cfg))]


def moe_mlp(p, cfg, pre, h, routers):
    """A sparse layer's MLP: softmax router, each token's top k experts weighted by their
    probabilities (renormalised for mixtral and with norm_topk_prob), SwiGLU experts.
    Appends the layer's probabilities and choices to `routers` for the load-balancing loss."""
    B, T, C = h.shape
    x = h.reshape(-1, C)
    router, experts = expert_names(cfg, pre)
    probs = torch.softmax(x @ p[router].T, dim=-1)
    top, chosen = torch.topk(probs, cfg["num_experts_per_tok"], dim=-1)
    if cfg["model_type"] == "mixtral" or cfg.get("norm_topk_prob"):
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e, (gate, up, down) in enumerate(experts):
        token, slot = torch.where(chosen == e)
        if len(token) == 0:
            continue
        xe = x[token]
        y = (F.silu(xe @ p[gate].T) * (xe @ p[up].T)) @ p[down].T
        out = out.index_add(0, token, y * top[token, slot, None])
    routers.append((probs, chosen))
    return out.view(B, T, C)


def load_balancing_loss(cfg, routers, micro):
    """transformers' load_balancing_loss_func over the sparse layers, per micro-batch (its
    tokens), then the mean over the micro-batches."""
    E = num_experts(cfg)
    losses = []
    for m in range(micro):
        assigned, prob_sum, rows = torch.zeros(E), torch.zeros(E), 0
        for probs, chosen in routers:
            n = probs.shape[0] // micro
            assigned = assigned + F.one_hot(chosen[m * n:(m + 1) * n].reshape(-1), E).sum(0).float()
            prob_sum = prob_sum + probs[m * n:(m + 1) * n].sum(0)
            rows += n
        losses.append(E * torch.sum((assigned / rows) * (prob_sum / rows)))
    return torch.stack(losses).mean()


def reference_forward(p, cfg, inputs, targets, micro=1):
    """Logits and loss; a mixture's loss adds router_aux_loss_coef times its load-balancing
    loss when output_router_logits (the micro-batches' mean), which comes back third."""
    B, T = inputs.shape
    routers = []
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim_of(cfg)
    eps = cfg["rms_norm_eps"]
    inv_freq = inv_freq_of(cfg)
    positions = torch.arange(T).float()
    freqs = (inv_freq[None, :, None] @ positions[None, None, :]).transpose(1, 2)[0]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    window = cfg.get("sliding_window") if cfg["model_type"] in ("mistral", "mixtral") else None
    if window:
        mask = mask & ~torch.ones(T, T, dtype=torch.bool).tril(-window)
    x = p["model.embed_tokens.weight"][inputs]
    for i in range(cfg["num_hidden_layers"]):
        w = lambda n: p[f"model.layers.{i}.{n}.weight"]
        bias = lambda n: p.get(f"model.layers.{i}.{n}.bias", 0.0)
        h = rmsnorm(x, w("input_layernorm"), eps)
        q = (h @ w("self_attn.q_proj").T + bias("self_attn.q_proj")).view(B, T, H, D)
        k = (h @ w("self_attn.k_proj").T + bias("self_attn.k_proj")).view(B, T, KV, D)
        v = (h @ w("self_attn.v_proj").T + bias("self_attn.v_proj")).view(B, T, KV, D)
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):  # per head, over D, before the rotary embedding
            q = rmsnorm(q, w("self_attn.q_norm"), eps)
            k = rmsnorm(k, w("self_attn.k_norm"), eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(H // KV, dim=1)  # query head h reads kv head h // (H / KV)
        v = v.repeat_interleave(H // KV, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        scores = scores.masked_fill(~mask, float("-inf"))
        y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, H * D)
        x = x + y @ w("self_attn.o_proj").T
        h = rmsnorm(x, w("post_attention_layernorm"), eps)
        if layer_is_sparse(cfg, i):
            x = x + moe_mlp(p, cfg, f"model.layers.{i}.", h, routers)
        else:
            x = x + (F.silu(h @ w("mlp.gate_proj").T) * (h @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
    x = rmsnorm(x, p["model.norm.weight"], eps)
    lm_head = p["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else p["lm_head.weight"]
    logits = x @ lm_head.T
    loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
    if cfg["model_type"] not in MOE_FAMILIES:
        return logits, loss
    aux = load_balancing_loss(cfg, routers, micro)
    if cfg.get("output_router_logits"):
        loss = loss + cfg["router_aux_loss_coef"] * aux
    return logits, loss, aux


def parameter_shapes(cfg):
    C, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    H, KV, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim_of(cfg)
    shapes = {"model.embed_tokens.weight": (V, C)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({
            pre + "self_attn.q_proj.weight": (H * D, C), pre + "self_attn.k_proj.weight": (KV * D, C),
            pre + "self_attn.v_proj.weight": (KV * D, C), pre + "self_attn.o_proj.weight": (C, H * D),
            pre + "input_layernorm.weight": (C,), pre + "post_attention_layernorm.weight": (C,)})
        if layer_is_sparse(cfg, i):
            IE = cfg["intermediate_size"] if cfg["model_type"] == "mixtral" else cfg["moe_intermediate_size"]
            router, experts = expert_names(cfg, pre)
            shapes[router] = (num_experts(cfg), C)
            for gate, up, down in experts:
                shapes.update({gate: (IE, C), up: (IE, C), down: (C, IE)})
        else:
            shapes.update({pre + "mlp.gate_proj.weight": (I, C), pre + "mlp.up_proj.weight": (I, C),
                           pre + "mlp.down_proj.weight": (C, I)})
        if cfg["model_type"] == "qwen2":
            shapes.update({pre + "self_attn.q_proj.bias": (H * D,), pre + "self_attn.k_proj.bias": (KV * D,),
                           pre + "self_attn.v_proj.bias": (KV * D,)})
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            shapes.update({pre + "self_attn.q_norm.weight": (D,), pre + "self_attn.k_norm.weight": (D,)})
    shapes["model.norm.weight"] = (C,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, C)
    return shapes


def rel_error(a, b):
    return (a.double() - b.double()).norm().item() / max(b.double().norm().item(), 1e-30)


def run_case(args, case, generator, workdir):
    family = case.get("family", "llama")
    cfg = dict(case["config"], model_type=family, architectures=[ARCHITECTURES[family]], hidden_act="silu")
    B, T, dtype = case["B"], case["T"], case["dtype"]
    model_dir = os.path.join(workdir, case["name"])
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    params = {}
    for name, shape in parameter_shapes(cfg).items():
        if name.endswith(".bias"):  # biases well away from zero
            t = 0.3 * torch.randn(shape, generator=generator)
        elif len(shape) == 1:  # norm weights near 1, not exactly 1, so their gradients matter
            t = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        else:
            t = 0.08 * torch.randn(shape, generator=generator)
        params[name] = t
    write_checkpoint(model_dir, params, dtype, case["shards"])
    if dtype == "BF16":  # the reference sees what strata reads
        params = {n: t.to(torch.bfloat16).float() for n, t in params.items()}
    elif dtype == "F16":
        params = {n: t.half().float() for n, t in params.items()}
    V = cfg["vocab_size"]
    tokens = torch.randint(0, V, (B * T + 1,), generator=generator)
    tokens_path = os.path.join(workdir, case["name"] + ".tokens")
    tokens.numpy().astype(np.uint32).tofile(tokens_path)
    rows = torch.stack([tokens[b * T:b * T + T + 1] for b in range(B)])
    inputs, targets = rows[:, :-1], rows[:, 1:]

    out_dir = os.path.join(workdir, case["name"] + "-out")
    driver = os.path.join(args.drivers, "model_ref")
    run = subprocess.run([driver, model_dir, tokens_path, str(B), str(T), str(case["micro"]), out_dir],
                         capture_output=True, text=True)
    if run.returncode != 0:
        print(f"{case['name']}: driver failed ({run.returncode}): {run.stderr.strip()}")
        return False
    outputs = read_safetensors(os.path.join(out_dir, "outputs.safetensors"))
    grads = read_checkpoint(os.path.join(out_dir, "grads"))

    leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
    logits, loss, *aux = reference_forward(leaves, cfg, inputs, targets, case["micro"])
    loss.backward()
    errors = {"logits": rel_error(outputs["logits"], logits.detach()),
              "loss": rel_error(outputs["loss"], loss.detach().reshape(1))}
    if aux:
        errors["aux_loss"] = rel_error(outputs["aux_loss"], aux[0].detach().reshape(1))
    missing = sorted(set(params) - set(grads))
    if missing:
        print(f"{case['name']}: strata wrote no gradient for {missing}")
        return False
    idle = 0
    for name, leaf in leaves.items():
        # An expert no token reached has no gradient in PyTorch: strata's must be zero.
        reference = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        idle += leaf.grad is None
        errors["grad " + name] = rel_error(grads[name], reference)
    worst = max(errors, key=errors.get)
    grad_worst = max(v for k, v in errors.items() if k.startswith("grad"))
    ok = all(v <= TOLERANCE for v in errors.values())
    aux_text = f", load-balancing loss {errors['aux_loss']:.2e}" if aux else ""
    idle_text = f" ({idle} of them zero: idle experts)" if idle else ""
    print(f"{case['name']}: loss {loss.item():.6f}; relative error logits {errors['logits']:.2e}, "
          f"loss {errors['loss']:.2e}{aux_text}, worst of {len(leaves)} gradients {grad_worst:.2e}{idle_text} "
          f"-> {'ok' if ok else 'FAIL'} (tolerance {TOLERANCE:g})")
    if not ok:
        for k, v in sorted(errors.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {k}: {v:.3e}")
        print(f"    worst: {worst}")
    return ok


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}

CASES = [
    # Untied, grouped-query heads (6 query heads on 2 kv heads), llama3 rope scaling whose
    # original context makes the frequencies fall in all three bands; F32 in one file.
    {"name": "untied-gqa-llama3", "B": 2, "T": 19, "micro": 1, "dtype": "F32", "shards": 1,
     "config": {"vocab_size": 97, "hidden_size": 60, "intermediate_size": 100, "num_hidden_layers": 2,
                "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 10,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}},
    # Tied, one kv head for four query heads, head_dim * heads != hidden_size; BF16 weights in
    # three shards with an index; two micro-batches accumulate into the gradients.
    {"name": "tied-mqa-bf16-sharded", "B": 4, "T": 13, "micro": 2, "dtype": "BF16", "shards": 3,
     "config": {"vocab_size": 83, "hidden_size": 44, "intermediate_size": 72, "num_hidden_layers": 3,
                "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 12,
                "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
                "tie_word_embeddings": True, "rope_scaling": None}},
    # Tied with llama3 scaling, plain multi-head attention, F16 weights.
    {"name": "tied-mha-llama3-f16", "B": 1, "T": 23, "micro": 1, "dtype": "F16", "shards": 1,
     "config": {"vocab_size": 131, "hidden_size": 36, "intermediate_size": 90, "num_hidden_layers": 1,
                "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 12,
                "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": True,
                "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}},
    # Qwen2: biases on q, k and v, tied, grouped-query heads, head_dim derived (60 / 6), odd
    # vocabulary and sequence; two micro-batches.
    {"name": "qwen2-tied-gqa", "family": "qwen2", "B": 2, "T": 17, "micro": 2, "dtype": "F32", "shards": 2,
     "config": {"vocab_size": 101, "hidden_size": 60, "intermediate_size": 74, "num_hidden_layers": 2,
                "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 512,
                "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 2,
                "rope_scaling": None}},
    # Qwen3: q/k norms per head, head_dim 14 with 5 heads on hidden 38 (not hidden / heads), untied.
    {"name": "qwen3-untied-headdim", "family": "qwen3", "B": 1, "T": 21, "micro": 1, "dtype": "BF16", "shards": 1,
     "config": {"vocab_size": 89, "hidden_size": 38, "intermediate_size": 66, "num_hidden_layers": 2,
                "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 14,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
                "sliding_window": None, "rope_scaling": None}},
    # Mistral with a window of 7 keys over sequences of 25: the windowed mask computed.
    {"name": "mistral-window", "family": "mistral", "B": 2, "T": 25, "micro": 1, "dtype": "F32", "shards": 1,
     "config": {"vocab_size": 77, "hidden_size": 40, "intermediate_size": 86, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "tie_word_embeddings": False, "sliding_window": 7, "rope_scaling": None}},
    # Mistral without a window (v0.3's shape), tied.
    {"name": "mistral-nowindow", "family": "mistral", "B": 1, "T": 15, "micro": 1, "dtype": "F32", "shards": 1,
     "config": {"vocab_size": 65, "hidden_size": 30, "intermediate_size": 46, "num_hidden_layers": 1,
                "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 10,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "tie_word_embeddings": True, "sliding_window": None, "rope_scaling": None}},
    # Mixtral: 5 experts, top 2 renormalised, a window of 6 keys; the load-balancing loss in
    # the loss, per micro-batch (two of them), BF16 weights in two shards.
    {"name": "mixtral-aux-micro", "family": "mixtral", "B": 2, "T": 19, "micro": 2, "dtype": "BF16", "shards": 2,
     "config": {"vocab_size": 79, "hidden_size": 42, "intermediate_size": 38, "num_hidden_layers": 2,
                "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 14,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
                "tie_word_embeddings": False, "sliding_window": 6, "rope_scaling": None,
                "num_local_experts": 5, "num_experts_per_tok": 2, "output_router_logits": True,
                "router_aux_loss_coef": 0.41, "router_jitter_noise": 0.0}},
    # Qwen3-MoE: 6 experts, top 3 not renormalised, layer 0 dense (mlp_only_layers) and layer
    # 2 dense by decoder_sparse_step 2 (layers 1 and 3 sparse), tied.
    {"name": "qwen3moe-dense-layers", "family": "qwen3_moe", "B": 1, "T": 23, "micro": 1, "dtype": "F32",
     "shards": 1,
     "config": {"vocab_size": 87, "hidden_size": 34, "intermediate_size": 54, "moe_intermediate_size": 22,
                "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 12,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "tie_word_embeddings": True, "attention_bias": False, "use_sliding_window": False,
                "rope_scaling": None, "num_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": False,
                "decoder_sparse_step": 2, "mlp_only_layers": [0], "output_router_logits": True,
                "router_aux_loss_coef": 0.23}},
    # Qwen3-MoE on 3 tokens over 11 experts, top 2 renormalised: most experts get no token
    # (their gradients zero); the load-balancing loss computed but not in the loss.
    {"name": "qwen3moe-idle-experts", "family": "qwen3_moe", "B": 1, "T": 3, "micro": 1, "dtype": "F32",
     "shards": 1,
     "config": {"vocab_size": 61, "hidden_size": 26, "intermediate_size": 40, "moe_intermediate_size": 18,
                "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
                "rope_scaling": None, "num_experts": 11, "num_experts_per_tok": 2, "norm_topk_prob": True,
                "output_router_logits": False, "router_aux_loss_coef": 0.001}},
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir")
    parser.add_argument("--drivers", required=True)
    parser.add_argument("--strata")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print(f"model_ref: seed {seed} (rerun with --seed {seed}); torch {torch.__version__}")
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    ok = True
    with tempfile.TemporaryDirectory(prefix="strata-model-ref-") as workdir:
        for case in CASES:
            ok = run_case(args, case, generator, workdir) and ok
    print("model_ref: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
