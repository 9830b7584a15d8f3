// Causal self-attention with grouped-query heads, CPU backend (fp32).
//
// Query head h reads key/value head h / (H / KV). Scores are scaled by
// 1/sqrt(D), masked causally (and, with a sliding window W, to the last W keys:
// key j is seen by query i when i - W < j <= i, as Hugging Face's
// sliding_window_overlay) and soft-maxed in fp32; the probabilities are
// saved for the backward. q, k and v are read in place from rows of the fused
// qkv projection (`row_stride` floats per token), so no copy is made.
//
// attention_forward overwrites `out` and `probs`. attention_backward overwrites
// dq, dk and dv (= semantics; dk/dv sum over the query heads of their group).
// Products go through sgemm (gemm.h); call from one thread at a time.
#pragma once

#include <cstdint>

namespace strata::kernels::cpu {

struct AttentionShape {
  int64_t B = 0;           // sequences
  int64_t T = 0;           // tokens per sequence
  int64_t H = 0;           // query heads
  int64_t KV = 0;          // key/value heads; H % KV == 0
  int64_t D = 0;           // head dimension
  int64_t row_stride = 0;  // floats between tokens in q, k, v (and dq, dk, dv)
  int64_t window = 0;      // sliding window: keys a query sees, ending at itself; 0: all
  // Queries are taken in blocks of this many rows; a block's products stop at
  // its last row's key (causality), which skips about half of the T x T work.
  int64_t row_block = 64;
};

void attention_forward(float* out,      // (B, T, H*D)
                       float* probs,    // (B, H, T, T), zero where masked
                       const float* q,  // (B, T, row_stride), H heads of D
                       const float* k,  // (B, T, row_stride), KV heads of D
                       const float* v,  // (B, T, row_stride), KV heads of D
                       const AttentionShape& shape);

void attention_backward(float* dq,           // (B, T, row_stride), H heads of D; =
                        float* dk,           // (B, T, row_stride), KV heads of D; =
                        float* dv,           // (B, T, row_stride), KV heads of D; =
                        float* scratch,      // (T, T)
                        const float* dout,   // (B, T, H*D)
                        const float* probs,  // (B, H, T, T), from attention_forward
                        const float* q, const float* k, const float* v,  // as in the forward
                        const AttentionShape& shape);

}  // namespace strata::kernels::cpu
