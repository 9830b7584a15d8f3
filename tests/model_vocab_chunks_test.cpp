// The embedding and the head cut along the vocabulary (ModelConfig::
// vocab_chunks) against the whole units, on fresh random odd-sized shapes,
// inputs and gradients, on the reference products (kernels/cpu/gemm.h):
//  - a cut model starts with the whole one's values;
//  - the embedding's output and its gradient are the whole unit's bits;
//  - the head's logits, loss and lm_head gradient are the whole head's bits;
//  - the head's input gradient and the final norm's weight gradient lie
//    within the bound core/README.md ("vocabulary chunks") derives, computed
//    here in float64: the normed rows' gradient g = sum_v d_v W_v summed in
//    another order differs by at most 2 gamma_V sum_v |d_v| |W_v| (gamma_n =
//    n u / (1 - n u), u = 2^-24), which the final norm's backward carries
//    through its Jacobian's absolute values, plus both sides' own rounding of
//    that backward (gamma_(C+8) of the same map applied to |g|);
//  - a whole model's step: the same loss bits, the gradients within 1e-5.
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

double gamma(double n) {
  return testing::gamma_bound(n);
}

class ModelVocabChunks : public testing::ReferenceProductsTest {
 protected:
  ModelVocabChunks() : ReferenceProductsTest("model_vocab_chunks") {}

  ModelConfig random_config() {
    ModelConfig c;
    c.vocab_size = std::uniform_int_distribution<int64_t>(150, 260)(rng_) | 1;
    c.num_attention_heads = 2;
    c.num_key_value_heads = 1;
    c.head_dim = 12;
    c.hidden_size = 2 * 12 + 6;  // not a multiple of the heads' width: o maps 24 to 30
    c.intermediate_size = std::uniform_int_distribution<int64_t>(30, 50)(rng_);
    c.num_hidden_layers = 1;
    c.max_position_embeddings = 64;
    c.rms_norm_eps = 1e-5;
    return c;
  }
  std::vector<int32_t> tokens(size_t n, int64_t vocab, bool some_ignored) {
    std::uniform_int_distribution<int32_t> d(0, int32_t(vocab) - 1);
    std::vector<int32_t> t(n);
    for (size_t i = 0; i < n; ++i) t[i] = some_ignored && i % 5 == 3 ? -1 : d(rng_);
    return t;
  }
};

// Tensor `name` of a model's gradients (or parameters), whole.
std::vector<float> whole(const HostModel& m, const std::string& name, bool grads) {
  for (const CheckpointTensor& t : checkpoint_tensor_groups(m.layout)) {
    if (t.name != name) continue;
    std::vector<float> scratch;
    const float* data = whole_tensor(
        t, [&](int64_t u) { return (grads ? m.grads : m.params)[size_t(u)].data(); }, scratch);
    return std::vector<float>(data, data + t.numel());
  }
  ADD_FAILURE() << "no tensor " << name;
  return {};
}

// A whole model and the same model cut into `chunks`, both initialised from `seed`.
std::pair<HostModel, HostModel> whole_and_cut(ModelConfig c, int64_t chunks, uint64_t seed) {
  HostModel whole = make_host_model(c);
  c.vocab_chunks = chunks;
  HostModel cut = make_host_model(c);
  init_host_model(whole, seed);
  init_host_model(cut, seed);
  return {std::move(whole), std::move(cut)};
}

// B sequences of T tokens, `targets` (when given) scored as the mean over them.
UnitBatch batch_of(const std::vector<int32_t>& ids, const std::vector<int32_t>* targets, int64_t B,
                   int64_t T) {
  UnitBatch batch;
  batch.tokens = ids.data();
  batch.targets = targets != nullptr ? targets->data() : nullptr;
  batch.B = B;
  batch.T = T;
  batch.loss_scale = 1.0f / float(B * T);
  return batch;
}

TEST_F(ModelVocabChunks, ACutModelStartsAsTheWholeOne) {
  auto [a, b] = whole_and_cut(random_config(), 3, seed_);
  EXPECT_EQ(b.layout.units.size(), 3u + 1u + 3u);
  EXPECT_EQ(b.layout.units[1].unit.name, "embedding.1");
  EXPECT_EQ(b.layout.units.back().unit.name, "head.2");
  for (const CheckpointTensor& t : checkpoint_tensor_groups(a.layout))
    EXPECT_TRUE(same_bits(whole(a, t.name, false), whole(b, t.name, false))) << t.name;
  EXPECT_EQ(a.tensor("lm_head.weight") != nullptr, true);
  EXPECT_EQ(b.tensor("lm_head.weight"), nullptr);  // it has parts
}

