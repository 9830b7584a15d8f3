// The memory and traffic planner behind `strata plan` and the engine's
// refusal of a configuration that cannot fit: a view of the training plan
// (core/plan/training_plan.h), not a second accounting.
//
// plan_memory builds the TrainingPlan the engine would run for a plan input
// (core/plan/plan_input.h, the one input every plan is built from) and
// reports its buffers: the model states, the activations and the staging
// buffers, per rank and tier, exactly as a rank allocates them. A bare
// parameter count (`--params N`) is planned as model_of_size(N). Beside
// strata's bytes it prints the ZeRO paper's accounting (2 + 2 + 12 bytes per
// parameter), which published tables use; whether the whole fits the budgets
// and, if not, the smallest change that does (every candidate is a plan built
// by the same code); and the bytes each link moves per step with their times,
// summed from the plan's operations (TrainingPlan::traffic_per_step, the one
// source of those figures).
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/config/config.h"
#include "core/model/model_config.h"
#include "core/plan/plan_input.h"
#include "core/plan/training_plan.h"
#include "tiers/tier.h"

namespace strata {

// Elements of each rank's shard of a unit with `numel` parameters over
// `world_size` ranks (padded to kShardAlignElements, as model_layout pads).
int64_t padded_shard_elements(int64_t numel, int world_size);

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

// A step's bytes per rank on each link (StepTraffic, the plan's own) and
// their times at the input's LinkBandwidths.
struct Traffic {
  // strata's collectives, sent per rank: within the node, then across nodes.
  int64_t intra_node_bytes = 0;
  int64_t inter_node_bytes = 0;
  int64_t collective_bytes_zero = 0;  // the ZeRO paper's 2x (stages 0-2) or 3x (stage 3) params
  int64_t h2d_bytes = 0;
  int64_t d2h_bytes = 0;
  int64_t nvme_read_bytes = 0;
  int64_t nvme_write_bytes = 0;
  double intra_node_seconds = 0, inter_node_seconds = 0;
  double h2d_seconds = 0, d2h_seconds = 0, nvme_seconds = 0;
  // "intra-node", "inter-node", "PCIe", "NVMe" or "" when nothing moves.
  std::string slowest_link;
  int64_t collective_bytes() const { return intra_node_bytes + inter_node_bytes; }
};

// One schedule's plan in brief, for the comparison `strata plan` prints.
struct ScheduleOption {
  Schedule schedule = Schedule::micro_batch;
  Tier activation_home = Tier::device;
  bool fits = true;
  Traffic traffic;
  TierBytes activations;       // saved inputs, gradients, tokens: per rank and tier
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
  // Both schedules (with a model), micro-batch first; from choose_schedule
  // with a schedule given, that one only (plan_memory's report has both).
  std::vector<ScheduleOption> options;
};
Result<ScheduleChoice> choose_schedule(const PlanInput& input);

// What `strata plan` reports of a plan: its bytes per tier and kind, the
// verdict against the budgets, the smallest change that fits, the traffic.
struct PlanReport {
  PlanInput input;  // with the schedule and activation home resolved
  ScheduleChoice schedule;
  int64_t parameters = 0;       // unpadded
  int64_t shard_elements = 0;   // this rank's padded shard, summed over units
  int64_t padded_elements = 0;  // every unit padded to a multiple of world_size shards
  int64_t largest_unit_elements = 0;
  std::string largest_unit;  // its name ("layers.3.mlp"); the first of the largest
  int units = 0;

  StateHomes homes;                    // where each kind of state lives (the gradient's resolved)
  std::string gradient_home_reason;    // the gradient's home and why, one line
  std::string expert_fetch_reason;     // a mixture's: experts read as routed or all, and why
  std::string
      expert_update_reason;  // a mixture's: idle experts' updates deferred or eager, and why
  std::vector<StateLine> states;       // strata's accounting
  std::vector<StateLine> states_zero;  // the ZeRO paper's accounting
  TierBytes model_states;              // sum of `states`
  TierBytes model_states_zero;         // sum of `states_zero`

