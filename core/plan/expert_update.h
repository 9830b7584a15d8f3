// Deferred expert updates (TrainingPlan::deferred_expert_updates;
// core/README.md, "Deferred expert updates"). Where a mixture's experts are
// read as routed (core/plan/expert_fetch.h), strata.expert_update deferred
// steps only part of a sparse MLP piece each step: its router and norm, and
// the experts its micro-batches' tokens reached. An expert no token reached
// has a zero gradient; its AdamW step (moments decay, weight decay, the
// bias-corrected update) waits, and the steps it missed are replayed, the
// same kernel on the same elements with the same decisions in the same
// order, before its parameters are next read (the forward that routes a
// token to it; at several ranks the share before that forward),
// checkpointed or exported. So the bits are those of the
// eager update, and an expert's state (on NVMe) or copy crosses the drive
// once per run of idle steps instead of once per step.
//
// With int8 moments an expert's step waits for the int8 blocks wholly
// inside it only (waiting_range): a block's scale is the largest of its 256
// elements, so a block shared with a neighbour is stepped every step with
// the router and norm, an idle expert's part of it with a zero gradient,
// as the eager update steps it. Blocks are independent, so the waiting
// blocks' replay gives the eager bits too. The scales stay in host memory.
//
// The unit of a transfer is a window: whole blocks of nvme_alignment
// elements (every piece, fp32 master, fp32, bf16 or int8 moments, the
// compute copy and the gradient, starts on the NVMe alignment), at most one
// optimizer chunk.
//  - Optimizer state on NVMe: a window's master, m, v and compute-precision
//    copy are read and written whole, so the elements of a neighbour that
//    share a block travel unchanged; on the optimizer's pass the gradient is
//    read with them when its home is NVMe (written by the reductions in the
//    same windows, gradient_windows).
//  - Optimizer state in host memory: the state is stepped where it lives and
//    only the copy's windows are written, filled from the master rounded to
//    the compute precision. That is the copy's every element as stored:
//    every parameter strata writes is its master rounded, at
//    initialisation, by the kernel's copy and on resume. Nothing is read.
// The plan's traffic counts a bound on any step: every expert replayed
// (each in its own windows where a step has several micro-batches:
// deferred_replay_bytes_per_op) at its unit's first forward and every
// element updated by its optimizer operation. ExpertUpdateLedger keeps which steps each expert
// waits on; deferred_step_nvme_bytes counts a step's bytes for its routing with the same ledger the
// engine keeps.
//
// Pure functions; the ledger is a value (not thread-safe: the engine guards it).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/plan/expert_fetch.h"
#include "core/plan/training_plan.h"

namespace strata {

// Whether the plan defers idle experts' updates, and the one line why or why
// not (TrainingPlan::expert_update_reason); empty for a dense model. `routed`:
// the plan reads experts as routed.
bool plan_defers_expert_updates(const PlanInput& input, bool routed, std::string& why);

// Unit u's idle experts wait: the plan defers and u routes its expert reads.
bool defers_expert_updates(const TrainingPlan& plan, int unit);

// Ranks: each rank steps its own shard of a unit (elements
// [optimizer_offset(u, rank), + optimizer_numel)), and the ranges and
// windows below are in that shard's elements, 0 at its start; at one rank
// the shard is the unit. The ranks join their routings (expert_fetch.h
// shares_routing), so every rank's ledger is the same and an expert cut
// by a shard boundary waits, and is replayed, on both ranks at once.
// Counts that take a `rank` of -1 are the most any one rank moves (at each
// operation, for the per-operation counts): a bound on every rank.

// The elements of expert `expert` (the layer's index: a piece of experts
// holds expert_blocks(...).first on) of unit u in `rank`'s shard whose step
// may wait: the expert's part in the shard; with int8 moments the
// 256-element int8 blocks wholly inside that part (a block's scale is the
// largest of its elements, so a block shared with a neighbour is stepped
// every step, with the part that never waits). Empty (begin == end) when
// no block is wholly inside.
ElementRange waiting_range(const TrainingPlan& plan, int unit, int64_t expert, int rank);

// Unit u's element ranges, in `rank`'s shard, of the `chosen` experts'
// waiting ranges ([E], != 0 chosen) and, with `with_rest`, of everything
// in the shard that never waits; sorted, neighbours joined.
std::vector<ElementRange> expert_update_ranges(const TrainingPlan& plan, int unit,
                                               const std::vector<uint8_t>& chosen, bool with_rest,
                                               int rank);

// The windows a ranged update of unit u reads and writes for `ranges` (of one rank's shard):
// each range widened to whole blocks of nvme_alignment elements, overlaps
// joined, cut at multiples of the optimizer chunk.
std::vector<ElementRange> update_windows(const TrainingPlan& plan, int unit,
                                         const std::vector<ElementRange>& ranges);

// Element windows as byte ranges of a shard of `element_bytes` per element.
std::vector<tiers::ByteRange> byte_windows(const std::vector<ElementRange>& windows,
                                           int64_t element_bytes);

// A deferring unit's gradient homed on NVMe moves in windows too: each
// micro-batch's sum is written in the windows of what is not an expert and
// of the experts `touched` ([E]) by the step's micro-batches so far, and read
// back in the previous micro-batch's; the rest of the stored gradient is
// stale, and its sum zero (the host buffer holds zeros there). The last
// micro-batch's windows are the optimizer's. Byte ranges of the fp32 shard.
bool moves_gradient_windows(const TrainingPlan& plan, int unit);
std::vector<tiers::ByteRange> gradient_windows(const TrainingPlan& plan, int unit,
                                               const std::vector<uint8_t>& touched, int rank);
// The experts of unit u that micro-batches 0..micro of `routing` reached.
std::vector<uint8_t> touched_through(const StepRouting& routing, int unit, int micro);

// The NVMe bytes of a ranged update over `windows`: with the optimizer
// state on NVMe, read and written alike (master, m, v and the separate
// compute copy), and the gradient's reads when `with_gradient` and its home
// is NVMe; with the state in host memory, the copy's writes alone.
struct WindowBytes {
  int64_t read = 0;
  int64_t written = 0;
};
WindowBytes window_bytes(const TrainingPlan& plan, const std::vector<ElementRange>& windows,
                         bool with_gradient);
// The worst case of a deferring unit's optimizer operation: every element's
// window (the compute copy in them; such a unit has no writeback).
WindowBytes worst_update_bytes(const TrainingPlan& plan, int unit, int rank = -1);

// One expert's missed steps: Adam's t of the first and last applied step it
// did not take (every applied step between them included).
struct DeferredSteps {
  int expert = 0;
  int64_t first = 0;
  int64_t last = 0;
};

// Which experts of which units wait, and since when.
class ExpertUpdateLedger {
 public:
  ExpertUpdateLedger() = default;
  explicit ExpertUpdateLedger(const TrainingPlan& plan);

