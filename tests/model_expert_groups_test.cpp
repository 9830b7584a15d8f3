// A sparse layer cut into expert groups (ModelConfig::expert_groups: a
// router piece and pieces of experts) against the uncut model, on fresh
// random odd-sized mixtures, on the reference products (kernels/cpu/gemm.h):
//  - a cut model starts with the uncut one's values, and its units hold the
//    same parameters;
//  - top 2 (Mixtral): the loss, the logits, the router statistics and
//    every gradient are the whole layers' bits, with experts no token
//    reached among the groups;
//  - top k > 2 (Qwen3-MoE, dense layers among the sparse ones): the
//    forward is bitwise; at one layer, the experts' and the router's
//    gradients are bitwise, and the layer's input gradient and the
//    post-attention norm's gradient lie within the bound core/README.md
//    ("Expert groups") derives, computed here in float64: each token's
//    gradient of the normed rows is a sum of its k experts' rows and the
//    router's E terms, which the two sum in other orders, so they differ by
//    at most 2 gamma_(k+E) times the sum of the terms' magnitudes (gamma_n =
//    n u / (1 - n u), u = 2^-24), carried through the norm's backward as for
//    the vocabulary chunks, plus each side's own rounding of that backward
//    and of the residual's addition.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/model/model.h"
#include "kernels/cpu/gemm.h"
#include "norm_bound_support.h"
#include "reference_products_test.h"
#include "tiers_test_support.h"

namespace strata {
namespace {

constexpr double kUnit = testing::kUnitRoundoff;
double gamma(double n) {
  return testing::gamma_bound(n);
}

class ModelExpertGroups : public testing::ReferenceProductsTest {
 protected:
  ModelExpertGroups() : ReferenceProductsTest("model_expert_groups") {}

