// swiglu_forward / swiglu_backward against float64 silu(gate) * up and its numeric gradient.
#include <gtest/gtest.h>

#include "kernels/cpu/swiglu.h"
#include "tests/kernel_reference.h"

namespace strata::testing {
namespace {

using namespace kernels::cpu;

std::vector<double> swiglu_ref(const std::vector<double>& gu, int64_t N, int64_t I) {
  std::vector<double> y(N * I);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < I; ++i) {
      const double g = gu[n * 2 * I + i], u = gu[n * 2 * I + I + i];
      y[n * I + i] = g / (1.0 + std::exp(-g)) * u;
    }
  }
  return y;
}

TEST(KernelSwiglu, MatchesFloat64AndItsGradient) {
  std::mt19937 rng(3);
  const int64_t N = 9, I = 31;
  auto gu = random_floats(N * 2 * I, rng, 2.0f), dy = random_floats(N * I, rng);
  std::vector<float> y(N * I), dgu(N * 2 * I);
  swiglu_forward(y.data(), gu.data(), N, I);
  EXPECT_LT(relative_error(y, swiglu_ref(to_double(gu), N, I)), kFp32Tolerance);
  swiglu_backward(dgu.data(), dy.data(), gu.data(), N, I);
  const auto dgu_ref =
      numeric_vjp([&](const auto& v) { return swiglu_ref(v, N, I); }, to_double(gu), to_double(dy));
  EXPECT_LT(relative_error(dgu, dgu_ref), kFp32Tolerance);
}

}  // namespace
}  // namespace strata::testing
