// The model's units on the CUDA backend: the GPU twins of core/model/model.h's
// unit_forward, unit_backward and head_forward_backward, with the same
// semantics (per-unit activation checkpointing, the backward recomputing a
// layer's forward from its input, parameter gradients accumulating in fp32,
// the gradient of a unit's input overwritten) and the same fused products
// (qkv, gate/up), built from kernels/cuda/ops.h and kernels/cuda/matmul.h, and
// the families' features: q/k/v biases (qwen2), per-head q/k RMSNorm (qwen3).
// Mistral's sliding window is computed only where it holds the whole sequence
// (create refuses a longer sequence, naming the window and --seq-len). A
// decoder layer may be cut into its attention and its MLP
// (ModelConfig::layer_pieces), each a unit computing what that half of the
// whole layer computes, in the same order. The embedding and the head may be
// cut along the vocabulary (ModelConfig::vocab_chunks), each chunk a unit
// computing what core/model/vocab_chunks.h's does: embedding chunks set
// their tokens' rows, head chunks write their block of the logits
// (CudaUnitBatch::head_logits), the last chunk's pass takes the loss over
// the whole rows, and every chunk's backward reads its block. A mixture's
// sparse layers (mixtral, qwen3_moe) route, run each expert over its rows
// and add the weighted outputs as core/model/model.h defines, with the
// router statistics in host memory (CudaUnitBatch::router). A sparse
// layer's MLP piece may be cut into a router piece and groups of experts
// (ModelConfig::expert_groups), a dense layer's into parts along its
// intermediate dimension (ModelConfig::mlp_parts), handing on what the CPU
// units hand on in the micro-batch's chain (CudaUnitBatch::expert_chain), with
// one difference: backward, the pieces pass the layer's output gradient on
// unchanged and add the normed rows' gradient into the chain's fp32 sum,
// which the router piece (or part 0) takes, so that no sum is rounded to
// the compute type between pieces (core/README.md, "Expert groups" and "MLP
// parts", states what stays bitwise and the bound).
//
// Contract. Every call enqueues work on `stream` and returns at once, but
// for a sparse layer: its forward waits for the stream once, to group the
// routed rows on the host (each expert's product needs its row count) and
// take the router statistics, its backward to upload the load-balancing
// gradient when it is not the one the device holds already; route and
// route_from_chain (routed expert fetch) wait for the stream too. Cut into
// groups, the router piece's forward waits once (the statistics), and each
// group's forward and backward once (its routing, read from the chain): G + 1
// waits per layer each way. Every pointer is a device pointer.
// Parameters and activations are in the compute type (bf16, fp16, or fp32 for testing); parameter
// gradients are fp32. A CudaUnits object is the working set of one (model, B, T, type): the
// activations of one decoder layer, the backward's scratch and the head's
// logits, laid out in one block of device memory that the caller allocates
// (from a budgeted device tier) with cuda_unit_workspace_bytes bytes. Like the
// CPU workspace, the last layer forward's activations survive the head, so
// the engine may skip recomputing that layer in its backward.
//
// Thread-safety: one caller and one stream at a time per object.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "core/model/model.h"
#include "core/model/model_config.h"
#include "io/base/status.h"

namespace strata {

// Rows of logits the GPU head computes at once, for (config, B, T, type bytes).
int64_t cuda_head_rows(const ModelConfig& config, int64_t B, int64_t T, int type_bytes);

// Device bytes a CudaUnits workspace takes (compiles without CUDA, for plans).
int64_t cuda_unit_workspace_bytes(const ModelConfig& config, int64_t B, int64_t T, int type_bytes);

// Device bytes of the gradient-norm kernel's scratch for `numel` elements (0 without CUDA).
int64_t cuda_grad_norm_scratch_bytes(int64_t numel);

}  // namespace strata

#if STRATA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/matmul.h"
#include "kernels/cuda/ops.h"

