// Shared by the engine_* tests: a small grouped-query model, token data drawn
// from a fresh seed, and one call that trains it with a given stage, offload,
// world size and precision and returns the losses, the weights and what the
// tiers recorded.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/data/token_data.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "tiers_test_support.h"

namespace strata::testing {

inline ModelConfig small_gqa_model(bool tied = false) {
  ModelConfig c;
  c.vocab_size = 96;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 256;
  c.rope_theta = 10000.0;
  c.tie_word_embeddings = tied;
  return c;
}

// small_gqa_model's shape as a mixture of experts: 5 experts of 40, top 2
// renormalised (mixtral), the load-balancing loss in the loss.
inline ModelConfig small_moe_model() {
  ModelConfig c = small_gqa_model();
  c.family = ModelFamily::mixtral;
  c.intermediate_size = 40;
  c.moe_intermediate_size = 40;
  c.num_experts = 5;
  c.num_experts_per_tok = 2;
  c.norm_topk_prob = true;
  c.output_router_logits = true;
  c.router_aux_loss_coef = 0.02;
  return c;
}

inline std::vector<int32_t> random_tokens(int64_t count, int64_t vocab, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  for (auto& t : tokens) t = int32_t(random() % uint64_t(vocab));
  return tokens;
}

// core/data/token_data.h's reading over an in-memory token array, in `order`
// (core/data/sequence_order.h; default sequential).
inline BatchReader memory_reader(std::shared_ptr<const std::vector<int32_t>> tokens,
                                 SequenceOrder order = {}) {
  return [tokens, order](int64_t offset, int64_t micro, int rank, int world, int64_t B, int64_t T,
                         int32_t* inputs, int32_t* targets) -> Status {
    const int64_t sequences = (int64_t(tokens->size()) - 1) / T;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t j = sequence_index(order, offset, micro, rank, world, B, b, sequences);
      std::memcpy(inputs + b * T, tokens->data() + j * T, size_t(T) * 4);
      std::memcpy(targets + b * T, tokens->data() + j * T + 1, size_t(T) * 4);
    }
    return Status::ok();
  };
}

struct EngineRun {
  int stage = 0;
  std::string offload_param = "none";
  std::string offload_optimizer = "none";
  int world = 1;
  std::string precision = "fp32";
  int64_t micro_batch = 2;
  int64_t grad_accum = 2;
  int64_t seq_len = 16;
  bool overlap_comm = true;
  bool reduce_scatter = true;
  double clipping = 1.0;
  double lr = 3e-3;
  double eps = 1e-8;  // Adam's
  int steps = 3;
  bool tied = false;
  int layers = 2;  // decoder layers of small_gqa_model
  bool moe = false;  // small_moe_model instead
  uint64_t device_budget = 64ull << 20;
  uint64_t host_budget = 64ull << 20;
  std::string scheduler;      // "" or a DeepSpeed scheduler type
  int param_buffers = 3;      // offload_param.buffer_count
  int optimizer_buffers = 3;  // offload_optimizer.buffer_count
  int64_t sub_group_size = 4096;
  bool reduce_in_bf16 = false;
  std::string init;              // safetensors checkpoint to start from; empty: the seed
  int initial_scale_power = 12;  // fp16
  std::shared_ptr<io::FaultInjector> fault_injector;
  kernels::BackendKind backend = kernels::BackendKind::cpu;
  bool emulate_gpu = false;  // EngineOptions::emulate_gpu
  bool shuffle = false;      // strata.shuffle
  std::optional<uint64_t> shuffle_seed;  // strata.shuffle_seed; unset: the run's seed
  std::string schedule = "auto";         // strata.schedule
  std::string state_dtype = "fp32";      // strata.optimizer_state_dtype
  std::string gradient_home = "auto";    // strata.gradient_home
  std::string activation_home = "auto";  // strata.activation_home
  int64_t vocab_chunks = 1;              // strata.vocab_chunks (0: auto)
  int64_t vocab_size = 0;                // the model's vocabulary; 0: small_gqa_model's
  int64_t layer_pieces = 1;              // strata.layer_pieces (0: auto)
  int64_t expert_groups = 1;             // strata.expert_groups
  int64_t mlp_parts = 1;                 // strata.mlp_parts (0: auto)
  std::string expert_fetch = "routed";   // strata.expert_fetch
  std::string expert_update = "eager";   // strata.expert_update
  int64_t experts = 0;                   // a mixture's experts; 0: small_moe_model's
  int64_t experts_per_token = 0;         // likewise its top k
  int64_t intermediate = 0;              // intermediate_size (and an expert's); 0: the model's
  std::string label() const {
    return std::string(moe ? "moe " : "") +
           std::string(backend == kernels::BackendKind::cuda ? "cuda "
                       : emulate_gpu                         ? "emulated gpu "
                                                             : "") +
           "stage " + std::to_string(stage) + " param " + offload_param + " optimizer " +
           offload_optimizer + " world " + std::to_string(world) + " " + precision +
           (overlap_comm ? "" : " no-overlap") + (reduce_scatter ? "" : " all-reduce") +
           (schedule == "auto" ? "" : " schedule " + schedule) +
           (state_dtype == "fp32" ? "" : " state " + state_dtype) +
           (gradient_home == "auto" ? "" : " gradients " + gradient_home) +
           (activation_home == "auto" ? "" : " activations " + activation_home) +
           (vocab_chunks == 1 ? "" : " vocab chunks " + std::to_string(vocab_chunks)) +
           (layer_pieces == 1 ? "" : " layer pieces " + std::to_string(layer_pieces)) +
           (expert_groups == 1 ? "" : " expert groups " + std::to_string(expert_groups)) +
           (mlp_parts == 1 ? "" : " mlp parts " + std::to_string(mlp_parts)) +
           (expert_fetch == "routed" ? "" : " expert fetch " + expert_fetch) +
           (expert_update == "eager" ? "" : " expert update " + expert_update);
  }
};

