#include "tools/train_flags.h"

namespace strata::tools {
namespace {

// The sections of `strata train --help`, in the order they are listed.
constexpr const char* kDataGroup = "Model and data";
constexpr const char* kBatchGroup = "Batch, precision and optimizer";
constexpr const char* kZeroGroup = "ZeRO and offload";
constexpr const char* kIoGroup = "NVMe I/O";
constexpr const char* kMemoryGroup = "Memory budgets";
constexpr const char* kOutputGroup = "Output";
constexpr const char* kCheckpointGroup = "Checkpoints";

void add_model_and_data_options(CLI::App& cmd, TrainFlags& flags) {
  cmd.add_option("--model", flags.model,
                 "Preset (tiny, small, llama3.2-1b, ...), config.json or Hugging Face directory")
      ->group(kDataGroup);
  cmd.add_option("--data", flags.data_path,
                 "Token file to train on: nanoGPT .bin (uint16), llm.c shard, or uint32 (see "
                 "--data-format); "
                 "`strata demo-data` writes one")
      ->group(kDataGroup);
  cmd.add_option("--data-format", flags.data_format,
                 "auto | nanogpt | llmc | uint32 (default auto)")
      ->check(CLI::IsMember({"auto", "nanogpt", "llmc", "uint32"}))
      ->group(kDataGroup);
  cmd.add_option(
         "--loss-mask", flags.loss_mask_path,
         "One byte per token of --data; 0: that token is not a target (prompts in fine-tuning). "
         "Default: the .mask file next to --data when there is one (train.bin -> train.mask); "
         "none: no mask")
      ->group(kDataGroup);
  cmd.add_option("--eval-data", flags.eval_path,
                 "Token file for a validation loss (same format as --data)")
      ->group(kDataGroup);
  cmd.add_option("--eval-every", flags.eval_every,
                 "Validation every N steps, and after the last (default: only after the last)")
      ->group(kDataGroup);
  cmd.add_option("--eval-batches", flags.eval_batches,
                 "Micro-batches of the eval file per validation (default 8)")
      ->group(kDataGroup);
  cmd.add_option("--init", flags.init_path,
                 "Start from these weights: .safetensors file or Hugging Face directory "
                 "(default: random from --seed)")
      ->group(kDataGroup);
  cmd.add_option("--seed", flags.seed, "Seed of the random initialisation (default 1234)")
      ->group(kDataGroup);
  // --no-shuffle counts -1: it undoes a config file's strata.shuffle.
  cmd.add_flag_function(
         "--shuffle,!--no-shuffle",
         [&flags](int64_t count) { flags.config.overrides.shuffle = count > 0; },
         "Read the sequences in a new seeded order every pass over the data (strata.shuffle; "
         "default: the file's order)")
      ->group(kDataGroup);
  cmd.add_option("--shuffle-seed", flags.config.overrides.shuffle_seed,
                 "Seed of the --shuffle order (strata.shuffle_seed; default: --seed)")
      ->group(kDataGroup);
  cmd.add_option("--backend", flags.backend,
                 "cpu | cuda | auto (default auto: cuda when a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->group(kDataGroup);
  cmd.add_option("--gemm", flags.gemm,
                 "CPU backend's matrix products: auto (default: the best class the CPU's "
                 "features allow) | avx512 | avx2 | avx | baseline | reference (the same bits "
                 "on every x86-64, slower); also STRATA_GEMM")
      ->check(CLI::IsMember({"auto", "avx512", "avx2", "avx", "baseline", "reference"}))
      ->group(kDataGroup);
}

void add_steps_and_shared_flags(CLI::App& cmd, TrainFlags& flags) {
  cmd.add_option("--steps", flags.steps,
                 "Optimizer steps to run (default 100; scheduler.params.total_num_steps "
                 "when the config leaves it 0); 0 with --init and --export converts")
      ->group(kBatchGroup);

  flags.config.add_to(cmd, /*with_plan_names=*/false);
  // The shared flags, grouped, each with its default and the DeepSpeed key it overrides.
  struct Placement {
    const char* name;
    const char* group;
    const char* description;
  };
  const Placement placements[] = {
      {"--config", kDataGroup,
       "DeepSpeed JSON config; a \"strata\" block holds strata's own keys (default: none)"},
      {"--micro-batch", kBatchGroup,
       "Sequences per micro-batch per rank (train_micro_batch_size_per_gpu; default 1)"},
      {"--grad-accum", kBatchGroup,
       "Micro-batches per step (gradient_accumulation_steps; default: derived, else 1)"},
      {"--global-batch", kBatchGroup,
       "Sequences per step over all ranks (train_batch_size; default: derived)"},
      {"--world-size", kBatchGroup,
       "Ranks, as threads of this process (sharing one GPU on the CUDA backend; "
       "strata.world_size; default 1)"},
      {"--seq-len", kBatchGroup,
       "Tokens per sequence (strata.seq_len; default min(2048, model maximum))"},
      {"--precision", kBatchGroup,
       "fp32 | bf16 | fp16 (bf16.enabled / fp16.enabled; default fp32)"},
      {"--lr", kBatchGroup,
       "Learning rate (optimizer.params.lr and scheduler.params.warmup_max_lr; default 1e-3)"},
      {"--lr-schedule", kBatchGroup,
       "constant | warmup | linear | cosine: DeepSpeed's WarmupLR, WarmupDecayLR or "
       "WarmupCosineLR, peaking at --lr, decaying over --steps (scheduler.type; default "
       "constant)"},
      {"--warmup-steps", kBatchGroup,
       "Warm-up steps, >= 1; it lasts max(2, N) (scheduler.params.warmup_num_steps; default "
       "1000)"},
      {"--warmup-type", kBatchGroup,
       "log | linear rise of the warm-up (scheduler.params.warmup_type; default log)"},
      {"--min-lr-ratio", kBatchGroup,
       "Where linear or cosine decay ends, as a fraction of --lr in [0, 1]; linear also warms "
       "up from it (cos_min_ratio, or warmup_min_lr / warmup_max_lr; default 1e-4 cosine, 0 "
       "linear)"},
      {"--zero-stage", kZeroGroup, "ZeRO stage 0-3 (zero_optimization.stage; default 0)"},
      {"--offload-param", kZeroGroup,
       "Home of the parameters: none | cpu | nvme, stage 3 only "
       "(zero_optimization.offload_param.device; default none)"},
      {"--offload-optimizer", kZeroGroup,
       "Home of fp32 master, Adam m and v: none | cpu | nvme "
       "(zero_optimization.offload_optimizer.device; default none)"},
      {"--nvme-path", kZeroGroup,
       "Swap directory, created if missing; repeat to stripe (strata.nvme_paths, "
       "offload_*.nvme_path; default ./strata-swap when something is on NVMe)"},
      {"--optimizer-state-dtype", kZeroGroup,
       "Adam m and v: fp32 (exact) | bf16 | int8 (strata.optimizer_state_dtype; default fp32)"},
      {"--gradient-home", kZeroGroup,
       "Gradient accumulator with the optimizer offloaded: auto | host | host_bf16 | nvme "
       "(strata.gradient_home; default auto: host fp32 if it fits, else NVMe fp32)"},
      {"--schedule", kZeroGroup,
       "Order of a step with --grad-accum: auto | micro_batch | layer (strata.schedule; "
       "default auto: the one moving fewer bytes over the slowest link)"},
      {"--activation-home", kZeroGroup,
       "Where the saved inputs wait for their backward: auto | device | host | nvme "
       "(strata.activation_home; default auto: the first that fits)"},
      {"--vocab-chunks", kZeroGroup,
       "Units the embedding and the head are cut into along the vocabulary, each fetched on its "
       "own, so neither sets the working set: auto | an integer >= 1 (strata.vocab_chunks; "
       "default auto: whole unless cutting them is what makes the plan fit the budgets; "
       "untied lm_head)"},
      {"--layer-pieces", kZeroGroup,
       "Units each decoder layer is cut into: auto | 1 (whole) | 2 (its attention and its MLP, "
       "each fetched on its own, so a layer's MLP alone sets the working set) "
       "(strata.layer_pieces; default auto: whole unless cutting them is what makes the plan fit "
       "the budgets)"},
      {"--expert-groups", kZeroGroup,
       "Mixtures of experts with --layer-pieces 2: the pieces a sparse layer's MLP is cut "
       "into: auto | 1 (one piece) | G > 1 (its router and G groups of experts, each fetched on "
       "its own, so a group of experts sets the working set, not the whole layer's) "
       "(strata.expert_groups; default auto: one piece unless groups are what makes the plan "
       "fit the budgets, then the fewest that do)"},
      {"--mlp-parts", kZeroGroup,
       "Dense layers with --layer-pieces 2: the parts a layer's MLP is cut into along its "
       "intermediate dimension: auto | 1 (one piece) | P > 1 (P parts of gate_proj and up_proj "
       "rows and down_proj columns, each fetched on its own, so a part sets the working set; "
       "the layer's output and input gradient then sum in parts, within the bound the README "
       "states) (strata.mlp_parts; default auto: one piece unless parts are what makes the "
       "plan fit the budgets, then the fewest that do)"},
      {"--expert-fetch", kZeroGroup,
       "Mixtures of experts: routed (a sparse layer's experts are read from NVMe only when "
       "the micro-batches' tokens are routed to them) | all (every expert with its unit) "
       "(strata.expert_fetch; default routed: where the plan can, one rank at stage 3 with "
       "the parameters on NVMe and --layer-pieces 2)"},
      {"--expert-update", kZeroGroup,
       "Mixtures of experts: eager (every expert takes its AdamW step every step) | deferred "
       "(an expert no token reached is stepped only when its parameters are next read, "
       "checkpointed or exported, its missed steps replayed exactly: fewer NVMe bytes when "
       "routing is sparse; int8 moments: an expert's whole 256-element blocks) "
       "(strata.expert_update; default eager; needs routed expert reads)"},
      {"--aio-block-size", kIoGroup,
       "Bytes per NVMe request, e.g. 1M (aio.block_size; default 1M)"},
      {"--aio-queue-depth", kIoGroup,
       "Requests in flight per I/O thread (aio.queue_depth; default 8)"},
      {"--aio-threads", kIoGroup, "I/O threads per path (aio.intra_op_parallelism; default 1)"},
      {"--device-mem-limit", kMemoryGroup,
       "Device memory per rank, e.g. 24G; host memory stands in on the CPU backend "
       "(strata.device_mem_limit; default: the plan's peak + 25% + 64M)"},
      {"--host-mem-limit", kMemoryGroup,
       "Pinned host memory for the node, e.g. 64G (strata.host_mem_limit; default: the plan's "
       "peak + 25% + 64M per rank)"},
  };
  for (const Placement& p : placements) {
    CLI::Option* option = cmd.get_option_no_throw(p.name);
    if (option == nullptr) continue;
    option->group(p.group);
    option->description(p.description);
  }
}

void add_output_and_checkpoint_options(CLI::App& cmd, TrainFlags& flags) {
  cmd.add_option("--metrics", flags.metrics_path,
                 "Write one JSON object per step to this .jsonl file")
      ->group(kOutputGroup);
  cmd.add_option("--hardware", flags.hardware,
                 "The step-time model's profile, to predict each step beside its measurement: "
                 "auto (this machine's cached probe: on the CPU backend made on first use, on "
                 "the CUDA backend the one strata plan --probe --backend cuda made), none, "
                 "a preset (h100-sxm/gen5x2, ...) or a profile file")
      ->default_str("auto");
  cmd.add_option("--trace", flags.trace_path,
                 "Write a Chrome/Perfetto trace of every plan operation on its lane (open in "
                 "ui.perfetto.dev)")
      ->group(kOutputGroup);
  cmd.add_option("--tensorboard", flags.config.overrides.tensorboard_dir,
                 "Write TensorBoard event files into this directory, created if missing: each "
                 "step's loss, eval loss, lr, gradient norm, loss scale (fp16), tokens/s, step "
                 "time and NVMe GB/s (the config's tensorboard block; default: none)")
      ->group(kOutputGroup);
  cmd.add_option(
         "--export", flags.export_path,
         "Write the final weights with Hugging Face names: FILE.safetensors, or a directory "
         "(config.json + model.safetensors)")
      ->group(kOutputGroup);
  cmd.add_option("--export-dtype", flags.export_dtype, "fp32 | bf16 | fp16 (default fp32)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->group(kOutputGroup);
  cmd.add_option("--save", flags.save_dir,
                 "Write checkpoints into this directory (step-N, atomically; also at the end and "
                 "on Ctrl-C / SIGTERM)")
      ->group(kCheckpointGroup);
  cmd.add_option("--save-every", flags.save_every,
                 "Save every N steps (default 0: only at the end)")
      ->group(kCheckpointGroup);
  cmd.add_option("--keep", flags.keep, "Keep the newest N checkpoints (default 0: all)")
      ->group(kCheckpointGroup);
  cmd.add_option("--resume", flags.resume,
                 "Resume from a checkpoint directory, or the newest one under a --save directory; "
                 "--steps is then the step to reach. World size, stage and offload may differ")
      ->group(kCheckpointGroup);
  cmd.add_flag("--print-config", flags.print_config,
               "Print the merged effective configuration as JSON and exit")
      ->group(kOutputGroup);
  cmd.add_flag("--print-plan", flags.print_plan,
               "Print the training plan (operations, lanes, buffers per tier) and exit")
      ->group(kOutputGroup);
}

}  // namespace

void add_train_flags(CLI::App& cmd, TrainFlags& flags) {
  add_model_and_data_options(cmd, flags);
  add_steps_and_shared_flags(cmd, flags);
  add_output_and_checkpoint_options(cmd, flags);
}

}  // namespace strata::tools