namespace strata {

// One micro-batch on the device.
struct CudaUnitBatch {
  const int32_t* tokens = nullptr;   // (B*T), in [0, V)
  const int32_t* targets = nullptr;  // (B*T), < 0 ignored
  float loss_scale = 1.0f;           // d(objective)/d(each token's loss)
  // A head cut along the vocabulary (ModelConfig::vocab_chunks > 1): this
  // micro-batch's logits of the compute type, (N, V) chunk after chunk, each
  // chunk's (N, rows) block, as UnitBatch::head_logits on the CPU. Null for
  // a whole head; a cut one needs it.
  void* head_logits = nullptr;
  // A mixture of experts (core/model/model.h, UnitBatch::router and
  // aux_loss_scale): the micro-batch's router statistics in host memory,
  // which the embedding's forward resets and each sparse layer's forward
  // adds to, and d(objective)/d(its load-balancing loss) for the backwards.
  RouterStats* router = nullptr;
  float aux_loss_scale = 0.0f;
  // A sparse layer cut into groups of experts, or a dense MLP into parts:
  // the micro-batch's chain, expert_chain_floats 4-byte words viewed as
  // expert_chain_view lays them out, its rows (N, C) of the compute type.
  // Null otherwise; a cut layer needs it.
  float* expert_chain = nullptr;
};

class CudaUnits {
 public:
  // `memory`: cuda_unit_workspace_bytes(layout.config, B, T, dtype_size(type)) device bytes,
  // 256-byte aligned. Uploads the RoPE tables (synchronously).
  static Result<std::unique_ptr<CudaUnits>> create(const ModelLayout& layout, int64_t B, int64_t T,
                                                   kernels::cuda::DType type, std::byte* memory,
                                                   int64_t bytes, kernels::cuda::Matmuls& matmuls);
  ~CudaUnits();
  CudaUnits(const CudaUnits&) = delete;
  CudaUnits& operator=(const CudaUnits&) = delete;

  // Forward of the embedding or a decoder layer (or a vocabulary chunk of the
  // embedding or head but the head's last): output (B*T, C) from input
  // (B*T, C) (unused by the whole embedding). params: the unit's flat (padded_numel).
  Status forward(int64_t u, const void* params, const CudaUnitBatch& batch, const void* input,
                 void* output, cudaStream_t stream);

  // Backward of the embedding or a decoder layer: grads (padded_numel, fp32) +=,
  // dinput (B*T, C) = (may alias doutput; unused by the embedding). recompute
  // false: the layer's activations are still those of its last forward.
  Status backward(int64_t u, const void* params, const CudaUnitBatch& batch, const void* input,
                  const void* doutput, void* dinput, float* grads, bool recompute,
                  cudaStream_t stream);

  // The head's forward and backward in one pass over blocks of logits (a
  // vocabulary-cut head's last chunk: input and dinput are the normed rows
  // and their gradient, the loss over every chunk's block).
  // params: the head's flat; tied_embedding: unit 0's flat when the model is
  // tied (its gradient goes to tied_grads, +=), else null. losses (B*T) fp32 =,
  // dinput (B*T, C) =, grads (head padded_numel) +=.
  Status head_forward_backward(const void* params, const void* tied_embedding,
                               const CudaUnitBatch& batch, const void* input, void* dinput,
                               float* grads, float* tied_grads, float* losses, cudaStream_t stream);

  // Routed expert fetch: the experts a sparse layer's MLP piece `u` routes
  // `input`'s tokens to, as its forward routes them (the post-attention norm,
  // the router in the compute type, moe_route): used[e] = 1 when expert e
  // gets a token, else 0 (E, host memory). Reads only the norm and the
  // router of `params`. Waits for the stream (the routing comes down); the
  // forward that follows recomputes it.
  Status route(int64_t u, const void* params, const void* input, uint8_t* used,
               cudaStream_t stream);
  // The same for a piece of experts: the experts of its group that the
  // routing its router piece recorded in the batch's chain reaches. Waits
  // for the stream.
  Status route_from_chain(int64_t u, const CudaUnitBatch& batch, uint8_t* used,
                          cudaStream_t stream);

