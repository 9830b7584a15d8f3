// The memory and traffic planner behind `strata plan` and the engine's
// refusal of a configuration that cannot fit: a view of the training plan
// (core/plan/training_plan.h), not a second accounting.
//
// With a model, plan_memory builds the TrainingPlan the engine would run
// (step_input: the one conversion from a config, which the engine's
// training_plan_input also goes through) and reports its buffers: the model
// states, the activations and the staging buffers, per rank and tier, exactly
// as a rank allocates them. With a bare parameter count (`--params N`) it
// reports the model-state lines alone, by the same rules (state_buffers_for,
// the model as one unit); activations need the model's shapes. Beside
// strata's bytes it prints the ZeRO paper's accounting (2 + 2 + 12 bytes per
// parameter), which published tables use; whether the whole fits the budgets
// and, if not, the smallest change that does (every candidate is a plan built
// by the same code); and the bytes each link moves per step with their times.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/model_config.h"
#include "core/plan/training_plan.h"
#include "tiers/tier.h"

namespace strata {

// The streamed optimizer (state on NVMe) works through a unit's shard in chunks
// of at most this many elements (4 MiB per fp32 state, 12 MiB per chunk of
// master, m and v), so its pinned buffers stay small whatever the unit size
// and a unit's chunks pipeline (read the next while updating this one and
// writing the last); sub_group_size can lower it further.
inline constexpr int64_t kOptimizerChunkElements = int64_t{1} << 20;

// The streamed optimizer's chunk for a sub_group_size: at most
// kOptimizerChunkElements, a whole multiple of 1024 elements (its SIMD and
// O_DIRECT granule), at least 1024.
int64_t streamed_chunk_elements(int64_t sub_group_size);

// Elements of each rank's shard of a unit with `numel` parameters over
// `world_size` ranks (padded to kShardAlignElements, as model_layout pads).
int64_t padded_shard_elements(int64_t numel, int world_size);

struct PlanInput {
  std::optional<ModelConfig> model;  // when absent, `parameters` alone (no activations or units)
  int64_t parameters = 0;            // used when model is absent
  int world_size = 1;
  int stage = 0;
  OffloadDevice offload_optimizer = OffloadDevice::none;
  OffloadDevice offload_param = OffloadDevice::none;
  Precision precision = Precision::bf16;
  Precision gradient_reduce_dtype = Precision::fp32;
  OptimizerStateDtype optimizer_state_dtype = OptimizerStateDtype::fp32;  // m and v
  GradientHome gradient_home = GradientHome::automatic;                   // strata.gradient_home
  int64_t micro_batch = 1;
  int64_t seq_len = 2048;
  int64_t grad_accum = 1;
  int param_buffer_count = 5;  // offload_param.buffer_count: NVMe parameter staging buffers
  int64_t param_buffer_elements =
      100000000;                   // offload_param.buffer_size: elements per staging buffer
  int optimizer_buffer_count = 4;  // offload_optimizer.buffer_count: streamed optimizer buffers
  int64_t sub_group_size = 1000000000;  // zero_optimization.sub_group_size: caps a streamed chunk
  bool overlap_comm = true;             // zero_optimization.overlap_comm
  bool reduce_scatter = true;           // zero_optimization.reduce_scatter
  bool optimizer_during_backward = false;  // no clipping and fp32: updates start during backward
  // The CUDA backend's buffers (the device is a GPU), else the CPU backend's
  // (host memory standing in for the device).
  bool gpu = false;
  bool nccl_staging = false;     // one process per GPU through NCCL
  bool nvme_path_known = false;  // an NVMe directory was given (for suggestions)
  // The step's order (strata.schedule); auto: choose_schedule's pick.
  Schedule schedule = Schedule::auto_choice;
  // Where layer-major activation checkpoints live (strata.activation_home);
  // unset: the first of device, host, NVMe (with a path known) that fits the budgets.
  std::optional<tiers::Tier> activation_home;

  // Budgets: device per rank; host and NVMe for the node (all ranks on one node).
  std::optional<int64_t> device_budget;
  std::optional<int64_t> host_budget;
  std::optional<int64_t> nvme_budget;
  std::string device_budget_source, host_budget_source, nvme_budget_source;

