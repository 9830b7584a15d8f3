// A whole model's forward and backward on the GPU against the CPU backend's
// model_forward_backward (core/model.h), on a small Llama with grouped-query
// heads, llama3 RoPE scaling, a sequence length that is not a multiple of the
// attention tiles, tied and untied heads.
//
// GpuUnits below is a small driver written for this test: it runs the units in
// the order and with the semantics of core/model.cpp's UnitKernels (the same
// fused qkv and gate/up products, residuals added by accumulating products,
// per-unit recomputation in the backward), with every operation on the GPU.
// fp32: the loss and every parameter gradient within 1e-4 relative error of the
// CPU backend (TF32 off). bf16 and fp16: parameters rounded to the type and
// activations kept in it, so the comparison with the fp32 CPU model is loose
// (loss within 1e-2, each gradient tensor within 1e-1; fp16 with a loss scale
// of 1024, as fp16 training runs); the per-kernel tests
// (tests/cuda_kernels_test.cpp, tests/cuda_attention_test.cpp) hold the tight bounds.
#include <gtest/gtest.h>

#if STRATA_HAS_CUDA

#include <fmt/format.h>

#include <memory>
#include <random>
#include <vector>

#include "core/model.h"
#include "kernels/cpu/rope.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda_test_support.h"

namespace strata::testing {
namespace {

namespace cuda = kernels::cuda;
namespace cpu = kernels::cpu;

ModelConfig small_config(bool tied) {
  ModelConfig c;
  c.vocab_size = 301;
  c.hidden_size = 128;
  c.intermediate_size = 352;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = 128;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 500000.0;
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.original_max_position_embeddings = 16;
  c.tie_word_embeddings = tied;
  return c;
}

// Runs the units of `model` on the GPU in compute type `type`. Parameters are
// copied once (cast on the device); gradients accumulate in fp32 per unit.
class GpuUnits {
 public:
  GpuUnits(const HostModel& model, int64_t B, int64_t T, DType type, cuda::Matmuls& matmuls)
      : c_(model.layout.config), layout_(model.layout), B_(B), T_(T), type_(type), mm_(matmuls) {
    const int64_t N = B * T, C = c_.hidden_size, I = c_.intermediate_size, V = c_.vocab_size;
    const int64_t H = c_.num_attention_heads, KV = c_.num_key_value_heads, D = c_.head_dim;
    qkv_width_ = (H + 2 * KV) * D;
    for (size_t u = 0; u < layout_.units.size(); ++u) {
      const int64_t numel = layout_.units[u].padded_numel;
      auto master = upload(model.params[u], DType::f32);
      params_.push_back(buffer(numel, type));
      expect_ok(cuda::cast(params_.back()->get(), type, master->get(), DType::f32, numel, nullptr));
      grads_.push_back(buffer(numel, DType::f32));
    }
    // RoPE tables as core/model.cpp's UnitWorkspace computes them.
    cpu::RopeParams rope;
    rope.head_dim = D;
    rope.theta = c_.rope_theta;
    rope.llama3_scaling = c_.rope_scaling.type == "llama3";
    rope.factor = c_.rope_scaling.factor;
    rope.low_freq_factor = c_.rope_scaling.low_freq_factor;
    rope.high_freq_factor = c_.rope_scaling.high_freq_factor;
    rope.original_max_positions = c_.rope_scaling.original_max_position_embeddings;
    std::vector<float> inv_freq(D / 2), cos(T * D / 2), sin(T * D / 2);
    cpu::rope_inv_freq(inv_freq.data(), rope);
    cpu::rope_cos_sin(cos.data(), sin.data(), inv_freq.data(), T, D);
    cos_ = upload(cos, DType::f32);
    sin_ = upload(sin, DType::f32);
    // Activations of one layer (recomputed in its backward) and scratch.
    xn1_ = buffer(N * C, type);
    rstd1_ = buffer(N, DType::f32);
    qkv_ = buffer(N * qkv_width_, type);
    lse_ = buffer(B * H * T, DType::f32);
    attn_ = buffer(N * H * D, type);
    x2_ = buffer(N * C, type);
    xn2_ = buffer(N * C, type);
    rstd2_ = buffer(N, DType::f32);
    gate_up_ = buffer(N * 2 * I, type);
    mlp_ = buffer(N * I, type);
    d_mlp_ = buffer(N * I, type);
    d_gate_up_ = buffer(N * 2 * I, type);
    d_xn_ = buffer(N * C, type);
    d_attn_ = buffer(N * H * D, type);
    d_qkv_ = buffer(N * qkv_width_, type);
    delta_ = buffer(B * H * T, DType::f32);
    logits_ = buffer(N * V, type);
    losses_ = buffer(N, DType::f32);
    const std::size_t scratch = std::max(cuda::rmsnorm_backward_scratch_bytes(N, C),
                                         cuda::embedding_backward_scratch_bytes(N, V));
    scratch_ = std::make_unique<DeviceBuffer>(scratch);
    units_in_.resize(layout_.units.size() - 1);
    for (auto& in : units_in_) in = buffer(N * C, type);
    grad_ = buffer(N * C, type);
  }

