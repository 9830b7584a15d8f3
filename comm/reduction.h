// The reduction arithmetic of the host communicators (LocalComm, GlooComm),
// in one place so that both give bitwise the same results.
//
// A sum over ranks starts at 0.0f and adds rank 0's element, then rank 1's, ...
// up to rank W-1's, in fp32. bf16 elements are widened exactly to fp32 and the
// fp32 sum is rounded to bf16 (nearest even) once, when it is stored. Internal
// to comm/: callers elsewhere use the Communicator interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "comm/communicator.h"

namespace strata::comm {

float bf16_to_float(uint16_t value);
// Rounds to nearest even; a NaN stays a (quiet) NaN.
uint16_t float_to_bf16(float value);

// sums[i] = sum over r in rank order of element (begin + i) of sources[r], for
// i in [0, count). sources[r] is rank r's buffer of `dtype` elements (any
// alignment).
void sum_in_rank_order(std::span<const void* const> sources, size_t begin, size_t count,
                       DataType dtype, float* sums);

// Element (begin + i) of `out` = sums[i] as `dtype`, for i in [0, count).
void store_sums(const float* sums, size_t count, DataType dtype, void* out, size_t begin);

}  // namespace strata::comm
