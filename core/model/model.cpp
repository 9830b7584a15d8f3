#include "core/model/model.h"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numbers>

#include "io/safe_write.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/bias.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"

namespace strata {
namespace cpu = kernels::cpu;
namespace {

// Rows of logits computed at once in the head: about 16 MiB of fp32.
constexpr int64_t kHeadLogitElements = 1 << 22;

void add_slot(UnitLayout& layout, std::string name, std::vector<int64_t> shape) {
  TensorSlot slot;
  slot.name = std::move(name);
  slot.offset = layout.numel;
  slot.numel = 1;
  for (int64_t d : shape) slot.numel *= d;
  slot.weight_decay = shape.size() == 2;
  slot.shape = std::move(shape);
  layout.numel += slot.numel;
  layout.tensors.push_back(std::move(slot));
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t name_hash(const std::string& name) {  // FNV-1a
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace

const TensorSlot* UnitLayout::find(const std::string& name) const {
  for (const TensorSlot& slot : tensors) {
    if (slot.name == name) return &slot;
  }
  return nullptr;
}

ModelLayout model_layout(const ModelConfig& c, int world_size) {
  ModelLayout model;
  model.config = c;
  model.world_size = std::max(1, world_size);
  const int64_t C = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, V = c.vocab_size;
  for (const UnitShape& unit : model_units(c)) {
    UnitLayout layout;
    layout.unit = unit;
    if (unit.kind == UnitKind::embedding) {
      add_slot(layout, "model.embed_tokens.weight", {V, C});
    } else if (unit.kind == UnitKind::decoder_layer) {
      const std::string p = fmt::format("model.layers.{}.", unit.layer);
      // q, k, v adjacent: one fused projection of (H + 2 KV) D rows; gate, up likewise.
      add_slot(layout, p + "self_attn.q_proj.weight", {H * D, C});
      add_slot(layout, p + "self_attn.k_proj.weight", {KV * D, C});
      add_slot(layout, p + "self_attn.v_proj.weight", {KV * D, C});
      add_slot(layout, p + "self_attn.o_proj.weight", {C, H * D});
      add_slot(layout, p + "mlp.gate_proj.weight", {I, C});
      add_slot(layout, p + "mlp.up_proj.weight", {I, C});
      add_slot(layout, p + "mlp.down_proj.weight", {C, I});
      add_slot(layout, p + "input_layernorm.weight", {C});
      add_slot(layout, p + "post_attention_layernorm.weight", {C});
      // The families' extras follow, so a Llama layer's layout is the same as ever.
      if (c.qkv_bias) {  // adjacent: one bias of (H + 2 KV) D for the fused projection
        add_slot(layout, p + "self_attn.q_proj.bias", {H * D});
        add_slot(layout, p + "self_attn.k_proj.bias", {KV * D});
        add_slot(layout, p + "self_attn.v_proj.bias", {KV * D});
      }
      if (c.qk_norm) {
        add_slot(layout, p + "self_attn.q_norm.weight", {D});
        add_slot(layout, p + "self_attn.k_norm.weight", {D});
      }
    } else {
      add_slot(layout, "model.norm.weight", {C});
      if (!c.tie_word_embeddings) add_slot(layout, "lm_head.weight", {V, C});
    }
    const int64_t granule = model.world_size * kShardAlignElements;
    layout.padded_numel = (layout.numel + granule - 1) / granule * granule;
    layout.shard_numel = layout.padded_numel / model.world_size;
    model.units.push_back(std::move(layout));
  }
  return model;
}

float init_normal(uint64_t seed, const std::string& name, int64_t index) {
  const uint64_t key = splitmix64(seed ^ splitmix64(name_hash(name)));
  const uint64_t bits = splitmix64(key + static_cast<uint64_t>(index) * 0xd1342543de82ef95ull);
  // Box-Muller on the two 32-bit halves: u1 in (0, 1], u2 in [0, 1).
  const double u1 = (static_cast<double>(bits >> 32) + 1.0) / 4294967296.0;
  const double u2 = static_cast<double>(bits & 0xffffffffull) / 4294967296.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2));
}

void init_unit_parameters(const ModelLayout& model, int64_t u, uint64_t seed, float* flat,
                          float init_std) {
  const UnitLayout& layout = model.units[u];
  std::fill(flat, flat + layout.padded_numel, 0.0f);
  for (const TensorSlot& slot : layout.tensors) {
    float* out = flat + slot.offset;
    if (slot.shape.size() == 1) {  // norms start at one, biases at zero (as transformers does)
      const bool bias = slot.name.ends_with(".bias");
      std::fill(out, out + slot.numel, bias ? 0.0f : 1.0f);
      continue;
    }
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, slot.numel, 4096),
                      [&](const tbb::blocked_range<int64_t>& range) {
                        for (int64_t i = range.begin(); i < range.end(); ++i) {
                          out[i] = init_std * init_normal(seed, slot.name, i);
                        }
                      });
  }
}

