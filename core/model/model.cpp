#include "core/model/model.h"

#include <fmt/format.h>
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/model/mlp_part_kernels.h"
#include "core/model/moe_kernels.h"
#include "core/model/vocab_chunks.h"
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

// A sparse layer's router and experts under the released checkpoints' names,
// each also readable from transformers 5's fused tensors.
// The router with `router`, and experts [first, end).
void add_expert_slots(UnitLayout& layout, const ModelConfig& c, const std::string& p, bool router,
                      int64_t first, int64_t end) {
  const int64_t C = c.hidden_size, I = c.moe_intermediate_size, E = c.num_experts;
  const bool mixtral = c.family == ModelFamily::mixtral;
  const std::string moe = p + (mixtral ? "block_sparse_moe." : "mlp.");
  if (router) {
    add_slot(layout, moe + "gate.weight", {E, C});
    if (mixtral) {
      layout.tensors.back().fused_name = p + "mlp.gate.weight";
      layout.tensors.back().fused_shape = {E, C};
    }
  }
  const std::string gate_up = p + "mlp.experts.gate_up_proj", down = p + "mlp.experts.down_proj";
  for (int64_t e = first; e < end; ++e) {
    const std::string x = fmt::format("{}experts.{}.", moe, e);
    add_slot(layout, x + (mixtral ? "w1.weight" : "gate_proj.weight"), {I, C});
    layout.tensors.back().fused_name = gate_up;
    layout.tensors.back().fused_shape = {E, 2 * I, C};
    layout.tensors.back().fused_first = e * 2 * I * C;
    add_slot(layout, x + (mixtral ? "w3.weight" : "up_proj.weight"), {I, C});
    layout.tensors.back().fused_name = gate_up;
    layout.tensors.back().fused_shape = {E, 2 * I, C};
    layout.tensors.back().fused_first = e * 2 * I * C + I * C;
    add_slot(layout, x + (mixtral ? "w2.weight" : "down_proj.weight"), {C, I});
    layout.tensors.back().fused_name = down;
    layout.tensors.back().fused_shape = {E, C, I};
    layout.tensors.back().fused_first = e * C * I;
  }
}

// A decoder layer's tensors, or those of its piece (UnitShape::piece): the
// attention's q, k, v, o, input norm and the families' extras; the MLP's
// projections (or router and experts) and post-attention norm; cut into
// expert groups, the router and the norm, or a group's experts. A whole
// layer keeps the order it always had.
void add_layer_slots(UnitLayout& layout, const ModelConfig& c, const UnitShape& unit) {
  const int64_t C = c.hidden_size, D = c.head_dim, I = c.intermediate_size;
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads;
  const std::string p = fmt::format("model.layers.{}.", unit.layer);
  if (unit.piece == LayerPiece::router) {
    add_expert_slots(layout, c, p, true, 0, 0);
    add_slot(layout, p + "post_attention_layernorm.weight", {C});
    return;
  }
  if (unit.piece == LayerPiece::experts) {
    add_expert_slots(layout, c, p, false, c.expert_group_begin(unit.expert_group),
                     c.expert_group_begin(unit.expert_group + 1));
    return;
  }
  if (unit.piece == LayerPiece::mlp_part) {
    // Rows [b, e) of gate and up (adjacent: one product), columns [b, e) of down.
    const int64_t b = c.mlp_part_begin(unit.mlp_part), e = c.mlp_part_begin(unit.mlp_part + 1);
    for (const char* name : {"gate_proj", "up_proj"}) {
      add_slot(layout, fmt::format("{}mlp.{}.weight", p, name), {e - b, C});
      layout.tensors.back().fused_name = layout.tensors.back().name;
      layout.tensors.back().fused_shape = {I, C};
      layout.tensors.back().fused_first = b * C;
    }
    add_slot(layout, p + "mlp.down_proj.weight", {C, e - b});
    layout.tensors.back().fused_name = layout.tensors.back().name;
    layout.tensors.back().fused_shape = {C, I};
    layout.tensors.back().fused_first = b;
    layout.tensors.back().columns = true;
    if (unit.mlp_part == 0) add_slot(layout, p + "post_attention_layernorm.weight", {C});
    return;
  }
  const bool attention = unit.piece != LayerPiece::mlp, mlp = unit.piece != LayerPiece::attention;
  if (attention) {
    // q, k, v adjacent: one fused projection of (H + 2 KV) D rows; gate, up likewise.
    add_slot(layout, p + "self_attn.q_proj.weight", {H * D, C});
    add_slot(layout, p + "self_attn.k_proj.weight", {KV * D, C});
    add_slot(layout, p + "self_attn.v_proj.weight", {KV * D, C});
    add_slot(layout, p + "self_attn.o_proj.weight", {C, H * D});
  }
  if (mlp) {
    if (c.layer_is_sparse(unit.layer)) {
      add_expert_slots(layout, c, p, true, 0, c.num_experts);
    } else {
      add_slot(layout, p + "mlp.gate_proj.weight", {I, C});
      add_slot(layout, p + "mlp.up_proj.weight", {I, C});
      add_slot(layout, p + "mlp.down_proj.weight", {C, I});
    }
  }
  if (attention) add_slot(layout, p + "input_layernorm.weight", {C});
  if (mlp) add_slot(layout, p + "post_attention_layernorm.weight", {C});
  if (!attention) return;
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
}