struct EngineOutcome {
  std::vector<StepResult> steps;
  HostModel weights;
  TrainingPlan plan;
  uint64_t nvme_read = 0, nvme_written = 0;        // during the steps, after initialisation
  std::vector<uint64_t> rank_nvme_read, rank_nvme_written;  // the same, per rank
  tiers::TierUsage rank_usage[tiers::kTierCount];  // the largest peak over the ranks
};

inline Result<TrainConfig> engine_config(const EngineRun& run, const std::string& nvme_dir) {
  nlohmann::json j;
  j["train_micro_batch_size_per_gpu"] = run.micro_batch;
  j["gradient_accumulation_steps"] = run.grad_accum;
  j["gradient_clipping"] = run.clipping;
  j["optimizer"] = {
      {"type", "AdamW"},
      {"params",
       {{"lr", run.lr}, {"weight_decay", 0.1}, {"betas", {0.9, 0.95}}, {"eps", run.eps}}}};
  if (!run.scheduler.empty())
    j["scheduler"] = {{"type", run.scheduler},
                      {"params",
                       {{"warmup_min_lr", 0.0},
                        {"warmup_max_lr", run.lr},
                        {"warmup_num_steps", 2},
                        {"total_num_steps", 8}}}};
  if (run.precision == "bf16") j["bf16"] = {{"enabled", true}};
  if (run.precision == "fp16")
    j["fp16"] = {
        {"enabled", true}, {"initial_scale_power", run.initial_scale_power}, {"hysteresis", 1}};
  nlohmann::json zero = {{"stage", run.stage},
                         {"overlap_comm", run.overlap_comm},
                         {"reduce_scatter", run.reduce_scatter},
                         {"sub_group_size", run.sub_group_size}};
  zero["offload_param"] = {{"device", run.offload_param}, {"buffer_count", run.param_buffers}};
  zero["offload_optimizer"] = {{"device", run.offload_optimizer},
                               {"buffer_count", run.optimizer_buffers}};
  if (run.offload_param == "nvme") zero["offload_param"]["nvme_path"] = nvme_dir;
  if (run.offload_optimizer == "nvme") zero["offload_optimizer"]["nvme_path"] = nvme_dir;
  j["zero_optimization"] = zero;
  j["aio"] = {{"block_size", 65536}, {"queue_depth", 8}};
  j["strata"] = {{"seq_len", run.seq_len}};
  if (run.reduce_in_bf16) j["strata"]["gradient_reduce_dtype"] = "bf16";
  if (run.shuffle) j["strata"]["shuffle"] = true;
  if (run.state_dtype != "fp32") j["strata"]["optimizer_state_dtype"] = run.state_dtype;
  if (run.gradient_home != "auto") j["strata"]["gradient_home"] = run.gradient_home;
  if (run.activation_home != "auto") j["strata"]["activation_home"] = run.activation_home;
  if (run.shuffle_seed) j["strata"]["shuffle_seed"] = *run.shuffle_seed;
  j["strata"]["vocab_chunks"] = run.vocab_chunks;
  j["strata"]["layer_pieces"] =
      run.layer_pieces == 0 ? nlohmann::json("auto") : nlohmann::json(run.layer_pieces);
  j["strata"]["expert_groups"] = run.expert_groups;
  j["strata"]["mlp_parts"] =
      run.mlp_parts == 0 ? nlohmann::json("auto") : nlohmann::json(run.mlp_parts);
  j["strata"]["schedule"] = run.schedule;
  j["strata"]["expert_fetch"] = run.expert_fetch;
  j["strata"]["expert_update"] = run.expert_update;
  ConfigOverrides overrides;
  overrides.world_size = run.world;
  return train_config_from_json(j, "test config", overrides);
}

