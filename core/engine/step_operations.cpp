#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include "core/engine/engine_impl.h"

namespace strata {

namespace {

// Elements [begin, end) of accumulate_one_rank_sum, eight at a time: the
// same IEEE additions per element, so the same bits as one at a time.
// `accumulator` may be `unreduced` when `first`.
void accumulate_one_rank_sum_range(float* accumulator, const float* unreduced, int64_t begin,
                                   int64_t end, bool first) {
  using Lanes = float __attribute__((vector_size(32)));
  const Lanes zero = {};
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    Lanes x, acc;
    std::memcpy(&x, unreduced + i, sizeof x);
    if (first) {
      acc = zero + x;
    } else {
      std::memcpy(&acc, accumulator + i, sizeof acc);
      acc += zero + x;
    }
    std::memcpy(accumulator + i, &acc, sizeof acc);
  }
  for (; i < end; ++i)
    accumulator[i] = first ? 0.0f + unreduced[i] : accumulator[i] + (0.0f + unreduced[i]);
}

// The sum over one rank, as the collectives of a group of threads compute it
// (comm/reduction.h: every element is 0.0f + x, which turns -0 into +0), folded
// into the accumulation's own pass: accumulator = 0.0f + x on the first
// micro-batch, accumulator + (0.0f + x) after, the same bits as reducing in
// place and then accumulating. Ranges of up to 2^18 elements (1 MiB): a pass
// this short is not worth waking many threads that the compute lane is using.
void accumulate_one_rank_sum(float* accumulator, const float* unreduced, int64_t numel,
                             bool first) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, numel, int64_t{1} << 18),
                    [&](const tbb::blocked_range<int64_t>& range) {
                      accumulate_one_rank_sum_range(accumulator, unreduced, range.begin(),
                                                    range.end(), first);
                    });
}

// The same sum where only `ranges` (sorted, within [0, numel)) of
// `unreduced` may be other than +0: a routed unit's gradient outside the
// experts its micro-batch reached (expert_update_ranges), which its backward
// never touched in the zeroed slot. Elsewhere accumulator + (0.0f + +0) is
// the accumulator, bit for bit (it is never -0: 0.0f + x is not, and a
// rounded-to-nearest sum is -0 only of two -0), so those elements are
// skipped, or set to +0 (0.0f + +0) on the first micro-batch.
void accumulate_one_rank_sum_in(float* accumulator, const float* unreduced, int64_t numel,
                                const std::vector<ElementRange>& ranges, bool first) {
  int64_t at = 0;
  auto zero_until = [&](int64_t end) {
    if (first && end > at) std::fill(accumulator + at, accumulator + end, 0.0f);
  };
  for (const ElementRange& r : ranges) {
    const int64_t begin = std::min(r.begin, numel), end = std::min(r.end, numel);
    zero_until(begin);
    accumulate_one_rank_sum(accumulator + begin, unreduced + begin, end - begin, first);
    at = std::max(at, end);
  }
  zero_until(numel);
}

// The same sum in place, where the accumulation is not a pass over host memory.
void one_rank_sum_in_place(float* values, int64_t numel) {
  accumulate_one_rank_sum(values, values, numel, true);
}

}  // namespace

// --- operations, one function per kind -------------------------------------------

Status Engine::Impl::gather(Rank& rank, const PlanOp& op) {
  // Units computed in place need no copy (at stage 3: one rank, on the GPU).
  if (params_in_place()) return Status::ok();
  const UnitPlacement& p = plan.units[size_t(op.unit)];
  const ShardKey key{op.unit, ShardKind::param};
  const bool fetched = plan.homes.param == tiers::Tier::nvme;
  std::byte* target = rank.gathered[size_t(op.slot)];
  Status status = Status::ok();
  const std::byte* source = nullptr;
  if (fetched) {
    Result<tiers::ShardView> view = rank.store->wait(key, tiers::Tier::host);
    // A failed load still takes part in the collective (with stale bytes), so
    // the other ranks are not left waiting; the step then fails.
    if (view)
      source = view->data;
    else
      status = view.status();
  } else if (plan.homes.param == tiers::Tier::device) {
    // Where the host cannot read the device tier, the shard comes to its
    // place in the gathered buffer and gathers in place.
    std::byte* own = target + int64_t(rank.rank) * p.shard_numel * plan.compute_bytes;
    Result<const std::byte*> readable = rank.compute->readable_on_host(
        home_data(rank, key), own, p.shard_numel * plan.compute_bytes);
    if (readable)
      source = *readable;
    else
      status = readable.status();
  } else {
    source = home_data(rank, key);
  }
  if (source == nullptr) source = target;
  std::vector<uint8_t> loaded;
  if (routes_expert_reads(plan, op.unit)) {  // the experts its fetch read ahead are in
    loaded.assign(size_t(plan.layout.config.num_experts), 0);
    for (int d : op.deps)
      if (plan.ops[size_t(d)].kind == OpKind::fetch && plan.ops[size_t(d)].unit == op.unit)
        loaded = experts_read_ahead(plan, d, &rank.routing);
  }
  Status gathered = Status::ok();
  if (shares_routing(plan, op.unit)) {
    // Several ranks (expert_fetch.h): only what the fetches read moves, the
    // rest and the experts read ahead, each piece from its owner.
    std::vector<ElementRange> pieces = fetched_elements(plan, op.unit);
    std::vector<uint8_t> none(loaded.size(), 0);
    for (const ElementRange& piece : expert_elements(plan, op.unit, loaded, none))
      pieces.push_back(piece);
    std::sort(pieces.begin(), pieces.end(),
              [](const ElementRange& a, const ElementRange& b) { return a.begin < b.begin; });
    gathered = broadcast_pieces(rank, op.unit, target, status ? source : nullptr, pieces);
  } else {
    const comm::DataType type =
        plan.compute_bytes == 4 ? comm::DataType::fp32 : comm::DataType::bf16;
    gathered = rank.comm->all_gather(source, target, size_t(p.shard_numel), type);
  }
  // What is loaded follows from the joined routing alone: every rank marks
  // it, failed or not, so that the shares after a failure (collectives,
  // which still run) send the same pieces on every rank.
  if (!loaded.empty()) rank.experts_loaded[size_t(op.slot)] = std::move(loaded);
  rank.shared_pieces[size_t(op.slot)].clear();  // the whole copy is taken below
  if (status && !gathered) status = gathered;
  if (fetched && status) status = rank.store->release(key, tiers::Tier::host);
  if (!status) return status;
  return rank.compute->take_gathered(op.unit, op.slot, target);
}

