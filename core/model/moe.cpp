// A sparse layer's mixture of experts on the CPU (core/model/moe_kernels.h).
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>

#include "core/model/moe_kernels.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/swiglu.h"

namespace strata {
namespace cpu = kernels::cpu;

void MoeKernels::route(const ModelConfig& c, const float* router, const float* xn,
                       UnitWorkspace& ws) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, E = c.num_experts;
  const int64_t K = c.num_experts_per_tok;
  float* probs = ws.router_probs.data();
  cpu::matmul_forward(probs, xn, router, N, C, E);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, 64), [&](const auto& range) {
    for (int64_t n = range.begin(); n < range.end(); ++n) {
      float* p = probs + n * E;
      const float top = *std::max_element(p, p + E);
      double sum = 0.0;
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - top);
      for (int64_t e = 0; e < E; ++e) p[e] = float(p[e] / sum);
      int32_t* chosen = ws.top_expert.data() + n * K;
      float* weight = ws.top_weight.data() + n * K;
      for (int64_t k = 0; k < K; ++k) {  // the k-th largest of the ones not chosen yet
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (std::find(chosen, chosen + k, int32_t(e)) != chosen + k) continue;
          if (best < 0 || p[e] > p[best]) best = e;
        }
        chosen[k] = int32_t(best);
        weight[k] = p[best];
      }
      if (c.norm_topk_prob) {
        float total = 0.0f;
        for (int64_t k = 0; k < K; ++k) total += weight[k];
        for (int64_t k = 0; k < K; ++k) weight[k] /= total;
      }
    }
  });
  group_routed_rows(ws.top_expert.data(), N, K, E, ws.expert_begin.data(), ws.row_of.data(),
                    ws.row_token.data());
}

void MoeKernels::experts_forward(const ModelConfig& c, const float* experts, int64_t first,
                                 int64_t end, const float* xn, UnitWorkspace& ws) {
  const int64_t C = c.hidden_size, I = c.moe_intermediate_size;
  const int64_t r_begin = ws.expert_begin[size_t(first)], r_end = ws.expert_begin[size_t(end)];
  tbb::parallel_for(r_begin, r_end, [&](int64_t r) {
    const float* x = xn + int64_t(ws.row_token[r]) * C;
    std::copy(x, x + C, ws.moe_x.data() + r * C);
  });
  for (int64_t e = first; e < end; ++e) {
    const int64_t r0 = ws.expert_begin[e], n = ws.expert_begin[e + 1] - r0;
    if (n == 0) continue;
    const float* gate_up = experts + (e - first) * 3 * I * C;
    cpu::matmul_forward(ws.moe_gate_up.data() + r0 * 2 * I, ws.moe_x.data() + r0 * C, gate_up, n, C,
                        2 * I);
    cpu::swiglu_forward(ws.moe_act.data() + r0 * I, ws.moe_gate_up.data() + r0 * 2 * I, n, I);
    cpu::matmul_forward(ws.moe_y.data() + r0 * C, ws.moe_act.data() + r0 * I, gate_up + 2 * I * C,
                        n, I, C);
  }
}

void MoeKernels::slots_by_expert(const UnitWorkspace& ws, int64_t n, int64_t K, int64_t* order) {
  for (int64_t k = 0; k < K; ++k) order[k] = k;
  const int32_t* chosen = ws.top_expert.data() + n * K;
  std::sort(order, order + K, [&](int64_t a, int64_t b) { return chosen[a] < chosen[b]; });
}

void MoeKernels::combine(const ModelConfig& c, const UnitWorkspace& ws, const float* x2,
                         float* out) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, K = c.num_experts_per_tok;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, 16), [&](const auto& range) {
    std::vector<int64_t> order(static_cast<size_t>(K));
    std::vector<float> sum(static_cast<size_t>(C));
    for (int64_t n = range.begin(); n < range.end(); ++n) {
      slots_by_expert(ws, n, K, order.data());
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int64_t k : order) {
        const float weight = ws.top_weight[n * K + k];
        const float* y = ws.moe_y.data() + int64_t(ws.row_of[n * K + k]) * C;
        for (int64_t i = 0; i < C; ++i) sum[i] += weight * y[i];
      }
      for (int64_t i = 0; i < C; ++i) out[n * C + i] = x2[n * C + i] + sum[i];
    }
  });
}

