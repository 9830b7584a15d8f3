#include "kernels/cpu/matmul.h"

#include "kernels/cpu/gemm.h"

namespace strata::kernels::cpu {

void matmul_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C,
                    int64_t OC, bool accumulate) {
  // out (N, OC) = inp (N, C) @ weight^T (C, OC)
  sgemm(false, true, N, OC, C, 1.0f, inp, C, weight, C, accumulate ? 1.0f : 0.0f, out, OC);
}

void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC) {
  if (dinp != nullptr) {
    // dinp (N, C) += dout (N, OC) @ weight (OC, C)
    sgemm(false, false, N, C, OC, 1.0f, dout, OC, weight, C, 1.0f, dinp, C);
  }
  if (dweight != nullptr) {
    // dweight (OC, C) += dout^T (OC, N) @ inp (N, C)
    sgemm(true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
  }
}

}  // namespace strata::kernels::cpu