TEST_F(ModelVocabChunks, TheEmbeddingsChunksGiveTheWholeUnitsBits) {
  for (int64_t K : {2, 3, 7}) {
    ModelConfig c = random_config();
    const int64_t B = 2, T = 9, N = B * T, C = c.hidden_size;
    auto [a, b] = whole_and_cut(c, K, seed_ + uint64_t(K));
    const std::vector<int32_t> ids = tokens(size_t(N), c.vocab_size, false);
    const UnitBatch batch = batch_of(ids, nullptr, B, T);
    UnitWorkspace ws(c, B, T);
    std::vector<float> out_a(size_t(N * C));
    unit_forward(a.layout, 0, a.unit_params(0), batch, nullptr, out_a.data(), ws);
    std::vector<std::vector<float>> levels(size_t(K), std::vector<float>(size_t(N * C)));
    for (int64_t k = 0; k < K; ++k)
      unit_forward(b.layout, k, b.unit_params(k), batch, k == 0 ? nullptr : levels[k - 1].data(),
                   levels[size_t(k)].data(), ws);
    EXPECT_TRUE(same_bits(levels.back(), out_a)) << K << " chunks";
    const std::vector<float> dout = normal(size_t(N * C), 1.0f);
    std::vector<float> dy = dout;
    unit_backward(a.layout, 0, a.unit_params(0), batch, nullptr, dy.data(), nullptr,
                  a.unit_grads(0), ws);
    for (int64_t k = K - 1; k >= 0; --k)
      unit_backward(b.layout, k, b.unit_params(k), batch, k == 0 ? nullptr : levels[k - 1].data(),
                    dy.data(), k == 0 ? nullptr : dy.data(), b.unit_grads(k), ws);
    EXPECT_TRUE(same_bits(whole(a, "model.embed_tokens.weight", true),
                          whole(b, "model.embed_tokens.weight", true)))
        << K << " chunks";
    EXPECT_TRUE(same_bits(dy, dout));  // the chunks pass the gradient on untouched
  }
}

