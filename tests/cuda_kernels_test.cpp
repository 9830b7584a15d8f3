// The CUDA kernels other than attention (tests/cuda_attention_test.cpp), each
// forward and backward on fresh random inputs:
//  - fp32 against the CPU backend (kernels/cpu), per-tensor relative error <= 1e-4;
//  - bf16 and fp16 against a float64 reference, at most twice the error of
//    PyTorch's low-precision version as emulated in tests/cuda_test_support.h
//    (each reference below says where PyTorch rounds);
//  - the mixture-of-experts kernels in fp32 against float64 (the same experts,
//    probabilities and weights to fp32 rounding) and, where the CPU backend's
//    loops (core/model/model.cpp) have no exponential, bitwise equal to them;
//  - AdamW bitwise equal to the CPU kernel, with fp32, bf16 and int8 moments
//    (int8: codes and scales); the gradient norm equal to the CPU
//    one to float64 rounding; argument errors naming the kernel and the shape.
// Skipped when no GPU can be used; argument checks run everywhere.
#include <gtest/gtest.h>

#if STRATA_HAS_CUDA

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/model/model.h"
#include "core/optimizer/optimizer.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/bias.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/grad_norm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda_test_support.h"

namespace strata::testing {
namespace {

namespace cuda = kernels::cuda;
namespace cpu = kernels::cpu;

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> tokens(n);
  for (auto& t : tokens) t = pick(rng);
  return tokens;
}

std::vector<double> map_round(const std::vector<double>& v, const Round& round) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = round(v[i]);
  return out;
}

class CudaKernels : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

class CudaKernelsLowPrecision : public CudaTestWithParam<DType> {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    seed_ = fresh_seed();
    rng_.seed(seed_);
  }
  DType type() const { return GetParam(); }
  // Random values already representable in the compute type.
  std::vector<float> random(size_t n, float scale = 1.0f) {
    return rounded(random_floats(n, rng_, scale), type());
  }
  uint32_t seed_ = 0;
  std::mt19937 rng_;
};

INSTANTIATE_TEST_SUITE_P(Types, CudaKernelsLowPrecision, ::testing::Values(DType::bf16, DType::f16),
                         [](const auto& info) { return std::string(type_label(info.param)); });

// --- embedding ------------------------------------------------------------------------

TEST_F(CudaKernels, EmbeddingMatchesCpuBitwise) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t V = 50, C = 70, N = 300;  // many repeated tokens
  const auto weight = random_floats(V * C, rng_);
  const auto tokens = random_tokens(N, V, rng_);
  const auto dout = random_floats(N * C, rng_);
  const auto prefill = random_floats(V * C, rng_);

  auto d_weight = upload(weight, DType::f32);
  auto d_tokens = upload_raw(tokens);
  DeviceBuffer d_out(N * C * 4);
  expect_ok(cuda::embedding_forward(d_out.get(), static_cast<int32_t*>(d_tokens->get()),
                                    d_weight->get(), N, C, DType::f32, nullptr));
  std::vector<float> cpu_out(N * C);
  cpu::embedding_forward(cpu_out.data(), tokens.data(), weight.data(), N, C);
  EXPECT_EQ(download(d_out, N * C, DType::f32), cpu_out);

  auto d_dout = upload(dout, DType::f32);
  auto d_dweight = upload(prefill, DType::f32);
  DeviceBuffer scratch(cuda::embedding_backward_scratch_bytes(N, V));
  expect_ok(cuda::embedding_backward(d_dweight->f32(), d_dout->get(),
                                     static_cast<int32_t*>(d_tokens->get()), N, C, V, DType::f32,
                                     scratch.get(), scratch.bytes(), nullptr));
  std::vector<float> cpu_dweight = prefill;
  cpu::embedding_backward(cpu_dweight.data(), dout.data(), tokens.data(), N, C);
  // Same rows added in the same order: the same bits.
  EXPECT_EQ(download(*d_dweight, V * C, DType::f32), cpu_dweight);
}

// A vocabulary chunk's rows (strata.vocab_chunks): only tokens in [begin, end)
// are set or add to their row, as the CPU kernels do, bit for bit.
TEST_F(CudaKernels, EmbeddingRowsOfAChunkMatchCpuBitwise) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t V = 50, C = 70, N = 300, begin = 17, end = 33, rows = end - begin;
  const auto weight = random_floats(rows * C, rng_);
  const auto tokens = random_tokens(N, V, rng_);
  const auto dout = random_floats(N * C, rng_);
  const auto before = random_floats(N * C, rng_);  // the rows of other chunks stay
  const auto prefill = random_floats(rows * C, rng_);

  auto d_weight = upload(weight, DType::f32);
  auto d_tokens = upload_raw(tokens);
  auto d_out = upload(before, DType::f32);
  expect_ok(cuda::embedding_forward_rows(d_out->get(), static_cast<int32_t*>(d_tokens->get()),
                                         d_weight->get(), N, C, begin, end, DType::f32, nullptr));
  std::vector<float> cpu_out = before;
  cpu::embedding_forward_rows(cpu_out.data(), tokens.data(), weight.data(), N, C, begin, end);
  EXPECT_EQ(download(*d_out, N * C, DType::f32), cpu_out);

  auto d_dout = upload(dout, DType::f32);
  auto d_dweight = upload(prefill, DType::f32);
  DeviceBuffer scratch(cuda::embedding_backward_scratch_bytes(N, V));
  expect_ok(cuda::embedding_backward_rows(
      d_dweight->f32(), d_dout->get(), static_cast<int32_t*>(d_tokens->get()), N, C, V, begin, end,
      DType::f32, scratch.get(), scratch.bytes(), nullptr));
  std::vector<float> cpu_dweight = prefill;
  cpu::embedding_backward_rows(cpu_dweight.data(), dout.data(), tokens.data(), N, C, begin, end);
  EXPECT_EQ(download(*d_dweight, rows * C, DType::f32), cpu_dweight);
}

TEST_P(CudaKernelsLowPrecision, Embedding) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t V = 64, C = 96, N = 500;
  const auto weight = random(V * C);
  const auto tokens = random_tokens(N, V, rng_);
  const auto dout = random(N * C);
  auto d_weight = upload(weight, type());
  auto d_tokens = upload_raw(tokens);
  DeviceBuffer d_out(N * C * 2);
  expect_ok(cuda::embedding_forward(d_out.get(), static_cast<int32_t*>(d_tokens->get()),
                                    d_weight->get(), N, C, type(), nullptr));
  std::vector<double> lookup(N * C);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) lookup[n * C + c] = weight[tokens[n] * C + c];
  // A lookup is exact in PyTorch too: the GPU must be exact.
  expect_within_twice_emulated(download(d_out, N * C, type()), lookup, lookup, "forward");

  auto d_dout = upload(dout, type());
  DeviceBuffer d_dweight(V * C * 4);
  DeviceBuffer scratch(cuda::embedding_backward_scratch_bytes(N, V));
  expect_ok(cuda::embedding_backward(d_dweight.f32(), d_dout->get(),
                                     static_cast<int32_t*>(d_tokens->get()), N, C, V, type(),
                                     scratch.get(), scratch.bytes(), nullptr));
  std::vector<double> reference(V * C, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) reference[tokens[n] * C + c] += dout[n * C + c];
  // PyTorch's bf16 model keeps a bf16 .grad: the sum, rounded once.
  expect_within_twice_emulated(download(d_dweight, V * C, DType::f32),
                               map_round(reference, rounding_to(type())), reference, "dweight");
}

// --- RMSNorm --------------------------------------------------------------------------

TEST_F(CudaKernels, RmsnormMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 37, C = 300;
  const float eps = 1e-5f;
  auto x = random_floats(N * C, rng_), w = random_floats(C, rng_), dy = random_floats(N * C, rng_);
  for (float& v : w) v += 1.0f;
  const auto dx_prefill = random_floats(N * C, rng_), dw_prefill = random_floats(C, rng_);

  std::vector<float> out(N * C), rstd(N), dx = dx_prefill, dw = dw_prefill;
  cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
  cpu::rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);

  auto d_x = upload(x, DType::f32), d_w = upload(w, DType::f32), d_dy = upload(dy, DType::f32);
  auto d_dx = upload(dx_prefill, DType::f32), d_dw = upload(dw_prefill, DType::f32);
  DeviceBuffer d_out(N * C * 4), d_rstd(N * 4);
  DeviceBuffer scratch(cuda::rmsnorm_backward_scratch_bytes(N, C));
  expect_ok(cuda::rmsnorm_forward(d_out.get(), d_rstd.f32(), d_x->get(), d_w->get(), N, C, eps,
                                  DType::f32, nullptr));
  expect_ok(cuda::rmsnorm_backward(d_dx->get(), d_dw->f32(), d_dy->get(), d_x->get(), d_w->get(),
                                   d_rstd.f32(), N, C, DType::f32, scratch.get(), scratch.bytes(),
                                   nullptr));
  expect_matches_cpu(download(d_out, N * C, DType::f32), out, "out");
  expect_matches_cpu(download(d_rstd, N, DType::f32), rstd, "rstd");
  expect_matches_cpu(download(*d_dx, N * C, DType::f32), dx, "dinp (+=)");
  expect_matches_cpu(download(*d_dw, C, DType::f32), dw, "dweight (+=)");
}

// Hugging Face's LlamaRMSNorm in a bf16 model: h = (x.float() * rstd).to(bf16)
// [round], y = w * h [round]. Autograd: dh = dy * w [round], dx in fp32 from dh
// then cast to bf16 [round]; dw = sum(dy * h) [round: a bf16 .grad].
struct RmsnormReference {
  std::vector<double> y, dx, dw;
};
RmsnormReference rmsnorm_reference(const std::vector<float>& x, const std::vector<float>& w,
                                   const std::vector<float>& dy, int64_t N, int64_t C, double eps,
                                   const Round& round) {
  RmsnormReference ref{std::vector<double>(N * C), std::vector<double>(N * C),
                       std::vector<double>(C, 0.0)};
  std::vector<double> dw_sum(C, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double ms = 0.0;
    for (int64_t c = 0; c < C; ++c) ms += double{x[n * C + c]} * x[n * C + c];
    const double r = 1.0 / std::sqrt(ms / C + eps);
    double dot = 0.0;
    std::vector<double> dh(C);
    for (int64_t c = 0; c < C; ++c) {
      const double h = round(x[n * C + c] * r);
      ref.y[n * C + c] = round(w[c] * h);
      dh[c] = round(double{dy[n * C + c]} * w[c]);
      dot += dh[c] * x[n * C + c] * r;
      dw_sum[c] += double{dy[n * C + c]} * h;
    }
    for (int64_t c = 0; c < C; ++c) {
      ref.dx[n * C + c] = round(r * (dh[c] - x[n * C + c] * r * dot / C));
    }
  }
  for (int64_t c = 0; c < C; ++c) ref.dw[c] = round(dw_sum[c]);
  return ref;
}

TEST_P(CudaKernelsLowPrecision, Rmsnorm) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 45, C = 512;
  const float eps = 1e-5f;
  auto x = random(N * C), dy = random(N * C);
  auto w = random_floats(C, rng_, 0.1f);
  for (float& v : w) v = round_to(v + 1.0f, type());
  const RmsnormReference exact_ref = rmsnorm_reference(x, w, dy, N, C, eps, exact());
  const RmsnormReference emulated = rmsnorm_reference(x, w, dy, N, C, eps, rounding_to(type()));

  auto d_x = upload(x, type()), d_w = upload(w, type()), d_dy = upload(dy, type());
  DeviceBuffer d_out(N * C * 2), d_rstd(N * 4), d_dx(N * C * 2), d_dw(C * 4);
  DeviceBuffer scratch(cuda::rmsnorm_backward_scratch_bytes(N, C));
  expect_ok(cuda::rmsnorm_forward(d_out.get(), d_rstd.f32(), d_x->get(), d_w->get(), N, C, eps,
                                  type(), nullptr));
  expect_ok(cuda::rmsnorm_backward(d_dx.get(), d_dw.f32(), d_dy->get(), d_x->get(), d_w->get(),
                                   d_rstd.f32(), N, C, type(), scratch.get(), scratch.bytes(),
                                   nullptr));
  expect_within_twice_emulated(download(d_out, N * C, type()), emulated.y, exact_ref.y, "out");
  expect_within_twice_emulated(download(d_dx, N * C, type()), emulated.dx, exact_ref.dx, "dinp");
  expect_within_twice_emulated(download(d_dw, C, DType::f32), emulated.dw, exact_ref.dw, "dweight");
}

