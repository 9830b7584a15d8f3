// A dense layer's MLP cut into parts along its intermediate dimension
// (ModelConfig::mlp_parts) against the uncut MLP piece, on fresh random
// odd-sized models, on the reference products (kernels/cpu/gemm.h):
//  - a cut model starts with the uncut one's values (each part draws the
//    whole tensor's elements), saves the whole tensors, and loads them back
//    into any count of parts;
//  - at one layer, every gradient of gate_proj, up_proj and down_proj is
//    the whole MLP's bits (each element the same sum in the same order);
//    the layer's output, its input gradient and the post-attention norm's
//    gradient lie within the bound core/README.md ("MLP parts") derives,
//    computed here in float64: the output's down product and the normed
//    rows' gradient are sums over the intermediate dimension that the parts
//    add in pieces, so each pair differs by at most 2 gamma_n times the sum
//    of the terms' magnitudes (n = I, 2 I), then the residual's addition
//    and the norm's backward carry it as for the expert groups;
//  - a whole model's loss and gradients stay near the uncut model's, in 4
//    parts, in parts of one row each, and in a mixture whose dense layer
//    is in parts and whose sparse layers are in groups of experts.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/checkpoint/safetensors.h"
#include "core/model/model.h"
#include "io_test_support.h"
#include "kernels/cpu/gemm.h"
#include "norm_bound_support.h"
#include "reference_products_test.h"
#include "tiers_test_support.h"

namespace strata {
namespace {

using testing::gamma_bound;
using testing::kUnitRoundoff;

class ModelMlpParts : public testing::ReferenceProductsTest {
 protected:
  ModelMlpParts() : ReferenceProductsTest("model_mlp_parts") {}

  ModelConfig dense() {
    ModelConfig c;
    c.family = pick(0, 1) == 0 ? ModelFamily::llama : ModelFamily::qwen3;
    c.qk_norm = c.family == ModelFamily::qwen3;
    c.vocab_size = pick(70, 120) | 1;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 1;
    c.head_dim = 8;
    c.hidden_size = pick(18, 26) | 1;
    c.intermediate_size = pick(31, 61) | 1;
    c.num_hidden_layers = 2;
    c.max_position_embeddings = 64;
    c.rms_norm_eps = 1e-5;
    return c;
  }
};

// A model of `c` in layer pieces, its dense MLPs in `parts`, from `seed`.
HostModel cut_model(ModelConfig c, int64_t parts, uint64_t seed, float init_std = 0.02f) {
  c.layer_pieces = 2;
  c.mlp_parts = parts;
  HostModel m = make_host_model(c);
  init_host_model(m, seed, init_std);
  return m;
}

// Every tensor of `m` whole, by name (a cut tensor's parts put together).
std::map<std::string, std::vector<float>> whole_tensors(const HostModel& m, bool gradients) {
  std::map<std::string, std::vector<float>> out;
  std::vector<float> scratch;
  for (const CheckpointTensor& t : checkpoint_tensor_groups(m.layout)) {
    const float* data = whole_tensor(
        t, [&](int64_t u) { return (gradients ? m.grads : m.params)[size_t(u)].data(); }, scratch);
    out[t.name].assign(data, data + t.numel());
  }
  return out;
}

TEST_F(ModelMlpParts, ACutModelStartsAsTheUncutOneAndSavesWholeTensors) {
  const ModelConfig c = dense();
  const HostModel whole = cut_model(c, 1, seed_);
  const HostModel cut = cut_model(c, 3, seed_);
  // embedding, each layer's attention and 3 parts, head
  ASSERT_EQ(cut.layout.units.size(), 1u + 2u * 4u + 1u);
  EXPECT_EQ(cut.layout.units[2].unit.name, "layers.0.mlp.0");
  EXPECT_EQ(cut.layout.units[4].unit.name, "layers.0.mlp.2");
  EXPECT_EQ(cut.layout.units[4].unit.mlp_part, 2);
  for (const UnitLayout& unit : cut.layout.units)
    EXPECT_EQ(unit.numel, unit.unit.numel) << unit.unit.name;
  const auto a = whole_tensors(whole, false), b = whole_tensors(cut, false);
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, values] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_TRUE(same_bits(values.data(), b.at(name).data(), values.size())) << name;
  }
  // Saved whole and loaded back into the uncut model and into other counts of parts.
  io::testing::TemporaryDirectory dir;
  ASSERT_TRUE(save_host_model(cut, dir.path(), DType::f32, 1ull << 30, false).is_ok());
  Result<SafetensorsCheckpoint> saved = SafetensorsCheckpoint::open(dir.path());
  ASSERT_TRUE(saved.is_ok()) << saved.status().message();
  for (int64_t parts : {1, 2, 5}) {
    ModelConfig other = c;
    other.layer_pieces = 2;
    other.mlp_parts = parts;
    HostModel loaded = make_host_model(other);
    ASSERT_TRUE(load_host_model(loaded, *saved).is_ok()) << parts << " parts";
    const auto l = whole_tensors(loaded, false);
    for (const auto& [name, values] : a)
      EXPECT_TRUE(same_bits(values.data(), l.at(name).data(), values.size()))
          << name << ", loaded into " << parts << " parts";
  }
}

