// The operations of a training plan: one step of one rank walked in a serial
// order that every lane can follow, with each operation's dependencies and
// bytes (core/plan/training_plan.h); the bytes each link moves are
// plan_traffic.cpp's.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "comm/communicator.h"
#include "core/plan/expert_fetch.h"
#include "core/plan/expert_update.h"
#include "core/plan/training_plan_parts.h"
#include "io/base/sizes.h"

namespace strata {
namespace {

using tiers::Tier;

PlanOp make_op(OpKind kind, Lane lane, int unit = -1, int micro = -1, int slot = -1) {
  PlanOp op;
  op.kind = kind;
  op.lane = lane;
  op.unit = unit;
  op.micro = micro;
  op.slot = slot;
  return op;
}

// Builds the op list by walking one step in a serial order that is also a
// valid order for every lane: gathers are emitted as early as their buffer
// allows, fetches as early as theirs, reductions right after their backward.
class PlanBuilder {
 public:
  explicit PlanBuilder(TrainingPlan& plan)
      : plan_(plan),
        in_(plan.input),
        units_(static_cast<int>(plan.layout.units.size())),
        head_(units_ - 1),
        tied_(plan.layout.config.tie_word_embeddings),
        stage3_(plan.input.stage == 3),
        early_(plan.input.optimizer_during_backward),
        writeback_(plan.homes.param == Tier::nvme && plan.homes.separate_master),
        comm_lane_(plan.input.overlap_comm ? Lane::comm : Lane::compute) {}

  void build() {
    list_compute_and_uses();
    if (early_) decide_index_ = add(make_op(OpKind::decide, Lane::optimizer));
    update_done_.assign(size_t(units_), -1);
    last_reduce_.assign(size_t(units_), -1);
    if (stage3_ && in_.offload_param == OffloadDevice::nvme) emit_fetches();
    for (size_t c = 0; c < compute_.size(); ++c) emit_compute(c);
    emit_exchange_and_updates();
    count_traffic();
  }

 private:
  // A compute operation of the step, and the gathered units it reads.
  struct ComputeUse {
    OpKind kind;
    int unit;
    int micro;
    std::vector<int> units;
  };
  // A gathered-buffer use: one unit over a run of consecutive compute
  // operations that read it (one gather serves them all); use i takes slot
  // i % gather_slots.
  struct Use {
    int unit;
    size_t first, last;  // compute operations
  };

  // The compute operations in schedule order. Micro-batch-major: per
  // micro-batch, forward of every unit (the head's forward and backward are
  // one pass), then backward of the layers and the embedding in reverse.
  // Layer-major: each unit's forward over every micro-batch, the head over
  // every micro-batch, then each unit's backward over every micro-batch in
  // reverse. Either way a unit's micro-batches reach it in order, so its
  // gradient sums in the same order.
  void list_compute() {
    const int G = int(in_.grad_accum);
    const std::vector<int> head_units =
        tied_ ? std::vector<int>{0, head_} : std::vector<int>{head_};
    if (plan_.layer_major()) {
      for (int u = 0; u < head_; ++u)
        for (int m = 0; m < G; ++m) compute_.push_back({OpKind::forward, u, m, {u}});
      for (int m = 0; m < G; ++m) compute_.push_back({OpKind::forward, head_, m, head_units});
      for (int u = head_ - 1; u >= 0; --u)
        for (int m = 0; m < G; ++m) compute_.push_back({OpKind::backward, u, m, {u}});
      return;
    }
    for (int m = 0; m < G; ++m) {
      for (int u = 0; u < head_; ++u) compute_.push_back({OpKind::forward, u, m, {u}});
      compute_.push_back({OpKind::forward, head_, m, head_units});
      for (int u = head_ - 1; u >= 0; --u) compute_.push_back({OpKind::backward, u, m, {u}});
    }
  }