UnitWorkspace::UnitWorkspace(const ModelConfig& c, int64_t B, int64_t T) : B_(B), T_(T) {
  const int64_t N = B * T, C = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, V = c.vocab_size;
  const int64_t QKV = (H + 2 * KV) * D;
  rope_cos.resize(T * D / 2);
  rope_sin.resize(T * D / 2);
  rope_tables(c, T, rope_cos.data(), rope_sin.data());
  xn1.resize(N * C);
  rstd1.resize(N);
  qkv.resize(N * QKV);
  probs.resize(B * H * T * T);
  attn.resize(N * H * D);
  x2.resize(N * C);
  xn2.resize(N * C);
  rstd2.resize(N);
  gate_up.resize(N * 2 * I);
  mlp.resize(N * I);
  d_mlp.resize(N * I);
  d_gate_up.resize(N * 2 * I);
  d_xn.resize(N * C);
  d_attn.resize(N * H * D);
  d_qkv.resize(N * QKV);
  d_scores.resize(T * T);
  if (c.qk_norm) {
    q_raw.resize(N * H * D);
    k_raw.resize(N * KV * D);
    q_rstd.resize(N * H);
    k_rstd.resize(N * KV);
    heads.resize(N * std::max(H, KV) * D);
    d_heads.resize(N * std::max(H, KV) * D);
  }
  head_xn.resize(N * C);
  head_rstd.resize(N);
  head_rows = std::clamp<int64_t>(kHeadLogitElements / std::max<int64_t>(V, 1), 1, N);
  logits.resize(head_rows * V);
  losses.resize(N);
}

int64_t UnitWorkspace::bytes_for(const ModelConfig& c, int64_t B, int64_t T) {
  const int64_t N = B * T, C = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, V = c.vocab_size;
  const int64_t QKV = (H + 2 * KV) * D;
  const int64_t head_rows = std::clamp<int64_t>(kHeadLogitElements / std::max<int64_t>(V, 1), 1, N);
  const int64_t floats = T * D                             // rope cos, sin
                         + 4 * N * C + 2 * N               // xn1, x2, xn2, d_xn; rstd1, rstd2
                         + 2 * N * QKV + 2 * N * H * D     // qkv, d_qkv; attn, d_attn
                         + B * H * T * T + T * T           // probs, d_scores
                         + 2 * N * 2 * I + 2 * N * I       // gate_up, d_gate_up; mlp, d_mlp
                         + N * C + N + head_rows * V + N;  // head_xn, head_rstd, logits, losses
  const int64_t qk_norm_floats = c.qk_norm ? N * (H + KV) * D +
                                                 N * (H + KV)  // q_raw, k_raw; q_rstd, k_rstd
                                                 + 2 * N * std::max(H, KV) * D  // heads, d_heads
                                           : 0;
  return (floats + qk_norm_floats) * int64_t(sizeof(float));
}

void rope_tables(const ModelConfig& c, int64_t T, float* cos, float* sin) {
  const int64_t D = c.head_dim;
  cpu::RopeParams rope;
  rope.head_dim = D;
  rope.theta = c.rope_theta;
  rope.llama3_scaling = c.rope_scaling.type == "llama3";
  rope.factor = c.rope_scaling.factor;
  rope.low_freq_factor = c.rope_scaling.low_freq_factor;
  rope.high_freq_factor = c.rope_scaling.high_freq_factor;
  rope.original_max_positions = c.rope_scaling.original_max_position_embeddings;
  std::vector<float> inv_freq(size_t(D / 2));
  cpu::rope_inv_freq(inv_freq.data(), rope);
  cpu::rope_cos_sin(cos, sin, inv_freq.data(), T, D);
}

