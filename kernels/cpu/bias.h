// The bias of a linear layer, CPU backend (fp32): Hugging Face's nn.Linear
// with bias=True is matmul_forward (kernels/cpu/matmul.h) followed by
// bias_forward.
//
// bias_forward adds the bias to every row of `out` in place; bias_backward
// adds the column sums of `dout` into `dbias` (+=, so micro-batches
// accumulate). TBB-parallel over columns with rows summed in order: the same
// bits for any thread count.
#pragma once

#include <cstdint>

namespace strata::kernels::cpu {

void bias_forward(float* out,         // (N, OC), +=  bias in every row
                  const float* bias,  // (OC)
                  int64_t N, int64_t OC);

void bias_backward(float* dbias,       // (OC), += sum over rows of dout
                   const float* dout,  // (N, OC)
                   int64_t N, int64_t OC);

}  // namespace strata::kernels::cpu
