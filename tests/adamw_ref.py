#!/usr/bin/env python3
"""strata's optimizer driver + CPU AdamW kernel against torch.optim.AdamW / Adam.

Runs tests/drivers/adamw_steps.cpp for a few steps on fresh random data and
does the same in PyTorch: parameter groups (weight decay on 2-D tensors only),
torch.nn.utils.clip_grad_norm_, DeepSpeed's LR schedules (their formulas,
written out below), fp16 loss scaling with a skipped overflow step, bf16/fp16
gradients and compute copies. Compares per-tensor relative errors of the fp32
master weights and both moments, the learning rate and gradient norm of every
step, and checks the compute copy bit for bit against torch's own cast of
strata's master weights.

Exit status: 0 pass, 1 fail, 77 when torch cannot be imported (ctest: skipped).
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
except ImportError as error:  # pragma: no cover
    print(f"skipping: {error}")
    sys.exit(77)

TOLERANCE = 1e-5  # per-tensor relative error against PyTorch (roundings differ)


def deepspeed_lr(scheduler, optimizer_lr, iteration):
    """lr_schedules.py's get_lr() for `last_batch_iteration` = iteration."""
    if scheduler is None:
        return optimizer_lr
    kind = scheduler["type"]
    steps = max(2, scheduler.get("warmup_num_steps", 1000))
    log_type = scheduler.get("warmup_type", "log") == "log"

    def warm(i):
        return (1.0 / math.log(steps)) * math.log(i + 1) if log_type else i / steps

    if kind in ("WarmupLR", "WarmupDecayLR"):
        low = scheduler.get("warmup_min_lr", 0.0)
        default_high = 0.001 if kind == "WarmupDecayLR" else optimizer_lr
        high = scheduler.get("warmup_max_lr", default_high)
        if iteration < 0:
            return low
        if iteration < steps:
            gamma = warm(iteration)
        elif kind == "WarmupDecayLR":
            total = scheduler["total_num_steps"]
            gamma = max(0.0, float(total - iteration) / float(max(1.0, total - steps)))
        else:
            gamma = 1.0
        return low + (high - low) * gamma
    assert kind == "WarmupCosineLR"
    if iteration < 0:
        return 0.0
    min_ratio = scheduler.get("warmup_min_ratio", 0.0)
    cos_min = scheduler.get("cos_min_ratio", 0.0001)
    if iteration < steps:
        ratio = min_ratio + warm(iteration) * (1.0 - min_ratio)
    else:
        total = scheduler["total_num_steps"]
        progress = min(1.0, (iteration - steps + 1) / max(1, total - steps))
        ratio = max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)
    return optimizer_lr * ratio