ComputeParams Engine::Impl::unit_params(Rank& rank, StepRun& run, int op_index, int unit) {
  if (params_in_place()) {
    wait_params(run.index, rank, unit);
    return {home_data(rank, {unit, ShardKind::param}), -1};
  }
  for (int d : plan.ops[size_t(op_index)].deps) {
    const PlanOp& dep = plan.ops[size_t(d)];
    if (dep.kind == OpKind::gather && dep.unit == unit)
      return {rank.gathered[size_t(dep.slot)], dep.slot};
  }
  return {};
}

GradTarget Engine::Impl::grad_target(Rank& rank, const PlanOp& op) {
  const int u = op.unit;
  const bool tied_model = plan.layout.config.tie_word_embeddings;
  const bool tied_head = tied_model && u == units() - 1;
  GradTarget target;
  if (plan.gpu_grads_in_place()) {
    target.grads = grad_home(rank, u);
    target.tied = tied_head ? grad_home(rank, 0) : nullptr;
    // A tied embedding's gradient was zeroed by the head, which added the lm_head's.
    target.zero_first = op.micro == 0 && !(u == 0 && tied_model);
    return target;
  }
  target.slot = grad_slot(op);
  // Slot -1: the tied embedding's buffer, which holds the lm_head's gradient already.
  float* tied = tied_model ? rank.tied_grads[size_t(plan.activation_copy(op.micro))] : nullptr;
  target.grads = op.slot >= 0 ? rank.grad_slots[size_t(op.slot)] : tied;
  target.tied = tied_head ? tied : nullptr;
  target.zero_first = op.slot >= 0;
  if (plan.gpu_grads_summed_on_device()) {
    target.sum_on_device = true;
    target.sum_first = op.micro == 0;
    target.send = op.micro == plan.input.grad_accum - 1;
  }
  return target;
}

Status Engine::Impl::forward(Rank& rank, StepRun& run, int op_index, const PlanOp& op) {
  const int u = op.unit;
  const ComputeParams params = unit_params(rank, run, op_index, u);
  if (params.data == nullptr) return Status::error("no parameters for the unit (plan error)");
  if (routes_expert_reads(plan, u)) {
    if (Status s = read_routed_experts(rank, op, params); !s) return s;
  }
  const UnitBatch batch = batch_of(rank, run, op.micro);
  if (u != units() - 1) return rank.compute->forward(u, op.micro, params, batch);
  ComputeParams tied;
  if (plan.layout.config.tie_word_embeddings) {
    tied = unit_params(rank, run, op_index, 0);
    if (tied.data == nullptr) return Status::error("no embedding for the tied head (plan error)");
  }
  Result<double> loss = rank.compute->head(op.micro, params, tied, batch, grad_target(rank, op));
  if (!loss) return loss.status();
  if (!std::isfinite(*loss) && plan.input.precision == Precision::fp32)
    return Status::error(
        fmt::format("the loss is {} (micro-batch {}); lower the learning rate or check the data",
                    *loss, op.micro));
  rank.micro_loss[size_t(op.micro)] = *loss;
  // Every sparse layer of the micro-batch has run its forward: its load-balancing loss is known.
  if (batch.router != nullptr) rank.micro_aux[size_t(op.micro)] = batch.router->aux_loss();
  return Status::ok();
}

