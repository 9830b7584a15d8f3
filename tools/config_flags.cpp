#include "tools/config_flags.h"

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace strata::tools {

void ConfigFlags::add_to(CLI::App& app, bool with_plan_names) {
  ConfigOverrides& o = overrides;
  app.add_option("--config", config_path, "DeepSpeed JSON config (a \"strata\" block holds strata's own keys)");
  app.add_option(with_plan_names ? "--stage,--zero-stage" : "--zero-stage,--stage", o.zero_stage,
                 "ZeRO stage 0-3 (zero_optimization.stage)");
  app.add_option("--offload-param", o.offload_param, "Home of the parameters: none | cpu | nvme (stage 3)");
  app.add_option("--offload-optimizer", o.offload_optimizer, "Home of master/m/v: none | cpu | nvme");
  app.add_option("--optimizer-state-dtype", o.optimizer_state_dtype,
                 "Adam m and v: fp32 (exact) | bf16 | int8 (strata.optimizer_state_dtype)");
  app.add_option("--gradient-home", o.gradient_home,
                 "Gradient accumulator with the optimizer offloaded: auto | host | host_bf16 | nvme "
                 "(strata.gradient_home)");
  app.add_option("--nvme-path", o.nvme_paths, "NVMe directory for swap files; repeat to stripe over several");
  app.add_option("--micro-batch", o.micro_batch, "train_micro_batch_size_per_gpu");
  app.add_option("--grad-accum", o.grad_accum, "gradient_accumulation_steps");
  app.add_option("--global-batch", o.global_batch, "train_batch_size");
  app.add_option("--world-size", o.world_size, "Number of ranks (default 1)");
  app.add_option("--precision", o.precision, "fp32 | bf16 | fp16 (sets bf16.enabled / fp16.enabled)");
  app.add_option("--lr", o.lr, "Learning rate (optimizer.params.lr and the warmup peak)");
  // The learning-rate schedule: DeepSpeed's schedulers by a plain name, and their params.
  app.add_option("--lr-schedule", o.lr_schedule,
                 "constant | warmup | linear | cosine (scheduler.type: none, WarmupLR, "
                 "WarmupDecayLR, WarmupCosineLR), over --steps");
  app.add_option("--warmup-steps", o.warmup_steps,
                 "Steps of the warm-up, >= 1 (scheduler.params.warmup_num_steps)");
  app.add_option("--warmup-type", o.warmup_type,
                 "Shape of the warm-up: log | linear (scheduler.params.warmup_type)");
  app.add_option("--min-lr-ratio", o.min_lr_ratio,
                 "Where the decay ends, a fraction of the peak lr in [0, 1] (cosine: "
                 "scheduler.params.cos_min_ratio; linear: warmup_min_lr = ratio x warmup_max_lr)");
  app.add_option("--seq-len", o.seq_len, "Tokens per sequence");
  app.add_option("--aio-block-size", o.aio_block_size, "aio.block_size, a size such as 1M");
  app.add_option("--aio-queue-depth", o.aio_queue_depth, "aio.queue_depth");
  app.add_option("--aio-threads", o.aio_threads, "aio.intra_op_parallelism (I/O threads)");
  app.add_option("--device-mem-limit", o.device_mem_limit, "Device memory budget per rank, e.g. 80G");
  app.add_option("--host-mem-limit", o.host_mem_limit, "Pinned host memory budget for the node, e.g. 512G");
  app.add_option("--schedule", o.schedule,
                 "Order of a step with --grad-accum: auto | micro_batch | layer (strata.schedule)");
  app.add_option("--activation-home", o.activation_home,
                 "Where the saved inputs wait for their backward: auto | device | host | "
                 "nvme (strata.activation_home)");
  app.add_option("--vocab-chunks", o.vocab_chunks,
                 "Units the embedding and the head are cut into along the vocabulary, each "
                 "fetched on its own: auto | an integer >= 1 (strata.vocab_chunks; default auto: "
                 "whole unless cutting them is what makes the plan fit)");
  app.add_option("--layer-pieces", o.layer_pieces,
                 "Units each decoder layer is cut into: auto | 1 (whole) | 2 (its attention and "
                 "its MLP, each fetched on its own) (strata.layer_pieces; default auto: whole "
                 "unless cutting them is what makes the plan fit)");
  app.add_option("--expert-groups", o.expert_groups,
                 "Mixtures of experts in layer pieces: the pieces a sparse layer's MLP is cut "
                 "into: auto | 1 (one piece) | G > 1 (its router and G groups of experts, each "
                 "fetched on its own) (strata.expert_groups; default auto: one piece unless "
                 "groups are what makes the plan fit; CPU backend)");
  app.add_option("--mlp-parts", o.mlp_parts,
                 "Layers in pieces: the parts a dense layer's MLP is cut into along its "
                 "intermediate dimension: auto | 1 (one piece) | P > 1 (P parts, each fetched on "
                 "its own) (strata.mlp_parts; default auto: one piece unless parts are what "
                 "makes the plan fit; CPU backend)");
  app.add_option("--expert-fetch", o.expert_fetch,
                 "Mixtures of experts: routed (read a sparse layer's experts from NVMe only "
                 "when tokens are routed to them) | all (strata.expert_fetch; default routed)");
  app.add_option("--expert-update", o.expert_update,
                 "Mixtures of experts: eager (every expert's AdamW step every step) | deferred "
                 "(an expert no token reached is stepped when next read, the same operations "
                 "replayed) (strata.expert_update; default eager)");
}

void print_config_warnings(const TrainConfig& config) {
  for (const std::string& warning : config.warnings) fmt::print(stderr, "warning: {}\n", warning);
}

}  // namespace strata::tools