inline Result<EngineOptions> engine_options(const EngineRun& run, const std::string& nvme_dir,
                                            std::shared_ptr<const std::vector<int32_t>> tokens,
                                            uint64_t seed) {
  Result<TrainConfig> config = engine_config(run, nvme_dir);
  if (!config) return config.status();
  EngineOptions options;
  options.model = run.moe ? small_moe_model() : small_gqa_model(run.tied);
  options.model.num_hidden_layers = run.layers;
  if (run.vocab_size > 0) options.model.vocab_size = run.vocab_size;
  if (run.experts > 0) options.model.num_experts = run.experts;
  if (run.experts_per_token > 0) options.model.num_experts_per_tok = run.experts_per_token;
  if (run.intermediate > 0) {
    options.model.intermediate_size = run.intermediate;
    if (run.moe) options.model.moe_intermediate_size = run.intermediate;
  }
  options.config = *config;
  options.total_steps = run.steps;
  options.budgets.device_per_rank = int64_t(run.device_budget);
  options.budgets.host_per_node = int64_t(run.host_budget);
  options.nvme_paths = {nvme_dir};
  options.seed = seed;
  options.data = memory_reader(tokens, SequenceOrder::from_config(options.config.strata, seed));
  options.backend = run.backend;
  options.emulate_gpu = run.emulate_gpu;
  // Copies between pinned host memory and a GPU run asynchronously, as in training.
  options.pin_host = run.backend == kernels::BackendKind::cuda;
  options.notice = [](const std::string&) {};
  options.fault_injector = run.fault_injector;
  options.init_checkpoint = run.init;
  return options;
}

inline Result<EngineOutcome> train_engine(const EngineRun& run, const std::string& nvme_dir,
                                          std::shared_ptr<const std::vector<int32_t>> tokens,
                                          uint64_t seed) {
  Result<EngineOptions> made = engine_options(run, nvme_dir, tokens, seed);
  if (!made) return made.status();
  EngineOptions options = std::move(*made);
  Result<std::unique_ptr<Engine>> engine = Engine::create(options);
  if (!engine) return engine.status();
  EngineOutcome outcome;
  outcome.plan = (*engine)->plan();
  const uint64_t read0 = (*engine)->nvme_bytes_read(), written0 = (*engine)->nvme_bytes_written();
  const int ranks = (*engine)->local_rank_count();
  for (int r = 0; r < ranks; ++r) {
    outcome.rank_nvme_read.push_back((*engine)->nvme_bytes_read(r));
    outcome.rank_nvme_written.push_back((*engine)->nvme_bytes_written(r));
  }
  for (int s = 0; s < run.steps; ++s) {
    Result<StepResult> step = (*engine)->step();
    if (!step) return step.status();
    outcome.steps.push_back(*step);
  }
  if (Status s = (*engine)->finish(); !s) return s;
  outcome.nvme_read = (*engine)->nvme_bytes_read() - read0;
  outcome.nvme_written = (*engine)->nvme_bytes_written() - written0;
  for (int r = 0; r < ranks; ++r) {
    outcome.rank_nvme_read[size_t(r)] =
        (*engine)->nvme_bytes_read(r) - outcome.rank_nvme_read[size_t(r)];
    outcome.rank_nvme_written[size_t(r)] =
        (*engine)->nvme_bytes_written(r) - outcome.rank_nvme_written[size_t(r)];
  }
  for (int t = 0; t < tiers::kTierCount; ++t) {
    for (int r = 0; r < run.world; ++r) {
      tiers::TierUsage u = (*engine)->rank_usage(r, static_cast<tiers::Tier>(t));
      if (u.peak >= outcome.rank_usage[t].peak) outcome.rank_usage[t] = u;
    }
  }
  Result<HostModel> weights = (*engine)->read_model();
  if (!weights) return weights.status();
  outcome.weights = std::move(*weights);
  return outcome;
}