Status Engine::Impl::backward(Rank& rank, StepRun& run, int op_index, const PlanOp& op) {
  const int u = op.unit;
  const ComputeParams params = unit_params(rank, run, op_index, u);
  if (params.data == nullptr) return Status::error("no parameters for the unit (plan error)");
  if (routes_expert_reads(plan, u)) {
    if (Status s = read_routed_experts(rank, op, params); !s) return s;
  }
  return rank.compute->backward(u, op.micro, params, batch_of(rank, run, op.micro),
                                plan.recomputes(u), grad_target(rank, op));
}

Status Engine::Impl::reduce(Rank& rank, const PlanOp& op) {
  // One rank with its gradients in place on the GPU has nothing to reduce:
  // they accumulated in their home.
  // Summed on the GPU, the gradient comes down once, after the last micro-batch.
  const bool last = op.micro == plan.input.grad_accum - 1;
  if (!plan.gpu_grads_in_place() && (last || !plan.gpu_grads_summed_on_device())) {
    if (Status s = reduce_and_accumulate(rank, op); !s) return s;
  }
  if (!last) return Status::ok();
  // On NVMe the norm was taken before the sum was written (accumulate_gradient).
  if (plan.homes.grad == tiers::Tier::nvme) return Status::ok();
  // This rank's slice of the final gradient, the same elements at every stage.
  const int u = op.unit;
  const UnitPlacement& p = plan.units[size_t(u)];
  const int64_t from = p.grad_numel == p.padded_numel ? int64_t(rank.rank) * p.shard_numel : 0;
  Result<kernels::cpu::GradNormPartial> partial =
      plan.homes.grad_bf16
          ? kernels::cpu::grad_norm_squared(home_data(rank, {u, ShardKind::grad}) + from * 2,
                                            ElementType::bf16, p.shard_numel)
          : rank.compute->grad_norm(plan.homes.grad, grad_home(rank, u) + from, p.shard_numel);
  if (!partial) return partial.status();
  rank.partials[size_t(u)] = *partial;
  return Status::ok();
}

Status Engine::Impl::reduce_and_accumulate(Rank& rank, const PlanOp& op) {
  const int u = op.unit;
  const UnitPlacement& p = plan.units[size_t(u)];
  const int r = rank.rank;
  // A gradient that failed to arrive still takes part in the collective (with
  // stale bytes), so the other ranks are not left waiting; the step then fails.
  const Status arrived = rank.compute->gradients_ready(grad_slot(op));
  float* buffer = op.slot >= 0 ? rank.grad_slots[size_t(op.slot)]
                               : rank.tied_grads[size_t(plan.activation_copy(op.micro))];
  const bool summed_on_device = plan.gpu_grads_summed_on_device();
  const bool first = op.micro == 0 || summed_on_device;
  if (world() == 1 && !process_mode() && !plan.input.reduce_in_bf16) {
    // One rank of a thread group: its all-reduce would be a pass of 0.0f + x
    // and a copy back. The same sum is taken in the accumulation's pass instead.
    if (!arrived) return arrived;
    const int64_t count = plan.input.stage >= 2 ? p.shard_numel : p.padded_numel;
    const bool host_memory = !plan.input.gpu || plan.homes.grad != tiers::Tier::device;
    if (host_memory && !plan.homes.grad_bf16 && plan.homes.grad != tiers::Tier::nvme) {
      if (sums_routed_gradients(plan, u)) {
        // Zero but where the buffer's micro-batches sent tokens: this one's,
        // or every one's so far when the GPU summed them.
        const std::vector<uint8_t> reached = summed_on_device
                                                 ? touched_through(rank.routing, u, op.micro)
                                                 : rank.routing[size_t(u)][size_t(op.micro)];
        accumulate_one_rank_sum_in(grad_home(rank, u), buffer, count,
                                   expert_update_ranges(plan, u, reached, true, r), first);
        return Status::ok();
      }
      accumulate_one_rank_sum(grad_home(rank, u), buffer, count, first);
      return Status::ok();
    }
    one_rank_sum_in_place(buffer, p.padded_numel);
    return accumulate_gradient(rank, u, buffer, count, op.micro, first);
  }
  const int64_t padded = p.padded_numel;
  if (options.gradient_observer && !summed_on_device)
    options.gradient_observer({r, u, op.micro, false, buffer, padded});
  if (plan.host_grads_summed()) {
    // Layer-major: the unit's micro-batch gradients add up here in
    // micro-batch order (sum = g0, sum + g1, ...) and the sum is reduced
    // once, after the last, straight into the accumulator.
    if (op.micro < plan.input.grad_accum - 1) {
      if (!arrived) return arrived;  // no collective to take part in
      return accumulate_on_host(rank.grad_sum, buffer, padded, op.micro == 0);
    }
    // The last still takes part in the collective if its gradient failed.
    // (buffer + sum: IEEE addition is commutative, the bits of sum + g.)
    if (arrived) {
      if (Status s = accumulate_on_host(buffer, rank.grad_sum, padded, false); !s) return s;
    }
  }
  const bool into_home_first = first || plan.host_grads_summed();
  const int stage = plan.input.stage;
  const bool scatter = stage >= 2 && plan.input.reduce_scatter && world() > 1;
  // Stages 2-3 keep their part of the full sum; stages 0-1 keep all of it.
  const int64_t count = stage >= 2 ? p.shard_numel : p.padded_numel;
  const int64_t kept_from = stage >= 2 && !scatter ? int64_t(r) * p.shard_numel : 0;
  float* reduced = scatter ? rank.reduce_out : buffer + kept_from;
  if (plan.input.reduce_in_bf16) {
    // Narrowed in place (element i's two bytes land at or below where its
    // fp32 was read, so a forward pass is safe), reduced in bf16 (summed in
    // fp32, rounded once), widened back into the fp32 buffer it came from.
    auto* bits = reinterpret_cast<uint16_t*>(buffer);
    for (int64_t i = 0; i < p.padded_numel; ++i) bits[i] = kernels::cpu::float_to_bf16(buffer[i]);
    auto* out_bits = scatter ? reinterpret_cast<uint16_t*>(rank.reduce_out) : bits;
    Status status =
        scatter
            ? rank.comm->reduce_scatter(bits, out_bits, size_t(p.shard_numel), comm::DataType::bf16)
            : rank.comm->all_reduce(bits, bits, size_t(p.padded_numel), comm::DataType::bf16);
    if (!arrived) return arrived;
    if (!status) return status;
    // Widen backwards so no bf16 value is overwritten before it is read.
    const uint16_t* kept = out_bits + kept_from;
    for (int64_t i = count - 1; i >= 0; --i) reduced[i] = kernels::cpu::bf16_to_float(kept[i]);
  } else {
    Status status = scatter ? rank.comm->reduce_scatter(buffer, rank.reduce_out,
                                                        size_t(p.shard_numel), comm::DataType::fp32)
                            : rank.comm->all_reduce(buffer, buffer, size_t(p.padded_numel),
                                                    comm::DataType::fp32);
    if (!arrived) return arrived;
    if (!status) return status;
  }
  if (options.gradient_observer) options.gradient_observer({r, u, op.micro, true, reduced, count});
  // Summed before the reduction (on the GPU or here), the one sum that
  // arrives is the first.
  return accumulate_gradient(rank, u, reduced, count, op.micro, into_home_first);
}

