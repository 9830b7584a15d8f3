#include "core/optimizer/optimizer.h"

#include <algorithm>
#include <cmath>
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

const void* offset_bytes(const void* base, int64_t elements, kernels::cpu::ElementType type) {
  return static_cast<const char*>(base) +
         elements * static_cast<int64_t>(kernels::cpu::element_size(type));
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

Result<StepPlan> Optimizer::begin_step(const std::optional<kernels::cpu::GradNormPartial>& grads) {
  if (needs_grad_norm() && !grads) {
    return Status::error(
        "Optimizer::begin_step: the gradient norm is needed (clipping, fp16 loss scaling or "
        "skip_nonfinite_steps) but none was given");
  }
  StepPlan plan;
  plan.loss_scale = loss_scaler_.scale();
  plan.grad_norm = std::numeric_limits<double>::quiet_NaN();
  if (grads) {
    plan.overflow = grads->nonfinite;
    plan.grad_norm = std::sqrt(grads->sum_squares) / plan.loss_scale;
  }
  // The scaler goes first: if it refuses (overflow at its minimum), nothing has changed.
  if (Status status = loss_scaler_.update(plan.overflow); !status) return status;
  state_.loss_scaler = loss_scaler_.state();

  const bool skip =
      plan.overflow && (options_.loss_scaler.enabled || options_.skip_nonfinite_steps);
  if (skip) {
    ++state_.skipped_steps;
    plan.apply = false;
    return plan;
  }
  plan.apply = true;
  plan.step = ++state_.applied_steps;
  plan.lr = schedule_.lr_at(state_.scheduler_iteration);
  ++state_.scheduler_iteration;  // DeepSpeed steps the scheduler after each applied step
  if (options_.gradient_clipping > 0.0) {
    plan.clip_coef = std::min(1.0, options_.gradient_clipping / (plan.grad_norm + 1e-6));
  }
  plan.grad_scale = plan.clip_coef / plan.loss_scale;
  return plan;
}

kernels::cpu::AdamWHyperparams Optimizer::hyperparams(const StepPlan& plan,
                                                      ParamGroup group) const {
  kernels::cpu::AdamWHyperparams hyper;
  hyper.lr = plan.lr;
  hyper.beta1 = options_.adamw.beta1;
  hyper.beta2 = options_.adamw.beta2;
  hyper.eps = options_.adamw.eps;
  hyper.step = plan.step;
  hyper.decoupled_weight_decay = options_.adamw.adam_w_mode;
  hyper.bias_correction = options_.adamw.bias_correction;
  hyper.grad_scale = plan.grad_scale;
  hyper.weight_decay = group == ParamGroup::decay ? options_.adamw.weight_decay : 0.0;
  return hyper;
}

namespace {

Status check_segments(std::span<const ShardSegment> segments, int64_t numel) {
  int64_t expected_begin = 0;
  for (const ShardSegment& segment : segments) {
    if (segment.begin != expected_begin || segment.end < segment.begin) {
      return Status::error(
          "Optimizer::update_shard: segments must be ordered and contiguous; got [" +
          std::to_string(segment.begin) + ", " + std::to_string(segment.end) + ") where " +
          std::to_string(expected_begin) + " was expected");
    }
    expected_begin = segment.end;
  }
  if (expected_begin != numel) {
    return Status::error("Optimizer::update_shard: segments cover " +
                         std::to_string(expected_begin) + " elements of a shard of " +
                         std::to_string(numel));
  }
  return Status::ok();
}

// The runs of a compact shard each kernel call covers, in order: per segment,
// an int8 segment starting inside a window first takes the rest of that window
// (one block), then the windows from the next multiple of 256 on. `visit`
// gets the run's range, group and first block.
template <typename Visit>
Status for_each_run(const CompactOptimizerShard& shard, Visit visit) {
  const kernels::cpu::AdamWStateShard& whole = shard.arrays;
  const ShardSegment all{0, whole.numel, ParamGroup::decay};
  const std::span<const ShardSegment> segments =
      shard.segments.empty() ? std::span<const ShardSegment>(&all, 1) : shard.segments;
  if (Status s = check_segments(segments, whole.numel); !s) return s;
  const bool int8 = whole.state_type == kernels::cpu::AdamWStateType::int8;
  const int64_t B = kernels::cpu::kAdamWInt8Block;
  int64_t block = 0;
  for (const ShardSegment& segment : segments) {
    int64_t at = segment.begin;
    while (at < segment.end) {
      const int64_t stop =
          int8 && at % B != 0 ? std::min(segment.end, (at / B + 1) * B) : segment.end;
      if (Status s = visit(at, stop, segment.group, block); !s) return s;
      block += kernels::cpu::adamw_state_scale_count(whole.state_type, stop - at);
      at = stop;
    }
  }
  return Status::ok();
}

// Run [begin, end) of `whole` as a shard of its own, its scales from `block`.
kernels::cpu::AdamWStateShard run_of(const kernels::cpu::AdamWStateShard& whole, int64_t begin,
                                     int64_t end, int64_t block) {
  const int64_t moment = whole.state_type == kernels::cpu::AdamWStateType::f32    ? 4
                         : whole.state_type == kernels::cpu::AdamWStateType::bf16 ? 2
                                                                                  : 1;
  kernels::cpu::AdamWStateShard part = whole;
  part.numel = end - begin;
  part.master = whole.master != nullptr ? whole.master + begin : nullptr;
  part.exp_avg = static_cast<char*>(whole.exp_avg) + begin * moment;
  part.exp_avg_sq = static_cast<char*>(whole.exp_avg_sq) + begin * moment;
  if (whole.exp_avg_scale != nullptr) {
    part.exp_avg_scale = whole.exp_avg_scale + block;
    part.exp_avg_sq_scale = whole.exp_avg_sq_scale + block;
  }
  if (whole.grad != nullptr) part.grad = offset_bytes(whole.grad, begin, whole.grad_type);
  if (whole.copy != nullptr)
    part.copy = const_cast<void*>(offset_bytes(whole.copy, begin, whole.copy_type));
  return part;
}

}  // namespace

int64_t int8_block_count(std::span<const ShardSegment> segments, int64_t numel) {
  const int64_t B = kernels::cpu::kAdamWInt8Block;
  if (segments.empty()) return (numel + B - 1) / B;
  int64_t blocks = 0;
  for (const ShardSegment& segment : segments)
    if (segment.end > segment.begin) blocks += (segment.end + B - 1) / B - segment.begin / B;
  return blocks;
}

Result<std::vector<CompactRun>> compact_runs(std::span<const ShardSegment> segments, int64_t numel,
                                             kernels::cpu::AdamWStateType type) {
  CompactOptimizerShard shard;
  shard.arrays.numel = numel;
  shard.arrays.state_type = type;
  shard.segments = segments;
  std::vector<CompactRun> runs;
  if (Status s = for_each_run(shard,
                              [&](int64_t begin, int64_t end, ParamGroup group, int64_t block) {
                                runs.push_back({begin, end, group, block});
                                return Status::ok();
                              });
      !s)
    return s;
  return runs;
}

Status Optimizer::update_shard(const StepPlan& plan, const CompactOptimizerShard& shard) const {
  if (!plan.apply) return Status::ok();
  return for_each_run(shard, [&](int64_t begin, int64_t end, ParamGroup group, int64_t block) {
    return kernels::cpu::adamw_step(run_of(shard.arrays, begin, end, block),
                                    hyperparams(plan, group));
  });
}

Status Optimizer::zero_state(const CompactOptimizerShard& shard) {
  return for_each_run(shard, [&](int64_t begin, int64_t end, ParamGroup, int64_t block) {
    kernels::cpu::first_touch_zero(run_of(shard.arrays, begin, end, block));
    return Status::ok();
  });
}

Status Optimizer::update_shard(const StepPlan& plan, const OptimizerShard& shard) const {
  if (!plan.apply) return Status::ok();
  const kernels::cpu::AdamWShard& whole = shard.arrays;
  const ShardSegment all{0, whole.numel, ParamGroup::decay};
  const std::span<const ShardSegment> segments =
      shard.segments.empty() ? std::span<const ShardSegment>(&all, 1) : shard.segments;
  if (Status s = check_segments(segments, whole.numel); !s) return s;

  for (const ShardSegment& segment : segments) {
    if (segment.begin == segment.end) continue;
    kernels::cpu::AdamWShard part = whole;
    part.numel = segment.end - segment.begin;
    part.master = whole.master + segment.begin;
    part.exp_avg = whole.exp_avg + segment.begin;
    part.exp_avg_sq = whole.exp_avg_sq + segment.begin;
    part.grad = offset_bytes(whole.grad, segment.begin, whole.grad_type);
    if (whole.copy != nullptr) {
      part.copy = const_cast<void*>(offset_bytes(whole.copy, segment.begin, whole.copy_type));
    }
    if (Status status = kernels::cpu::adamw_step(part, hyperparams(plan, segment.group)); !status)
      return status;
  }
  return Status::ok();
}

void Optimizer::restore(const OptimizerState& state) {
  state_ = state;
  loss_scaler_.restore(state.loss_scaler);
}

}  // namespace strata
