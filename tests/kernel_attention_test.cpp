// Causal grouped-query attention against a float64 reference and its numeric gradient,
// reading q, k, v from rows of a fused qkv buffer; without and with a sliding window
// shorter than the sequence (query i sees keys i - W < j <= i).
#include <gtest/gtest.h>

#include "kernels/cpu/attention.h"
#include "tests/kernel_reference.h"

namespace strata::testing {
namespace {

using namespace kernels::cpu;

// qkv: (B, T, (H + 2 KV) D) -> out (B, T, H D).
std::vector<double> attention_ref(const std::vector<double>& qkv, const AttentionShape& s) {
  const int64_t T = s.T, D = s.D, ld = s.row_stride;
  std::vector<double> out(s.B * T * s.H * D, 0.0);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t kvh = h / (s.H / s.KV);
      for (int64_t i = 0; i < T; ++i) {
        const int64_t first = s.window > 0 ? std::max<int64_t>(0, i - s.window + 1) : 0;
        std::vector<double> p(i + 1, 0.0);
        double m = -1e300, sum = 0.0;
        for (int64_t j = first; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            dot += qkv[(b * T + i) * ld + h * D + d] * qkv[(b * T + j) * ld + (s.H + kvh) * D + d];
          }
          p[j] = dot / std::sqrt(static_cast<double>(D));
          m = std::max(m, p[j]);
        }
        for (int64_t j = first; j <= i; ++j) sum += (p[j] = std::exp(p[j] - m));
        for (int64_t j = first; j <= i; ++j) {
          for (int64_t d = 0; d < D; ++d) {
            out[(b * T + i) * s.H * D + h * D + d] +=
                p[j] / sum * qkv[(b * T + j) * ld + (s.H + s.KV + kvh) * D + d];
          }
        }
      }
    }
  }
  return out;
}

struct AttentionCase {
  int64_t row_block;
  int64_t window;
};

class KernelAttention : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(KernelAttention, GroupedQueryCausalMatchesFloat64AndItsGradient) {
  std::mt19937 rng(7);
  AttentionShape s;
  s.row_block = GetParam().row_block;
  s.window = GetParam().window;
  s.B = 2;
  s.T = 7;
  s.H = 6;
  s.KV = 2;
  s.D = 6;
  s.row_stride = (s.H + 2 * s.KV) * s.D;
  const int64_t N = s.B * s.T;
  auto qkv = random_floats(N * s.row_stride, rng);
  std::vector<float> out(N * s.H * s.D), probs(s.B * s.H * s.T * s.T);
  const float* q = qkv.data();
  attention_forward(out.data(), probs.data(), q, q + s.H * s.D, q + (s.H + s.KV) * s.D, s);
  EXPECT_LT(relative_error(out, attention_ref(to_double(qkv), s)), kFp32Tolerance);
  for (int64_t i = 0; i < s.T; ++i) {  // causal: nothing above the diagonal, nor before the window
    for (int64_t j = i + 1; j < s.T; ++j) ASSERT_EQ(probs[i * s.T + j], 0.0f);
    for (int64_t j = 0; s.window > 0 && j <= i - s.window; ++j) ASSERT_EQ(probs[i * s.T + j], 0.0f);
  }

  auto dout = random_floats(out.size(), rng);
  std::vector<float> dqkv(qkv.size(), 123.0f),
      scratch(s.T * s.T);  // = semantics: garbage overwritten
  float* dq = dqkv.data();
  attention_backward(dq, dq + s.H * s.D, dq + (s.H + s.KV) * s.D, scratch.data(), dout.data(),
                     probs.data(), q, q + s.H * s.D, q + (s.H + s.KV) * s.D, s);
  const auto ref = numeric_vjp([&](const auto& x) { return attention_ref(x, s); }, to_double(qkv),
                               to_double(dout));
  EXPECT_LT(relative_error(dqkv, ref), kFp32Tolerance);
}

// One block of rows, and blocks of 3 rows with a ragged last block; windows of 3 keys
// (shorter than the 7 tokens) and of 7 (the whole sequence: plain causal).
INSTANTIATE_TEST_SUITE_P(RowBlocks, KernelAttention,
                         ::testing::Values(AttentionCase{64, 0}, AttentionCase{3, 0},
                                           AttentionCase{64, 3}, AttentionCase{3, 3},
                                           AttentionCase{3, 7}));

}  // namespace
}  // namespace strata::testing