Status Engine::Impl::accumulate_gradient(Rank& rank, int u, float* reduced, int64_t count,
                                         int micro, bool first) {
  const ShardKey key{u, ShardKind::grad};
  if (plan.homes.grad_bf16) {
    // Each micro-batch's sum is taken in fp32 and rounded once to bf16 (to
    // nearest even): acc = bf16(float(acc) + reduced).
    auto* acc = reinterpret_cast<uint16_t*>(home_data(rank, key));
    for (int64_t i = 0; i < count; ++i)
      acc[i] = kernels::cpu::float_to_bf16(
          first ? reduced[i] : kernels::cpu::bf16_to_float(acc[i]) + reduced[i]);
    return Status::ok();
  }
  if (plan.homes.grad != tiers::Tier::nvme)
    return rank.compute->accumulate(plan.homes.grad, grad_home(rank, u), reduced, count, first);
  const bool last = micro == plan.input.grad_accum - 1;
  if (plan.layer_major() && plan.input.grad_accum > 1 && !(first && last)) {
    // Layer-major: the unit's micro-batches come one after another, so the
    // sum (acc + reduced, as in memory) stays in host memory until the last.
    if (first) {
      std::memcpy(rank.grad_staging, reduced, size_t(count) * 4);
    } else if (Status s = accumulate_on_host(rank.grad_staging, reduced, count, false); !s) {
      return s;
    }
    if (!last) return Status::ok();
    std::memcpy(reduced, rank.grad_staging, size_t(count) * 4);
    first = true;  // nothing stored to read back
  }
  // NVMe: the sum so far is read back and added to (acc + reduced, as in
  // memory), then written; the last micro-batch's sum is final: its norm first.
  // A deferring unit's moves in the windows of the experts touched so far
  // (expert_update.h): elsewhere the sum is zero.
  const bool windows = moves_gradient_windows(plan, u);
  const std::span<std::byte> bytes(reinterpret_cast<std::byte*>(reduced), size_t(count) * 4);
  if (!first) {
    const std::span<std::byte> stored(reinterpret_cast<std::byte*>(rank.grad_staging),
                                      size_t(count) * 4);
    if (windows) {
      std::memset(stored.data(), 0, stored.size());
      if (Status s = rank.store->read_home_ranges(
              key,
              gradient_windows(plan, u, touched_through(rank.routing, u, micro - 1), rank.rank),
              stored.data());
          !s)
        return s;
    } else if (Status s = rank.store->read_shard(key, stored); !s) {
      return s;
    }
    if (Status s = accumulate_on_host(rank.grad_staging, reduced, count, false); !s) return s;
    std::memcpy(reduced, rank.grad_staging, size_t(count) * 4);
  }
  if (micro == plan.input.grad_accum - 1) {
    const UnitPlacement& p = plan.units[size_t(u)];
    const int64_t from = p.grad_numel == p.padded_numel ? int64_t(rank.rank) * p.shard_numel : 0;
    Result<kernels::cpu::GradNormPartial> partial =
        grad_norm_on_host(reduced + from, p.shard_numel);
    if (!partial) return partial.status();
    rank.partials[size_t(u)] = *partial;
  }
  if (!windows) return rank.store->write_shard(key, bytes);
  if (reinterpret_cast<uintptr_t>(reduced) % rank.store->nvme_alignment() != 0)
    return Status::error("a gradient written in windows is not NVMe-aligned (plan error)");
  return rank.store->write_home_ranges(
      key, gradient_windows(plan, u, touched_through(rank.routing, u, micro), rank.rank),
      bytes.data());
}

