// The model's operations on the GPU (CUDA backend), forward and backward.
//
// Contract. Every function here is a host call that enqueues work on `stream`
// and returns at once; pointers are device pointers, with the shape written
// next to each. Activations and activation gradients are in the compute type
// `type` (bf16, fp16, or fp32 for testing); arithmetic inside every kernel is
// fp32 (float64 for the gradient norm), rounded to `type` once per output
// element, except where Hugging Face's LlamaForCausalLM rounds in between and
// we follow it (RMSNorm's normalised row is cast to the input type before the
// weight multiplies it; kernels/README.md). Parameter gradients are fp32 and
// accumulate (+=) like the CPU backend's; activation gradients follow each CPU
// kernel's = or += (kernels/cpu/*.h), so a unit's code reads the same on both
// backends. Shapes follow kernels/cpu/*.h exactly; only the pointers' element
// type differs.
//
// Errors. A call checks its arguments and its launch (cudaGetLastError), and a
// failure comes back as a Status naming the kernel, the type and the shape,
// e.g. "attention_forward<bf16> (B=1 T=2048 H=32 KV=8 D=64): too many
// resources requested for launch". Faults inside a running kernel surface at
// the next synchronising call, as always with CUDA.
//
// Determinism. No kernel uses atomics: the embedding gradient sorts tokens and
// sums each token's rows in their original order (as the CPU backend does), the
// RMSNorm weight gradient and the gradient norm reduce fixed chunks in a fixed
// order, attention's backward computes dq and dk/dv in separate passes. Results
// are bitwise reproducible on one device for any stream or run.
//
// Scratch. Backwards that need temporary memory take it from the caller (a
// budgeted device tier), sized by the matching *_scratch_bytes function.
//
// Thread-safety: the functions keep no state; concurrent calls on different
// streams and buffers are fine. Matrix products are in kernels/cuda/matmul.h,
// AdamW in kernels/cuda/adamw.h.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "io/base/status.h"
#include "kernels/cpu/attention.h"