TORCH_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run_case(name, case, drivers, generator):
    shapes = case["shapes"]
    steps = case["steps"]
    grad_type = case["grad_type"]
    adamw = case["adamw"]
    fp16 = case.get("fp16")
    overflow_steps = set(case.get("overflow_steps", []))
    params = [torch.randn(shape, generator=generator) for shape in shapes]

    # The loss scale of each step as DeepSpeed's scaler sets it (hysteresis 1,
    # a window longer than the test: it only halves on overflow).
    scales = []
    scale = 2.0 ** fp16["initial_scale_power"] if fp16 else 1.0
    for k in range(steps):
        scales.append(scale)
        if k in overflow_steps:
            scale = max(scale / 2.0, 1.0)

    grads = []  # per step, per tensor: the gradient as strata receives it (torch tensor, grad dtype)
    for k in range(steps):
        step_grads = []
        for p in params:
            magnitude = 10.0 ** float(torch.empty(1).uniform_(-3, 0, generator=generator))
            g = torch.randn(p.shape, generator=generator) * magnitude * scales[k]
            step_grads.append(g.to(TORCH_DTYPE[grad_type]))
        if k in overflow_steps:
            step_grads[len(step_grads) // 2].view(-1)[3] = float("inf")
        grads.append(step_grads)

    with tempfile.TemporaryDirectory(prefix="strata-adamw-ref-") as tmp:
        config = {"tensors": [{"shape": list(s)} for s in shapes], "steps": steps,
                  "grad_type": grad_type, "copy_type": case["copy_type"], "adamw": adamw,
                  "gradient_clipping": case.get("gradient_clipping", 0.0)}
        if case.get("scheduler"):
            config["scheduler"] = case["scheduler"]
        if fp16:
            config["fp16"] = dict(fp16, enabled=True, hysteresis=1, loss_scale_window=1000)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        torch.cat([p.reshape(-1) for p in params]).numpy().tofile(os.path.join(tmp, "params.bin"))
        for k in range(steps):
            flat = torch.cat([g.reshape(-1) for g in grads[k]])
            raw = flat.view(torch.int16) if grad_type != "fp32" else flat
            raw.numpy().tofile(os.path.join(tmp, f"grads_{k}.bin"))
        result = subprocess.run([os.path.join(drivers, "adamw_steps"), tmp],
                                capture_output=True, text=True)
        if result.returncode != 0:
            print(f"{name}: driver failed: {result.stderr.strip()}")
            return False
        out = {key: np.fromfile(os.path.join(tmp, f"out_{key}.bin"), dtype=np.float32)
               for key in ("master", "exp_avg", "exp_avg_sq")}
        copy = None
        if case["copy_type"] != "none":
            copy = np.fromfile(os.path.join(tmp, "out_copy.bin"), dtype=np.uint16)
        with open(os.path.join(tmp, "out_log.json")) as f:
            log = json.load(f)

    # PyTorch: fp32 parameters, groups by dimension, the same schedule and clipping.
    torch_params = [torch.nn.Parameter(p.clone()) for p in params]
    decay = [p for p in torch_params if p.dim() == 2]
    no_decay = [p for p in torch_params if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": adamw["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    kind = torch.optim.AdamW if adamw.get("adam_w_mode", True) else torch.optim.Adam
    optimizer = kind(groups, lr=adamw["lr"], betas=(adamw["beta1"], adamw["beta2"]),
                     eps=adamw["eps"])
    ok = True
    iteration = -1
    applied = 0
    for k in range(steps):
        entry = log[k]
        if k in overflow_steps:
            if entry["apply"] or not entry["overflow"]:
                print(f"{name}: step {k} had inf gradients but strata did not skip it: {entry}")
                ok = False
            continue
        if not entry["apply"] or entry["loss_scale"] != scales[k]:
            print(f"{name}: step {k}: expected an applied step at loss scale {scales[k]}: {entry}")
            ok = False
        for p, g in zip(torch_params, grads[k]):
            p.grad = g.float() / scales[k]
        clip = case.get("gradient_clipping", 0.0)
        if clip > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(torch_params, clip))
        else:
            norm = float(torch.norm(torch.stack([p.grad.norm() for p in torch_params])))
        if abs(entry["grad_norm"] - norm) > 1e-5 * norm:
            print(f"{name}: step {k}: grad norm {entry['grad_norm']} vs torch {norm}")
            ok = False
        lr = deepspeed_lr(case.get("scheduler"), adamw["lr"], iteration)
        if abs(entry["lr"] - lr) > 1e-12 * max(lr, 1e-30):
            print(f"{name}: step {k}: lr {entry['lr']} vs DeepSpeed's schedule {lr}")
            ok = False
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        iteration += 1
        applied += 1
        if entry["step"] != applied:
            print(f"{name}: step {k}: Adam's t {entry['step']}, expected {applied}")
            ok = False

    def flat(tensors):
        return torch.cat([t.detach().reshape(-1).double() for t in tensors])

    expected = {"master": flat(torch_params),
                "exp_avg": flat([optimizer.state[p]["exp_avg"] for p in torch_params]),
                "exp_avg_sq": flat([optimizer.state[p]["exp_avg_sq"] for p in torch_params])}
    for key, want in expected.items():
        got = torch.from_numpy(out[key]).double()
        error = float((got - want).norm() / want.norm())
        verdict = "ok" if error < TOLERANCE else "FAIL"
        print(f"{name}: {key} relative error {error:.2e} ({verdict})")
        ok = ok and error < TOLERANCE
    # The update itself (master minus its start), which the master's own
    # magnitude would hide; cancellation in fp32 allows less precision here.
    start = flat(params)
    got_update = torch.from_numpy(out["master"]).double() - start
    want_update = expected["master"] - start
    error = float((got_update - want_update).norm() / want_update.norm())
    verdict = "ok" if error < 1e-4 else "FAIL"
    print(f"{name}: update (master - initial) relative error {error:.2e} ({verdict})")
    ok = ok and error < 1e-4
    if copy is not None:
        cast = torch.from_numpy(out["master"]).to(TORCH_DTYPE[case["copy_type"]])
        want_bits = cast.view(torch.int16).numpy().view(np.uint16)
        mismatches = int((want_bits != copy).sum())
        print(f"{name}: {case['copy_type']} copy vs torch's cast of the master: "
              f"{mismatches} mismatches")
        ok = ok and mismatches == 0
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--build-dir")
    parser.add_argument("--drivers", required=True)
    parser.add_argument("--strata")
    args = parser.parse_args()

    seed = random.SystemRandom().randrange(2**63)
    print(f"seed {seed}")
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 48), (48,), (37, 5), (33,), (7, 129)]
    base = {"lr": 2e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1}
    cases = {
        "fp32 AdamW, clipping, WarmupLR": dict(
            shapes=shapes, steps=6, grad_type="fp32", copy_type="none", adamw=base,
            gradient_clipping=0.05,
            scheduler={"type": "WarmupLR", "warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                       "warmup_num_steps": 4, "warmup_type": "linear"}),
        "bf16 grads and copy, WarmupDecayLR": dict(
            shapes=shapes, steps=6, grad_type="bf16", copy_type="bf16",
            adamw=dict(base, beta1=0.8, beta2=0.95), gradient_clipping=1.0,
            scheduler={"type": "WarmupDecayLR", "warmup_num_steps": 2, "total_num_steps": 8,
                       "warmup_max_lr": 5e-3}),
        "fp16 loss scale with overflow, WarmupCosineLR": dict(
            shapes=shapes, steps=7, grad_type="fp16", copy_type="fp16", adamw=base,
            gradient_clipping=0.1, fp16={"initial_scale_power": 10}, overflow_steps=[2, 4],
            scheduler={"type": "WarmupCosineLR", "warmup_num_steps": 2, "total_num_steps": 6,
                       "warmup_min_ratio": 0.1}),
        "Adam with L2 weight decay": dict(
            shapes=shapes, steps=4, grad_type="fp32", copy_type="bf16",
            adamw=dict(base, adam_w_mode=False, weight_decay=0.01)),
    }
    ok = True
    for name, case in cases.items():
        ok = run_case(name, case, args.drivers, generator) and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