Status Engine::Impl::exchange(Rank& rank, StepRun& run) {
  const int U = units();
  const int G = int(plan.input.grad_accum);
  const int W = world();
  // Per rank: U norm partials, U non-finite flags, G loss sums (and a
  // mixture's G load-balancing losses), as doubles.
  const bool moe = plan.layout.config.is_moe();
  const size_t per_rank = size_t(plan.exchange_values());
  std::vector<double> send(per_rank), all(per_rank * size_t(W));
  for (int u = 0; u < U; ++u) {
    send[size_t(u)] = rank.partials[size_t(u)].sum_squares;
    send[size_t(U + u)] = rank.partials[size_t(u)].nonfinite ? 1.0 : 0.0;
  }
  for (int m = 0; m < G; ++m) send[size_t(2 * U + m)] = rank.micro_loss[size_t(m)];
  if (moe)
    for (int m = 0; m < G; ++m) send[size_t(2 * U + G + m)] = rank.micro_aux[size_t(m)];
  // Doubles travel as pairs of fp32 words: a gather copies, it does not add.
  if (Status s = rank.comm->all_gather(send.data(), all.data(), per_rank * 2, comm::DataType::fp32);
      !s)
    return s;
  kernels::cpu::GradNormPartial global;
  for (int u = 0; u < U; ++u) {
    for (int r = 0; r < W; ++r) {
      const double* theirs = all.data() + size_t(r) * per_rank;
      global.add({theirs[u], theirs[U + u] != 0.0});
    }
  }
  double loss = 0, aux = 0;
  for (int m = 0; m < G; ++m)
    for (int r = 0; r < W; ++r) loss += all[size_t(r) * per_rank + size_t(2 * U + m)];
  if (moe)
    for (int m = 0; m < G; ++m)
      for (int r = 0; r < W; ++r) aux += all[size_t(r) * per_rank + size_t(2 * U + G + m)];
  if (global.nonfinite && plan.input.precision == Precision::fp32) {
    std::string where;
    for (int r = 0; r < W; ++r)
      for (int u = 0; u < U; ++u)
        if (all[size_t(r) * per_rank + size_t(U + u)] != 0.0 &&
            where.find(plan.layout.units[size_t(u)].unit.name) == std::string::npos)
          where += (where.empty() ? "" : ", ") + plan.layout.units[size_t(u)].unit.name;
    return Status::error(
        fmt::format("the gradients hold inf or NaN (in {}); the step failed and the run cannot go "
                    "on. Lower the learning rate, "
                    "enable gradient_clipping, or check the data",
                    where));
  }
  if (plan.input.optimizer_during_backward) {
    // `decide` ran at the start of the step; the norm is for the report.
    std::lock_guard lock(run.mutex);
    run.loss_sum[size_t(rank.rank)] = loss;
    run.aux_sum[size_t(rank.rank)] = aux;
    run.grad_norm[size_t(rank.rank)] = std::sqrt(global.sum_squares);
    return Status::ok();
  }
  Result<StepDecision> decision = rank.optimizer->begin_step(global);
  if (!decision) return decision.status();
  std::lock_guard lock(run.mutex);
  run.decisions[size_t(rank.rank)] = *decision;
  run.loss_sum[size_t(rank.rank)] = loss;
  run.aux_sum[size_t(rank.rank)] = aux;
  run.grad_norm[size_t(rank.rank)] = decision->grad_norm;
  return Status::ok();
}

