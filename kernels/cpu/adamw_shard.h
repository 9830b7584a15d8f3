// AdamWShard: one AdamW update of one shard of optimizer state, the one
// description of it from the optimizer (core/optimizer/optimizer.h) through
// the engine's computes down to both kernels (kernels/cpu/adamw.h,
// kernels/cuda/adamw.h), which take it as it is.
//
// A shard is `numel` elements: the fp32 master, the moments m (exp_avg) and
// v (exp_avg_sq) as `state_type` stores them, int8 block scales when they are
// int8, the gradient, the compute-precision copy written in the same pass,
// and the parameter groups (`segments`) over [0, numel). Every pointer is
// memory the kernel that runs it can reach (host memory for the CPU kernel,
// device memory for the CUDA kernel); the caller owns them all.
//
// Parameter groups: weight decay applies to group `decay` only. Both kernels
// run a shard as the runs compact_runs() cuts it into (a run is one group;
// int8 runs have whole blocks of their own), each run a kernel pass with the
// step's hyperparameters for its group (group_hyperparams); so the CPU and
// the GPU step the same shard in the same pieces.
//
// int8 blocks: the 256-element windows of the shard counted from its element
// 0, cut where a segment ends (a block has one parameter group), in order;
// exp_avg_scale and exp_avg_sq_scale hold int8_block_count(segments, numel)
// scales each. A shard cut at multiples of 256 (a streamed chunk) has the
// same blocks as the whole, so its scales are a contiguous run of the whole's.
//
// Plain values and pure functions: thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "io/base/status.h"
#include "kernels/cpu/simd.h"

namespace strata::kernels::cpu {

struct AdamWHyperparams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;           // of group `decay`; group `no_decay` takes none
  int64_t step = 1;                    // t, 1 for the first update (bias corrections use it)
  bool decoupled_weight_decay = true;  // true: AdamW; false: Adam with L2 (g += wd * p)
  bool bias_correction = true;         // false: the 1 - beta^t terms are taken as 1
  double grad_scale = 1.0;             // gradients are multiplied by this first
};

// How m and v are stored (kernels/cpu/adamw.h gives the formats).
enum class AdamWStateType { f32, bf16, int8 };

// Elements per int8 block: one fp32 scale per block for m and one for v (1/32
// byte per parameter), and a block of new m and sqrt(v) fits in 2 KiB of stack.
inline constexpr int64_t kAdamWInt8Block = 256;

// The Hugging Face Trainer's grouping (core/optimizer/optimizer.h
// param_group_for_shape): weight decay on 2-D tensors only.
enum class ParamGroup { decay, no_decay };

// Elements [begin, end) of a shard belong to one parameter group.
struct ShardSegment {
  int64_t begin = 0;
  int64_t end = 0;
  ParamGroup group = ParamGroup::decay;
};

// Arrays of `numel` elements unless stated; none overlap.
struct AdamWShard {
  int64_t numel = 0;
  AdamWStateType state_type = AdamWStateType::f32;
  float* master = nullptr;  // (numel) fp32 master weights, updated in place
  // (numel) m and v, updated in place: f32: float; bf16: uint16_t bits;
  // int8: int8_t codes for m, uint8_t codes of sqrt(v) for v.
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  // int8 only (nullptr otherwise), (int8_block_count(segments, numel)) each,
  // updated in place: max |m| and max sqrt(v) of each block.
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  const void* grad = nullptr;  // (numel) of grad_type, read only
  ElementType grad_type = ElementType::f32;
  // (numel) of copy_type, written: the new master in compute precision;
  // nullptr: no copy. The kernels write bf16 or fp16 in their pass and
  // refuse f32; above them (Optimizer::update_shard, GpuRank::adamw) an f32
  // copy is the new master copied there after the kernel.
  void* copy = nullptr;
  ElementType copy_type = ElementType::bf16;
  // Ordered, non-overlapping and covering [0, numel) exactly; empty: the
  // whole shard is in group `decay`.
  std::span<const ShardSegment> segments;
};

// The int8 blocks of a shard of `numel` elements with these segments (empty: one).
int64_t int8_block_count(std::span<const ShardSegment> segments, int64_t numel);

// One kernel pass's part of a shard: elements [begin, end) of group `group`,
// its int8 scales from block `block` of the shard's (0 otherwise).
struct CompactRun {
  int64_t begin = 0, end = 0;
  ParamGroup group = ParamGroup::decay;
  int64_t block = 0;
};

// The runs of a shard of `numel` elements of `type` with these segments, in
// order: per segment; an int8 segment starting inside a 256-element window
// first takes the rest of that window, one block, then the windows from the
// next multiple of 256. Fails on segments that do not cover [0, numel) in
// order.
Result<std::vector<CompactRun>> compact_runs(std::span<const ShardSegment> segments, int64_t numel,
                                             AdamWStateType type);

// Run `run` of `shard` as a shard of its own (one group, no segments).
AdamWShard run_of(const AdamWShard& shard, const CompactRun& run);

// The hyperparameters of a run of group `group`: `hyper`, without weight
// decay for group `no_decay`.
AdamWHyperparams group_hyperparams(const AdamWHyperparams& hyper, ParamGroup group);

}  // namespace strata::kernels::cpu
