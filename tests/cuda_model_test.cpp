// A whole model's forward and backward on the GPU against the CPU backend's
// model_forward_backward (core/model/model.h), on a small Llama with grouped-query
// heads, llama3 RoPE scaling, a sequence length that is not a multiple of the
// attention tiles, tied and untied heads; and on each other family: qwen2's
// q/k/v biases (random, not zero), qwen3's per-head q/k norms with a head_dim
// unrelated to hidden / heads, mistral with a window that holds the sequence
// (a shorter one is refused by CudaUnits::create, naming --seq-len); and
// with each decoder layer cut into its attention and its MLP
// (strata.layer_pieces 2), each a unit of its own, against the CPU
// backend's pieces (which give its whole layers' bits); and with the
// embedding and the head cut along the vocabulary (strata.vocab_chunks),
// against the CPU backend's chunks; and on the two mixtures of experts
// (mixtral: 7 experts, top 2 renormalised; qwen3_moe: 12 experts, top 3 as
// weighed, a dense layer among sparse ones), whole and in pieces, with
// their load-balancing gradient, the routers scaled up so that no token's
// choice is within rounding of a tie (the same routing is checked: every
// expert's token count; in layer pieces, each sparse MLP piece's route(),
// the routed expert fetch's routing, against the CPU's routed_experts); and
// with the sparse layers' MLP pieces cut into a router piece and groups of
// experts (strata.expert_groups; each group's route_from_chain against the
// CPU's routing of its router piece's input) and the dense layers' into
// parts (strata.mlp_parts), against the CPU backend's cuts.
//
// GpuUnits below drives core/model/cuda_units.h (the units the engine's CUDA backend
// runs: the same fused qkv and gate/up products as core/model/model.cpp's
// UnitKernels, residuals added by accumulating products, per-unit
// recomputation in the backward) over a whole model.
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

#include "core/model/cuda_units.h"
#include "core/model/model.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/ops.h"
#include "tests/cuda_test_support.h"

namespace strata::testing {
namespace {

namespace cuda = kernels::cuda;

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

ModelConfig family_config(bool tied, ModelFamily family) {
  ModelConfig c = small_config(tied);
  c.family = family;
  if (family == ModelFamily::qwen2) c.qkv_bias = true;
  if (family == ModelFamily::qwen3) {
    c.qk_norm = true;
    c.head_dim = 48;  // 4 x 48 = 192 != hidden 128
  }
  if (family == ModelFamily::mistral) c.sliding_window = 64;
  if (family == ModelFamily::mixtral) {  // 7 experts, top 2 renormalised, Mistral's attention
    c.sliding_window = 64;
    c.moe_intermediate_size = 72;
    c.num_experts = 7;
    c.num_experts_per_tok = 2;
    c.norm_topk_prob = true;
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.3;
  }
  if (family == ModelFamily::qwen3_moe) {  // 12 experts, top 3 as weighed, a dense layer 0
    c.qk_norm = true;
    c.head_dim = 48;
    c.num_hidden_layers = 3;
    c.moe_intermediate_size = 40;
    c.num_experts = 12;
    c.num_experts_per_tok = 3;
    c.norm_topk_prob = false;
    c.mlp_only_layers = {0};
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.3;
  }
  return c;
}

// A mixture's routers scaled up, so that no token's k-th and (k+1)-th
// probabilities are near enough for fp32 rounding (or the GPU's exp) to
// swap them: a different choice would be a different function, not an error.
void sharpen_routers(HostModel& model) {
  for (const NamedTensor& t : checkpoint_tensors(model.layout)) {
    if (!t.slot->name.ends_with("gate.weight")) continue;
    float* p = model.params[t.unit].data() + t.slot->offset;
    for (int64_t i = 0; i < t.slot->numel; ++i) p[i] *= 40.0f;
  }
}

// Random values in every 1-D tensor: biases well away from zero, norms near one.
void randomize_vectors(HostModel& model, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const NamedTensor& t : checkpoint_tensors(model.layout)) {
    if (t.slot->shape.size() != 1) continue;
    const bool bias = t.slot->name.ends_with(".bias");
    float* p = model.params[t.unit].data() + t.slot->offset;
    for (int64_t i = 0; i < t.slot->numel; ++i)
      p[i] = bias ? 0.3f * normal(rng) : 1.0f + 0.1f * normal(rng);
  }
}

// Runs the units of `model` on the GPU through core/model/cuda_units.h (what the
// engine's CUDA backend runs), in the order of core/model/model.cpp's
// model_forward_backward. Parameters are copied once (cast on the device);
// gradients accumulate in fp32 per unit. The last layer's backward reuses the
// activations of its forward (no recomputation), as the engine does.
class GpuUnits {
 public:
  GpuUnits(const HostModel& model, int64_t B, int64_t T, DType type, cuda::Matmuls& matmuls)
      : layout_(model.layout), B_(B), T_(T) {
    const ModelConfig& c = layout_.config;
    const int64_t N = B * T, C = c.hidden_size;
    for (size_t u = 0; u < layout_.units.size(); ++u) {
      const int64_t numel = layout_.units[u].padded_numel;
      auto master = upload(model.params[u], DType::f32);
      params_.push_back(buffer(numel, type));
      expect_ok(cuda::cast(params_.back()->get(), type, master->get(), DType::f32, numel, nullptr));
      grads_.push_back(buffer(numel, DType::f32));
    }
    const int64_t bytes = cuda_unit_workspace_bytes(c, B, T, int(cuda::dtype_size(type)));
    workspace_ = std::make_unique<DeviceBuffer>(size_t(bytes));
    Result<std::unique_ptr<CudaUnits>> units = CudaUnits::create(
        layout_, B, T, type, static_cast<std::byte*>(workspace_->get()), bytes, matmuls);
    EXPECT_TRUE(units.is_ok()) << units.status().message();
    if (units) units_ = std::move(*units);
    units_in_.resize(layout_.units.size() - 1);
    for (auto& in : units_in_) in = buffer(N * C, type);
    grad_ = buffer(N * C, type);
    losses_ = buffer(N, DType::f32);
    if (c.vocab_chunks > 1) head_logits_ = buffer(N * c.vocab_size, type);
    if (uses_expert_chain(c)) chain_ = buffer(expert_chain_floats(c, N), DType::f32);
  }

