// The CUDA units of a layer cut finer than its MLP piece
// (core/model/cuda_units.h): a sparse layer's router piece and groups of
// experts (ModelConfig::expert_groups), a dense layer's MLP parts
// (ModelConfig::mlp_parts), over the micro-batch's chain. The CPU twins are
// core/model/moe_kernels.h and core/model/mlp_part_kernels.h; the forwards
// hand on what they hand on, the backwards keep the normed rows' gradient
// in the chain's fp32 sum instead of passing it down in the compute type.
#include "core/model/cuda_units.h"

#if STRATA_HAS_CUDA
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "core/model/cuda_units_buffers.h"
#include "core/model/mlp_part_kernels.h"

namespace strata {
namespace cuda = kernels::cuda;

namespace {

// The micro-batch's chain, which a cut layer needs.
Result<ExpertChain> chain_of(const ModelConfig& c, int64_t N, const CudaUnitBatch& batch,
                             const UnitShape& unit) {
  if (batch.expert_chain == nullptr)
    return Status::error(
        fmt::format("{}: a layer cut finer than its MLP piece needs the micro-batch's chain "
                    "(CudaUnitBatch::expert_chain)",
                    unit.name));
  return expert_chain_view(c, N, batch.expert_chain);
}

Status copy_on(void* to, const void* from, int64_t bytes, cudaStream_t stream, const char* what) {
  if (to == from) return Status::ok();
  return cuda::check_cuda(
      cudaMemcpyAsync(to, from, size_t(bytes), cudaMemcpyDeviceToDevice, stream), what);
}

}  // namespace

Status CudaUnits::piece_forward(int64_t u, const void* w, const CudaUnitBatch& batch, const void* x,
                                void* out, cudaStream_t stream) {
  const UnitLayout& unit = layout_.units[size_t(u)];
  Result<ExpertChain> chain = chain_of(layout_.config, B_ * T_, batch, unit.unit);
  if (!chain) return chain.status();
  switch (unit.unit.piece) {
    case LayerPiece::router:
      return router_piece_forward(unit, w, *chain, x, out, stream);
    case LayerPiece::experts:
      return expert_group_forward(u, w, *chain, x, out, stream);
    case LayerPiece::mlp_part:
      return mlp_part_forward(u, w, *chain, x, out, stream);
    default:
      return Status::error(fmt::format("{}: not a piece of an MLP", unit.unit.name));
  }
}

Status CudaUnits::piece_backward(int64_t u, const void* w, float* g, const CudaUnitBatch& batch,
                                 const void* x, const void* dout, void* dx, bool recompute,
                                 const float* aux_grad, cudaStream_t stream) {
  const UnitLayout& unit = layout_.units[size_t(u)];
  Result<ExpertChain> chain = chain_of(layout_.config, B_ * T_, batch, unit.unit);
  if (!chain) return chain.status();
  switch (unit.unit.piece) {
    case LayerPiece::router:
      return router_piece_backward(unit, w, g, *chain, x, dout, dx, aux_grad, stream);
    case LayerPiece::experts:
      return expert_group_backward(u, w, g, *chain, x, dout, dx, stream);
    case LayerPiece::mlp_part:
      return mlp_part_backward(u, w, g, *chain, x, dout, dx, recompute, stream);
    default:
      return Status::error(fmt::format("{}: not a piece of an MLP", unit.unit.name));
  }
}

// --- a sparse layer cut into groups of experts ------------------------------------------

// The router piece (the router, then the post-attention norm): the norm and
// the routing; recorded in the chain with x2 and a zeroed sum, the normed
// rows out, and the router statistics' counts and sums on the host (for
// forward's add_router_stats) as moe_forward leaves them.
Status CudaUnits::router_piece_forward(const UnitLayout& unit, const void* w,
                                       const ExpertChain& chain, const void* x2, void* out,
                                       cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t router = unit.tensors[0].offset, norm = unit.tensors[1].offset;
  const int64_t ts = int64_t(cuda::dtype_size(type_));
  Buffers& b = *b_;
  STRATA_CHECK(cuda::rmsnorm_forward(b.xn2, b.rstd2, x2, at(w, norm), N, C,
                                     static_cast<float>(c.rms_norm_eps), type_, stream));
  STRATA_CHECK(
      matmuls_.forward(b.router_logits, b.xn2, at(w, router), N, C, E, type_, false, stream));
  STRATA_CHECK(cuda::moe_route(b.probs, b.top_expert, b.top_weight, b.router_logits, N, E, K,
                               c.norm_topk_prob, type_, stream));
  if (out == nullptr) return Status::ok();
  const int64_t s = sparse_layer_index(c, unit.unit.layer);
  STRATA_CHECK(copy_on(chain.top_expert + s * N * K, b.top_expert, N * K * 4, stream,
                       "recording the routing"));
  STRATA_CHECK(copy_on(chain.top_weight + s * N * K, b.top_weight, N * K * 4, stream,
                       "recording the routing"));
  STRATA_CHECK(copy_on(chain.rows, x2, N * C * ts, stream, "keeping the residual"));
  STRATA_CHECK(cuda::check_cuda(cudaMemsetAsync(chain.sum, 0, size_t(N * C) * 4, stream),
                                "zeroing the experts' sum"));
  STRATA_CHECK(copy_on(out, b.xn2, N * C * ts, stream, "handing on the normed rows"));
  // The router statistics, as moe_forward takes them: one wait.
  return routing_to_host(stream);
}

Status CudaUnits::read_chain_routing(int64_t sparse, const ExpertChain& chain,
                                     cudaStream_t stream) {
  const int64_t NK = B_ * T_ * layout_.config.num_experts_per_tok;
  Buffers& b = *b_;
  // The wait also covers the last uploads from the host copies grouped from it.
  STRATA_CHECK(
      cuda::check_cuda(cudaMemcpyAsync(b.host_top_expert.data(), chain.top_expert + sparse * NK,
                                       size_t(NK) * 4, cudaMemcpyDeviceToHost, stream),
                       "reading the recorded routing"));
  return cuda::check_cuda(cudaStreamSynchronize(stream), "waiting for the routing");
}

Status CudaUnits::load_chain_routing(int64_t sparse, const ExpertChain& chain,
                                     cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  Buffers& b = *b_;
  STRATA_CHECK(read_chain_routing(sparse, chain, stream));
  group_routed_rows(b.host_top_expert.data(), B_ * T_, c.num_experts_per_tok, c.num_experts,
                    b.expert_begin.data(), b.host_row_of.data(), b.host_row_token.data());
  return upload_routed_rows(stream);
}

// A group: its experts' weighted outputs added to the chain's sum (the
// whole combine's operations, this group's slots); the last group outputs
// x2 + sum, the others hand the normed rows on.
Status CudaUnits::expert_group_forward(int64_t u, const void* w, const ExpertChain& chain,
                                       const void* xn, void* out, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const UnitLayout& unit = layout_.units[size_t(u)];
  const int64_t N = B_ * T_, C = c.hidden_size, K = c.num_experts_per_tok;
  const ExpertBlocks group = expert_blocks(layout_, u);
  const int64_t s = sparse_layer_index(c, unit.unit.layer);
  const bool last = unit.unit.expert_group == c.expert_groups - 1;
  STRATA_CHECK(load_chain_routing(s, chain, stream));
  STRATA_CHECK(expert_rows_forward(group, w, xn, stream));
  if (out == nullptr) return Status::ok();
  STRATA_CHECK(cuda::moe_combine_experts(chain.sum, last ? out : nullptr, chain.rows, b_->moe_y,
                                         chain.top_expert + s * N * K, b_->row_of,
                                         chain.top_weight + s * N * K, group.first,
                                         group.first + group.count, N, C, K, type_, stream));
  if (last) return Status::ok();
  return copy_on(out, xn, N * C * int64_t(cuda::dtype_size(type_)), stream,
                 "handing on the normed rows");
}

// A group's backward from the layer's output gradient (dout, handed on
// unchanged from the last group down): its slots' weights' gradients into
// the chain, its experts' gradients, and its rows' input gradients added to
// the chain's sum (the last group's from zero).
Status CudaUnits::expert_group_backward(int64_t u, const void* w, float* g,
                                        const ExpertChain& chain, const void* xn, const void* dout,
                                        void* dx, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const UnitLayout& unit = layout_.units[size_t(u)];
  const int64_t N = B_ * T_, C = c.hidden_size, K = c.num_experts_per_tok;
  const size_t ts = cuda::dtype_size(type_);
  const ExpertBlocks group = expert_blocks(layout_, u);
  const int64_t s = sparse_layer_index(c, unit.unit.layer), end = group.first + group.count;
  const bool last = unit.unit.expert_group == c.expert_groups - 1;
  Buffers& b = *b_;
  // The rows' activations, recomputed whatever `recompute` says: the
  // workspace holds one routing, and the last forward's may be another layer's.
  STRATA_CHECK(load_chain_routing(s, chain, stream));
  STRATA_CHECK(expert_rows_forward(group, w, xn, stream));
  const int32_t* top = chain.top_expert + s * N * K;
  STRATA_CHECK(cuda::moe_weight_backward_experts(chain.d_weight, b.moe_y, dout, top, b.row_of,
                                                 chain.top_weight + s * N * K, group.first, end, N,
                                                 C, K, type_, stream));
  STRATA_CHECK(expert_rows_backward(group, w, g, stream));
  STRATA_CHECK(cuda::moe_add_rows(chain.sum, !last, b.d_moe_x, top, b.row_of, group.first, end, N,
                                  C, K, type_, stream));
  return copy_on(dx, dout, N * C * int64_t(ts), stream, "handing on the output gradient");
}

// The router piece's backward: the routing recomputed, the router's
// gradient from the weights' gradients the groups left in the chain, the
// normed rows' gradient (the chain's sum, rounded once, plus the router's
// part) through the norm, added to the layer's output gradient (dout).
Status CudaUnits::router_piece_backward(const UnitLayout& unit, const void* w, float* g,
                                        const ExpertChain& chain, const void* x2, const void* dout,
                                        void* dx, const float* aux_grad, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t router = unit.tensors[0].offset, norm = unit.tensors[1].offset;
  const int64_t s = sparse_layer_index(c, unit.unit.layer);
  Buffers& b = *b_;
  // The norm, the logits and the probabilities recomputed; the slots those
  // the groups took their weights' gradients for, recorded in the chain.
  STRATA_CHECK(router_piece_forward(unit, w, chain, x2, nullptr, stream));
  STRATA_CHECK(cuda::moe_router_backward(b.router_logits, b.probs, chain.top_expert + s * N * K,
                                         chain.top_weight + s * N * K, chain.d_weight, aux_grad, N,
                                         E, K, c.norm_topk_prob, type_, stream));
  STRATA_CHECK(cuda::cast(b.d_xn, type_, chain.sum, cuda::DType::f32, N * C, stream));
  STRATA_CHECK(matmuls_.backward(b.d_xn, g + router, b.router_logits, b.xn2, at(w, router), N, C, E,
                                 type_, stream));
  STRATA_CHECK(copy_on(dx, dout, N * C * int64_t(cuda::dtype_size(type_)), stream,
                       "copying the residual gradient"));
  return cuda::rmsnorm_backward(dx, g + norm, b.d_xn, x2, at(w, norm), b.rstd2, N, C, type_,
                                b.scratch, size_t(b.scratch_bytes), stream);
}

Status CudaUnits::route_from_chain(int64_t u, const CudaUnitBatch& batch, uint8_t* used,
                                   cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const UnitLayout& unit = layout_.units[size_t(u)];
  if (unit.unit.piece != LayerPiece::experts)
    return Status::error(fmt::format("routing {}: not a piece of experts", unit.unit.name));
  const int64_t N = B_ * T_;
  Result<ExpertChain> chain = chain_of(c, N, batch, unit.unit);
  if (!chain) return chain.status();
  // The layer's routing alone comes down.
  STRATA_CHECK(read_chain_routing(sparse_layer_index(c, unit.unit.layer), *chain, stream));
  const std::vector<uint8_t> routed =
      group_routed_experts(layout_, u, b_->host_top_expert.data(), N);
  std::copy(routed.begin(), routed.end(), used);
  return Status::ok();
}

// --- a dense layer's MLP cut into parts ---------------------------------------------------

// Part p: part 0 norms x2 (kept in the chain) and hands the normed rows on;
// every part computes its rows' SwiGLU and adds its down product, rounded
// to the compute type, to the chain's fp32 sum (part 0 from zero); the last
// outputs x2 + sum, one rounding.
Status CudaUnits::mlp_part_forward(int64_t u, const void* w, const ExpertChain& chain,
                                   const void* x, void* out, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size;
  const int64_t ts = int64_t(cuda::dtype_size(type_));
  const MlpPart p = mlp_part(layout_, u);
  Buffers& b = *b_;
  const void* xn = x;
  if (p.first) {
    STRATA_CHECK(cuda::rmsnorm_forward(b.xn2, b.rstd2, x, at(w, p.norm), N, C,
                                       static_cast<float>(c.rms_norm_eps), type_, stream));
    xn = b.xn2;
  }
  STRATA_CHECK(
      matmuls_.forward(b.gate_up, xn, at(w, p.gate_up), N, C, 2 * p.rows, type_, false, stream));
  STRATA_CHECK(cuda::swiglu_forward(b.mlp, b.gate_up, N, p.rows, type_, stream));
  if (out == nullptr) return Status::ok();
  if (p.first) STRATA_CHECK(copy_on(chain.rows, x, N * C * ts, stream, "keeping the residual"));
  // The part's down product in b.x2, which a part of a layer does not use otherwise.
  STRATA_CHECK(matmuls_.forward(b.x2, b.mlp, at(w, p.down), N, p.rows, C, type_, false, stream));
  STRATA_CHECK(cuda::accumulate_f32(chain.sum, b.x2, N * C, !p.first, type_, stream));
  if (p.last) return cuda::residual_add_f32(out, chain.rows, chain.sum, N * C, type_, stream);
  return copy_on(out, xn, N * C * ts, stream, "handing on the normed rows");
}

// Part p's backward from the layer's output gradient (dout, handed on
// unchanged from the last part down): its gradients, and its part of the
// normed rows' gradient added to the chain's fp32 sum (the last part's from
// zero); part 0 rounds the sum once and takes it through the norm into dx.
Status CudaUnits::mlp_part_backward(int64_t u, const void* w, float* g, const ExpertChain& chain,
                                    const void* x, const void* dout, void* dx, bool recompute,
                                    cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size;
  const size_t ts = cuda::dtype_size(type_);
  const MlpPart p = mlp_part(layout_, u);
  Buffers& b = *b_;
  if (recompute) STRATA_CHECK(mlp_part_forward(u, w, chain, x, nullptr, stream));
  const void* xn = p.first ? b.xn2 : x;
  auto zero = [&](void* buffer, int64_t elements) {
    return cuda::check_cuda(cudaMemsetAsync(buffer, 0, size_t(elements) * ts, stream),
                            "zeroing a gradient buffer");
  };
  STRATA_CHECK(zero(b.d_mlp, N * p.rows));
  STRATA_CHECK(matmuls_.backward(b.d_mlp, g + p.down, dout, b.mlp, at(w, p.down), N, p.rows, C,
                                 type_, stream));
  STRATA_CHECK(cuda::swiglu_backward(b.d_gate_up, b.d_mlp, b.gate_up, N, p.rows, type_, stream));
  STRATA_CHECK(zero(b.d_xn, N * C));
  STRATA_CHECK(matmuls_.backward(b.d_xn, g + p.gate_up, b.d_gate_up, xn, at(w, p.gate_up), N, C,
                                 2 * p.rows, type_, stream));
  STRATA_CHECK(cuda::accumulate_f32(chain.sum, b.d_xn, N * C, !p.last, type_, stream));
  STRATA_CHECK(copy_on(dx, dout, N * C * int64_t(ts), stream, "handing on the output gradient"));
  if (!p.first) return Status::ok();
  STRATA_CHECK(cuda::cast(b.d_xn, type_, chain.sum, cuda::DType::f32, N * C, stream));
  return cuda::rmsnorm_backward(dx, g + p.norm, b.d_xn, x, at(w, p.norm), b.rstd2, N, C, type_,
                                b.scratch, size_t(b.scratch_bytes), stream);
}

}  // namespace strata
#endif
