// The optimizer driver: AdamW over sharded fp32 state, with parameter groups,
// the step counter, the learning-rate schedule, fp16 loss scaling and
// clipping by global gradient norm. The per-element work is the CPU kernel
// in kernels/cpu/adamw.h, on shards described as kernels/cpu/adamw_shard.h's
// AdamWShard; this class decides what each step does.
//
// One training step, as the engine drives it (core/plan/training_plan.h orders it):
//   1. backward with the loss multiplied by loss_scale();
//   2. when needs_grad_norm(): sum kernels::cpu::grad_norm_squared() over every
//      gradient shard, in a fixed order (unit order), into one GradNormPartial;
//   3. plan = begin_step(summary): decides whether the step is applied (an
//      fp16 overflow skips it), the learning rate, the clipping coefficient
//      and the gradient multiplier; it advances the step counter, the
//      schedule and the loss scaler, so every later call sees the new state;
//   4. update_shard(plan, shard) for every shard, in any order, from any
//      thread (shards must not overlap); a skipped plan leaves them untouched.
//
// Numbers: AdamW as torch.optim.AdamW; clipping as torch.nn.utils.clip_grad_norm_
// (coef = min(1, max_norm / (norm + 1e-6)) on the unscaled norm); the
// gradients are unscaled and clipped inside the AdamW pass (one multiply by
// clip_coef / loss_scale). Weight decay only on 2-D tensors (group `decay`);
// 1-D tensors (norm weights) get none (group `no_decay`).
//
// Not thread-safe to call begin_step() concurrently with anything;
// update_shard() is const and may run concurrently with itself.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "core/optimizer/loss_scaler.h"
#include "core/optimizer/lr_schedule.h"
#include "io/base/status.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/adamw_shard.h"
#include "kernels/cpu/grad_norm.h"

namespace strata {

// DeepSpeed's "optimizer": {"type": "AdamW" | "Adam", "params": {...}}, with the
// defaults of DeepSpeed's CPU Adam. Type "AdamW" means adam_w_mode = true; type
// "Adam" is also decoupled AdamW unless params.adam_w_mode is false.
struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;    // params.betas[0]
  double beta2 = 0.999;  // params.betas[1]
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;  // false: Adam with L2 weight decay added to the gradient
  bool bias_correction = true;
};

struct OptimizerOptions {
  AdamWOptions adamw;
  LrScheduleOptions lr_schedule;   // "scheduler"; type constant when absent
  LossScalerOptions loss_scaler;   // "fp16"; disabled for bf16 and fp32 training
  double gradient_clipping = 0.0;  // top-level "gradient_clipping"; 0: no clipping
  // Without an fp16 loss scaler: skip a step whose gradients hold inf/NaN
  // instead of writing NaN into every weight. DeepSpeed's bf16.check_grad_overflow
  // (default true); DeepSpeed does not check in fp32 training. When false, with
  // no clipping and no fp16, needs_grad_norm() is false and a unit's update may
  // start as soon as its gradients are final (core/plan/training_plan.h).
  bool skip_nonfinite_steps = true;
};

// A shard's parameter groups and the kernels' runs are the kernels' own
// (kernels/cpu/adamw_shard.h); core names them here.
using kernels::cpu::compact_runs;
using kernels::cpu::CompactRun;
using kernels::cpu::int8_block_count;
using kernels::cpu::ParamGroup;
using kernels::cpu::ShardSegment;

// The Hugging Face Trainer's grouping: weight decay on 2-D tensors only.
// `shape`: the tensor's shape, e.g. {out, in} for a projection, {hidden} for a norm.
ParamGroup param_group_for_shape(std::span<const int64_t> shape);

// What begin_step() decided for one step.
struct StepDecision {
  bool apply = false;     // false: the step is skipped and shards stay as they are
  bool overflow = false;  // the gradients held inf/NaN
  int64_t step = 0;       // Adam's t of this update (1 for the first applied step); 0 if skipped
  double lr = 0.0;        // learning rate of this update
  double grad_norm =
      0.0;  // global L2 norm of the unscaled gradients, before clipping (NaN if unknown)
  double clip_coef = 1.0;   // min(1, gradient_clipping / (grad_norm + 1e-6)), 1 without clipping
  double loss_scale = 1.0;  // the scale the gradients of this step carry
  double grad_scale = 1.0;  // clip_coef / loss_scale: what the AdamW pass multiplies gradients by
};

// What a checkpoint keeps to resume the driver exactly.
struct OptimizerState {
  int64_t applied_steps = 0;  // Adam's t of the last applied step
  int64_t skipped_steps = 0;
  int64_t scheduler_iteration = -1;  // DeepSpeed's last_batch_iteration
  LossScalerState loss_scaler;
};

class Optimizer {
 public:
  // Fails with a message naming the config key on invalid options.
  static Result<Optimizer> create(const OptimizerOptions& options);

  // True when begin_step() needs the global gradient summary: clipping is on,
  // the loss is scaled (fp16), or non-finite steps are to be skipped.
  bool needs_grad_norm() const;

  // Multiply the loss by this before backward.
  double loss_scale() const { return loss_scaler_.scale(); }

  // The learning rate the next applied step will use.
  double next_lr() const { return schedule_.lr_at(state_.scheduler_iteration); }

  // Step 3 of the contract. `grads`: the sum over all shards of the (scaled)
  // gradients' squares; may be absent only when !needs_grad_norm(). Fails when
  // it is missing, or when an fp16 overflow happens at the minimum loss scale
  // (the run cannot go on); the state is then unchanged.
  Result<StepDecision> begin_step(const std::optional<kernels::cpu::GradNormPartial>& grads);

  // Step 4: one shard's AdamW update for `plan` (nothing when !decision.apply),
  // by the CPU kernel, each parameter group of shard.segments with its own
  // weight decay. An fp32 copy is the new master, copied there after the
  // kernel. Fails (touching nothing) on what the kernel refuses.
  Status update_shard(const StepDecision& decision, const kernels::cpu::AdamWShard& shard) const;

  // The AdamW hyperparameters of `plan` for parameter group `group`. For a
  // whole shard (the kernels take each group's weight decay from these by
  // group_hyperparams) the group is `decay`, as update_shard passes them and
  // a GPU update of device-resident state does.
  kernels::cpu::AdamWHyperparams hyperparams(const StepDecision& decision,
                                             ParamGroup group = ParamGroup::decay) const;

  const OptimizerState& state() const { return state_; }
  void restore(const OptimizerState& state);
  const OptimizerOptions& options() const { return options_; }

 private:
  Optimizer(const OptimizerOptions& options, LrSchedule schedule, LossScaler loss_scaler);

  OptimizerOptions options_;
  LrSchedule schedule_;
  LossScaler loss_scaler_;
  OptimizerState state_;
};

}  // namespace strata
