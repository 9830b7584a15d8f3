// AdamW on the GPU, host side: argument checks and the per-step constants,
// rounded from float64 exactly as kernels/cpu/adamw.cpp rounds them (that is
// half of what keeps the two backends bitwise equal; adamw.cu is the other).
#include "kernels/cuda/adamw.h"

#include <cmath>
#include <string>

#include "kernels/cuda/adamw_constants.h"

namespace strata::kernels::cuda {
namespace {

static_assert(detail::kInt8Block == cpu::kAdamWInt8Block,
              "the CUDA int8 moments use the CPU kernel's blocks");

Status check(const AdamWDeviceShard& s, const cpu::AdamWHyperparams& h) {
  if (s.numel < 0) {
    return Status::error("adamw_step (cuda): negative shard length " + std::to_string(s.numel));
  }
  if (s.numel > 0 && (s.master == nullptr || s.exp_avg == nullptr || s.exp_avg_sq == nullptr ||
                      s.grad == nullptr)) {
    return Status::error(
        "adamw_step (cuda): master, exp_avg, exp_avg_sq and grad must all be given");
  }
  if (s.copy != nullptr && s.copy_type == DType::f32) {
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

Status check_scales(const AdamWDeviceStateShard& s) {
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

}  // namespace

Status adamw_step(const AdamWDeviceShard& shard, const cpu::AdamWHyperparams& hyper,
                  cudaStream_t stream) {
  if (Status s = check(shard, hyper); !s) return s;
  if (shard.numel == 0) return Status::ok();
  return detail::adamw_launch(shard.master, shard.exp_avg, shard.exp_avg_sq, shard.grad,
                              shard.grad_type, shard.copy, shard.copy_type, shard.numel,
                              make_constants(hyper), stream);
}

Status adamw_step(const AdamWDeviceStateShard& shard, const cpu::AdamWHyperparams& hyper,
                  cudaStream_t stream) {
  AdamWDeviceShard arrays;  // the checks every format shares
  arrays.numel = shard.numel;
  arrays.master = shard.master;
  arrays.exp_avg = static_cast<float*>(shard.exp_avg);
  arrays.exp_avg_sq = static_cast<float*>(shard.exp_avg_sq);
  arrays.grad = shard.grad;
  arrays.grad_type = shard.grad_type;
  arrays.copy = shard.copy;
  arrays.copy_type = shard.copy_type;
  if (Status s = check_scales(shard); !s) return s;
  if (shard.state_type == cpu::AdamWStateType::f32) return adamw_step(arrays, hyper, stream);
  if (Status s = check(arrays, hyper); !s) return s;
  if (shard.numel == 0) return Status::ok();
  if (shard.state_type == cpu::AdamWStateType::bf16) {
    return detail::adamw_bf16_launch(shard.master, static_cast<uint16_t*>(shard.exp_avg),
                                     static_cast<uint16_t*>(shard.exp_avg_sq), shard.grad,
                                     shard.grad_type, shard.copy, shard.copy_type, shard.numel,
                                     make_constants(hyper), stream);
  }
  return detail::adamw_int8_launch(shard.master, static_cast<int8_t*>(shard.exp_avg),
                                   static_cast<uint8_t*>(shard.exp_avg_sq), shard.exp_avg_scale,
                                   shard.exp_avg_sq_scale, shard.grad, shard.grad_type, shard.copy,
                                   shard.copy_type, shard.numel, make_constants(hyper), stream);
}

}  // namespace strata::kernels::cuda