kernels::cpu::AttentionShape layer_attention_shape(const ModelConfig& c, int64_t B, int64_t T) {
  kernels::cpu::AttentionShape s;
  s.B = B;
  s.T = T;
  s.H = c.num_attention_heads;
  s.KV = c.num_key_value_heads;
  s.D = c.head_dim;
  s.row_stride = (s.H + 2 * s.KV) * s.D;
  s.window = c.sliding_window;
  return s;
}

namespace {

// heads (N * heads, D) = the first `heads` heads of D in each row of x (N, row_stride).
void gather_heads(float* out, const float* x, int64_t N, int64_t heads, int64_t D,
                  int64_t row_stride) {
  for (int64_t n = 0; n < N; ++n)
    std::copy(x + n * row_stride, x + n * row_stride + heads * D, out + n * heads * D);
}

// The inverse of gather_heads: rows of x (N, row_stride) get their first heads * D back.
void scatter_heads(float* x, const float* heads_in, int64_t N, int64_t heads, int64_t D,
                   int64_t row_stride) {
  for (int64_t n = 0; n < N; ++n)
    std::copy(heads_in + n * heads * D, heads_in + (n + 1) * heads * D, x + n * row_stride);
}

}  // namespace

// The unit computations; a struct so it can reach the workspace's buffers.
struct UnitKernels {
  template <typename T>  // const float for parameters, float for gradients
  struct LayerWeights {
    T* qkv;        // (QKV, C): q_proj, k_proj, v_proj stacked
    T* o;          // (C, H D)
    T* gate_up;    // (2 I, C): gate_proj, up_proj stacked
    T* down;       // (C, I)
    T* norm_in;    // (C)
    T* norm_post;  // (C)
    T* qkv_bias;   // (QKV): q_proj, k_proj, v_proj biases stacked; null without
    T* q_norm;     // (D); null without
    T* k_norm;     // (D); null without
  };
  template <typename T>
  static LayerWeights<T> layer_weights(const ModelConfig& c, const UnitLayout& layout, T* flat) {
    const auto& t = layout.tensors;  // order fixed by model_layout
    const size_t extra = c.qkv_bias ? 12 : 9;  // the q/k norms follow the biases
    return {flat + t[0].offset,
            flat + t[3].offset,
            flat + t[4].offset,
            flat + t[6].offset,
            flat + t[7].offset,
            flat + t[8].offset,
            c.qkv_bias ? flat + t[9].offset : nullptr,
            c.qk_norm ? flat + t[extra].offset : nullptr,
            c.qk_norm ? flat + t[extra + 1].offset : nullptr};
  }

  // Qwen3's RMSNorm over each head of q and k, in place in the qkv rows; keeps
  // the inputs and rstd for the backward.
  static void qk_norm_forward(const ModelConfig& c, const LayerWeights<const float>& w,
                              UnitWorkspace& ws) {
    const int64_t N = ws.B_ * ws.T_, H = c.num_attention_heads, KV = c.num_key_value_heads;
    const int64_t D = c.head_dim, QKV = (H + 2 * KV) * D;
    const float eps = static_cast<float>(c.rms_norm_eps);
    float* q = ws.qkv.data();
    gather_heads(ws.q_raw.data(), q, N, H, D, QKV);
    cpu::rmsnorm_forward(ws.heads.data(), ws.q_rstd.data(), ws.q_raw.data(), w.q_norm, N * H, D,
                         eps);
    scatter_heads(q, ws.heads.data(), N, H, D, QKV);
    gather_heads(ws.k_raw.data(), q + H * D, N, KV, D, QKV);
    cpu::rmsnorm_forward(ws.heads.data(), ws.k_rstd.data(), ws.k_raw.data(), w.k_norm, N * KV, D,
                         eps);
    scatter_heads(q + H * D, ws.heads.data(), N, KV, D, QKV);
  }

