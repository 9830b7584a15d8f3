// Squared L2 norm and inf/nan check of a gradient shard, in one read.
//
// The sum is taken in float64 (each square of an fp32, bf16 or fp16 value is
// exact there) in a fixed order that depends only on the shard length: blocks
// of kGradNormBlock elements, 16 interleaved lanes inside a block, blocks
// combined by tbb::parallel_deterministic_reduce. So the result is bitwise
// the same for any thread count and on every SIMD path (simd.h), and the
// engine gets the same global norm however the work is scheduled.
//
// An inf or NaN anywhere makes `nonfinite` true (and sum_squares non-finite);
// a finite gradient cannot overflow the float64 sum. Thread-safe; uses the
// current TBB arena.
#pragma once

#include <cstdint>

#include "io/base/status.h"
#include "kernels/cpu/simd.h"

namespace strata::kernels::cpu {

inline constexpr int64_t kGradNormBlock = 4096;

struct GradNormPartial {
  double sum_squares = 0.0;  // sum of grad[i]^2, unscaled by anything
  bool nonfinite = false;    // some element is inf or NaN

  // Combines shards; call in a fixed order (e.g. unit order) for reproducible sums.
  void add(const GradNormPartial& other) {
    sum_squares += other.sum_squares;
    nonfinite = nonfinite || other.nonfinite;
  }
};

// `grad`: (numel) elements of `type`. Fails on a negative length or a null
// pointer with numel > 0.
Result<GradNormPartial> grad_norm_squared(const void* grad, ElementType type, int64_t numel);

}  // namespace strata::kernels::cpu