TEST_F(ModelMlpParts, OneLayerIsBitwiseButTheSumsOverTheIntermediateDimensionWithinTheBound) {
  for (int64_t parts : {2, 3, 7}) {
    const ModelConfig c = dense();
    const int64_t B = 2, T = 5, N = B * T, C = c.hidden_size, I = c.intermediate_size;
    // Weights large enough that the MLP's products weigh beside the residual.
    HostModel a = cut_model(c, 1, seed_ + uint64_t(parts), 0.3f);
    HostModel b = cut_model(c, parts, seed_ + uint64_t(parts), 0.3f);
    // A post-attention norm away from one, so its gradient and Jacobian are not trivial.
    std::vector<float> w = normal(size_t(C), 0.2f);
    for (float& x : w) x += 1.0f;
    const std::string p = "model.layers.0.", norm = p + "post_attention_layernorm.weight";
    std::copy(w.begin(), w.end(), const_cast<float*>(a.tensor(norm)));
    std::copy(w.begin(), w.end(), const_cast<float*>(b.tensor(norm)));
    const std::vector<float> x2 = normal(size_t(N * C), 1.0f), dout = normal(size_t(N * C), 1.0f);
    UnitBatch batch;
    batch.B = B;
    batch.T = T;
    UnitWorkspace ws(c, B, T);
    // The uncut MLP piece (unit 2: embedding, layers.0.attention, layers.0.mlp).
    std::vector<float> out_a(size_t(N * C)), dx_a(size_t(N * C));
    unit_forward(a.layout, 2, a.unit_params(2), batch, x2.data(), out_a.data(), ws);
    unit_backward(a.layout, 2, a.unit_params(2), batch, x2.data(), dout.data(), dx_a.data(),
                  a.unit_grads(2), ws);
    // The parts (units 2 ..), down and back.
    std::vector<float> chain(size_t(expert_chain_floats(b.layout.config, N)));
    batch.experts = expert_chain_view(b.layout.config, N, chain.data());
    std::vector<float> xn(size_t(N * C)), out_b(size_t(N * C)), pass(size_t(N * C));
    unit_forward(b.layout, 2, b.unit_params(2), batch, x2.data(), xn.data(), ws);
    for (int64_t q = 1; q < parts; ++q)
      unit_forward(b.layout, 2 + q, b.unit_params(2 + q), batch, xn.data(),
                   q + 1 == parts ? out_b.data() : pass.data(), ws);
    if (parts > 2) {
      EXPECT_TRUE(same_bits(pass.data(), xn.data(), xn.size())) << "a part passes its input on";
    }
    std::vector<float> d = dout;
    for (int64_t q = parts - 1; q >= 1; --q)
      unit_backward(b.layout, 2 + q, b.unit_params(2 + q), batch, xn.data(), d.data(), d.data(),
                    b.unit_grads(2 + q), ws);
    std::vector<float> dx_b(size_t(N * C));
    unit_backward(b.layout, 2, b.unit_params(2), batch, x2.data(), d.data(), dx_b.data(),
                  b.unit_grads(2), ws);
    // The projections' gradients: each part's elements are the whole tensor's bits.
    for (int64_t q = 0; q < parts; ++q) {
      const UnitLayout& unit = b.layout.units[size_t(2 + q)];
      for (const TensorSlot& slot : unit.tensors) {
        if (slot.name == norm) continue;
        ASSERT_TRUE(slot.is_part()) << slot.name;
        const float* whole = a.tensor_grad(slot.name);
        const float* part = b.grads[size_t(2 + q)].data() + slot.offset;
        int64_t same = 0;
        for (int64_t i = 0; i < slot.numel; ++i)
          same += std::memcmp(&part[i], &whole[slot.part_element(i)], 4) == 0 ? 1 : 0;
        EXPECT_EQ(same, slot.numel) << slot.name << ", part " << q << " of " << parts;
      }
    }
    // The bounds, in float64 from the inputs.
    const testing::NormBackwardBound nb(x2.data(), w.data(), N, C, c.rms_norm_eps);
    const float* gate = a.tensor(p + "mlp.gate_proj.weight");
    const float* up = a.tensor(p + "mlp.up_proj.weight");
    const float* down = a.tensor(p + "mlp.down_proj.weight");
    std::vector<double> g(size_t(N * C)), g_abs(size_t(N * C)), cut(size_t(N * C), 0.0);
    int64_t differ = 0;
    double worst = 0;
    for (int64_t t = 0; t < N; ++t) {
      std::vector<double> h(size_t(I), 0.0), u(size_t(I), 0.0), da(size_t(I), 0.0);
      for (int64_t i = 0; i < I; ++i)
        for (int64_t j = 0; j < C; ++j) {
          h[size_t(i)] += double(gate[i * C + j]) * nb.normed(t, j);
          u[size_t(i)] += double(up[i * C + j]) * nb.normed(t, j);
        }
      for (int64_t j = 0; j < C; ++j) {
        // The output: x2 + sum_i act_i down_ji, I products summed in parts.
        double magnitude = 0;
        for (int64_t i = 0; i < I; ++i) {
          const double sig = 1 / (1 + std::exp(-h[size_t(i)]));
          magnitude += std::abs(h[size_t(i)] * sig * u[size_t(i)] * double(down[j * I + i]));
          da[size_t(i)] += double(down[j * I + i]) * double(dout[t * C + j]);
        }
        const double oa = out_a[t * C + j], ob = out_b[t * C + j];
        const double bound = 1.01 * (2 * gamma_bound(double(I)) * magnitude +
                                     kUnitRoundoff * (std::abs(oa) + std::abs(ob)));
        differ += oa != ob ? 1 : 0;
        worst = std::max(worst, std::abs(oa - ob) / bound);
        ASSERT_LE(std::abs(oa - ob), bound) << parts << " parts, output row " << t << ", " << j;
      }
      // The normed rows' gradient: 2 I terms, through gate and up.
      for (int64_t j = 0; j < C; ++j) {
        double sum = 0, magnitude = 0;
        for (int64_t i = 0; i < I; ++i) {
          const double hi = h[size_t(i)], sig = 1 / (1 + std::exp(-hi));
          const double dh = da[size_t(i)] * u[size_t(i)] * sig * (1 + hi * (1 - sig));
          const double du = da[size_t(i)] * hi * sig;
          const double terms[2] = {dh * double(gate[i * C + j]), du * double(up[i * C + j])};
          for (double x : terms) {
            sum += x;
            magnitude += std::abs(x);
          }
        }
        g[size_t(t * C + j)] = sum;
        g_abs[size_t(t * C + j)] = std::abs(sum);
        cut[size_t(t * C + j)] = 1.01 * 2 * gamma_bound(double(2 * I)) * magnitude;
      }
    }
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t j = 0; j < C; ++j) {
        const double added =
            1.01 * kUnitRoundoff * (std::abs(dx_a[t * C + j]) + std::abs(dx_b[t * C + j]));
        const double bound = nb.input_gradient(cut, g_abs, t, j) + added;
        const double diff = std::abs(double(dx_b[t * C + j]) - dx_a[t * C + j]);
        differ += diff > 0 ? 1 : 0;
        worst = std::max(worst, diff / std::max(bound, 1e-300));
        ASSERT_LE(diff, bound) << parts << " parts, input gradient row " << t << ", " << j;
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
        "%lld parts of %lld rows: %lld of %lld outputs and input gradients differ, the "
        "largest by %.3f of its bound\n",
        static_cast<long long>(parts), static_cast<long long>(I), static_cast<long long>(differ),
        static_cast<long long>(2 * N * C), worst);
  }
}

