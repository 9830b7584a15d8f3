#include "tools/plan_tune.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/plan/planner.h"

namespace strata::tools {
namespace {

struct Placement {
  int stage;
  OffloadDevice param, optimizer;
};

// The flags of `strata train` that make `c` from the config the user gave.
std::string candidate_flags(const TrainConfig& c) {
  std::string flags =
      fmt::format("--micro-batch {} --grad-accum {} --zero-stage {}",
                  c.train_micro_batch_size_per_gpu, c.gradient_accumulation_steps, c.zero.stage);
  if (c.zero.offload_param.device != OffloadDevice::none)
    flags += fmt::format(" --offload-param {}", offload_device_name(c.zero.offload_param.device));
  if (c.zero.offload_optimizer.device != OffloadDevice::none)
    flags += fmt::format(" --offload-optimizer {}",
                         offload_device_name(c.zero.offload_optimizer.device));
  if (c.gradient_accumulation_steps > 1)
    flags += fmt::format(" --schedule {}", schedule_name(c.strata.schedule));
  if (c.strata.schedule == Schedule::layer && c.gradient_accumulation_steps > 1)
    flags += fmt::format(" --activation-home {}", activation_home_name(c.strata.activation_home));
  if (c.strata.optimizer_state_dtype != OptimizerStateDtype::fp32)
    flags += fmt::format(" --optimizer-state-dtype {}",
                         optimizer_state_dtype_name(c.strata.optimizer_state_dtype));
  if (c.strata.gradient_home == GradientHome::host_bf16) flags += " --gradient-home host_bf16";
  return flags;
}

}  // namespace

Result<TuneResult> tune_plan(const TrainConfig& base, const ModelConfig& model, PlanTarget target,
                             const PlanBudgets& budgets, const HardwareProfile& hardware,
                             bool allow_approximate, int keep) {
  TuneResult result;
  const int64_t sequences = base.train_micro_batch_size_per_gpu * base.gradient_accumulation_steps;
  const bool nvme = !base.effective_nvme_paths().empty();
  std::vector<Placement> placements;
  for (int stage = 0; stage <= 3; ++stage)
    for (OffloadDevice optimizer : {OffloadDevice::none, OffloadDevice::cpu, OffloadDevice::nvme})
      for (OffloadDevice param : {OffloadDevice::none, OffloadDevice::cpu, OffloadDevice::nvme}) {
        if (param != OffloadDevice::none && stage < 3) continue;
        if ((param == OffloadDevice::nvme || optimizer == OffloadDevice::nvme) && !nvme) continue;
        placements.push_back({stage, param, optimizer});
      }
  std::vector<OptimizerStateDtype> states = {OptimizerStateDtype::fp32};
  if (allow_approximate)
    states = {OptimizerStateDtype::fp32, OptimizerStateDtype::bf16, OptimizerStateDtype::int8};
  auto consider = [&](TrainConfig c) -> Status {
    c.train_batch_size =
        c.train_micro_batch_size_per_gpu * c.gradient_accumulation_steps * int64_t(c.world_size);
    PlanInput input = plan_input_from_config(c, model, target);
    input.budgets = budgets;
    if (!validate_plan_input(input)) return Status::ok();  // not a configuration strata runs
    ++result.tried;
    Result<TrainingPlan> plan = plan_training(input);
    if (!plan || !training_plan_report(plan->input, *plan).fits) return Status::ok();
    ++result.fitting;
    result.fastest.push_back({c, candidate_flags(c), predict_step(*plan, hardware)});
    return Status::ok();
  };
  for (int64_t micro = 1; micro <= sequences; ++micro) {
    if (sequences % micro != 0) continue;
    const int64_t accumulation = sequences / micro;
    for (const Placement& place : placements) {
      for (OptimizerStateDtype state : states) {
        TrainConfig c = base;
        c.train_micro_batch_size_per_gpu = micro;
        c.gradient_accumulation_steps = accumulation;
        c.zero.stage = place.stage;
        c.zero.offload_param.device = place.param;
        c.zero.offload_optimizer.device = place.optimizer;
        c.strata.optimizer_state_dtype = state;
        std::vector<std::pair<Schedule, ActivationHome>> orders = {
            {Schedule::micro_batch, ActivationHome::automatic}};
        if (accumulation > 1)
          for (ActivationHome home :
               {ActivationHome::device, ActivationHome::host, ActivationHome::nvme})
            if (home != ActivationHome::nvme || nvme) orders.push_back({Schedule::layer, home});
        for (auto [schedule, home] : orders) {
          c.strata.schedule = schedule;
          c.strata.activation_home = home;
          std::vector<int> slots = {c.zero.offload_param.buffer_count};
          if (place.param == OffloadDevice::nvme) slots = {3, 5, 8};
          for (int fetch : slots) {
            c.zero.offload_param.buffer_count = fetch;
            if (Status s = consider(c); !s) return s;
          }
        }
      }
    }
  }
  // The configuration as given, for the speed-up the first pick promises.
  {
    PlanInput input = plan_input_from_config(base, model, target);
    input.budgets = budgets;
    if (validate_plan_input(input))
      if (Result<TrainingPlan> plan = plan_training(input))
        if (training_plan_report(plan->input, *plan).fits)
          result.given_seconds = predict_step(*plan, hardware).steady_seconds;
  }
  std::stable_sort(result.fastest.begin(), result.fastest.end(),
                   [](const TuneCandidate& a, const TuneCandidate& b) {
                     return a.prediction.steady_seconds < b.prediction.steady_seconds;
                   });
  if (int(result.fastest.size()) > keep) result.fastest.resize(size_t(keep));
  return result;
}

std::string format_tune_result(const TuneResult& r) {
  std::string out =
      fmt::format("tuned: {} configurations tried, {} fit; the fastest by the step-time model:\n",
                  r.tried, r.fitting);
  for (size_t i = 0; i < r.fastest.size(); ++i) {
    const TuneCandidate& c = r.fastest[i];
    out +=
        fmt::format("{}. {:.1f} ms per step, {:.0f} tokens/s, bound by the {} lane and the {}",
                    i + 1, 1e3 * c.prediction.steady_seconds, c.prediction.tokens_per_second,
                    lane_name(c.prediction.bound_lane), resource_name(c.prediction.bound_resource));
    if (r.given_seconds && c.prediction.steady_seconds > 0)
      out +=
          fmt::format(" ({:.2f}x the flags given)", *r.given_seconds / c.prediction.steady_seconds);
    out += fmt::format("\n   strata train {}\n   DeepSpeed config: {}\n", c.flags,
                       train_config_to_json(c.config).dump());
  }
  if (r.fastest.empty())
    out += "  none fits the budgets; strata plan without --tune says what overflows\n";
  return out;
}

nlohmann::ordered_json tune_result_to_json(const TuneResult& r) {
  nlohmann::ordered_json j;
  j["tried"] = r.tried;
  j["fitting"] = r.fitting;
  if (r.given_seconds) j["given_step_seconds"] = *r.given_seconds;
  nlohmann::ordered_json candidates = nlohmann::ordered_json::array();
  for (const TuneCandidate& c : r.fastest) {
    nlohmann::ordered_json one;
    one["flags"] = c.flags;
    one["deepspeed_config"] = train_config_to_json(c.config);
    one["prediction"] = prediction_to_json(c.prediction);
    candidates.push_back(std::move(one));
  }
  j["candidates"] = std::move(candidates);
  return j;
}

}  // namespace strata::tools
