// Rotary position embeddings of the CPU backend, as Hugging Face's
// LlamaRotaryEmbedding: the `rotate_half` convention (dimension i pairs with
// i + D/2), inverse frequencies theta^(-2i/D) in fp32, optionally rescaled by
// `rope_scaling` of type llama3 (Llama 3.1/3.2), cos/sin computed in fp32.
// Positions restart at 0 in every sequence.
//
// rope_forward and rope_backward work in place on rows of a (possibly wider)
// buffer, so q and k can be rotated inside the fused qkv projection. The
// backward is the transposed rotation applied to the gradient (= semantics).
#pragma once

#include <cstdint>
#include <string>

namespace strata::kernels::cpu {

struct RopeParams {
  int64_t head_dim = 0;
  double theta = 10000.0;
  bool llama3_scaling = false;  // rope_scaling.rope_type == "llama3"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_positions = 8192;
};

// Inverse frequencies as Hugging Face computes them (fp32, llama3 scaling applied).
void rope_inv_freq(float* inv_freq,  // (D/2)
                   const RopeParams& params);

// cos/sin of position t times inv_freq[i], for t < T.
void rope_cos_sin(float* cos,             // (T, D/2)
                  float* sin,             // (T, D/2)
                  const float* inv_freq,  // (D/2)
                  int64_t T, int64_t D);

// x: rows n = b*T + t, each `row_stride` floats, holding `heads` heads of D at its start.
void rope_forward(float* x,          // (B*T, row_stride), heads*D used
                  const float* cos,  // (T, D/2)
                  const float* sin,  // (T, D/2)
                  int64_t B, int64_t T, int64_t heads, int64_t D, int64_t row_stride);

void rope_backward(float* dx,         // (B*T, row_stride), heads*D used
                   const float* cos,  // (T, D/2)
                   const float* sin,  // (T, D/2)
                   int64_t B, int64_t T, int64_t heads, int64_t D, int64_t row_stride);

}  // namespace strata::kernels::cpu
