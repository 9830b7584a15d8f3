// Internal to kernels/cuda: the per-step constants of AdamW (rounded once to
// fp32 from float64 by adamw.cpp, as kernels/cpu/adamw.cpp rounds them) and
// the launcher in adamw.cu that applies them. Kept free of TBB and of CUDA
// device headers so that both compilers read it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "io/base/status.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda::detail {

// Elements per int8 block of the moments (kernels/cpu/adamw.h kAdamWInt8Block;
// adamw.cpp checks that they agree).
inline constexpr int kInt8Block = 256;

struct AdamWConstants {
  float grad_scale;
  float decay;  // 1 - lr * wd (AdamW), 1 (Adam)
  float l2;     // wd (Adam), 0 (AdamW)
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_step_size;              // -lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^t)
  float eps;
  bool decoupled;
};

// fp32 moments: the arrays of one run of a cpu::AdamWShard (kernels/cuda/adamw.h),
// checked by adamw_step.
Status adamw_launch(float* master, float* exp_avg, float* exp_avg_sq,  // (numel) each
                    const void* grad, DType grad_type,                 // (numel)
                    void* copy, DType copy_type,                       // (numel) or null
                    int64_t numel, const AdamWConstants& constants, cudaStream_t stream);

// bf16 moments (bits, rounded to nearest even as kernels/cpu/simd.h's
// float_to_bf16), checked by adamw_step.
Status adamw_bf16_launch(float* master, uint16_t* exp_avg, uint16_t* exp_avg_sq,  // (numel) each
                         const void* grad, DType grad_type,                       // (numel)
                         void* copy, DType copy_type,                             // (numel) or null
                         int64_t numel, const AdamWConstants& constants, cudaStream_t stream);

// int8 moments: codes (numel) each, scales (ceil(numel / 256)) each.
Status adamw_int8_launch(float* master, int8_t* exp_avg, uint8_t* exp_avg_sq, float* exp_avg_scale,
                         float* exp_avg_sq_scale,            //
                         const void* grad, DType grad_type,  // (numel)
                         void* copy, DType copy_type,        // (numel) or null
                         int64_t numel, const AdamWConstants& constants, cudaStream_t stream);

}  // namespace strata::kernels::cuda::detail
