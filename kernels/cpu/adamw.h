// Fused AdamW step over one shard of optimizer state (an AdamWShard,
// kernels/cpu/adamw_shard.h).
//
// One pass reads the gradient (fp32, bf16 or fp16), multiplies it by
// `grad_scale` (1 / loss scale times the clipping coefficient, computed once
// by the caller), updates the fp32 master weights and the moments m and v in
// place with torch.optim.AdamW's arithmetic (the formulas below), and writes
// the compute-precision copy of the new master (bf16 rounded to nearest even,
// or fp16) in the same pass. A shard of several parameter groups is one such
// pass per run (adamw_shard.h, compact_runs). The pass is meant to run at the
// memory bandwidth of the machine, so the bytes it moves per parameter are
// its cost:
//
//   moments (state_type)   fp32 grad, no copy   bf16 grad, bf16 copy
//   fp32                          28                   28
//   bf16                          20                   20
//   int8                          16 + 1/16            16 + 1/16
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
// Compact moments (state_type bf16 or int8). m and v are read in their
// stored form, widened to fp32 in registers, updated with the formulas above
// (the master step uses the new fp32 m and v, before they are rounded), and
// written back in their stored form; no fp32 copy of them exists in memory at
// any time (the int8 kernel holds one block of new m and sqrt(v) on the stack).
// - bf16: m and v are bf16, rounded to nearest even (as DeepSpeed's
//   fp32_optimizer_states: false). A property of the format, not of this
//   kernel: a bf16 v that only decays (v * beta2 with beta2 > 1 - 2^-9) rounds
//   back to itself, so v follows growth at once and decay only as far as new
//   g^2 pulls it.
// - int8: blocks of kAdamWInt8Block elements, counted from the first element
//   of each run (the last block may be short; adamw_shard.h: a shard's blocks
//   are its windows cut at segment ends), each with two fp32 scales.
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
#include "kernels/cpu/adamw_shard.h"

namespace strata::kernels::cpu {

// Runs one step on `shard` with the active SIMD level, one pass per run of
// its segments, each with its group's hyperparameters (group_hyperparams).
// Fails (touching nothing) on a missing array, a negative length, missing or
// unexpected scales, a copy of type fp32, segments that do not cover the
// shard, a step below 1 or hyperparameters outside torch's accepted ranges.
Status adamw_step(const AdamWShard& shard, const AdamWHyperparams& hyper);

// Zeroes `data` (n floats) with the same range-to-thread mapping as
// adamw_step, so that fresh pages are first touched by the thread (and NUMA
// node) that will update them.
void first_touch_zero(float* data, int64_t n);

// Zeroes the moments and their scales of `shard` (the state before step 1),
// each run with the range-to-thread mapping adamw_step gives it; master,
// grad and copy are not touched. Fails (touching nothing) on segments that do
// not cover the shard.
Status first_touch_zero(const AdamWShard& shard);

// --- the moments' formats ---------------------------------------------------------------

std::string_view adamw_state_type_name(AdamWStateType type);

// Scales per moment of an int8 run of `numel` elements (0 for fp32, bf16).
int64_t adamw_state_scale_count(AdamWStateType type, int64_t numel);

// Bytes of m, v and their scales for `numel` elements (fp32: 8, bf16: 4, int8:
// 2 per element, plus 8 per block).
int64_t adamw_state_bytes(AdamWStateType type, int64_t numel);

}  // namespace strata::kernels::cpu