  // One micro-batch, as core/model/model.cpp's model_forward_backward: returns the
  // sum of token losses; gradients accumulate into grads(). A mixture's
  // statistics go to router() and its load-balancing gradient follows
  // aux_loss_scale.
  double forward_backward(const std::vector<int32_t>& tokens, const std::vector<int32_t>& targets,
                          float loss_scale, float aux_loss_scale = 0.0f) {
    if (!units_) return 0.0;
    auto d_tokens = upload_raw(tokens), d_targets = upload_raw(targets);
    CudaUnitBatch batch;
    batch.tokens = static_cast<const int32_t*>(d_tokens->get());
    batch.targets = static_cast<const int32_t*>(d_targets->get());
    batch.loss_scale = loss_scale;
    if (head_logits_) batch.head_logits = head_logits_->get();
    if (chain_) batch.expert_chain = chain_->f32();
    batch_ = batch;
    if (layout_.config.is_moe()) {
      batch.router = &router_;
      batch.aux_loss_scale = aux_loss_scale;
    }
    const int64_t units = static_cast<int64_t>(layout_.units.size());
    const int64_t head = units - 1, N = B_ * T_;
    const bool tied = layout_.config.tie_word_embeddings;
    expect_ok(units_->forward(0, params_[0]->get(), batch, nullptr, units_in_[0]->get(), nullptr));
    for (int64_t u = 1; u < head; ++u)
      expect_ok(units_->forward(u, params_[u]->get(), batch, units_in_[u - 1]->get(),
                                units_in_[u]->get(), nullptr));
    expect_ok(units_->head_forward_backward(
        params_[head]->get(), tied ? params_[0]->get() : nullptr, batch, units_in_[head - 1]->get(),
        grad_->get(), grads_[head]->f32(), tied ? grads_[0]->f32() : nullptr, losses_->f32(),
        nullptr));
    for (int64_t u = head - 1; u >= 1; --u)
      expect_ok(units_->backward(u, params_[u]->get(), batch, units_in_[u - 1]->get(), grad_->get(),
                                 grad_->get(), grads_[u]->f32(),
                                 /*recompute=*/u != head - 1, nullptr));
    expect_ok(units_->backward(0, nullptr, batch, nullptr, grad_->get(), nullptr, grads_[0]->f32(),
                               true, nullptr));
    double loss = 0.0;
    for (float x : download(*losses_, N, DType::f32)) loss += x;
    return loss;
  }

  std::vector<float> grads(size_t u) const {
    return download(*grads_[u], layout_.units[u].padded_numel, DType::f32);
  }