// Calls `each(name, x, y, numel)` for every whole tensor of `a` with the
// same tensor of `b` (by name: models cut differently compare); false when
// their tensors or shapes differ.
inline bool for_each_tensor_pair(
    const HostModel& a, const HostModel& b,
    const std::function<void(const std::string&, const float*, const float*, int64_t)>& each) {
  const std::vector<CheckpointTensor> ta = checkpoint_tensor_groups(a.layout);
  const std::vector<CheckpointTensor> tb = checkpoint_tensor_groups(b.layout);
  if (ta.size() != tb.size()) return false;
  std::vector<float> sa, sb;
  for (const CheckpointTensor& t : ta) {
    const auto other = std::find_if(tb.begin(), tb.end(),
                                    [&](const CheckpointTensor& u) { return u.name == t.name; });
    if (other == tb.end() || other->shape != t.shape) return false;
    const float* x = whole_tensor(
        t, [&](int64_t u) { return a.params[size_t(u)].data(); }, sa);
    const float* y = whole_tensor(
        *other, [&](int64_t u) { return b.params[size_t(u)].data(); }, sb);
    each(t.name, x, y, t.numel());
  }
  return true;
}

// Largest per-tensor relative error |a - b| / |b| over the model (infinite
// where a weight is NaN); `where` gets its tensor.
inline double weights_relative_error(const HostModel& a, const HostModel& b,
                                     std::string* where = nullptr) {
  double worst = 0;
  const bool paired = for_each_tensor_pair(
      a, b, [&](const std::string& name, const float* x, const float* y, int64_t numel) {
        double diff = 0, norm = 0;
        for (int64_t e = 0; e < numel; ++e) {
          diff += (double(x[e]) - y[e]) * (double(x[e]) - y[e]);
          norm += double(y[e]) * y[e];
        }
        double error = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
        if (std::isnan(error)) error = INFINITY;  // a NaN weight is as far as it gets
        if (error > worst && where) *where = name;
        worst = std::max(worst, error);
      });
  return paired ? worst : INFINITY;
}

// The weights of two runs whose gradients differ only by rounding (another
// summation order, another cut of a sum). AdamW divides each gradient by its
// own magnitude, so an element whose gradient is near zero, and of another
// sign in the other run, moves by up to 2 lr where the other does not; int8
// moments round to their block's codes, so an element on a code's boundary
// reads back a moment one code apart (for a small moment, up to twice the
// step). Such elements are rare (the schedules at 2 ranks, both fp32 and int8
// moments, 60 seeds: at most 1 of 74048 elements more than lr / 100 apart),
// but any one of them alone takes a small tensor past a per-tensor bound
// (seen: 3.8e-4 from a single element 0.2 lr apart). So the elements more
// than lr / 100 apart are counted apart ("flipped"), each held to the most
// two runs can differ by, and the rest to `relative` per tensor.
struct WeightsDrift {
  double relative = 0;  // largest per-tensor |a - b| / |b|, flipped elements left out
  std::string where;    // its tensor
  int64_t flipped = 0;  // elements more than lr / 100 apart
  double largest = 0;   // largest |a - b| / lr over all elements
  int64_t elements = 0;
};

inline WeightsDrift weights_drift(const HostModel& a, const HostModel& b, double lr) {
  WeightsDrift drift;
  const bool paired = for_each_tensor_pair(
      a, b, [&](const std::string& name, const float* x, const float* y, int64_t numel) {
        double diff = 0, norm = 0;
        for (int64_t e = 0; e < numel; ++e) {
          const double d = std::fabs(double(x[e]) - y[e]);
          drift.largest = std::max(drift.largest, std::isnan(d) ? INFINITY : d / lr);
          norm += double(y[e]) * y[e];
          if (!(d <= lr / 100)) {
            ++drift.flipped;
            continue;
          }
          diff += d * d;
        }
        double error = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
        if (std::isnan(error)) error = INFINITY;  // a NaN in `b`'s tensor
        if (error > drift.relative) drift.where = name;
        drift.relative = std::max(drift.relative, error);
        drift.elements += numel;
      });
  if (!paired) drift.relative = INFINITY;
  return drift;
}