Status Engine::Impl::optimize(Rank& rank, StepRun& run, const PlanOp& op) {
  StepDecision decision;
  {
    std::lock_guard lock(run.mutex);
    decision = run.decisions[size_t(rank.rank)];
  }
  if (!decision.apply) return Status::ok();
  const int u = op.unit;
  if (plan.input.optimizer_during_backward && rank.partials[size_t(u)].nonfinite)
    return Status::error(fmt::format(
        "the gradients of {} hold inf or NaN; it was not updated. Lower the learning rate, enable "
        "gradient_clipping, or check the data",
        plan.layout.units[size_t(u)].unit.name));
  const UnitPlacement& p = plan.units[size_t(u)];
  const int cb = plan.compute_bytes;
  const int64_t offset = plan.optimizer_offset(u, rank.rank);
  const ShardKey master_key{u, plan.homes.separate_master ? ShardKind::master : ShardKind::param};
  // In fp32 the parameters may be the master: then the update is already in them.
  const int64_t master_offset = plan.homes.separate_master || plan.input.stage == 3 ? 0 : offset;
  const int64_t param_offset = plan.input.stage == 3 ? 0 : offset;
  std::byte* param_home = plan.homes.param == tiers::Tier::nvme
                              ? nullptr
                              : home_data(rank, {u, ShardKind::param}) + param_offset * cb;

  UnitUpdate update;
  update.optimizer = &*rank.optimizer;
  update.decision = decision;
  kernels::cpu::AdamWShard& shard = update.shard;
  shard.numel = p.optimizer_numel;
  shard.segments = rank.segments[size_t(u)];
  const int64_t grad_offset = p.grad_numel == p.padded_numel ? offset : 0;
  shard.grad_type = plan.homes.grad_bf16 ? ElementType::bf16 : ElementType::f32;
  // On NVMe the streamed optimizer reads the gradient with its chunks.
  if (plan.homes.grad != tiers::Tier::nvme)
    shard.grad = home_data(rank, {u, ShardKind::grad}) +
                 grad_offset * int64_t(kernels::cpu::element_size(shard.grad_type));
  shard.copy_type = compute_type();
  shard.state_type = plan.state_type();
  shard.exp_avg_scale = rank.m_scales.empty() ? nullptr : rank.m_scales[size_t(u)];
  shard.exp_avg_sq_scale = rank.v_scales.empty() ? nullptr : rank.v_scales[size_t(u)];
  if (plan.homes.separate_master) {
    // The new compute-precision parameters go to their home, or to the staging
    // buffer on their way to NVMe or (from the CPU) to the GPU.
    shard.copy = plan.new_params_staged() ? rank.param_out : param_home;
    update.copy_home = plan.new_params_staged() ? tiers::Tier::host : plan.homes.param;
  }
  // On NVMe the streamed optimizer brings master, m and v chunk by chunk.
  if (plan.homes.optimizer != tiers::Tier::nvme) {
    shard.master = reinterpret_cast<float*>(home_data(rank, master_key)) + master_offset;
    shard.exp_avg = home_data(rank, {u, ShardKind::m});
    shard.exp_avg_sq = home_data(rank, {u, ShardKind::v});
  }
  Status updated = Status::ok();
  if (defers_expert_updates(plan, u)) {
    updated = update_deferring(rank, update, op, master_key.kind);
  } else if (plan.homes.optimizer == tiers::Tier::nvme) {
    updated = update_streamed(rank, update, op, master_key.kind);
  } else {
    updated = rank.compute->update(plan.homes.optimizer, update);
  }
  if (!updated) return updated;
  // Staged on their way to their home in the device tier.
  if (plan.new_params_staged() && plan.homes.param == tiers::Tier::device)
    return rank.compute->upload(param_home, rank.param_out, shard.numel * cb);
  return Status::ok();
}

Status Engine::Impl::update_streamed(Rank& rank, const UnitUpdate& update, const PlanOp& op,
                                     ShardKind master_kind) {
  const int unit = op.unit;
  // Chunks stream through the pass's buffers (the one chunk loop).
  StreamedOptimizerUnit streamed;
  streamed.unit = unit;
  streamed.shard = update.shard;
  const UnitPlacement& p = plan.units[size_t(unit)];
  streamed.grad_offset =
      p.grad_numel == p.padded_numel ? plan.optimizer_offset(unit, rank.rank) : 0;
  streamed.master_kind = master_kind;
  // The next update of this step on this lane: its master, m and v are
  // written by nothing but that update, so they are read while this one's
  // write-backs finish and it waits for its gradients. One that goes unused
  // (a failed step) is dropped. Not where experts' updates are deferred: a
  // replay of missed steps (the next step's forward, on the compute lane)
  // runs its own pass in between and would drop it, reading it twice.
  StreamedOptimizerUnit next;
  for (size_t i = size_t(&op - plan.ops.data()) + 1;
       i < plan.ops.size() && !plan.deferred_expert_updates; ++i) {
    if (plan.ops[i].kind != OpKind::optimizer) continue;
    next.unit = plan.ops[i].unit;
    next.shard.numel = plan.units[size_t(next.unit)].optimizer_numel;
    next.master_kind = master_kind;
    break;
  }
  std::lock_guard lock(rank.streamed_mutex);
  return rank.streamed->step(*rank.optimizer, update.decision, {&streamed, 1},
                             {&next, next.shard.numel > 0 ? size_t{1} : size_t{0}});
}

