#!/usr/bin/env python3
"""strata against DeepSpeed ZeRO-3, side by side: step time and losses.

One command builds a random Hugging Face Llama model (transformers, fp32
safetensors), a token file, and one DeepSpeed JSON config per row, then runs
the row with both engines in turn, each reading that same file:

  strata     `strata train --config ds.json --init MODEL --data tokens.bin --seq-len T`
  DeepSpeed  `deepspeed.initialize(config=ds.json)` on LlamaForCausalLM(MODEL), ZeRO
             stage 3, one process (DS_ACCELERATOR=cpu unless --backend cuda)

The file holds the micro-batch, the gradient accumulation, AdamW (lr, betas,
eps, weight decay), gradient clipping, no lr schedule (constant), fp32, and
the placements of the row:

  opt cpu               offload_optimizer cpu
  opt nvme              offload_optimizer nvme
  param cpu, opt nvme   offload_param cpu + offload_optimizer nvme
  param nvme, opt nvme  offload_param nvme + offload_optimizer nvme
                        (--ds-param-cpu: DeepSpeed's side with offload_param cpu,
                        from a file of its own; the row is marked *)

each with every --accum value (default 1 and 4). strata picks its step order
(--schedule auto: layer-major when parameters move over NVMe with
accumulation); the table says which one ran, from its --print-plan.

The same weights: DeepSpeed builds the model inside deepspeed.zero.Init with
the config and copies each tensor of the safetensors file into it through
GatheredParameters. (Leaving the partitioning to deepspeed.initialize makes
DeepSpeed 0.19.8 choose bf16 for its NVMe parameter swapper on a CPU without
fp16 support, whatever the model's dtype: parameters on NVMe come back
rounded to bf16, and larger models fail in the swapper.)

The same tokens in the same order: sequence j of the token file is tokens
[j*T, j*T + T + 1) (inputs the first T, targets the last T); step s (from 0),
micro-batch m, row b reads sequence (s*G*B + m*B + b) mod S, S = (tokens - 1) / T
(core/data/token_data.h, one rank). DeepSpeed's side reads exactly those
windows from the same file.

The same loss and optimizer:
  - the loss of a micro-batch is the mean token cross-entropy over its B*T
    targets (computed from the logits, not through transformers' own shifted
    loss, which would drop a target); DeepSpeed's engine.backward divides it by
    the accumulation G, and every micro-batch has B*T targets, so the step
    optimises the mean over the G*B*T targets of the step, which is strata's
    loss; the loss reported for DeepSpeed is the mean of its G micro-batch
    losses, which is that same mean;
  - weight decay on 2-D tensors only (strata's rule, Hugging Face Trainer's
    groups): DeepSpeed gets two parameter groups, the norms' with weight decay
    0 (a partitioned parameter's shape is its ds_shape: its .data is empty);
  - AdamW: DeepSpeed builds its optimizer from the config's `optimizer` block;
    with offload_optimizer it is DeepSpeedCPUAdam (adamw_mode, bias
    correction) unless --ds-torch-adam writes "torch_adam": true (then
    torch.optim.AdamW); the last line says which ran.

Per row: median step time of each after --warmup steps (strata's step_time_s
from --metrics; DeepSpeed's the wall time of its G forward/backward/step
calls), strata / DeepSpeed, the loss of step 1 and of the last step of each,
and the largest relative difference of the losses over all steps (the JSON
also has the gradient norms'). A side that cannot run the row is reported in
it with the reason (its last line of error), and the bench exits 1.

--formats fp32,bf16,int8 (default fp32) adds under each placement a row per
optimizer state format: strata's config file adds "strata":
{"optimizer_state_dtype": FORMAT}; beside the bf16 row DeepSpeed's file has
"fp32_optimizer_states": false in zero_optimization.offload_optimizer
(DeepSpeed 0.19.8 refuses that key there: the block forbids unknown keys; the
row says so and DeepSpeed runs again with the key in optimizer.params, where
0.19.8 reads it and hands it to DeepSpeedCPUAdam, which then keeps m and v in
the dtype of the fp32 master partition: fp32; the row prints the dtype the
worker found). DeepSpeed has no int8 state: an int8 row shows its fp32 run.
These rows also print the relative difference of strata's loss from its own
fp32 row (at step N and over all steps) and strata's NVMe bytes per step
(nvme_read_bytes / nvme_written_bytes from --metrics, medians).

    python3 benches/vs_deepspeed.py --strata build/tools/strata --python VENV/bin/python [--steps 8]
        [--accum 1,4] [--rows opt-cpu,opt-nvme,param-cpu,param-nvme] [--formats fp32,bf16,int8]
        [--nvme-path DIR]
        [--hidden 512 --layers 8 --vocab 8192 --seq-len 64 --micro-batch 1] [--json OUT.json]

--python is an interpreter with PyPI torch, deepspeed, transformers and
safetensors (a virtual environment; DeepSpeed's async I/O op needs
libaio-dev); this script itself needs only Python 3. DeepSpeed builds its ops
(CPU Adam, async I/O, shared-memory comm) the first time they are used, which
takes minutes: the bench loads them once before the rows, untimed.
NVMe swap files go under --nvme-path (default: a temporary directory under
the current directory, which must not be a tmpfs: both engines use O_DIRECT).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROWS = {
    # name: (offload_param, offload_optimizer)
    "opt-cpu": ("none", "cpu"),
    "opt-nvme": ("none", "nvme"),
    "param-cpu": ("cpu", "nvme"),
    "param-nvme": ("nvme", "nvme"),
}
ROW_TITLES = {
    "opt-cpu": "opt cpu",
    "opt-nvme": "opt nvme",
    "param-cpu": "param cpu, opt nvme",
    "param-nvme": "param nvme, opt nvme",
}


# ---------------------------------------------------------------- workers (run under --python)

def worker_make_model(args):
    """A random LlamaForCausalLM in fp32, saved as config.json + model.safetensors."""
    import torch
    import transformers
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(1024, args.seq_len), rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, torch_dtype="float32")
    model = transformers.LlamaForCausalLM(config).float()
    model.save_pretrained(args.out, safe_serialization=True)
    count = sum(p.numel() for p in model.parameters())
    print(json.dumps({"parameters": count, "transformers": transformers.__version__,
                      "torch": torch.__version__}))


def worker_prepare(args):
    """Loads (JIT-builds the first time) the DeepSpeed ops the rows use, outside their timeouts."""
    if args.backend == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator import get_accelerator
    names = ["CPUAdamBuilder"] + (["AsyncIOBuilder"] if args.nvme else []) + \
        (["ShareMemCommBuilder"] if args.backend == "cpu" else [])
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None:
            builder.load()


def read_tokens(path):
    import numpy as np
    return np.fromfile(path, dtype=np.uint16).astype(np.int64)


def build_under_zero_init(args, config, torch, deepspeed, transformers):
    """LlamaForCausalLM built inside zero.Init, its weights copied in from the model directory."""
    hf_config = transformers.LlamaConfig.from_pretrained(args.model)
    hf_config.use_cache = False
    hf_config._attn_implementation = "eager"
    # The model is built inside zero.Init with the config (dtype from it: fp32), then each
    # parameter is loaded from the safetensors file through GatheredParameters. Leaving the
    # partitioning to deepspeed.initialize instead makes its Init pick bf16 for the parameter
    # swapper on a CPU without fp16 support (its _set_dtype ignores an explicit fp32 there),
    # so that parameters homed on NVMe would be rounded to bf16.
    # Imported before zero.Init: importing torch._dynamo (transformers does it lazily) while
    # Init has replaced torch.Tensor.__new__ fails.
    import torch._dynamo  # noqa: F401
    model_class = transformers.LlamaForCausalLM
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = model_class(hf_config)
    from safetensors.torch import load_file
    weights = {}
    for name in sorted(os.listdir(args.model)):
        if name.endswith(".safetensors"):
            weights.update(load_file(os.path.join(args.model, name)))
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(weights[name].to(param.dtype))
    del weights
    return model


def worker_deepspeed(args):
    """ZeRO-3 training of the model directory with the DeepSpeed config, one process."""
    if args.backend == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(args.port))
    import torch
    import torch.nn.functional as F
    import deepspeed
    import transformers
    from deepspeed.accelerator import get_accelerator

    config = json.load(open(args.config))
    B = config["train_micro_batch_size_per_gpu"]
    G = config.get("gradient_accumulation_steps", 1)
    T = args.seq_len
    tokens = read_tokens(args.data)
    sequences = (len(tokens) - 1) // T

    deepspeed.init_distributed()
    device = get_accelerator().device_name()
    if args.ds_late_partition:
        # The other way: load the whole model, let deepspeed.initialize partition it.
        model = transformers.LlamaForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32,
                                                              attn_implementation="eager")
        model.config.use_cache = False
    else:
        model = build_under_zero_init(args, config, torch, deepspeed, transformers)
    # Partitioned parameters hold an empty tensor: their shape is ds_shape.
    rank_of = lambda p: len(getattr(p, "ds_shape", p.shape))
    decay = [p for _, p in model.named_parameters() if rank_of(p) == 2]
    no_decay = [p for _, p in model.named_parameters() if rank_of(p) != 2]
    weight_decay = config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    inner = getattr(optimizer, "optimizer", optimizer)
    info = {"deepspeed": deepspeed.__version__, "torch": torch.__version__, "accelerator": device,
            "optimizer": type(inner).__module__ + "." + type(inner).__name__,
            "threads": torch.get_num_threads()}
    vocab = model.config.vocab_size
    out = open(args.metrics, "w")
    out.write(json.dumps({"info": info}) + "\n")
    out.flush()
    for step in range(args.steps):
        start = time.perf_counter()
        losses = []
        for m in range(G):
            rows = [((step * G + m) * B + b) % sequences for b in range(B)]
            batch = torch.stack([torch.from_numpy(tokens[j * T:j * T + T + 1]) for j in rows]).to(device)
            logits = engine(input_ids=batch[:, :T]).logits
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), batch[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        elapsed = time.perf_counter() - start
        norm = engine.get_global_grad_norm()
        out.write(json.dumps({"step": step + 1, "loss": sum(losses) / G, "step_time_s": elapsed,
                              "grad_norm": None if norm is None else float(norm)}) + "\n")
        if step == 0:
            # The dtype DeepSpeed's optimizer actually keeps Adam's moments in (with the
            # optimizer on NVMe the swapped-out state tensors are empty, but keep their dtype).
            dtypes = sorted({str(state[key].dtype).replace("torch.", "") for state in inner.state.values()
                             for key in ("exp_avg", "exp_avg_sq") if key in state})
            out.write(json.dumps({"state_dtypes": dtypes,
                                  "fp32_optimizer_states": getattr(inner, "fp32_optimizer_states", None)}) + "\n")
        out.flush()
    out.close()


# ---------------------------------------------------------------- the bench

def last_error_line(text):
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    lines = [l[len("[rank0]:"):].strip() if l.startswith("[rank0]:") else l for l in lines]
    for i, line in enumerate(lines):
        # A pydantic refusal of a config key: name the key, not the link after it.
        if "Extra inputs are not permitted" in line and i > 0:
            return f"{lines[i - 1]}: {line.split(' [type=')[0]} (pydantic, extra_forbidden)"
    for line in reversed(lines):
        if "Error" in line or "error" in line or "refused" in line or "cannot" in line:
            return line[:300]
    return lines[-1][:300] if lines else "no output"


def ds_config(args, row, accum, side, nvme_dir, fmt="fp32", ds_key="offload_optimizer"):
    """The DeepSpeed JSON config of one row; with --ds-param-cpu, DeepSpeed's side of the
    param-nvme row keeps the parameters in host memory. fmt: the optimizer state format;
    strata's side gets "strata": {"optimizer_state_dtype": fmt}, DeepSpeed's side of a bf16 row
    "fp32_optimizer_states": false in its offload_optimizer block (ds_key "optimizer": in the
    optimizer's params instead, where DeepSpeed 0.19.8 reads it); int8 has no DeepSpeed
    counterpart, so DeepSpeed's side of an int8 row is its fp32 config."""
    param, optimizer = ROWS[row]
    if side == "deepspeed" and param == "nvme" and args.ds_param_cpu:
        param = "cpu"
    zero = {"stage": 3, "offload_optimizer": {"device": optimizer}, "offload_param": {"device": param}}
    if optimizer != "none":
        zero["offload_optimizer"]["pin_memory"] = True
    if optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = nvme_dir
    if param != "none":
        zero["offload_param"]["pin_memory"] = True
    if param == "nvme":
        zero["offload_param"]["nvme_path"] = nvme_dir
    params = {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": args.weight_decay}
    if args.ds_torch_adam:
        params["torch_adam"] = True
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": args.clip,
        "zero_optimization": zero,
        "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                "single_submit": False, "overlap_events": True},
        "steps_per_print": 1000000,
        "wall_clock_breakdown": False,
    }
    if side == "strata" and fmt != "fp32":
        config["strata"] = {"optimizer_state_dtype": fmt}
    if side == "deepspeed" and fmt == "bf16":
        if ds_key == "offload_optimizer":
            zero["offload_optimizer"]["fp32_optimizer_states"] = False
        else:
            params["fp32_optimizer_states"] = False
    return config


def strata_schedule(args, config_path, model_dir, data):
    command = [args.strata, "train", "--config", config_path, "--init", model_dir, "--model", model_dir,
               "--data", data, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--backend", args.backend, "--print-plan"]
    run = subprocess.run(command, capture_output=True, text=True)
    for line in run.stdout.splitlines():
        if line.startswith("schedule"):
            return line.split()[1].rstrip(":")
    return "?"


def run_strata(args, config_path, model_dir, data, metrics):
    command = [args.strata, "train", "--config", config_path, "--init", model_dir, "--model", model_dir,
               "--data", data, "--seq-len", str(args.seq_len), "--steps", str(args.steps),
               "--backend", args.backend, "--metrics", metrics]
    start = time.monotonic()
    run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - start
    lines = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
    if run.returncode != 0 or len(lines) < args.steps:
        return {"error": last_error_line(run.stderr + run.stdout)}, wall
    kernels = [l.split(":", 1)[1].strip() for l in run.stdout.splitlines() if l.startswith("cpu kernels:")]
    return {"losses": [l["loss"] for l in lines], "times": [l["step_time_s"] for l in lines],
            "grad_norms": [l.get("grad_norm") for l in lines], "cpu_kernels": kernels[0] if kernels else None,
            "nvme_read_bytes": [l.get("nvme_read_bytes", 0) for l in lines],
            "nvme_written_bytes": [l.get("nvme_written_bytes", 0) for l in lines]}, wall


def run_deepspeed(args, config_path, model_dir, data, metrics, port):
    command = [args.python, os.path.abspath(__file__), "--worker", "deepspeed", "--config-file", config_path,
               "--model-dir", model_dir, "--data-file", data, "--seq-len", str(args.seq_len),
               "--steps", str(args.steps), "--metrics-file", metrics, "--backend", args.backend,
               "--port", str(port)] + (["--ds-late-partition"] if args.ds_late_partition else [])
    start = time.monotonic()
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}, time.monotonic() - start
    wall = time.monotonic() - start
    lines = [json.loads(l) for l in open(metrics)] if os.path.exists(metrics) else []
    info = lines[0]["info"] if lines and "info" in lines[0] else {}
    steps = [l for l in lines if "step" in l]
    if run.returncode != 0 or len(steps) < args.steps:
        return {"error": last_error_line(run.stderr + run.stdout), "info": info}, wall
    for l in lines:
        if "state_dtypes" in l:
            info = dict(info, state_dtypes=l["state_dtypes"], fp32_optimizer_states=l["fp32_optimizer_states"])
    return {"losses": [l["loss"] for l in steps], "times": [l["step_time_s"] for l in steps],
            "grad_norms": [l.get("grad_norm") for l in steps], "info": info}, wall


def median_after(times, warmup):
    kept = times[warmup:] or times
    return statistics.median(kept)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strata", default="build/tools/strata")
    parser.add_argument("--python", default="python3",
                        help="Python with torch, deepspeed, transformers, safetensors (default python3)")
    parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--accum", default="1,4", help="gradient accumulation values, one row each")
    parser.add_argument("--rows", default=",".join(ROWS), help="placements: " + ", ".join(ROWS))
    parser.add_argument("--formats", default="fp32",
                        help="strata optimizer state formats, one row each per placement: fp32, bf16, int8 "
                             "(DeepSpeed beside bf16 with \"fp32_optimizer_states\": false)")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping (0: off)")
    parser.add_argument("--ds-torch-adam", action="store_true",
                        help="\"torch_adam\": true: DeepSpeed runs torch.optim.AdamW instead of its CPU Adam")
    parser.add_argument("--ds-param-cpu", action="store_true",
                        help="DeepSpeed's side of the param-nvme row with offload_param cpu")
    parser.add_argument("--ds-late-partition", action="store_true",
                        help="DeepSpeed loads the whole model and deepspeed.initialize partitions it "
                             "(its NVMe parameter swapper then runs in bf16 on a CPU without fp16)")
    parser.add_argument("--nvme-path", help="swap directory for both engines (default: a temporary one here)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--keep", help="keep the model, data and configs in this directory")
    parser.add_argument("--json", help="also write the results here")
    # Worker modes, run under --python.
    parser.add_argument("--worker", choices=["make-model", "prepare", "deepspeed"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--config-file", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data-file", help=argparse.SUPPRESS)
    parser.add_argument("--metrics-file", help=argparse.SUPPRESS)
    parser.add_argument("--nvme", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29533, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker == "make-model":
        return worker_make_model(args)
    if args.worker == "prepare":
        return worker_prepare(args)
    if args.worker == "deepspeed":
        args.config, args.model, args.data, args.metrics = \
            args.config_file, args.model_dir, args.data_file, args.metrics_file
        return worker_deepspeed(args)

    rows = [r for r in args.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            parser.error(f"--rows: unknown row {r!r} (choose from {', '.join(ROWS)})")
    accums = [int(a) for a in args.accum.split(",") if a]
    formats = [f for f in args.formats.split(",") if f]
    for f in formats:
        if f not in ("fp32", "bf16", "int8"):
            parser.error(f"--formats: unknown format {f!r} (choose from fp32, bf16, int8)")
    if formats != ["fp32"] and formats[0] != "fp32":
        formats = ["fp32"] + [f for f in formats if f != "fp32"]
    work = args.keep or tempfile.mkdtemp(prefix="vs-deepspeed-")
    os.makedirs(work, exist_ok=True)
    made_swap = args.nvme_path is None
    nvme_root = args.nvme_path or tempfile.mkdtemp(prefix="vs-deepspeed-swap-", dir=os.getcwd())
    try:
        return bench(args, rows, accums, formats, work, nvme_root)
    finally:
        if made_swap:
            shutil.rmtree(nvme_root, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def bench(args, rows, accums, formats, work, nvme_root):
    model_dir = os.path.join(work, "model")
    made = subprocess.run([args.python, os.path.abspath(__file__), "--worker", "make-model", "--out", model_dir,
                           "--vocab", str(args.vocab), "--hidden", str(args.hidden),
                           "--intermediate", str(args.intermediate), "--layers", str(args.layers),
                           "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
                           "--seq-len", str(args.seq_len), "--seed", str(args.seed)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        print(f"could not make the model with {args.python}: {last_error_line(made.stderr)}")
        return 1
    model_info = json.loads(made.stdout.strip().splitlines()[-1])
    # DeepSpeed builds its ops (CPU Adam, async I/O, shared-memory comm) on first use, which
    # takes minutes; load them once here, untimed.
    start = time.monotonic()
    prepared = subprocess.run([args.python, os.path.abspath(__file__), "--worker", "prepare", "--backend",
                               args.backend] + (["--nvme"] if any(ROWS[r][1] == "nvme" for r in rows) else []),
                              capture_output=True, text=True)
    if prepared.returncode != 0:
        print(f"DeepSpeed's ops could not be loaded: {last_error_line(prepared.stderr)}")
    ops_seconds = time.monotonic() - start
    # The tokens: strata's demo text as byte tokens (nanoGPT uint16), enough for every step
    # of the largest accumulation without wrapping.
    needed = args.steps * max(accums) * args.micro_batch * args.seq_len + 1
    data_dir = os.path.join(work, "data")
    subprocess.run([args.strata, "demo-data", "--out", data_dir, "--tokens", str(max(needed, 100000))],
                   check=True, stdout=subprocess.DEVNULL)
    data = os.path.join(data_dir, "train.bin")

    print(f"model: random Llama, {model_info['parameters'] / 1e6:.1f} M parameters (hidden {args.hidden}, "
          f"{args.layers} layers, {args.heads}/{args.kv_heads} heads, intermediate {args.intermediate}, vocab "
          f"{args.vocab}, untied), fp32; transformers {model_info['transformers']}, torch {model_info['torch']}")
    print(f"batch: micro-batch {args.micro_batch} x {args.seq_len} tokens; AdamW lr {args.lr} betas 0.9/0.95 "
          f"eps 1e-8 weight decay {args.weight_decay} (2-D tensors), clipping {args.clip}, constant lr; "
          f"{args.steps} steps, medians after {args.warmup}; {os.cpu_count()} cores (load average "
          f"{os.getloadavg()[0]:.1f} at the start); swap under {nvme_root}")
    sys.stdout.flush()

    results = []
    port = 29500 + os.getpid() % 1000
    for accum in accums:
        for row in rows:
            fp32_entry = None
            for fmt in formats:
                port += 2
                entry = run_row(args, row, accum, fmt, work, nvme_root, model_dir, data, port, fp32_entry)
                if fmt == "fp32":
                    fp32_entry = entry
                results.append(entry)
                print_row(entry, args, header=len(results) == 1, formats=formats)
                sys.stdout.flush()

    if any(r.get("ds_param_cpu") for r in results):
        print("* DeepSpeed ran this row from its own config file, with offload_param cpu (--ds-param-cpu)")
    if formats != ["fp32"]:
        print("state: strata's Adam m and v (its config file adds \"strata\": {\"optimizer_state_dtype\": ...}); "
              "vs fp32 N / max: relative difference of strata's loss from its fp32 row at the last step / over "
              "all steps; NVMe MiB/step: strata's nvme_read_bytes / nvme_written_bytes per step (median)")
    info = next((r["deepspeed"].get("info") for r in results if r["deepspeed"].get("info")), {})
    print(f"DeepSpeed {info.get('deepspeed', '?')} on {info.get('accelerator', '?')}, optimizer "
          f"{info.get('optimizer', '?')}, torch threads {info.get('threads', '?')}; strata {args.strata}; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    kernels = sorted({r["strata"]["cpu_kernels"] for r in results if r["strata"].get("cpu_kernels")})
    for line in kernels:
        print(f"strata CPU kernels: {line}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_info, "args": {k: v for k, v in vars(args).items()
                                                      if not k.startswith("worker")}, "deepspeed": info,
                       "rows": results}, f, indent=2)
    failed = [r for r in results if "ratio" not in r]
    return 1 if failed else 0


def run_row(args, row, accum, fmt, work, nvme_root, model_dir, data, port, fp32_entry):
    """One row: strata with optimizer state format fmt, DeepSpeed beside it."""
    entry = {"row": row, "accum": accum, "format": fmt, "notes": []}
    tag = f"{row}-g{accum}" + ("" if fmt == "fp32" else f"-{fmt}")
    # One swap directory and, unless --ds-param-cpu or the state format changes a side, one
    # config file that both engines read.
    swap = os.path.join(nvme_root, tag)
    os.makedirs(swap, exist_ok=True)

    def write_configs(ds_key):
        configs = {side: ds_config(args, row, accum, side, swap, fmt, ds_key) for side in ("strata", "deepspeed")}
        same = configs["strata"] == configs["deepspeed"]
        paths = {}
        for side in ("strata", "deepspeed"):
            paths[side] = os.path.join(work, f"ds-{tag}" + ("" if same else f"-{side}-{ds_key}") + ".json")
            with open(paths[side], "w") as f:
                json.dump(configs[side], f, indent=2)
        return {side: (paths[side], configs[side]) for side in configs}, same

    configs, same = write_configs("offload_optimizer")
    entry["same_config_file"] = same
    entry["ds_param_cpu"] = configs["deepspeed"][1]["zero_optimization"]["offload_param"]["device"] != \
        ROWS[row][0]
    entry["deepspeed_offload_param"] = configs["deepspeed"][1]["zero_optimization"]["offload_param"]["device"]
    entry["schedule"] = strata_schedule(args, configs["strata"][0], model_dir, data)
    strata, strata_wall = run_strata(args, configs["strata"][0], model_dir, data,
                                     os.path.join(work, f"strata-{tag}.jsonl"))
    if fmt == "int8" and fp32_entry is not None and "error" not in fp32_entry["deepspeed"]:
        # DeepSpeed has no int8 optimizer state: its side of the row is its fp32 run.
        deepspeed, ds_wall = fp32_entry["deepspeed"], fp32_entry["deepspeed_wall_s"]
        entry["notes"].append("DeepSpeed has no int8 optimizer state: its column is its fp32 run of this placement")
    else:
        deepspeed, ds_wall = run_deepspeed(args, configs["deepspeed"][0], model_dir, data,
                                           os.path.join(work, f"ds-{tag}.jsonl"), port)
        if fmt == "int8":
            entry["notes"].append("DeepSpeed has no int8 optimizer state: its column ran its fp32 config")
        if fmt == "bf16" and "error" in deepspeed:
            # DeepSpeed 0.19.8's offload_optimizer block forbids keys it does not know; it
            # reads fp32_optimizer_states from the optimizer's params. Run that instead.
            entry["notes"].append("DeepSpeed refused \"fp32_optimizer_states\": false in "
                                  f"zero_optimization.offload_optimizer: {deepspeed['error']}")
            entry["deepspeed_refused"] = deepspeed["error"]
            configs, _ = write_configs("optimizer")
            deepspeed, ds_wall = run_deepspeed(args, configs["deepspeed"][0], model_dir, data,
                                               os.path.join(work, f"ds-{tag}-optimizer.jsonl"), port + 1)
            entry["notes"].append("DeepSpeed's column: \"fp32_optimizer_states\": false in optimizer.params "
                                  "instead (where DeepSpeed 0.19.8 reads it)")
        if fmt == "bf16" and "info" in deepspeed and deepspeed["info"].get("state_dtypes"):
            info = deepspeed["info"]
            same_losses = ""
            if fp32_entry is not None and "losses" in fp32_entry["deepspeed"] and "losses" in deepspeed:
                diff = max(abs(a - b) / abs(b) for a, b in zip(deepspeed["losses"], fp32_entry["deepspeed"]["losses"]))
                entry["deepspeed_max_rel_loss_vs_fp32"] = diff
                same_losses = f"; its losses vs its fp32 row: max rel diff {diff:.1e}"
            entry["notes"].append(f"DeepSpeedCPUAdam took fp32_optimizer_states={info.get('fp32_optimizer_states')} "
                                  f"and kept Adam's moments in {'/'.join(info['state_dtypes'])} (it keeps them in "
                                  f"the dtype of the fp32 master partition){same_losses}")
    entry.update({"strata": strata, "deepspeed": deepspeed, "strata_wall_s": strata_wall,
                  "deepspeed_wall_s": ds_wall})
    if "losses" in strata:
        entry["strata_step_s"] = median_after(strata["times"], args.warmup)
        entry["nvme_read_per_step"] = median_after(strata["nvme_read_bytes"], args.warmup)
        entry["nvme_written_per_step"] = median_after(strata["nvme_written_bytes"], args.warmup)
        if fp32_entry is not None and "losses" in fp32_entry["strata"]:
            base = fp32_entry["strata"]["losses"]
            diffs = [abs(a - b) / abs(b) for a, b in zip(strata["losses"], base)]
            entry["rel_loss_vs_fp32_last"] = diffs[-1]
            entry["max_rel_loss_vs_fp32"] = max(diffs)
    if "losses" in deepspeed:
        entry["deepspeed_step_s"] = median_after(deepspeed["times"], args.warmup)
    if "losses" in strata and "losses" in deepspeed:
        entry["ratio"] = entry["strata_step_s"] / entry["deepspeed_step_s"]
        entry["max_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in
                                         zip(strata["losses"], deepspeed["losses"]))
        norms = [(a, b) for a, b in zip(strata["grad_norms"], deepspeed["grad_norms"])
                 if a is not None and b is not None]
        if norms:
            entry["max_rel_grad_norm_diff"] = max(abs(a - b) / abs(b) for a, b in norms)
    return entry


def print_row(entry, args, header, formats=("fp32",)):
    compact = list(formats) != ["fp32"]
    if header:
        print(f"{'placement':<22} {'G':>2} {'schedule':<11} " + (f"{'state':<5} " if compact else "") +
              f"{'strata s':>9} {'DS s':>8} {'ratio':>6} "
              f"{'strata loss 1 -> N':>19} {'DS loss 1 -> N':>17} {'max rel diff':>12}" +
              (f" {'vs fp32 N':>9} {'max':>8} {'NVMe MiB/step r/w':>17}" if compact else ""))
    s, d = entry["strata"], entry["deepspeed"]
    title = ROW_TITLES[entry["row"]] + (" *" if entry.get("ds_param_cpu") else "")
    fmt_loss = lambda side: f"{side['losses'][0]:.4f} -> {side['losses'][-1]:.4f}" if "losses" in side else "-"
    nan = float("nan")
    line = (f"{title:<22} {entry['accum']:>2} {entry['schedule']:<11} " +
            (f"{entry['format']:<5} " if compact else "") +
            f"{entry.get('strata_step_s', nan):>9.3f} {entry.get('deepspeed_step_s', nan):>8.3f} "
            f"{entry.get('ratio', nan):>6.2f} {fmt_loss(s):>19} {fmt_loss(d):>17} "
            f"{entry.get('max_rel_loss_diff', nan):>12.1e}")
    if compact:
        mib = lambda key: f"{entry[key] / 2**20:.1f}" if key in entry else "-"
        e = lambda key, width: f"{entry[key]:>{width}.1e}" if key in entry else f"{'-':>{width}}"
        line += (f" {e('rel_loss_vs_fp32_last', 9)} {e('max_rel_loss_vs_fp32', 8)}"
                 f" {mib('nvme_read_per_step') + ' / ' + mib('nvme_written_per_step'):>17}")
    print(line)
    for name, side in (("strata", s), ("DeepSpeed", d)):
        if "error" in side:
            print(f"    {name} could not run this row: {side['error']}")
    for note in entry.get("notes", []):
        print(f"    {note}")


if __name__ == "__main__":
    sys.exit(main())