// `a`'s weights within `relative` of `b`'s per tensor but for at most
// max(4, elements / 10^4) flipped elements, each at most 8 lr per step
// apart: AdamW moves an element by at most 1.17 lr a step with fp32 moments
// (|m^| / sqrt(v^) by Cauchy-Schwarz over beta1 = 0.9, beta2 = 0.95, any
// step), at most 3.5 lr with int8 ones (a small m read back up to 2x, sqrt(v)
// down to 1 / 1.5), plus weight decay, lr / 10 of a weight; two runs, 4 lr
// each. The runs used learning rates up to `lr`. Returns what it measured.
inline WeightsDrift expect_weights_near(const EngineOutcome& a, const EngineOutcome& b, double lr,
                                        double relative, const std::string& label) {
  const WeightsDrift drift = weights_drift(a.weights, b.weights, lr);
  EXPECT_LE(drift.relative, relative) << label << " (" << drift.where << ")";
  EXPECT_LE(drift.flipped, std::max<int64_t>(4, drift.elements / 10000))
      << label << ": elements more than lr / 100 apart";
  EXPECT_LE(drift.largest, 8.0 * double(std::max<size_t>(a.steps.size(), 1)))
      << label << ": largest difference, in lr";
  return drift;
}

// Each step's loss and gradient norm within `loss_relative` and
// `norm_relative` of the reference run's.
inline void expect_steps_near(const EngineOutcome& outcome, const EngineOutcome& reference,
                              double loss_relative, double norm_relative,
                              const std::string& label) {
  ASSERT_EQ(outcome.steps.size(), reference.steps.size()) << label;
  for (size_t s = 0; s < outcome.steps.size(); ++s) {
    EXPECT_NEAR(outcome.steps[s].loss, reference.steps[s].loss,
                loss_relative * reference.steps[s].loss)
        << label << ", step " << s + 1;
    EXPECT_NEAR(outcome.steps[s].grad_norm, reference.steps[s].grad_norm,
                norm_relative * reference.steps[s].grad_norm)
        << label << ", step " << s + 1;
  }
}

// A run's NVMe bytes are its plan's per step, and each tier's peak stays
// within its capacity and (but NVMe) the plan's.
inline void expect_run_keeps_to_its_plan(const EngineOutcome& outcome, uint64_t rank_steps,
                                         const std::string& label) {
  const TrainingPlan& plan = outcome.plan;
  EXPECT_GT(outcome.nvme_read, 0u) << label;
  EXPECT_EQ(outcome.nvme_read, uint64_t(plan.traffic_per_step.nvme_read) * rank_steps) << label;
  EXPECT_EQ(outcome.nvme_written, uint64_t(plan.traffic_per_step.nvme_written) * rank_steps)
      << label;
  for (int t = 0; t < tiers::kTierCount; ++t) {
    const tiers::TierUsage& usage = outcome.rank_usage[t];
    const auto tier = static_cast<tiers::Tier>(t);
    EXPECT_LE(usage.peak, usage.capacity) << label << " " << tiers::tier_name(tier);
    if (tier != tiers::Tier::nvme) {
      EXPECT_LE(int64_t(usage.peak), plan.peak(tier)) << label;
    }
  }
}

inline bool weights_bitwise_equal(const HostModel& a, const HostModel& b) {
  bool equal = true;
  const bool paired = for_each_tensor_pair(
      a, b, [&](const std::string&, const float* x, const float* y, int64_t numel) {
        equal = equal && std::memcmp(x, y, size_t(numel) * 4) == 0;
      });
  return paired && equal;
}

// Losses, gradient norms and weights bitwise equal.
inline void expect_identical(const EngineOutcome& a, const EngineOutcome& b,
                             const std::string& what) {
  ASSERT_EQ(a.steps.size(), b.steps.size()) << what;
  for (size_t s = 0; s < a.steps.size(); ++s) {
    EXPECT_EQ(a.steps[s].loss, b.steps[s].loss) << what << ", step " << s + 1;
    EXPECT_EQ(a.steps[s].grad_norm, b.steps[s].grad_norm) << what << ", step " << s + 1;
  }
  EXPECT_TRUE(weights_bitwise_equal(a.weights, b.weights)) << what;
}

