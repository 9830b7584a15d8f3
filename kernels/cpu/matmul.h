// Matrix products of the CPU backend (fp32, row-major, through sgemm: gemm.h).
//
// A linear layer is Hugging Face's bias-free nn.Linear: `weight` is [out, in]
// and out = inp @ weight^T. matmul_forward overwrites `out` (or adds into it
// when `accumulate`); matmul_backward adds into `dinp` and `dweight` (+=), so
// parameter gradients accumulate over micro-batches and an input read by
// several products (the residual stream, q/k/v) collects all of them.
//
// sgemm parallelises inside each call as TBB tasks (gemm.h), so these may be
// called from several threads and from inside TBB tasks; a product's bits
// depend on its shape and the configured thread count, not on what runs
// beside it.
#pragma once

#include <cstdint>

namespace strata::kernels::cpu {

void matmul_forward(float* out,           // (N, OC)
                    const float* inp,     // (N, C)
                    const float* weight,  // (OC, C)
                    int64_t N, int64_t C, int64_t OC, bool accumulate = false);

void matmul_backward(float* dinp,          // (N, C), +=; null to skip
                     float* dweight,       // (OC, C), +=; null to skip
                     const float* dout,    // (N, OC)
                     const float* inp,     // (N, C)
                     const float* weight,  // (OC, C)
                     int64_t N, int64_t C, int64_t OC);

}  // namespace strata::kernels::cpu