  void list_compute_and_uses() {
    list_compute();
    // A unit read by consecutive compute operations is gathered once for all of them.
    std::vector<int> open(plan_.units.size(), -1);  // the unit's latest use
    compute_uses_.resize(compute_.size());
    for (size_t c = 0; c < compute_.size(); ++c) {
      for (int u : compute_[c].units) {
        int& latest = open[size_t(u)];
        if (latest >= 0 && uses_[size_t(latest)].last + 1 == c) {
          uses_[size_t(latest)].last = c;
        } else {
          uses_.push_back({u, c, c});
          latest = int(uses_.size()) - 1;
        }
        compute_uses_[c].push_back(size_t(latest));
      }
    }
    gather_op_.assign(uses_.size(), -1);
    fetch_op_.assign(uses_.size(), -1);
    release_op_.assign(uses_.size(), -1);
    compute_op_.assign(compute_.size(), -1);
    forward_of_.assign(size_t(in_.grad_accum), std::vector<size_t>(plan_.units.size(), 0));
    for (size_t c = 0; c < compute_.size(); ++c)
      if (compute_[c].kind == OpKind::forward)
        forward_of_[size_t(compute_[c].micro)][size_t(compute_[c].unit)] = c;
    // The previous use of the same unit: its host copy must be gone before the
    // next fetch of that shard (a shard has one copy per tier).
    previous_use_.assign(uses_.size(), -1);
    std::vector<int> last(plan_.units.size(), -1);
    for (size_t i = 0; i < uses_.size(); ++i) {
      previous_use_[i] = last[size_t(uses_[i].unit)];
      last[size_t(uses_[i].unit)] = int(i);
    }
  }

  bool fetch_ready(size_t i) const {
    const int P = plan_.fetch_slots;
    if (int(i) >= P && gather_op_[i - size_t(P)] < 0) return false;  // its slot is still taken
    // Reads ahead: a routed backward's fetch waits for its forwards (below).
    if (routes_expert_reads(plan_, uses_[i].unit) && !forwards_emitted(uses_[i])) return false;
    return previous_use_[i] < 0 || gather_op_[size_t(previous_use_[i])] >= 0;
  }

  // fetch(i) needs the host copy that gather(i - P) released.
  void emit_fetches() {
    const int P = plan_.fetch_slots;
    while (next_fetch_ < uses_.size() && fetch_ready(next_fetch_)) {
      const size_t i = next_fetch_++;
      PlanOp op = make_op(OpKind::fetch, Lane::io, uses_[i].unit, compute_[uses_[i].first].micro,
                          int(i % size_t(P)));
      if (int(i) >= P) op.deps.push_back(gather_op_[i - size_t(P)]);
      if (previous_use_[i] >= 0) op.deps.push_back(gather_op_[size_t(previous_use_[i])]);
      op.bytes = plan_.units[size_t(uses_[i].unit)].param_numel * plan_.compute_bytes;
      if (routes_expert_reads(plan_, uses_[i].unit)) {  // the rest when routed (expert_fetch.h)
        read_ahead(uses_[i], op.deps);
        op.bytes = fetched_ahead_bytes(uses_[i].unit);
      }
      fetch_op_[i] = add(std::move(op));
    }
  }

  // What a routed unit's fetch reads of the rest (fetched_ahead): at several
  // ranks the fewest any rank reads of its shard (expert_fetch.h counts the
  // others' more as routed reads).
  int64_t fetched_ahead_bytes(int unit) const {
    const std::vector<tiers::ByteRange> rest =
        fetched_ahead(plan_, unit, plan_.input.nvme_alignment);
    int64_t fewest = rank_bytes(plan_, unit, rest, 0);
    for (int r = 1; r < in_.world_size; ++r)
      fewest = std::min(fewest, rank_bytes(plan_, unit, rest, r));
    return fewest;
  }