// A fixture that trains the small model on fresh random tokens in a temporary
// NVMe directory; `seed_label` names the seed printed for reruns.
// The bytes of a plan's buffers sized by its largest unit: the fetched and
// gathered parameter copies and the unit gradients.
inline int64_t parameter_slot_bytes(const TrainingPlan& plan) {
  int64_t slots = 0;
  for (const PlanBuffer& buffer : plan.buffers)
    if (buffer.role == BufferRole::gathered_unit || buffer.role == BufferRole::unit_gradient ||
        buffer.role == BufferRole::gathered_unit_fp32 ||
        buffer.role == BufferRole::nvme_parameter_copies)
      slots += buffer.bytes;
  return slots;
}

class EngineRunsTest : public ::testing::Test {
 protected:
  explicit EngineRunsTest(std::string seed_label) : seed_label_(std::move(seed_label)) {}
  void SetUp() override {
    if (std::string why = dir_.why_unusable(); !why.empty()) GTEST_SKIP() << why;
    seed_ = tiers::testing::fresh_seed(seed_label_.c_str());
    tokens_ = std::make_shared<std::vector<int32_t>>(
        random_tokens(4096, small_gqa_model().vocab_size, seed_ + 1));
  }
  EngineOutcome train(const EngineRun& run) {
    Result<EngineOutcome> outcome = train_engine(run, dir_.path(), tokens_, seed_);
    EXPECT_TRUE(outcome.is_ok()) << run.label() << ": " << outcome.status().message();
    if (!outcome) return {};
    return std::move(*outcome);
  }
  // The engine of `run` is refused, in one line holding `expected`.
  void expect_refused(const EngineRun& run, const std::string& expected) {
    Result<EngineOptions> options = engine_options(run, dir_.path(), tokens_, seed_);
    ASSERT_TRUE(options.is_ok()) << options.status().message();
    Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
    ASSERT_FALSE(engine.is_ok()) << run.label();
    EXPECT_NE(engine.status().message().find(expected), std::string::npos)
        << engine.status().message();
    EXPECT_EQ(engine.status().message().find('\n'), std::string::npos);
  }
  // `run`'s pieces that pass their input on share their input's saved
  // input (TrainingPlan::level_storage): kept in host memory, `shared`
  // fewer places than one per level; spilled to NVMe, `spilled_shared`
  // fewer spills per micro-batch (the last two levels stay in their
  // slots). Both keep to their plans (NVMe bytes, peaks) and give the same
  // bits, one reading the shared place, the other restoring its input's
  // spilled copy into the level's own slot.
  void expect_pieces_share_saved_inputs(EngineRun run, int64_t shared, int64_t spilled_shared) {
    run.activation_home = "host";
    EngineRun spilled = run;
    spilled.activation_home = "nvme";
    const EngineOutcome kept = train(run), moved = train(spilled);
    ASSERT_EQ(kept.steps.size(), size_t(run.steps)) << run.label();
    const TrainingPlan& plan = kept.plan;
    ASSERT_FALSE(plan.activations_spilled()) << run.label();
    const int64_t levels = int64_t(plan.units.size()) - 1 - shared;
    EXPECT_EQ(plan.saved_input_levels(), levels) << run.label();
    const PlanBuffer* saved = plan.buffer(BufferRole::saved_inputs);
    ASSERT_NE(saved, nullptr);
    EXPECT_EQ(saved->bytes, levels * plan.activation_copies() * plan.tokens_per_micro *
                                plan.input.model.hidden_size * 4)
        << run.label();
    expect_run_keeps_to_its_plan(kept, uint64_t(run.steps), run.label());
    const TrainingPlan& out = moved.plan;
    ASSERT_TRUE(out.activations_spilled()) << spilled.label();
    const int64_t spilled_places = out.spilled_levels() - spilled_shared;
    EXPECT_EQ(out.spilled_places(), spilled_places) << spilled.label();
    int64_t spills = 0;
    for (const PlanOp& op : out.ops) spills += op.kind == OpKind::spill;
    EXPECT_EQ(spills, spilled_places * out.input.grad_accum) << spilled.label();
    expect_run_keeps_to_its_plan(moved, uint64_t(run.steps), spilled.label());
    expect_identical(kept, moved, run.label() + ": kept in host memory vs spilled to NVMe");
  }
  // `whole` and `cut` (the same run with a unit cut finer) train and keep
  // to their plans, and the cut's parameter slots (parameter_slot_bytes)
  // are under 3/4 of the whole run's; `what` names the cut in the print.
  void expect_cut_lowers_the_slots(const EngineRun& whole, const EngineRun& cut,
                                   const std::string& what) {
    int64_t slots[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
      const EngineRun& run = i == 0 ? whole : cut;
      const EngineOutcome outcome = train(run);
      ASSERT_EQ(outcome.steps.size(), size_t(run.steps)) << run.label();
      expect_run_keeps_to_its_plan(outcome, uint64_t(run.steps), run.label());
      slots[i] = parameter_slot_bytes(outcome.plan);
      ASSERT_GT(slots[i], 0) << run.label();
    }
    std::printf("parameter slots: %lld bytes %s\n", static_cast<long long>(slots[0]),
                fmt::format(fmt::runtime(what), slots[1]).c_str());
    EXPECT_LT(double(slots[1]), 0.75 * double(slots[0])) << cut.label();
  }
  // `runs_for(world, schedule)` at 1 and 2 ranks in both schedules: every
  // other (at 2 ranks every fourth) placement and the last give the first's
  // bits, whose plan has `units` units, and at 1 rank both schedules do too.
  void expect_placements_and_schedules_identical(
      const std::function<std::vector<EngineRun>(int, const std::string&)>& runs_for,
      size_t units) {
    EngineOutcome one_rank;
    for (auto [world, schedule] : {std::pair{1, "micro_batch"}, std::pair{1, "layer"},
                                   std::pair{2, "micro_batch"}, std::pair{2, "layer"}}) {
      std::vector<EngineRun> runs = runs_for(world, schedule);
      const EngineOutcome reference = train(runs[0]);
      ASSERT_EQ(reference.steps.size(), size_t(runs[0].steps)) << runs[0].label();
      ASSERT_EQ(reference.plan.units.size(), units) << runs[0].label();
      const size_t stride = world == 1 ? 2 : 4;  // stage 3 with NVMe among them
      for (size_t i = stride; i < runs.size(); i += stride)
        expect_identical(train(runs[i]), reference, runs[i].label() + " vs " + runs[0].label());
      expect_identical(train(runs.back()), reference, runs.back().label());
      if (world == 1 && one_rank.steps.empty()) {
        one_rank = reference;
      } else if (world == 1) {
        expect_identical(reference, one_rank, std::string("schedule ") + schedule);
      }
    }
  }
  // `run` with int8 moments, saved after a step and resumed with `resumed`'s
  // cut of the units: refused in one line holding `expected`.
  void expect_int8_resume_refused(EngineRun run, EngineRun resumed, const std::string& expected) {
    run.state_dtype = resumed.state_dtype = "int8";
    Result<EngineOptions> options = engine_options(run, dir_.path(), tokens_, seed_);
    ASSERT_TRUE(options.is_ok()) << options.status().message();
    Result<std::unique_ptr<Engine>> first = Engine::create(*options);
    ASSERT_TRUE(first.is_ok()) << run.label() << ": " << first.status().message();
    ASSERT_TRUE((*first)->step().is_ok()) << run.label();
    Result<std::string> saved = (*first)->save_checkpoint(dir_.path() + "/int8-ckpt");
    ASSERT_TRUE(saved.is_ok()) << run.label() << ": " << saved.status().message();
    first->reset();
    Result<EngineOptions> other = engine_options(resumed, dir_.path(), tokens_, seed_);
    ASSERT_TRUE(other.is_ok()) << other.status().message();
    other->resume_from = *saved;
    Result<std::unique_ptr<Engine>> refused = Engine::create(*other);
    ASSERT_FALSE(refused.is_ok()) << resumed.label();
    EXPECT_NE(refused.status().message().find(expected), std::string::npos)
        << refused.status().message();
    EXPECT_EQ(refused.status().message().find('\n'), std::string::npos);
  }
  // `run` saved after `save_after` steps and resumed in a new engine (with
  // `resumed`'s settings when given) gives the straight run's (`resumed`'s)
  // remaining losses and final weights bitwise.
  void expect_resumes_bitwise(const EngineRun& run, int save_after,
                              const std::optional<EngineRun>& resumed = std::nullopt) {
    const EngineOutcome straight = train(resumed.value_or(run));
    Result<EngineOptions> options = engine_options(run, dir_.path(), tokens_, seed_);
    ASSERT_TRUE(options.is_ok()) << options.status().message();
    Result<std::unique_ptr<Engine>> first = Engine::create(*options);
    ASSERT_TRUE(first.is_ok()) << run.label() << ": " << first.status().message();
    for (int s = 0; s < save_after; ++s) ASSERT_TRUE((*first)->step().is_ok()) << run.label();
    Result<std::string> saved = (*first)->save_checkpoint(dir_.path() + "/resume-ckpt");
    ASSERT_TRUE(saved.is_ok()) << run.label() << ": " << saved.status().message();
    first->reset();
    if (resumed) options = engine_options(*resumed, dir_.path(), tokens_, seed_);
    ASSERT_TRUE(options.is_ok()) << options.status().message();
    options->resume_from = *saved;
    Result<std::unique_ptr<Engine>> second = Engine::create(*options);
    ASSERT_TRUE(second.is_ok()) << run.label() << ": " << second.status().message();
    for (int s = save_after; s < run.steps; ++s) {
      Result<StepResult> step = (*second)->step();
      ASSERT_TRUE(step.is_ok()) << run.label() << ": " << step.status().message();
      EXPECT_EQ(step->loss, straight.steps[size_t(s)].loss) << run.label() << ", step " << s + 1;
    }
    Result<HostModel> weights = (*second)->read_model();
    ASSERT_TRUE(weights.is_ok()) << run.label();
    EXPECT_TRUE(weights_bitwise_equal(*weights, straight.weights)) << run.label();
  }