void MoeKernels::weight_grads(const ModelConfig& c, const float* dout, int64_t first, int64_t end,
                              float* d_weight, UnitWorkspace& ws) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, K = c.num_experts_per_tok;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, 16), [&](const auto& range) {
    for (int64_t n = range.begin(); n < range.end(); ++n) {
      for (int64_t k = 0; k < K; ++k) {
        const int32_t expert = ws.top_expert[n * K + k];
        if (expert < first || expert >= end) continue;
        float* y = ws.moe_y.data() + int64_t(ws.row_of[n * K + k]) * C;
        const float weight = ws.top_weight[n * K + k];
        double dot = 0.0;
        for (int64_t i = 0; i < C; ++i) {
          dot += double(dout[n * C + i]) * y[i];
          y[i] = weight * dout[n * C + i];
        }
        d_weight[n * K + k] = float(dot);
      }
    }
  });
}

void MoeKernels::experts_backward(const ModelConfig& c, const float* experts, float* d_experts,
                                  int64_t first, int64_t end, UnitWorkspace& ws) {
  const int64_t C = c.hidden_size, I = c.moe_intermediate_size;
  const int64_t r_begin = ws.expert_begin[size_t(first)], r_end = ws.expert_begin[size_t(end)];
  std::fill(ws.d_moe_act.begin() + r_begin * I, ws.d_moe_act.begin() + r_end * I, 0.0f);
  std::fill(ws.d_moe_x.begin() + r_begin * C, ws.d_moe_x.begin() + r_end * C, 0.0f);
  for (int64_t e = first; e < end; ++e) {
    const int64_t r0 = ws.expert_begin[e], n = ws.expert_begin[e + 1] - r0;
    if (n == 0) continue;  // its gradient stays as it was: zero from this micro-batch
    const float* gate_up = experts + (e - first) * 3 * I * C;
    float* d_gate_up = d_experts + (e - first) * 3 * I * C;
    cpu::matmul_backward(ws.d_moe_act.data() + r0 * I, d_gate_up + 2 * I * C,
                         ws.moe_y.data() + r0 * C, ws.moe_act.data() + r0 * I, gate_up + 2 * I * C,
                         n, I, C);
    cpu::swiglu_backward(ws.d_moe_gate_up.data() + r0 * 2 * I, ws.d_moe_act.data() + r0 * I,
                         ws.moe_gate_up.data() + r0 * 2 * I, n, I);
    cpu::matmul_backward(ws.d_moe_x.data() + r0 * C, d_gate_up,
                         ws.d_moe_gate_up.data() + r0 * 2 * I, ws.moe_x.data() + r0 * C, gate_up, n,
                         C, 2 * I);
  }
}

void MoeKernels::add_row_grads(const ModelConfig& c, const UnitWorkspace& ws, int64_t first,
                               int64_t end, float* dxn) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, K = c.num_experts_per_tok;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, 16), [&](const auto& range) {
    std::vector<int64_t> order(static_cast<size_t>(K));
    for (int64_t n = range.begin(); n < range.end(); ++n) {
      slots_by_expert(ws, n, K, order.data());
      float* d = dxn + n * C;
      for (int64_t k : order) {
        const int32_t expert = ws.top_expert[n * K + k];
        if (expert < first || expert >= end) continue;
        const float* dxr = ws.d_moe_x.data() + int64_t(ws.row_of[n * K + k]) * C;
        for (int64_t i = 0; i < C; ++i) d[i] += dxr[i];
      }
    }
  });
}

