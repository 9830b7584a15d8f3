// AdamW on the GPU, host side: argument checks and the per-step constants,
// rounded from float64 exactly as kernels/cpu/adamw.cpp rounds them (that is
// half of what keeps the two backends bitwise equal; adamw.cu is the other).
#include "kernels/cuda/adamw.h"

#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "kernels/cuda/adamw_constants.h"

namespace strata::kernels::cuda {
namespace {

static_assert(detail::kInt8Block == cpu::kAdamWInt8Block,
              "the CUDA int8 moments use the CPU kernel's blocks");

// The element types of the CPU kernel's description, as the launchers take them.
DType dtype_of(cpu::ElementType type) {
  switch (type) {
    case cpu::ElementType::f32:
      return DType::f32;
    case cpu::ElementType::bf16:
      return DType::bf16;
    case cpu::ElementType::f16:
      return DType::f16;
  }
  return DType::f32;
}

Status check(const cpu::AdamWShard& s, const cpu::AdamWHyperparams& h) {
  if (s.numel < 0) {
    return Status::error("adamw_step (cuda): negative shard length " + std::to_string(s.numel));
  }
  if (s.numel > 0 && (s.master == nullptr || s.exp_avg == nullptr || s.exp_avg_sq == nullptr ||
                      s.grad == nullptr)) {
    return Status::error(
        "adamw_step (cuda): master, exp_avg, exp_avg_sq and grad must all be given");
  }
  if (s.copy != nullptr && s.copy_type == cpu::ElementType::f32) {
    return Status::error(
        "adamw_step (cuda): the compute copy must be bf16 or fp16 (fp32 mode has no copy)");
  }
  if (h.step < 1) {
    return Status::error("adamw_step (cuda): step must be >= 1, got " + std::to_string(h.step));
  }
  if (!(h.lr >= 0.0) || !(h.eps >= 0.0) || !(h.weight_decay >= 0.0) ||
      !(h.beta1 >= 0.0 && h.beta1 < 1.0) || !(h.beta2 >= 0.0 && h.beta2 < 1.0)) {
    return Status::error(
        "adamw_step (cuda): hyperparameters out of range (lr, eps, weight_decay >= 0; betas in "
        "[0, 1))");
  }
  return Status::ok();
}

detail::AdamWConstants make_constants(const cpu::AdamWHyperparams& h) {
  const double t = static_cast<double>(h.step);
  const double bias_correction1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bias_correction2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  detail::AdamWConstants c{};
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.decoupled = h.decoupled_weight_decay;
  c.decay = h.decoupled_weight_decay ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.l2 = h.decoupled_weight_decay ? 0.0f : static_cast<float>(h.weight_decay);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.neg_step_size = -static_cast<float>(h.lr / bias_correction1);
  c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  c.eps = static_cast<float>(h.eps);
  return c;
}

Status check_scales(const cpu::AdamWShard& s) {
  const bool int8 = s.state_type == cpu::AdamWStateType::int8;
  if (int8 && s.numel > 0 && (s.exp_avg_scale == nullptr || s.exp_avg_sq_scale == nullptr)) {
    return Status::error("adamw_step (cuda): int8 moments need exp_avg_scale and exp_avg_sq_scale");
  }
  if (!int8 && (s.exp_avg_scale != nullptr || s.exp_avg_sq_scale != nullptr)) {
    return Status::error("adamw_step (cuda): only int8 moments have scales; " +
                         std::string(cpu::adamw_state_type_name(s.state_type)) +
                         " moments were given some");
  }
  return Status::ok();
}

// One run (a shard of one group), checked by adamw_step.
Status launch_run(const cpu::AdamWShard& run, const detail::AdamWConstants& constants,
                  cudaStream_t stream) {
  const DType grad_type = dtype_of(run.grad_type), copy_type = dtype_of(run.copy_type);
  switch (run.state_type) {
    case cpu::AdamWStateType::f32:
      return detail::adamw_launch(run.master, static_cast<float*>(run.exp_avg),
                                  static_cast<float*>(run.exp_avg_sq), run.grad, grad_type,
                                  run.copy, copy_type, run.numel, constants, stream);
    case cpu::AdamWStateType::bf16:
      return detail::adamw_bf16_launch(run.master, static_cast<uint16_t*>(run.exp_avg),
                                       static_cast<uint16_t*>(run.exp_avg_sq), run.grad, grad_type,
                                       run.copy, copy_type, run.numel, constants, stream);
    case cpu::AdamWStateType::int8:
      break;
  }
  return detail::adamw_int8_launch(run.master, static_cast<int8_t*>(run.exp_avg),
                                   static_cast<uint8_t*>(run.exp_avg_sq), run.exp_avg_scale,
                                   run.exp_avg_sq_scale, run.grad, grad_type, run.copy, copy_type,
                                   run.numel, constants, stream);
}

}  // namespace

Status adamw_step(const cpu::AdamWShard& shard, const cpu::AdamWHyperparams& hyper,
                  cudaStream_t stream) {
  if (Status s = check_scales(shard); !s) return s;
  if (Status s = check(shard, hyper); !s) return s;
  Result<std::vector<cpu::CompactRun>> runs =
      cpu::compact_runs(shard.segments, shard.numel, shard.state_type);
  if (!runs) return runs.status();
  for (const cpu::CompactRun& run : *runs) {
    const detail::AdamWConstants constants =
        make_constants(cpu::group_hyperparams(hyper, run.group));
    if (Status s = launch_run(cpu::run_of(shard, run), constants, stream); !s) return s;
  }
  return Status::ok();
}

}  // namespace strata::kernels::cuda