  // Backward of qk_norm_forward, in place in d_qkv: d(normed q, k) in, d(raw q, k) out.
  static void qk_norm_backward(const ModelConfig& c, const LayerWeights<const float>& w,
                               const LayerWeights<float>& g, UnitWorkspace& ws) {
    const int64_t N = ws.B_ * ws.T_, H = c.num_attention_heads, KV = c.num_key_value_heads;
    const int64_t D = c.head_dim, QKV = (H + 2 * KV) * D;
    float* dq = ws.d_qkv.data();
    for (int part = 0; part < 2; ++part) {
      const int64_t heads = part == 0 ? H : KV;
      float* rows = part == 0 ? dq : dq + H * D;
      gather_heads(ws.heads.data(), rows, N, heads, D, QKV);
      std::fill(ws.d_heads.begin(), ws.d_heads.begin() + N * heads * D, 0.0f);
      cpu::rmsnorm_backward(ws.d_heads.data(), part == 0 ? g.q_norm : g.k_norm, ws.heads.data(),
                            part == 0 ? ws.q_raw.data() : ws.k_raw.data(),
                            part == 0 ? w.q_norm : w.k_norm,
                            part == 0 ? ws.q_rstd.data() : ws.k_rstd.data(), N * heads, D);
      scatter_heads(rows, ws.d_heads.data(), N, heads, D, QKV);
    }
  }

  static void layer_forward(const ModelConfig& c, const UnitLayout& layout, const float* flat,
                            const float* x, float* out, UnitWorkspace& ws) {
    const int64_t B = ws.B_, T = ws.T_, N = B * T, C = c.hidden_size, I = c.intermediate_size;
    const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
    const cpu::AttentionShape s = layer_attention_shape(c, B, T);
    const int64_t QKV = s.row_stride;
    const LayerWeights<const float> w = layer_weights(c, layout, flat);
    const float eps = static_cast<float>(c.rms_norm_eps);
    cpu::rmsnorm_forward(ws.xn1.data(), ws.rstd1.data(), x, w.norm_in, N, C, eps);
    cpu::matmul_forward(ws.qkv.data(), ws.xn1.data(), w.qkv, N, C, QKV);
    if (w.qkv_bias != nullptr) cpu::bias_forward(ws.qkv.data(), w.qkv_bias, N, QKV);
    if (w.q_norm != nullptr) qk_norm_forward(c, w, ws);
    float* q = ws.qkv.data();
    float* k = q + H * D;
    float* v = k + KV * D;
    cpu::rope_forward(q, ws.rope_cos.data(), ws.rope_sin.data(), B, T, H, D, QKV);
    cpu::rope_forward(k, ws.rope_cos.data(), ws.rope_sin.data(), B, T, KV, D, QKV);
    cpu::attention_forward(ws.attn.data(), ws.probs.data(), q, k, v, s);
    std::copy(x, x + N * C, ws.x2.data());
    cpu::matmul_forward(ws.x2.data(), ws.attn.data(), w.o, N, H * D, C, /*accumulate=*/true);
    cpu::rmsnorm_forward(ws.xn2.data(), ws.rstd2.data(), ws.x2.data(), w.norm_post, N, C, eps);
    cpu::matmul_forward(ws.gate_up.data(), ws.xn2.data(), w.gate_up, N, C, 2 * I);
    cpu::swiglu_forward(ws.mlp.data(), ws.gate_up.data(), N, I);
    if (out == nullptr) return;  // recomputation for the backward stops here
    std::copy(ws.x2.begin(), ws.x2.end(), out);
    cpu::matmul_forward(out, ws.mlp.data(), w.down, N, I, C, /*accumulate=*/true);
  }

