// The engine's routed expert reads (core/plan/expert_fetch.h): at one rank
// each forward and backward reads the experts its micro-batch needs that its
// gather has not; at several, `route` takes this rank's routing, `share`
// joins the ranks' and sends the experts the union reaches, each piece from
// the rank whose shard holds it. Where expert updates are deferred
// (expert_update.h), the forward, or at several ranks the share, first
// replays the missed steps of the experts it is about to read.
#include "core/engine/engine_impl.h"

namespace strata {

Status Engine::Impl::read_routed_experts(Rank& rank, const PlanOp& op,
                                         const ComputeParams& params) {
  const int u = op.unit, slot = params.gathered_slot;
  if (slot < 0) return Status::error("routed experts without a gathered copy (plan error)");
  std::vector<uint8_t>& needed = rank.routing[size_t(u)][size_t(op.micro)];
  if (shares_routing(plan, u)) {
    // Several ranks: the share before a forward, the gather before a
    // backward (its fetch read ahead) brought every expert of the union;
    // the computation takes what the share brought (here, on its lane).
    const std::vector<uint8_t>& loaded = rank.experts_loaded[size_t(slot)];
    for (size_t e = 0; e < needed.size(); ++e)
      if (needed[e] && (e >= loaded.size() || !loaded[e]))
        return Status::error(fmt::format(
            "{} of {} micro-batch {}: expert {} was routed to but not shared (plan error)",
            op_kind_name(op.kind), plan.layout.units[size_t(u)].unit.name, op.micro, e));
    std::vector<ElementRange> pieces = std::exchange(rank.shared_pieces[size_t(slot)], {});
    for (const ElementRange& piece : pieces) {
      Status s = rank.compute->take_gathered_range(u, slot, rank.gathered[size_t(slot)],
                                                   piece.begin, piece.end - piece.begin);
      if (!s) return s;
    }
    return Status::ok();
  }
  if (op.kind == OpKind::forward) {  // the backward reads what its forward routed
    Result<std::vector<uint8_t>> routed = rank.compute->routed_experts(u, op.micro, params);
    if (!routed) return routed.status();
    needed = std::move(*routed);
  }
  if (op.kind == OpKind::forward && defers_expert_updates(plan, u)) {
    // Experts whose steps wait take them before their parameters are read.
    // With the state in host memory the copy's windows are put together in
    // the gathered copy, which the read below then fills.
    std::lock_guard lock(rank.streamed_mutex);
    if (Status s = replay_deferred(rank, u, rank.deferred.take_due(u, needed),
                                   rank.gathered[size_t(slot)]);
        !s)
      return s;
  }
  if (Status s = check_expert_alignment(rank, u); !s) return s;
  const int64_t cb = plan.compute_bytes;
  const std::vector<tiers::ByteRange> ranges = expert_reads(
      plan, u, needed, rank.experts_loaded[size_t(slot)], rank.store->nvme_alignment());
  if (ranges.empty()) return Status::ok();
  std::byte* gathered = rank.gathered[size_t(slot)];
  if (Status s = rank.store->read_home_ranges({u, ShardKind::param}, ranges, gathered); !s)
    return s;
  for (const tiers::ByteRange& range : ranges) {
    Status s = rank.compute->take_gathered_range(u, slot, gathered, int64_t(range.offset) / cb,
                                                 int64_t(range.bytes) / cb);
    if (!s) return s;
  }
  return Status::ok();
}

Status Engine::Impl::check_expert_alignment(Rank& rank, int unit) const {
  const uint64_t alignment = rank.store->nvme_alignment();
  if (uint64_t(plan.units[size_t(unit)].param_numel * plan.compute_bytes) % alignment == 0)
    return Status::ok();
  return Status::error(fmt::format(
      "routed expert reads: {}'s parameter shard is not a whole number of {}-byte NVMe blocks; "
      "use --expert-fetch all",
      plan.layout.units[size_t(unit)].unit.name, alignment));
}

Status Engine::Impl::route(Rank& rank, StepRun& run, int op_index, const PlanOp& op) {
  const ComputeParams params = unit_params(rank, run, op_index, op.unit);
  if (params.data == nullptr) return Status::error("no parameters for the unit (plan error)");
  Result<std::vector<uint8_t>> routed = rank.compute->routed_experts(op.unit, op.micro, params);
  if (!routed) return routed.status();
  rank.routing[size_t(op.unit)][size_t(op.micro)] = std::move(*routed);
  return Status::ok();
}

Status Engine::Impl::share(Rank& rank, const PlanOp& op) {
  const int u = op.unit;
  int slot = -1;
  for (int d : op.deps)
    if (plan.ops[size_t(d)].kind == OpKind::gather) slot = plan.ops[size_t(d)].slot;
  if (slot < 0) return Status::error("a share without a gathered copy (plan error)");
  // The union of the ranks' routings: how many ranks reach each expert. A
  // rank whose step failed before its route sends what it holds; the step
  // fails anyway.
  const size_t E = size_t(plan.layout.config.num_experts);
  std::vector<uint8_t>& routing = rank.routing[size_t(u)][size_t(op.micro)];
  std::vector<float> reached(E, 0.0f);
  for (size_t e = 0; e < E && e < routing.size(); ++e) reached[e] = routing[e] ? 1.0f : 0.0f;
  if (Status s = rank.comm->all_reduce(reached.data(), reached.data(), E, comm::DataType::fp32); !s)
    return s;
  routing.assign(E, 0);
  for (size_t e = 0; e < E; ++e) routing[e] = reached[e] > 0.0f;
  // This rank's part of the experts not yet loaded, read into its place in
  // the gathered copy, then every piece sent by its owner. A failed read
  // still takes part in the broadcasts (with stale bytes).
  std::vector<uint8_t>& loaded = rank.experts_loaded[size_t(slot)];
  std::vector<uint8_t> read = loaded;
  const std::vector<ElementRange> pieces = expert_elements(plan, u, routing, loaded);
  std::byte* gathered = rank.gathered[size_t(slot)];
  const UnitPlacement& p = plan.units[size_t(u)];
  const int64_t cb = plan.compute_bytes;
  std::byte* own = gathered + int64_t(rank.rank) * p.shard_numel * cb;
  Status status = check_expert_alignment(rank, u);
  if (status && defers_expert_updates(plan, u)) {
    // Experts whose steps wait take them, each rank on its shard (every
    // rank's ledger is the same), before the read below brings them. With
    // the state in host memory the copy's windows are put together in this
    // rank's part of the gathered copy: the bytes already there, but for
    // the replayed experts', which nothing has read yet.
    std::lock_guard lock(rank.streamed_mutex);
    status = replay_deferred(rank, u, rank.deferred.take_due(u, routing), own);
  }
  if (status) {
    const std::vector<tiers::ByteRange> ranges = rank_ranges(
        plan, u, expert_reads(plan, u, routing, read, rank.store->nvme_alignment()), rank.rank);
    if (!ranges.empty()) status = rank.store->read_home_ranges({u, ShardKind::param}, ranges, own);
  }
  if (Status s = broadcast_pieces(rank, u, gathered, nullptr, pieces); status && !s) status = s;
  if (!status) return status;
  std::vector<ElementRange>& untaken = rank.shared_pieces[size_t(slot)];
  untaken.insert(untaken.end(), pieces.begin(), pieces.end());
  return Status::ok();
}

Status Engine::Impl::broadcast_pieces(Rank& rank, int unit, std::byte* gathered,
                                      const std::byte* own,
                                      const std::vector<ElementRange>& pieces) {
  const int64_t S = plan.units[size_t(unit)].shard_numel, cb = plan.compute_bytes;
  const comm::DataType type = cb == 4 ? comm::DataType::fp32 : comm::DataType::bf16;
  Status status = Status::ok();
  for (const ElementRange& piece : pieces) {
    for (int64_t at = piece.begin; at < piece.end;) {
      const int owner = int(at / S);
      const int64_t end = std::min(piece.end, int64_t(owner + 1) * S);
      std::byte* place = gathered + at * cb;
      if (owner == rank.rank && own != nullptr)
        std::memcpy(place, own + (at - int64_t(owner) * S) * cb, size_t((end - at) * cb));
      Status sent = rank.comm->broadcast(place, size_t(end - at), type, owner);
      if (status && !sent) status = sent;
      at = end;
    }
  }
  return status;
}

}  // namespace strata