namespace strata::kernels::cuda {

// Element type of activations, parameters in compute precision, and copies.
enum class DType { f32, bf16, f16 };

std::string_view dtype_name(DType type);
std::size_t dtype_size(DType type);

// OK, or "what: CUDA's error text" for the result of a CUDA runtime call (the
// sticky last error is cleared), for callers that enqueue copies and events.
Status check_cuda(cudaError_t error, std::string_view what);

// --- embedding (kernels/cuda/embedding.cu) ------------------------------------------

// Token ids must lie in [0, V) (core/ checks them, as for the CPU backend).
Status embedding_forward(void* out,              // (N, C) of type, =
                         const int32_t* tokens,  // (N)
                         const void* weight,     // (V, C) of type
                         int64_t N, int64_t C, DType type, cudaStream_t stream);

// A vocabulary chunk's rows (strata.vocab_chunks): the rows of the tokens in
// [begin, end) set from weight's row (token - begin); the others untouched.
Status embedding_forward_rows(void* out,              // (N, C) of type
                              const int32_t* tokens,  // (N)
                              const void* weight,     // (end - begin, C) of type
                              int64_t N, int64_t C, int64_t begin, int64_t end, DType type,
                              cudaStream_t stream);

std::size_t embedding_backward_scratch_bytes(int64_t N, int64_t V);

// Deterministic: every token's rows are added into dweight in increasing row
// order, as kernels/cpu/embedding.cpp does, so fp32 results are bitwise equal to
// the CPU backend's.
Status embedding_backward(float* dweight,         // (V, C), +=
                          const void* dout,       // (N, C) of type
                          const int32_t* tokens,  // (N)
                          int64_t N, int64_t C, int64_t V, DType type,
                          void* scratch,  // embedding_backward_scratch_bytes(N, V)
                          std::size_t scratch_bytes, cudaStream_t stream);
// The same for a vocabulary chunk: only tokens in [begin, end) of the
// vocabulary's V, each into dweight's row (token - begin).
Status embedding_backward_rows(float* dweight,         // (end - begin, C), +=
                               const void* dout,       // (N, C) of type
                               const int32_t* tokens,  // (N), in [0, V)
                               int64_t N, int64_t C, int64_t V, int64_t begin, int64_t end,
                               DType type,
                               void* scratch,  // embedding_backward_scratch_bytes(N, V)
                               std::size_t scratch_bytes, cudaStream_t stream);

// --- RMSNorm (kernels/cuda/rmsnorm.cu) -----------------------------------------------

// out = weight * cast_to_type(x * rstd), rstd = 1 / sqrt(mean(x^2) + eps) in fp32.
Status rmsnorm_forward(void* out,           // (N, C) of type, =
                       float* rstd,         // (N), =
                       const void* inp,     // (N, C) of type
                       const void* weight,  // (C) of type
                       int64_t N, int64_t C, float eps, DType type, cudaStream_t stream);

std::size_t rmsnorm_backward_scratch_bytes(int64_t N, int64_t C);

Status rmsnorm_backward(void* dinp,          // (N, C) of type, +=
                        float* dweight,      // (C), +=
                        const void* dout,    // (N, C) of type
                        const void* inp,     // (N, C) of type
                        const void* weight,  // (C) of type
                        const float* rstd,   // (N), from rmsnorm_forward
                        int64_t N, int64_t C, DType type,
                        void* scratch,  // rmsnorm_backward_scratch_bytes(N, C)
                        std::size_t scratch_bytes, cudaStream_t stream);

// --- bias of a linear layer (kernels/cuda/bias.cu) --------------------------------------

// out (N, OC) += bias in every row (fp32 add, one rounding).
Status bias_forward(void* out,         // (N, OC) of type, +=
                    const void* bias,  // (OC) of type
                    int64_t N, int64_t OC, DType type, cudaStream_t stream);

// dbias += the column sums of dout, in a fixed order.
Status bias_backward(float* dbias,      // (OC), +=
                     const void* dout,  // (N, OC) of type
                     int64_t N, int64_t OC, DType type, cudaStream_t stream);

// --- rotary embedding (kernels/cuda/rope.cu) -------------------------------------------

// In place on rows n = b*T + t of `row_stride` elements holding `heads` heads of
// D at their start (q or k inside the fused qkv rows). cos/sin are the fp32
// tables of kernels/cpu/rope.h (rope_cos_sin), copied to the device.
Status rope_forward(void* x,           // (B*T, row_stride) of type, heads*D used
                    const float* cos,  // (T, D/2)
                    const float* sin,  // (T, D/2)
                    int64_t B, int64_t T, int64_t heads, int64_t D, int64_t row_stride, DType type,
                    cudaStream_t stream);

// The transposed rotation, in place on the gradient (=).
Status rope_backward(void* dx,          // (B*T, row_stride) of type, heads*D used
                     const float* cos,  // (T, D/2)
                     const float* sin,  // (T, D/2)
                     int64_t B, int64_t T, int64_t heads, int64_t D, int64_t row_stride, DType type,
                     cudaStream_t stream);

// --- causal grouped-query attention (kernels/cuda/attention.cu) ----------------------

// The shape of kernels/cpu/attention.h (row_block is not used here). D <= 128.
// A sliding window is accepted only when it holds the whole sequence
// (window >= T, where it masks nothing); a shorter one is refused.
using AttentionShape = cpu::AttentionShape;

// Flash-style: tiles of keys stream through shared memory and an online
// softmax keeps a running max and sum per query row, so no T x T matrix exists
// in memory. Saves the log-sum-exp of every row's scaled scores for the backward.
Status attention_forward(void* out,      // (B, T, H*D) of type, =
                         float* lse,     // (B, H, T), =
                         const void* q,  // (B, T, row_stride) of type, H heads of D
                         const void* k,  // (B, T, row_stride) of type, KV heads of D
                         const void* v,  // (B, T, row_stride) of type, KV heads of D
                         const AttentionShape& shape, DType type, cudaStream_t stream);

// Recomputes the probabilities tile by tile from q, k and lse. dk/dv sum over
// the query heads of their group. = semantics, like the CPU backend.
Status attention_backward(void* dq,          // (B, T, row_stride) of type, H heads of D, =
                          void* dk,          // (B, T, row_stride) of type, KV heads of D, =
                          void* dv,          // (B, T, row_stride) of type, KV heads of D, =
                          float* delta,      // (B, H, T) scratch: rowsum(dout * out)
                          const void* dout,  // (B, T, H*D) of type
                          const void* out,   // (B, T, H*D) of type, from attention_forward
                          const float* lse,  // (B, H, T), from attention_forward
                          const void* q, const void* k, const void* v,  // as in the forward
                          const AttentionShape& shape, DType type, cudaStream_t stream);

// --- SwiGLU (kernels/cuda/swiglu.cu) ---------------------------------------------------

Status swiglu_forward(void* out,            // (N, I) of type, = silu(gate) * up
                      const void* gate_up,  // (N, 2*I) of type: gate then up
                      int64_t N, int64_t I, DType type, cudaStream_t stream);

Status swiglu_backward(void* dgate_up,       // (N, 2*I) of type, =
                       const void* dout,     // (N, I) of type
                       const void* gate_up,  // (N, 2*I) of type
                       int64_t N, int64_t I, DType type, cudaStream_t stream);

// --- mixture of experts (kernels/cuda/moe.cu) -----------------------------------------
//
// A sparse layer's routing and the per-token parts around the experts'
// products, as core/model/model.h defines them (the experts' products are
// matrix products, kernels/cuda/matmul.h, over each expert's rows). The host
// groups the routed rows by expert (group_routed_rows, core/model/model.h):
// row_of (N, K) gives the row of token n's k-th slot, row_token (N K) the
// token of each row. Every kernel below keeps the CPU backend's order of
// operations, but for expf's rounding in the router and the float64 sum
// behind each weight's gradient (a block reduction); one thread or one block
// per token, no atomics. K is at most kMoeMaxTopK.

constexpr int64_t kMoeMaxTopK = 32;

// probs = softmax(logits) in fp32 (exponentials against the row's maximum,
// their sum in float64); each token's k largest probabilities in descending
// order, ties to the lower index; the weights are those probabilities,
// divided by their (fp32, slot-order) sum when norm_topk_prob.
Status moe_route(float* probs,         // (N, E) fp32, =
                 int32_t* top_expert,  // (N, K), =
                 float* top_weight,    // (N, K) fp32, =
                 const void* logits,   // (N, E) of type
                 int64_t N, int64_t E, int64_t K, bool norm_topk_prob, DType type,
                 cudaStream_t stream);

// sums[e] = the sum over tokens n (in order, float64) of probs[n, e]; zeros for N = 0.
Status moe_prob_sums(double* sums,        // (E), =
                     const float* probs,  // (N, E) fp32
                     int64_t N, int64_t E, cudaStream_t stream);

// rows[r] = x[row_token[r]]: each routed row's input.
Status moe_gather_rows(void* rows,                // (R, C) of type, =
                       const void* x,             // (N, C) of type
                       const int32_t* row_token,  // (R), in [0, N)
                       int64_t R, int64_t N, int64_t C, DType type, cudaStream_t stream);

// out[n] = x2[n] + s, s the fp32 sum over token n's slots in increasing
// order of their experts of top_weight * y[row_of]: one rounding per element.
Status moe_combine(void* out,                  // (N, C) of type, =
                   const void* x2,             // (N, C) of type
                   const void* y,              // (R, C) of type: the experts' outputs
                   const int32_t* top_expert,  // (N, K)
                   const int32_t* row_of,      // (N, K)
                   const float* top_weight,    // (N, K) fp32
                   int64_t N, int64_t C, int64_t K, DType type, cudaStream_t stream);

// A sparse layer cut into groups of experts (strata.expert_groups): group
// [first, end)'s part of moe_combine. sum (fp32) += the weighted outputs of
// the token's slots whose experts lie in [first, end), in increasing order of
// their experts; with `out` (the last group), out = x2 + sum, one rounding.
// Groups run in expert order from a zeroed sum, so the last one's out is
// moe_combine's bits.
Status moe_combine_experts(float* sum,                 // (N, C) fp32, +=
                           void* out,                  // (N, C) of type, =, or null
                           const void* x2,             // (N, C) of type (with out)
                           const void* y,              // (R, C) of type: the group's rows
                           const int32_t* top_expert,  // (N, K)
                           const int32_t* row_of,      // (N, K)
                           const float* top_weight,    // (N, K) fp32
                           int64_t first, int64_t end, int64_t N, int64_t C, int64_t K, DType type,
                           cudaStream_t stream);

// The weights' gradient d_top_weight[n, k] = dout[n] . y[row_of[n, k]]
// (summed in float64, stored as fp32), then each row's output gradient in place: y[row] =
// top_weight * dout[n], rounded to type.
Status moe_weight_backward(float* d_top_weight,      // (N, K) fp32, =
                           void* y,                  // (R, C) of type: outputs in, gradients out
                           const void* dout,         // (N, C) of type
                           const int32_t* row_of,    // (N, K)
                           const float* top_weight,  // (N, K) fp32
                           int64_t N, int64_t C, int64_t K, DType type, cudaStream_t stream);

// moe_weight_backward for the slots whose experts lie in [first, end) (a
// group of experts); the other slots' weights' gradients and rows untouched.
Status moe_weight_backward_experts(float* d_top_weight,        // (N, K) fp32, = (the group's)
                                   void* y,                    // (R, C) of type, as above
                                   const void* dout,           // (N, C) of type
                                   const int32_t* top_expert,  // (N, K)
                                   const int32_t* row_of,      // (N, K)
                                   const float* top_weight,    // (N, K) fp32
                                   int64_t first, int64_t end, int64_t N, int64_t C, int64_t K,
                                   DType type, cudaStream_t stream);

// The router's backward to its logits: dp_e = aux_grad[e] (0 when null)
// plus, for each slot k in order, d_top_weight's share (through the
// renormalisation when norm_topk_prob); d_logits = p (dp - p . dp), the dot in
// float64.
Status moe_router_backward(void* d_logits,             // (N, E) of type, =
                           const float* probs,         // (N, E) fp32
                           const int32_t* top_expert,  // (N, K)
                           const float* top_weight,    // (N, K) fp32
                           const float* d_top_weight,  // (N, K) fp32
                           const float* aux_grad,      // (E) fp32, or null
                           int64_t N, int64_t E, int64_t K, bool norm_topk_prob, DType type,
                           cudaStream_t stream);

// dx[n] = the fp32 sum over token n's slots in increasing order of their
// experts of d_rows[row_of], one rounding per element.
Status moe_sum_rows(void* dx,                   // (N, C) of type, =
                    const void* d_rows,         // (R, C) of type
                    const int32_t* top_expert,  // (N, K)
                    const int32_t* row_of,      // (N, K)
                    int64_t N, int64_t C, int64_t K, DType type, cudaStream_t stream);

// moe_sum_rows for the slots whose experts lie in [first, end), into an
// fp32 sum: sum[n] = (accumulate ? sum[n] : 0) + those rows in increasing
// order of their experts. Groups of experts add their rows in turn (the
// last group first); with k <= 2 slots per token the sum is moe_sum_rows's
// before its rounding (one addition commutes).
Status moe_add_rows(float* sum,  // (N, C) fp32, = or +=
                    bool accumulate,
                    const void* d_rows,         // (R, C) of type
                    const int32_t* top_expert,  // (N, K)
                    const int32_t* row_of,      // (N, K)
                    int64_t first, int64_t end, int64_t N, int64_t C, int64_t K, DType type,
                    cudaStream_t stream);

// --- softmax cross-entropy (kernels/cuda/cross_entropy.cu) ---------------------------

// As Hugging Face's loss: logits upcast to fp32. A target below 0 is ignored
// (loss 0, gradient 0).
Status cross_entropy_forward(float* losses,           // (N), =
                             const void* logits,      // (N, V) of type
                             const int32_t* targets,  // (N), < 0 ignored
                             int64_t N, int64_t V, DType type, cudaStream_t stream);

// dlogits = dloss * (softmax(logits) - onehot(target)), rounded to type; it may
// alias logits (each element is read before it is overwritten). losses may be
// null (backward only).
Status cross_entropy_forward_backward(float* losses,           // (N), =; or null
                                      void* dlogits,           // (N, V) of type, =
                                      const void* logits,      // (N, V) of type
                                      const int32_t* targets,  // (N), < 0 ignored
                                      float dloss, int64_t N, int64_t V, DType type,
                                      cudaStream_t stream);

// --- residual add and casts (kernels/cuda/residual.cu, kernels/cuda/cast.cu) --------

// out = a + b, rounded once; out may alias a or b. The residual's backward is
// the identity: the gradient reaches both branches unchanged, and callers add
// it where the branches meet with this same function.
Status residual_forward(void* out,      // (n) of type
                        const void* a,  // (n) of type
                        const void* b,  // (n) of type
                        int64_t n, DType type, cudaStream_t stream);

// An fp32 sum of values of the type, for sums that pieces of a layer add
// in turn (an MLP cut into parts): sum = (accumulate ? sum : 0) + x.
Status accumulate_f32(float* sum,     // (n) fp32, = or +=
                      const void* x,  // (n) of type
                      int64_t n, bool accumulate, DType type, cudaStream_t stream);

// out = a + b with b in fp32, rounded once; out may alias a.
Status residual_add_f32(void* out,       // (n) of type
                        const void* a,   // (n) of type
                        const float* b,  // (n) fp32
                        int64_t n, DType type, cudaStream_t stream);

// Converts n elements (round to nearest even when narrowing). src and dst must
// not overlap unless they are the same buffer of the same type.
Status cast(void* dst, DType dst_type,        // (n)
            const void* src, DType src_type,  // (n)
            int64_t n, cudaStream_t stream);

// --- gradient norm and inf/nan check (kernels/cuda/grad_norm.cu) ----------------------

struct GradNormResult {
  double sum_squares = 0.0;  // sum of grad[i]^2 in float64
  int32_t nonfinite = 0;     // 1 when some element is inf or NaN
};

std::size_t grad_norm_scratch_bytes(int64_t numel);

// Writes *result (device memory) for `grad`: fixed chunks summed in float64,
// then the chunk sums in a fixed tree, so the result depends only on numel.
Status grad_norm_squared(GradNormResult* result,  // (1), device, =
                         const void* grad,        // (numel) of type
                         DType type, int64_t numel,
                         void* scratch,  // grad_norm_scratch_bytes(numel)
                         std::size_t scratch_bytes, cudaStream_t stream);

}  // namespace strata::kernels::cuda