// --- rotary embedding -----------------------------------------------------------------

struct RopeTables {
  std::vector<float> cos, sin;
};
RopeTables rope_tables(int64_t T, int64_t D) {
  cpu::RopeParams params;
  params.head_dim = D;
  params.theta = 500000.0;
  params.llama3_scaling = true;
  params.factor = 32.0;
  params.original_max_positions = 16;
  std::vector<float> inv_freq(D / 2);
  cpu::rope_inv_freq(inv_freq.data(), params);
  RopeTables tables{std::vector<float>(T * D / 2), std::vector<float>(T * D / 2)};
  cpu::rope_cos_sin(tables.cos.data(), tables.sin.data(), inv_freq.data(), T, D);
  return tables;
}

TEST_F(CudaKernels, RopeMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t B = 2, T = 13, heads = 3, D = 16, stride = heads * D + 5;
  const RopeTables tables = rope_tables(T, D);
  const auto x = random_floats(B * T * stride, rng_);
  auto d_cos = upload(tables.cos, DType::f32), d_sin = upload(tables.sin, DType::f32);
  for (const bool forward : {true, false}) {
    std::vector<float> cpu_x = x;
    auto d_x = upload(x, DType::f32);
    if (forward) {
      cpu::rope_forward(cpu_x.data(), tables.cos.data(), tables.sin.data(), B, T, heads, D, stride);
      expect_ok(cuda::rope_forward(d_x->get(), d_cos->f32(), d_sin->f32(), B, T, heads, D, stride,
                                   DType::f32, nullptr));
    } else {
      cpu::rope_backward(cpu_x.data(), tables.cos.data(), tables.sin.data(), B, T, heads, D,
                         stride);
      expect_ok(cuda::rope_backward(d_x->get(), d_cos->f32(), d_sin->f32(), B, T, heads, D, stride,
                                    DType::f32, nullptr));
    }
    // The whole rows, so columns past heads*D are checked to be untouched.
    expect_matches_cpu(download(*d_x, x.size(), DType::f32), cpu_x,
                       forward ? "forward" : "backward");
  }
}

// PyTorch: cos/sin cast to the compute type [round]; q*cos [round];
// rotate_half(q)*sin [round]; the sum [round]. The backward (autograd):
// dy*cos [round], dy*sin [round], rotated back and added [round].
std::vector<double> rope_reference(const std::vector<float>& x, const RopeTables& tables,
                                   int64_t rows, int64_t T, int64_t heads, int64_t D,
                                   int64_t stride, bool forward, const Round& round) {
  std::vector<double> y(x.begin(), x.end());
  const int64_t half = D / 2;
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t t = n % T;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < half; ++i) {
        const double c = round(tables.cos[t * half + i]), s = round(tables.sin[t * half + i]);
        const double x1 = x[n * stride + h * D + i], x2 = x[n * stride + h * D + half + i];
        if (forward) {
          y[n * stride + h * D + i] = round(round(x1 * c) + round(-x2 * s));
          y[n * stride + h * D + half + i] = round(round(x2 * c) + round(x1 * s));
        } else {
          y[n * stride + h * D + i] = round(round(x1 * c) + round(x2 * s));
          y[n * stride + h * D + half + i] = round(round(x2 * c) - round(x1 * s));
        }
      }
    }
  }
  return y;
}

TEST_P(CudaKernelsLowPrecision, Rope) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t B = 2, T = 40, heads = 4, D = 64, stride = 3 * heads * D;
  const RopeTables tables = rope_tables(T, D);
  const auto x = random(B * T * stride);
  auto d_cos = upload(tables.cos, DType::f32), d_sin = upload(tables.sin, DType::f32);
  for (const bool forward : {true, false}) {
    auto d_x = upload(x, type());
    if (forward) {
      expect_ok(cuda::rope_forward(d_x->get(), d_cos->f32(), d_sin->f32(), B, T, heads, D, stride,
                                   type(), nullptr));
    } else {
      expect_ok(cuda::rope_backward(d_x->get(), d_cos->f32(), d_sin->f32(), B, T, heads, D, stride,
                                    type(), nullptr));
    }
    expect_within_twice_emulated(
        download(*d_x, x.size(), type()),
        rope_reference(x, tables, B * T, T, heads, D, stride, forward, rounding_to(type())),
        rope_reference(x, tables, B * T, T, heads, D, stride, forward, exact()),
        forward ? "forward" : "backward");
  }
}

// --- SwiGLU ---------------------------------------------------------------------------

TEST_F(CudaKernels, SwigluMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 29, I = 300;
  const auto gate_up = random_floats(N * 2 * I, rng_, 2.0f), dout = random_floats(N * I, rng_);
  std::vector<float> out(N * I), dgate_up(N * 2 * I);
  cpu::swiglu_forward(out.data(), gate_up.data(), N, I);
  cpu::swiglu_backward(dgate_up.data(), dout.data(), gate_up.data(), N, I);
  auto d_gate_up = upload(gate_up, DType::f32), d_dout = upload(dout, DType::f32);
  DeviceBuffer d_out(N * I * 4), d_dgate_up(N * 2 * I * 4);
  expect_ok(cuda::swiglu_forward(d_out.get(), d_gate_up->get(), N, I, DType::f32, nullptr));
  expect_ok(cuda::swiglu_backward(d_dgate_up.get(), d_dout->get(), d_gate_up->get(), N, I,
                                  DType::f32, nullptr));
  expect_matches_cpu(download(d_out, N * I, DType::f32), out, "out");
  expect_matches_cpu(download(d_dgate_up, N * 2 * I, DType::f32), dgate_up, "dgate_up");
}

// PyTorch: a = silu(gate) [round], out = a * up [round]. Autograd: dup = dy * a
// [round], da = dy * up [round], dgate = silu_backward(da, gate) [round].
struct SwigluReference {
  std::vector<double> out, dgate_up;
};
SwigluReference swiglu_reference(const std::vector<float>& gate_up, const std::vector<float>& dout,
                                 int64_t N, int64_t I, const Round& round) {
  SwigluReference ref{std::vector<double>(N * I), std::vector<double>(N * 2 * I)};
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < I; ++i) {
      const double g = gate_up[n * 2 * I + i], u = gate_up[n * 2 * I + I + i];
      const double dy = dout[n * I + i];
      const double sigmoid = 1.0 / (1.0 + std::exp(-g));
      const double a = round(g * sigmoid);
      ref.out[n * I + i] = round(a * u);
      const double da = round(dy * u);
      ref.dgate_up[n * 2 * I + i] = round(da * sigmoid * (1.0 + g * (1.0 - sigmoid)));
      ref.dgate_up[n * 2 * I + I + i] = round(dy * a);
    }
  }
  return ref;
}

TEST_P(CudaKernelsLowPrecision, Swiglu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 33, I = 512;
  const auto gate_up = random(N * 2 * I, 2.0f), dout = random(N * I);
  const SwigluReference exact_ref = swiglu_reference(gate_up, dout, N, I, exact());
  const SwigluReference emulated = swiglu_reference(gate_up, dout, N, I, rounding_to(type()));
  auto d_gate_up = upload(gate_up, type()), d_dout = upload(dout, type());
  DeviceBuffer d_out(N * I * 2), d_dgate_up(N * 2 * I * 2);
  expect_ok(cuda::swiglu_forward(d_out.get(), d_gate_up->get(), N, I, type(), nullptr));
  expect_ok(cuda::swiglu_backward(d_dgate_up.get(), d_dout->get(), d_gate_up->get(), N, I, type(),
                                  nullptr));
  expect_within_twice_emulated(download(d_out, N * I, type()), emulated.out, exact_ref.out, "out");
  expect_within_twice_emulated(download(d_dgate_up, N * 2 * I, type()), emulated.dgate_up,
                               exact_ref.dgate_up, "dgate_up");
}

// --- bias of a linear layer ------------------------------------------------------------

TEST_F(CudaKernels, BiasMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 45, OC = 333;  // a ragged last block of columns and of row groups
  const auto x = random_floats(N * OC, rng_), bias = random_floats(OC, rng_);
  const auto dout = random_floats(N * OC, rng_), before = random_floats(OC, rng_);
  std::vector<float> out = x, dbias = before;
  cpu::bias_forward(out.data(), bias.data(), N, OC);
  cpu::bias_backward(dbias.data(), dout.data(), N, OC);
  auto d_out = upload(x, DType::f32), d_bias = upload(bias, DType::f32);
  auto d_dout = upload(dout, DType::f32), d_dbias = upload(before, DType::f32);
  expect_ok(cuda::bias_forward(d_out->get(), d_bias->get(), N, OC, DType::f32, nullptr));
  expect_ok(cuda::bias_backward(static_cast<float*>(d_dbias->get()), d_dout->get(), N, OC,
                                DType::f32, nullptr));
  expect_matches_cpu(download(*d_out, N * OC, DType::f32), out, "out");
  expect_matches_cpu(download(*d_dbias, OC, DType::f32), dbias, "dbias");
}

TEST_P(CudaKernelsLowPrecision, Bias) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 67, OC = 200;
  const auto x = random(N * OC), bias = random(OC), dout = random(N * OC);
  // PyTorch: out = x + bias [round]; dbias = sum over rows of dout, in fp32.
  std::vector<double> exact_out(N * OC), emulated_out(N * OC), dbias_ref(OC, 0.0);
  const Round round = rounding_to(type());
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t c = 0; c < OC; ++c) {
      exact_out[n * OC + c] = double(x[n * OC + c]) + bias[c];
      emulated_out[n * OC + c] = round(exact_out[n * OC + c]);
      dbias_ref[c] += dout[n * OC + c];
    }
  }
  auto d_out = upload(x, type()), d_bias = upload(bias, type()), d_dout = upload(dout, type());
  DeviceBuffer d_dbias(OC * 4);
  expect_ok(cuda::bias_forward(d_out->get(), d_bias->get(), N, OC, type(), nullptr));
  expect_ok(cuda::bias_backward(static_cast<float*>(d_dbias.get()), d_dout->get(), N, OC, type(),
                                nullptr));
  expect_within_twice_emulated(download(*d_out, N * OC, type()), emulated_out, exact_out, "out");
  // The sums are fp32 of values exact in the type: within fp32 rounding of float64.
  EXPECT_LE(relative_error(download(d_dbias, OC, DType::f32), dbias_ref), 1e-6);
}

// --- cross-entropy --------------------------------------------------------------------