  // One micro-batch, as core/model.cpp's model_forward_backward: returns the
  // sum of token losses; gradients accumulate into grads().
  double forward_backward(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                          float loss_scale) {
    auto d_tokens = upload_raw(tokens), d_targets = upload_raw(targets);
    const int32_t* tok = static_cast<int32_t*>(d_tokens->get());
    const int32_t* tgt = static_cast<int32_t*>(d_targets->get());
    const int64_t units = static_cast<int64_t>(layout_.units.size());
    const int64_t N = B_ * T_, C = c_.hidden_size, V = c_.vocab_size;
    expect_ok(
        cuda::embedding_forward(units_in_[0]->get(), tok, params_[0]->get(), N, C, type_, nullptr));
    for (int64_t u = 1; u + 1 < units; ++u) {
      layer_forward(u, units_in_[u - 1]->get(), units_in_[u]->get());
    }
    head_forward_backward(units_in_[units - 2]->get(), tgt, loss_scale);
    for (int64_t u = units - 2; u >= 1; --u) {
      layer_backward(u, units_in_[u - 1]->get(), grad_->get(), grad_->get());
    }
    expect_ok(cuda::embedding_backward(grads_[0]->f32(), grad_->get(), tok, N, C, V, type_,
                                       scratch_->get(), scratch_->bytes(), nullptr));
    double loss = 0.0;
    for (float x : download(*losses_, N, DType::f32)) loss += x;
    return loss;
  }

  std::vector<float> grads(size_t u) const {
    return download(*grads_[u], layout_.units[u].padded_numel, DType::f32);
  }

 private:
  std::unique_ptr<DeviceBuffer> buffer(int64_t n, DType type) {
    return std::make_unique<DeviceBuffer>(n * cuda::dtype_size(type));
  }
  // Element `offset` of a flat buffer of the compute type.
  void* at(const DeviceBuffer& flat, int64_t offset) const {
    return static_cast<char*>(flat.get()) + offset * cuda::dtype_size(type_);
  }
  const TensorSlot& slot(int64_t u, int index) const { return layout_.units[u].tensors[index]; }
  void copy(void* dst, const void* src, int64_t n) {
    EXPECT_EQ(cudaMemcpy(dst, src, n * cuda::dtype_size(type_), cudaMemcpyDeviceToDevice),
              cudaSuccess);
  }
  void zero(const DeviceBuffer& b) { EXPECT_EQ(cudaMemset(b.get(), 0, b.bytes()), cudaSuccess); }
  cuda::AttentionShape attention_shape() const {
    cuda::AttentionShape s;
    s.B = B_;
    s.T = T_;
    s.H = c_.num_attention_heads;
    s.KV = c_.num_key_value_heads;
    s.D = c_.head_dim;
    s.row_stride = qkv_width_;
    return s;
  }

  // Layer tensors, in core/model.cpp's order: q k v o gate up down norm_in norm_post.
  void layer_forward(int64_t u, const void* x, void* out) {
    const int64_t N = B_ * T_, C = c_.hidden_size, I = c_.intermediate_size;
    const int64_t H = c_.num_attention_heads, KV = c_.num_key_value_heads, D = c_.head_dim;
    const DeviceBuffer& w = *params_[u];
    const float eps = static_cast<float>(c_.rms_norm_eps);
    expect_ok(cuda::rmsnorm_forward(xn1_->get(), rstd1_->f32(), x, at(w, slot(u, 7).offset), N, C,
                                    eps, type_, nullptr));
    expect_ok(mm_.forward(qkv_->get(), xn1_->get(), at(w, slot(u, 0).offset), N, C, qkv_width_,
                          type_, false, nullptr));
    expect_ok(cuda::rope_forward(at(*qkv_, 0), cos_->f32(), sin_->f32(), B_, T_, H, D, qkv_width_,
                                 type_, nullptr));
    expect_ok(cuda::rope_forward(at(*qkv_, H * D), cos_->f32(), sin_->f32(), B_, T_, KV, D,
                                 qkv_width_, type_, nullptr));
    expect_ok(cuda::attention_forward(attn_->get(), lse_->f32(), at(*qkv_, 0), at(*qkv_, H * D),
                                      at(*qkv_, (H + KV) * D), attention_shape(), type_, nullptr));
    copy(x2_->get(), x, N * C);
    expect_ok(mm_.forward(x2_->get(), attn_->get(), at(w, slot(u, 3).offset), N, H * D, C, type_,
                          true, nullptr));
    expect_ok(cuda::rmsnorm_forward(xn2_->get(), rstd2_->f32(), x2_->get(),
                                    at(w, slot(u, 8).offset), N, C, eps, type_, nullptr));
    expect_ok(mm_.forward(gate_up_->get(), xn2_->get(), at(w, slot(u, 4).offset), N, C, 2 * I,
                          type_, false, nullptr));
    expect_ok(cuda::swiglu_forward(mlp_->get(), gate_up_->get(), N, I, type_, nullptr));
    if (out == nullptr) return;  // recomputation for the backward stops here
    copy(out, x2_->get(), N * C);
    expect_ok(
        mm_.forward(out, mlp_->get(), at(w, slot(u, 6).offset), N, I, C, type_, true, nullptr));
  }

