// The embedding and the head cut along the vocabulary
// (ModelConfig::vocab_chunks > 1): the CPU computation of their chunks,
// which unit_forward, unit_backward and head_forward_backward (model.h, where
// the semantics are stated) hand a chunk's unit to.
#pragma once

#include <cstdint>

#include "core/model/model.h"

namespace strata {

// Forward of chunk unit `u` (an embedding or head chunk): its output, or for
// the last head chunk the sum of the token losses.
double vocab_chunk_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                           const UnitBatch& batch, const float* input, float* output,
                           UnitWorkspace& ws);

// Backward of an embedding chunk or of a head chunk but the last.
void vocab_chunk_backward(const ModelLayout& model, int64_t u, const UnitParams& params,
                          const UnitBatch& batch, const float* input, const float* doutput,
                          float* dinput, const UnitGrads& grads, UnitWorkspace& ws);

// The last head chunk's forward and backward in one pass: returns the sum of
// the token losses; dinput = its part of the normed rows' gradient; logits
// (B, T, V) written unless null.
double vocab_chunk_head_pass(const ModelLayout& model, const UnitParams& params,
                             const UnitBatch& batch, const float* input, float* dinput,
                             const UnitGrads& grads, UnitWorkspace& ws, float* logits);

}  // namespace strata