TEST_F(CudaKernels, CrossEntropyMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 9, V = 5003;
  const auto logits = random_floats(N * V, rng_, 3.0f);
  auto targets = random_tokens(N, V, rng_);
  targets[4] = -100;  // ignored
  const float dloss = 1.0f / 8;
  std::vector<float> losses(N), dlogits(N * V);
  cpu::cross_entropy_forward(losses.data(), logits.data(), targets.data(), N, V);
  cpu::cross_entropy_backward(dlogits.data(), logits.data(), targets.data(), dloss, N, V);

  auto d_targets = upload_raw(targets);
  const int32_t* t = static_cast<int32_t*>(d_targets->get());
  auto d_logits = upload(logits, DType::f32);
  DeviceBuffer d_losses(N * 4), d_dlogits(N * V * 4);
  expect_ok(
      cuda::cross_entropy_forward(d_losses.f32(), d_logits->get(), t, N, V, DType::f32, nullptr));
  expect_matches_cpu(download(d_losses, N, DType::f32), losses, "losses (forward)");
  expect_ok(cuda::cross_entropy_forward_backward(nullptr, d_dlogits.get(), d_logits->get(), t,
                                                 dloss, N, V, DType::f32, nullptr));
  expect_matches_cpu(download(d_dlogits, N * V, DType::f32), dlogits, "dlogits");
  // In place: the gradient over the logits, and the losses of the same pass.
  DeviceBuffer d_losses2(N * 4);
  expect_ok(cuda::cross_entropy_forward_backward(d_losses2.f32(), d_logits->get(), d_logits->get(),
                                                 t, dloss, N, V, DType::f32, nullptr));
  expect_matches_cpu(download(d_losses2, N, DType::f32), losses, "losses (in place)");
  expect_matches_cpu(download(*d_logits, N * V, DType::f32), dlogits, "dlogits (in place)");
}

// Hugging Face upcasts the logits to fp32 for the loss: losses in fp32
// [round to fp32], the gradient cast back to the logits' type [round].
TEST_P(CudaKernelsLowPrecision, CrossEntropy) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 12, V = 32000;
  const auto logits = random(N * V, 3.0f);
  auto targets = random_tokens(N, V, rng_);
  targets[0] = -100;
  const float dloss = 1.0f / 11;
  std::vector<double> losses(N, 0.0), dlogits(N * V, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (targets[n] < 0) continue;
    double max = -1e300, sum = 0.0;
    for (int64_t v = 0; v < V; ++v) max = std::max(max, double{logits[n * V + v]});
    for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[n * V + v] - max);
    const double lse = max + std::log(sum);
    losses[n] = lse - logits[n * V + targets[n]];
    for (int64_t v = 0; v < V; ++v) {
      dlogits[n * V + v] = dloss * (std::exp(logits[n * V + v] - lse) - (v == targets[n] ? 1 : 0));
    }
  }
  std::vector<double> losses_fp32(N);
  for (int64_t n = 0; n < N; ++n) losses_fp32[n] = static_cast<float>(losses[n]);

  auto d_targets = upload_raw(targets);
  auto d_logits = upload(logits, type());
  DeviceBuffer d_losses(N * 4);
  expect_ok(cuda::cross_entropy_forward_backward(d_losses.f32(), d_logits->get(), d_logits->get(),
                                                 static_cast<int32_t*>(d_targets->get()), dloss, N,
                                                 V, type(), nullptr));
  expect_within_twice_emulated(download(d_losses, N, DType::f32), losses_fp32, losses, "losses");
  expect_within_twice_emulated(download(*d_logits, N * V, type()),
                               map_round(dlogits, rounding_to(type())), dlogits, "dlogits");
}

// --- mixture of experts ---------------------------------------------------------------

template <typename T>
std::vector<T> download_raw(const void* data, size_t n) {
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<T> values(n);
  EXPECT_EQ(cudaMemcpy(values.data(), data, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return values;
}

// Router logits in `type` whose probabilities lie well apart, so that fp32 and
// float64 rank them alike: a token's experts take the ranks of a random
// permutation, 0.25 apart with +-0.05 of jitter (after rounding to bf16 still
// over 0.08 apart). Every third token has exact ties, its largest logit copied
// to the second and its K-th to the (K+1)-th, which the GPU and the reference
// must both break to the lower index.
std::vector<float> moe_logits(int64_t N, int64_t E, int64_t K, DType type, std::mt19937& rng) {
  std::normal_distribution<float> base(0.0f, 2.0f);
  std::uniform_real_distribution<float> jitter(-0.05f, 0.05f);
  std::vector<float> logits(N * E);
  std::vector<int64_t> by_rank(E);  // the expert of each rank, the largest first
  for (int64_t n = 0; n < N; ++n) {
    float* logit = logits.data() + n * E;
    std::iota(by_rank.begin(), by_rank.end(), int64_t{0});
    std::shuffle(by_rank.begin(), by_rank.end(), rng);
    const float top = base(rng);
    for (int64_t r = 0; r < E; ++r)
      logit[by_rank[r]] = round_to(top - 0.25f * r + jitter(rng), type);
    if (n % 3 == 0 && E > 1) {
      logit[by_rank[1]] = logit[by_rank[0]];
      if (K < E) logit[by_rank[K]] = logit[by_rank[K - 1]];
    }
  }
  return logits;
}

// The router in float64: softmax, each token's K largest probabilities (ties
// to the lower index) in descending order, their weights (divided by their
// sum when norm_topk_prob).
struct MoeRouteReference {
  std::vector<double> probs;        // (N, E)
  std::vector<int32_t> top_expert;  // (N, K)
  std::vector<double> top_weight;   // (N, K)
};
MoeRouteReference moe_route_reference(const std::vector<float>& logits, int64_t N, int64_t E,
                                      int64_t K, bool norm_topk_prob) {
  MoeRouteReference ref{std::vector<double>(N * E), std::vector<int32_t>(N * K),
                        std::vector<double>(N * K)};
  for (int64_t n = 0; n < N; ++n) {
    const float* logit = logits.data() + n * E;
    double* p = ref.probs.data() + n * E;
    const double top = *std::max_element(logit, logit + E);
    double sum = 0.0;
    for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(logit[e] - top);
    for (int64_t e = 0; e < E; ++e) p[e] /= sum;
    int32_t* chosen = ref.top_expert.data() + n * K;
    double* weight = ref.top_weight.data() + n * K;
    double total = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (std::find(chosen, chosen + k, int32_t(e)) != chosen + k) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      chosen[k] = int32_t(best);
      weight[k] = p[best];
      total += weight[k];
    }
    if (norm_topk_prob) {
      for (int64_t k = 0; k < K; ++k) weight[k] /= total;
    }
  }
  return ref;
}

// A routed batch as the kernels after the router take it: the float64
// router's probabilities and weights in fp32, its experts, and the N K routed
// rows grouped by expert (by token within an expert) by the function both
// backends group them with (group_routed_rows, core/model/model.h).
struct MoeRouting {
  std::vector<float> probs;         // (N, E)
  std::vector<int32_t> top_expert;  // (N, K)
  std::vector<float> top_weight;    // (N, K)
  std::vector<int32_t> row_of;      // (N, K): the row of token n's k-th slot
  std::vector<int32_t> row_token;   // (N K): the token of each row
};
MoeRouting moe_routing(int64_t N, int64_t E, int64_t K, bool norm_topk_prob, std::mt19937& rng) {
  const MoeRouteReference ref =
      moe_route_reference(moe_logits(N, E, K, DType::f32, rng), N, E, K, norm_topk_prob);
  MoeRouting routing{std::vector<float>(ref.probs.begin(), ref.probs.end()), ref.top_expert,
                     std::vector<float>(ref.top_weight.begin(), ref.top_weight.end()),
                     std::vector<int32_t>(N * K), std::vector<int32_t>(N * K)};
  std::vector<int64_t> expert_begin(size_t(E + 1));
  group_routed_rows(routing.top_expert.data(), N, K, E, expert_begin.data(), routing.row_of.data(),
                    routing.row_token.data());
  return routing;
}

// Token n's slots in increasing order of their experts.
std::vector<int64_t> slots_by_expert(const MoeRouting& routing, int64_t n, int64_t K) {
  std::vector<int64_t> order(K);
  std::iota(order.begin(), order.end(), int64_t{0});
  const int32_t* chosen = routing.top_expert.data() + n * K;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return chosen[a] < chosen[b]; });
  return order;
}

// The CPU backend's loops in fp32 (core/model/model.cpp: moe_combine and
// moe_backward), which the kernels repeat operation for operation: on the
// same inputs the GPU's fp32 results are these bits.
std::vector<float> moe_combine_cpu(const std::vector<float>& x2, const std::vector<float>& y,
                                   const MoeRouting& routing, int64_t N, int64_t C, int64_t K) {
  std::vector<float> out(N * C), sum(C);
  for (int64_t n = 0; n < N; ++n) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (const int64_t k : slots_by_expert(routing, n, K)) {
      const float weight = routing.top_weight[n * K + k];
      const float* row = y.data() + int64_t(routing.row_of[n * K + k]) * C;
      for (int64_t i = 0; i < C; ++i) sum[i] += weight * row[i];
    }
    for (int64_t i = 0; i < C; ++i) out[n * C + i] = x2[n * C + i] + sum[i];
  }
  return out;
}

std::vector<float> moe_row_grads_cpu(const std::vector<float>& dout, const MoeRouting& routing,
                                     int64_t N, int64_t C, int64_t K) {
  std::vector<float> rows(N * K * C);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const float weight = routing.top_weight[n * K + k];
      float* row = rows.data() + int64_t(routing.row_of[n * K + k]) * C;
      for (int64_t i = 0; i < C; ++i) row[i] = weight * dout[n * C + i];
    }
  }
  return rows;
}

std::vector<float> moe_router_backward_cpu(const MoeRouting& routing,
                                           const std::vector<float>& d_top_weight,
                                           const float* aux_grad, int64_t N, int64_t E, int64_t K,
                                           bool norm_topk_prob) {
  std::vector<float> d_logits(N * E);
  for (int64_t n = 0; n < N; ++n) {
    const float* p = routing.probs.data() + n * E;
    float* dp = d_logits.data() + n * E;
    for (int64_t e = 0; e < E; ++e) dp[e] = aux_grad != nullptr ? aux_grad[e] : 0.0f;
    const float* weight = routing.top_weight.data() + n * K;
    const float* dw = d_top_weight.data() + n * K;
    const int32_t* chosen = routing.top_expert.data() + n * K;
    if (norm_topk_prob) {
      float total = 0.0f, dot = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        total += p[chosen[k]];
        dot += dw[k] * weight[k];
      }
      for (int64_t k = 0; k < K; ++k) dp[chosen[k]] += (dw[k] - dot) / total;
    } else {
      for (int64_t k = 0; k < K; ++k) dp[chosen[k]] += dw[k];
    }
    double dot = 0.0;
    for (int64_t e = 0; e < E; ++e) dot += double(p[e]) * dp[e];
    for (int64_t e = 0; e < E; ++e) dp[e] = p[e] * (dp[e] - float(dot));
  }
  return d_logits;
}

std::vector<float> moe_sum_rows_cpu(const std::vector<float>& d_rows, const MoeRouting& routing,
                                    int64_t N, int64_t C, int64_t K) {
  std::vector<float> dx(N * C, 0.0f);
  for (int64_t n = 0; n < N; ++n) {
    for (const int64_t k : slots_by_expert(routing, n, K)) {
      const float* row = d_rows.data() + int64_t(routing.row_of[n * K + k]) * C;
      for (int64_t i = 0; i < C; ++i) dx[n * C + i] += row[i];
    }
  }
  return dx;
}

// Float64 references with Hugging Face's roundings in a low-precision model
// (Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock): the routing weights cast to
// the type [round]; each expert's rows times their weight [round];
// index_add_ into a zero tensor of the type, expert by expert [round each
// add]; the residual add [round].
std::vector<double> moe_combine_reference(const std::vector<float>& x2, const std::vector<float>& y,
                                          const MoeRouting& routing, int64_t N, int64_t C,
                                          int64_t K, const Round& round) {
  std::vector<double> out(N * C);
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<int64_t> order = slots_by_expert(routing, n, K);
    for (int64_t i = 0; i < C; ++i) {
      double sum = 0.0;
      for (const int64_t k : order) {
        const double weight = round(routing.top_weight[n * K + k]);
        sum = round(sum + round(weight * y[int64_t(routing.row_of[n * K + k]) * C + i]));
      }
      out[n * C + i] = round(x2[n * C + i] + sum);
    }
  }
  return out;
}

