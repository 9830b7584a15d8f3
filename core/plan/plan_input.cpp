#include "core/plan/plan_input.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>

#include "io/base/sizes.h"

namespace strata {

int64_t streamed_chunk_elements(int64_t sub_group_size) {
  return std::max<int64_t>(1024, std::min(kOptimizerChunkElements, sub_group_size) / 1024 * 1024);
}

int64_t effective_seq_len(const TrainConfig& config, const ModelConfig& model) {
  if (config.strata.seq_len) return *config.strata.seq_len;
  return model.max_position_embeddings > 0 ? std::min<int64_t>(2048, model.max_position_embeddings)
                                           : 2048;
}

namespace {

std::optional<tiers::Tier> activation_tier(ActivationHome home) {
  switch (home) {
    case ActivationHome::automatic:
      return std::nullopt;
    case ActivationHome::device:
      return tiers::Tier::device;
    case ActivationHome::host:
      return tiers::Tier::host;
    case ActivationHome::nvme:
      return tiers::Tier::nvme;
  }
  return std::nullopt;
}

}  // namespace

PlanInput plan_input_from_config(const TrainConfig& c, const ModelConfig& model,
                                 PlanTarget target) {
  PlanInput in;
  in.model = model;
  in.world_size = c.world_size;
  in.stage = c.zero.stage;
  in.offload_param = c.zero.offload_param.device;
  in.offload_optimizer = c.zero.offload_optimizer.device;
  in.precision = c.precision;
  in.micro_batch = c.train_micro_batch_size_per_gpu;
  in.seq_len = effective_seq_len(c, model);
  in.model.vocab_chunks = std::max<int64_t>(1, c.strata.vocab_chunks);
  in.vocab_chunks_auto = c.strata.vocab_chunks == 0;
  in.model.layer_pieces = std::max<int64_t>(1, c.strata.layer_pieces);
  in.layer_pieces_auto = c.strata.layer_pieces == 0;
  in.model.expert_groups = std::max<int64_t>(1, c.strata.expert_groups);
  in.expert_groups_auto = c.strata.expert_groups == 0 && model.is_moe();
  if (in.model.expert_groups > 1 && in.layer_pieces_auto && model.is_moe()) {
    // The groups cut a sparse layer's MLP piece: the layers are in pieces.
    in.model.layer_pieces = 2;
    in.layer_pieces_auto = false;
    in.layer_pieces_reason = "2 (strata.expert_groups cuts each sparse layer's MLP piece)";
  }
  in.model.mlp_parts = std::max<int64_t>(1, c.strata.mlp_parts);
  in.mlp_parts_auto =
      c.strata.mlp_parts == 0 && model.sparse_layer_count() < model.num_hidden_layers;
  if (in.model.mlp_parts > 1 && in.layer_pieces_auto) {
    // The parts cut a dense layer's MLP piece: the layers are in pieces.
    in.model.layer_pieces = 2;
    in.layer_pieces_auto = false;
    in.layer_pieces_reason = "2 (strata.mlp_parts cuts each dense layer's MLP piece)";
  }
  in.expert_fetch_all = c.strata.expert_fetch_all;
  in.expert_update_deferred = c.strata.expert_update_deferred;
  in.grad_accum = c.gradient_accumulation_steps;
  in.overlap_comm = c.zero.overlap_comm;
  in.reduce_scatter = c.zero.reduce_scatter;
  in.reduce_in_bf16 = c.strata.gradient_reduce_dtype == Precision::bf16;
  in.optimizer_state = c.strata.optimizer_state_dtype;
  in.gradient_home = c.strata.gradient_home;
  // Optimizer::needs_grad_norm() is false exactly then (optimizer_options_from_config).
  in.optimizer_during_backward = c.gradient_clipping == 0.0 && c.precision == Precision::fp32;
  in.gpu = target.gpu;
  in.nccl_staging = target.nccl_staging;
  in.schedule = c.strata.schedule;
  in.activation_home = activation_tier(c.strata.activation_home);
  // DeepSpeed's activation_checkpointing.cpu_checkpointing keeps the
  // checkpoints (strata's saved inputs) in host memory; strata.activation_home
  // decides when it is not auto.
  if (!in.activation_home && c.activation_checkpointing.cpu_checkpointing)
    in.activation_home = tiers::Tier::host;
  in.fetch_slots = c.zero.offload_param.buffer_count;
  in.optimizer_buffers = c.zero.offload_optimizer.buffer_count;
  in.optimizer_chunk_elements = streamed_chunk_elements(c.zero.sub_group_size);
  in.nvme_path_known = !c.effective_nvme_paths().empty();
  in.budgets.ranks_per_node = target.ranks_per_node;
  if (c.strata.device_mem_limit) {
    in.budgets.device_per_rank = int64_t(*c.strata.device_mem_limit);
    in.budgets.device_source = "given";
  }
  if (c.strata.host_mem_limit) {
    in.budgets.host_per_node = int64_t(*c.strata.host_mem_limit);
    in.budgets.host_source = "given";
  }
  return in;
}

ModelConfig model_of_size(int64_t parameters) {
  ModelConfig m;
  m.family = ModelFamily::llama;
  m.vocab_size = 32000;
  m.max_position_embeddings = 4096;
  m.rope_theta = 10000.0;
  // Widths in steps of 128; the depth that brings the count nearest the
  // target; of those, the one nearest 128 features per layer (Llama's shapes).
  auto shaped = [&](int64_t hidden, int64_t vocab) {
    ModelConfig s = m;
    s.vocab_size = vocab;
    s.hidden_size = hidden;
    s.intermediate_size = std::max<int64_t>(128, (hidden * 8 / 3 + 255) / 256 * 256);
    s.num_attention_heads = std::max<int64_t>(1, hidden / 128);
    s.num_key_value_heads = s.num_attention_heads;
    s.head_dim = hidden / s.num_attention_heads;
    s.num_hidden_layers = 1;
    const int64_t outer = s.parameter_count() - s.layer_parameter_count();
    const int64_t layer = s.layer_parameter_count();
    s.num_hidden_layers =
        std::max<int64_t>(1, std::llround(double(parameters - outer) / double(layer)));
    return s;
  };
  std::optional<ModelConfig> best;
  double best_score = 0;
  for (int64_t vocab : {int64_t{32000}, int64_t{256}}) {
    for (int64_t hidden = 128; hidden <= 65536; hidden += 128) {
      ModelConfig s = shaped(hidden, vocab);
      const double miss = std::abs(double(s.parameter_count() - parameters)) / double(parameters);
      const double aspect =
          std::abs(std::log(double(s.num_hidden_layers) * 128.0 / double(hidden)));
      // Within 3% of the count, the most Llama-like aspect; else the nearest count.
      const double score = miss <= 0.03 ? aspect : 100.0 + miss;
      if (!best || score < best_score) {
        best = s;
        best_score = score;
      }
    }
    if (best_score < 100.0) break;  // the 32000-token vocabulary fits the count
  }
  best->name = fmt::format("llama-shaped (hidden {}, {} layers, vocab {})", best->hidden_size,
                           best->num_hidden_layers, best->vocab_size);
  return *best;
}

Status validate_plan_input(const PlanInput& in) {
  if (in.world_size < 1)
    return Status::invalid_argument(
        fmt::format("world size must be at least 1 (--world-size), got {}", in.world_size));
  const int node_ranks = in.budgets.node_ranks(in.world_size);
  if (node_ranks < 1 || in.world_size % node_ranks != 0)
    return Status::invalid_argument(fmt::format(
        "world size {} is not a whole number of nodes of {} ranks each; make the world size a "
        "multiple of the ranks per node (--gpus-per-node, or the launcher's LOCAL_WORLD_SIZE)",
        in.world_size, node_ranks));
  if (in.stage < 0 || in.stage > 3)
    return Status::invalid_argument(fmt::format(
        "ZeRO stage must be 0, 1, 2 or 3 (--stage, zero_optimization.stage), got {}", in.stage));
  if (in.offload_param != OffloadDevice::none && in.stage < 3)
    return Status::invalid_argument(fmt::format(
        "zero_optimization.offload_param.device {} needs ZeRO stage 3 (stage is {}); pass "
        "--stage 3 or --offload-param none",
        offload_device_name(in.offload_param), in.stage));
  if (in.micro_batch < 1 || in.seq_len < 1 || in.grad_accum < 1)
    return Status::invalid_argument(fmt::format(
        "micro batch ({}), sequence length ({}) and gradient accumulation ({}) must each be at "
        "least 1",
        in.micro_batch, in.seq_len, in.grad_accum));
  if (Status s = check_mixture(in.model); !s) return s;
  if (Status s = check_vocab_chunks(in.model); !s) return s;
  if (Status s = check_layer_pieces(in.model); !s) return s;
  if (Status s = check_expert_groups(in.model); !s) return s;
  if (Status s = check_mlp_parts(in.model); !s) return s;
  if (in.fetch_slots < 1)
    return Status::invalid_argument(fmt::format(
        "zero_optimization.offload_param.buffer_count must be at least 1, got {}", in.fetch_slots));
  if (in.optimizer_buffers < 2)
    return Status::invalid_argument(
        fmt::format("zero_optimization.offload_optimizer.buffer_count must be at least 2, got {}",
                    in.optimizer_buffers));
  if (in.optimizer_chunk_elements <= 0 || in.optimizer_chunk_elements % 1024 != 0)
    return Status::invalid_argument(
        fmt::format("optimizer chunk of {} elements: it must be a positive multiple of 1024; check "
                    "zero_optimization.sub_group_size",
                    in.optimizer_chunk_elements));
  if (in.offload_optimizer == OffloadDevice::none && in.gradient_home != GradientHome::automatic)
    return Status::invalid_argument(fmt::format(
        "strata.gradient_home {}: with the optimizer on the device the gradients stay there; "
        "offload the optimizer (--offload-optimizer cpu or nvme) or leave it auto",
        gradient_home_name(in.gradient_home)));
  if (in.gradient_home == GradientHome::nvme && in.offload_optimizer != OffloadDevice::nvme)
    return Status::invalid_argument(
        "strata.gradient_home nvme: the streamed optimizer reads gradients from NVMe with its "
        "state, so it needs --offload-optimizer nvme; use host or host_bf16 otherwise");
  return Status::ok();
}

}  // namespace strata