  static void layer_backward(const ModelConfig& c, const UnitLayout& layout, const float* flat,
                             float* grad_flat, const float* x, const float* dout, float* dx,
                             bool recompute, UnitWorkspace& ws) {
    const int64_t B = ws.B_, T = ws.T_, N = B * T, C = c.hidden_size, I = c.intermediate_size;
    const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
    const cpu::AttentionShape s = layer_attention_shape(c, B, T);
    const int64_t QKV = s.row_stride;
    const LayerWeights<const float> w = layer_weights(c, layout, flat);
    const LayerWeights<float> g = layer_weights(c, layout, grad_flat);
    // Recompute the activations from the checkpointed input; the output is not needed.
    if (recompute) layer_forward(c, layout, flat, x, nullptr, ws);

    // dx starts as the residual gradient; each branch adds into it.
    if (dx != dout) std::copy(dout, dout + N * C, dx);
    // MLP branch: out = x2 + down(swiglu(gate_up(norm_post(x2)))).
    std::fill(ws.d_mlp.begin(), ws.d_mlp.end(), 0.0f);
    cpu::matmul_backward(ws.d_mlp.data(), g.down, dout, ws.mlp.data(), w.down, N, I, C);
    cpu::swiglu_backward(ws.d_gate_up.data(), ws.d_mlp.data(), ws.gate_up.data(), N, I);
    std::fill(ws.d_xn.begin(), ws.d_xn.end(), 0.0f);
    cpu::matmul_backward(ws.d_xn.data(), g.gate_up, ws.d_gate_up.data(), ws.xn2.data(), w.gate_up,
                         N, C, 2 * I);
    cpu::rmsnorm_backward(dx, g.norm_post, ws.d_xn.data(), ws.x2.data(), w.norm_post,
                          ws.rstd2.data(), N, C);
    // dx now holds d(x2). Attention branch: x2 = x + o(attention(rope(qkv(norm_in(x))))).
    std::fill(ws.d_attn.begin(), ws.d_attn.end(), 0.0f);
    cpu::matmul_backward(ws.d_attn.data(), g.o, dx, ws.attn.data(), w.o, N, H * D, C);
    const float* q = ws.qkv.data();
    float* dq = ws.d_qkv.data();
    cpu::attention_backward(dq, dq + H * D, dq + (H + KV) * D, ws.d_scores.data(), ws.d_attn.data(),
                            ws.probs.data(), q, q + H * D, q + (H + KV) * D, s);
    cpu::rope_backward(dq, ws.rope_cos.data(), ws.rope_sin.data(), B, T, H, D, QKV);
    cpu::rope_backward(dq + H * D, ws.rope_cos.data(), ws.rope_sin.data(), B, T, KV, D, QKV);
    if (w.q_norm != nullptr) qk_norm_backward(c, w, g, ws);
    if (g.qkv_bias != nullptr) cpu::bias_backward(g.qkv_bias, dq, N, QKV);
    std::fill(ws.d_xn.begin(), ws.d_xn.end(), 0.0f);
    cpu::matmul_backward(ws.d_xn.data(), g.qkv, dq, ws.xn1.data(), w.qkv, N, C, QKV);
    cpu::rmsnorm_backward(dx, g.norm_in, ws.d_xn.data(), x, w.norm_in, ws.rstd1.data(), N, C);
  }

  // The head over rows [begin, begin + rows): logits into ws.logits.
  static void head_logits(const ModelConfig& c, const float* lm_head, int64_t begin, int64_t rows,
                          UnitWorkspace& ws) {
    cpu::matmul_forward(ws.logits.data(), ws.head_xn.data() + begin * c.hidden_size, lm_head, rows,
                        c.hidden_size, c.vocab_size);
  }

  static double head_forward(const ModelConfig& c, const float* norm, const float* lm_head,
                             const UnitBatch& batch, const float* x, float* logits_out,
                             UnitWorkspace& ws) {
    const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, V = c.vocab_size;
    cpu::rmsnorm_forward(ws.head_xn.data(), ws.head_rstd.data(), x, norm, N, C,
                         static_cast<float>(c.rms_norm_eps));
    double loss_sum = 0.0;
    for (int64_t begin = 0; begin < N; begin += ws.head_rows) {
      const int64_t rows = std::min(ws.head_rows, N - begin);
      head_logits(c, lm_head, begin, rows, ws);
      if (logits_out != nullptr) {
        std::copy(ws.logits.begin(), ws.logits.begin() + rows * V, logits_out + begin * V);
      }
      if (batch.targets != nullptr) {
        cpu::cross_entropy_forward(ws.losses.data() + begin, ws.logits.data(),
                                   batch.targets + begin, rows, V);
      }
    }
    if (batch.targets != nullptr) {
      for (int64_t n = 0; n < N; ++n) loss_sum += ws.losses[n];
    }
    return loss_sum;
  }

