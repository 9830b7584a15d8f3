#include "core/optimizer/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

namespace strata {
namespace {

Status check_adamw(const AdamWOptions& o) {
  if (!(o.lr >= 0.0))
    return Status::error("optimizer.params.lr must be >= 0, got " + std::to_string(o.lr));
  if (!(o.beta1 >= 0.0 && o.beta1 < 1.0) || !(o.beta2 >= 0.0 && o.beta2 < 1.0)) {
    return Status::error("optimizer.params.betas must both lie in [0, 1), got [" +
                         std::to_string(o.beta1) + ", " + std::to_string(o.beta2) + "]");
  }
  if (!(o.eps >= 0.0))
    return Status::error("optimizer.params.eps must be >= 0, got " + std::to_string(o.eps));
  if (!(o.weight_decay >= 0.0)) {
    return Status::error("optimizer.params.weight_decay must be >= 0, got " +
                         std::to_string(o.weight_decay));
  }
  return Status::ok();
}

}  // namespace

ParamGroup param_group_for_shape(std::span<const int64_t> shape) {
  return shape.size() == 2 ? ParamGroup::decay : ParamGroup::no_decay;
}

Result<Optimizer> Optimizer::create(const OptimizerOptions& options) {
  if (Status status = check_adamw(options.adamw); !status) return status;
  if (!(options.gradient_clipping >= 0.0)) {
    return Status::error("gradient_clipping must be >= 0 (0: off), got " +
                         std::to_string(options.gradient_clipping));
  }
  Result<LrSchedule> schedule = LrSchedule::create(options.lr_schedule, options.adamw.lr);
  if (!schedule) return schedule.status();
  Result<LossScaler> scaler = LossScaler::create(options.loss_scaler);
  if (!scaler) return scaler.status();
  return Optimizer(options, std::move(schedule).value(), std::move(scaler).value());
}

Optimizer::Optimizer(const OptimizerOptions& options, LrSchedule schedule, LossScaler loss_scaler)
    : options_(options), schedule_(std::move(schedule)), loss_scaler_(std::move(loss_scaler)) {
  state_.loss_scaler = loss_scaler_.state();
}

bool Optimizer::needs_grad_norm() const {
  return options_.gradient_clipping > 0.0 || options_.loss_scaler.enabled ||
         options_.skip_nonfinite_steps;
}

Result<StepDecision> Optimizer::begin_step(const std::optional<kernels::cpu::GradNormPartial>& grads) {
  if (needs_grad_norm() && !grads) {
    return Status::error(
        "Optimizer::begin_step: the gradient norm is needed (clipping, fp16 loss scaling or "
        "skip_nonfinite_steps) but none was given");
  }
  StepDecision decision;
  decision.loss_scale = loss_scaler_.scale();
  decision.grad_norm = std::numeric_limits<double>::quiet_NaN();
  if (grads) {
    decision.overflow = grads->nonfinite;
    decision.grad_norm = std::sqrt(grads->sum_squares) / decision.loss_scale;
  }
  // The scaler goes first: if it refuses (overflow at its minimum), nothing has changed.
  if (Status status = loss_scaler_.update(decision.overflow); !status) return status;
  state_.loss_scaler = loss_scaler_.state();

  const bool skip =
      decision.overflow && (options_.loss_scaler.enabled || options_.skip_nonfinite_steps);
  if (skip) {
    ++state_.skipped_steps;
    decision.apply = false;
    return decision;
  }
  decision.apply = true;
  decision.step = ++state_.applied_steps;
  decision.lr = schedule_.lr_at(state_.scheduler_iteration);
  ++state_.scheduler_iteration;  // DeepSpeed steps the scheduler after each applied step
  if (options_.gradient_clipping > 0.0) {
    decision.clip_coef = std::min(1.0, options_.gradient_clipping / (decision.grad_norm + 1e-6));
  }
  decision.grad_scale = decision.clip_coef / decision.loss_scale;
  return decision;
}

kernels::cpu::AdamWHyperparams Optimizer::hyperparams(const StepDecision& decision,
                                                      ParamGroup group) const {
  kernels::cpu::AdamWHyperparams hyper;
  hyper.lr = decision.lr;
  hyper.beta1 = options_.adamw.beta1;
  hyper.beta2 = options_.adamw.beta2;
  hyper.eps = options_.adamw.eps;
  hyper.step = decision.step;
  hyper.decoupled_weight_decay = options_.adamw.adam_w_mode;
  hyper.bias_correction = options_.adamw.bias_correction;
  hyper.grad_scale = decision.grad_scale;
  hyper.weight_decay = options_.adamw.weight_decay;
  return kernels::cpu::group_hyperparams(hyper, group);
}

Status Optimizer::update_shard(const StepDecision& decision, const kernels::cpu::AdamWShard& shard) const {
  if (!decision.apply) return Status::ok();
  // The kernel writes bf16 and fp16 copies in its pass; an fp32 copy is the new master itself.
  const bool copies_master =
      shard.copy != nullptr && shard.copy_type == kernels::cpu::ElementType::f32;
  kernels::cpu::AdamWShard kernel_shard = shard;
  if (copies_master) kernel_shard.copy = nullptr;
  if (Status s = kernels::cpu::adamw_step(kernel_shard, hyperparams(decision)); !s) return s;
  if (copies_master) std::memcpy(shard.copy, shard.master, size_t(shard.numel) * 4);
  return Status::ok();
}

void Optimizer::restore(const OptimizerState& state) {
  state_ = state;
  loss_scaler_.restore(state.loss_scaler);
}

}  // namespace strata
