// Fused AdamW step over one contiguous shard of fp32 optimizer state.
//
// One pass reads the gradient (fp32, bf16 or fp16), multiplies it by
// `grad_scale` (1 / loss scale times the clipping coefficient, computed once
// by the caller), updates the fp32 master weights and the moments m and v in
// place with torch.optim.AdamW's arithmetic (the formulas below), and writes
// the compute-precision copy of the new master (bf16 rounded to nearest even,
// or fp16) in the same pass. 28 bytes move per parameter both in fp32 mode
// (fp32 gradient, no copy) and in mixed mode (bf16 gradient in, bf16 copy
// out); the pass is meant to run at the memory bandwidth of the machine.
//
// Per element, in fp32, with every constant rounded once from float64
// (fma: one fused multiply-add, a single rounding):
//   g  = grad * grad_scale                   (plain Adam: g = fma(wd, p, g))
//   p  = p * (1 - lr * weight_decay)         (decoupled, AdamW)
//   m  = fma(1 - beta1, g, m * beta1)
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   p  = p + (-lr / (1 - beta1^t)) * m / fma(sqrt(v), 1 / sqrt(1 - beta2^t), eps)
// torch rounds after every multiply and divides sqrt(v) by sqrt(1 - beta2^t);
// the fused forms and the float64 reciprocal save work per element and stay
// within an ulp or so of it. Every path (scalar with std::fma, AVX2 and
// AVX-512; simd.h) uses exactly these operations in this order, so they give
// bitwise-identical results, for any number of threads.
//
// The copy is written with non-temporal stores (it is on its way to the
// device, and this saves reading each of its cache lines first), so it is not
// left in the CPU caches.
//
// Threads: the current TBB arena, one contiguous range per thread
// (for_each_static_range in simd.h). The arrays of one call must not overlap;
// calls on disjoint shards may run concurrently.
#pragma once

#include <cstdint>

#include "io/base/status.h"
#include "kernels/cpu/simd.h"

namespace strata::kernels::cpu {

struct AdamWHyperparams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;                    // t, 1 for the first update (bias corrections use it)
  bool decoupled_weight_decay = true;  // true: AdamW; false: Adam with L2 (g += wd * p)
  bool bias_correction = true;         // false: the 1 - beta^t terms are taken as 1
  double grad_scale = 1.0;             // gradients are multiplied by this first
};

// One shard: every array has `numel` elements and they do not overlap.
struct AdamWShard {
  int64_t numel = 0;
  float* master = nullptr;      // (numel) fp32 master weights, updated in place
  float* exp_avg = nullptr;     // (numel) first moment m, updated in place
  float* exp_avg_sq = nullptr;  // (numel) second moment v, updated in place
  const void* grad = nullptr;   // (numel) of grad_type, read only
  ElementType grad_type = ElementType::f32;
  void* copy = nullptr;  // (numel) of copy_type, written; nullptr: no copy (fp32 mode)
  ElementType copy_type = ElementType::bf16;  // bf16 or f16
};

// Runs one step on `shard` with the active SIMD level. Fails (touching
// nothing) on a missing array, a negative length, a copy of type fp32, a step
// below 1 or hyperparameters outside torch's accepted ranges.
Status adamw_step(const AdamWShard& shard, const AdamWHyperparams& hyper);

// Zeroes `data` (n floats) with the same range-to-thread mapping as
// adamw_step, so that fresh pages are first touched by the thread (and NUMA
// node) that will update them.
void first_touch_zero(float* data, int64_t n);

}  // namespace strata::kernels::cpu
