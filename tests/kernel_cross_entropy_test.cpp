// cross_entropy_forward / cross_entropy_backward against float64 log-softmax and its
// numeric gradient; ignored targets; the backward written over the logits.
#include <gtest/gtest.h>

#include "kernels/cpu/cross_entropy.h"
#include "tests/kernel_reference.h"

namespace strata::testing {
namespace {

using namespace kernels::cpu;

std::vector<double> losses_ref(const std::vector<double>& x, const std::vector<int32_t>& t,
                               int64_t N, int64_t V) {
  std::vector<double> loss(N, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (t[n] < 0) continue;
    double m = x[n * V];
    for (int64_t j = 1; j < V; ++j) m = std::max(m, x[n * V + j]);
    double sum = 0.0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(x[n * V + j] - m);
    loss[n] = std::log(sum) + m - x[n * V + t[n]];
  }
  return loss;
}

TEST(KernelCrossEntropy, MatchesFloat64IgnoresNegativeTargetsAndWorksInPlace) {
  std::mt19937 rng(5);
  const int64_t N = 7, V = 101;
  auto logits = random_floats(N * V, rng, 3.0f);
  std::vector<int32_t> targets = {0, 100, 5, -100, 42, 42, 7};
  std::vector<float> losses(N);
  cross_entropy_forward(losses.data(), logits.data(), targets.data(), N, V);
  EXPECT_LT(relative_error(losses, losses_ref(to_double(logits), targets, N, V)), kFp32Tolerance);
  EXPECT_EQ(losses[3], 0.0f);

  const float dloss = 1.0f / 6.0f;
  const auto dx_ref = numeric_vjp([&](const auto& x) { return losses_ref(x, targets, N, V); },
                                  to_double(logits), std::vector<double>(N, dloss));
  auto dx = logits;  // in place
  cross_entropy_backward(dx.data(), dx.data(), targets.data(), dloss, N, V);
  EXPECT_LT(relative_error(dx, dx_ref), kFp32Tolerance);
  for (int64_t j = 0; j < V; ++j) ASSERT_EQ(dx[3 * V + j], 0.0f);
}

}  // namespace
}  // namespace strata::testing
