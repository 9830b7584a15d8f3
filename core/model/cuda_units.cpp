#include "core/model/cuda_units.h"

#include <algorithm>
#include <vector>

#include "core/model/cuda_units_buffers.h"
#include "io/base/sizes.h"

namespace strata {
namespace {

// The head's logits are computed in blocks of rows of at most this many bytes.
constexpr int64_t kHeadLogitBytes = int64_t{256} << 20;

}  // namespace

int64_t cuda_head_rows(const ModelConfig& config, int64_t B, int64_t T, int type_bytes) {
  const int64_t N = B * T;
  const int64_t rows = kHeadLogitBytes / std::max<int64_t>(1, config.vocab_size * type_bytes);
  // Multiples of 8 rows keep every block's pointers 16-byte aligned for cuBLASLt.
  return std::clamp<int64_t>(rows / 8 * 8, std::min<int64_t>(N, 8), N);
}

}  // namespace strata

#if STRATA_HAS_CUDA
#include <fmt/format.h>

namespace strata {
namespace cuda = kernels::cuda;
namespace {

constexpr int64_t kAlign = 256;

// The workspace's buffers in order, as (bytes) entries; CudaUnits::create lays
// them out in this same order.
struct WorkspaceShape {
  int64_t N, C, I, H, KV, D, QKV, V, B, T, ts, head_rows, scratch;
  int64_t qk_norm;  // 1 with per-head q/k norms (qwen3), else 0: their buffers are empty
  int64_t moe;      // 1 with sparse layers, else 0: their buffers are empty
  int64_t E, K, R, IE;  // experts, experts per token, routed rows N K, an expert's intermediate
  std::vector<int64_t> sizes() const {
    const int64_t most_heads = std::max(H, KV);
    return {
        N * C * ts,                         // xn1
        N * 4,                              // rstd1
        N * QKV * ts,                       // qkv
        B * H * T * 4,                      // lse
        N * H * D * ts,                     // attn
        N * C * ts,                         // x2
        N * C * ts,                         // xn2
        N * 4,                              // rstd2
        N * 2 * I * ts,                     // gate_up
        N * I * ts,                         // mlp
        N * I * ts,                         // d_mlp
        N * 2 * I * ts,                     // d_gate_up
        N * C * ts,                         // d_xn
        N * H * D * ts,                     // d_attn
        N * QKV * ts,                       // d_qkv
        B * H * T * 4,                      // delta
        N * C * ts,                         // head_xn
        N * 4,                              // head_rstd
        head_rows * V * ts,                 // logits
        scratch,                            // backward scratch (RMSNorm, embedding)
        T * (D / 2) * 4,                    // rope cos
        T * (D / 2) * 4,                    // rope sin
        qk_norm * N * H * D * ts,           // q_raw: q before its norm
        qk_norm * N * KV * D * ts,          // k_raw
        qk_norm * N * H * 4,                // q_rstd
        qk_norm * N * KV * 4,               // k_rstd
        qk_norm * N * most_heads * D * ts,  // heads: (N * heads, D) contiguous
        qk_norm * N * most_heads * D * ts,  // d_heads
        moe * N * E * ts,                   // router logits, then their gradient
        moe * N * E * 4,                    // router probabilities
        moe * N * K * 4,                    // top_expert
        moe * N * K * 4,                    // top_weight
        moe * N * K * 4,                    // d_top_weight
        moe * N * K * 4,                    // row_of
        moe * R * 4,                        // row_token
        moe * E * 4,                        // aux_grad
        moe * E * 8,                        // prob_sums
        moe * R * C * ts,                   // moe_x: the routed rows' inputs
        moe * R * 2 * IE * ts,              // moe_gate_up
        moe * R * IE * ts,                  // moe_act: SwiGLU's output
        moe * R * C * ts,                   // moe_y: the experts' outputs, then their gradient
        moe * R * C * ts,                   // d_moe_x
        moe * R * 2 * IE * ts,              // d_moe_gate_up
        moe * R * IE * ts,                  // d_moe_act
    };
  }
};

WorkspaceShape workspace_shape(const ModelConfig& c, int64_t B, int64_t T, int ts) {
  WorkspaceShape s{};
  s.B = B;
  s.T = T;
  s.N = B * T;
  s.C = c.hidden_size;
  s.I = c.intermediate_size;
  s.H = c.num_attention_heads;
  s.KV = c.num_key_value_heads;
  s.D = c.head_dim;
  s.QKV = (s.H + 2 * s.KV) * s.D;
  s.V = c.vocab_size;
  s.ts = ts;
  s.head_rows = cuda_head_rows(c, B, T, ts);
  s.qk_norm = c.qk_norm ? 1 : 0;
  s.moe = c.sparse_layer_count() > 0 ? 1 : 0;
  s.E = c.num_experts;
  s.K = c.num_experts_per_tok;
  s.R = s.N * s.K;
  s.IE = c.moe_intermediate_size;
  s.scratch = int64_t(std::max(cuda::rmsnorm_backward_scratch_bytes(s.N, s.C),
                               cuda::embedding_backward_scratch_bytes(s.N, s.V)));
  if (c.qk_norm)
    s.scratch = std::max(
        s.scratch, int64_t(cuda::rmsnorm_backward_scratch_bytes(s.N * std::max(s.H, s.KV), s.D)));
  return s;
}

}  // namespace

int64_t cuda_unit_workspace_bytes(const ModelConfig& config, int64_t B, int64_t T, int type_bytes) {
  int64_t total = 0;
  for (int64_t size : workspace_shape(config, B, T, type_bytes).sizes())
    total += round_up(size, kAlign);
  return total;
}

int64_t cuda_grad_norm_scratch_bytes(int64_t numel) {
  return int64_t(cuda::grad_norm_scratch_bytes(numel));
}

CudaUnits::CudaUnits(const ModelLayout& layout, int64_t B, int64_t T, cuda::DType type,
                     cuda::Matmuls& matmuls)
    : layout_(layout), B_(B), T_(T), type_(type), matmuls_(matmuls) {}

CudaUnits::~CudaUnits() = default;

Result<std::unique_ptr<CudaUnits>> CudaUnits::create(const ModelLayout& layout, int64_t B,
                                                     int64_t T, cuda::DType type, std::byte* memory,
                                                     int64_t bytes, cuda::Matmuls& matmuls) {
  const ModelConfig& c = layout.config;
  const int ts = int(cuda::dtype_size(type));
  const WorkspaceShape shape = workspace_shape(c, B, T, ts);
  if (bytes < cuda_unit_workspace_bytes(c, B, T, ts))
    return Status::error(fmt::format("CUDA unit workspace: {} bytes given, {} needed", bytes,
                                     cuda_unit_workspace_bytes(c, B, T, ts)));
  if (c.head_dim > 128)
    return Status::error(fmt::format(
        "head_dim {} is above the CUDA attention kernel's 128; use the CPU backend", c.head_dim));
  if (Status s = check_sequence_window(c, T); !s) return s;
  if (shape.moe != 0 && shape.K > cuda::kMoeMaxTopK)
    return Status::error(fmt::format(
        "num_experts_per_tok {} is above the CUDA routing kernels' {}; use the CPU backend",
        shape.K, cuda::kMoeMaxTopK));
  std::unique_ptr<CudaUnits> units(new CudaUnits(layout, B, T, type, matmuls));
  auto b = std::make_unique<Buffers>();
  std::vector<std::byte*> at;
  std::byte* next = memory;
  for (int64_t size : shape.sizes()) {
    at.push_back(next);
    next += round_up(size, kAlign);
  }
  size_t i = 0;
  b->xn1 = at[i++];
  b->rstd1 = reinterpret_cast<float*>(at[i++]);
  b->qkv = at[i++];
  b->lse = reinterpret_cast<float*>(at[i++]);
  b->attn = at[i++];
  b->x2 = at[i++];
  b->xn2 = at[i++];
  b->rstd2 = reinterpret_cast<float*>(at[i++]);
  b->gate_up = at[i++];
  b->mlp = at[i++];
  b->d_mlp = at[i++];
  b->d_gate_up = at[i++];
  b->d_xn = at[i++];
  b->d_attn = at[i++];
  b->d_qkv = at[i++];
  b->delta = reinterpret_cast<float*>(at[i++]);
  b->head_xn = at[i++];
  b->head_rstd = reinterpret_cast<float*>(at[i++]);
  b->logits = at[i++];
  b->scratch = at[i++];
  b->scratch_bytes = shape.scratch;
  b->cos = reinterpret_cast<float*>(at[i++]);
  b->sin = reinterpret_cast<float*>(at[i++]);
  b->q_raw = at[i++];
  b->k_raw = at[i++];
  b->q_rstd = reinterpret_cast<float*>(at[i++]);
  b->k_rstd = reinterpret_cast<float*>(at[i++]);
  b->heads = at[i++];
  b->d_heads = at[i++];
  b->head_rows = shape.head_rows;
  b->router_logits = at[i++];
  b->probs = reinterpret_cast<float*>(at[i++]);
  b->top_expert = reinterpret_cast<int32_t*>(at[i++]);
  b->top_weight = reinterpret_cast<float*>(at[i++]);
  b->d_top_weight = reinterpret_cast<float*>(at[i++]);
  b->row_of = reinterpret_cast<int32_t*>(at[i++]);
  b->row_token = reinterpret_cast<int32_t*>(at[i++]);
  b->aux_grad = reinterpret_cast<float*>(at[i++]);
  b->prob_sums = reinterpret_cast<double*>(at[i++]);
  b->moe_x = at[i++];
  b->moe_gate_up = at[i++];
  b->moe_act = at[i++];
  b->moe_y = at[i++];
  b->d_moe_x = at[i++];
  b->d_moe_gate_up = at[i++];
  b->d_moe_act = at[i++];
  if (shape.moe != 0) {
    b->host_top_expert.resize(size_t(shape.N * shape.K));
    b->host_row_of.resize(size_t(shape.N * shape.K));
    b->host_row_token.resize(size_t(shape.R));
    b->expert_begin.resize(size_t(shape.E + 1));
    b->host_prob_sums.resize(size_t(shape.E));
  }

  // RoPE tables as the CPU backend's.
  const int64_t D = c.head_dim;
  std::vector<float> cos(size_t(T * D / 2)), sin(size_t(T * D / 2));
  rope_tables(c, T, cos.data(), sin.data());
  if (Status s =
          cuda::check_cuda(cudaMemcpy(b->cos, cos.data(), cos.size() * 4, cudaMemcpyHostToDevice),
                           "uploading the RoPE tables");
      !s)
    return s;
  if (Status s =
          cuda::check_cuda(cudaMemcpy(b->sin, sin.data(), sin.size() * 4, cudaMemcpyHostToDevice),
                           "uploading the RoPE tables");
      !s)
    return s;
  // cudaMemcpy from pageable memory may return before its copy lands, and
  // the units' streams do not wait for the legacy default stream it ran on.
  if (Status s = cuda::check_cuda(cudaDeviceSynchronize(), "uploading the RoPE tables"); !s)
    return s;
  units->b_ = std::move(b);
  return units;
}

const void* CudaUnits::at(const void* flat, int64_t offset) const {
  return static_cast<const char*>(flat) + offset * int64_t(cuda::dtype_size(type_));
}
void* CudaUnits::at(void* flat, int64_t offset) const {
  return static_cast<char*>(flat) + offset * int64_t(cuda::dtype_size(type_));
}

// (N * heads, D) contiguous <-> the first heads * D elements of each (N, row_stride) row,
// as strided device copies.
Status CudaUnits::copy_heads(void* to, int64_t to_pitch, const void* from, int64_t from_pitch,
                             int64_t heads, cudaStream_t stream) const {
  const size_t ts = cuda::dtype_size(type_);
  const int64_t width = heads * layout_.config.head_dim;
  return cuda::check_cuda(
      cudaMemcpy2DAsync(to, size_t(to_pitch) * ts, from, size_t(from_pitch) * ts,
                        size_t(width) * ts, size_t(B_ * T_), cudaMemcpyDeviceToDevice, stream),
      "copying the heads of q or k");
}

Status CudaUnits::qk_norm_forward(const void* w, int64_t q_norm, int64_t k_norm,
                                  cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, H = c.num_attention_heads, KV = c.num_key_value_heads;
  const int64_t D = c.head_dim, QKV = (H + 2 * KV) * D;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Buffers& b = *b_;
  // q: gather its heads, keep them for the backward, normalise, scatter back; k likewise.
  STRATA_CHECK(copy_heads(b.q_raw, H * D, b.qkv, QKV, H, stream));
  STRATA_CHECK(cuda::rmsnorm_forward(b.heads, b.q_rstd, b.q_raw, at(w, q_norm), N * H, D, eps,
                                     type_, stream));
  STRATA_CHECK(copy_heads(b.qkv, QKV, b.heads, H * D, H, stream));
  STRATA_CHECK(copy_heads(b.k_raw, KV * D, at(b.qkv, H * D), QKV, KV, stream));
  STRATA_CHECK(cuda::rmsnorm_forward(b.heads, b.k_rstd, b.k_raw, at(w, k_norm), N * KV, D, eps,
                                     type_, stream));
  return copy_heads(at(b.qkv, H * D), QKV, b.heads, KV * D, KV, stream);
}

Status CudaUnits::qk_norm_backward(const void* w, float* g, int64_t q_norm, int64_t k_norm,
                                   cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, H = c.num_attention_heads, KV = c.num_key_value_heads;
  const int64_t D = c.head_dim, QKV = (H + 2 * KV) * D;
  const size_t ts = cuda::dtype_size(type_);
  Buffers& b = *b_;
  for (int part = 0; part < 2; ++part) {
    const int64_t heads = part == 0 ? H : KV, norm = part == 0 ? q_norm : k_norm;
    void* rows = at(b.d_qkv, part == 0 ? 0 : H * D);
    STRATA_CHECK(copy_heads(b.heads, heads * D, rows, QKV, heads, stream));
    STRATA_CHECK(cuda::check_cuda(cudaMemsetAsync(b.d_heads, 0, size_t(N * heads * D) * ts, stream),
                                  "zeroing a gradient"));
    STRATA_CHECK(cuda::rmsnorm_backward(b.d_heads, g + norm, b.heads, part == 0 ? b.q_raw : b.k_raw,
                                        at(w, norm), part == 0 ? b.q_rstd : b.k_rstd, N * heads, D,
                                        type_, b.scratch, size_t(b.scratch_bytes), stream));
    STRATA_CHECK(copy_heads(rows, QKV, b.d_heads, heads * D, heads, stream));
  }
  return Status::ok();
}

// A decoder layer's tensors, or those of its piece (UnitShape::piece), by
// name as core/model/model.cpp lays them out; -1 where the family or the
// piece has none. q, k, v are adjacent (one fused product), and so are gate
// and up, and the q/k/v biases (qwen2).
CudaUnits::LayerOffsets CudaUnits::layer_offsets(const UnitLayout& unit) {
  const std::string p = fmt::format("model.layers.{}.", unit.unit.layer);
  auto at = [&](const char* name) -> int64_t {
    const TensorSlot* slot = unit.find(p + name);
    return slot == nullptr ? -1 : slot->offset;
  };
  LayerOffsets o;
  o.qkv = at("self_attn.q_proj.weight");
  o.o = at("self_attn.o_proj.weight");
  o.gate_up = at("mlp.gate_proj.weight");
  o.down = at("mlp.down_proj.weight");
  o.norm_in = at("input_layernorm.weight");
  o.norm_post = at("post_attention_layernorm.weight");
  o.qkv_bias = at("self_attn.q_proj.bias");
  o.q_norm = at("self_attn.q_norm.weight");
  o.k_norm = at("self_attn.k_norm.weight");
  // A sparse layer, under either family's names (mixtral's, qwen3_moe's).
  o.router = std::max(at("block_sparse_moe.gate.weight"), at("mlp.gate.weight"));
  o.experts =
      std::max(at("block_sparse_moe.experts.0.w1.weight"), at("mlp.experts.0.gate_proj.weight"));
  return o;
}

// The attention of a layer (whole or its piece):
// x2 = x + o(attention(rope(qkv(norm_in(x))))).
Status CudaUnits::attention_forward(const LayerOffsets& o, const void* w, const void* x, void* x2,
                                    cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size;
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
  const cuda::AttentionShape s = layer_attention_shape(c, B_, T_);
  const int64_t QKV = s.row_stride;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Buffers& b = *b_;
  STRATA_CHECK(
      cuda::rmsnorm_forward(b.xn1, b.rstd1, x, at(w, o.norm_in), N, C, eps, type_, stream));
  STRATA_CHECK(matmuls_.forward(b.qkv, b.xn1, at(w, o.qkv), N, C, QKV, type_, false, stream));
  if (o.qkv_bias >= 0)
    STRATA_CHECK(cuda::bias_forward(b.qkv, at(w, o.qkv_bias), N, QKV, type_, stream));
  if (o.q_norm >= 0) STRATA_CHECK(qk_norm_forward(w, o.q_norm, o.k_norm, stream));
  STRATA_CHECK(cuda::rope_forward(at(b.qkv, 0), b.cos, b.sin, B_, T_, H, D, QKV, type_, stream));
  STRATA_CHECK(
      cuda::rope_forward(at(b.qkv, H * D), b.cos, b.sin, B_, T_, KV, D, QKV, type_, stream));
  STRATA_CHECK(cuda::attention_forward(b.attn, b.lse, at(b.qkv, 0), at(b.qkv, H * D),
                                       at(b.qkv, (H + KV) * D), s, type_, stream));
  // Residuals are added by accumulating products into a copy of the input.
  const int64_t row_bytes = C * int64_t(cuda::dtype_size(type_));
  STRATA_CHECK(cuda::check_cuda(
      cudaMemcpyAsync(x2, x, size_t(N * row_bytes), cudaMemcpyDeviceToDevice, stream),
      "copying the residual"));
  return matmuls_.forward(x2, b.attn, at(w, o.o), N, H * D, C, type_, true, stream);
}

// The MLP of a layer (whole or its piece): out = x2 + down(swiglu(gate_up(norm_post(x2)))).
// No `out`: recomputation for the backward, which stops before the last product.
Status CudaUnits::mlp_forward(const LayerOffsets& o, const void* w, const void* x2, void* out,
                              cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size, I = c.intermediate_size;
  const float eps = static_cast<float>(c.rms_norm_eps);
  Buffers& b = *b_;
  STRATA_CHECK(
      cuda::rmsnorm_forward(b.xn2, b.rstd2, x2, at(w, o.norm_post), N, C, eps, type_, stream));
  if (o.router >= 0) return moe_forward(o, w, x2, out, stream);
  STRATA_CHECK(
      matmuls_.forward(b.gate_up, b.xn2, at(w, o.gate_up), N, C, 2 * I, type_, false, stream));
  STRATA_CHECK(cuda::swiglu_forward(b.mlp, b.gate_up, N, I, type_, stream));
  if (out == nullptr) return Status::ok();
  const int64_t row_bytes = C * int64_t(cuda::dtype_size(type_));
  STRATA_CHECK(cuda::check_cuda(
      cudaMemcpyAsync(out, x2, size_t(N * row_bytes), cudaMemcpyDeviceToDevice, stream),
      "copying the residual"));
  return matmuls_.forward(out, b.mlp, at(w, o.down), N, I, C, type_, true, stream);
}

// The pieces layer_forward and layer_backward compute: whole, attention,
// MLP (the finer ones run in piece_forward and piece_backward).
static bool cut_finer(const UnitShape& unit) {
  return unit.piece == LayerPiece::router || unit.piece == LayerPiece::experts ||
         unit.piece == LayerPiece::mlp_part;
}
static Status built_piece(const UnitShape& unit) {
  if (!cut_finer(unit)) return Status::ok();
  return Status::error(
      fmt::format("{}: a piece of an MLP runs in piece_forward and piece_backward", unit.name));
}

// A whole layer, or its piece (as core/model/model.cpp computes them): the
// attention piece's output is its x2, the MLP piece's input is. A whole
// layer keeps x2 in b.x2. No `out`: recomputation for the backward.
Status CudaUnits::layer_forward(int64_t u, const void* w, const void* x, void* out,
                                cudaStream_t stream) {
  const UnitLayout& unit = layout_.units[size_t(u)];
  if (Status s = built_piece(unit.unit); !s) return s;
  const LayerOffsets o = layer_offsets(unit);
  const LayerPiece piece = unit.unit.piece;
  if (piece == LayerPiece::mlp) return mlp_forward(o, w, x, out, stream);
  void* x2 = piece == LayerPiece::attention && out != nullptr ? out : b_->x2;
  STRATA_CHECK(attention_forward(o, w, x, x2, stream));
  if (piece == LayerPiece::whole) return mlp_forward(o, w, b_->x2, out, stream);
  return Status::ok();
}

// The MLP's backward: its parameters' gradients +=, and d(x2) += through
// norm_post into dx (which holds the residual gradient already).
Status CudaUnits::mlp_backward(const LayerOffsets& o, const void* w, float* g, const void* x2,
                               const void* dout, void* dx, const float* aux_grad,
                               cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size, I = c.intermediate_size;
  const size_t ts = cuda::dtype_size(type_);
  Buffers& b = *b_;
  if (o.router >= 0) {
    STRATA_CHECK(moe_backward(o, w, g, dout, aux_grad, stream));
    return cuda::rmsnorm_backward(dx, g + o.norm_post, b.d_xn, x2, at(w, o.norm_post), b.rstd2, N,
                                  C, type_, b.scratch, size_t(b.scratch_bytes), stream);
  }
  auto zero = [&](void* buffer, int64_t elements) {
    return cuda::check_cuda(cudaMemsetAsync(buffer, 0, size_t(elements) * ts, stream),
                            "zeroing a gradient buffer");
  };
  STRATA_CHECK(zero(b.d_mlp, N * I));
  STRATA_CHECK(
      matmuls_.backward(b.d_mlp, g + o.down, dout, b.mlp, at(w, o.down), N, I, C, type_, stream));
  STRATA_CHECK(cuda::swiglu_backward(b.d_gate_up, b.d_mlp, b.gate_up, N, I, type_, stream));
  STRATA_CHECK(zero(b.d_xn, N * C));
  STRATA_CHECK(matmuls_.backward(b.d_xn, g + o.gate_up, b.d_gate_up, b.xn2, at(w, o.gate_up), N, C,
                                 2 * I, type_, stream));
  return cuda::rmsnorm_backward(dx, g + o.norm_post, b.d_xn, x2, at(w, o.norm_post), b.rstd2, N, C,
                                type_, b.scratch, size_t(b.scratch_bytes), stream);
}

// The attention's backward: dx holds d(x2) on entry; its parameters'
// gradients +=, and d(x) += through norm_in into dx.
Status CudaUnits::attention_backward(const LayerOffsets& o, const void* w, float* g, const void* x,
                                     void* dx, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size;
  const int64_t H = c.num_attention_heads, KV = c.num_key_value_heads, D = c.head_dim;
  const cuda::AttentionShape s = layer_attention_shape(c, B_, T_);
  const int64_t QKV = s.row_stride;
  const size_t ts = cuda::dtype_size(type_);
  Buffers& b = *b_;
  auto zero = [&](void* buffer, int64_t elements) {
    return cuda::check_cuda(cudaMemsetAsync(buffer, 0, size_t(elements) * ts, stream),
                            "zeroing a gradient buffer");
  };
  STRATA_CHECK(zero(b.d_attn, N * H * D));
  STRATA_CHECK(
      matmuls_.backward(b.d_attn, g + o.o, dx, b.attn, at(w, o.o), N, H * D, C, type_, stream));
  STRATA_CHECK(cuda::attention_backward(
      at(b.d_qkv, 0), at(b.d_qkv, H * D), at(b.d_qkv, (H + KV) * D), b.delta, b.d_attn, b.attn,
      b.lse, at(b.qkv, 0), at(b.qkv, H * D), at(b.qkv, (H + KV) * D), s, type_, stream));
  STRATA_CHECK(cuda::rope_backward(at(b.d_qkv, 0), b.cos, b.sin, B_, T_, H, D, QKV, type_, stream));
  STRATA_CHECK(
      cuda::rope_backward(at(b.d_qkv, H * D), b.cos, b.sin, B_, T_, KV, D, QKV, type_, stream));
  if (o.q_norm >= 0) STRATA_CHECK(qk_norm_backward(w, g, o.q_norm, o.k_norm, stream));
  if (o.qkv_bias >= 0)
    STRATA_CHECK(cuda::bias_backward(g + o.qkv_bias, b.d_qkv, N, QKV, type_, stream));
  STRATA_CHECK(zero(b.d_xn, N * C));
  STRATA_CHECK(
      matmuls_.backward(b.d_xn, g + o.qkv, b.d_qkv, b.xn1, at(w, o.qkv), N, C, QKV, type_, stream));
  return cuda::rmsnorm_backward(dx, g + o.norm_in, b.d_xn, x, at(w, o.norm_in), b.rstd1, N, C,
                                type_, b.scratch, size_t(b.scratch_bytes), stream);
}

// Backward of a whole layer or its piece. dx starts as the residual
// gradient, and each branch adds into it: the MLP's (whose x2 is a whole
// layer's b.x2, the MLP piece's input), then the attention's.
Status CudaUnits::layer_backward(int64_t u, const void* w, float* g, const void* x,
                                 const void* dout, void* dx, bool recompute, const float* aux_grad,
                                 cudaStream_t stream) {
  const UnitLayout& unit = layout_.units[size_t(u)];
  if (Status s = built_piece(unit.unit); !s) return s;
  const LayerOffsets o = layer_offsets(unit);
  const LayerPiece piece = unit.unit.piece;
  const size_t ts = cuda::dtype_size(type_);
  const int64_t N = B_ * T_, C = layout_.config.hidden_size;
  if (recompute) STRATA_CHECK(layer_forward(u, w, x, nullptr, stream));
  if (dx != dout)
    STRATA_CHECK(cuda::check_cuda(
        cudaMemcpyAsync(dx, dout, size_t(N * C) * ts, cudaMemcpyDeviceToDevice, stream),
        "copying the residual gradient"));
  if (piece != LayerPiece::attention)
    STRATA_CHECK(
        mlp_backward(o, w, g, piece == LayerPiece::mlp ? x : b_->x2, dout, dx, aux_grad, stream));
  if (piece != LayerPiece::mlp) STRATA_CHECK(attention_backward(o, w, g, x, dx, stream));
  return Status::ok();
}

Status CudaUnits::forward(int64_t u, const void* params, const CudaUnitBatch& batch,
                          const void* input, void* output, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const UnitShape& unit = layout_.units[size_t(u)].unit;
  switch (unit.kind) {
    case UnitKind::embedding:
      // The first embedding unit starts the micro-batch's router statistics.
      if (batch.router != nullptr && unit.chunk <= 0) batch.router->reset(c.num_experts);
      if (unit.chunk >= 0) return vocab_chunk_forward(u, params, batch, input, output, stream);
      return cuda::embedding_forward(output, batch.tokens, params, B_ * T_, c.hidden_size, type_,
                                     stream);
    case UnitKind::decoder_layer:
      if (cut_finer(unit))
        STRATA_CHECK(piece_forward(u, params, batch, input, output, stream));
      else
        STRATA_CHECK(layer_forward(u, params, input, output, stream));
      // The layer's routing: a whole layer's, its MLP piece's or its router piece's.
      if (batch.router != nullptr && c.layer_is_sparse(unit.layer) &&
          unit.piece != LayerPiece::attention && unit.piece != LayerPiece::experts)
        add_router_stats(*batch.router);
      return Status::ok();
    case UnitKind::head:
      if (unit.chunk >= 0 && unit.chunk < c.vocab_chunks - 1)
        return vocab_chunk_forward(u, params, batch, input, output, stream);
      break;
  }
  return Status::error("CudaUnits::forward: the head runs in head_forward_backward");
}

Status CudaUnits::backward(int64_t u, const void* params, const CudaUnitBatch& batch,
                           const void* input, const void* doutput, void* dinput, float* grads,
                           bool recompute, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const UnitShape& unit = layout_.units[size_t(u)].unit;
  switch (unit.kind) {
    case UnitKind::embedding:
      if (unit.chunk >= 0)
        return vocab_chunk_backward(u, params, batch, input, doutput, dinput, grads, stream);
      return cuda::embedding_backward(grads, doutput, batch.tokens, B_ * T_, c.hidden_size,
                                      c.vocab_size, type_, b_->scratch, size_t(b_->scratch_bytes),
                                      stream);
    case UnitKind::decoder_layer: {
      const float* aux_grad = nullptr;
      if (c.layer_is_sparse(unit.layer) && unit.piece != LayerPiece::attention &&
          unit.piece != LayerPiece::experts) {
        Result<const float*> uploaded = upload_aux_grad(batch, stream);
        if (!uploaded) return uploaded.status();
        aux_grad = *uploaded;
      }
      if (cut_finer(unit))
        return piece_backward(u, params, grads, batch, input, doutput, dinput, recompute, aux_grad,
                              stream);
      return layer_backward(u, params, grads, input, doutput, dinput, recompute, aux_grad, stream);
    }
    case UnitKind::head:
      if (unit.chunk >= 0 && unit.chunk < c.vocab_chunks - 1)
        return vocab_chunk_backward(u, params, batch, input, doutput, dinput, grads, stream);
      break;
  }
  return Status::error("CudaUnits::backward: the head runs in head_forward_backward");
}

Status CudaUnits::head_forward_backward(const void* params, const void* tied_embedding,
                                        const CudaUnitBatch& batch, const void* input, void* dinput,
                                        float* grads, float* tied_grads, float* losses,
                                        cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  if (c.vocab_chunks > 1)
    return head_chunks_pass(params, batch, input, dinput, grads, losses, stream);
  const int64_t N = B_ * T_, C = c.hidden_size, V = c.vocab_size;
  const UnitLayout& head = layout_.units.back();
  const bool tied = c.tie_word_embeddings;
  if (tied && (tied_embedding == nullptr || tied_grads == nullptr))
    return Status::error("CudaUnits: a tied head needs the embedding and its gradient");
  const int64_t lm_offset = tied ? 0 : head.tensors[1].offset;
  const void* norm = params;
  const void* lm_head = tied ? tied_embedding : at(params, lm_offset);
  float* d_norm = grads;
  float* d_lm_head = tied ? tied_grads : grads + lm_offset;
  const size_t ts = cuda::dtype_size(type_);
  Buffers& b = *b_;
  STRATA_CHECK(cuda::rmsnorm_forward(b.head_xn, b.head_rstd, input, norm, N, C,
                                     static_cast<float>(c.rms_norm_eps), type_, stream));
  STRATA_CHECK(cuda::check_cuda(cudaMemsetAsync(b.d_xn, 0, size_t(N * C) * ts, stream),
                                "zeroing the head's gradient"));
  for (int64_t begin = 0; begin < N; begin += b.head_rows) {
    const int64_t rows = std::min(b.head_rows, N - begin);
    STRATA_CHECK(matmuls_.forward(b.logits, at(b.head_xn, begin * C), lm_head, rows, C, V, type_,
                                  false, stream));
    STRATA_CHECK(cuda::cross_entropy_forward_backward(losses + begin, b.logits, b.logits,
                                                      batch.targets + begin, batch.loss_scale, rows,
                                                      V, type_, stream));
    STRATA_CHECK(matmuls_.backward(at(b.d_xn, begin * C), d_lm_head, b.logits,
                                   at(b.head_xn, begin * C), lm_head, rows, C, V, type_, stream));
  }
  STRATA_CHECK(cuda::check_cuda(cudaMemsetAsync(dinput, 0, size_t(N * C) * ts, stream),
                                "zeroing the head's input gradient"));
  return cuda::rmsnorm_backward(dinput, d_norm, b.d_xn, input, norm, b.head_rstd, N, C, type_,
                                b.scratch, size_t(b.scratch_bytes), stream);
}

// --- vocabulary chunks (core/model/vocab_chunks.cpp's twins) -----------------------

Status CudaUnits::move_logit_rows(void* blocks, int64_t first, int64_t rows, bool gather,
                                  cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_;
  const size_t ts = cuda::dtype_size(type_), pitch = size_t(c.vocab_size) * ts;
  for (int64_t k = 0; k < c.vocab_chunks; ++k) {
    const int64_t begin = c.vocab_chunk_begin(k), width = c.vocab_chunk_begin(k + 1) - begin;
    void* chunk_rows = at(blocks, N * begin + first * width);
    void* full = at(b_->logits, begin);
    const size_t bytes = size_t(width) * ts;
    const cudaError_t e = gather
                              ? cudaMemcpy2DAsync(full, pitch, chunk_rows, bytes, bytes,
                                                  size_t(rows), cudaMemcpyDeviceToDevice, stream)
                              : cudaMemcpy2DAsync(chunk_rows, bytes, full, pitch, bytes,
                                                  size_t(rows), cudaMemcpyDeviceToDevice, stream);
    STRATA_CHECK(cuda::check_cuda(e, "moving a vocabulary chunk's logits"));
  }
  return Status::ok();
}

Status CudaUnits::vocab_chunk_forward(int64_t u, const void* params, const CudaUnitBatch& batch,
                                      const void* input, void* output, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const UnitLayout& layout = layout_.units[size_t(u)];
  const int64_t k = layout.unit.chunk, N = B_ * T_, C = c.hidden_size;
  const int64_t begin = c.vocab_chunk_begin(k), end = c.vocab_chunk_begin(k + 1);
  const size_t bytes = size_t(N * C) * cuda::dtype_size(type_);
  if (layout.unit.kind == UnitKind::embedding) {
    // The input (none for the first chunk: zeros) with the chunk's tokens' rows set.
    if (input == nullptr)
      STRATA_CHECK(cuda::check_cuda(cudaMemsetAsync(output, 0, bytes, stream),
                                    "zeroing the embedding's output"));
    else if (input != output)
      STRATA_CHECK(
          cuda::check_cuda(cudaMemcpyAsync(output, input, bytes, cudaMemcpyDeviceToDevice, stream),
                           "copying the embedding's rows"));
    return cuda::embedding_forward_rows(output, batch.tokens, at(params, layout.tensors[0].offset),
                                        N, C, begin, end, type_, stream);
  }
  // A head chunk but the last: the output is the normed rows; its logits block.
  if (batch.head_logits == nullptr)
    return Status::error("CudaUnits: a vocabulary-cut head needs the logits store (engine error)");
  if (k == 0) {
    const TensorSlot* norm = layout.find("model.norm.weight");
    STRATA_CHECK(cuda::rmsnorm_forward(output, b_->head_rstd, input, at(params, norm->offset), N, C,
                                       static_cast<float>(c.rms_norm_eps), type_, stream));
  } else if (input != output) {
    STRATA_CHECK(
        cuda::check_cuda(cudaMemcpyAsync(output, input, bytes, cudaMemcpyDeviceToDevice, stream),
                         "copying the normed rows"));
  }
  const TensorSlot* lm_head = lm_head_slot(layout);
  return matmuls_.forward(at(batch.head_logits, N * begin), output, at(params, lm_head->offset), N,
                          C, end - begin, type_, false, stream);
}

Status CudaUnits::vocab_chunk_backward(int64_t u, const void* params, const CudaUnitBatch& batch,
                                       const void* input, const void* doutput, void* dinput,
                                       float* grads, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const UnitLayout& layout = layout_.units[size_t(u)];
  const int64_t k = layout.unit.chunk, N = B_ * T_, C = c.hidden_size;
  const int64_t begin = c.vocab_chunk_begin(k), end = c.vocab_chunk_begin(k + 1);
  const size_t bytes = size_t(N * C) * cuda::dtype_size(type_);
  Buffers& b = *b_;
  if (layout.unit.kind == UnitKind::embedding) {
    // Its rows' gradients; the gradient passes on to the chunk before.
    STRATA_CHECK(cuda::embedding_backward_rows(grads + layout.tensors[0].offset, doutput,
                                               batch.tokens, N, C, c.vocab_size, begin, end, type_,
                                               b.scratch, size_t(b.scratch_bytes), stream));
    if (dinput == nullptr || dinput == doutput) return Status::ok();
    return cuda::check_cuda(
        cudaMemcpyAsync(dinput, doutput, bytes, cudaMemcpyDeviceToDevice, stream),
        "passing the embedding's gradient on");
  }
  // A head chunk but the last: its block's product added to the gradient of
  // the normed rows that doutput carries; the first chunk takes it through
  // the final norm.
  if (batch.head_logits == nullptr)
    return Status::error("CudaUnits: a vocabulary-cut head needs the logits store (engine error)");
  const TensorSlot* lm_head = lm_head_slot(layout);
  const TensorSlot* norm = k == 0 ? layout.find("model.norm.weight") : nullptr;
  const void* xn = input;
  if (norm != nullptr) {
    STRATA_CHECK(cuda::rmsnorm_forward(b.head_xn, b.head_rstd, input, at(params, norm->offset), N,
                                       C, static_cast<float>(c.rms_norm_eps), type_, stream));
    xn = b.head_xn;
  }
  STRATA_CHECK(
      cuda::check_cuda(cudaMemcpyAsync(b.d_xn, doutput, bytes, cudaMemcpyDeviceToDevice, stream),
                       "copying the normed rows' gradient"));
  const int64_t width = end - begin;
  const void* block = at(batch.head_logits, N * begin);
  for (int64_t first = 0; first < N; first += b.head_rows) {
    const int64_t rows = std::min(b.head_rows, N - first);
    STRATA_CHECK(matmuls_.backward(at(b.d_xn, first * C), grads + lm_head->offset,
                                   at(block, first * width), at(xn, first * C),
                                   at(params, lm_head->offset), rows, C, width, type_, stream));
  }
  if (norm == nullptr)
    return cuda::check_cuda(
        cudaMemcpyAsync(dinput, b.d_xn, bytes, cudaMemcpyDeviceToDevice, stream),
        "passing the normed rows' gradient on");
  STRATA_CHECK(cuda::check_cuda(cudaMemsetAsync(dinput, 0, bytes, stream),
                                "zeroing the head's input gradient"));
  return cuda::rmsnorm_backward(dinput, grads + norm->offset, b.d_xn, input,
                                at(params, norm->offset), b.head_rstd, N, C, type_, b.scratch,
                                size_t(b.scratch_bytes), stream);
}

Status CudaUnits::head_chunks_pass(const void* params, const CudaUnitBatch& batch,
                                   const void* input, void* dinput, float* grads, float* losses,
                                   cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const UnitLayout& layout = layout_.units.back();
  const int64_t N = B_ * T_, C = c.hidden_size, V = c.vocab_size;
  const int64_t begin = c.vocab_chunk_begin(c.vocab_chunks - 1), width = V - begin;
  if (batch.head_logits == nullptr)
    return Status::error("CudaUnits: a vocabulary-cut head needs the logits store (engine error)");
  const TensorSlot* lm_head = lm_head_slot(layout);
  const void* weight = at(params, lm_head->offset);
  void* block = at(batch.head_logits, N * begin);
  const size_t ts = cuda::dtype_size(type_);
  Buffers& b = *b_;
  // Its block, then the loss over the whole rows, a block of rows at a time,
  // as the whole head: each row's logits gathered from every chunk's block,
  // turned into their gradient and scattered back; its block's backward.
  STRATA_CHECK(matmuls_.forward(block, input, weight, N, C, width, type_, false, stream));
  STRATA_CHECK(cuda::check_cuda(cudaMemsetAsync(b.d_xn, 0, size_t(N * C) * ts, stream),
                                "zeroing the head's gradient"));
  for (int64_t first = 0; first < N; first += b.head_rows) {
    const int64_t rows = std::min(b.head_rows, N - first);
    STRATA_CHECK(move_logit_rows(batch.head_logits, first, rows, true, stream));
    STRATA_CHECK(cuda::cross_entropy_forward_backward(losses + first, b.logits, b.logits,
                                                      batch.targets + first, batch.loss_scale, rows,
                                                      V, type_, stream));
    STRATA_CHECK(move_logit_rows(batch.head_logits, first, rows, false, stream));
    STRATA_CHECK(matmuls_.backward(at(b.d_xn, first * C), grads + lm_head->offset,
                                   at(block, first * width), at(input, first * C), weight, rows, C,
                                   width, type_, stream));
  }
  return cuda::check_cuda(
      cudaMemcpyAsync(dinput, b.d_xn, size_t(N * C) * ts, cudaMemcpyDeviceToDevice, stream),
      "passing the normed rows' gradient on");
}

#undef STRATA_CHECK

}  // namespace strata
#else
namespace strata {
int64_t cuda_unit_workspace_bytes(const ModelConfig&, int64_t, int64_t, int) {
  return 0;
}
int64_t cuda_grad_norm_scratch_bytes(int64_t) {
  return 0;
}
}  // namespace strata
#endif