  std::string seed_label_;
  io::testing::TemporaryDirectory dir_;
  uint64_t seed_ = 0;
  std::shared_ptr<std::vector<int32_t>> tokens_;
};

// A mixture whose micro-batches reach few experts, its experts read as routed:
// 16 experts of 64, top 1, 1 x 4 tokens a micro-batch; the parameters on
// NVMe at stage 3, the layers in pieces; fp32 state, Adam's eps 1e-6.
inline EngineRun routed_moe_run(const std::string& schedule, const std::string& precision) {
  EngineRun run;
  run.moe = true;
  run.experts = 16;
  run.experts_per_token = 1;
  run.intermediate = 64;
  run.stage = 3;
  run.offload_param = "nvme";
  run.precision = precision;
  run.micro_batch = 1;
  run.seq_len = 4;
  run.layer_pieces = 2;
  run.schedule = schedule;
  run.lr = 1e-3;
  run.eps = 1e-6;
  return run;
}

// Every valid (stage, offload_param, offload_optimizer): parameter offload needs stage 3.
// At more than one rank the two schedules sum gradients in different orders
// (core/README.md, "Numbers at more than one rank") and `auto` picks by
// placement, so runs to be compared across placements take one schedule:
// `schedule`, by default the micro-batch order there (`auto` at one rank,
// where both give the same bits).
inline std::vector<EngineRun> every_placement(int world, const std::string& precision,
                                              std::string schedule = "") {
  if (schedule.empty()) schedule = world > 1 ? "micro_batch" : "auto";
  std::vector<EngineRun> runs;
  for (int stage = 0; stage <= 3; ++stage) {
    for (const char* param : {"none", "cpu", "nvme"}) {
      if (stage < 3 && std::string(param) != "none") continue;
      for (const char* optimizer : {"none", "cpu", "nvme"}) {
        EngineRun run;
        run.stage = stage;
        run.offload_param = param;
        run.offload_optimizer = optimizer;
        run.world = world;
        run.precision = precision;
        run.schedule = schedule;
        runs.push_back(run);
      }
    }
  }
  return runs;
}

// every_placement in fp32 with one cut of the model (`cut` sets it: vocabulary
// chunks, layer pieces), two steps, the same global batch (6 micro-batches)
// at every world size.
inline std::vector<EngineRun> cut_placements(int world, const std::string& schedule,
                                             const std::function<void(EngineRun&)>& cut) {
  std::vector<EngineRun> runs = every_placement(world, "fp32", schedule);
  for (EngineRun& run : runs) {
    cut(run);
    run.grad_accum = 6 / world;
    run.steps = 2;
  }
  return runs;
}

}  // namespace strata::testing
