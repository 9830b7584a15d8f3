#!/usr/bin/env python3
"""A small mixture of experts against two dense models, everything on NVMe.

  benches/moe_step_bench.py [--strata build/tools/strata] [--out build/moe-bench] [--steps 12]
                            [--micro-batch 4 --seq-len 128 --grad-accum 1] [--experts 8 --top-k 2]
                            [--gradient-home auto|host|nvme] [--offload-optimizer nvme|cpu]
                            [--optimizer-state fp32|bf16|int8] [--backend cpu|cuda]
                            [--world-size 1]

Models of the same attention (hidden 256, 4 layers, 8 heads, byte
vocabulary) trained side by side in one command on the CPU backend, stage 3,
parameters and optimizer state on NVMe (`--offload-param nvme
--offload-optimizer nvme`), 4 sequences of 128 tokens a step by default:

- moe: a Mixtral-shaped mixture, E experts of 344 (8 by default), k per token
  (2; the load-balancing loss in the loss), whole decoder layers: every
  expert read with its layer;
- moe-routed: the same mixture with its layers in pieces (`--layer-pieces 2`),
  whose sparse MLP pieces read from NVMe only the experts a micro-batch's
  tokens reach (routed expert fetch, the default `--expert-fetch routed`);
- moe-deferred: moe-routed whose optimizer steps an expert no token reached
  only when it is next read, replaying its missed steps
  (`--expert-update deferred`): the bits of moe-routed;
- dense-active: a Llama of the same active parameters (intermediate k x 344);
- dense-total: a Llama of the same total parameters (intermediate E x 344).

Printed per model: parameters (total, active), median step time after the
first two steps, the time relative to each dense model, NVMe bytes read and
written per step (the engine's counters, `--metrics`; the mean over every
step), and the last loss.
Routed reads cut the parameters' reads only: with the eager update an
expert's gradient and optimizer state are read and written whole each step.
With 512 tokens a step a layer's tokens reach every expert, so the mixture
moves what the whole layers do; fewer tokens a micro-batch (`--micro-batch 1
--seq-len 8 --grad-accum 4`) and more experts (`--experts 32 --top-k 1`)
leave experts idle for steps, which deferred updates skip.
`--offload-optimizer cpu` keeps every model's optimizer state in host
memory (the parameters stay on NVMe): then an eager step writes every
expert's parameters, and a deferred one only the windows it stepped.
`--optimizer-state` stores every model's moments in fp32 (the default), bf16
or int8 (`--optimizer-state-dtype`); with int8 the deferred update waits in
whole 256-element blocks of an expert. `--backend cuda` trains every model
on the GPU: the mixture routes there, and with the optimizer state off the
GPU (here always) its updates defer on the CPU as on the CPU backend.
`--world-size N` trains every model at N ranks (threads of one process):
there the ranks join their routings before each sparse forward and read and
send only the experts some rank's tokens reached, and moe-deferred's ranks
each step and replay their shard's part of the experts. The network column
is the bytes the ranks sent each step (all ranks together).
"""
import argparse
import json
import os
import statistics
import subprocess