  // After a forward_backward: each sparse MLP piece's route() (routed
  // expert fetch) over its input of that pass picks the experts the CPU's
  // routed_experts picks from the same input.
  void expect_routes_as_the_cpu(const HostModel& model, DType type) {
    const ModelConfig& c = layout_.config;
    const int64_t N = B_ * T_;
    UnitWorkspace ws(c, B_, T_);
    int routed = 0;
    for (size_t u = 1; u + 1 < layout_.units.size(); ++u) {
      if (layout_.units[u].unit.piece != LayerPiece::mlp ||
          expert_blocks(layout_, int64_t(u)).count == 0)
        continue;
      ++routed;
      std::vector<uint8_t> used(size_t(c.num_experts), 7);
      expect_ok(units_->route(int64_t(u), params_[u]->get(), units_in_[u - 1]->get(), used.data(),
                              nullptr));
      const std::vector<float> input = download(*units_in_[u - 1], size_t(N * c.hidden_size), type);
      UnitParams p;
      p.flat = model.params[u].data();
      EXPECT_EQ(used, routed_experts(layout_, int64_t(u), p, input.data(), ws))
          << layout_.units[u].unit.name;
    }
    EXPECT_GT(routed, 0);
    // A piece of experts: the experts of its group its router piece's
    // routing reaches, as the CPU routes that piece's input.
    for (size_t u = 1; u + 1 < layout_.units.size(); ++u) {
      if (layout_.units[u].unit.piece != LayerPiece::experts) continue;
      size_t router = u;
      while (layout_.units[router].unit.piece != LayerPiece::router) --router;
      const ExpertBlocks group = expert_blocks(layout_, int64_t(u));
      std::vector<uint8_t> used(size_t(c.num_experts), 7);
      expect_ok(units_->route_from_chain(int64_t(u), batch_, used.data(), nullptr));
      const std::vector<float> input =
          download(*units_in_[router - 1], size_t(N * c.hidden_size), type);
      UnitParams p;
      p.flat = model.params[router].data();
      std::vector<uint8_t> expected = routed_experts(layout_, int64_t(router), p, input.data(), ws);
      for (int64_t e = 0; e < c.num_experts; ++e)
        if (e < group.first || e >= group.first + group.count) expected[size_t(e)] = 0;
      EXPECT_EQ(used, expected) << layout_.units[u].unit.name;
    }
    // A unit that is not a sparse MLP piece is refused.
    std::vector<uint8_t> used(size_t(c.num_experts));
    const Status refused =
        units_->route(1, params_[1]->get(), units_in_[0]->get(), used.data(), nullptr);
    EXPECT_FALSE(refused.is_ok());
  }
  const RouterStats& router() const { return router_; }

 private:
  std::unique_ptr<DeviceBuffer> buffer(int64_t n, DType type) {
    return std::make_unique<DeviceBuffer>(n * cuda::dtype_size(type));
  }

