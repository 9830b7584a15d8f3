// The whole model's gradients: central differences of the loss on a few
// parameters of every tensor (fp32 with a step large enough to drown rounding,
// checked at 0.5%), for Llama and for each other family on small odd-sized
// configs (qwen2's q/k/v biases, qwen3's per-head q/k norms with a head_dim
// unrelated to hidden / heads, mistral's sliding window shorter than the
// sequence; the mixtures' routers and experts and the load-balancing loss in
// the objective), gradient accumulation over micro-batches, tied embeddings
// collecting both uses, and bad token ids refused. Each layer cut into its
// attention and its MLP (ModelConfig::layer_pieces) gives the whole layers'
// bits: the cut sums nothing another way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>

#include "core/model/model.h"
#include "tiers_test_support.h"

namespace strata {
namespace {

ModelConfig small_config(bool tied) {
  ModelConfig c;
  c.vocab_size = 29;
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 6;
  c.max_position_embeddings = 64;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000.0;
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 16;
  c.tie_word_embeddings = tied;
  return c;
}

// One small config per family, sizes chosen odd where RoPE allows.
ModelConfig family_config(ModelFamily family) {
  ModelConfig c = small_config(false);
  c.family = family;
  c.rope_scaling = RopeScaling{};
  switch (family) {
    case ModelFamily::llama:
      c = small_config(false);
      break;
    case ModelFamily::qwen2:  // biases, tied, one kv head for three query heads
      c.vocab_size = 31;
      c.hidden_size = 30;
      c.intermediate_size = 38;
      c.num_attention_heads = 3;
      c.num_key_value_heads = 1;
      c.head_dim = 10;
      c.tie_word_embeddings = true;
      c.qkv_bias = true;
      break;
    case ModelFamily::qwen3:  // q/k norms, head_dim 6 with 5 heads on hidden 26
      c.vocab_size = 33;
      c.hidden_size = 26;
      c.intermediate_size = 42;
      c.num_attention_heads = 5;
      c.num_key_value_heads = 5;
      c.head_dim = 6;
      c.rope_theta = 1000000.0;
      c.qk_norm = true;
      break;
    case ModelFamily::mistral:  // a window of 3 keys over sequences of 5
      c.vocab_size = 27;
      c.hidden_size = 22;
      c.intermediate_size = 34;
      c.head_dim = 8;
      c.sliding_window = 3;
      break;
    case ModelFamily::mixtral:  // 5 experts, top 2 renormalised, the load-balancing loss in the loss
      c.vocab_size = 23;
      c.hidden_size = 18;
      c.intermediate_size = 14;
      c.moe_intermediate_size = 14;
      c.head_dim = 6;
      c.sliding_window = 4;
      c.num_experts = 5;
      c.num_experts_per_tok = 2;
      c.norm_topk_prob = true;
      c.output_router_logits = true;
      c.router_aux_loss_coef = 0.5;
      break;
    case ModelFamily::qwen3_moe:  // 6 experts, top 3 as the router weighs them, a dense layer 0
      c.vocab_size = 25;
      c.hidden_size = 20;
      c.intermediate_size = 30;
      c.moe_intermediate_size = 10;
      c.num_hidden_layers = 3;
      c.head_dim = 6;
      c.qk_norm = true;
      c.num_experts = 6;
      c.num_experts_per_tok = 3;
      c.norm_topk_prob = false;
      c.mlp_only_layers = {0};
      c.output_router_logits = true;
      c.router_aux_loss_coef = 0.7;
      break;
  }
  return c;
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

struct Data {
  std::vector<int32_t> tokens, targets;
};

Data random_data(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(vocab - 1));
  Data d;
  for (int64_t i = 0; i < n; ++i) {
    d.tokens.push_back(pick(rng));
    d.targets.push_back(pick(rng));
  }
  return d;
}

void expect_central_differences(const ModelConfig& config) {
  HostModel model = make_host_model(config);
  init_host_model(model, 3, /*init_std=*/0.3f);  // large weights: gradients well above fp32 noise
  randomize_vectors(model, 11);
  const int64_t B = 2, T = 5, N = B * T;
  const Data data = random_data(N, config.vocab_size, 4);
  UnitBatch batch{data.tokens.data(), data.targets.data(), B, T, 1.0f / N};
  // A mixture's objective adds the coefficient times its load-balancing loss.
  RouterStats router;
  batch.router = &router;
  const double aux_coef = config.output_router_logits ? config.router_aux_loss_coef : 0.0;
  batch.aux_loss_scale = float(aux_coef);
  UnitWorkspace ws(config, B, T);
  ASSERT_TRUE(model_forward_backward(model, batch, ws).is_ok());

  auto loss_at = [&](float* p, float value) {
    const float saved = *p;
    *p = value;
    const double loss = *model_forward(model, batch, ws) / N + aux_coef * router.aux_loss();
    *p = saved;
    return loss;
  };
  int checked = 0;
  double worst = 0.0;
  for (const NamedTensor& t : checkpoint_tensors(model.layout)) {
    float* p = model.params[t.unit].data() + t.slot->offset;
    const float* g = model.grads[t.unit].data() + t.slot->offset;
    // The two entries with the largest gradients: the ones a sign or factor error would show in.
    std::vector<int64_t> order(t.slot->numel);
    for (int64_t i = 0; i < t.slot->numel; ++i) order[i] = i;
    const int64_t candidates = std::min<int64_t>(t.slot->numel, 8);
    std::partial_sort(order.begin(), order.begin() + candidates, order.end(),
                      [&](int64_t a, int64_t b) { return std::abs(g[a]) > std::abs(g[b]); });
    int taken = 0;
    for (int64_t k = 0; k < candidates && taken < 2; ++k) {
      const int64_t i = order[k];
      // k's bias moves every score of a row nearly alike, which the softmax cancels: its
      // gradients are small, so a larger step keeps fp32 rounding of the loss below 0.5%.
      // An expert sees a few tokens, so its gradients are small too: the same larger step.
      const bool small = t.slot->name.ends_with("k_proj.bias") ||
                         t.slot->name.find(".experts.") != std::string::npos;
      const float h = small ? 1e-2f : 2e-3f;
      const double numeric = (loss_at(p + i, p[i] + h) - loss_at(p + i, p[i] - h)) / (2.0 * h);
      if (config.is_moe()) {
        // A router whose choice flips within the step makes the loss jump there: the
        // difference over half the step then disagrees, and the entry is not a smooth
        // point to compare at (the next largest is taken).
        const double half =
            (loss_at(p + i, p[i] + h / 2) - loss_at(p + i, p[i] - h / 2)) / double(h);
        if (std::abs(half - numeric) > 0.02 * std::abs(numeric) + 1e-5) continue;
      }
      EXPECT_NEAR(g[i], numeric, 5e-3 * std::abs(numeric) + 1e-6)
          << t.slot->name << "[" << i << "]";
      worst = std::max(worst, std::abs(g[i] - numeric) / std::abs(numeric));
      ++checked;
      ++taken;
    }
    EXPECT_GT(taken, 0) << t.slot->name << ": no smooth point among its largest gradients";
  }
  EXPECT_GT(checked, 20);
  std::printf("%s: checked %d parameters; worst relative difference %.2e\n",
              model_family_name(config.family), checked, worst);
}

class ModelGradient : public ::testing::TestWithParam<bool> {};

TEST_P(ModelGradient, MatchesCentralDifferencesOfTheLoss) {
  expect_central_differences(small_config(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, ModelGradient, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "tied" : "untied"; });

class FamilyGradient : public ::testing::TestWithParam<ModelFamily> {};

TEST_P(FamilyGradient, MatchesCentralDifferencesOfTheLoss) {
  expect_central_differences(family_config(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyGradient,
                         ::testing::Values(ModelFamily::qwen2, ModelFamily::qwen3,
                                           ModelFamily::mistral, ModelFamily::mixtral,
                                           ModelFamily::qwen3_moe),
                         [](const auto& info) { return model_family_name(info.param); });

TEST(ModelGradients, AccumulateOverMicroBatches) {
  const ModelConfig config = small_config(true);
  HostModel whole = make_host_model(config), split = make_host_model(config);
  init_host_model(whole, 5);
  init_host_model(split, 5);
  const int64_t B = 4, T = 6, N = B * T;
  const Data data = random_data(N, config.vocab_size, 6);
  UnitWorkspace ws_whole(config, B, T), ws_half(config, B / 2, T);
  UnitBatch batch{data.tokens.data(), data.targets.data(), B, T, 1.0f / N};
  const double loss = *model_forward_backward(whole, batch, ws_whole);
  double loss_split = 0.0;
  for (int64_t m = 0; m < 2; ++m) {
    UnitBatch half{data.tokens.data() + m * N / 2, data.targets.data() + m * N / 2, B / 2, T,
                   1.0f / N};
    loss_split += *model_forward_backward(split, half, ws_half);
  }
  EXPECT_NEAR(loss_split, loss, 1e-5 * loss);
  for (size_t u = 0; u < whole.grads.size(); ++u) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < whole.grads[u].size(); ++i) {
      diff += std::pow(whole.grads[u][i] - split.grads[u][i], 2);
      norm += std::pow(whole.grads[u][i], 2);
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-5) << whole.layout.units[u].unit.name;
  }
  // A second identical pass doubles every gradient (up to the order BLAS adds in).
  std::vector<std::vector<float>> once = whole.grads;
  ASSERT_TRUE(model_forward_backward(whole, batch, ws_whole).is_ok());
  for (size_t u = 0; u < once.size(); ++u) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < once[u].size(); ++i) {
      diff += std::pow(whole.grads[u][i] - 2.0 * once[u][i], 2);
      norm += std::pow(2.0 * once[u][i], 2);
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-6) << whole.layout.units[u].unit.name;
  }
}

// An engine's loop: units one at a time, only unit inputs kept, every unit
// recomputed in its backward, the head's forward and backward as two calls.
class UnitByUnit : public ::testing::TestWithParam<ModelFamily> {};

TEST_P(UnitByUnit, CallsMatchTheWholeModelPath) {
  ModelConfig config = family_config(GetParam());
  if (GetParam() == ModelFamily::llama) config.tie_word_embeddings = true;
  HostModel whole = make_host_model(config), units = make_host_model(config);
  init_host_model(whole, 8);
  init_host_model(units, 8);
  randomize_vectors(whole, 12);
  randomize_vectors(units, 12);
  const int64_t B = 2, T = 7, N = B * T, C = config.hidden_size;
  const Data data = random_data(N, config.vocab_size, 9);
  const UnitBatch batch{data.tokens.data(), data.targets.data(), B, T, 1.0f / N};
  UnitWorkspace ws(config, B, T);
  const double loss = *model_forward_backward(whole, batch, ws);

  const ModelLayout& layout = units.layout;
  const int64_t count = static_cast<int64_t>(layout.units.size());
  std::vector<std::vector<float>> inputs(count,
                                         std::vector<float>(N * C));  // inputs[u] feeds unit u + 1
  unit_forward(layout, 0, units.unit_params(0), batch, nullptr, inputs[0].data(), ws);
  for (int64_t u = 1; u + 1 < count; ++u) {
    unit_forward(layout, u, units.unit_params(u), batch, inputs[u - 1].data(), inputs[u].data(),
                 ws);
  }
  const double unit_loss = unit_forward(layout, count - 1, units.unit_params(count - 1), batch,
                                        inputs[count - 2].data(), nullptr, ws);
  EXPECT_NEAR(unit_loss, loss, 1e-6 * loss);
  std::vector<float> grad(N * C);
  unit_backward(layout, count - 1, units.unit_params(count - 1), batch, inputs[count - 2].data(),
                nullptr, grad.data(), units.unit_grads(count - 1), ws);
  for (int64_t u = count - 2; u >= 1; --u) {
    unit_backward(layout, u, units.unit_params(u), batch, inputs[u - 1].data(), grad.data(),
                  grad.data(), units.unit_grads(u), ws);
  }
  unit_backward(layout, 0, units.unit_params(0), batch, nullptr, grad.data(), nullptr,
                units.unit_grads(0), ws);
  for (size_t u = 0; u < units.grads.size(); ++u) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < units.grads[u].size(); ++i) {
      diff += std::pow(units.grads[u][i] - whole.grads[u][i], 2);
      norm += std::pow(whole.grads[u][i], 2);
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-6) << layout.units[u].unit.name;
  }
}