  // Reads ahead (expert_fetch.h): a routed backward use's fetch is emitted
  // once its forwards are (fetch_ready) and depends on them, to read their
  // experts with the rest. Later fetches wait behind it: fetches go in use
  // order.
  bool forwards_emitted(const Use& use) const {
    for (size_t c = use.first; c <= use.last; ++c) {
      if (compute_[c].kind != OpKind::backward) return true;
      if (compute_op_[forward_of_[size_t(compute_[c].micro)][size_t(use.unit)]] < 0) return false;
    }
    return true;
  }
  void read_ahead(const Use& use, std::vector<int>& deps) const {
    for (size_t c = use.first; c <= use.last; ++c) {
      if (compute_[c].kind != OpKind::backward) return;
      deps.push_back(compute_op_[forward_of_[size_t(compute_[c].micro)][size_t(use.unit)]]);
    }
  }

  // gather(i) reuses the slot of use i - K, free once that use's last compute op released it.
  // `through`: at most up to that use (a routed forward's, emit_compute).
  void emit_gathers_before(size_t c, size_t through = SIZE_MAX) {
    const int K = plan_.gather_slots;
    while (next_gather_ < uses_.size() && next_gather_ <= through) {
      const size_t i = next_gather_;
      if (int(i) >= K && uses_[i - size_t(K)].last >= c) break;
      PlanOp op = make_op(OpKind::gather, comm_lane_, uses_[i].unit, compute_[uses_[i].first].micro,
                          int(i % size_t(K)));
      if (int(i) >= K) op.deps.push_back(release_op_[i - size_t(K)]);
      if (fetch_op_[i] >= 0) op.deps.push_back(fetch_op_[i]);
      op.bytes = plan_.units[size_t(uses_[i].unit)].shard_numel * plan_.compute_bytes *
                 (in_.world_size - 1);
      if (shares_routing(plan_, uses_[i].unit)) {
        // What the fetches read goes (Engine::gather): the rest, and for a
        // backward's every expert at worst (read ahead).
        std::vector<ElementRange> pieces = fetched_elements(plan_, uses_[i].unit);
        if (compute_[uses_[i].first].kind == OpKind::backward)
          pieces.push_back(every_expert(uses_[i].unit));
        op.bytes = most_sent(uses_[i].unit, pieces);
      }
      gather_op_[i] = add(std::move(op));
      ++next_gather_;
      if (in_.offload_param == OffloadDevice::nvme) emit_fetches();
    }
  }

  // optimizer(u) and, for NVMe parameter homes, writeback(u); returns the last.
  int emit_update(int u, std::vector<int> deps) {
    PlanOp optimizer = make_op(OpKind::optimizer, Lane::optimizer, u);
    optimizer.deps = std::move(deps);
    const int64_t n = plan_.units[size_t(u)].optimizer_numel;
    if (defers_expert_updates(plan_, u)) {
      // Deferred expert updates (expert_update.h): the worst case, every
      // element's window, with the compute copy written in it (and read,
      // with the state on NVMe) instead of a writeback.
      const WindowBytes bytes = worst_update_bytes(plan_, u);
      optimizer.bytes = bytes.read + bytes.written;
      return add(std::move(optimizer));
    }
    // Read and written: the fp32 master, m and v as stored, chunk by chunk,
    // each piece rounded to the I/O alignment (int8's last piece may be short).
    if (plan_.homes.optimizer == Tier::nvme) {
      const int64_t chunk = plan_.optimizer_chunk_elements;
      const int64_t alignment = int64_t(in_.nvme_alignment);
      for (int64_t at = 0; at < n; at += chunk) {
        const int64_t piece = std::min(chunk, n - at);
        optimizer.bytes += 2 * (round_up(piece * 4, alignment) +
                                2 * round_up(piece * plan_.moment_bytes(), alignment));
      }
    }
    int last = add(std::move(optimizer));
    if (writeback_) {
      PlanOp write = make_op(OpKind::writeback, Lane::optimizer, u);
      write.deps.push_back(last);
      write.bytes = plan_.units[size_t(u)].param_numel * plan_.compute_bytes;
      last = add(std::move(write));
    }
    return last;
  }

