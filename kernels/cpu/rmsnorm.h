// RMSNorm of the CPU backend, as Hugging Face's LlamaRMSNorm in fp32:
// out = weight * (x * rsqrt(mean(x^2) + eps)), one row of C at a time.
//
// rmsnorm_forward overwrites `out` and `rstd`; rmsnorm_backward adds into
// `dinp` and `dweight` (+=). `rstd` saved by the forward is what the backward
// reads. TBB-parallel over rows (and over columns for dweight), deterministic
// for any thread count.
#pragma once

#include <cstdint>

namespace strata::kernels::cpu {

void rmsnorm_forward(float* out,           // (N, C)
                     float* rstd,          // (N): 1 / sqrt(mean(x^2) + eps)
                     const float* inp,     // (N, C)
                     const float* weight,  // (C)
                     int64_t N, int64_t C, float eps);

void rmsnorm_backward(float* dinp,          // (N, C), +=
                      float* dweight,       // (C), +=
                      const float* dout,    // (N, C)
                      const float* inp,     // (N, C)
                      const float* weight,  // (C)
                      const float* rstd,    // (N), from rmsnorm_forward
                      int64_t N, int64_t C);

}  // namespace strata::kernels::cpu
