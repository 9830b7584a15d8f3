// The CUDA units of a mixture's sparse layers (core/model/cuda_units.h):
// the routing, each expert over its rows, their backward, the router
// statistics and the routed expert fetch's routing.
#include "core/model/cuda_units.h"

#if STRATA_HAS_CUDA
#include <fmt/format.h>

#include <algorithm>

#include "core/model/cuda_units_buffers.h"

namespace strata {
namespace cuda = kernels::cuda;

// --- mixture of experts (core/model/model.cpp's UnitKernels twins) -----------------

Status CudaUnits::moe_forward(const LayerOffsets& o, const void* w, const void* x2, void* out,
                              cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  Buffers& b = *b_;
  // The router (its logits in the compute type, as transformers' gate), then
  // each token's experts and weights.
  STRATA_CHECK(
      matmuls_.forward(b.router_logits, b.xn2, at(w, o.router), N, C, E, type_, false, stream));
  STRATA_CHECK(cuda::moe_route(b.probs, b.top_expert, b.top_weight, b.router_logits, N, E, K,
                               c.norm_topk_prob, type_, stream));
  // The rows grouped by expert on the host: each expert's product needs its
  // row count there. The probabilities' sums (the router statistics') come
  // down in the same wait. The copies down and up keep the stream's order.
  STRATA_CHECK(routing_to_host(stream));
  STRATA_CHECK(upload_routed_rows(stream));
  STRATA_CHECK(
      expert_rows_forward(ExpertBlocks{.offset = o.experts, .count = E}, w, b.xn2, stream));
  if (out == nullptr) return Status::ok();
  return cuda::moe_combine(out, x2, b.moe_y, b.top_expert, b.row_of, b.top_weight, N, C, K, type_,
                           stream);
}

Status CudaUnits::moe_backward(const LayerOffsets& o, const void* w, float* g, const void* dout,
                               const float* aux_grad, cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  Buffers& b = *b_;
  // The weights' gradient; the experts' outputs become their gradient.
  STRATA_CHECK(cuda::moe_weight_backward(b.d_top_weight, b.moe_y, dout, b.row_of, b.top_weight, N,
                                         C, K, type_, stream));
  STRATA_CHECK(expert_rows_backward(ExpertBlocks{.offset = o.experts, .count = E}, w, g, stream));
  // The router: the logits' gradient (in the logits' buffer), then d(xn2):
  // the rows' input gradients in expert order, plus the router's product.
  STRATA_CHECK(cuda::moe_router_backward(b.router_logits, b.probs, b.top_expert, b.top_weight,
                                         b.d_top_weight, aux_grad, N, E, K, c.norm_topk_prob, type_,
                                         stream));
  STRATA_CHECK(
      cuda::moe_sum_rows(b.d_xn, b.d_moe_x, b.top_expert, b.row_of, N, C, K, type_, stream));
  return matmuls_.backward(b.d_xn, g + o.router, b.router_logits, b.xn2, at(w, o.router), N, C, E,
                           type_, stream);
}

Status CudaUnits::routing_to_host(cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, E = c.num_experts, K = c.num_experts_per_tok;
  Buffers& b = *b_;
  STRATA_CHECK(cuda::moe_prob_sums(b.prob_sums, b.probs, N, E, stream));
  STRATA_CHECK(cuda::check_cuda(cudaMemcpyAsync(b.host_top_expert.data(), b.top_expert,
                                                size_t(N * K) * 4, cudaMemcpyDeviceToHost, stream),
                                "reading the routing"));
  STRATA_CHECK(cuda::check_cuda(cudaMemcpyAsync(b.host_prob_sums.data(), b.prob_sums, size_t(E) * 8,
                                                cudaMemcpyDeviceToHost, stream),
                                "reading the router's statistics"));
  STRATA_CHECK(cuda::check_cuda(cudaStreamSynchronize(stream), "waiting for the routing"));
  group_routed_rows(b.host_top_expert.data(), N, K, E, b.expert_begin.data(), b.host_row_of.data(),
                    b.host_row_token.data());
  return Status::ok();
}

Status CudaUnits::upload_routed_rows(cudaStream_t stream) {
  const int64_t R = B_ * T_ * layout_.config.num_experts_per_tok;
  Buffers& b = *b_;
  // The host copies stay until the next routing, which waits for the stream
  // (so for these uploads) before it replaces them: the uploads and that
  // wait must stay on one stream (were the copies pinned and the uploads on
  // another stream, the wait would not cover them).
  STRATA_CHECK(cuda::check_cuda(cudaMemcpyAsync(b.row_of, b.host_row_of.data(), size_t(R) * 4,
                                                cudaMemcpyHostToDevice, stream),
                                "uploading the routed rows"));
  return cuda::check_cuda(cudaMemcpyAsync(b.row_token, b.host_row_token.data(), size_t(R) * 4,
                                          cudaMemcpyHostToDevice, stream),
                          "uploading the routed rows");
}

Status CudaUnits::expert_rows_forward(const ExpertBlocks& experts, const void* w, const void* xn,
                                      cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size, I = c.moe_intermediate_size;
  Buffers& b = *b_;
  const int64_t end = experts.first + experts.count;
  const int64_t r_begin = b.expert_begin[size_t(experts.first)];
  const int64_t r_end = b.expert_begin[size_t(end)];
  STRATA_CHECK(cuda::moe_gather_rows(at(b.moe_x, r_begin * C), xn, b.row_token + r_begin,
                                     r_end - r_begin, N, C, type_, stream));
  for (int64_t e = experts.first; e < end; ++e) {
    const int64_t r0 = b.expert_begin[size_t(e)], n = b.expert_begin[size_t(e) + 1] - r0;
    if (n == 0) continue;
    const int64_t gate_up = experts.offset + (e - experts.first) * 3 * I * C;
    const int64_t down = gate_up + 2 * I * C;
    STRATA_CHECK(matmuls_.forward(at(b.moe_gate_up, r0 * 2 * I), at(b.moe_x, r0 * C),
                                  at(w, gate_up), n, C, 2 * I, type_, false, stream));
    STRATA_CHECK(cuda::swiglu_forward(at(b.moe_act, r0 * I), at(b.moe_gate_up, r0 * 2 * I), n, I,
                                      type_, stream));
    STRATA_CHECK(matmuls_.forward(at(b.moe_y, r0 * C), at(b.moe_act, r0 * I), at(w, down), n, I, C,
                                  type_, false, stream));
  }
  return Status::ok();
}

Status CudaUnits::expert_rows_backward(const ExpertBlocks& experts, const void* w, float* g,
                                       cudaStream_t stream) {
  const ModelConfig& c = layout_.config;
  const int64_t C = c.hidden_size, I = c.moe_intermediate_size;
  const size_t ts = cuda::dtype_size(type_);
  Buffers& b = *b_;
  const int64_t end = experts.first + experts.count;
  const int64_t r_begin = b.expert_begin[size_t(experts.first)];
  const int64_t rows = b.expert_begin[size_t(end)] - r_begin;
  STRATA_CHECK(cuda::check_cuda(
      cudaMemsetAsync(at(b.d_moe_act, r_begin * I), 0, size_t(rows * I) * ts, stream),
      "zeroing a gradient buffer"));
  STRATA_CHECK(cuda::check_cuda(
      cudaMemsetAsync(at(b.d_moe_x, r_begin * C), 0, size_t(rows * C) * ts, stream),
      "zeroing a gradient buffer"));
  for (int64_t e = experts.first; e < end; ++e) {
    const int64_t r0 = b.expert_begin[size_t(e)], n = b.expert_begin[size_t(e) + 1] - r0;
    if (n == 0) continue;  // its gradient stays as it was: zero from this micro-batch
    const int64_t gate_up = experts.offset + (e - experts.first) * 3 * I * C;
    const int64_t down = gate_up + 2 * I * C;
    STRATA_CHECK(matmuls_.backward(at(b.d_moe_act, r0 * I), g + down, at(b.moe_y, r0 * C),
                                   at(b.moe_act, r0 * I), at(w, down), n, I, C, type_, stream));
    STRATA_CHECK(cuda::swiglu_backward(at(b.d_moe_gate_up, r0 * 2 * I), at(b.d_moe_act, r0 * I),
                                       at(b.moe_gate_up, r0 * 2 * I), n, I, type_, stream));
    STRATA_CHECK(matmuls_.backward(at(b.d_moe_x, r0 * C), g + gate_up,
                                   at(b.d_moe_gate_up, r0 * 2 * I), at(b.moe_x, r0 * C),
                                   at(w, gate_up), n, C, 2 * I, type_, stream));
  }
  return Status::ok();
}

Status CudaUnits::route(int64_t u, const void* w, const void* input, uint8_t* used,
                        cudaStream_t stream) {
  const UnitLayout& unit = layout_.units[size_t(u)];
  const LayerOffsets o = layer_offsets(unit);
  if (unit.unit.piece != LayerPiece::mlp || o.router < 0)
    return Status::error(fmt::format("routing {}: not a sparse layer's MLP piece", unit.unit.name));
  const ModelConfig& c = layout_.config;
  const int64_t N = B_ * T_, C = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  Buffers& b = *b_;
  STRATA_CHECK(cuda::rmsnorm_forward(b.xn2, b.rstd2, input, at(w, o.norm_post), N, C,
                                     static_cast<float>(c.rms_norm_eps), type_, stream));
  STRATA_CHECK(
      matmuls_.forward(b.router_logits, b.xn2, at(w, o.router), N, C, E, type_, false, stream));
  STRATA_CHECK(cuda::moe_route(b.probs, b.top_expert, b.top_weight, b.router_logits, N, E, K,
                               c.norm_topk_prob, type_, stream));
  STRATA_CHECK(cuda::check_cuda(cudaMemcpyAsync(b.host_top_expert.data(), b.top_expert,
                                                size_t(N * K) * 4, cudaMemcpyDeviceToHost, stream),
                                "reading the routing"));
  STRATA_CHECK(cuda::check_cuda(cudaStreamSynchronize(stream), "waiting for the routing"));
  std::fill_n(used, E, uint8_t{0});
  for (int64_t r = 0; r < N * K; ++r) used[b.host_top_expert[size_t(r)]] = 1;
  return Status::ok();
}

void CudaUnits::add_router_stats(RouterStats& stats) const {
  const Buffers& b = *b_;
  stats.add(b.expert_begin.data(), b.host_prob_sums.data(), B_ * T_);
}

Result<const float*> CudaUnits::upload_aux_grad(const CudaUnitBatch& batch, cudaStream_t stream) {
  UnitBatch host;
  host.router = batch.router;
  host.aux_loss_scale = batch.aux_loss_scale;
  std::vector<float> aux_grad = router_aux_grad(layout_.config, host);
  if (aux_grad.empty()) return static_cast<const float*>(nullptr);
  // The micro-batch's other sparse layers take the same gradient: the device has it.
  if (aux_grad == b_->host_aux_grad) return static_cast<const float*>(b_->aux_grad);
  // The last upload (and every kernel that read it) is done before its host
  // copy and its device buffer are replaced.
  STRATA_CHECK(
      cuda::check_cuda(cudaStreamSynchronize(stream), "waiting for the last sparse layer"));
  b_->host_aux_grad = std::move(aux_grad);
  Status uploaded = cuda::check_cuda(
      cudaMemcpyAsync(b_->aux_grad, b_->host_aux_grad.data(), b_->host_aux_grad.size() * 4,
                      cudaMemcpyHostToDevice, stream),
      "uploading the load-balancing gradient");
  if (!uploaded) {
    b_->host_aux_grad.clear();  // the device's copy is unknown
    return uploaded;
  }
  return static_cast<const float*>(b_->aux_grad);
}

}  // namespace strata
#endif