  // Compute operation c with its gathers before it, its release and its reduction after it.
  void emit_compute(size_t c) {
    const ComputeUse& cu = compute_[c];
    // A routed forward at several ranks: its share goes on the collectives'
    // lane right after its own gather, and the next uses' gathers after the
    // share of its use's last forward, so no share waits for a later
    // unit's fetch.
    const bool shares = cu.kind == OpKind::forward && shares_routing(plan_, cu.unit);
    size_t own = 0;
    for (size_t i : compute_uses_[c]) own = std::max(own, i);
    if (stage3_) emit_gathers_before(c, shares ? own : SIZE_MAX);
    PlanOp op = make_op(cu.kind, Lane::compute, cu.unit, cu.micro);
    if (stage3_) {
      for (size_t i : compute_uses_[c]) op.deps.push_back(gather_op_[i]);
    }
    // Gradient buffers: the head and every backward fill one; a tied
    // embedding's lives from the head to the embedding's reduce.
    const bool fills_grad = cu.kind == OpKind::backward || cu.unit == head_;
    const bool uses_rotating_grad = fills_grad && !(tied_ && cu.unit == 0);
    if (uses_rotating_grad) {
      op.slot = grad_use_ % plan_.grad_slots;
      if (grad_use_ >= plan_.grad_slots)
        op.deps.push_back(reduce_of_grad_use_[size_t(grad_use_ - plan_.grad_slots)]);
    }
    // One tied embedding gradient buffer: the next micro-batch's head waits
    // for the embedding's reduce (layer-major keeps one per micro-batch).
    if (tied_ && cu.unit == head_ && cu.micro > 0 && !plan_.layer_major())
      op.deps.push_back(last_reduce_[0]);
    // Spilled inputs (TrainingPlan::activations_spilled): the forward of
    // unit u writes level u over level u - 2, which must be out first; a
    // backward reads level u - 1, which must be back.
    if (cu.kind == OpKind::forward && cu.unit < head_ && plan_.spills(cu.unit - 2))
      op.deps.push_back(spill_op_[level_index(cu.unit - 2, cu.micro)]);
    if (cu.kind == OpKind::backward && plan_.spills(cu.unit - 1))
      op.deps.push_back(restore_op_[level_index(cu.unit - 1, cu.micro)]);
    if (shares) {
      emit_route_and_share(op, uses_[own].first == c);
      if (uses_[own].last == c) emit_gathers_before(c);
    }
    compute_op_[c] = add(std::move(op));
    if (stage3_ && in_.offload_param == OffloadDevice::nvme) emit_fetches();  // reads ahead
    emit_spill_or_restore(c);
    if (stage3_) {
      // The uses that end here give their slots back.
      int release_index = -1;
      for (size_t i : compute_uses_[c]) {
        if (uses_[i].last != c) continue;
        if (release_index < 0) {
          PlanOp release = make_op(OpKind::release, Lane::compute, cu.unit, cu.micro);
          release.deps.push_back(compute_op_[c]);
          release_index = add(std::move(release));
        }
        release_op_[i] = release_index;
      }
    }
    if (fills_grad) emit_reduce(c, uses_rotating_grad);
  }

  // Several ranks reading experts as routed (expert_fetch.h): before the
  // forward, its routing on the compute lane (with the forward's
  // dependencies), then the ranks' routings joined and the experts sent, on
  // the collectives' lane; the forward waits for both. Worst case: the
  // all-reduce of E numbers, and at the use's first forward every expert
  // sent by its owner (the later ones find them loaded).
  void emit_route_and_share(PlanOp& forward, bool first_of_use) {
    PlanOp route = forward;
    route.kind = OpKind::route;
    const int route_index = add(std::move(route));
    PlanOp share = make_op(OpKind::share, comm_lane_, forward.unit, forward.micro);
    share.deps.push_back(route_index);
    for (int d : forward.deps)
      if (plan_.ops[size_t(d)].kind == OpKind::gather) share.deps.push_back(d);
    share.bytes = first_of_use ? most_sent(forward.unit, {every_expert(forward.unit)}) : 0;
    uint64_t joined = 0;  // the all-reduce of E counts, at the rank that sends the most
    for (int r = 0; r < in_.world_size; ++r)
      joined = std::max(joined, comm::bytes_sent_by(comm::CollectiveKind::all_reduce,
                                                    size_t(plan_.layout.config.num_experts),
                                                    comm::DataType::fp32, in_.world_size, r));
    share.bytes += int64_t(joined);
    forward.deps.push_back(add(std::move(share)));
  }