  // Forward and backward of the head in one pass over each block of logits.
  static double head_forward_backward(const ModelConfig& c, const float* norm, const float* lm_head,
                                      float* d_norm, float* d_lm_head, const UnitBatch& batch,
                                      const float* x, float* dx, float* logits_out,
                                      UnitWorkspace& ws) {
    const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, V = c.vocab_size;
    cpu::rmsnorm_forward(ws.head_xn.data(), ws.head_rstd.data(), x, norm, N, C,
                         static_cast<float>(c.rms_norm_eps));
    std::fill(ws.d_xn.begin(), ws.d_xn.end(), 0.0f);
    for (int64_t begin = 0; begin < N; begin += ws.head_rows) {
      const int64_t rows = std::min(ws.head_rows, N - begin);
      head_logits(c, lm_head, begin, rows, ws);
      if (logits_out != nullptr) {
        std::copy(ws.logits.begin(), ws.logits.begin() + rows * V, logits_out + begin * V);
      }
      cpu::cross_entropy_forward_backward(ws.losses.data() + begin, ws.logits.data(),
                                          ws.logits.data(), batch.targets + begin, batch.loss_scale,
                                          rows, V);
      cpu::matmul_backward(ws.d_xn.data() + begin * C, d_lm_head, ws.logits.data(),
                           ws.head_xn.data() + begin * C, lm_head, rows, C, V);
    }
    std::fill(dx, dx + N * C, 0.0f);
    cpu::rmsnorm_backward(dx, d_norm, ws.d_xn.data(), x, norm, ws.head_rstd.data(), N, C);
    double loss_sum = 0.0;
    for (int64_t n = 0; n < N; ++n) loss_sum += ws.losses[n];
    return loss_sum;
  }
};

double unit_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                    const UnitBatch& batch, const float* input, float* output, UnitWorkspace& ws) {
  const ModelConfig& c = model.config;
  const UnitLayout& layout = model.units[u];
  const int64_t N = batch.B * batch.T;
  switch (layout.unit.kind) {
    case UnitKind::embedding:
      cpu::embedding_forward(output, batch.tokens, params.flat, N, c.hidden_size);
      return 0.0;
    case UnitKind::decoder_layer:
      UnitKernels::layer_forward(c, layout, params.flat, input, output, ws);
      return 0.0;
    case UnitKind::head: {
      const float* lm_head =
          c.tie_word_embeddings ? params.tied_embedding : params.flat + layout.tensors[1].offset;
      return UnitKernels::head_forward(c, params.flat, lm_head, batch, input, output, ws);
    }
  }
  return 0.0;
}

void unit_backward(const ModelLayout& model, int64_t u, const UnitParams& params,
                   const UnitBatch& batch, const float* input, const float* doutput, float* dinput,
                   const UnitGrads& grads, UnitWorkspace& ws, bool recompute) {
  const ModelConfig& c = model.config;
  const UnitLayout& layout = model.units[u];
  const int64_t N = batch.B * batch.T;
  switch (layout.unit.kind) {
    case UnitKind::embedding:
      cpu::embedding_backward(grads.flat, doutput, batch.tokens, N, c.hidden_size);
      return;
    case UnitKind::decoder_layer:
      UnitKernels::layer_backward(c, layout, params.flat, grads.flat, input, doutput, dinput,
                                  recompute, ws);
      return;
    case UnitKind::head:
      head_forward_backward(model, params, batch, input, dinput, grads, ws);
      return;
  }
}

double head_forward_backward(const ModelLayout& model, const UnitParams& params,
                             const UnitBatch& batch, const float* input, float* dinput,
                             const UnitGrads& grads, UnitWorkspace& ws, float* logits) {
  const ModelConfig& c = model.config;
  const UnitLayout& layout = model.units.back();
  const bool tied = c.tie_word_embeddings;
  const int64_t lm_offset = tied ? 0 : layout.tensors[1].offset;
  const float* lm_head = tied ? params.tied_embedding : params.flat + lm_offset;
  float* d_lm_head = tied ? grads.tied_embedding : grads.flat + lm_offset;
  return UnitKernels::head_forward_backward(c, params.flat, lm_head, grads.flat, d_lm_head, batch,
                                            input, dinput, logits, ws);
}

// --- HostModel -----------------------------------------------------------------

