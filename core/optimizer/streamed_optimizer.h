// StreamedOptimizer: the AdamW step over optimizer state that lives on NVMe
// (or in host memory), through the tiers' streamed pass (tiers/streamed_pass.h).
// It is the one chunk loop of strata: the engine's optimizer operation over
// NVMe-homed state runs it one unit at a time.
// Tiers move bytes; this file says which bytes make an AdamW chunk and hands
// the optimizer driver's update (core/optimizer/optimizer.h) to the pass as its work.
//
// Layout: for every unit, the store holds shards (unit, master), (unit, m) and
// (unit, v), each numel * 4 bytes of fp32, homed on NVMe or host (in fp32
// mode the master may be the (unit, param) shard itself: master_kind). step() walks
// the units in the order given, each in chunks of at most chunk_elements
// elements (kOptimizerChunkElements of core/plan/plan_input.h, lowered by sub_group_size):
// chunk k+1 is read while chunk k is updated and chunk k-1 written back. The
// gradient and the compute-precision copy are host arrays the caller owns
// (the gradient is read only; the copy, when given, is written).
//
// Compact m and v (state_type bf16 or int8, kernels/cpu/adamw.h): the m and v
// shards hold numel elements as stored (bf16, or int8 codes) and a chunk's
// pieces are that many bytes; int8 block scales are host arrays the caller
// owns (StreamedOptimizerUnit::shard); since chunks start at multiples of
// 4096 elements, a chunk's blocks are a contiguous run of the unit's.
//
// Host memory: buffer_count buffers of chunk_elements * (4 + 2 x the moment's
// bytes, + 4 when the gradients come from the store, + copy_bytes) bytes (12
// for fp32 state), charged to
// the host tier at create() (the planner's host staging for the streamed
// optimizer). Completion: step() returns once every updated chunk is written
// back; on an error the message names the unit, chunk and shard, and chunks
// not reached are untouched. Not thread-safe: one step() at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/optimizer/optimizer.h"
#include "core/plan/expert_update.h"
#include "core/plan/plan_input.h"
#include "io/base/status.h"
#include "kernels/cpu/adamw_shard.h"
#include "tiers/streamed_pass.h"
#include "tiers/tiered_store.h"

namespace strata {

struct StreamedOptimizerOptions {
  int64_t chunk_elements = kOptimizerChunkElements;  // a multiple of 1024
  unsigned buffer_count = 4;                         // offload_optimizer.buffer_count
  // How m and v are stored; compact formats need chunk_elements a multiple of 4096.
  kernels::cpu::AdamWStateType state_type = kernels::cpu::AdamWStateType::f32;
  // The gradients are (unit, grad) shards homed on NVMe, read with each chunk.
  bool grads_in_store = false;
  // Bytes per element of the compute-precision copy that ranged updates
  // (step_ranges) carry as a piece of their windows; 0 when they carry none.
  int64_t copy_bytes = 0;
};

// Some elements of a unit and the decisions they take, in order (a ranged
// update, step_ranges).
struct RangeUpdate {
  ElementRange elements;
  std::vector<StepDecision> decisions;
};

// One unit's update as the step sees it: which unit, its shard update and
// where the stored pieces are. The shard's master, exp_avg and exp_avg_sq are
// not used (the step brings them chunk by chunk from the store's shards
// (unit, master_kind), (unit, m), (unit, v)); the rest is host memory the
// caller owns: grad (unused with grads_in_store), the copy (bf16/fp16
// rounded by the kernel, f32 copied; written as each chunk is updated), the
// int8 block scales. Its state_type must be the options' (step() refuses
// another).
struct StreamedOptimizerUnit {
  int unit = 0;
  kernels::cpu::AdamWShard shard;
  // The shard holding the fp32 master: `master`, or `param` where the fp32
  // parameters are the master.
  tiers::ShardKind master_kind = tiers::ShardKind::master;
  // grads_in_store: instead of shard.grad, fp32 elements [grad_offset,
  // grad_offset + numel) of shard (unit, grad), read (not written back) with
  // each chunk.
  int64_t grad_offset = 0;
};

// Elements [begin, end) of `shard` (its master, moments, gradient and copy
// in host memory, each from element 0; int8 scales, the shard's whole run)
// take `decisions` in order, with the shard's gradient, or with a zero one
// when `zero_gradient` (a replay of missed steps). step_ranges applies it to
// each window; the engine applies it to state that lives in host memory.
// int8 moments are stepped in whole blocks (a block's scale is the largest
// of its elements): `begin` must be a multiple of 256 and `end` one or the
// shard's end, so the range's blocks are the shard's; else an error.
Status update_elements(const Optimizer& optimizer, const kernels::cpu::AdamWShard& shard,
                       int64_t begin, int64_t end, std::span<const StepDecision> decisions,
                       bool zero_gradient);

class StreamedOptimizer {
 public:
  static Result<std::unique_ptr<StreamedOptimizer>> create(tiers::TieredStore& store,
                                                           StreamedOptimizerOptions options);