// embed_tokens or lm_head (V, C), or chunk `chunk`'s rows of it.
void add_vocab_slot(UnitLayout& layout, const ModelConfig& c, const std::string& name,
                    int64_t chunk) {
  const int64_t V = c.vocab_size, C = c.hidden_size;
  if (chunk < 0) {
    add_slot(layout, name, {V, C});
    return;
  }
  const int64_t begin = c.vocab_chunk_begin(chunk), end = c.vocab_chunk_begin(chunk + 1);
  add_slot(layout, name, {end - begin, C});
  layout.tensors.back().fused_name = name;
  layout.tensors.back().fused_shape = {V, C};
  layout.tensors.back().fused_first = begin * C;
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

const TensorSlot* lm_head_slot(const UnitLayout& head) {
  return head.find("lm_head.weight");
}

const TensorSlot* UnitLayout::find(const std::string& name) const {
  for (const TensorSlot& slot : tensors) {
    if (slot.name == name) return &slot;
  }
  return nullptr;
}

void RouterStats::reset(int64_t experts) {
  assigned.assign(size_t(experts), 0.0);
  prob_sum.assign(size_t(experts), 0.0);
  rows = 0;
}

void RouterStats::add(const int64_t* expert_begin, const double* prob_sums, int64_t N) {
  for (size_t e = 0; e < assigned.size(); ++e) {
    assigned[e] += double(expert_begin[e + 1] - expert_begin[e]);
    prob_sum[e] += prob_sums[e];
  }
  rows += double(N);
}

double RouterStats::aux_loss() const {
  if (rows <= 0) return 0.0;
  double sum = 0.0;
  for (size_t e = 0; e < assigned.size(); ++e) sum += (assigned[e] / rows) * (prob_sum[e] / rows);
  return double(assigned.size()) * sum;
}

ModelLayout model_layout(const ModelConfig& c, int world_size) {
  ModelLayout model;
  model.config = c;
  model.world_size = std::max(1, world_size);
  const int64_t C = c.hidden_size;
  for (const UnitShape& unit : model_units(c)) {
    UnitLayout layout;
    layout.unit = unit;
    if (unit.kind == UnitKind::embedding) {
      add_vocab_slot(layout, c, "model.embed_tokens.weight", unit.chunk);
    } else if (unit.kind == UnitKind::decoder_layer) {
      add_layer_slots(layout, c, unit);
    } else {
      if (unit.chunk <= 0) add_slot(layout, "model.norm.weight", {C});
      if (!c.tie_word_embeddings) add_vocab_slot(layout, c, "lm_head.weight", unit.chunk);
    }
    const int64_t granule = model.world_size * kShardAlignElements;
    layout.padded_numel = (layout.numel + granule - 1) / granule * granule;
    layout.shard_numel = layout.padded_numel / model.world_size;
    layout.experts = locate_experts(c, layout);
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
    // A vocabulary chunk's rows, or an MLP part's, draw the whole tensor's
    // values: a cut model starts as the whole one does.
    const bool part = slot.is_part();
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, slot.numel, 4096),
                      [&](const tbb::blocked_range<int64_t>& range) {
                        for (int64_t i = range.begin(); i < range.end(); ++i) {
                          out[i] = init_std *
                                   init_normal(seed, slot.name, part ? slot.part_element(i) : i);
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
  // A mixture whose layers are all sparse has no dense MLP to hold.
  const int64_t dense_rows = c.sparse_layer_count() < c.num_hidden_layers ? N : 0;
  gate_up.resize(dense_rows * 2 * I);
  mlp.resize(dense_rows * I);
  d_mlp.resize(dense_rows * I);
  d_gate_up.resize(dense_rows * 2 * I);
  if (c.sparse_layer_count() > 0) {
    const int64_t E = c.num_experts, K = c.num_experts_per_tok, IE = c.moe_intermediate_size;
    router_probs.resize(N * E);
    d_router.resize(N * E);
    top_expert.resize(N * K);
    row_of.resize(N * K);
    top_weight.resize(N * K);
    d_top_weight.resize(N * K);
    expert_begin.resize(E + 1);
    row_token.resize(N * K);
    for (auto* rows_c : {&moe_x, &moe_y, &d_moe_x}) rows_c->resize(N * K * C);
    for (auto* rows_2i : {&moe_gate_up, &d_moe_gate_up}) rows_2i->resize(N * K * 2 * IE);
    for (auto* rows_i : {&moe_act, &d_moe_act}) rows_i->resize(N * K * IE);
  }
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
  const int64_t dense_rows = c.sparse_layer_count() < c.num_hidden_layers ? N : 0;
  const int64_t E = c.num_experts, K = c.num_experts_per_tok, IE = c.moe_intermediate_size;
  const int64_t moe_floats =
      c.sparse_layer_count() == 0
          ? 0
          : 2 * N * E + 5 * N * K + (E + 1) * 2  // router probs, d; top k, rows; begins
                + N * K * (3 * C + 4 * IE + 2 * IE);  // moe_x, y, d_x; gate_up, d; act, d
  const int64_t floats = T * D                                      // rope cos, sin
                         + 4 * N * C + 2 * N                        // xn1, x2, xn2, d_xn; rstd1, 2
                         + 2 * N * QKV + 2 * N * H * D              // qkv, d_qkv; attn, d_attn
                         + B * H * T * T + T * T                    // probs, d_scores
                         + 2 * dense_rows * 2 * I + 2 * dense_rows * I  // gate_up, d; mlp, d
                         + N * C + N + head_rows * V + N  // head_xn, head_rstd, logits, losses
                         + moe_floats;
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
    T* gate_up;    // (2 I, C): gate_proj, up_proj stacked; null in a sparse layer
    T* down;       // (C, I); null in a sparse layer
    T* norm_in;    // (C)
    T* norm_post;  // (C)
    T* qkv_bias;   // (QKV): q_proj, k_proj, v_proj biases stacked; null without
    T* q_norm;     // (D); null without
    T* k_norm;     // (D); null without
    T* router;     // (E, C) in a sparse layer; null otherwise
    T* experts;    // expert e's gate and up (2 I, C) at e * 3 I C, its down (C, I) after them
  };
  // A whole layer's weights, or its piece's (the other piece's are null).
  template <typename T>
  static LayerWeights<T> layer_weights(const ModelConfig& c, const UnitLayout& layout, T* flat) {
    const std::string p = fmt::format("model.layers.{}.", layout.unit.layer);
    auto at = [&](const std::string& name) -> T* {
      const TensorSlot* slot = layout.find(p + name);
      return slot == nullptr ? nullptr : flat + slot->offset;
    };
    const bool mixtral = c.family == ModelFamily::mixtral;
    const std::string moe = mixtral ? "block_sparse_moe." : "mlp.";
    return {at("self_attn.q_proj.weight"),
            at("self_attn.o_proj.weight"),
            at("mlp.gate_proj.weight"),
            at("mlp.down_proj.weight"),
            at("input_layernorm.weight"),
            at("post_attention_layernorm.weight"),
            at("self_attn.q_proj.bias"),
            at("self_attn.q_norm.weight"),
            at("self_attn.k_norm.weight"),
            at(moe + "gate.weight"),
            at(moe + (mixtral ? "experts.0.w1.weight" : "experts.0.gate_proj.weight"))};
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

  // The attention half: x2 = x + o(attention(rope(qkv(norm_in(x))))).
  static void attention_forward(const ModelConfig& c, const LayerWeights<const float>& w,
                                const float* x, float* x2, UnitWorkspace& ws) {
    const int64_t B = ws.B_, T = ws.T_, N = B * T, C = c.hidden_size;
    const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
    const cpu::AttentionShape s = layer_attention_shape(c, B, T);
    const int64_t QKV = s.row_stride;
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
    std::copy(x, x + N * C, x2);
    cpu::matmul_forward(x2, ws.attn.data(), w.o, N, H * D, C, /*accumulate=*/true);
  }

  // The MLP half: out = x2 + down(swiglu(gate_up(norm_post(x2)))), or the
  // experts'; with no `out` (recomputation for the backward) it stops before it.
  static void mlp_forward(const ModelConfig& c, const LayerWeights<const float>& w, const float* x2,
                          float* out, UnitWorkspace& ws) {
    const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, I = c.intermediate_size;
    const float eps = static_cast<float>(c.rms_norm_eps);
    cpu::rmsnorm_forward(ws.xn2.data(), ws.rstd2.data(), x2, w.norm_post, N, C, eps);
    if (w.router != nullptr) {
      MoeKernels::route(c, w.router, ws.xn2.data(), ws);
      MoeKernels::experts_forward(c, w.experts, 0, c.num_experts, ws.xn2.data(), ws);
      if (out != nullptr) MoeKernels::combine(c, ws, x2, out);
      return;
    }
    cpu::matmul_forward(ws.gate_up.data(), ws.xn2.data(), w.gate_up, N, C, 2 * I);
    cpu::swiglu_forward(ws.mlp.data(), ws.gate_up.data(), N, I);
    if (out == nullptr) return;
    std::copy(x2, x2 + N * C, out);
    cpu::matmul_forward(out, ws.mlp.data(), w.down, N, I, C, /*accumulate=*/true);
  }

  // A whole layer, or its piece: the attention's output is its x2, the
  // MLP's input is. A whole layer keeps x2 in ws.x2. No `out`: recomputation
  // for the backward (of the MLP, up to its last product).
  static void layer_forward(const ModelConfig& c, const UnitLayout& layout, const float* flat,
                            const float* x, float* out, UnitWorkspace& ws) {
    const LayerWeights<const float> w = layer_weights(c, layout, flat);
    const LayerPiece piece = layout.unit.piece;
    if (piece == LayerPiece::mlp) return mlp_forward(c, w, x, out, ws);
    float* x2 = piece == LayerPiece::attention && out != nullptr ? out : ws.x2.data();
    attention_forward(c, w, x, x2, ws);
    if (piece == LayerPiece::whole) mlp_forward(c, w, ws.x2.data(), out, ws);
  }

  // The routing alone, as mlp_forward computes it (a whole layer's attention first).
  static std::vector<uint8_t> route_only(const ModelConfig& c, const UnitLayout& layout,
                                         const float* flat, const float* x, UnitWorkspace& ws) {
    // A piece of experts routes by its router piece's recorded choice: every expert may be read.
    if (layout.unit.piece == LayerPiece::experts)
      return std::vector<uint8_t>(size_t(c.num_experts), 1);
    const LayerWeights<const float> w = layer_weights(c, layout, flat);
    const float* x2 = x;
    if (layout.unit.piece == LayerPiece::whole) {
      attention_forward(c, w, x, ws.x2.data(), ws);
      x2 = ws.x2.data();
    }
    const int64_t N = ws.B_ * ws.T_;
    cpu::rmsnorm_forward(ws.xn2.data(), ws.rstd2.data(), x2, w.norm_post, N, c.hidden_size,
                         static_cast<float>(c.rms_norm_eps));
    MoeKernels::route(c, w.router, ws.xn2.data(), ws);
    std::vector<uint8_t> used(size_t(c.num_experts), 0);
    for (int64_t e = 0; e < c.num_experts; ++e)
      used[size_t(e)] = ws.expert_begin[size_t(e) + 1] > ws.expert_begin[size_t(e)];
    return used;
  }

  // Backward of the MLP half (mlp_forward): dx += its branch's d(x2).
  static void mlp_backward(const ModelConfig& c, const LayerWeights<const float>& w,
                           const LayerWeights<float>& g, const float* x2, const float* dout,
                           float* dx, const float* aux_grad, UnitWorkspace& ws) {
    const int64_t N = ws.B_ * ws.T_, C = c.hidden_size, I = c.intermediate_size;
    if (w.router != nullptr) {
      MoeKernels::backward(c, w.router, w.experts, g.router, g.experts, ws.xn2.data(), dout,
                           aux_grad, ws);
    } else {
      std::fill(ws.d_mlp.begin(), ws.d_mlp.end(), 0.0f);
      cpu::matmul_backward(ws.d_mlp.data(), g.down, dout, ws.mlp.data(), w.down, N, I, C);
      cpu::swiglu_backward(ws.d_gate_up.data(), ws.d_mlp.data(), ws.gate_up.data(), N, I);
      std::fill(ws.d_xn.begin(), ws.d_xn.end(), 0.0f);
      cpu::matmul_backward(ws.d_xn.data(), g.gate_up, ws.d_gate_up.data(), ws.xn2.data(),
                           w.gate_up, N, C, 2 * I);
    }
    cpu::rmsnorm_backward(dx, g.norm_post, ws.d_xn.data(), x2, w.norm_post, ws.rstd2.data(), N, C);
  }

  // Backward of the attention half (attention_forward): dx holds d(x2) and
  // gains the branch's d(x).
  static void attention_backward(const ModelConfig& c, const LayerWeights<const float>& w,
                                 const LayerWeights<float>& g, const float* x, float* dx,
                                 UnitWorkspace& ws) {
    const int64_t B = ws.B_, T = ws.T_, N = B * T, C = c.hidden_size;
    const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
    const cpu::AttentionShape s = layer_attention_shape(c, B, T);
    const int64_t QKV = s.row_stride;
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

  // Backward of a whole layer or its piece. dx starts as the residual
  // gradient, and each branch adds into it: the MLP's (whose x2 is a whole
  // layer's ws.x2, the MLP piece's input), then the attention's.
  static void layer_backward(const ModelConfig& c, const UnitLayout& layout, const float* flat,
                             float* grad_flat, const float* x, const float* dout, float* dx,
                             bool recompute, const float* aux_grad, UnitWorkspace& ws) {
    const int64_t N = ws.B_ * ws.T_, C = c.hidden_size;
    const LayerWeights<const float> w = layer_weights(c, layout, flat);
    const LayerWeights<float> g = layer_weights(c, layout, grad_flat);
    const LayerPiece piece = layout.unit.piece;
    // Recompute the activations from the checkpointed input; the output is not needed.
    if (recompute) layer_forward(c, layout, flat, x, nullptr, ws);
    if (dx != dout) std::copy(dout, dout + N * C, dx);
    if (piece != LayerPiece::attention) {
      const float* x2 = piece == LayerPiece::mlp ? x : ws.x2.data();
      mlp_backward(c, w, g, x2, dout, dx, aux_grad, ws);
    }
    if (piece != LayerPiece::mlp) attention_backward(c, w, g, x, dx, ws);
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

int64_t sparse_layer_index(const ModelConfig& c, int64_t layer) {
  int64_t index = 0;
  for (int64_t i = 0; i < layer; ++i) index += c.layer_is_sparse(i) ? 1 : 0;
  return index;
}

namespace {

// A sparse layer cut into expert groups (moe_kernels.h): its router piece's
// and its pieces of experts' weights and chain.
struct ExpertPiece {
  const float* router = nullptr;  // router piece: the router (E, C) and the post-attention norm
  const float* norm = nullptr;
  int64_t router_offset = 0, norm_offset = 0;
  ExpertBlocks experts;  // piece of experts
  bool last = false;     // the layer's last group
  int64_t sparse = 0;    // the layer's index among the sparse layers
};
ExpertPiece expert_piece(const ModelLayout& model, int64_t u, const float* flat) {
  const ModelConfig& c = model.config;
  const UnitLayout& layout = model.units[size_t(u)];
  ExpertPiece piece;
  piece.sparse = sparse_layer_index(c, layout.unit.layer);
  if (layout.unit.piece == LayerPiece::experts) {
    piece.experts = expert_blocks(model, u);
    piece.last = layout.unit.expert_group == c.expert_groups - 1;
    return piece;
  }
  piece.router_offset = layout.tensors[0].offset;  // the router, then the norm (add_layer_slots)
  piece.norm_offset = layout.tensors[1].offset;
  piece.router = flat + piece.router_offset;
  piece.norm = flat + piece.norm_offset;
  return piece;
}
void expert_router_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                           const UnitBatch& batch, const float* input, float* output,
                           UnitWorkspace& ws) {
  const ExpertPiece p = expert_piece(model, u, params.flat);
  MoeKernels::router_forward(model.config, p.router, p.norm, input, output, p.sparse, batch.experts,
                             ws);
}

void expert_group_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                          const UnitBatch& batch, const float* input, float* output,
                          UnitWorkspace& ws) {
  const ExpertPiece p = expert_piece(model, u, params.flat);
  MoeKernels::group_forward(model.config, params.flat + p.experts.offset, p.experts.first,
                            p.experts.first + p.experts.count, p.last, input, output, p.sparse,
                            batch.experts, ws);
}

void expert_piece_backward(const ModelLayout& model, int64_t u, const UnitParams& params,
                           const UnitBatch& batch, const float* input, const float* doutput,
                           float* dinput, const UnitGrads& grads, UnitWorkspace& ws) {
  const ModelConfig& c = model.config;
  const ExpertPiece p = expert_piece(model, u, params.flat);
  if (model.units[size_t(u)].unit.piece == LayerPiece::experts) {
    MoeKernels::group_backward(c, params.flat + p.experts.offset, grads.flat + p.experts.offset,
                               p.experts.first, p.experts.first + p.experts.count, p.last, input,
                               doutput, dinput, p.sparse, batch.experts, ws);
    return;
  }
  const std::vector<float> aux_grad = router_aux_grad(c, batch);
  MoeKernels::router_backward(c, p.router, p.norm, grads.flat + p.router_offset,
                              grads.flat + p.norm_offset, input, doutput, dinput,
                              aux_grad.empty() ? nullptr : aux_grad.data(), batch.experts, ws);
}

}  // namespace

double unit_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                    const UnitBatch& batch, const float* input, float* output, UnitWorkspace& ws) {
  const ModelConfig& c = model.config;
  const UnitLayout& layout = model.units[u];
  const int64_t N = batch.B * batch.T;
  if (layout.unit.chunk >= 0)
    return vocab_chunk_forward(model, u, params, batch, input, output, ws);
  switch (layout.unit.kind) {
    case UnitKind::embedding:
      cpu::embedding_forward(output, batch.tokens, params.flat, N, c.hidden_size);
      if (batch.router != nullptr) batch.router->reset(c.num_experts);
      return 0.0;
    case UnitKind::decoder_layer:
      if (layout.unit.piece == LayerPiece::experts) {
        expert_group_forward(model, u, params, batch, input, output, ws);
        return 0.0;
      }
      if (layout.unit.piece == LayerPiece::mlp_part) {
        MlpPartKernels::forward(model, u, params.flat, input, output, batch.experts, ws);
        return 0.0;
      }
      if (layout.unit.piece == LayerPiece::router)
        expert_router_forward(model, u, params, batch, input, output, ws);
      else
        UnitKernels::layer_forward(c, layout, params.flat, input, output, ws);
      if (batch.router != nullptr && c.layer_is_sparse(layout.unit.layer) &&
          layout.unit.piece != LayerPiece::attention)
        MoeKernels::add_router_stats(c, ws, *batch.router);
      return 0.0;
    case UnitKind::head: {
      const float* lm_head =
          c.tie_word_embeddings ? params.tied_embedding : params.flat + layout.tensors[1].offset;
      return UnitKernels::head_forward(c, params.flat, lm_head, batch, input, output, ws);
    }
  }
  return 0.0;
}

void group_routed_rows(const int32_t* top_expert, int64_t N, int64_t K, int64_t E,
                       int64_t* expert_begin, int32_t* row_of, int32_t* row_token) {
  std::fill(expert_begin, expert_begin + E + 1, 0);
  for (int64_t i = 0; i < N * K; ++i) ++expert_begin[top_expert[i] + 1];
  for (int64_t e = 0; e < E; ++e) expert_begin[e + 1] += expert_begin[e];
  std::vector<int64_t> next(expert_begin, expert_begin + E);
  for (int64_t i = 0; i < N * K; ++i) {
    const int64_t row = next[size_t(top_expert[i])]++;
    row_of[i] = int32_t(row);
    row_token[row] = int32_t(i / K);
  }
}

std::vector<float> router_aux_grad(const ModelConfig& c, const UnitBatch& batch) {
  std::vector<float> aux_grad;
  if (batch.router == nullptr || batch.aux_loss_scale == 0.0f || batch.router->rows <= 0)
    return aux_grad;
  const RouterStats& stats = *batch.router;
  for (double a : stats.assigned)
    aux_grad.push_back(float(double(batch.aux_loss_scale) * double(c.num_experts) * a /
                             (stats.rows * stats.rows)));
  return aux_grad;
}

std::vector<uint8_t> routed_experts(const ModelLayout& model, int64_t u, const UnitParams& params,
                                    const float* input, UnitWorkspace& ws) {
  return UnitKernels::route_only(model.config, model.units[size_t(u)], params.flat, input, ws);
}

std::vector<uint8_t> chain_routed_experts(const ModelLayout& model, int64_t u,
                                          const ExpertChain& chain, int64_t N) {
  const ModelConfig& c = model.config;
  const int64_t sparse = sparse_layer_index(c, model.units[size_t(u)].unit.layer);
  return group_routed_experts(model, u, chain.top_expert + sparse * N * c.num_experts_per_tok, N);
}

std::vector<uint8_t> group_routed_experts(const ModelLayout& model, int64_t u,
                                          const int32_t* chosen, int64_t N) {
  const ModelConfig& c = model.config;
  const ExpertBlocks experts = expert_blocks(model, u);
  const int64_t K = c.num_experts_per_tok;
  std::vector<uint8_t> routed(size_t(c.num_experts), 0);
  for (int64_t i = 0; i < N * K; ++i)
    if (chosen[i] >= experts.first && chosen[i] < experts.first + experts.count)
      routed[size_t(chosen[i])] = 1;
  return routed;
}

void unit_backward(const ModelLayout& model, int64_t u, const UnitParams& params,
                   const UnitBatch& batch, const float* input, const float* doutput, float* dinput,
                   const UnitGrads& grads, UnitWorkspace& ws, bool recompute) {
  const ModelConfig& c = model.config;
  const UnitLayout& layout = model.units[u];
  const int64_t N = batch.B * batch.T;
  if (layout.unit.chunk >= 0 && u != int64_t(model.units.size()) - 1) {
    vocab_chunk_backward(model, u, params, batch, input, doutput, dinput, grads, ws);
    return;
  }
  switch (layout.unit.kind) {
    case UnitKind::embedding:
      cpu::embedding_backward(grads.flat, doutput, batch.tokens, N, c.hidden_size);
      return;
    case UnitKind::decoder_layer: {
      if (layout.unit.piece == LayerPiece::router || layout.unit.piece == LayerPiece::experts) {
        expert_piece_backward(model, u, params, batch, input, doutput, dinput, grads, ws);
        return;
      }
      if (layout.unit.piece == LayerPiece::mlp_part) {
        MlpPartKernels::backward(model, u, params.flat, grads.flat, input, doutput, dinput,
                                 batch.experts, ws, recompute);
        return;
      }
      const std::vector<float> aux_grad = router_aux_grad(c, batch);
      UnitKernels::layer_backward(c, layout, params.flat, grads.flat, input, doutput, dinput,
                                  recompute, aux_grad.empty() ? nullptr : aux_grad.data(), ws);
      return;
    }
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
  if (layout.unit.chunk >= 0)
    return vocab_chunk_head_pass(model, params, batch, input, dinput, grads, ws, logits);
  const bool tied = c.tie_word_embeddings;
  const int64_t lm_offset = tied ? 0 : layout.tensors[1].offset;
  const float* lm_head = tied ? params.tied_embedding : params.flat + lm_offset;
  float* d_lm_head = tied ? grads.tied_embedding : grads.flat + lm_offset;
  return UnitKernels::head_forward_backward(c, params.flat, lm_head, grads.flat, d_lm_head, batch,
                                            input, dinput, logits, ws);
}

}  // namespace strata
