// Rotary embeddings: llama3 frequency bands, rotation against float64 rotate_half,
// backward as the transposed rotation, in place on a wider buffer.
#include <gtest/gtest.h>

#include <numbers>

#include "kernels/cpu/rope.h"
#include "tests/kernel_reference.h"

namespace strata::testing {
namespace {

using namespace kernels::cpu;

TEST(KernelRope, Llama3ScalingKeepsHighDividesLowAndSmoothsMediumFrequencies) {
  RopeParams p;
  p.head_dim = 10;
  p.theta = 10000.0;
  std::vector<float> plain(5), scaled(5);
  rope_inv_freq(plain.data(), p);
  for (int i = 0; i < 5; ++i)
    EXPECT_NEAR(plain[i], std::pow(10000.0, -2.0 * i / 10), 1e-6 * plain[i]);
  p.llama3_scaling = true;
  p.factor = 8.0;
  p.low_freq_factor = 1.0;
  p.high_freq_factor = 4.0;
  p.original_max_positions = 64;  // wavelengths: 6.3 (high), 39.7 (medium), 251+ (low)
  rope_inv_freq(scaled.data(), p);
  EXPECT_EQ(scaled[0], plain[0]);
  const double wavelen = 2 * std::numbers::pi / plain[1];
  const double smooth = (64.0 / wavelen - 1.0) / 3.0;
  EXPECT_NEAR(scaled[1], (1 - smooth) * plain[1] / 8 + smooth * plain[1], 1e-6 * plain[1]);
  for (int i = 2; i < 5; ++i) EXPECT_NEAR(scaled[i], plain[i] / 8, 1e-6 * plain[i]);
}

TEST(KernelRope, RotatesLikeRotateHalfAndBackwardIsTheTranspose) {
  std::mt19937 rng(6);
  const int64_t B = 2, T = 9, heads = 3, D = 8, stride = 30;  // heads*D = 24 < stride
  RopeParams p;
  p.head_dim = D;
  p.theta = 500.0;
  std::vector<float> inv(D / 2), cos(T * D / 2), sin(T * D / 2);
  rope_inv_freq(inv.data(), p);
  rope_cos_sin(cos.data(), sin.data(), inv.data(), T, D);
  auto ref = [&](const std::vector<double>& x) {
    std::vector<double> y = x;
    for (int64_t n = 0; n < B * T; ++n) {
      const double t = static_cast<double>(n % T);
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < D / 2; ++i) {
          const double angle = static_cast<double>(inv[i]) * t, c = std::cos(angle),
                       s = std::sin(angle);
          const double a = x[n * stride + h * D + i], b = x[n * stride + h * D + i + D / 2];
          y[n * stride + h * D + i] = a * c - b * s;
          y[n * stride + h * D + i + D / 2] = b * c + a * s;
        }
      }
    }
    return y;
  };
  auto x = random_floats(B * T * stride, rng);
  auto y = x;
  rope_forward(y.data(), cos.data(), sin.data(), B, T, heads, D, stride);
  EXPECT_LT(relative_error(y, ref(to_double(x))), kFp32Tolerance);
  for (int64_t n = 0; n < B * T; ++n) {  // columns past heads*D untouched
    for (int64_t c = heads * D; c < stride; ++c) ASSERT_EQ(y[n * stride + c], x[n * stride + c]);
  }
  auto dy = random_floats(B * T * stride, rng);
  auto dx = dy;
  rope_backward(dx.data(), cos.data(), sin.data(), B, T, heads, D, stride);
  EXPECT_LT(relative_error(dx, numeric_vjp(ref, to_double(x), to_double(dy))), kFp32Tolerance);
}

}  // namespace
}  // namespace strata::testing
