// rmsnorm_forward / rmsnorm_backward against a float64 RMSNorm and its numeric gradient.
#include <gtest/gtest.h>

#include "kernels/cpu/rmsnorm.h"
#include "tests/kernel_reference.h"

namespace strata::testing {
namespace {

using namespace kernels::cpu;

std::vector<double> rmsnorm_ref(const std::vector<double>& x, const std::vector<double>& w,
                                int64_t N, int64_t C, double eps) {
  std::vector<double> y(N * C);
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0.0;
    for (int64_t c = 0; c < C; ++c) ms += x[n * C + c] * x[n * C + c];
    const double r = 1.0 / std::sqrt(ms / C + eps);
    for (int64_t c = 0; c < C; ++c) y[n * C + c] = w[c] * x[n * C + c] * r;
  }
  return y;
}

TEST(KernelRmsnorm, MatchesFloat64AndItsGradient) {
  std::mt19937 rng(2);
  const int64_t N = 11, C = 67;
  const double eps = 1e-5;
  auto x = random_floats(N * C, rng), w = random_floats(C, rng), dy = random_floats(N * C, rng);
  for (float& v : w) v += 1.0f;
  std::vector<float> y(N * C), rstd(N);
  rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, static_cast<float>(eps));
  EXPECT_LT(relative_error(y, rmsnorm_ref(to_double(x), to_double(w), N, C, eps)), kFp32Tolerance);

  const auto dx_ref =
      numeric_vjp([&](const auto& xs) { return rmsnorm_ref(xs, to_double(w), N, C, eps); },
                  to_double(x), to_double(dy));
  const auto dw_ref =
      numeric_vjp([&](const auto& ws) { return rmsnorm_ref(to_double(x), ws, N, C, eps); },
                  to_double(w), to_double(dy));
  auto dx0 = random_floats(N * C, rng), dw0 = random_floats(C, rng);
  auto dx = dx0, dw = dw0;
  rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  EXPECT_LT(relative_error(dx, plus(dx0, dx_ref)), kFp32Tolerance);
  EXPECT_LT(relative_error(dw, plus(dw0, dw_ref)), kFp32Tolerance);
}

}  // namespace
}  // namespace strata::testing