  // Adds (unit, master), (unit, m), (unit, v) of numel fp32 elements, homed in `home`.
  static Status add_unit_state(tiers::TieredStore& store, int unit, int64_t numel,
                               tiers::Tier home);

  // Host bytes create() takes from the host tier.
  static uint64_t host_buffer_bytes(const StreamedOptimizerOptions& options);

  // One optimizer step (nothing when !decision.apply).
  // `next`: the units of the step() expected after this one; once this one's
  // last chunk is updated, their first chunks' master, m and v start being
  // read (as many as there are buffers) while this one's write-backs finish,
  // and that step() takes them as read (StreamedPass::prefetch). Only for
  // state nothing else writes before then; the gradient, when in the store,
  // is read by that step() itself.
  Status step(const Optimizer& optimizer, const StepDecision& decision,
              std::span<const StreamedOptimizerUnit> units,
              std::span<const StreamedOptimizerUnit> next = {});

  // A ranged update of one unit (deferred expert updates,
  // core/plan/expert_update.h): the pass visits `windows` (whole blocks of
  // the I/O alignment, each within one chunk: update_windows) and each of
  // `ranges` (inside the windows) takes its decisions in order, with the
  // unit's gradient (the shard's, or the store's read with the window), or
  // with a zero gradient when `zero_gradient` (a replay of missed steps).
  // With options' copy_bytes, the unit's (unit, param) shard is a read and
  // written piece of each window and the copy is written into it; elements
  // of a window outside every range are written back as they were read.
  // int8 state: windows start on a 256-element block, ranges are whole
  // blocks (update_elements); the scales are the shard's, in host memory.
  Status step_ranges(const Optimizer& optimizer, const StreamedOptimizerUnit& unit,
                     std::span<const ElementRange> windows, std::span<const RangeUpdate> ranges,
                     bool zero_gradient);

  const tiers::StreamedPassStats& last_step() const { return pass_->last_run(); }
  // The pass and its buffers, for other chunked walks over the same shards
  // (checkpoints read NVMe homes through it between steps).
  tiers::StreamedPass& pass() { return *pass_; }

 private:
  StreamedOptimizer(StreamedOptimizerOptions options, std::unique_ptr<tiers::StreamedPass> pass)
      : options_(options), pass_(std::move(pass)) {}
  // Where one chunk sits: unit index in the step's list, first element, count.
  struct Chunk {
    size_t unit = 0;
    int64_t begin = 0;
    int64_t numel = 0;
  };
  // The pass's items for `units`, chunk by chunk (at most max_items): master,
  // m, v, and the gradient when `grads` and it is in the store.
  void chunk_items(std::span<const StreamedOptimizerUnit> units, bool grads,
                   std::vector<Chunk>* chunks, std::vector<tiers::StreamItem>* items,
                   size_t max_items) const;

  StreamedOptimizerOptions options_;
  std::unique_ptr<tiers::StreamedPass> pass_;
};

}  // namespace strata