UnitParams HostModel::unit_params(int64_t u) const {
  UnitParams p;
  p.flat = params[u].data();
  if (layout.units[u].unit.kind == UnitKind::head && layout.config.tie_word_embeddings) {
    p.tied_embedding = params[0].data();
  }
  return p;
}

UnitGrads HostModel::unit_grads(int64_t u) {
  UnitGrads g;
  g.flat = grads[u].data();
  if (layout.units[u].unit.kind == UnitKind::head && layout.config.tie_word_embeddings) {
    g.tied_embedding = grads[0].data();
  }
  return g;
}

namespace {
template <typename Buffers>
auto find_tensor(const ModelLayout& layout, Buffers& buffers, const std::string& name)
    -> decltype(buffers[0].data()) {
  const std::string target = name == "lm_head.weight" && layout.config.tie_word_embeddings
                                 ? "model.embed_tokens.weight"
                                 : name;
  for (size_t u = 0; u < layout.units.size(); ++u) {
    if (const TensorSlot* slot = layout.units[u].find(target))
      return buffers[u].data() + slot->offset;
  }
  return nullptr;
}
}  // namespace

const float* HostModel::tensor(const std::string& name) const {
  return find_tensor(layout, params, name);
}

float* HostModel::tensor_grad(const std::string& name) {
  return find_tensor(layout, grads, name);
}

HostModel make_host_model(const ModelConfig& config, int world_size) {
  HostModel model;
  model.layout = model_layout(config, world_size);
  for (const UnitLayout& unit : model.layout.units) {
    model.params.emplace_back(unit.padded_numel, 0.0f);
    model.grads.emplace_back(unit.padded_numel, 0.0f);
  }
  return model;
}

void init_host_model(HostModel& model, uint64_t seed, float init_std) {
  for (size_t u = 0; u < model.layout.units.size(); ++u) {
    init_unit_parameters(model.layout, static_cast<int64_t>(u), seed, model.params[u].data(),
                         init_std);
  }
}

void zero_host_grads(HostModel& model) {
  for (auto& g : model.grads) std::fill(g.begin(), g.end(), 0.0f);
}

std::vector<NamedTensor> checkpoint_tensors(const ModelLayout& layout) {
  // Hugging Face order: embeddings, layers, final norm, lm_head.
  std::vector<NamedTensor> list;
  for (size_t u = 0; u < layout.units.size(); ++u) {
    for (const TensorSlot& slot : layout.units[u].tensors)
      list.push_back({static_cast<int64_t>(u), &slot});
  }
  return list;
}

Status check_token_ids(const ModelConfig& config, const int32_t* ids, int64_t count,
                       bool allow_negative, const std::string& origin) {
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] >= config.vocab_size || (ids[i] < 0 && !allow_negative)) {
      return Status::error(
          fmt::format("{}: token id {} at position {} is outside the vocabulary [0, {})", origin,
                      ids[i], i, config.vocab_size));
    }
  }
  return Status::ok();
}

namespace {

Status check_batch(const HostModel& model, const UnitBatch& batch, const UnitWorkspace& ws) {
  if (batch.B != ws.B() || batch.T != ws.T()) {
    return Status::error(fmt::format("batch is {}x{} but the workspace was made for {}x{}", batch.B,
                                     batch.T, ws.B(), ws.T()));
  }
  const int64_t N = batch.B * batch.T;
  if (Status s = check_token_ids(model.layout.config, batch.tokens, N, false, "input tokens"); !s)
    return s;
  if (batch.targets != nullptr) {
    if (Status s = check_token_ids(model.layout.config, batch.targets, N, true, "targets"); !s)
      return s;
  }
  return Status::ok();
}

// Runs the forward of every unit, keeping each unit's input in `inputs` (L + 1 buffers).
double forward_all(const HostModel& model, const UnitBatch& batch, UnitWorkspace& ws,
                   std::vector<std::vector<float>>& inputs, float* logits) {
  const ModelLayout& layout = model.layout;
  const int64_t units = static_cast<int64_t>(layout.units.size());
  const int64_t NC = batch.B * batch.T * layout.config.hidden_size;
  inputs.assign(units - 1, std::vector<float>(NC));
  unit_forward(layout, 0, model.unit_params(0), batch, nullptr, inputs[0].data(), ws);
  for (int64_t u = 1; u + 1 < units; ++u) {
    unit_forward(layout, u, model.unit_params(u), batch, inputs[u - 1].data(), inputs[u].data(),
                 ws);
  }
  return unit_forward(layout, units - 1, model.unit_params(units - 1), batch,
                      inputs[units - 2].data(), logits, ws);
}

}  // namespace