// Autograd through that product: d weight = the sum over C of
// round(dout * y), in fp32 and rounded [a tensor of the type]; the rows'
// gradient dout * round(weight) [round].
struct MoeWeightBackwardReference {
  std::vector<double> d_top_weight;  // (N, K)
  std::vector<double> d_rows;        // (N K, C)
};
MoeWeightBackwardReference moe_weight_backward_reference(const std::vector<float>& dout,
                                                         const std::vector<float>& y,
                                                         const MoeRouting& routing, int64_t N,
                                                         int64_t C, int64_t K, const Round& round) {
  MoeWeightBackwardReference ref{std::vector<double>(N * K), std::vector<double>(N * K * C)};
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = routing.row_of[n * K + k];
      const double weight = round(routing.top_weight[n * K + k]);
      double dot = 0.0;
      for (int64_t i = 0; i < C; ++i) {
        dot += round(double{dout[n * C + i]} * y[row * C + i]);
        ref.d_rows[row * C + i] = round(dout[n * C + i] * weight);
      }
      ref.d_top_weight[n * K + k] = round(dot);
    }
  }
  return ref;
}

// The router's backward runs in fp32 in Hugging Face (softmax(dtype=float),
// top k and renormalisation), its result cast to the logits' type [round].
std::vector<double> moe_router_backward_reference(const MoeRouting& routing,
                                                  const std::vector<float>& d_top_weight,
                                                  const float* aux_grad, int64_t N, int64_t E,
                                                  int64_t K, bool norm_topk_prob,
                                                  const Round& round) {
  std::vector<double> d_logits(N * E);
  for (int64_t n = 0; n < N; ++n) {
    const float* p = routing.probs.data() + n * E;
    double* dp = d_logits.data() + n * E;  // d p, then overwritten by d logits
    const float* weight = routing.top_weight.data() + n * K;
    const float* dw = d_top_weight.data() + n * K;
    const int32_t* chosen = routing.top_expert.data() + n * K;
    for (int64_t e = 0; e < E; ++e) dp[e] = aux_grad != nullptr ? aux_grad[e] : 0.0;
    double total = 0.0, dot = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      total += p[chosen[k]];
      dot += double{dw[k]} * weight[k];
    }
    for (int64_t k = 0; k < K; ++k) dp[chosen[k]] += norm_topk_prob ? (dw[k] - dot) / total : dw[k];
    double p_dot_dp = 0.0;
    for (int64_t e = 0; e < E; ++e) p_dot_dp += p[e] * dp[e];
    for (int64_t e = 0; e < E; ++e) dp[e] = round(p[e] * (dp[e] - p_dot_dp));
  }
  return d_logits;
}

// Autograd of the rows' gather: their gradients index-added into the
// input's gradient of the type, expert by expert [round each add].
std::vector<double> moe_sum_rows_reference(const std::vector<float>& d_rows,
                                           const MoeRouting& routing, int64_t N, int64_t C,
                                           int64_t K, const Round& round) {
  std::vector<double> dx(N * C);
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<int64_t> order = slots_by_expert(routing, n, K);
    for (int64_t i = 0; i < C; ++i) {
      double sum = 0.0;
      for (const int64_t k : order) {
        sum = round(sum + d_rows[int64_t(routing.row_of[n * K + k]) * C + i]);
      }
      dx[n * C + i] = sum;
    }
  }
  return dx;
}

std::vector<float> moe_gather(const std::vector<float>& x, const MoeRouting& routing, int64_t C) {
  std::vector<float> rows(routing.row_token.size() * C);
  for (size_t r = 0; r < routing.row_token.size(); ++r) {
    std::copy_n(x.begin() + int64_t(routing.row_token[r]) * C, C, rows.begin() + int64_t(r) * C);
  }
  return rows;
}

// fp32 results of a few roundings (and expf's 2 ulp) against float64.
constexpr double kMoeFp32Tolerance = 1e-6;

std::string moe_case(int64_t E, int64_t K, bool norm_topk_prob) {
  return "E=" + std::to_string(E) + " K=" + std::to_string(K) +
         (norm_topk_prob ? " norm_topk_prob" : "");
}

// fp32 routing against float64: the same experts in the same order (ties to
// the lower index), the probabilities and weights to fp32 rounding; the
// probabilities' sums in token order in float64, as the host adds them: the
// same bits.
TEST_F(CudaKernels, MoeRouteMatchesFloat64) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 37;
  for (const auto& [E, K] : {std::pair<int64_t, int64_t>{12, 3}, {7, 2}, {7, 7}, {64, 8}}) {
    for (const bool norm : {false, true}) {
      SCOPED_TRACE(moe_case(E, K, norm));
      const auto logits = moe_logits(N, E, K, DType::f32, rng_);
      const MoeRouteReference ref = moe_route_reference(logits, N, E, K, norm);
      auto d_logits = upload(logits, DType::f32);
      DeviceBuffer d_probs(N * E * 4), d_expert(N * K * 4), d_weight(N * K * 4), d_sums(E * 8);
      expect_ok(cuda::moe_route(d_probs.f32(), static_cast<int32_t*>(d_expert.get()),
                                d_weight.f32(), d_logits->get(), N, E, K, norm, DType::f32,
                                nullptr));
      expect_ok(
          cuda::moe_prob_sums(static_cast<double*>(d_sums.get()), d_probs.f32(), N, E, nullptr));
      const std::vector<float> probs = download(d_probs, N * E, DType::f32);
      EXPECT_EQ(download_raw<int32_t>(d_expert.get(), N * K), ref.top_expert);
      EXPECT_LE(relative_error(probs, ref.probs), kMoeFp32Tolerance) << "probs";
      EXPECT_LE(relative_error(download(d_weight, N * K, DType::f32), ref.top_weight),
                kMoeFp32Tolerance)
          << "top_weight";
      std::vector<double> sums(E, 0.0);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t e = 0; e < E; ++e) sums[e] += probs[n * E + e];
      EXPECT_EQ(download_raw<double>(d_sums.get(), E), sums);
    }
  }
}

// The rows around the experts in fp32: the gather exact; the combine and the
// rows' sum the CPU backend's bits, and within fp32 rounding of float64.
TEST_F(CudaKernels, MoeGatherCombineAndSumRowsMatchCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 37, C = 45;
  for (const auto& [E, K] : {std::pair<int64_t, int64_t>{12, 3}, {7, 2}}) {
    SCOPED_TRACE(moe_case(E, K, true));
    const int64_t R = N * K;
    const MoeRouting routing = moe_routing(N, E, K, true, rng_);
    const auto x = random_floats(N * C, rng_), x2 = random_floats(N * C, rng_);
    const auto y = random_floats(R * C, rng_), d_rows = random_floats(R * C, rng_);
    auto d_expert = upload_raw(routing.top_expert), d_row_of = upload_raw(routing.row_of);
    auto d_row_token = upload_raw(routing.row_token),
         d_weight = upload(routing.top_weight, DType::f32);
    auto d_x = upload(x, DType::f32), d_x2 = upload(x2, DType::f32), d_y = upload(y, DType::f32);
    auto d_d_rows = upload(d_rows, DType::f32);
    DeviceBuffer d_gathered(R * C * 4), d_out(N * C * 4), d_dx(N * C * 4);
    const auto* expert = static_cast<const int32_t*>(d_expert->get());
    const auto* row_of = static_cast<const int32_t*>(d_row_of->get());
    expect_ok(cuda::moe_gather_rows(d_gathered.get(), d_x->get(),
                                    static_cast<const int32_t*>(d_row_token->get()), R, N, C,
                                    DType::f32, nullptr));
    expect_ok(cuda::moe_combine(d_out.get(), d_x2->get(), d_y->get(), expert, row_of,
                                d_weight->f32(), N, C, K, DType::f32, nullptr));
    expect_ok(cuda::moe_sum_rows(d_dx.get(), d_d_rows->get(), expert, row_of, N, C, K, DType::f32,
                                 nullptr));
    EXPECT_EQ(download(d_gathered, R * C, DType::f32), moe_gather(x, routing, C));
    const std::vector<float> out = download(d_out, N * C, DType::f32);
    const std::vector<float> dx = download(d_dx, N * C, DType::f32);
    EXPECT_EQ(out, moe_combine_cpu(x2, y, routing, N, C, K));
    EXPECT_EQ(dx, moe_sum_rows_cpu(d_rows, routing, N, C, K));
    EXPECT_LE(relative_error(out, moe_combine_reference(x2, y, routing, N, C, K, exact())),
              kFp32Tolerance);
    EXPECT_LE(relative_error(dx, moe_sum_rows_reference(d_rows, routing, N, C, K, exact())),
              kFp32Tolerance);
  }
}

// The backward of the weights and the router in fp32: d_top_weight within
// fp32 rounding of float64 (its float64 sum runs in another order than the
// CPU's); the rows' gradients, written over the outputs, and the logits'
// gradient the CPU backend's bits, with and without renormalisation and the
// load-balancing loss's gradient.
TEST_F(CudaKernels, MoeBackwardMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 37, C = 45;
  for (const auto& [E, K] : {std::pair<int64_t, int64_t>{12, 3}, {7, 2}}) {
    for (const bool norm : {false, true}) {
      SCOPED_TRACE(moe_case(E, K, norm));
      const int64_t R = N * K;
      const MoeRouting routing = moe_routing(N, E, K, norm, rng_);
      const auto dout = random_floats(N * C, rng_), y = random_floats(R * C, rng_);
      const auto d_top_weight = random_floats(N * K, rng_), aux = random_floats(E, rng_, 0.1f);
      auto d_expert = upload_raw(routing.top_expert), d_row_of = upload_raw(routing.row_of);
      auto d_probs = upload(routing.probs, DType::f32);
      auto d_weight = upload(routing.top_weight, DType::f32);
      auto d_dout = upload(dout, DType::f32), d_y = upload(y, DType::f32);
      auto d_dw_in = upload(d_top_weight, DType::f32), d_aux = upload(aux, DType::f32);
      DeviceBuffer d_dw(N * K * 4), d_logits(N * E * 4);
      const auto* expert = static_cast<const int32_t*>(d_expert->get());

      expect_ok(cuda::moe_weight_backward(d_dw.f32(), d_y->get(), d_dout->get(),
                                          static_cast<const int32_t*>(d_row_of->get()),
                                          d_weight->f32(), N, C, K, DType::f32, nullptr));
      const MoeWeightBackwardReference ref =
          moe_weight_backward_reference(dout, y, routing, N, C, K, exact());
      EXPECT_LE(relative_error(download(d_dw, N * K, DType::f32), ref.d_top_weight),
                kMoeFp32Tolerance);
      EXPECT_EQ(download(*d_y, R * C, DType::f32), moe_row_grads_cpu(dout, routing, N, C, K));

      for (const bool with_aux : {false, true}) {
        SCOPED_TRACE(with_aux ? "aux_grad" : "no aux_grad");
        const float* aux_host = with_aux ? aux.data() : nullptr;
        expect_ok(cuda::moe_router_backward(d_logits.get(), d_probs->f32(), expert, d_weight->f32(),
                                            d_dw_in->f32(), with_aux ? d_aux->f32() : nullptr, N, E,
                                            K, norm, DType::f32, nullptr));
        const std::vector<float> d_logits_gpu = download(d_logits, N * E, DType::f32);
        EXPECT_EQ(d_logits_gpu,
                  moe_router_backward_cpu(routing, d_top_weight, aux_host, N, E, K, norm));
        EXPECT_LE(relative_error(d_logits_gpu,
                                 moe_router_backward_reference(routing, d_top_weight, aux_host, N,
                                                               E, K, norm, exact())),
                  kFp32Tolerance);
      }
    }
  }
}