 private:
  struct Buffers;
  CudaUnits(const ModelLayout& layout, int64_t B, int64_t T, kernels::cuda::DType type,
            kernels::cuda::Matmuls& matmuls);
  // A decoder layer's tensors (or its piece's) in its flat buffer, in
  // elements; -1 where the family or the piece has none.
  struct LayerOffsets {
    int64_t qkv = -1, o = -1, gate_up = -1, down = -1, norm_in = -1, norm_post = -1;
    int64_t qkv_bias = -1, q_norm = -1, k_norm = -1;
    // A sparse layer's router (E, C) and experts (expert e's gate and up
    // (2 I, C) at experts + e 3 I C, its down (C, I) after them).
    int64_t router = -1, experts = -1;
  };
  static LayerOffsets layer_offsets(const UnitLayout& unit);
  // A whole layer or its piece (UnitShape::piece), as the CPU units compute them.
  Status layer_forward(int64_t u, const void* params, const void* x, void* out,
                       cudaStream_t stream);
  Status layer_backward(int64_t u, const void* params, float* grads, const void* x,
                        const void* dout, void* dx, bool recompute, const float* aux_grad,
                        cudaStream_t stream);
  // The two halves of a layer: x2 = x + attention; out = x2 + MLP (no `out`:
  // recomputation for the backward). Their backwards add into dx.
  Status attention_forward(const LayerOffsets& o, const void* w, const void* x, void* x2,
                           cudaStream_t stream);
  Status mlp_forward(const LayerOffsets& o, const void* w, const void* x2, void* out,
                     cudaStream_t stream);
  Status attention_backward(const LayerOffsets& o, const void* w, float* g, const void* x, void* dx,
                            cudaStream_t stream);
  Status mlp_backward(const LayerOffsets& o, const void* w, float* g, const void* x2,
                      const void* dout, void* dx, const float* aux_grad, cudaStream_t stream);
  // A sparse layer's MLP from xn2 (its norm's output): the routing (grouped
  // on the host, which waits for the stream), each expert over its rows, and
  // with `out`, out = x2 + the weighted sum. Its backward leaves d(xn2) in
  // d_xn; aux_grad: the load-balancing gradient (E) on the device, or null.
  Status moe_forward(const LayerOffsets& o, const void* w, const void* x2, void* out,
                     cudaStream_t stream);
  Status moe_backward(const LayerOffsets& o, const void* w, float* g, const void* dout,
                      const float* aux_grad, cudaStream_t stream);
  // After a sparse layer's forward: its routing's counts and probabilities'
  // sums (in host memory since the routing) added to the micro-batch's statistics.
  void add_router_stats(RouterStats& stats) const;
  // The load-balancing gradient of `batch` for a sparse layer's backward,
  // uploaded: the device pointer, or null when the batch takes none.
  Result<const float*> upload_aux_grad(const CudaUnitBatch& batch, cudaStream_t stream);
  // A layer cut finer than its MLP piece (cuda_units_pieces.cpp): a sparse
  // layer's router piece and groups of experts, a dense layer's MLP parts,
  // over the micro-batch's chain. No `out`: recomputation for the backward.
  Status piece_forward(int64_t u, const void* w, const CudaUnitBatch& batch, const void* x,
                       void* out, cudaStream_t stream);
  Status piece_backward(int64_t u, const void* w, float* g, const CudaUnitBatch& batch,
                        const void* x, const void* dout, void* dx, bool recompute,
                        const float* aux_grad, cudaStream_t stream);
  Status router_piece_forward(const UnitLayout& unit, const void* w, const ExpertChain& chain,
                              const void* x2, void* out, cudaStream_t stream);
  Status router_piece_backward(const UnitLayout& unit, const void* w, float* g,
                               const ExpertChain& chain, const void* x2, const void* dout, void* dx,
                               const float* aux_grad, cudaStream_t stream);
  Status expert_group_forward(int64_t u, const void* w, const ExpertChain& chain, const void* xn,
                              void* out, cudaStream_t stream);
  Status expert_group_backward(int64_t u, const void* w, float* g, const ExpertChain& chain,
                               const void* xn, const void* dout, void* dx, cudaStream_t stream);
  Status mlp_part_forward(int64_t u, const void* w, const ExpertChain& chain, const void* x,
                          void* out, cudaStream_t stream);
  Status mlp_part_backward(int64_t u, const void* w, float* g, const ExpertChain& chain,
                           const void* x, const void* dout, void* dx, bool recompute,
                           cudaStream_t stream);
  // Sparse layer `sparse`'s routing as its router piece recorded it in the
  // chain, in b.host_top_expert (the host waits for the stream); and
  // besides grouped there and the grouped rows uploaded.
  Status read_chain_routing(int64_t sparse, const ExpertChain& chain, cudaStream_t stream);
  Status load_chain_routing(int64_t sparse, const ExpertChain& chain, cudaStream_t stream);
  // The routing just computed (b.top_expert) and its probabilities' sums to
  // the host (one wait), its rows grouped there; and the grouped rows uploaded.
  Status routing_to_host(cudaStream_t stream);
  Status upload_routed_rows(cudaStream_t stream);
  // Experts [first, first + count) of `experts` (offset: expert first's
  // gate in w and g) over their routed rows of xn: inputs, products,
  // outputs; and their backward from the rows' output gradients in moe_y:
  // their gradients (+=) and the rows' input gradients (d_moe_x).
  Status expert_rows_forward(const ExpertBlocks& experts, const void* w, const void* xn,
                             cudaStream_t stream);
  Status expert_rows_backward(const ExpertBlocks& experts, const void* w, float* g,
                              cudaStream_t stream);
  // Qwen3's RMSNorm on each head of q and k, in place in the qkv rows (the inputs
  // and rstd kept), and its backward in place in d_qkv; the norms' flat offsets.
  Status qk_norm_forward(const void* params, int64_t q_norm, int64_t k_norm, cudaStream_t stream);
  Status qk_norm_backward(const void* params, float* grads, int64_t q_norm, int64_t k_norm,
                          cudaStream_t stream);
  // Strided copy of `heads` heads per token between (B*T, pitch) buffers (pitches in elements).
  Status copy_heads(void* to, int64_t to_pitch, const void* from, int64_t from_pitch, int64_t heads,
                    cudaStream_t stream) const;
  // A vocabulary chunk of the embedding or the head (core/model/vocab_chunks.h).
  Status vocab_chunk_forward(int64_t u, const void* params, const CudaUnitBatch& batch,
                             const void* input, void* output, cudaStream_t stream);
  Status vocab_chunk_backward(int64_t u, const void* params, const CudaUnitBatch& batch,
                              const void* input, const void* doutput, void* dinput, float* grads,
                              cudaStream_t stream);
  Status head_chunks_pass(const void* params, const CudaUnitBatch& batch, const void* input,
                          void* dinput, float* grads, float* losses, cudaStream_t stream);
  // Rows [first, first + rows) of the whole logits between the chunks' blocks
  // and the (rows, V) logits buffer: gathered, or scattered back.
  Status move_logit_rows(void* blocks, int64_t first, int64_t rows, bool gather,
                         cudaStream_t stream);
  // Element `offset` of a flat buffer of the compute type.
  const void* at(const void* flat, int64_t offset) const;
  void* at(void* flat, int64_t offset) const;

  const ModelLayout& layout_;
  int64_t B_, T_;
  kernels::cuda::DType type_;
  kernels::cuda::Matmuls& matmuls_;
  std::unique_ptr<Buffers> b_;
};

}  // namespace strata
#endif
