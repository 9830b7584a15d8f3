// Flash-style causal grouped-query attention on the GPU (kernels/cuda/attention.cu),
// forward and backward, at sequence lengths that are and are not multiples of
// the kernels' tiles (16 query rows, 32 keys), head dimensions from 6 to 128,
// groups of 1 to 4 query heads per key/value head:
//  - fp32 against the CPU backend (kernels/cpu/attention.h), relative error <= 1e-4;
//  - bf16 and fp16 against a float64 reference, at most twice the error of
//    PyTorch's scaled_dot_product_attention in that type as emulated here (its
//    fused kernels round out, dq, dk and dv once each and compute the backward's
//    rowsum(dout * out) from the rounded out).
#include <gtest/gtest.h>

#if STRATA_HAS_CUDA

#include <fmt/format.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda_test_support.h"

namespace strata::testing {
namespace {

namespace cuda = kernels::cuda;
namespace cpu = kernels::cpu;

struct Case {
  int64_t B, T, H, KV, D;
  int64_t extra_columns;  // row_stride beyond the fused (H + 2 KV) D columns
};

std::string case_name(const Case& c) {
  return fmt::format("B{}_T{}_H{}_KV{}_D{}", c.B, c.T, c.H, c.KV, c.D);
}

cuda::AttentionShape shape_of(const Case& c) {
  cuda::AttentionShape s;
  s.B = c.B;
  s.T = c.T;
  s.H = c.H;
  s.KV = c.KV;
  s.D = c.D;
  s.row_stride = (c.H + 2 * c.KV) * c.D + c.extra_columns;
  return s;
}

// Both directions of attention in float64, with PyTorch's rounding points
// as hooks: out [round]; delta from the rounded out; dq, dk, dv [round].
struct AttentionReference {
  std::vector<double> out;   // (B, T, H*D)
  std::vector<double> dqkv;  // (B, T, row_stride), zero outside the q, k, v heads
};
AttentionReference attention_reference(const std::vector<float>& qkv,
                                       const std::vector<float>& dout,
                                       const cuda::AttentionShape& s, const Round& round) {
  const int64_t T = s.T, D = s.D, ld = s.row_stride, HD = s.H * s.D;
  AttentionReference ref{std::vector<double>(s.B * T * HD, 0.0),
                         std::vector<double>(s.B * T * ld, 0.0)};
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> p(T), o(D);
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t kvh = h / (s.H / s.KV);
      auto q = [&](int64_t t, int64_t d) { return double{qkv[(b * T + t) * ld + h * D + d]}; };
      auto k = [&](int64_t t, int64_t d) {
        return double{qkv[(b * T + t) * ld + (s.H + kvh) * D + d]};
      };
      auto v = [&](int64_t t, int64_t d) {
        return double{qkv[(b * T + t) * ld + (s.H + s.KV + kvh) * D + d]};
      };
      for (int64_t i = 0; i < T; ++i) {
        double max = -1e300, sum = 0.0;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t d = 0; d < D; ++d) dot += q(i, d) * k(j, d);
          p[j] = dot * scale;
          max = std::max(max, p[j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - max));
        for (int64_t j = 0; j <= i; ++j) p[j] /= sum;
        for (int64_t d = 0; d < D; ++d) {
          double acc = 0.0;
          for (int64_t j = 0; j <= i; ++j) acc += p[j] * v(j, d);
          o[d] = round(acc);
          ref.out[(b * T + i) * HD + h * D + d] = o[d];
        }
        std::vector<double> dy(D);
        for (int64_t d = 0; d < D; ++d) dy[d] = dout[(b * T + i) * HD + h * D + d];
        double delta = 0.0;
        for (int64_t d = 0; d < D; ++d) delta += dy[d] * o[d];
        for (int64_t j = 0; j <= i; ++j) {
          double dp = 0.0;
          for (int64_t d = 0; d < D; ++d) dp += dy[d] * v(j, d);
          const double ds = p[j] * (dp - delta) * scale;
          for (int64_t d = 0; d < D; ++d) {
            ref.dqkv[(b * T + i) * ld + h * D + d] += ds * k(j, d);
            ref.dqkv[(b * T + j) * ld + (s.H + kvh) * D + d] += ds * q(i, d);
            ref.dqkv[(b * T + j) * ld + (s.H + s.KV + kvh) * D + d] += p[j] * dy[d];
          }
        }
      }
    }
  }
  for (double& x : ref.dqkv) x = round(x);
  return ref;
}