// A sparse layer cut into groups of experts (strata.expert_groups): the
// groups' kernels over their slots add up to the whole layer's. The combine,
// group after group into an fp32 sum, gives moe_combine's bits; each group's
// weights' backward writes its slots as moe_weight_backward does, and leaves
// the others; the rows' sums, the last group first, round to moe_sum_rows's
// bits at top 2 (one addition commutes) and within fp32 rounding of float64
// at top 3.
TEST_F(CudaKernels, MoeGroupsOfExpertsAddUpToTheWholeLayer) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 37, C = 45;
  for (const auto& [E, K] : {std::pair<int64_t, int64_t>{12, 3}, {7, 2}}) {
    SCOPED_TRACE(moe_case(E, K, true));
    const int64_t R = N * K, G = 3;
    auto first = [&](int64_t g) { return g * E / G; };
    const MoeRouting routing = moe_routing(N, E, K, true, rng_);
    const auto x2 = random_floats(N * C, rng_), y = random_floats(R * C, rng_);
    const auto dout = random_floats(N * C, rng_), d_rows = random_floats(R * C, rng_);
    auto d_expert = upload_raw(routing.top_expert), d_row_of = upload_raw(routing.row_of);
    auto d_weight = upload(routing.top_weight, DType::f32);
    auto d_x2 = upload(x2, DType::f32), d_y = upload(y, DType::f32);
    auto d_dout = upload(dout, DType::f32), d_d_rows = upload(d_rows, DType::f32);
    const auto* expert = static_cast<const int32_t*>(d_expert->get());
    const auto* row_of = static_cast<const int32_t*>(d_row_of->get());
    DeviceBuffer d_sum(N * C * 4), d_out(N * C * 4), d_dx(N * C * 4);
    expect_ok(cuda::check_cuda(cudaMemset(d_sum.get(), 0, size_t(N * C) * 4), "zeroing"));
    for (int64_t g = 0; g < G; ++g)
      expect_ok(cuda::moe_combine_experts(d_sum.f32(), g == G - 1 ? d_out.get() : nullptr,
                                          d_x2->get(), d_y->get(), expert, row_of, d_weight->f32(),
                                          first(g), first(g + 1), N, C, K, DType::f32, nullptr));
    EXPECT_EQ(download(d_out, N * C, DType::f32), moe_combine_cpu(x2, y, routing, N, C, K));

    // The weights' backward, group by group, against the whole kernel's.
    auto d_y_whole = upload(y, DType::f32);
    DeviceBuffer d_dw_whole(N * K * 4), d_dw(N * K * 4);
    expect_ok(cuda::moe_weight_backward(d_dw_whole.f32(), d_y_whole->get(), d_dout->get(), row_of,
                                        d_weight->f32(), N, C, K, DType::f32, nullptr));
    const std::vector<float> unset(size_t(N * K), -7.0f);
    auto d_dw_groups = upload(unset, DType::f32);
    for (int64_t g = 0; g < G; ++g) {
      expect_ok(cuda::moe_weight_backward_experts(d_dw_groups->f32(), d_y->get(), d_dout->get(),
                                                  expert, row_of, d_weight->f32(), first(g),
                                                  first(g + 1), N, C, K, DType::f32, nullptr));
      // After group g, exactly the slots of experts below its end are written.
      const std::vector<float> dw = download(*d_dw_groups, N * K, DType::f32);
      for (int64_t slot = 0; slot < N * K; ++slot)
        EXPECT_EQ(dw[size_t(slot)] == -7.0f, routing.top_expert[size_t(slot)] >= first(g + 1))
            << "group " << g << ", slot " << slot;
    }
    EXPECT_EQ(download(*d_dw_groups, N * K, DType::f32), download(d_dw_whole, N * K, DType::f32));
    EXPECT_EQ(download(*d_y, R * C, DType::f32), download(*d_y_whole, R * C, DType::f32));

    // The rows' input gradients, the last group first, into one fp32 sum.
    for (int64_t g = G - 1; g >= 0; --g)
      expect_ok(cuda::moe_add_rows(d_sum.f32(), g != G - 1, d_d_rows->get(), expert, row_of,
                                   first(g), first(g + 1), N, C, K, DType::f32, nullptr));
    const std::vector<float> summed = download(d_sum, N * C, DType::f32);
    if (K <= 2) {
      EXPECT_EQ(summed, moe_sum_rows_cpu(d_rows, routing, N, C, K));
    }
    EXPECT_LE(relative_error(summed, moe_sum_rows_reference(d_rows, routing, N, C, K, exact())),
              kFp32Tolerance);
  }
}

// The fp32 sums an MLP cut into parts adds its products into: parts added
// in turn, then the residual, one rounding; in fp32 the host's fp32
// arithmetic in the same order, in bf16 and fp16 within one rounding of the
// float64 sum of the values as stored.
TEST_F(CudaKernels, PartsSumInFp32AndRoundOnce) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t n = 1000, parts = 3;
  for (const DType type : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(type_label(type));
    std::vector<std::vector<float>> products;
    for (int64_t p = 0; p < parts; ++p) products.push_back(random_floats(n, rng_));
    const auto x2 = random_floats(n, rng_);
    DeviceBuffer d_sum(n * 4), d_out(n * cuda::dtype_size(type));
    for (int64_t p = 0; p < parts; ++p) {
      auto d_product = upload(products[size_t(p)], type);
      expect_ok(cuda::accumulate_f32(d_sum.f32(), d_product->get(), n, p > 0, type, nullptr));
    }
    auto d_x2 = upload(x2, type);
    expect_ok(cuda::residual_add_f32(d_out.get(), d_x2->get(), d_sum.f32(), n, type, nullptr));
    // The inputs as the type holds them (upload rounds), then fp32 and float64 sums.
    std::vector<std::vector<float>> stored;
    for (const auto& product : products) {
      auto d = upload(product, type);
      stored.push_back(download(*d, n, type));
    }
    auto d_x2_stored = upload(x2, type);
    const std::vector<float> x2_stored = download(*d_x2_stored, n, type);
    std::vector<float> sum(static_cast<size_t>(n), 0.0f), out_fp32(static_cast<size_t>(n));
    std::vector<double> reference(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      double exact_sum = x2_stored[size_t(i)];
      for (int64_t p = 0; p < parts; ++p) {
        sum[size_t(i)] =
            p == 0 ? stored[0][size_t(i)] : sum[size_t(i)] + stored[size_t(p)][size_t(i)];
        exact_sum += stored[size_t(p)][size_t(i)];
      }
      out_fp32[size_t(i)] = x2_stored[size_t(i)] + sum[size_t(i)];
      reference[size_t(i)] = exact_sum;
    }
    EXPECT_EQ(download(d_sum, n, DType::f32), sum);
    const std::vector<float> out = download(d_out, n, type);
    if (type == DType::f32) {
      EXPECT_EQ(out, out_fp32);
    }
    EXPECT_LE(relative_error(out, reference), type == DType::f32 ? kFp32Tolerance : 1e-2);
  }
}

// Routing from logits of the type: the softmax is fp32 arithmetic on values
// exact in the type, as PyTorch's softmax(dtype=float), so the same experts
// and fp32 rounding of float64.
TEST_P(CudaKernelsLowPrecision, MoeRoute) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 37;
  for (const auto& [E, K] : {std::pair<int64_t, int64_t>{12, 3}, {7, 2}}) {
    for (const bool norm : {false, true}) {
      SCOPED_TRACE(moe_case(E, K, norm));
      const auto logits = moe_logits(N, E, K, type(), rng_);
      const MoeRouteReference ref = moe_route_reference(logits, N, E, K, norm);
      auto d_logits = upload(logits, type());
      DeviceBuffer d_probs(N * E * 4), d_expert(N * K * 4), d_weight(N * K * 4);
      expect_ok(cuda::moe_route(d_probs.f32(), static_cast<int32_t*>(d_expert.get()),
                                d_weight.f32(), d_logits->get(), N, E, K, norm, type(), nullptr));
      EXPECT_EQ(download_raw<int32_t>(d_expert.get(), N * K), ref.top_expert);
      EXPECT_LE(relative_error(download(d_probs, N * E, DType::f32), ref.probs), kMoeFp32Tolerance)
          << "probs";
      EXPECT_LE(relative_error(download(d_weight, N * K, DType::f32), ref.top_weight),
                kMoeFp32Tolerance)
          << "top_weight";
    }
  }
}

// The rows around the experts and the backwards in the type, against the
// float64 references above and their emulated PyTorch versions.
TEST_P(CudaKernelsLowPrecision, MoeRowsAndBackward) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t N = 37, C = 45;
  const Round round = rounding_to(type());
  for (const auto& [E, K] : {std::pair<int64_t, int64_t>{12, 3}, {7, 2}}) {
    for (const bool norm : {false, true}) {
      SCOPED_TRACE(moe_case(E, K, norm));
      const int64_t R = N * K;
      const MoeRouting routing = moe_routing(N, E, K, norm, rng_);
      const auto x = random(N * C), x2 = random(N * C), y = random(R * C);
      const auto dout = random(N * C), d_rows = random(R * C);
      const auto d_top_weight = random_floats(N * K, rng_), aux = random_floats(E, rng_, 0.1f);
      auto d_expert = upload_raw(routing.top_expert), d_row_of = upload_raw(routing.row_of);
      auto d_row_token = upload_raw(routing.row_token);
      auto d_probs = upload(routing.probs, DType::f32);
      auto d_weight = upload(routing.top_weight, DType::f32);
      auto d_x = upload(x, type()), d_x2 = upload(x2, type()), d_y = upload(y, type());
      auto d_dout = upload(dout, type()), d_d_rows = upload(d_rows, type());
      auto d_dw_in = upload(d_top_weight, DType::f32), d_aux = upload(aux, DType::f32);
      DeviceBuffer d_gathered(R * C * 2), d_out(N * C * 2), d_dx(N * C * 2), d_dw(N * K * 4);
      DeviceBuffer d_logits(N * E * 2);
      const auto* expert = static_cast<const int32_t*>(d_expert->get());
      const auto* row_of = static_cast<const int32_t*>(d_row_of->get());

      // A gather is exact in PyTorch too.
      expect_ok(cuda::moe_gather_rows(d_gathered.get(), d_x->get(),
                                      static_cast<const int32_t*>(d_row_token->get()), R, N, C,
                                      type(), nullptr));
      EXPECT_EQ(download(d_gathered, R * C, type()), moe_gather(x, routing, C));

      expect_ok(cuda::moe_combine(d_out.get(), d_x2->get(), d_y->get(), expert, row_of,
                                  d_weight->f32(), N, C, K, type(), nullptr));
      expect_within_twice_emulated(download(d_out, N * C, type()),
                                   moe_combine_reference(x2, y, routing, N, C, K, round),
                                   moe_combine_reference(x2, y, routing, N, C, K, exact()), "out");

      expect_ok(cuda::moe_weight_backward(d_dw.f32(), d_y->get(), d_dout->get(), row_of,
                                          d_weight->f32(), N, C, K, type(), nullptr));
      const MoeWeightBackwardReference exact_ref =
          moe_weight_backward_reference(dout, y, routing, N, C, K, exact());
      const MoeWeightBackwardReference emulated =
          moe_weight_backward_reference(dout, y, routing, N, C, K, round);
      expect_within_twice_emulated(download(d_dw, N * K, DType::f32), emulated.d_top_weight,
                                   exact_ref.d_top_weight, "d_top_weight");
      expect_within_twice_emulated(download(*d_y, R * C, type()), emulated.d_rows, exact_ref.d_rows,
                                   "the rows' gradients");

      for (const bool with_aux : {false, true}) {
        SCOPED_TRACE(with_aux ? "aux_grad" : "no aux_grad");
        const float* aux_host = with_aux ? aux.data() : nullptr;
        expect_ok(cuda::moe_router_backward(d_logits.get(), d_probs->f32(), expert, d_weight->f32(),
                                            d_dw_in->f32(), with_aux ? d_aux->f32() : nullptr, N, E,
                                            K, norm, type(), nullptr));
        expect_within_twice_emulated(
            download(d_logits, N * E, type()),
            moe_router_backward_reference(routing, d_top_weight, aux_host, N, E, K, norm, round),
            moe_router_backward_reference(routing, d_top_weight, aux_host, N, E, K, norm, exact()),
            "d_logits");
      }

      expect_ok(cuda::moe_sum_rows(d_dx.get(), d_d_rows->get(), expert, row_of, N, C, K, type(),
                                   nullptr));
      expect_within_twice_emulated(download(d_dx, N * C, type()),
                                   moe_sum_rows_reference(d_rows, routing, N, C, K, round),
                                   moe_sum_rows_reference(d_rows, routing, N, C, K, exact()), "dx");
    }
  }
}