Status Engine::Impl::update_deferring(Rank& rank, const UnitUpdate& update, const PlanOp& op,
                                      ShardKind master_kind) {
  const int u = op.unit;
  const std::vector<uint8_t> active =
      touched_through(rank.routing, u, int(plan.input.grad_accum) - 1);
  StreamedOptimizerUnit streamed;
  streamed.unit = u;
  streamed.shard = update.shard;
  streamed.master_kind = master_kind;
  const UnitPlacement& p = plan.units[size_t(u)];
  streamed.grad_offset = p.grad_numel == p.padded_numel ? plan.optimizer_offset(u, rank.rank) : 0;
  const std::vector<ElementRange> ranges = expert_update_ranges(plan, u, active, true, rank.rank);
  std::vector<RangeUpdate> updates;
  for (const ElementRange& range : ranges) updates.push_back({range, {update.decision}});
  std::lock_guard lock(rank.streamed_mutex);
  // The experts the step reached took their missed steps in its forwards;
  // the others miss this one.
  if (!rank.deferred.take_due(u, active).empty())
    return Status::error(fmt::format(
        "deferred expert updates: an expert of {} was routed to with its steps still waiting "
        "(engine error)",
        plan.layout.units[size_t(u)].unit.name));
  rank.deferred_decisions[update.decision.step] = update.decision;
  rank.deferred.defer_idle(u, active, update.decision.step);
  const std::vector<ElementRange> windows = update_windows(plan, u, ranges);
  Status status =
      plan.homes.optimizer == tiers::Tier::nvme
          ? rank.streamed->step_ranges(*rank.optimizer, streamed, windows, updates, false)
          : update_ranges_in_host(rank, u, update.shard, windows, updates, false, rank.param_out);
  // Decisions no expert waits on any more.
  const int64_t oldest = rank.deferred.oldest_waited();
  std::erase_if(rank.deferred_decisions,
                [&](const auto& entry) { return oldest == 0 || entry.first < oldest; });
  return status;
}

Status Engine::Impl::update_ranges_in_host(Rank& rank, int unit, kernels::cpu::AdamWShard shard,
                                           const std::vector<ElementRange>& windows,
                                           const std::vector<RangeUpdate>& updates,
                                           bool zero_gradient, std::byte* staging) {
  // Every element of the copy as stored is its master rounded; the stepped
  // ones are then written by the kernel, as the eager update writes them.
  const int64_t cb = plan.compute_bytes;
  for (const ElementRange& w : windows)
    narrow(shard.master + w.begin, compute_type(), staging + w.begin * cb, w.end - w.begin);
  shard.copy = staging;
  for (const RangeUpdate& range : updates)
    if (Status s = update_elements(*rank.optimizer, shard, range.elements.begin, range.elements.end,
                                   range.decisions, zero_gradient);
        !s)
      return s.with_context(fmt::format("{} elements [{}, {})",
                                        plan.layout.units[size_t(unit)].unit.name,
                                        range.elements.begin, range.elements.end));
  return rank.store->write_home_ranges({unit, ShardKind::param}, byte_windows(windows, cb),
                                       staging);
}

Status Engine::Impl::replay_deferred(Rank& rank, int unit, const std::vector<DeferredSteps>& due,
                                     std::byte* staging) {
  if (due.empty()) return Status::ok();
  std::vector<RangeUpdate> updates;
  std::vector<uint8_t> chosen(size_t(plan.layout.config.num_experts), 0);
  for (const DeferredSteps& d : due) {
    RangeUpdate update;
    update.elements = waiting_range(plan, unit, d.expert, rank.rank);
    if (update.elements.begin == update.elements.end) continue;  // stepped every step
    for (int64_t t = d.first; t <= d.last; ++t) {
      const auto found = rank.deferred_decisions.find(t);
      if (found == rank.deferred_decisions.end())
        return Status::error(fmt::format(
            "deferred expert updates: {} expert {} waits on step {}, which was not kept (engine "
            "error)",
            plan.layout.units[size_t(unit)].unit.name, d.expert, t));
      update.decisions.push_back(found->second);
    }
    updates.push_back(std::move(update));
    chosen[size_t(d.expert)] = 1;
  }
  if (updates.empty()) return Status::ok();
  StreamedOptimizerUnit streamed;
  streamed.unit = unit;
  kernels::cpu::AdamWShard& shard = streamed.shard;
  shard.numel = plan.units[size_t(unit)].optimizer_numel;
  shard.segments = rank.segments[size_t(unit)];
  shard.state_type = plan.state_type();
  shard.copy_type = compute_type();
  shard.exp_avg_scale = rank.m_scales.empty() ? nullptr : rank.m_scales[size_t(unit)];
  shard.exp_avg_sq_scale = rank.v_scales.empty() ? nullptr : rank.v_scales[size_t(unit)];
  streamed.master_kind = plan.homes.separate_master ? ShardKind::master : ShardKind::param;
  const std::vector<ElementRange> windows =
      update_windows(plan, unit, expert_update_ranges(plan, unit, chosen, false, rank.rank));
  Status status = Status::ok();
  if (plan.homes.optimizer == tiers::Tier::nvme) {
    status = rank.streamed->step_ranges(*rank.optimizer, streamed, windows, updates, true);
  } else {
    shard.master = reinterpret_cast<float*>(home_data(rank, {unit, streamed.master_kind}));
    shard.exp_avg = home_data(rank, {unit, ShardKind::m});
    shard.exp_avg_sq = home_data(rank, {unit, ShardKind::v});
    status = update_ranges_in_host(rank, unit, shard, windows, updates, true, staging);
  }
  return status.with_context(fmt::format("replaying the missed steps of {}'s experts",
                                         plan.layout.units[size_t(unit)].unit.name));
}