  ElementRange every_expert(int unit) const {
    const ExpertBlocks experts = expert_blocks(plan_.layout, unit);
    return {experts.offset, experts.offset + experts.count * experts.numel};
  }

  // The bytes the rank owning the most of `pieces` sends of them to the others.
  int64_t most_sent(int unit, const std::vector<ElementRange>& pieces) const {
    const int64_t S = plan_.units[size_t(unit)].shard_numel;
    int64_t most = 0;
    for (int r = 0; r < in_.world_size; ++r) {
      int64_t owned = 0;
      for (const ElementRange& piece : pieces)
        owned += std::max<int64_t>(
            0, std::min(piece.end, (r + 1) * S) - std::max(piece.begin, int64_t(r) * S));
      most = std::max(most, owned);
    }
    return most * plan_.compute_bytes * (in_.world_size - 1);
  }

  size_t level_index(int level, int micro) const {
    return size_t(level) * size_t(in_.grad_accum) + size_t(micro);
  }

  // After compute operation c: the spill of the level a forward produced,
  // or the restore of the level whose slot a backward (or the head) has
  // just read for the last time: level k + 2 shares level k's slot, and its
  // last reader is the backward of unit k + 3, or the head for the last level.
  void emit_spill_or_restore(size_t c) {
    if (plan_.spilled_levels() == 0) return;
    const ComputeUse& cu = compute_[c];
    const int64_t bytes = plan_.saved_input_transfer_bytes();
    if (spill_op_.empty()) {
      spill_op_.assign(level_index(plan_.spilled_levels(), 0), -1);
      restore_op_.assign(spill_op_.size(), -1);
    }
    if (cu.kind == OpKind::forward && plan_.shares_spill(cu.unit)) {
      // Its input's spill holds its bytes: the restore reads that copy.
      spill_op_[level_index(cu.unit, cu.micro)] = spill_op_[level_index(cu.unit - 1, cu.micro)];
      return;
    }
    if (cu.kind == OpKind::forward && cu.unit < head_ && plan_.spills(cu.unit)) {
      PlanOp spill = make_op(OpKind::spill, Lane::activations, cu.unit, cu.micro,
                             plan_.saved_input_place(cu.unit, cu.micro).copy);
      spill.deps.push_back(compute_op_[c]);
      spill.bytes = bytes;
      spill_op_[level_index(cu.unit, cu.micro)] = add(std::move(spill));
      return;
    }
    const int freed = cu.kind == OpKind::backward ? cu.unit - 3 : cu.unit == head_ ? head_ - 3 : -1;
    if (!plan_.spills(freed)) return;
    PlanOp restore = make_op(OpKind::restore, Lane::activations, freed, cu.micro,
                             plan_.saved_input_place(freed, cu.micro).copy);
    restore.deps.push_back(compute_op_[c]);
    restore.deps.push_back(spill_op_[level_index(freed, cu.micro)]);
    restore.bytes = bytes;
    restore_op_[level_index(freed, cu.micro)] = add(std::move(restore));
  }

