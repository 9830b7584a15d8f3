// AdamW on the GPU, device side: one thread per element, the operations of
// kernels/cpu/adamw.cpp's update_element written as explicit
// round-to-nearest intrinsics (__fmul_rn, __fmaf_rn, ...), which nvcc never
// contracts or reorders, so the result is bitwise the CPU kernel's.
#include <type_traits>

#include "kernels/cuda/adamw_constants.h"
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

struct NoCopy {};

template <typename G, typename C>
__global__ void adamw_kernel(float* master,      // (numel)
                             float* exp_avg,     // (numel)
                             float* exp_avg_sq,  // (numel)
                             const G* grad,      // (numel)
                             C* copy,            // (numel), unused for NoCopy
                             AdamWConstants c, int64_t numel) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= numel) return;
  float g = __fmul_rn(to_float(grad[i]), c.grad_scale);
  float p = master[i];
  if (c.decoupled) {
    p = __fmul_rn(p, c.decay);
  } else {
    g = __fmaf_rn(c.l2, p, g);
  }
  const float m = __fmaf_rn(c.one_minus_beta1, g, __fmul_rn(exp_avg[i], c.beta1));
  const float v = __fmaf_rn(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(exp_avg_sq[i], c.beta2));
  const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_bias_correction2_sqrt, c.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step_size, m), denom));
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
  master[i] = p;
  if constexpr (!std::is_same_v<C, NoCopy>) copy[i] = from_float<C>(p);
}

}  // namespace

namespace detail {

Status adamw_launch(float* master, float* exp_avg, float* exp_avg_sq, const void* grad_data,
                    DType grad_type, void* copy, DType copy_type, int64_t numel,
                    const AdamWConstants& constants, cudaStream_t stream) {
  const std::string shape = shape_text({{"numel", numel}});
  const unsigned blocks = blocks_for(numel, kThreads);
  return dispatch_type(grad_type, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    const G* grad = static_cast<const G*>(grad_data);
    if (copy == nullptr) {
      adamw_kernel<G, NoCopy><<<blocks, kThreads, 0, stream>>>(master, exp_avg, exp_avg_sq, grad,
                                                               nullptr, constants, numel);
    } else if (copy_type == DType::bf16) {
      adamw_kernel<G, bf16><<<blocks, kThreads, 0, stream>>>(
          master, exp_avg, exp_avg_sq, grad, static_cast<bf16*>(copy), constants, numel);
    } else {
      adamw_kernel<G, f16><<<blocks, kThreads, 0, stream>>>(
          master, exp_avg, exp_avg_sq, grad, static_cast<f16*>(copy), constants, numel);
    }
    return check_launch("adamw_step", grad_type, shape);
  });
}

}  // namespace detail
}  // namespace strata::kernels::cuda
