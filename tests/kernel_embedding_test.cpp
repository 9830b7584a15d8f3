// embedding_forward / embedding_backward: row lookup, and += scatter with repeated tokens.
#include <gtest/gtest.h>

#include "kernels/cpu/embedding.h"
#include "tests/kernel_reference.h"

namespace strata::testing {
namespace {

using namespace kernels::cpu;

TEST(KernelEmbedding, LooksUpRowsAndScattersGradientsWithAccumulation) {
  std::mt19937 rng(4);
  const int64_t V = 13, C = 70, N = 25;
  auto weight = random_floats(V * C, rng), dout = random_floats(N * C, rng);
  std::vector<int32_t> tokens(N);
  for (int64_t n = 0; n < N; ++n) tokens[n] = static_cast<int32_t>((n * 7) % 5);  // repeats
  tokens[N - 1] = static_cast<int32_t>(V - 1);
  std::vector<float> out(N * C);
  embedding_forward(out.data(), tokens.data(), weight.data(), N, C);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) ASSERT_EQ(out[n * C + c], weight[tokens[n] * C + c]);
  }
  auto d0 = random_floats(V * C, rng);
  auto dweight = d0;
  std::vector<double> ref(V * C, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < C; ++c) ref[tokens[n] * C + c] += dout[n * C + c];
  }
  embedding_backward(dweight.data(), dout.data(), tokens.data(), N, C);
  EXPECT_LT(relative_error(dweight, plus(d0, ref)), kFp32Tolerance);
}

}  // namespace
}  // namespace strata::testing