Result<double> model_forward(const HostModel& model, const UnitBatch& batch, UnitWorkspace& ws,
                             float* logits) {
  if (Status s = check_batch(model, batch, ws); !s) return s;
  std::vector<std::vector<float>> inputs;
  return forward_all(model, batch, ws, inputs, logits);
}

Result<double> model_forward_backward(HostModel& model, const UnitBatch& batch, UnitWorkspace& ws,
                                      float* logits) {
  if (Status s = check_batch(model, batch, ws); !s) return s;
  if (batch.targets == nullptr) return Status::error("model_forward_backward needs targets");
  const ModelLayout& layout = model.layout;
  const int64_t units = static_cast<int64_t>(layout.units.size());
  // Forward through the last layer keeping unit inputs; the head runs forward and
  // backward at once, then the layers and the embedding go backward.
  std::vector<std::vector<float>> inputs(
      units - 1, std::vector<float>(batch.B * batch.T * layout.config.hidden_size));
  unit_forward(layout, 0, model.unit_params(0), batch, nullptr, inputs[0].data(), ws);
  for (int64_t u = 1; u + 1 < units; ++u) {
    unit_forward(layout, u, model.unit_params(u), batch, inputs[u - 1].data(), inputs[u].data(),
                 ws);
  }
  std::vector<float> grad(inputs[0].size());
  const double loss_sum =
      head_forward_backward(layout, model.unit_params(units - 1), batch, inputs[units - 2].data(),
                            grad.data(), model.unit_grads(units - 1), ws, logits);
  for (int64_t u = units - 2; u >= 1; --u) {
    // The last layer's activations are still in the workspace (the head keeps its own).
    unit_backward(layout, u, model.unit_params(u), batch, inputs[u - 1].data(), grad.data(),
                  grad.data(), model.unit_grads(u), ws, /*recompute=*/u != units - 2);
  }
  unit_backward(layout, 0, model.unit_params(0), batch, nullptr, grad.data(), nullptr,
                model.unit_grads(0), ws);
  return loss_sum;
}

Status load_unit_parameters(const SafetensorsCheckpoint& checkpoint, const ModelLayout& layout,
                            int64_t u, float* flat) {
  for (const TensorSlot& slot : layout.units[u].tensors) {
    if (Status s = checkpoint.read_f32(slot.name, slot.shape, flat + slot.offset); !s) return s;
  }
  return Status::ok();
}

Status load_host_model(HostModel& model, const SafetensorsCheckpoint& checkpoint) {
  for (size_t u = 0; u < model.layout.units.size(); ++u) {
    Status s = load_unit_parameters(checkpoint, model.layout, static_cast<int64_t>(u),
                                    model.params[u].data());
    if (!s) return s;
  }
  return Status::ok();
}

Status write_model_config_json(const ModelConfig& model, const std::string& dir, DType dtype) {
  nlohmann::json config = model_config_to_json(model);
  config["torch_dtype"] = dtype == DType::f32    ? "float32"
                          : dtype == DType::bf16 ? "bfloat16"
                                                 : "float16";
  return io::write_file_atomically((std::filesystem::path(dir) / "config.json").string(),
                                   config.dump(2) + "\n");
}

Status save_host_model(const HostModel& model, const std::string& dir, DType dtype,
                       uint64_t max_shard_bytes, bool gradients) {
  const std::vector<NamedTensor> list = checkpoint_tensors(model.layout);
  std::vector<TensorSpec> specs;
  for (const NamedTensor& t : list) specs.push_back({t.slot->name, t.slot->shape});
  const auto& buffers = gradients ? model.grads : model.params;
  Status s = write_safetensors_checkpoint(dir, specs, dtype, max_shard_bytes, [&](size_t i) {
    return buffers[list[i].unit].data() + list[i].slot->offset;
  });
  if (!s) return s;
  return write_model_config_json(model.layout.config, dir, dtype);
  return Status::ok();
}

}  // namespace strata