  void layer_backward(int64_t u, const void* x, const void* dout, void* dx) {
    const int64_t N = B_ * T_, C = c_.hidden_size, I = c_.intermediate_size;
    const int64_t H = c_.num_attention_heads, KV = c_.num_key_value_heads, D = c_.head_dim;
    const DeviceBuffer& w = *params_[u];
    float* g = grads_[u]->f32();
    layer_forward(u, x, nullptr);
    if (dx != dout) copy(dx, dout, N * C);
    zero(*d_mlp_);
    expect_ok(mm_.backward(d_mlp_->get(), g + slot(u, 6).offset, dout, mlp_->get(),
                           at(w, slot(u, 6).offset), N, I, C, type_, nullptr));
    expect_ok(cuda::swiglu_backward(d_gate_up_->get(), d_mlp_->get(), gate_up_->get(), N, I, type_,
                                    nullptr));
    zero(*d_xn_);
    expect_ok(mm_.backward(d_xn_->get(), g + slot(u, 4).offset, d_gate_up_->get(), xn2_->get(),
                           at(w, slot(u, 4).offset), N, C, 2 * I, type_, nullptr));
    expect_ok(cuda::rmsnorm_backward(dx, g + slot(u, 8).offset, d_xn_->get(), x2_->get(),
                                     at(w, slot(u, 8).offset), rstd2_->f32(), N, C, type_,
                                     scratch_->get(), scratch_->bytes(), nullptr));
    zero(*d_attn_);
    expect_ok(mm_.backward(d_attn_->get(), g + slot(u, 3).offset, dx, attn_->get(),
                           at(w, slot(u, 3).offset), N, H * D, C, type_, nullptr));
    expect_ok(cuda::attention_backward(at(*d_qkv_, 0), at(*d_qkv_, H * D),
                                       at(*d_qkv_, (H + KV) * D), delta_->f32(), d_attn_->get(),
                                       attn_->get(), lse_->f32(), at(*qkv_, 0), at(*qkv_, H * D),
                                       at(*qkv_, (H + KV) * D), attention_shape(), type_, nullptr));
    expect_ok(cuda::rope_backward(at(*d_qkv_, 0), cos_->f32(), sin_->f32(), B_, T_, H, D,
                                  qkv_width_, type_, nullptr));
    expect_ok(cuda::rope_backward(at(*d_qkv_, H * D), cos_->f32(), sin_->f32(), B_, T_, KV, D,
                                  qkv_width_, type_, nullptr));
    zero(*d_xn_);
    expect_ok(mm_.backward(d_xn_->get(), g + slot(u, 0).offset, d_qkv_->get(), xn1_->get(),
                           at(w, slot(u, 0).offset), N, C, qkv_width_, type_, nullptr));
    expect_ok(cuda::rmsnorm_backward(dx, g + slot(u, 7).offset, d_xn_->get(), x,
                                     at(w, slot(u, 7).offset), rstd1_->f32(), N, C, type_,
                                     scratch_->get(), scratch_->bytes(), nullptr));
  }