  // Every buffer of the training plan.
  std::vector<PlanBuffer> buffers;
  // The buffers besides the states, summed by what they hold.
  int64_t saved_activation_bytes = 0;    // unit inputs kept to the backward, tokens, losses
  int64_t activation_working_bytes = 0;  // one unit's recompute + backward working set
  int64_t device_staging_bytes = 0;      // gathered units, unit gradients, ... on the device
  int64_t host_staging_bytes = 0;        // pinned copies, streamed optimizer, new parameters

  TierBytes total_per_rank;  // states + activations + staging
  std::vector<TierVerdict> verdicts;
  bool fits = true;
  std::string suggestion;  // the smallest change that fits, when !fits
  Traffic traffic;
};

// The plan a run executes: the schedule and the activation home resolved by
// choose_schedule where the input leaves them to it (auto, unset), then
// build_training_plan. `strata train` builds it and the engine takes it;
// `schedule_reason`, when given, receives choose_schedule's one line.
Result<TrainingPlan> plan_training(const PlanInput& input, std::string* schedule_reason = nullptr);

// The plan without suggestion search.
Result<PlanReport> plan_memory(const PlanInput& input);

// The automatic cuts of the units (PlanInput::vocab_chunks_auto,
// layer_pieces_auto) resolved: each stays whole unless the plan without it
// does not fit its budgets and the plan with it does. The vocabulary is
// tried first (it adds no saved input); then each layer's attention and MLP
// (with the vocabulary, when automatic, cut to a piece's size); then a
// mixture's groups of experts and a dense MLP's parts, the fewest that fit.
// A given count is kept; the input says what was chosen and why in
// vocab_chunks_reason, layer_pieces_reason, expert_groups_reason and
// mlp_parts_reason. `report` is the plan the
// choice was judged by, when the choice built the one it chose.
struct UnitCutsChoice {
  PlanInput input;
  std::optional<PlanReport> report;
};
Result<UnitCutsChoice> choose_unit_cuts(const PlanInput& input);
// Its input alone: plan_training and plan_memory resolve the cuts first.
Result<PlanInput> resolve_unit_cuts(const PlanInput& input);
// The fewest chunks that make every embedding and head chunk no larger than
// the largest decoder-layer unit (a whole layer, or the largest piece of one);
// 1 where that is already so, or where the model or the backend cannot be
// cut (a tied head, the CUDA backend).
int64_t vocab_chunks_for_layers(const PlanInput& input);

// The report of a plan already built from `input` (its buffers, traffic and
// whether it fits the input's budgets), without building it again.
PlanReport training_plan_report(const PlanInput& input, TrainingPlan plan);

// The plan, and when it does not fit, the smallest change that does.
Result<PlanReport> plan_with_suggestion(const PlanInput& input);

// Reading the node: MemAvailable, free bytes under the NVMe directories.
std::optional<int64_t> detect_host_available_bytes();
std::optional<int64_t> detect_free_bytes(const std::vector<std::string>& directories);

std::string format_plan_table(const PlanReport& plan, bool zero_accounting);
// "2 (given)", or the automatic choice and why (PlanInput::vocab_chunks_reason).
std::string vocabulary_chunks_line(const PlanInput& input);
// Likewise for the layer pieces (PlanInput::layer_pieces_reason).
std::string layer_pieces_line(const PlanInput& input);
// Likewise for the groups of experts (PlanInput::expert_groups_reason).
std::string expert_groups_line(const PlanInput& input);
// The fewest groups of experts (ModelConfig::expert_groups, more than
// `leanest`'s) with which its plan, in layer pieces, fits the device's
// budget; 0 when no count up to the experts does.
int64_t expert_groups_that_fit(const PlanInput& leanest);
// Likewise for the parts of a dense layer's MLP (ModelConfig::mlp_parts,
// up to 64), and their line (PlanInput::mlp_parts_reason).
int64_t mlp_parts_that_fit(const PlanInput& leanest);
// Both, for a mixture with dense layers where neither alone fits: the
// fewest groups that fit with the dense MLPs cut to a group's size, then
// the fewest parts; {0, 0} when none does.
std::pair<int64_t, int64_t> groups_and_parts_that_fit(const PlanInput& leanest);
std::string mlp_parts_line(const PlanInput& input);
nlohmann::ordered_json plan_to_json(const PlanReport& plan, bool zero_accounting);

}  // namespace strata
