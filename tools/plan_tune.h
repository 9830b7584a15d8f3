// `strata plan --tune`: the configurations that fit, fastest first, by the
// step-time model (core/plan/step_model.h). For the model, the tokens per
// step, the hardware profile and the budgets it searches micro-batch x
// accumulation at the same tokens per step, the ZeRO stage, where the
// parameters and the optimizer state live, the schedule, the activation home
// and the fetch slots (offload_param.buffer_count); compact optimizer state
// and bf16 gradients only when approximations are allowed. Each candidate is
// made the way a run makes its plan (plan_input_from_config of a changed
// config), checked against the budgets by the planner's report of that
// plan (training_plan_report), and predicted.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/model_config.h"
#include "core/plan/hardware_profile.h"
#include "core/plan/plan_input.h"
#include "core/plan/step_model.h"
#include "io/base/status.h"

namespace strata::tools {

struct TuneCandidate {
  TrainConfig config;  // the DeepSpeed config that runs it (train_config_to_json)
  std::string flags;   // the same as strata train flags
  StepPrediction prediction;
};

struct TuneResult {
  std::vector<TuneCandidate> fastest;  // at most `keep`, fastest first
  int tried = 0, fitting = 0;
  std::optional<double> given_seconds;  // the configuration as given, when it fits
};

// `base` is the run's config (its tokens per step are kept); `budgets` and
// `target` as strata plan found them.
Result<TuneResult> tune_plan(const TrainConfig& base, const ModelConfig& model, PlanTarget target,
                             const PlanBudgets& budgets, const HardwareProfile& hardware,
                             bool allow_approximate, int keep = 5);

std::string format_tune_result(const TuneResult& result);
// The same as JSON (`strata plan --tune --json`): tried, fitting,
// given_step_seconds (when the configuration as given fits) and the
// candidates, fastest first, each with its flags, DeepSpeed config and
// prediction (prediction_to_json).
nlohmann::ordered_json tune_result_to_json(const TuneResult& result);

}  // namespace strata::tools
