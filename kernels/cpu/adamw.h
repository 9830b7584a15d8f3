// Fused AdamW step over one contiguous shard of optimizer state.
//
// One pass reads the gradient (fp32, bf16 or fp16), multiplies it by
// `grad_scale` (1 / loss scale times the clipping coefficient, computed once
// by the caller), updates the fp32 master weights and the moments m and v in
// place with torch.optim.AdamW's arithmetic (the formulas below), and writes
// the compute-precision copy of the new master (bf16 rounded to nearest even,
// or fp16) in the same pass. The pass is meant to run at the memory bandwidth
// of the machine, so the bytes it moves per parameter are its cost:
//
//   moments (AdamWStateType)        fp32 grad, no copy   bf16 grad, bf16 copy
//   fp32 (AdamWShard or StateShard)        28                   28
//   bf16 (AdamWStateShard)                 20                   20
//   int8 (AdamWStateShard)                 16 + 1/16            16 + 1/16
// (int8: two fp32 scales read and written per 256 parameters). On a machine
// where the pass is bound by memory bandwidth these are its relative costs;
// benches/adamw_compare.py measures them against torch and DeepSpeed.
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
// Compact moments (AdamWStateShard). m and v are read in their stored form,
// widened to fp32 in registers, updated with the formulas above (the master
// step uses the new fp32 m and v, before they are rounded), and written back
// in their stored form; no fp32 copy of them exists in memory at any time
// (the int8 kernel holds one block of new m and sqrt(v) on the stack).
// - bf16: m and v are bf16, rounded to nearest even (as DeepSpeed's
//   fp32_optimizer_states: false). A property of the format, not of this
//   kernel: a bf16 v that only decays (v * beta2 with beta2 > 1 - 2^-9) rounds
//   back to itself, so v follows growth at once and decay only as far as new
//   g^2 pulls it.
// - int8: blocks of kAdamWInt8Block elements, counted from the first element
//   of the shard (the last block may be short), each with two fp32 scales.
//     m: int8 codes q in [-127, 127], scale a = max |m| over the block;
//        m = q * (a / 127); stored q = round(m * (127 / a)).
//     v: uint8 codes q in [0, 255] of sqrt(v), scale s = max sqrt(v) over the
//        block; v = (q * (s / 255))^2; stored q = round(sqrt(v) * (255 / s)),
//        except that a v > 0 rounding to code 0 is stored as code 1, so a
//        second moment is never read back as 0 while m is not (that would
//        turn m / (sqrt(v) + eps) into m / eps); it only shrinks that step.
//   round is to nearest, ties to even; a / 127, 127 / a, s / 255 and 255 / s
//   are fp32 divisions made once per block (127 / a and 255 / s are taken as 0
//   when the scale is below 2^-100, inf or NaN: an m block that small reads
//   back as 0, and no sqrt(v) of a v > 0 in fp32 is that small); a NaN
//   product gets code 0. The scales are exact maxima (NaN above everything,
//   so a NaN anywhere in a block makes the block's scale NaN and the block
//   reads back as NaN, as an fp32 state would show it). Linear codes
//   for m resolve it to 1/254 of the block's largest |m| (smaller values read
//   back as 0: that element does not move this step); sqrt codes for v keep
//   small second moments at the same relative resolution as m's step sizes.
//   A zero state (codes 0, scales 0) reads back as m = v = 0: step 0.
//   The blocks belong to the scales: every call on a state must start at the
//   same element (a shard split into pieces must be split at the same
//   places, each piece with its own scales, every step).
//
// The copy is written with non-temporal stores where it is 32-byte aligned
// (it is on its way to the device, and this saves reading each of its cache
// lines first), so it is not left in the CPU caches.
//
// Threads: the current TBB arena, one contiguous range per thread
// (for_each_static_range in simd.h). The arrays of one call must not overlap;
// calls on disjoint shards may run concurrently.
#pragma once

#include <cstdint>
#include <string_view>

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

// One shard of fp32 state: every array has `numel` elements and they do not overlap.
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

// --- moments in a chosen element type -------------------------------------------------

// How m and v are stored (the header comment gives the formats).
enum class AdamWStateType { f32, bf16, int8 };

// Elements per int8 block: one fp32 scale per block for m and one for v (1/32
// byte per parameter), and a block of new m and sqrt(v) fits in 2 KiB of stack.
inline constexpr int64_t kAdamWInt8Block = 256;

std::string_view adamw_state_type_name(AdamWStateType type);

// Scales per moment of an int8 shard of `numel` elements (0 for fp32, bf16).
int64_t adamw_state_scale_count(AdamWStateType type, int64_t numel);

// Bytes of m, v and their scales for `numel` elements (fp32: 8, bf16: 4, int8:
// 2 per element, plus 8 per block).
int64_t adamw_state_bytes(AdamWStateType type, int64_t numel);

// One shard whose moments are of `state_type`. Arrays of `numel` elements
// unless stated; none overlap.
struct AdamWStateShard {
  int64_t numel = 0;
  AdamWStateType state_type = AdamWStateType::bf16;
  float* master = nullptr;  // (numel) fp32 master weights, updated in place
  // (numel) m and v, updated in place: f32: float; bf16: uint16_t bits;
  // int8: int8_t codes for m, uint8_t codes of sqrt(v) for v.
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  // int8 only (nullptr otherwise), (adamw_state_scale_count(int8, numel)) each,
  // updated in place: max |m| and max sqrt(v) of each block.
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  const void* grad = nullptr;  // (numel) of grad_type, read only
  ElementType grad_type = ElementType::f32;
  void* copy = nullptr;                       // (numel) of copy_type, written; nullptr: no copy
  ElementType copy_type = ElementType::bf16;  // bf16 or f16
};

// Runs one step on `shard` with the active SIMD level (fp32 moments: exactly
// adamw_step on an AdamWShard of the same arrays). Fails (touching nothing) as
// adamw_step does, and on missing or unexpected scales.
Status adamw_step(const AdamWStateShard& shard, const AdamWHyperparams& hyper);

// Zeroes the moments and their scales of `shard` (the state before step 1)
// with the range-to-thread mapping of adamw_step; master, grad and copy are
// not touched.
void first_touch_zero(const AdamWStateShard& shard);

}  // namespace strata::kernels::cpu