  ModelConfig mixture(ModelFamily family, int64_t experts, int64_t top) {
    ModelConfig c;
    c.family = family;
    c.vocab_size = pick(70, 120) | 1;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 1;
    c.head_dim = 8;
    c.hidden_size = 22;
    c.intermediate_size = pick(20, 30);
    c.moe_intermediate_size = pick(9, 15) | 1;
    c.num_experts = experts;
    c.num_experts_per_tok = top;
    c.num_hidden_layers = 2;
    c.max_position_embeddings = 64;
    c.rms_norm_eps = 1e-5;
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.05;
    if (family == ModelFamily::qwen3_moe) {
      c.qk_norm = true;
      c.num_hidden_layers = 3;
      c.mlp_only_layers = {1};
    }
    return c;
  }
  std::vector<int32_t> tokens(size_t n, int64_t vocab) {
    std::uniform_int_distribution<int32_t> d(0, int32_t(vocab) - 1);
    std::vector<int32_t> t(n);
    for (int32_t& x : t) x = d(rng_);
    return t;
  }
  // Routers scaled up, so that no token's choice is within rounding of a tie.
  void sharpen_routers(HostModel& m) {
    for (const NamedTensor& t : checkpoint_tensors(m.layout)) {
      const std::string& name = t.slot->name;
      if (name.find("mlp.gate.weight") == std::string::npos &&
          name.find("block_sparse_moe.gate.weight") == std::string::npos)
        continue;
      float* w = m.params[size_t(t.unit)].data() + t.slot->offset;
      for (int64_t i = 0; i < t.slot->numel; ++i) w[i] *= 40.0f;
    }
  }
};

// The uncut model and the model cut into `groups`, both initialised from `seed`.
std::pair<HostModel, HostModel> uncut_and_cut(ModelConfig c, int64_t groups, uint64_t seed,
                                              float init_std = 0.02f) {
  HostModel uncut = make_host_model(c);
  c.layer_pieces = 2;
  c.expert_groups = groups;
  HostModel cut = make_host_model(c);
  init_host_model(uncut, seed, init_std);
  init_host_model(cut, seed, init_std);
  return {std::move(uncut), std::move(cut)};
}

TEST_F(ModelExpertGroups, ACutModelStartsAsTheUncutOne) {
  ModelConfig c = mixture(ModelFamily::qwen3_moe, 7, 3);
  auto [a, b] = uncut_and_cut(c, 3, seed_);
  // embedding, layers 0 and 2 as attention, router and 3 groups, layer 1 as attention and MLP, head
  ASSERT_EQ(b.layout.units.size(), 1u + 5u + 2u + 5u + 1u);
  EXPECT_EQ(b.layout.units[2].unit.name, "layers.0.router");
  EXPECT_EQ(b.layout.units[3].unit.name, "layers.0.experts.0");
  EXPECT_EQ(b.layout.units[5].unit.name, "layers.0.experts.2");
  EXPECT_EQ(b.layout.units[7].unit.name, "layers.1.mlp");
  EXPECT_EQ(b.layout.config.parameter_count(), a.layout.config.parameter_count());
  // Group g holds experts [g E / G, (g + 1) E / G): 2, 2 and 3 of 7.
  const ExpertBlocks last = expert_blocks(b.layout, 5);
  EXPECT_EQ(last.first, 4);
  EXPECT_EQ(last.count, 3);
  EXPECT_EQ(expert_blocks(b.layout, 2).count, 0);  // the router piece holds no expert
  for (const NamedTensor& t : checkpoint_tensors(a.layout)) {
    const float* x = a.tensor(t.slot->name);
    const float* y = b.tensor(t.slot->name);
    ASSERT_NE(y, nullptr) << t.slot->name;
    EXPECT_TRUE(same_bits(x, y, size_t(t.slot->numel))) << t.slot->name;
  }
  for (const UnitLayout& unit : b.layout.units)
    EXPECT_EQ(unit.numel, unit.unit.numel) << unit.unit.name;
}

TEST_F(ModelExpertGroups, TopTwoGivesTheWholeLayersBits) {
  for (int64_t groups : {2, 3, 16}) {
    ModelConfig c = mixture(ModelFamily::mixtral, 16, 2);
    const int64_t B = 1, T = 4, N = B * T;  // 8 slots of 16 experts: most get no token
    auto [a, b] = uncut_and_cut(c, groups, seed_ + uint64_t(groups));
    const std::vector<int32_t> ids = tokens(size_t(N), c.vocab_size);
    const std::vector<int32_t> targets = tokens(size_t(N), c.vocab_size);
    UnitBatch batch;
    batch.tokens = ids.data();
    batch.targets = targets.data();
    batch.B = B;
    batch.T = T;
    batch.loss_scale = 1.0f / float(N);
    batch.aux_loss_scale = float(c.router_aux_loss_coef);
    RouterStats stats_a, stats_b;
    std::vector<float> logits_a(size_t(N * c.vocab_size)), logits_b(logits_a.size());
    UnitWorkspace ws(c, B, T);
    batch.router = &stats_a;
    Result<double> loss_a = model_forward_backward(a, batch, ws, logits_a.data());
    batch.router = &stats_b;
    Result<double> loss_b = model_forward_backward(b, batch, ws, logits_b.data());
    ASSERT_TRUE(loss_a.is_ok() && loss_b.is_ok());
    EXPECT_EQ(*loss_a, *loss_b) << groups << " groups";
    EXPECT_TRUE(same_bits(logits_a.data(), logits_b.data(), logits_a.size())) << groups;
    EXPECT_EQ(stats_a.assigned, stats_b.assigned);
    EXPECT_EQ(stats_a.prob_sum, stats_b.prob_sum);
    int64_t idle = 0;
    for (double assigned : stats_a.assigned) idle += assigned == 0 ? 1 : 0;
    EXPECT_GT(idle, 0) << "every expert got a token: the check shows nothing";
    for (const NamedTensor& t : checkpoint_tensors(a.layout)) {
      const std::string& name = t.slot->name;
      EXPECT_TRUE(same_bits(a.tensor_grad(name), b.tensor_grad(name), size_t(t.slot->numel)))
          << name << ", " << groups << " groups";
    }
  }
}

// One token's k experts' rows and the router's terms of the normed rows'
// gradient, in float64 from the fp32 parameters and the routing the pieces
// recorded: g (C) their sum, magnitude (C) the sum of their magnitudes.
struct NormedGradient {
  std::vector<double> g, magnitude;
};
NormedGradient reference_normed_gradient(const HostModel& m, const std::vector<double>& xn,
                                         const float* dout, const int32_t* chosen,
                                         const float* weight) {
  const ModelConfig& c = m.layout.config;
  const int64_t C = c.hidden_size, I = c.moe_intermediate_size, E = c.num_experts;
  const int64_t K = c.num_experts_per_tok;
  NormedGradient out{std::vector<double>(size_t(C), 0.0), std::vector<double>(size_t(C), 0.0)};
  const float* router = m.tensor("model.layers.0.mlp.gate.weight");
  std::vector<double> p(static_cast<size_t>(E)), dp(static_cast<size_t>(E), 0.0);
  std::vector<double> dw(static_cast<size_t>(K));
  double top = -INFINITY, total = 0;
  for (int64_t e = 0; e < E; ++e) {
    double logit = 0;
    for (int64_t j = 0; j < C; ++j) logit += double(router[e * C + j]) * xn[size_t(j)];
    p[size_t(e)] = logit;
    top = std::max(top, logit);
  }
  for (double& x : p) total += x = std::exp(x - top);
  for (double& x : p) x /= total;
  for (int64_t k = 0; k < K; ++k) {
    const std::string x = fmt::format("model.layers.0.mlp.experts.{}.", chosen[k]);
    const float* gate = m.tensor(x + "gate_proj.weight");
    const float* up = m.tensor(x + "up_proj.weight");
    const float* down = m.tensor(x + "down_proj.weight");
    const size_t rows = static_cast<size_t>(I);
    std::vector<double> h(rows, 0.0), u(rows, 0.0), a(rows, 0.0), da(rows, 0.0);
    for (int64_t i = 0; i < I; ++i)
      for (int64_t j = 0; j < C; ++j) {
        h[size_t(i)] += double(gate[i * C + j]) * xn[size_t(j)];
        u[size_t(i)] += double(up[i * C + j]) * xn[size_t(j)];
      }
    for (int64_t i = 0; i < I; ++i) {
      const double sig = 1 / (1 + std::exp(-h[size_t(i)]));
      a[size_t(i)] = h[size_t(i)] * sig * u[size_t(i)];
    }
    double dot = 0;
    for (int64_t j = 0; j < C; ++j) {
      double y = 0;
      for (int64_t i = 0; i < I; ++i) y += double(down[j * I + i]) * a[size_t(i)];
      dot += double(dout[j]) * y;
      for (int64_t i = 0; i < I; ++i)
        da[size_t(i)] += double(down[j * I + i]) * double(weight[k]) * double(dout[j]);
    }
    dw[size_t(k)] = dot;
    for (int64_t j = 0; j < C; ++j) {
      double row = 0;
      for (int64_t i = 0; i < I; ++i) {
        const double sig = 1 / (1 + std::exp(-h[size_t(i)])), silu = h[size_t(i)] * sig;
        const double dh = da[size_t(i)] * u[size_t(i)] * sig * (1 + h[size_t(i)] * (1 - sig));
        row += double(gate[i * C + j]) * dh + double(up[i * C + j]) * da[size_t(i)] * silu;
      }
      out.g[size_t(j)] += row;
      out.magnitude[size_t(j)] += std::abs(row);
    }
  }
  double chosen_total = 0, dot = 0;
  for (int64_t k = 0; k < K; ++k) {
    chosen_total += p[size_t(chosen[k])];
    dot += dw[size_t(k)] * double(weight[k]);
  }
  for (int64_t k = 0; k < K; ++k)
    dp[size_t(chosen[k])] +=
        c.norm_topk_prob ? (dw[size_t(k)] - dot) / chosen_total : dw[size_t(k)];
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += p[size_t(e)] * dp[size_t(e)];
  for (int64_t e = 0; e < E; ++e) {
    const double dlogit = p[size_t(e)] * (dp[size_t(e)] - mean);
    for (int64_t j = 0; j < C; ++j) {
      out.g[size_t(j)] += dlogit * double(router[e * C + j]);
      out.magnitude[size_t(j)] += std::abs(dlogit * double(router[e * C + j]));
    }
  }
  return out;
}

TEST_F(ModelExpertGroups, TopKAboveTwoIsBitwiseButTheNormedRowsGradientWithinTheBound) {
  for (int64_t groups : {2, 7}) {
    ModelConfig c = mixture(ModelFamily::qwen3_moe, 7, 3);
    c.layer_pieces = 2;
    const int64_t B = 2, T = 5, N = B * T, C = c.hidden_size, K = c.num_experts_per_tok;
    // Weights large enough that the experts' rows weigh beside the residual's gradient.
    auto [a, b] = uncut_and_cut(c, groups, seed_ + 30 + uint64_t(groups), 0.4f);
    // A post-attention norm away from one, so its gradient and Jacobian are not trivial.
    std::vector<float> w = normal(size_t(C), 0.2f);
    for (float& x : w) x += 1.0f;
    const std::string norm = "model.layers.0.post_attention_layernorm.weight";
    std::copy(w.begin(), w.end(), const_cast<float*>(a.tensor(norm)));
    std::copy(w.begin(), w.end(), const_cast<float*>(b.tensor(norm)));
    const std::vector<float> x2 = normal(size_t(N * C), 1.0f), dout = normal(size_t(N * C), 1.0f);
    UnitBatch batch;
    batch.B = B;
    batch.T = T;
    std::vector<float> chain(size_t(expert_chain_floats(b.layout.config, N)));
    UnitWorkspace ws(c, B, T);
    // The uncut MLP piece (unit 2: embedding, layers.0.attention, layers.0.mlp).
    std::vector<float> out_a(size_t(N * C)), dx_a(size_t(N * C));
    unit_forward(a.layout, 2, a.unit_params(2), batch, x2.data(), out_a.data(), ws);
    unit_backward(a.layout, 2, a.unit_params(2), batch, x2.data(), dout.data(), dx_a.data(),
                  a.unit_grads(2), ws);
    // The router piece (unit 2) and the groups (units 3 ..), down and back.
    batch.experts = expert_chain_view(b.layout.config, N, chain.data());
    std::vector<float> xn(size_t(N * C)), out_b(size_t(N * C)), pass(size_t(N * C));
    unit_forward(b.layout, 2, b.unit_params(2), batch, x2.data(), xn.data(), ws);
    for (int64_t g = 0; g < groups; ++g)
      unit_forward(b.layout, 3 + g, b.unit_params(3 + g), batch, xn.data(),
                   g + 1 == groups ? out_b.data() : pass.data(), ws);
    EXPECT_TRUE(same_bits(out_a.data(), out_b.data(), out_a.size())) << groups << " groups";
    EXPECT_TRUE(same_bits(pass.data(), xn.data(), xn.size())) << "a group passes its input on";
    std::vector<float> d = dout;
    for (int64_t g = groups - 1; g >= 0; --g)
      unit_backward(b.layout, 3 + g, b.unit_params(3 + g), batch, xn.data(), d.data(), d.data(),
                    b.unit_grads(3 + g), ws);
    std::vector<float> dx_b(size_t(N * C));
    unit_backward(b.layout, 2, b.unit_params(2), batch, x2.data(), d.data(), dx_b.data(),
                  b.unit_grads(2), ws);
    // The experts' and the router's gradients: bitwise.
    for (const TensorSlot& slot : a.layout.units[2].tensors) {
      if (slot.name == norm) continue;
      EXPECT_TRUE(same_bits(a.tensor_grad(slot.name), b.tensor_grad(slot.name), size_t(slot.numel)))
          << slot.name << ", " << groups << " groups";
    }
    // The bound, in float64 from the inputs.
    const testing::NormBackwardBound nb(x2.data(), w.data(), N, C, c.rms_norm_eps);
    std::vector<double> g(size_t(N * C)), cut(size_t(N * C));
    for (int64_t t = 0; t < N; ++t) {
      std::vector<double> row(static_cast<size_t>(C));
      for (int64_t j = 0; j < C; ++j) row[size_t(j)] = nb.normed(t, j);
      const NormedGradient r =
          reference_normed_gradient(b, row, dout.data() + t * C, batch.experts.top_expert + t * K,
                                    batch.experts.top_weight + t * K);
      for (int64_t j = 0; j < C; ++j) {
        g[t * C + j] = r.g[size_t(j)];
        cut[t * C + j] = 1.01 * 2 * gamma(double(K + c.num_experts)) * r.magnitude[size_t(j)];
      }
    }
    std::vector<double> g_abs(size_t(N * C));
    for (size_t i = 0; i < g.size(); ++i) g_abs[i] = std::abs(g[i]);
    double worst = 0;
    int64_t differ = 0;
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t j = 0; j < C; ++j) {
        const double added = 1.01 * kUnit * (std::abs(dx_a[t * C + j]) + std::abs(dx_b[t * C + j]));
        const double bound = nb.input_gradient(cut, g_abs, t, j) + added;
        const double diff = std::abs(double(dx_b[t * C + j]) - dx_a[t * C + j]);
        differ += diff > 0 ? 1 : 0;
        worst = std::max(worst, diff / std::max(bound, 1e-300));
        ASSERT_LE(diff, bound) << groups << " groups, row " << t << ", column " << j;
      }
    }
    EXPECT_GT(differ, 0) << "nothing was summed in another order: the check shows nothing";
    // The norm's weight: sum_t g_tj xhat_tj, its g within `cut`.
    const float* dw_a = a.tensor_grad(norm);
    const float* dw_b = b.tensor_grad(norm);
    for (int64_t j = 0; j < C; ++j)
      EXPECT_LE(std::abs(double(dw_b[j]) - dw_a[j]), nb.weight_gradient(cut, g_abs, j))
          << "column " << j;
    std::printf(
        "%lld groups: %lld of %lld input gradients differ, the largest by %.3f of its "
        "bound\n",
        static_cast<long long>(groups), static_cast<long long>(differ),
        static_cast<long long>(N * C), worst);
  }
}

}  // namespace
}  // namespace strata
