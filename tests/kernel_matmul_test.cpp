// matmul_forward / matmul_backward against float64 products.
#include <gtest/gtest.h>

#include "kernels/cpu/matmul.h"
#include "tests/kernel_reference.h"

namespace strata::testing {
namespace {

using kernels::cpu::matmul_backward;
using kernels::cpu::matmul_forward;

TEST(KernelMatmul, ForwardAndBackwardMatchFloat64AndAccumulate) {
  std::mt19937 rng(1);
  const int64_t N = 37, C = 53, OC = 29;
  auto inp = random_floats(N * C, rng), weight = random_floats(OC * C, rng),
       dout = random_floats(N * OC, rng);
  std::vector<double> out_ref(N * OC), dinp_ref(N * C), dweight_ref(OC * C);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < OC; ++o) {
      double sum = 0.0;
      for (int64_t c = 0; c < C; ++c) {
        sum += static_cast<double>(inp[n * C + c]) * weight[o * C + c];
        dinp_ref[n * C + c] += static_cast<double>(dout[n * OC + o]) * weight[o * C + c];
        dweight_ref[o * C + c] += static_cast<double>(dout[n * OC + o]) * inp[n * C + c];
      }
      out_ref[n * OC + o] = sum;
    }
  }
  std::vector<float> out(N * OC);
  matmul_forward(out.data(), inp.data(), weight.data(), N, C, OC);
  EXPECT_LT(relative_error(out, out_ref), kFp32Tolerance);

  // Gradients accumulate: start from non-zero buffers.
  auto dinp0 = random_floats(N * C, rng), dweight0 = random_floats(OC * C, rng);
  auto dinp = dinp0, dweight = dweight0;
  matmul_backward(dinp.data(), dweight.data(), dout.data(), inp.data(), weight.data(), N, C, OC);
  EXPECT_LT(relative_error(dinp, plus(dinp0, dinp_ref)), kFp32Tolerance);
  EXPECT_LT(relative_error(dweight, plus(dweight0, dweight_ref)), kFp32Tolerance);

  // accumulate = true adds the product to what is there.
  auto base = random_floats(N * OC, rng);
  auto acc = base;
  matmul_forward(acc.data(), inp.data(), weight.data(), N, C, OC, /*accumulate=*/true);
  EXPECT_LT(relative_error(acc, plus(base, out_ref)), kFp32Tolerance);
}

}  // namespace
}  // namespace strata::testing