  void head_forward_backward(const void* x, const int32_t* targets, float loss_scale) {
    const int64_t N = B_ * T_, C = c_.hidden_size, V = c_.vocab_size;
    const int64_t head = static_cast<int64_t>(layout_.units.size()) - 1;
    const bool tied = c_.tie_word_embeddings;
    const void* norm = at(*params_[head], 0);
    float* d_norm = grads_[head]->f32();
    const void* lm_head = tied ? params_[0]->get() : at(*params_[head], slot(head, 1).offset);
    float* d_lm_head = tied ? grads_[0]->f32() : grads_[head]->f32() + slot(head, 1).offset;
    expect_ok(cuda::rmsnorm_forward(xn1_->get(), rstd1_->f32(), x, norm, N, C,
                                    static_cast<float>(c_.rms_norm_eps), type_, nullptr));
    expect_ok(mm_.forward(logits_->get(), xn1_->get(), lm_head, N, C, V, type_, false, nullptr));
    expect_ok(cuda::cross_entropy_forward_backward(losses_->f32(), logits_->get(), logits_->get(),
                                                   targets, loss_scale, N, V, type_, nullptr));
    zero(*d_xn_);
    expect_ok(mm_.backward(d_xn_->get(), d_lm_head, logits_->get(), xn1_->get(), lm_head, N, C, V,
                           type_, nullptr));
    zero(*grad_);
    expect_ok(cuda::rmsnorm_backward(grad_->get(), d_norm, d_xn_->get(), x, norm, rstd1_->f32(), N,
                                     C, type_, scratch_->get(), scratch_->bytes(), nullptr));
  }

  const ModelConfig& c_;
  const ModelLayout& layout_;
  int64_t B_, T_;
  DType type_;
  cuda::Matmuls& mm_;
  int64_t qkv_width_ = 0;
  std::vector<std::unique_ptr<DeviceBuffer>> params_, grads_, units_in_;
  std::unique_ptr<DeviceBuffer> cos_, sin_, xn1_, rstd1_, qkv_, lse_, attn_, x2_, xn2_, rstd2_,
      gate_up_, mlp_, d_mlp_, d_gate_up_, d_xn_, d_attn_, d_qkv_, delta_, logits_, losses_,
      scratch_, grad_;
};

struct ModelCase {
  bool tied;
  DType type;
};

class CudaModel : public CudaTestWithParam<ModelCase> {};

TEST_P(CudaModel, ForwardBackwardMatchesTheCpuBackend) {
  const ModelCase param = GetParam();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const ModelConfig config = small_config(param.tied);
  HostModel model = make_host_model(config);
  init_host_model(model, seed, /*init_std=*/0.05f);
  const int64_t B = 2, T = 37, N = B * T;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(config.vocab_size - 1));
  std::vector<int32_t> tokens(N), targets(N);
  for (auto& t : tokens) t = pick(rng);
  for (auto& t : targets) t = pick(rng);
  targets[5] = -100;
  const float loss_scale = 1.0f / (N - 1);

  auto matmuls = cuda::Matmuls::create();
  ASSERT_TRUE(matmuls.is_ok()) << matmuls.status().message();
  GpuUnits gpu(model, B, T, param.type, **matmuls);
  // fp16 trains with a loss scale (its gradients would sink into subnormals
  // otherwise); the GPU's gradients are divided by it before the comparison.
  const float fp16_loss_scale = param.type == DType::f16 ? 1024.0f : 1.0f;
  const double gpu_loss = gpu.forward_backward(tokens, targets, loss_scale * fp16_loss_scale);

  UnitWorkspace ws(config, B, T);
  UnitBatch batch{tokens.data(), targets.data(), B, T, loss_scale};
  const Result<double> cpu_loss = model_forward_backward(model, batch, ws);
  ASSERT_TRUE(cpu_loss.is_ok()) << cpu_loss.status().message();

  const bool fp32 = param.type == DType::f32;
  const double loss_tolerance = fp32 ? kCudaFp32Tolerance : 1e-2;
  const double grad_tolerance = fp32 ? kCudaFp32Tolerance : 1e-1;
  EXPECT_NEAR(gpu_loss, *cpu_loss, loss_tolerance * std::abs(*cpu_loss));
  for (size_t u = 0; u < model.layout.units.size(); ++u) {
    std::vector<float> gpu_grads = gpu.grads(u);
    for (float& g : gpu_grads) g /= fp16_loss_scale;
    for (const TensorSlot& slot : model.layout.units[u].tensors) {
      const std::vector<float> expected(model.grads[u].begin() + slot.offset,
                                        model.grads[u].begin() + slot.offset + slot.numel);
      const std::vector<float> got(gpu_grads.begin() + slot.offset,
                                   gpu_grads.begin() + slot.offset + slot.numel);
      EXPECT_LE(relative_error(got, to_double(expected)), grad_tolerance) << slot.name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Configs, CudaModel,
    ::testing::Values(ModelCase{false, DType::f32}, ModelCase{true, DType::f32},
                      ModelCase{false, DType::bf16}, ModelCase{true, DType::f16}),
    [](const auto& info) {
      return fmt::format("{}_{}", info.param.tied ? "tied" : "untied", type_label(info.param.type));
    });

}  // namespace
}  // namespace strata::testing

#else  // a CPU-only build has no CUDA kernels to test

TEST(CudaModel, NeedsACudaBuild) {
  GTEST_SKIP() << "built without CUDA";
}

#endif