  void emit_reduce(size_t c, bool uses_rotating_grad) {
    const ComputeUse& cu = compute_[c];
    PlanOp reduce = make_op(OpKind::reduce, comm_lane_, cu.unit, cu.micro,
                            uses_rotating_grad ? grad_use_ % plan_.grad_slots : -1);
    reduce.deps.push_back(compute_op_[c]);
    if (last_reduce_[size_t(cu.unit)] >= 0) reduce.deps.push_back(last_reduce_[size_t(cu.unit)]);
    const UnitPlacement& p = plan_.units[size_t(cu.unit)];
    const bool scatter = in_.stage >= 2 && in_.reduce_scatter;
    // Reduce-scatter sends (W-1)/W of the unit, all-reduce twice that; summed
    // once per step, only the last micro-batch's reduce sends (the sum).
    const bool sends = !plan_.grads_summed_per_step() || cu.micro == in_.grad_accum - 1;
    reduce.bytes = sends ? p.shard_numel * (in_.reduce_in_bf16 ? 2 : 4) * (in_.world_size - 1) *
                               (scatter ? 1 : 2)
                         : 0;
    const int index = add(std::move(reduce));
    last_reduce_[size_t(cu.unit)] = index;
    if (uses_rotating_grad) {
      reduce_of_grad_use_.push_back(index);
      ++grad_use_;
    }
    if (early_ && cu.micro == in_.grad_accum - 1) {
      update_done_[size_t(cu.unit)] = emit_update(cu.unit, {decide_index_, index});
      update_order_.push_back(cu.unit);
    }
  }

  // The exchange of norms and losses, the updates (unless they ran during
  // backward) and, at stages 1-2, the all-gathers of the updated parameters.
  void emit_exchange_and_updates() {
    PlanOp exchange = make_op(OpKind::exchange, comm_lane_);
    // An all-gather of TrainingPlan::exchange_values, doubles sent as fp32 pairs.
    exchange.bytes = plan_.exchange_values() * 8 * (in_.world_size - 1);
    for (int u = 0; u < units_; ++u) exchange.deps.push_back(last_reduce_[size_t(u)]);
    // With the updates during backward the step's decision (its learning
    // rate, whether it applies) came from `decide`: the step is over, and
    // its result read, once the exchange is, so the decision must be in by then.
    if (early_) exchange.deps.push_back(decide_index_);
    const int exchange_index = add(std::move(exchange));
    if (!early_) {
      for (int u = 0; u < units_; ++u) {
        update_done_[size_t(u)] = emit_update(u, {exchange_index});
        update_order_.push_back(u);
      }
    }
    if (in_.stage == 1 || in_.stage == 2) {
      for (int u : update_order_) {
        PlanOp sync = make_op(OpKind::sync, comm_lane_, u);
        sync.deps.push_back(update_done_[size_t(u)]);
        sync.bytes =
            plan_.units[size_t(u)].shard_numel * plan_.compute_bytes * (in_.world_size - 1);
        add(std::move(sync));
      }
    }
  }

  // The bytes every link moves in one step: NVMe and the collectives from the
  // operations' bytes; on the CUDA backend, PCIe from the data paths of
  // core/engine/gpu_rank.h (a gathered unit goes up once per use, unless the
  // use is only the embedding's backward, which reads no parameters).
  void count_traffic() { plan_.traffic_per_step = total_traffic(traffic_per_op(plan_)); }

  int add(PlanOp op) {
    plan_.ops.push_back(std::move(op));
    return static_cast<int>(plan_.ops.size()) - 1;
  }

  TrainingPlan& plan_;
  const PlanInput& in_;
  const int units_, head_;
  const bool tied_, stage3_, early_, writeback_;
  const Lane comm_lane_;
  std::vector<ComputeUse> compute_;
  std::vector<Use> uses_;
  std::vector<std::vector<size_t>> compute_uses_;                      // per compute op: its uses
  std::vector<int> gather_op_, fetch_op_, release_op_, previous_use_;  // per use
  std::vector<int> compute_op_;                                        // per compute op
  std::vector<std::vector<size_t>> forward_of_;  // [micro][unit]: its forward's compute op
  std::vector<int> spill_op_, restore_op_;  // per spilled level and micro-batch (level_index)
  size_t next_gather_ = 0, next_fetch_ = 0;
  int decide_index_ = -1;
  int grad_use_ = 0;
  std::vector<int> reduce_of_grad_use_, last_reduce_, update_done_, update_order_;
};

}  // namespace

void build_plan_operations(TrainingPlan& plan) {
  PlanBuilder(plan).build();
}

}  // namespace strata