  // Link bandwidths in bytes per second, for the traffic times.
  double net_bandwidth = 25e9;
  double pcie_bandwidth = 25e9;
  double nvme_bandwidth = 6e9;
};

// The one Tier of the house (tiers/tier.h).
using tiers::Tier;
using tiers::tier_name;

struct TierBytes {
  int64_t device = 0;
  int64_t host = 0;
  int64_t nvme = 0;
  int64_t& at(Tier tier);
  int64_t at(Tier tier) const;
  int64_t total() const { return device + host + nvme; }
};

// One kind of model state: where it lives and how many bytes it takes per rank.
struct StateLine {
  std::string name;  // "parameters (bf16)", "gradients (fp32)", "fp32 master", "Adam m", "Adam v"
  Tier tier = Tier::device;
  int64_t bytes = 0;
};

struct TierVerdict {
  Tier tier = Tier::device;
  int64_t need = 0;  // bytes needed on the node for this tier (device: per rank)
  std::optional<int64_t> budget;
  std::string budget_source;
  bool fits() const { return !budget || need <= *budget; }
};

struct Traffic {
  int64_t collective_bytes = 0;       // strata: what the ring collectives send per rank
  int64_t collective_bytes_zero = 0;  // the ZeRO paper's 2x (stages 0-2) or 3x (stage 3) params
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  int64_t nvme_read_bytes = 0;
  int64_t nvme_write_bytes = 0;
  double collective_seconds = 0, h2d_seconds = 0, d2h_seconds = 0, nvme_seconds = 0;
  std::string slowest_link;  // "network", "PCIe", "NVMe" or "" when nothing moves
};

// One schedule's plan in brief, for the comparison `strata plan` prints.
struct ScheduleOption {
  Schedule schedule = Schedule::micro_batch;
  Tier activation_home = Tier::device;
  bool fits = true;
  Traffic traffic;
  TierBytes activations;       // activation checkpoints, gradients, tokens: per rank and tier
  double slowest_seconds = 0;  // the step's time on its slowest link
};

// The schedule a plan input runs: the given one, or for auto the one whose
// plan moves fewer bytes over its slowest link among those that fit (the
// micro-batch order on a tie, and with one micro-batch, where both are the
// same); with the activation home the first of device, host, NVMe that fits.
struct ScheduleChoice {
  Schedule schedule = Schedule::micro_batch;
  Tier activation_home = Tier::device;
  std::string reason;                   // one line: why
  std::vector<ScheduleOption> options;  // both schedules (with a model), micro-batch first
};
Result<ScheduleChoice> choose_schedule(const PlanInput& input);

struct MemoryPlan {
  PlanInput input;  // with the schedule and activation home resolved
  ScheduleChoice schedule;
  int64_t parameters = 0;       // unpadded
  int64_t shard_elements = 0;   // this rank's padded shard, summed over units
  int64_t padded_elements = 0;  // every unit padded to a multiple of world_size shards
  int64_t largest_unit_elements = 0;
  int units = 0;

  StateHomes homes;                    // where each kind of state lives (the gradient's resolved)
  std::string gradient_home_reason;    // the gradient's home and why, one line
  std::vector<StateLine> states;       // strata's accounting
  std::vector<StateLine> states_zero;  // the ZeRO paper's accounting
  TierBytes model_states;              // sum of `states`
  TierBytes model_states_zero;         // sum of `states_zero`

  // Every buffer of the training plan (with a model; else the state lines).
  std::vector<PlanBuffer> buffers;
  // The buffers besides the states, summed by what they hold.
  int64_t activation_checkpoint_bytes = 0;  // unit inputs kept to the backward, tokens, losses
  int64_t activation_working_bytes = 0;     // one unit's recompute + backward working set
  int64_t device_staging_bytes = 0;         // gathered units, unit gradients, ... on the device
  int64_t host_staging_bytes = 0;           // pinned copies, streamed optimizer, new parameters

  TierBytes total_per_rank;  // states + activations + staging
  std::vector<TierVerdict> verdicts;
  bool fits = true;
  std::string suggestion;  // the smallest change that fits, when !fits
  Traffic traffic;
};

// Tokens per sequence: strata.seq_len, else min(2048, the model's maximum)
// (2048 without a model).
int64_t effective_seq_len(const TrainConfig& config, const std::optional<ModelConfig>& model);

// The plan input a merged config describes (stage, offload homes, precision,
// batch shape, buffer counts, sub_group_size); budgets and bandwidths are left
// to the caller.
PlanInput plan_input_from_config(const TrainConfig& config,
                                 const std::optional<ModelConfig>& model);

// The training-plan input a plan input describes (needs input.model); the
// engine's plans are built from the same conversion.
// An unresolved schedule (auto, or no activation home) is resolved by
// choose_schedule; an input it cannot plan falls back to the micro-batch order.
TrainingPlanInput step_input(const PlanInput& input);
// step_input of plan_input_from_config: what the engine runs for this config
// on the given backend; auto judges fit against strata.device_mem_limit and
// strata.host_mem_limit where the config gives them.
TrainingPlanInput training_plan_input(const ModelConfig& model, const TrainConfig& config,
                                      bool gpu = false, bool nccl_staging = false);
// The plan input training_plan_input converts (choose_schedule of it says why
// the schedule is what it is).
PlanInput engine_plan_input(const ModelConfig& model, const TrainConfig& config, bool gpu,
                            bool nccl_staging);

// Checks the input (stage range, offload_param below stage 3, ...).
Status validate_plan_input(const PlanInput& input);

// The plan without suggestion search.
Result<MemoryPlan> plan_memory(const PlanInput& input);

// The plan, and when it does not fit, the smallest change that does.
Result<MemoryPlan> plan_with_suggestion(const PlanInput& input);

// Reading the node: MemAvailable, free bytes under the NVMe directories.
std::optional<int64_t> detect_host_available_bytes();
std::optional<int64_t> detect_free_bytes(const std::vector<std::string>& directories);

std::string format_plan_table(const MemoryPlan& plan, bool zero_accounting);
nlohmann::ordered_json plan_to_json(const MemoryPlan& plan, bool zero_accounting);

}  // namespace strata