// A whole model, its MLPs in 4 parts or in parts of one row each; and a
// Qwen3-MoE mixture with a dense layer among its sparse ones, the dense
// MLP in 3 parts and the sparse ones in 2 groups of experts.
class ModelMlpPartsWhole : public ModelMlpParts, public ::testing::WithParamInterface<int> {};

TEST_P(ModelMlpPartsWhole, StaysNearTheUncutModel) {
  ModelConfig c = dense();
  int64_t parts = GetParam() == 0 ? 4 : c.intermediate_size;
  if (GetParam() == 2) {
    c.family = ModelFamily::qwen3_moe;
    c.qk_norm = true;
    c.num_hidden_layers = 3;
    c.mlp_only_layers = {1};
    c.num_experts = 5;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = pick(9, 15) | 1;
    parts = 3;
  }
  const int64_t B = 2, T = 6, N = B * T;
  HostModel a = cut_model(c, 1, seed_ + 50);
  ModelConfig cut = c;
  cut.expert_groups = c.is_moe() ? 2 : 1;
  HostModel b = cut_model(cut, parts, seed_ + 50);
  if (c.is_moe()) {  // layers.1 (dense) in parts, layers.0 and .2 a router and groups
    EXPECT_EQ(b.layout.units[6].unit.name, "layers.1.mlp.0");
    EXPECT_EQ(b.layout.units[3].unit.name, "layers.0.experts.0");
  }
  std::uniform_int_distribution<int32_t> id(0, int32_t(c.vocab_size) - 1);
  std::vector<int32_t> tokens(static_cast<size_t>(N)), targets(static_cast<size_t>(N));
  for (auto& x : tokens) x = id(rng_);
  for (auto& x : targets) x = id(rng_);
  UnitBatch batch;
  batch.tokens = tokens.data();
  batch.targets = targets.data();
  batch.B = B;
  batch.T = T;
  batch.loss_scale = 1.0f / float(N);
  UnitWorkspace ws(c, B, T);
  Result<double> la = model_forward_backward(a, batch, ws);
  Result<double> lb = model_forward_backward(b, batch, ws);
  ASSERT_TRUE(la.is_ok() && lb.is_ok());
  EXPECT_NEAR(*la, *lb, 1e-5 * std::abs(*la));
  const auto wa = whole_tensors(a, false), wb = whole_tensors(b, false);
  for (const auto& [name, values] : wa)
    EXPECT_TRUE(same_bits(values.data(), wb.at(name).data(), values.size())) << name;
  const auto ga = whole_tensors(a, true), gb = whole_tensors(b, true);
  for (const auto& [name, values] : ga) {
    double scale = 0, diff = 0;
    for (size_t i = 0; i < values.size(); ++i) {
      scale = std::max(scale, double(std::abs(values[i])));
      diff = std::max(diff, double(std::abs(values[i] - gb.at(name)[i])));
    }
    EXPECT_LE(diff, 1e-4 * scale + 1e-12) << name;
  }
}

INSTANTIATE_TEST_SUITE_P(, ModelMlpPartsWhole, ::testing::Values(0, 1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == 0   ? "FourParts"
                                              : info.param == 1 ? "OneRowEach"
                                                                : "AMixtureWithGroups");
                         });

}  // namespace
}  // namespace strata