// --- residual add and casts -----------------------------------------------------------

TEST_F(CudaKernels, ResidualAddMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t n = 10007;
  const auto a = random_floats(n, rng_), b = random_floats(n, rng_);
  std::vector<float> sum(n);
  for (int64_t i = 0; i < n; ++i) sum[i] = a[i] + b[i];
  auto d_a = upload(a, DType::f32), d_b = upload(b, DType::f32);
  expect_ok(cuda::residual_forward(d_a->get(), d_a->get(), d_b->get(), n, DType::f32, nullptr));
  EXPECT_EQ(download(*d_a, n, DType::f32), sum);
}

TEST_P(CudaKernelsLowPrecision, ResidualAddAndCasts) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t n = 10007;
  const auto a = random(n), b = random(n);
  std::vector<double> exact_sum(n), rounded_sum(n);
  for (int64_t i = 0; i < n; ++i) {
    exact_sum[i] = double{a[i]} + b[i];
    rounded_sum[i] = round_to(a[i] + b[i], type());  // PyTorch: fp32 add, one rounding
  }
  auto d_a = upload(a, type()), d_b = upload(b, type());
  DeviceBuffer d_sum(n * 2);
  expect_ok(cuda::residual_forward(d_sum.get(), d_a->get(), d_b->get(), n, type(), nullptr));
  expect_within_twice_emulated(download(d_sum, n, type()), rounded_sum, exact_sum, "a + b");
  EXPECT_EQ(download(d_sum, n, type()), std::vector<float>(rounded_sum.begin(), rounded_sum.end()));

  // fp32 -> type rounds to nearest even like the CPU conversions; back is exact.
  const auto wide = random_floats(n, rng_);
  auto d_wide = upload(wide, DType::f32);
  DeviceBuffer d_narrow(n * 2), d_back(n * 4);
  expect_ok(cuda::cast(d_narrow.get(), type(), d_wide->get(), DType::f32, n, nullptr));
  expect_ok(cuda::cast(d_back.get(), DType::f32, d_narrow.get(), type(), n, nullptr));
  EXPECT_EQ(download(d_back, n, DType::f32), rounded(wide, type()));
}

// --- gradient norm --------------------------------------------------------------------

TEST_F(CudaKernels, GradNormMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  for (const DType type : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(type_label(type));
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{8191}, int64_t{300007}}) {
      const auto grad = rounded(random_floats(n, rng_, 0.01f), type);
      const cpu::ElementType cpu_type = type == DType::f32    ? cpu::ElementType::f32
                                        : type == DType::bf16 ? cpu::ElementType::bf16
                                                              : cpu::ElementType::f16;
      auto d_grad = upload(grad, type);
      // The CPU kernel reads the same bits.
      std::vector<uint16_t> bits(n);
      for (int64_t i = 0; i < n; ++i) {
        bits[i] = type == DType::bf16 ? cpu::float_to_bf16(grad[i]) : cpu::float_to_f16(grad[i]);
      }
      const void* host = type == DType::f32 ? static_cast<const void*>(grad.data()) : bits.data();
      const Result<cpu::GradNormPartial> expected = cpu::grad_norm_squared(host, cpu_type, n);
      ASSERT_TRUE(expected.is_ok());
      DeviceBuffer scratch(cuda::grad_norm_scratch_bytes(n)),
          d_result(sizeof(cuda::GradNormResult));
      expect_ok(cuda::grad_norm_squared(static_cast<cuda::GradNormResult*>(d_result.get()),
                                        d_grad->get(), type, n, scratch.get(), scratch.bytes(),
                                        nullptr));
      cuda::GradNormResult result;
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(&result, d_result.get(), sizeof result, cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(result.nonfinite, 0);
      // Float64 sums in different orders: equal to float64 rounding.
      EXPECT_NEAR(result.sum_squares, expected->sum_squares, 1e-10 * expected->sum_squares) << n;

      if (n == 0) continue;
      for (const float bad :
           {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
        auto poisoned = grad;
        poisoned[n / 2] = bad;
        auto d_poisoned = upload(poisoned, type);
        expect_ok(cuda::grad_norm_squared(static_cast<cuda::GradNormResult*>(d_result.get()),
                                          d_poisoned->get(), type, n, scratch.get(),
                                          scratch.bytes(), nullptr));
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(&result, d_result.get(), sizeof result, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        EXPECT_EQ(result.nonfinite, 1) << "value " << bad << " n " << n;
      }
    }
  }
}

// --- AdamW ----------------------------------------------------------------------------

TEST_F(CudaKernels, AdamWIsBitwiseTheCpuStep) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t n = 40000 + 13;
  for (const DType grad_type : {DType::f32, DType::bf16, DType::f16}) {
    for (const DType copy_type : {DType::f32, DType::bf16, DType::f16}) {  // f32: no copy
      for (const bool decoupled : {true, false}) {
        SCOPED_TRACE(std::string(type_label(grad_type)) + " grad, " + type_label(copy_type) +
                     " copy, " + (decoupled ? "AdamW" : "Adam"));
        auto master = random_floats(n, rng_), m = random_floats(n, rng_, 0.01f);
        auto v = random_floats(n, rng_, 0.01f);
        for (float& x : v) x = x * x;
        const auto grad = rounded(random_floats(n, rng_, 0.1f), grad_type);
        cpu::AdamWHyperparams hyper;
        hyper.lr = 3e-4;
        hyper.weight_decay = 0.1;
        hyper.step = 7;
        hyper.grad_scale = 0.5;
        hyper.decoupled_weight_decay = decoupled;

        auto d_master = upload(master, DType::f32), d_m = upload(m, DType::f32);
        auto d_v = upload(v, DType::f32), d_grad = upload(grad, grad_type);
        DeviceBuffer d_copy(n * 2);
        cpu::AdamWShard shard;
        shard.numel = n;
        shard.master = d_master->f32();
        shard.exp_avg = d_m->f32();
        shard.exp_avg_sq = d_v->f32();
        shard.grad = d_grad->get();
        shard.grad_type = grad_type == DType::f32    ? cpu::ElementType::f32
                          : grad_type == DType::bf16 ? cpu::ElementType::bf16
                                                     : cpu::ElementType::f16;
        shard.copy = copy_type == DType::f32 ? nullptr : d_copy.get();
        shard.copy_type = copy_type == DType::f16 ? cpu::ElementType::f16 : cpu::ElementType::bf16;
        expect_ok(cuda::adamw_step(shard, hyper, nullptr));

        std::vector<uint16_t> grad_bits(n), copy_bits(n);
        for (int64_t i = 0; i < n; ++i) {
          grad_bits[i] =
              grad_type == DType::bf16 ? cpu::float_to_bf16(grad[i]) : cpu::float_to_f16(grad[i]);
        }
        cpu::AdamWShard host;
        host.numel = n;
        host.master = master.data();
        host.exp_avg = m.data();
        host.exp_avg_sq = v.data();
        host.grad =
            grad_type == DType::f32 ? static_cast<const void*>(grad.data()) : grad_bits.data();
        host.grad_type = grad_type == DType::f32    ? cpu::ElementType::f32
                         : grad_type == DType::bf16 ? cpu::ElementType::bf16
                                                    : cpu::ElementType::f16;
        host.copy = copy_type == DType::f32 ? nullptr : copy_bits.data();
        host.copy_type = copy_type == DType::f16 ? cpu::ElementType::f16 : cpu::ElementType::bf16;
        ASSERT_TRUE(cpu::adamw_step(host, hyper).is_ok());

        EXPECT_EQ(download(*d_master, n, DType::f32), master);
        EXPECT_EQ(download(*d_m, n, DType::f32), m);
        EXPECT_EQ(download(*d_v, n, DType::f32), v);
        if (copy_type != DType::f32) {
          std::vector<uint16_t> gpu_copy(n);
          ASSERT_EQ(cudaMemcpy(gpu_copy.data(), d_copy.get(), n * 2, cudaMemcpyDeviceToHost),
                    cudaSuccess);
          EXPECT_EQ(gpu_copy, copy_bits);
        }
      }
    }
  }
}