// Device buffers of one attention call: q, k, v inside one fused qkv buffer.
struct AttentionBuffers {
  AttentionBuffers(const std::vector<float>& qkv, const std::vector<float>& dout,
                   const cuda::AttentionShape& s, DType type)
      : qkv_(upload(qkv, type)),
        dout_(upload(dout, type)),
        out_(s.B * s.T * s.H * s.D * kernels::cuda::dtype_size(type)),
        dqkv_(qkv.size() * kernels::cuda::dtype_size(type)),
        lse_(s.B * s.H * s.T * 4),
        delta_(s.B * s.H * s.T * 4),
        shape_(s),
        type_(type) {}

  char* at(const DeviceBuffer& buffer, int64_t heads) const {
    return static_cast<char*>(buffer.get()) + heads * shape_.D * kernels::cuda::dtype_size(type_);
  }
  Status forward() {
    return cuda::attention_forward(out_.get(), lse_.f32(), at(*qkv_, 0), at(*qkv_, shape_.H),
                                   at(*qkv_, shape_.H + shape_.KV), shape_, type_, nullptr);
  }
  Status backward() {
    const int64_t H = shape_.H, KV = shape_.KV;
    return cuda::attention_backward(at(dqkv_, 0), at(dqkv_, H), at(dqkv_, H + KV), delta_.f32(),
                                    dout_->get(), out_.get(), lse_.f32(), at(*qkv_, 0),
                                    at(*qkv_, H), at(*qkv_, H + KV), shape_, type_, nullptr);
  }

  std::unique_ptr<DeviceBuffer> qkv_, dout_;
  DeviceBuffer out_, dqkv_, lse_, delta_;
  cuda::AttentionShape shape_;
  DType type_;
};

class CudaAttention : public CudaTestWithParam<Case> {};

const Case kCases[] = {
    {1, 1, 2, 2, 32, 0},     // a single token
    {2, 17, 4, 2, 16, 0},    // T not a multiple of either tile
    {1, 32, 8, 8, 64, 0},    // exactly one key tile, no grouping
    {1, 64, 6, 3, 6, 5},     // tiny odd head dimension, padded rows
    {2, 100, 8, 2, 64, 0},   // Llama 3.2 1B's head shape, ragged T
    {1, 257, 4, 1, 128, 3},  // D = 128, all heads share one key/value head
};

TEST_P(CudaAttention, Fp32MatchesCpuForwardAndBackward) {
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  const cuda::AttentionShape s = shape_of(GetParam());
  const auto qkv = random_floats(s.B * s.T * s.row_stride, rng);
  const auto dout = random_floats(s.B * s.T * s.H * s.D, rng);

  cpu::AttentionShape cs = s;
  std::vector<float> out(s.B * s.T * s.H * s.D), probs(s.B * s.H * s.T * s.T);
  std::vector<float> dqkv(qkv.size(), 0.0f), scratch(s.T * s.T);
  const int64_t H = s.H, KV = s.KV, D = s.D;
  cpu::attention_forward(out.data(), probs.data(), qkv.data(), qkv.data() + H * D,
                         qkv.data() + (H + KV) * D, cs);
  cpu::attention_backward(dqkv.data(), dqkv.data() + H * D, dqkv.data() + (H + KV) * D,
                          scratch.data(), dout.data(), probs.data(), qkv.data(), qkv.data() + H * D,
                          qkv.data() + (H + KV) * D, cs);

  AttentionBuffers gpu(qkv, dout, s, DType::f32);
  expect_ok(gpu.forward());
  expect_ok(gpu.backward());
  expect_matches_cpu(download(gpu.out_, out.size(), DType::f32), out, "out");
  expect_matches_cpu(download(gpu.dqkv_, dqkv.size(), DType::f32), dqkv, "dq, dk, dv");
}

