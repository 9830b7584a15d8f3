// bias_forward / bias_backward against float64 loops: the bias added to every
// row, its gradient the column sums, accumulating (+=) into what is there.
#include <gtest/gtest.h>

#include "kernels/cpu/bias.h"
#include "tests/kernel_reference.h"

namespace strata::testing {
namespace {

using namespace kernels::cpu;

TEST(KernelBias, AddsToEveryRowAndSumsColumnsForItsGradient) {
  std::mt19937 rng(11);
  const int64_t N = 37, OC = 301;  // more columns than one parallel block, odd rows
  const auto x = random_floats(N * OC, rng), bias = random_floats(OC, rng);
  std::vector<float> out = x;
  bias_forward(out.data(), bias.data(), N, OC);
  std::vector<double> out_ref(N * OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < OC; ++c) out_ref[n * OC + c] = double(x[n * OC + c]) + bias[c];
  EXPECT_LT(relative_error(out, out_ref), kFp32Tolerance);

  const auto dout = random_floats(N * OC, rng), before = random_floats(OC, rng);
  std::vector<float> dbias = before;
  bias_backward(dbias.data(), dout.data(), N, OC);
  std::vector<double> dbias_ref(OC);
  for (int64_t c = 0; c < OC; ++c) {
    double sum = before[c];
    for (int64_t n = 0; n < N; ++n) sum += dout[n * OC + c];
    dbias_ref[c] = sum;
  }
  EXPECT_LT(relative_error(dbias, dbias_ref), kFp32Tolerance);
}

}  // namespace
}  // namespace strata::testing