// Compact moments (bf16, int8): the GPU step on a shard cut into runs as the
// CPU optimizer cuts it (core/optimizer/optimizer.h compact_runs: parameter
// groups of odd lengths, int8 runs starting inside a 256-element window),
// three steps from a random state (int8: random codes and scales, a block of
// zero state and gradient, a block of tiny gradients), against the CPU
// kernel on the same runs. The CUDA kernel performs the CPU kernel's
// operations (kernels/cuda/adamw.h), so master, copy, moments and scales must
// be bitwise equal; a mismatch reports how far apart they are (bf16 moments
// in ulps, int8 codes in codes, scales and master relative).
TEST_F(CudaKernels, AdamWCompactMomentsAreBitwiseTheCpuStep) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t n = 5 * 256 + 1000 + 37;
  const std::vector<ShardSegment> segments = {{0, 300, ParamGroup::no_decay},
                                              {300, 301, ParamGroup::decay},
                                              {301, 1500, ParamGroup::decay},
                                              {1500, 1537, ParamGroup::no_decay},
                                              {1537, n, ParamGroup::decay}};
  std::uniform_int_distribution<int> m_code(-127, 127), root_code(0, 255);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  for (const cpu::AdamWStateType state : {cpu::AdamWStateType::bf16, cpu::AdamWStateType::int8}) {
    for (const DType grad_type : {DType::f32, DType::bf16}) {
      for (const DType copy_type : {DType::f32, DType::bf16, DType::f16}) {  // f32: no copy
        const bool int8 = state == cpu::AdamWStateType::int8;
        SCOPED_TRACE(std::string(cpu::adamw_state_type_name(state)) + " moments, " +
                     type_label(grad_type) + " grad, " + type_label(copy_type) + " copy");
        Result<std::vector<CompactRun>> runs = compact_runs(segments, n, state);
        ASSERT_TRUE(runs.is_ok()) << runs.status().message();
        const int64_t blocks = int8 ? int8_block_count(segments, n) : 0;
        const int64_t mb = int8 ? 1 : 2;
        // A random state in the stored format.
        std::vector<float> master = random_floats(n, rng_);
        std::vector<uint8_t> m(static_cast<size_t>(n * mb)), v(static_cast<size_t>(n * mb));
        std::vector<float> m_scale(static_cast<size_t>(blocks)),
            v_scale(static_cast<size_t>(blocks));
        if (int8) {
          for (int64_t i = 0; i < n; ++i) {
            m[size_t(i)] = static_cast<uint8_t>(static_cast<int8_t>(m_code(rng_)));
            v[size_t(i)] = static_cast<uint8_t>(root_code(rng_));
          }
          for (int64_t b = 0; b < blocks; ++b) {
            m_scale[size_t(b)] = 0.01f * unit(rng_);
            v_scale[size_t(b)] = 0.01f * unit(rng_);
          }
        } else {
          auto* const m16 = reinterpret_cast<uint16_t*>(m.data());
          auto* const v16 = reinterpret_cast<uint16_t*>(v.data());
          for (int64_t i = 0; i < n; ++i) {
            m16[i] = cpu::float_to_bf16(0.01f * (2.0f * unit(rng_) - 1.0f));
            const float root = 0.01f * unit(rng_);
            v16[i] = cpu::float_to_bf16(root * root);
          }
        }
        std::vector<float> grad = rounded(random_floats(n, rng_, 0.1f), grad_type);
        // Elements [256, 512): zero state and gradient (an int8 block with scale 0);
        // [1024, 1280): tiny gradients.
        for (int64_t i = 256; i < 512; ++i) {
          grad[size_t(i)] = 0.0f;
          std::fill_n(m.begin() + i * mb, mb, 0);
          std::fill_n(v.begin() + i * mb, mb, 0);
        }
        if (int8) {
          for (const CompactRun& r : *runs) {
            for (int64_t b = r.block; b < r.block + (r.end - r.begin + 255) / 256; ++b) {
              if (r.begin >= 256 && r.end <= 512) m_scale[size_t(b)] = v_scale[size_t(b)] = 0.0f;
            }
          }
        }
        for (int64_t i = 1024; i < 1280; ++i) grad[size_t(i)] *= 1e-20f;

        auto d_master = upload(master, DType::f32), d_grad = upload(grad, grad_type);
        auto d_m = upload_raw(m), d_v = upload_raw(v);
        auto d_m_scale = upload_raw(int8 ? m_scale : std::vector<float>(1));
        auto d_v_scale = upload_raw(int8 ? v_scale : std::vector<float>(1));
        DeviceBuffer d_copy(size_t(n) * 2);
        std::vector<uint16_t> grad_bits(static_cast<size_t>(n)), copy_bits(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) grad_bits[size_t(i)] = cpu::float_to_bf16(grad[size_t(i)]);

        for (int64_t step = 1; step <= 3; ++step) {
          for (const CompactRun& r : *runs) {
            cpu::AdamWHyperparams hyper;
            hyper.lr = 1e-3;
            hyper.weight_decay = r.group == ParamGroup::decay ? 0.1 : 0.0;
            hyper.step = step;
            hyper.grad_scale = 0.5;
            const int64_t count = r.end - r.begin;

            cpu::AdamWShard shard;
            shard.numel = count;
            shard.state_type = state;
            shard.master = d_master->f32() + r.begin;
            shard.exp_avg = static_cast<uint8_t*>(d_m->get()) + r.begin * mb;
            shard.exp_avg_sq = static_cast<uint8_t*>(d_v->get()) + r.begin * mb;
            if (int8) {
              shard.exp_avg_scale = d_m_scale->f32() + r.block;
              shard.exp_avg_sq_scale = d_v_scale->f32() + r.block;
            }
            shard.grad = static_cast<const uint8_t*>(d_grad->get()) +
                         r.begin * int64_t(cuda::dtype_size(grad_type));
            shard.grad_type =
                grad_type == DType::f32 ? cpu::ElementType::f32 : cpu::ElementType::bf16;
            shard.copy = copy_type == DType::f32
                             ? nullptr
                             : static_cast<void*>(static_cast<uint16_t*>(d_copy.get()) + r.begin);
            shard.copy_type =
                copy_type == DType::f16 ? cpu::ElementType::f16 : cpu::ElementType::bf16;
            expect_ok(cuda::adamw_step(shard, hyper, nullptr));

            cpu::AdamWShard host;
            host.numel = count;
            host.state_type = state;
            host.master = master.data() + r.begin;
            host.exp_avg = m.data() + r.begin * mb;
            host.exp_avg_sq = v.data() + r.begin * mb;
            if (int8) {
              host.exp_avg_scale = m_scale.data() + r.block;
              host.exp_avg_sq_scale = v_scale.data() + r.block;
            }
            host.grad = grad_type == DType::f32 ? static_cast<const void*>(grad.data() + r.begin)
                                                : grad_bits.data() + r.begin;
            host.grad_type =
                grad_type == DType::f32 ? cpu::ElementType::f32 : cpu::ElementType::bf16;
            host.copy = copy_type == DType::f32 ? nullptr : copy_bits.data() + r.begin;
            host.copy_type =
                copy_type == DType::f16 ? cpu::ElementType::f16 : cpu::ElementType::bf16;
            ASSERT_TRUE(cpu::adamw_step(host, hyper).is_ok());
          }
        }

        const std::vector<float> gpu_master = download(d_master->get(), size_t(n), DType::f32);
        std::vector<uint8_t> gpu_m(m.size()), gpu_v(v.size());
        ASSERT_EQ(cudaMemcpy(gpu_m.data(), d_m->get(), m.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(gpu_v.data(), d_v->get(), v.size(), cudaMemcpyDeviceToHost),
                  cudaSuccess);
        // How far apart, for the failure message.
        double master_error = 0.0;
        for (int64_t i = 0; i < n; ++i) {
          const double a = gpu_master[size_t(i)], b = master[size_t(i)];
          master_error = std::max(master_error, std::fabs(a - b) / std::max(std::fabs(b), 1e-30));
        }
        int moment_error = 0;  // bf16: ulps (the bits of same-sign values); int8: codes
        for (int64_t i = 0; i < n; ++i) {
          for (int f = 0; f < 2; ++f) {
            const auto& gpu_state = f == 0 ? gpu_m : gpu_v;
            const auto& cpu_state = f == 0 ? m : v;
            int a, b;
            if (int8 && f == 0) {
              a = static_cast<int8_t>(gpu_state[size_t(i)]);
              b = static_cast<int8_t>(cpu_state[size_t(i)]);
            } else if (int8) {
              a = gpu_state[size_t(i)];
              b = cpu_state[size_t(i)];
            } else {
              a = reinterpret_cast<const uint16_t*>(gpu_state.data())[i];
              b = reinterpret_cast<const uint16_t*>(cpu_state.data())[i];
            }
            moment_error = std::max(moment_error, std::abs(a - b));
          }
        }
        EXPECT_EQ(gpu_master, master) << "largest relative master difference " << master_error;
        EXPECT_EQ(gpu_m, m) << "largest moment difference " << moment_error;
        EXPECT_EQ(gpu_v, v) << "largest moment difference " << moment_error;
        if (int8) {
          EXPECT_EQ(download(d_m_scale->get(), size_t(blocks), DType::f32), m_scale);
          EXPECT_EQ(download(d_v_scale->get(), size_t(blocks), DType::f32), v_scale);
          // The blocks of zero state and gradient keep scale 0.
          for (const CompactRun& r : *runs) {
            if (r.begin >= 256 && r.end <= 512) {
              for (int64_t b = r.block; b < r.block + (r.end - r.begin + 255) / 256; ++b)
                EXPECT_EQ(m_scale[size_t(b)], 0.0f) << "block " << b;
            }
          }
        }
        if (copy_type != DType::f32) {
          std::vector<uint16_t> gpu_copy(static_cast<size_t>(n));
          ASSERT_EQ(
              cudaMemcpy(gpu_copy.data(), d_copy.get(), size_t(n) * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
          EXPECT_EQ(gpu_copy, copy_bits);
        }
      }
    }
  }
}

// --- matrix products ------------------------------------------------------------------

TEST_F(CudaKernels, MatmulMatchesCpu) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  auto matmuls = cuda::Matmuls::create();
  ASSERT_TRUE(matmuls.is_ok()) << matmuls.status().message();
  const int64_t N = 67, C = 130, OC = 45;
  const auto inp = random_floats(N * C, rng_), weight = random_floats(OC * C, rng_);
  const auto dout = random_floats(N * OC, rng_), out_prefill = random_floats(N * OC, rng_);
  const auto dinp_prefill = random_floats(N * C, rng_), dw_prefill = random_floats(OC * C, rng_);
  std::vector<float> out(N * OC), out_acc = out_prefill, dinp = dinp_prefill, dw = dw_prefill;
  cpu::matmul_forward(out.data(), inp.data(), weight.data(), N, C, OC);
  cpu::matmul_forward(out_acc.data(), inp.data(), weight.data(), N, C, OC, /*accumulate=*/true);
  cpu::matmul_backward(dinp.data(), dw.data(), dout.data(), inp.data(), weight.data(), N, C, OC);

  auto d_inp = upload(inp, DType::f32), d_weight = upload(weight, DType::f32);
  auto d_dout = upload(dout, DType::f32), d_acc = upload(out_prefill, DType::f32);
  auto d_dinp = upload(dinp_prefill, DType::f32), d_dw = upload(dw_prefill, DType::f32);
  DeviceBuffer d_out(N * OC * 4);
  cuda::Matmuls& mm = **matmuls;
  expect_ok(
      mm.forward(d_out.get(), d_inp->get(), d_weight->get(), N, C, OC, DType::f32, false, nullptr));
  expect_ok(
      mm.forward(d_out.get(), d_inp->get(), d_weight->get(), N, C, OC, DType::f32, false, nullptr));
  EXPECT_EQ(mm.cached_plans(), 1u) << "the second product of a shape reuses its plan";
  expect_ok(
      mm.forward(d_acc->get(), d_inp->get(), d_weight->get(), N, C, OC, DType::f32, true, nullptr));
  expect_ok(mm.backward(d_dinp->get(), d_dw->f32(), d_dout->get(), d_inp->get(), d_weight->get(), N,
                        C, OC, DType::f32, nullptr));
  expect_matches_cpu(download(d_out, N * OC, DType::f32), out, "out");
  expect_matches_cpu(download(*d_acc, N * OC, DType::f32), out_acc, "out (accumulate)");

  // A weight 16 bytes into a flat buffer (as tensors sit inside a unit's buffer)
  // gets a plan of its own for that alignment.
  std::vector<float> flat(4 + OC * C, 0.0f);
  std::copy(weight.begin(), weight.end(), flat.begin() + 4);
  auto d_flat = upload(flat, DType::f32);
  DeviceBuffer d_out2(N * OC * 4);
  expect_ok(mm.forward(d_out2.get(), d_inp->get(), d_flat->f32() + 4, N, C, OC, DType::f32, false,
                       nullptr));
  EXPECT_EQ(mm.cached_plans(), 5u);  // forward, accumulate, dinp, dweight, this one
  expect_matches_cpu(download(d_out2, N * OC, DType::f32), out, "out (weight at 16 bytes)");
  expect_matches_cpu(download(*d_dinp, N * C, DType::f32), dinp, "dinp (+=)");
  expect_matches_cpu(download(*d_dw, OC * C, DType::f32), dw, "dweight (+=)");
}

// The plan cache keeps the most recently used shapes up to its limit (a
// mixture's experts see a new row count almost every step); a dropped shape
// is planned again and gives the same product.
TEST_F(CudaKernels, MatmulPlanCacheKeepsTheMostRecentShapes) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  auto matmuls = cuda::Matmuls::create();
  ASSERT_TRUE(matmuls.is_ok()) << matmuls.status().message();
  cuda::Matmuls& mm = **matmuls;
  EXPECT_EQ(mm.plan_limit(), cuda::Matmuls::kDefaultPlanLimit);
  mm.set_plan_limit(2);
  const int64_t C = 40, OC = 24;
  const auto weight = random_floats(OC * C, rng_);
  auto d_weight = upload(weight, DType::f32);
  auto product = [&](int64_t N) {
    const auto inp = random_floats(N * C, rng_);
    std::vector<float> out(size_t(N * OC));
    cpu::matmul_forward(out.data(), inp.data(), weight.data(), N, C, OC);
    auto d_inp = upload(inp, DType::f32);
    DeviceBuffer d_out(N * OC * 4);
    expect_ok(mm.forward(d_out.get(), d_inp->get(), d_weight->get(), N, C, OC, DType::f32, false,
                         nullptr));
    expect_matches_cpu(download(d_out, N * OC, DType::f32), out, "rows " + std::to_string(N));
  };
  product(7);
  product(9);
  product(7);   // the most recent again
  product(11);  // drops 9, the least recently used
  EXPECT_EQ(mm.cached_plans(), 2u);
  product(9);  // planned again
  EXPECT_EQ(mm.cached_plans(), 2u);
  mm.set_plan_limit(0);  // at least one is kept
  EXPECT_EQ(mm.plan_limit(), 1u);
  EXPECT_EQ(mm.cached_plans(), 1u);
  product(7);
}