void MoeKernels::router_grads(const ModelConfig& c, const float* router, float* d_router,
                              const float* xn, const float* d_weight, const float* aux_grad,
                              float* dxn, UnitWorkspace& ws) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size;
  const int64_t E = c.num_experts, K = c.num_experts_per_tok;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, 16), [&](const auto& range) {
    for (int64_t n = range.begin(); n < range.end(); ++n) {
      const float* p = ws.router_probs.data() + n * E;
      float* dp = ws.d_router.data() + n * E;
      for (int64_t e = 0; e < E; ++e) dp[e] = aux_grad != nullptr ? aux_grad[e] : 0.0f;
      const float* weight = ws.top_weight.data() + n * K;
      const float* dw = d_weight + n * K;
      const int32_t* chosen = ws.top_expert.data() + n * K;
      if (c.norm_topk_prob) {  // weight_k = p_k / S: d p_k = (dw_k - sum_j dw_j weight_j) / S
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
  });
  cpu::matmul_backward(dxn, d_router, ws.d_router.data(), xn, router, N, C, E);
}

void MoeKernels::backward(const ModelConfig& c, const float* router, const float* experts,
                          float* d_router, float* d_experts, const float* xn, const float* dout,
                          const float* aux_grad, UnitWorkspace& ws) {
  const int64_t E = c.num_experts;
  weight_grads(c, dout, 0, E, ws.d_top_weight.data(), ws);
  experts_backward(c, experts, d_experts, 0, E, ws);
  std::fill(ws.d_xn.begin(), ws.d_xn.end(), 0.0f);
  add_row_grads(c, ws, 0, E, ws.d_xn.data());
  router_grads(c, router, d_router, xn, ws.d_top_weight.data(), aux_grad, ws.d_xn.data(), ws);
}

void MoeKernels::add_router_stats(const ModelConfig& c, const UnitWorkspace& ws,
                                  RouterStats& stats) {
  const int64_t N = ws.B_ * ws.T_, E = c.num_experts;
  std::vector<double> sums(size_t(E), 0.0);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t n = 0; n < N; ++n) sums[size_t(e)] += ws.router_probs[n * E + e];
  stats.add(ws.expert_begin.data(), sums.data(), N);
}

// --- expert groups ---------------------------------------------------------

void MoeKernels::load_routing(const ModelConfig& c, int64_t sparse_layer, const ExpertChain& chain,
                              UnitWorkspace& ws) {
  const int64_t N = ws.B_ * ws.T_, K = c.num_experts_per_tok;
  const int32_t* experts = chain.top_expert + sparse_layer * N * K;
  const float* weights = chain.top_weight + sparse_layer * N * K;
  std::copy(experts, experts + N * K, ws.top_expert.begin());
  std::copy(weights, weights + N * K, ws.top_weight.begin());
  group_routed_rows(ws.top_expert.data(), N, K, c.num_experts, ws.expert_begin.data(),
                    ws.row_of.data(), ws.row_token.data());
}

void MoeKernels::router_forward(const ModelConfig& c, const float* router, const float* norm,
                                const float* x2, float* out, int64_t sparse_layer,
                                const ExpertChain& chain, UnitWorkspace& ws) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, K = c.num_experts_per_tok;
  cpu::rmsnorm_forward(ws.xn2.data(), ws.rstd2.data(), x2, norm, N, C,
                       static_cast<float>(c.rms_norm_eps));
  route(c, router, ws.xn2.data(), ws);
  if (out == nullptr) return;
  std::copy(ws.top_expert.begin(), ws.top_expert.begin() + N * K,
            chain.top_expert + sparse_layer * N * K);
  std::copy(ws.top_weight.begin(), ws.top_weight.begin() + N * K,
            chain.top_weight + sparse_layer * N * K);
  std::copy(x2, x2 + N * C, chain.rows);
  std::fill(chain.sum, chain.sum + N * C, 0.0f);
  std::copy(ws.xn2.begin(), ws.xn2.begin() + N * C, out);
}