INSTANTIATE_TEST_SUITE_P(Families, UnitByUnit,
                         ::testing::Values(ModelFamily::llama, ModelFamily::qwen2,
                                           ModelFamily::qwen3, ModelFamily::mistral,
                                           ModelFamily::mixtral, ModelFamily::qwen3_moe),
                         [](const auto& info) { return model_family_name(info.param); });

// Each tensor of a model's gradients (or parameters) by name.
std::map<std::string, std::vector<float>> tensors_of(const HostModel& m, bool grads) {
  std::map<std::string, std::vector<float>> out;
  for (const NamedTensor& t : checkpoint_tensors(m.layout)) {
    const float* data = (grads ? m.grads : m.params)[size_t(t.unit)].data() + t.slot->offset;
    out[t.slot->name] = std::vector<float>(data, data + t.slot->numel);
  }
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// The whole model's path (every unit recomputed in its backward but the
// last before the head, which keeps its forward's activations), and every
// unit recomputed, with layers whole and cut into pieces.
class LayerPieces : public ::testing::TestWithParam<ModelFamily> {};

TEST_P(LayerPieces, GiveTheWholeLayersBits) {
  const uint64_t seed = tiers::testing::fresh_seed("layer_pieces");
  ModelConfig config = family_config(GetParam());
  if (GetParam() == ModelFamily::llama) config.tie_word_embeddings = true;
  ModelConfig cut_config = config;
  cut_config.layer_pieces = 2;
  HostModel whole = make_host_model(config), cut = make_host_model(cut_config);
  ASSERT_EQ(cut.layout.units.size(), whole.layout.units.size() + size_t(config.num_hidden_layers));
  EXPECT_EQ(cut.layout.units[1].unit.name, "layers.0.attention");
  EXPECT_EQ(cut.layout.units[2].unit.name, "layers.0.mlp");
  EXPECT_EQ(cut.layout.units[1].numel + cut.layout.units[2].numel, whole.layout.units[1].numel);
  EXPECT_EQ(cut.layout.units[1].numel, config.attention_parameter_count());
  init_host_model(whole, seed);
  init_host_model(cut, seed);
  ASSERT_EQ(tensors_of(whole, false), tensors_of(cut, false));  // initialised by name
  randomize_vectors(whole, uint32_t(seed));
  for (const NamedTensor& t : checkpoint_tensors(cut.layout)) {
    const float* from = whole.tensor(t.slot->name);
    std::copy(from, from + t.slot->numel, cut.params[size_t(t.unit)].data() + t.slot->offset);
  }
  const int64_t B = 2, T = 7, N = B * T;
  const Data data = random_data(N, config.vocab_size, uint32_t(seed >> 32));
  RouterStats router_whole, router_cut;
  UnitBatch batch{data.tokens.data(), data.targets.data(), B, T, 1.0f / N};
  batch.aux_loss_scale = config.output_router_logits ? float(config.router_aux_loss_coef) : 0.0f;
  UnitBatch cut_batch = batch;
  batch.router = &router_whole;
  cut_batch.router = &router_cut;
  UnitWorkspace ws(config, B, T);
  std::vector<float> logits_whole(size_t(N * config.vocab_size)), logits_cut(logits_whole.size());
  Result<double> loss_whole = model_forward_backward(whole, batch, ws, logits_whole.data());
  Result<double> loss_cut = model_forward_backward(cut, cut_batch, ws, logits_cut.data());
  ASSERT_TRUE(loss_whole.is_ok() && loss_cut.is_ok());
  EXPECT_EQ(*loss_cut, *loss_whole);
  EXPECT_EQ(router_cut.aux_loss(), router_whole.aux_loss());
  EXPECT_TRUE(same_bits(logits_cut, logits_whole));
  const auto grads_whole = tensors_of(whole, true);
  for (const auto& [name, grad] : tensors_of(cut, true))
    EXPECT_TRUE(same_bits(grad, grads_whole.at(name))) << name;
  Result<double> eval = model_forward(cut, cut_batch, ws);
  ASSERT_TRUE(eval.is_ok());
  EXPECT_EQ(*eval, *model_forward(whole, batch, ws));

  // Unit by unit, every unit recomputed: the pieces' gradients are the model path's.
  const ModelLayout& layout = cut.layout;
  const int64_t count = int64_t(layout.units.size()), C = config.hidden_size;
  std::vector<std::vector<float>> inputs(size_t(count), std::vector<float>(size_t(N * C)));
  HostModel again = make_host_model(cut_config);
  again.params = cut.params;
  unit_forward(layout, 0, again.unit_params(0), cut_batch, nullptr, inputs[0].data(), ws);
  for (int64_t u = 1; u + 1 < count; ++u)
    unit_forward(layout, u, again.unit_params(u), cut_batch, inputs[size_t(u - 1)].data(),
                 inputs[size_t(u)].data(), ws);
  std::vector<float> grad(size_t(N * C));
  head_forward_backward(layout, again.unit_params(count - 1), cut_batch,
                        inputs[size_t(count - 2)].data(), grad.data(), again.unit_grads(count - 1),
                        ws);
  for (int64_t u = count - 2; u >= 0; --u)
    unit_backward(layout, u, again.unit_params(u), cut_batch,
                  u == 0 ? nullptr : inputs[size_t(u - 1)].data(), grad.data(),
                  u == 0 ? nullptr : grad.data(), again.unit_grads(u), ws);
  const auto grads_cut = tensors_of(cut, true);
  for (const auto& [name, g] : tensors_of(again, true))
    EXPECT_TRUE(same_bits(g, grads_cut.at(name))) << name << " (every unit recomputed)";
}

INSTANTIATE_TEST_SUITE_P(Families, LayerPieces,
                         ::testing::Values(ModelFamily::llama, ModelFamily::qwen2,
                                           ModelFamily::qwen3, ModelFamily::mistral,
                                           ModelFamily::mixtral, ModelFamily::qwen3_moe),
                         [](const auto& info) { return model_family_name(info.param); });

TEST(ModelGradients, TokensOutsideTheVocabularyAreRefused) {
  const ModelConfig config = small_config(false);
  HostModel model = make_host_model(config);
  Data data = random_data(4, config.vocab_size, 1);
  data.tokens[2] = static_cast<int32_t>(config.vocab_size);
  UnitWorkspace ws(config, 1, 4);
  Result<double> loss =
      model_forward_backward(model, {data.tokens.data(), data.targets.data(), 1, 4, 0.25f}, ws);
  ASSERT_FALSE(loss.is_ok());
  EXPECT_NE(loss.status().message().find("position 2"), std::string::npos)
      << loss.status().message();
}

}  // namespace
}  // namespace strata