TEST_P(CudaAttention, LowPrecisionWithinTwicePyTorchError) {
  for (const DType type : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(type_label(type));
    const uint32_t seed = fresh_seed();
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937 rng(seed);
    const cuda::AttentionShape s = shape_of(GetParam());
    const auto qkv = rounded(random_floats(s.B * s.T * s.row_stride, rng), type);
    const auto dout = rounded(random_floats(s.B * s.T * s.H * s.D, rng), type);
    const AttentionReference exact_ref = attention_reference(qkv, dout, s, exact());
    const AttentionReference emulated = attention_reference(qkv, dout, s, rounding_to(type));

    AttentionBuffers gpu(qkv, dout, s, type);
    expect_ok(gpu.forward());
    expect_ok(gpu.backward());
    expect_within_twice_emulated(download(gpu.out_, exact_ref.out.size(), type), emulated.out,
                                 exact_ref.out, "out");
    expect_within_twice_emulated(download(gpu.dqkv_, qkv.size(), type), emulated.dqkv,
                                 exact_ref.dqkv, "dq, dk, dv");
  }
}

// No atomics: the same inputs give the same bits, run after run.
TEST_F(CudaTest, AttentionIsBitwiseReproducible) {
  const cuda::AttentionShape s = shape_of({2, 100, 8, 2, 64, 0});
  std::mt19937 rng(fresh_seed());
  const auto qkv = rounded(random_floats(s.B * s.T * s.row_stride, rng), DType::bf16);
  const auto dout = rounded(random_floats(s.B * s.T * s.H * s.D, rng), DType::bf16);
  std::vector<float> first_out, first_dqkv;
  for (int run = 0; run < 2; ++run) {
    AttentionBuffers gpu(qkv, dout, s, DType::bf16);
    expect_ok(gpu.forward());
    expect_ok(gpu.backward());
    auto out = download(gpu.out_, s.B * s.T * s.H * s.D, DType::bf16);
    auto dqkv = download(gpu.dqkv_, qkv.size(), DType::bf16);
    if (run == 0) {
      first_out = std::move(out);
      first_dqkv = std::move(dqkv);
    } else {
      EXPECT_EQ(out, first_out);
      EXPECT_EQ(dqkv, first_dqkv);
    }
  }
}

// The GPU never holds a T x T matrix: a long sequence runs with buffers linear in T.
TEST_F(CudaTest, AttentionAtLongSequenceNeedsNoQuadraticMemory) {
  Case c{1, 8192, 32, 8, 64, 0};
  const cuda::AttentionShape s = shape_of(c);
  std::mt19937 rng(fresh_seed());
  const auto qkv = rounded(random_floats(s.B * s.T * s.row_stride, rng), DType::bf16);
  const auto dout = rounded(random_floats(s.B * s.T * s.H * s.D, rng), DType::bf16);
  AttentionBuffers gpu(qkv, dout, s, DType::bf16);
  expect_ok(gpu.forward());
  expect_ok(gpu.backward());
  // Finite results are what this checks (values are covered above).
  for (float x : download(gpu.dqkv_, qkv.size(), DType::bf16)) ASSERT_TRUE(std::isfinite(x));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaAttention, ::testing::ValuesIn(kCases),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
}  // namespace strata::testing

#else  // a CPU-only build has no CUDA kernels to test

TEST(CudaAttention, NeedsACudaBuild) {
  GTEST_SKIP() << "built without CUDA";
}

#endif