void MoeKernels::group_forward(const ModelConfig& c, const float* experts, int64_t first,
                               int64_t end, bool last, const float* xn, float* out,
                               int64_t sparse_layer, const ExpertChain& chain, UnitWorkspace& ws) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, K = c.num_experts_per_tok;
  load_routing(c, sparse_layer, chain, ws);
  experts_forward(c, experts, first, end, xn, ws);
  if (out == nullptr) return;
  // The whole MLP's combine, this group's slots: the same products added in
  // the same order into the same running sum.
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, 16), [&](const auto& range) {
    std::vector<int64_t> order(static_cast<size_t>(K));
    for (int64_t n = range.begin(); n < range.end(); ++n) {
      slots_by_expert(ws, n, K, order.data());
      float* sum = chain.sum + n * C;
      for (int64_t k : order) {
        const int32_t expert = ws.top_expert[n * K + k];
        if (expert < first || expert >= end) continue;
        const float weight = ws.top_weight[n * K + k];
        const float* y = ws.moe_y.data() + int64_t(ws.row_of[n * K + k]) * C;
        for (int64_t i = 0; i < C; ++i) sum[i] += weight * y[i];
      }
      if (last)
        for (int64_t i = 0; i < C; ++i) out[n * C + i] = chain.rows[n * C + i] + sum[i];
      else if (out != xn)
        std::copy(xn + n * C, xn + (n + 1) * C, out + n * C);
    }
  });
}

void MoeKernels::group_backward(const ModelConfig& c, const float* experts, float* d_experts,
                                int64_t first, int64_t end, bool last, const float* xn,
                                const float* doutput, float* dinput, int64_t sparse_layer,
                                const ExpertChain& chain, UnitWorkspace& ws) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size;
  if (last && doutput != chain.rows) std::copy(doutput, doutput + N * C, chain.rows);
  load_routing(c, sparse_layer, chain, ws);
  experts_forward(c, experts, first, end, xn, ws);
  weight_grads(c, chain.rows, first, end, chain.d_weight, ws);
  experts_backward(c, experts, d_experts, first, end, ws);
  if (last)
    std::fill(dinput, dinput + N * C, 0.0f);
  else if (dinput != doutput)
    std::copy(doutput, doutput + N * C, dinput);
  add_row_grads(c, ws, first, end, dinput);
}

void MoeKernels::router_backward(const ModelConfig& c, const float* router, const float* norm,
                                 float* d_router, float* d_norm, const float* x2,
                                 const float* doutput, float* dx, const float* aux_grad,
                                 const ExpertChain& chain, UnitWorkspace& ws) {
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size;
  cpu::rmsnorm_forward(ws.xn2.data(), ws.rstd2.data(), x2, norm, N, C,
                       static_cast<float>(c.rms_norm_eps));
  route(c, router, ws.xn2.data(), ws);
  std::copy(doutput, doutput + N * C, ws.d_xn.begin());
  router_grads(c, router, d_router, ws.xn2.data(), chain.d_weight, aux_grad, ws.d_xn.data(), ws);
  std::copy(chain.rows, chain.rows + N * C, dx);
  cpu::rmsnorm_backward(dx, d_norm, ws.d_xn.data(), x2, norm, ws.rstd2.data(), N, C);
}

int64_t expert_chain_floats(const ModelConfig& c, int64_t N) {
  const int64_t K = c.num_experts_per_tok;
  return 2 * N * c.hidden_size + N * K + 2 * c.sparse_layer_count() * N * K;
}

bool uses_expert_chain(const ModelConfig& c) {
  return c.expert_groups > 1 || c.mlp_parts > 1;
}

ExpertChain expert_chain_view(const ModelConfig& c, int64_t N, float* buffer) {
  const int64_t C = c.hidden_size, K = c.num_experts_per_tok, S = c.sparse_layer_count();
  ExpertChain chain;
  chain.rows = buffer;
  chain.sum = buffer + N * C;
  chain.d_weight = chain.sum + N * C;
  chain.top_expert = reinterpret_cast<int32_t*>(chain.d_weight + N * K);
  chain.top_weight = chain.d_weight + N * K + S * N * K;
  return chain;
}

}  // namespace strata