TEST_F(ModelVocabChunks, TheHeadsChunksGiveTheWholeHeadsBitsAndTheInputGradientWithinTheBound) {
  for (int64_t K : {2, 3, 7}) {
    ModelConfig c = random_config();
    const int64_t B = 2, T = 11, N = B * T, C = c.hidden_size, V = c.vocab_size;
    auto [a, b] = whole_and_cut(c, K, seed_ + 10 + uint64_t(K));
    // A final norm away from one, so its gradient and Jacobian are not trivial.
    std::vector<float> w = normal(size_t(C), 0.2f);
    for (float& x : w) x += 1.0f;
    std::copy(w.begin(), w.end(), a.params.back().begin());
    const int64_t first = K + c.num_hidden_layers;  // head.0
    std::copy(w.begin(), w.end(), b.params[size_t(first)].begin());
    const std::vector<float> h = normal(size_t(N * C), 1.5f);
    const std::vector<int32_t> targets = tokens(size_t(N), V, true);
    const std::vector<int32_t> ids = tokens(size_t(N), V, false);
    UnitBatch batch = batch_of(ids, &targets, B, T);
    UnitWorkspace ws(c, B, T);
    const int64_t whole_head = int64_t(a.layout.units.size()) - 1;
    std::vector<float> dx_a(size_t(N * C)), logits_a(size_t(N * V)), logits_b(size_t(N * V));
    const double loss_a =
        head_forward_backward(a.layout, a.unit_params(whole_head), batch, h.data(), dx_a.data(),
                              a.unit_grads(whole_head), ws, logits_a.data());
    // The cut head: head.0 .. head.{K-2} forward, the last chunk's pass, back down.
    std::vector<float> store(size_t(N * V));
    batch.head_logits = store.data();
    std::vector<std::vector<float>> x(size_t(K), std::vector<float>(size_t(N * C)));
    x[0] = h;
    for (int64_t k = 0; k + 1 < K; ++k)
      unit_forward(b.layout, first + k, b.unit_params(first + k), batch, x[size_t(k)].data(),
                   x[size_t(k + 1)].data(), ws);
    std::vector<float> dx_b(size_t(N * C));
    const double loss_b =
        head_forward_backward(b.layout, b.unit_params(first + K - 1), batch, x.back().data(),
                              dx_b.data(), b.unit_grads(first + K - 1), ws, logits_b.data());
    for (int64_t k = K - 2; k >= 0; --k)
      unit_backward(b.layout, first + k, b.unit_params(first + k), batch, x[size_t(k)].data(),
                    dx_b.data(), dx_b.data(), b.unit_grads(first + k), ws);
    EXPECT_EQ(loss_b, loss_a) << K << " chunks";
    EXPECT_TRUE(same_bits(logits_b, logits_a)) << K << " chunks";
    EXPECT_TRUE(same_bits(whole(b, "lm_head.weight", true), whole(a, "lm_head.weight", true)))
        << K << " chunks";

    // The bound, in float64 from the inputs.
    const std::vector<float> W = whole(a, "lm_head.weight", false);
    const testing::NormBackwardBound nb(h.data(), w.data(), N, C, c.rms_norm_eps);
    std::vector<double> g(size_t(N * C), 0.0), cut(size_t(N * C), 0.0);
    for (int64_t t = 0; t < N; ++t) {
      if (targets[t] < 0) continue;
      double max = -INFINITY, sum = 0;
      for (int64_t v = 0; v < V; ++v) max = std::max(max, double(logits_a[t * V + v]));
      for (int64_t v = 0; v < V; ++v) sum += std::exp(double(logits_a[t * V + v]) - max);
      for (int64_t v = 0; v < V; ++v) {
        const double p = std::exp(double(logits_a[t * V + v]) - max) / sum;
        const double d = double(batch.loss_scale) * (p - (v == targets[t] ? 1.0 : 0.0));
        for (int64_t j = 0; j < C; ++j) {
          const double wvj = W[size_t(v * C + j)];
          g[t * C + j] += d * wvj;  // d(loss)/d(the norm's output)
          cut[t * C + j] += 1.01 * 2 * gamma(double(V)) * std::abs(d) * std::abs(wvj);
        }
      }
    }
    std::vector<double> g_abs(size_t(N * C));
    for (size_t i = 0; i < g.size(); ++i) g_abs[i] = std::abs(g[i]);
    double worst = 0;
    for (int64_t t = 0; t < N; ++t) {
      for (int64_t j = 0; j < C; ++j) {
        const double bound = nb.input_gradient(cut, g_abs, t, j);
        const double diff = std::abs(double(dx_b[t * C + j]) - dx_a[t * C + j]);
        worst = std::max(worst, diff / std::max(bound, 1e-300));
        ASSERT_LE(diff, bound) << K << " chunks, row " << t << ", column " << j;
      }
    }
    // The final norm's weight: sum_t g_tj xhat_tj, its g within `cut`.
    const std::vector<float> dw_a = whole(a, "model.norm.weight", true);
    const std::vector<float> dw_b = whole(b, "model.norm.weight", true);
    for (int64_t j = 0; j < C; ++j)
      EXPECT_LE(std::abs(double(dw_b[size_t(j)]) - dw_a[size_t(j)]),
                nb.weight_gradient(cut, g_abs, j))
          << "column " << j;
    std::printf("%lld chunks: the input gradient's largest difference is %.3f of its bound\n",
                static_cast<long long>(K), worst);
  }
}

TEST_F(ModelVocabChunks, AWholeModelsStepAgrees) {
  ModelConfig c = random_config();
  c.num_hidden_layers = 2;
  const int64_t B = 2, T = 8, N = B * T;
  auto [a, b] = whole_and_cut(c, 4, seed_ + 99);
  const std::vector<int32_t> ids = tokens(size_t(N), c.vocab_size, false);
  const std::vector<int32_t> targets = tokens(size_t(N), c.vocab_size, true);
  const UnitBatch batch = batch_of(ids, &targets, B, T);
  UnitWorkspace ws(c, B, T);
  Result<double> la = model_forward_backward(a, batch, ws);
  Result<double> lb = model_forward_backward(b, batch, ws);
  ASSERT_TRUE(la.is_ok() && lb.is_ok());
  EXPECT_EQ(*la, *lb);
  Result<double> eval = model_forward(b, batch, ws);
  ASSERT_TRUE(eval.is_ok());
  EXPECT_EQ(*eval, *la);
  for (const CheckpointTensor& t : checkpoint_tensor_groups(a.layout)) {
    const std::vector<float> ga = whole(a, t.name, true), gb = whole(b, t.name, true);
    double diff = 0, norm = 0;
    for (size_t i = 0; i < ga.size(); ++i) {
      diff += (double(ga[i]) - gb[i]) * (double(ga[i]) - gb[i]);
      norm += double(ga[i]) * ga[i];
    }
    EXPECT_LE(std::sqrt(diff), 1e-5 * std::sqrt(norm) + 1e-12) << t.name;
  }
}

}  // namespace
}  // namespace strata