// PyTorch's bf16 linear: cuBLAS with fp32 accumulation, each output rounded
// once; a bf16 model's weight gradient is bf16 [round], ours stays fp32.
TEST_P(CudaKernelsLowPrecision, Matmul) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  auto matmuls = cuda::Matmuls::create();
  ASSERT_TRUE(matmuls.is_ok()) << matmuls.status().message();
  const int64_t N = 96, C = 256, OC = 160;
  const auto inp = random(N * C), weight = random(OC * C), dout = random(N * OC);
  std::vector<double> out(N * OC, 0.0), dinp(N * C, 0.0), dw(OC * C, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < OC; ++o) {
      for (int64_t c = 0; c < C; ++c) {
        out[n * OC + o] += double{inp[n * C + c]} * weight[o * C + c];
        dinp[n * C + c] += double{dout[n * OC + o]} * weight[o * C + c];
        dw[o * C + c] += double{dout[n * OC + o]} * inp[n * C + c];
      }
    }
  }
  auto d_inp = upload(inp, type()), d_weight = upload(weight, type()),
       d_dout = upload(dout, type());
  DeviceBuffer d_out(N * OC * 2), d_dinp(N * C * 2), d_dw(OC * C * 4);
  cuda::Matmuls& mm = **matmuls;
  expect_ok(
      mm.forward(d_out.get(), d_inp->get(), d_weight->get(), N, C, OC, type(), false, nullptr));
  expect_ok(mm.backward(d_dinp.get(), d_dw.f32(), d_dout->get(), d_inp->get(), d_weight->get(), N,
                        C, OC, type(), nullptr));
  const Round round = rounding_to(type());
  expect_within_twice_emulated(download(d_out, N * OC, type()), map_round(out, round), out, "out");
  expect_within_twice_emulated(download(d_dinp, N * C, type()), map_round(dinp, round), dinp,
                               "dinp");
  expect_within_twice_emulated(download(d_dw, OC * C, DType::f32), map_round(dw, round), dw,
                               "dweight");
}

// --- determinism ----------------------------------------------------------------------

// The reductions over rows (embedding and RMSNorm weight gradients) use no
// atomics: the same inputs give the same bits, run after run.
TEST_F(CudaKernels, ParameterGradientsAreBitwiseReproducible) {
  SCOPED_TRACE("seed " + std::to_string(seed_));
  const int64_t V = 40, C = 200, N = 700;
  const auto x = rounded(random_floats(N * C, rng_), DType::bf16);
  const auto dy = rounded(random_floats(N * C, rng_), DType::bf16);
  const auto w = rounded(random_floats(C, rng_), DType::bf16);
  const auto tokens = random_tokens(N, V, rng_);
  auto d_x = upload(x, DType::bf16), d_dy = upload(dy, DType::bf16), d_w = upload(w, DType::bf16);
  auto d_tokens = upload_raw(tokens);
  DeviceBuffer d_out(N * C * 2), d_rstd(N * 4);
  expect_ok(cuda::rmsnorm_forward(d_out.get(), d_rstd.f32(), d_x->get(), d_w->get(), N, C, 1e-5f,
                                  DType::bf16, nullptr));
  std::vector<float> first_dw, first_dtable;
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer d_dx(N * C * 2), d_dw(C * 4), d_dtable(V * C * 4);
    DeviceBuffer scratch(std::max(cuda::rmsnorm_backward_scratch_bytes(N, C),
                                  cuda::embedding_backward_scratch_bytes(N, V)));
    expect_ok(cuda::rmsnorm_backward(d_dx.get(), d_dw.f32(), d_dy->get(), d_x->get(), d_w->get(),
                                     d_rstd.f32(), N, C, DType::bf16, scratch.get(),
                                     scratch.bytes(), nullptr));
    expect_ok(cuda::embedding_backward(d_dtable.f32(), d_dy->get(),
                                       static_cast<int32_t*>(d_tokens->get()), N, C, V, DType::bf16,
                                       scratch.get(), scratch.bytes(), nullptr));
    auto dw = download(d_dw, C, DType::f32);
    auto dtable = download(d_dtable, V * C, DType::f32);
    if (run == 0) {
      first_dw = std::move(dw);
      first_dtable = std::move(dtable);
    } else {
      EXPECT_EQ(dw, first_dw);
      EXPECT_EQ(dtable, first_dtable);
    }
  }
}

// --- errors ---------------------------------------------------------------------------

// Argument checks come before any CUDA call, so these run without a GPU too.
TEST(CudaKernelErrors, NameTheKernelTypeAndShape) {
  cuda::AttentionShape shape;
  shape.B = 1;
  shape.T = 2048;
  shape.H = 32;
  shape.KV = 8;
  shape.D = 256;
  shape.row_stride = 48 * 256;
  const Status status = cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, shape,
                                                DType::bf16, nullptr);
  ASSERT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("attention_forward<bf16>"), std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("D=256"), std::string::npos) << status.message();

  const Status rope =
      cuda::rope_forward(nullptr, nullptr, nullptr, 1, 4, 2, 7, 14, DType::f16, nullptr);
  ASSERT_FALSE(rope.is_ok());
  EXPECT_NE(rope.message().find("rope_forward<fp16> (B=1 T=4 heads=2 D=7"), std::string::npos)
      << rope.message();

  // Compact moments: int8 needs its scales, other formats take none.
  cpu::AdamWShard compact;
  compact.numel = 10;
  compact.state_type = cpu::AdamWStateType::int8;
  compact.master = reinterpret_cast<float*>(16);
  compact.exp_avg = compact.exp_avg_sq = compact.master;
  compact.grad = compact.master;
  const Status no_scales = cuda::adamw_step(compact, cpu::AdamWHyperparams{}, nullptr);
  ASSERT_FALSE(no_scales.is_ok());
  EXPECT_NE(no_scales.message().find("int8 moments need"), std::string::npos)
      << no_scales.message();
  compact.state_type = cpu::AdamWStateType::bf16;
  compact.exp_avg_scale = compact.exp_avg_sq_scale = compact.master;
  const Status extra = cuda::adamw_step(compact, cpu::AdamWHyperparams{}, nullptr);
  ASSERT_FALSE(extra.is_ok());
  EXPECT_NE(extra.message().find("bf16 moments were given some"), std::string::npos)
      << extra.message();

  const Status scratch = cuda::rmsnorm_backward(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                nullptr, 64, 128, DType::f32, nullptr, 0, nullptr);
  ASSERT_FALSE(scratch.is_ok());
  EXPECT_NE(scratch.message().find("rmsnorm_backward<fp32> (N=64 C=128)"), std::string::npos)
      << scratch.message();
}

// A token's top k must lie in [1, min(E, kMoeMaxTopK)] ([1, kMoeMaxTopK] where
// the call has no E), and a group's combine needs its sum; checked before any
// CUDA call.
TEST(CudaKernelErrors, MoeRefusesATopKOutsideItsRange) {
  const Status above_experts =
      cuda::moe_route(nullptr, nullptr, nullptr, nullptr, 37, 12, 13, true, DType::bf16, nullptr);
  ASSERT_FALSE(above_experts.is_ok());
  EXPECT_NE(above_experts.message().find("moe_route<bf16> (N=37 E=12 K=13): K outside [1, 12]"),
            std::string::npos)
      << above_experts.message();

  const Status above_limit = cuda::moe_route(nullptr, nullptr, nullptr, nullptr, 37, 64,
                                             cuda::kMoeMaxTopK + 1, false, DType::f32, nullptr);
  ASSERT_FALSE(above_limit.is_ok());
  EXPECT_NE(above_limit.message().find("moe_route<fp32> (N=37 E=64 K=33): K outside [1, 32]"),
            std::string::npos)
      << above_limit.message();

  const Status none = cuda::moe_router_backward(nullptr, nullptr, nullptr, nullptr, nullptr,
                                                nullptr, 37, 12, 0, false, DType::f32, nullptr);
  ASSERT_FALSE(none.is_ok());
  EXPECT_NE(none.message().find("moe_router_backward<fp32> (N=37 E=12 K=0)"), std::string::npos)
      << none.message();

  const Status combine = cuda::moe_combine(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 37,
                                           45, cuda::kMoeMaxTopK + 1, DType::f16, nullptr);
  ASSERT_FALSE(combine.is_ok());
  EXPECT_NE(combine.message().find("moe_combine<fp16> (N=37 C=45 K=33): K outside [1, 32]"),
            std::string::npos)
      << combine.message();

  const Status weights = cuda::moe_weight_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 37,
                                                   45, 0, DType::bf16, nullptr);
  ASSERT_FALSE(weights.is_ok());
  EXPECT_NE(weights.message().find("moe_weight_backward<bf16> (N=37 C=45 K=0)"), std::string::npos)
      << weights.message();

  const Status sum_rows =
      cuda::moe_sum_rows(nullptr, nullptr, nullptr, nullptr, 37, 45, 0, DType::bf16, nullptr);
  ASSERT_FALSE(sum_rows.is_ok());
  EXPECT_NE(sum_rows.message().find("moe_sum_rows<bf16> (N=37 C=45 K=0)"), std::string::npos)
      << sum_rows.message();

  // A group's combine needs its fp32 sum, and x2 where it outputs (the last group).
  const Status no_sum =
      cuda::moe_combine_experts(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 4,
                                37, 45, 2, DType::bf16, nullptr);
  ASSERT_FALSE(no_sum.is_ok());
  EXPECT_NE(no_sum.message().find("moe_combine_experts<bf16> (N=37 C=45): no sum"),
            std::string::npos)
      << no_sum.message();
  float sum = 0, out = 0;
  const Status no_x2 = cuda::moe_combine_experts(&sum, &out, nullptr, nullptr, nullptr, nullptr,
                                                 nullptr, 0, 4, 37, 45, 2, DType::f32, nullptr);
  ASSERT_FALSE(no_x2.is_ok());
  EXPECT_NE(no_x2.message().find("moe_combine_experts<fp32> (N=37 C=45): an output without x2"),
            std::string::npos)
      << no_x2.message();
}

// The embedding's backward scratch holds its four index buffers and CUB's
// sort. A plan for a GPU made where there is none sizes it too: CUB cannot
// answer without a device (it once gave 0), so the sort is estimated there.
TEST(CudaKernelErrors, TheEmbeddingScratchHoldsTheSortWithOrWithoutADevice) {
  int devices = 0;
  const bool gpu = cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0;
  cudaGetLastError();
  for (int64_t N : {int64_t{1}, int64_t{4096}, int64_t{16384}}) {
    const std::size_t indices = 4 * ((std::size_t(N) * 4 + 255) / 256 * 256);
    const std::size_t bytes = cuda::embedding_backward_scratch_bytes(N, 152064);
    EXPECT_GT(bytes, indices) << "N " << N;
    if (!gpu) {
      EXPECT_GE(bytes, indices + 12 * std::size_t(N) + (std::size_t{64} << 10)) << "N " << N;
    }
  }
  // Where there is no driver every call reports that again; with a GPU none is left behind.
  if (gpu) {
    EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "the size query leaves no error behind";
  }
}

}  // namespace
}  // namespace strata::testing

#else  // a CPU-only build has no CUDA kernels to test

TEST(CudaKernels, NeedACudaBuild) {
  GTEST_SKIP() << "built without CUDA";
}

#endif