  // A forward of `unit` routes tokens to `needed` ([E]): the experts among
  // them that wait, which must be replayed now; they wait no more.
  std::vector<DeferredSteps> take_due(int unit, const std::vector<uint8_t>& needed);
  // Every waiting expert of `unit` (a checkpoint, an export, a read of the weights).
  std::vector<DeferredSteps> take_all(int unit);
  // Applied step `step` updates `unit`: its experts not `active` ([E]) miss
  // it (a piece of experts': those of its group only).
  void defer_idle(int unit, const std::vector<uint8_t>& active, int64_t step);
  // The oldest step any expert waits on; 0 when none waits.
  int64_t oldest_waited() const;

 private:
  // [unit][expert]: the steps it missed, first 0 when none.
  std::vector<std::vector<DeferredSteps>> waiting_;
  // [unit]: the layer's experts it holds, [first, end) (expert_blocks).
  std::vector<std::pair<int64_t, int64_t>> experts_;
};

// One step of a plan that reads experts as routed, for its routing, per
// operation of plan.ops: what the step-time model costs a recorded step
// with (predict_step).
struct RoutedStep {
  // traffic_per_op's worst case with each computation's expert reads
  // `routing`'s and, where the plan defers, the deferring units' replays,
  // optimizer windows and gradient windows what `routing` replays, updates
  // and writes.
  std::vector<StepTraffic> traffic;
  // The elements AdamW steps, where the routing decides them: a deferring
  // unit's optimizer operation, its ranges' elements; a forward that
  // replays, each replayed expert's elements times the steps it missed; -1
  // elsewhere (the plan's own count).
  std::vector<int64_t> adamw_elements;
  // The gradient elements a reduce adds into the accumulator where only the
  // experts its micro-batch (or, summed on the GPU, micro-batches) reached
  // are added (sums_routed_gradients); -1 elsewhere (the whole unit).
  std::vector<int64_t> summed_elements;
};
// Advances `ledger` (the experts that waited before the step) past the step,
// taken as applied step `step` (Adam's t, so that replays count the steps
// each expert missed). `rank`'s bytes and elements; -1: at each operation
// the most any one rank's.
RoutedStep routed_step(const TrainingPlan& plan, const StepRouting& routing,
                       ExpertUpdateLedger& ledger, int64_t step, int rank = -1);

// The NVMe bytes one step of a plan that defers expert updates moves for its
// routing at `rank`: routed_step's traffic summed.
WindowBytes deferred_step_nvme_bytes(const TrainingPlan& plan, const StepRouting& routing,
                                     ExpertUpdateLedger& ledger, int rank = -1);

// A step's NVMe bytes, read and written, replayed from recorded routings in
// their order (deferred_step_nvme_bytes where the plan defers; else the
// plan's traffic with its routed parameter reads those of the routing), at
// several ranks the most any one rank moves in that step: what
// `strata plan --routing` prints beside the parameter reads.
struct RecordedStepBytes {
  int64_t steps = 0;
  int64_t read_mean = 0;  // rounded down
  int64_t written_mean = 0;
  int64_t read_most = 0;
  int64_t written_most = 0;
  int64_t worst_read = 0;  // the plan's worst step: traffic_per_step
  int64_t worst_written = 0;
};
RecordedStepBytes recorded_step_bytes(const TrainingPlan& plan,
                                      const std::vector<StepRouting>& steps);

// Per operation of plan.ops, the worst case of the replays: on the first
// operation that reads each deferring unit's experts in the step (its
// first forward; at several ranks, its first share), every expert, each
// in its own windows where a step has several micro-batches (experts
// replayed at two micro-batches move a block they share twice): a bound
// on a step's replays, all counted on that one operation. (A
// deferring unit's optimizer operation counts its worst case, every
// element, in its own bytes.)
std::vector<WindowBytes> deferred_replay_bytes_per_op(const TrainingPlan& plan, int rank = -1);
// The elements those worst-case replays step (every expert's waiting range,
// one missed step each) on the same operations; -1 elsewhere.
std::vector<int64_t> deferred_replay_elements_per_op(const TrainingPlan& plan, int rank = -1);
// The operation that replays a deferring unit's missed steps before its
// experts are read: a forward; at several ranks, a share.
bool replays_expert_updates(const TrainingPlan& plan, const PlanOp& op);

}  // namespace strata