BASE = {"vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def models(experts, top_k):
    """name: (config, extra flags)."""
    mixtral = dict(BASE, model_type="mixtral", intermediate_size=344, num_local_experts=experts,
                   num_experts_per_tok=top_k, output_router_logits=True, router_aux_loss_coef=0.02)
    routed = ["--layer-pieces", "2", "--expert-fetch", "routed"]
    return {
        "moe": (mixtral, ["--layer-pieces", "1"]),
        "moe-routed": (mixtral, routed),
        "moe-deferred": (mixtral, routed + ["--expert-update", "deferred"]),
        "dense-active": (dict(BASE, model_type="llama", intermediate_size=top_k * 344), ["--layer-pieces", "1"]),
        "dense-total": (dict(BASE, model_type="llama", intermediate_size=experts * 344), ["--layer-pieces", "1"]),
    }


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def counts(cfg):
    C, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = C // H
    attention = C * H * D * 2 + 2 * C * KV * D + 2 * C
    outer = 2 * V * C + C
    I = cfg["intermediate_size"]
    if cfg["model_type"] == "mixtral":
        E, k = cfg["num_local_experts"], cfg["num_experts_per_tok"]
        return outer + L * (attention + E * C + E * 3 * C * I), outer + L * (attention + E * C + k * 3 * C * I)
    total = outer + L * (attention + 3 * C * I)
    return total, total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strata", default="build/tools/strata")
    parser.add_argument("--out", default="build/moe-bench")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--gradient-home", default="auto",
                        help="strata train --gradient-home for every model (auto, host, nvme)")
    parser.add_argument("--offload-optimizer", default="nvme", choices=["nvme", "cpu"],
                        help="home of every model's optimizer state (nvme, or cpu: host memory)")
    parser.add_argument("--optimizer-state", default="fp32", choices=["fp32", "bf16", "int8"],
                        help="every model's Adam moments (--optimizer-state-dtype)")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"],
                        help="strata train --backend for every model (cuda: moe and the dense rows)")
    parser.add_argument("--world-size", type=int, default=1,
                        help="ranks every model trains at (threads of one process)")
    args = parser.parse_args()
    strata = os.path.abspath(args.strata)
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "demo")
    if not os.path.exists(os.path.join(data, "train.bin")):
        run([strata, "demo-data", "--out", data], stdout=subprocess.DEVNULL)
    version = subprocess.run([strata, "--version"], capture_output=True, text=True).stdout.strip()
    print(version.replace("\n", "; "))
    rows = {}
    print(f"{args.micro_batch} x {args.seq_len} tokens a micro-batch, {args.grad_accum} a step; "
          f"{args.experts} experts, {args.top_k} per token; gradients {args.gradient_home}; "
          f"optimizer state {'on NVMe' if args.offload_optimizer == 'nvme' else 'in host memory'}, "
          f"{args.optimizer_state} moments; "
          f"backend {args.backend}; {args.world_size} rank(s)")
    for name, (cfg, flags) in models(args.experts, args.top_k).items():
        model_dir = os.path.join(args.out, name)
        os.makedirs(model_dir, exist_ok=True)
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(cfg, f)
        metrics = os.path.join(args.out, name + ".jsonl")
        run([strata, "train", "--model", model_dir, "--backend", args.backend, "--data", os.path.join(data, "train.bin"),
             "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
             "--grad-accum", str(args.grad_accum), "--steps", str(args.steps), "--lr", "3e-3",
             "--zero-stage", "3", "--offload-param", "nvme", "--offload-optimizer", args.offload_optimizer,
             "--nvme-path", os.path.join(args.out, "swap"), "--hardware", "none", "--metrics", metrics,
             "--gradient-home", args.gradient_home, "--optimizer-state-dtype", args.optimizer_state,
             "--world-size", str(args.world_size)] + flags,
            stdout=subprocess.DEVNULL)
        with open(metrics) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        steady = lines[2:] or lines
        rows[name] = {"params": counts(cfg), "seconds": statistics.median(l["step_time_s"] for l in steady),
                      # Bytes: the mean over every step (an update's writes may land in
                      # the next step's count, so single steps jitter; the sum does not).
                      "read": statistics.mean(l["nvme_read_bytes"] for l in lines),
                      "written": statistics.mean(l["nvme_written_bytes"] for l in lines),
                      "network": statistics.mean(l.get("network_bytes", 0) for l in lines),
                      "loss": lines[-1]["loss"], "aux": lines[-1].get("aux_loss")}
    print(f"\n{'model':>13} {'params':>10} {'active':>10} {'s/step':>8} {'/ active':>9} {'/ total':>8} "
          f"{'NVMe read/step':>15} {'written/step':>13} {'network/step':>13} {'last loss':>10}")
    for name, r in rows.items():
        aux = f" (aux {r['aux']:.3f})" if r["aux"] is not None else ""
        print(f"{name:>13} {r['params'][0]:>10,} {r['params'][1]:>10,} {r['seconds']:>8.3f} "
              f"{r['seconds'] / rows['dense-active']['seconds']:>9.2f} {r['seconds'] / rows['dense-total']['seconds']:>8.2f} "
              f"{r['read']:>15,.0f} {r['written']:>13,.0f} {r['network']:>13,.0f} {r['loss']:>10.4f}{aux}")


if __name__ == "__main__":
    main()
