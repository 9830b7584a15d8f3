// Softmax cross-entropy of the CPU backend, fused: the backward recomputes the
// softmax from the logits and may write the gradient over them, so a (N, V)
// block of logits never needs a second buffer.
//
// A target below 0 (Hugging Face's -100) is ignored: loss 0, gradient 0.
// cross_entropy_forward overwrites `losses`. cross_entropy_backward overwrites
// `dlogits` (=; it may alias `logits`) with dloss * (softmax - onehot), where
// dloss is d(objective)/d(each token's loss), e.g. 1 / tokens in the batch.
// cross_entropy_forward_backward does both in one pass over the exponentials
// (the head's forward and backward run back to back). Softmax sums are in
// double after subtracting the row maximum; TBB over rows.
#pragma once

#include <cstdint>

namespace strata::kernels::cpu {

void cross_entropy_forward(float* losses,           // (N)
                           const float* logits,     // (N, V)
                           const int32_t* targets,  // (N), < 0 ignored
                           int64_t N, int64_t V);

void cross_entropy_backward(float* dlogits,          // (N, V), =; may alias logits
                            const float* logits,     // (N, V)
                            const int32_t* targets,  // (N), < 0 ignored
                            float dloss, int64_t N, int64_t V);

void cross_entropy_forward_backward(float* losses,           // (N)
                                    float* dlogits,          // (N, V), =; may alias logits
                                    const float* logits,     // (N, V)
                                    const int32_t* targets,  // (N), < 0 ignored
                                    float dloss, int64_t N, int64_t V);

}  // namespace strata::kernels::cpu