  const ModelLayout& layout_;
  int64_t B_, T_;
  std::unique_ptr<DeviceBuffer> workspace_;
  std::unique_ptr<CudaUnits> units_;
  std::vector<std::unique_ptr<DeviceBuffer>> params_, grads_, units_in_;
  std::unique_ptr<DeviceBuffer> grad_, losses_, head_logits_;
  std::unique_ptr<DeviceBuffer> chain_;  // expert groups' or MLP parts' (ExpertChain)
  CudaUnitBatch batch_;                  // the last forward_backward's
  RouterStats router_;
};

struct ModelCase {
  bool tied;
  DType type;
  ModelFamily family = ModelFamily::llama;
  int64_t layer_pieces = 1;
  int64_t vocab_chunks = 1;
  int64_t expert_groups = 1;
  int64_t mlp_parts = 1;
};

class CudaModel : public CudaTestWithParam<ModelCase> {};

TEST_P(CudaModel, ForwardBackwardMatchesTheCpuBackend) {
  const ModelCase param = GetParam();
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  ModelConfig config = family_config(param.tied, param.family);
  config.layer_pieces = param.layer_pieces;
  config.vocab_chunks = param.vocab_chunks;
  config.expert_groups = param.expert_groups;
  config.mlp_parts = param.mlp_parts;
  HostModel model = make_host_model(config);
  init_host_model(model, seed, /*init_std=*/0.05f);
  randomize_vectors(model, seed + 1);
  if (config.is_moe()) sharpen_routers(model);
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
  // A mixture's load-balancing term weighs as much as a token's loss.
  const float aux_loss_scale = config.is_moe() ? 0.5f : 0.0f;
  const double gpu_loss = gpu.forward_backward(tokens, targets, loss_scale * fp16_loss_scale,
                                               aux_loss_scale * fp16_loss_scale);

  UnitWorkspace ws(config, B, T);
  UnitBatch batch{tokens.data(), targets.data(), B, T, loss_scale};
  RouterStats router;
  if (config.is_moe()) {
    batch.router = &router;
    batch.aux_loss_scale = aux_loss_scale;
  }
  const Result<double> cpu_loss = model_forward_backward(model, batch, ws);
  ASSERT_TRUE(cpu_loss.is_ok()) << cpu_loss.status().message();

  const bool fp32 = param.type == DType::f32;
  const double loss_tolerance = fp32 ? kCudaFp32Tolerance : 1e-2;
  const double grad_tolerance = fp32 ? kCudaFp32Tolerance : 1e-1;
  EXPECT_NEAR(gpu_loss, *cpu_loss, loss_tolerance * std::abs(*cpu_loss));
  if (config.is_moe()) {
    // The same routing: every expert's token count, and the load-balancing loss.
    EXPECT_EQ(gpu.router().assigned, router.assigned);
    EXPECT_EQ(gpu.router().rows, router.rows);
    EXPECT_NEAR(gpu.router().aux_loss(), router.aux_loss(), loss_tolerance * router.aux_loss());
  }
  if (config.is_moe() && config.layer_pieces == 2) gpu.expect_routes_as_the_cpu(model, param.type);
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
                      ModelCase{false, DType::bf16}, ModelCase{true, DType::f16},
                      ModelCase{true, DType::f32, ModelFamily::qwen2},
                      ModelCase{false, DType::bf16, ModelFamily::qwen2},
                      ModelCase{false, DType::f32, ModelFamily::qwen3},
                      ModelCase{true, DType::bf16, ModelFamily::qwen3},
                      ModelCase{false, DType::f32, ModelFamily::mistral},
                      ModelCase{false, DType::f32, ModelFamily::llama, 2},
                      ModelCase{true, DType::bf16, ModelFamily::llama, 2},
                      ModelCase{false, DType::f32, ModelFamily::qwen2, 2},
                      ModelCase{false, DType::f32, ModelFamily::qwen3, 2},
                      ModelCase{false, DType::f32, ModelFamily::llama, 1, 3},
                      ModelCase{false, DType::bf16, ModelFamily::llama, 2, 2},
                      ModelCase{false, DType::f32, ModelFamily::mixtral},
                      ModelCase{false, DType::bf16, ModelFamily::mixtral},
                      ModelCase{false, DType::f32, ModelFamily::qwen3_moe},
                      ModelCase{true, DType::bf16, ModelFamily::qwen3_moe},
                      ModelCase{false, DType::f32, ModelFamily::mixtral, 2},
                      ModelCase{false, DType::bf16, ModelFamily::mixtral, 2},
                      ModelCase{false, DType::f32, ModelFamily::qwen3_moe, 2, 2},
                      ModelCase{false, DType::f32, ModelFamily::mixtral, 2, 1, 3},
                      ModelCase{false, DType::bf16, ModelFamily::mixtral, 2, 1, 7},
                      ModelCase{false, DType::f32, ModelFamily::qwen3_moe, 2, 1, 4, 2},
                      ModelCase{false, DType::f32, ModelFamily::llama, 2, 1, 1, 3},
                      ModelCase{true, DType::bf16, ModelFamily::llama, 2, 1, 1, 2}),
    [](const auto& info) {
      return fmt::format("{}_{}_{}{}", model_family_name(info.param.family),
                         info.param.tied ? "tied" : "untied", type_label(info.param.type),
                         std::string(info.param.layer_pieces > 1 ? "_pieces" : "") +
                             (info.param.vocab_chunks > 1 ? "_chunks" : "") +
                             (info.param.expert_groups > 1 ? "_groups" : "") +
                             (info.param.mlp_parts > 1 ? "_parts" : ""));
    });

class CudaModelWindow : public CudaTest {};

TEST_F(CudaModelWindow, ASequenceLongerThanTheSlidingWindowIsRefused) {
  ModelConfig config = family_config(false, ModelFamily::mistral);
  config.sliding_window = 16;
  const ModelLayout layout = model_layout(config);
  auto matmuls = cuda::Matmuls::create();
  ASSERT_TRUE(matmuls.is_ok()) << matmuls.status().message();
  const int64_t bytes = cuda_unit_workspace_bytes(config, 1, 37, 4);
  DeviceBuffer memory{size_t(bytes)};
  Result<std::unique_ptr<CudaUnits>> units = CudaUnits::create(
      layout, 1, 37, DType::f32, static_cast<std::byte*>(memory.get()), bytes, **matmuls);
  ASSERT_FALSE(units.is_ok());
  EXPECT_NE(units.status().message().find("sliding_window 16"), std::string::npos)
      << units.status().message();
  EXPECT_NE(units.status().message().find("--seq-len 37"), std::string::npos)
      << units.status().message();
}

}  // namespace
}  // namespace strata::testing

#else  // a CPU-only build has no CUDA kernels to test

TEST(CudaModel, NeedsACudaBuild) {
  GTEST_SKIP() << "built without CUDA";
}

#endif