Status Engine::Impl::apply_deferred_updates() {
  if (!plan.deferred_expert_updates) return Status::ok();
  for (auto& rank : ranks) {
    std::lock_guard lock(rank->streamed_mutex);
    for (int u = 0; u < units(); ++u) {
      if (!defers_expert_updates(plan, u)) continue;
      if (Status s = replay_deferred(*rank, u, rank->deferred.take_all(u), rank->param_out); !s)
        return s;
    }
    rank->deferred_decisions.clear();
  }
  return Status::ok();
}

Status Engine::Impl::sync(Rank& rank, const PlanOp& op) {
  const UnitPlacement& p = plan.units[size_t(op.unit)];
  std::byte* params = home_data(rank, {op.unit, ShardKind::param});
  const int cb = plan.compute_bytes;
  const comm::DataType type = cb == 4 ? comm::DataType::fp32 : comm::DataType::bf16;
  const int64_t own = int64_t(rank.rank) * p.shard_numel * cb;
  // The data paths differ here: the collectives work on host memory, and
  // whole units the GPU computes from in place are in GPU memory, so they
  // gather in the plan's pinned staging buffer and go back whole; elsewhere
  // they gather in place in their home.
  if (!plan.gpu_params_in_place())
    return rank.comm->all_gather(params + own, params, size_t(p.shard_numel), type);
  if (world() == 1) return Status::ok();
  Status status = rank.compute->download(rank.sync_staging + own, params + own, p.shard_numel * cb);
  // A failed copy still takes part in the collective, so the other ranks are not left waiting.
  Status gathered = rank.comm->all_gather(rank.sync_staging + own, rank.sync_staging,
                                          size_t(p.shard_numel), type);
  if (status) status = gathered;
  if (!status) return status;
  return rank.compute->upload(params, rank.sync_staging, p.padded_numel * cb);
}

// Spilled saved inputs (TrainingPlan::activations_spilled): level
// op.unit of micro-batch op.micro between its device slot and its home. On
// the CPU backend the slot is host memory and NVMe reads and writes it in
// place; a GPU's goes through its host copy, or the staging copy to NVMe.
// The NVMe offsets are multiples of the transfer, which is a multiple of the
// tier's alignment (checked when the rank opened).
Status Engine::Impl::spill(Rank& rank, const PlanOp& op) {
  const size_t copy = size_t(plan.spill_copy(op.unit, op.micro));
  const std::byte* slot = rank.compute->saved_input(op.unit, op.micro);
  Status status = Status::ok();
  if (!rank.spill_extent) {
    status =
        rank.compute->saved_input_to_host(rank.spilled_inputs[copy], slot, plan.saved_input_bytes());
  } else {
    const std::byte* source = slot;
    if (plan.input.gpu) {
      status = rank.compute->saved_input_to_host(rank.spill_staging, slot, plan.saved_input_bytes());
      source = rank.spill_staging;
    }
    if (status)
      status = rank.store->nvme_tier()
                   ->write(*rank.spill_extent, copy * saved_input_copy_bytes(), source,
                           uint64_t(plan.saved_input_transfer_bytes()))
                   .wait();
  }
  if (status) return status;
  return status.with_context(
      fmt::format("spilling the saved input of {} (micro-batch {})",
                  plan.layout.units[size_t(op.unit)].unit.name, op.micro));
}

Status Engine::Impl::restore(Rank& rank, const PlanOp& op) {
  const size_t copy = size_t(plan.spill_copy(op.unit, op.micro));
  std::byte* slot = rank.compute->saved_input(op.unit, op.micro);
  Status status = Status::ok();
  if (!rank.spill_extent) {
    status =
        rank.compute->saved_input_to_device(slot, rank.spilled_inputs[copy], plan.saved_input_bytes());
  } else {
    std::byte* landing = plan.input.gpu ? rank.spill_staging : slot;
    status = rank.store->nvme_tier()
                 ->read(*rank.spill_extent, copy * saved_input_copy_bytes(), landing,
                        uint64_t(plan.saved_input_transfer_bytes()))
                 .wait();
    if (status && plan.input.gpu)
      status = rank.compute->saved_input_to_device(slot, landing, plan.saved_input_bytes());
  }
  if (status) return status;
  return status.with_context(
      fmt::format("restoring the saved input of {} (micro-batch {})",
                  plan.layout.units[size_t(op.unit)].unit.name, op.micro));
}

}  // namespace strata
