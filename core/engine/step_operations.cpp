#include "core/engine/engine_impl.h"

namespace strata {

// --- operations, one function per kind -------------------------------------------

Status Engine::Impl::gather(Rank& rank, const PlanOp& op) {
  // One rank with its parameters on the GPU computes from their home.
  if (plan.gpu_params_in_place()) return Status::ok();
  const UnitPlacement& p = plan.units[size_t(op.unit)];
  const ShardKey key{op.unit, ShardKind::param};
  const bool fetched = plan.homes.param == tiers::Tier::nvme;
  std::byte* target = rank.gathered[size_t(op.slot)];
  Status status = Status::ok();
  const std::byte* source = nullptr;
  if (params_on_gpu()) {
    // The shard comes to its place in the host buffer, then gathers in place.
    std::byte* own = target + int64_t(rank.rank) * p.shard_numel * plan.compute_bytes;
    status = rank.gpu->download(own, home_data(rank, key), p.shard_numel * plan.compute_bytes);
    source = own;
  } else if (fetched) {
    Result<tiers::ShardView> view = rank.store->wait(key, tiers::Tier::host);
    // A failed load still takes part in the collective (with stale bytes), so
    // the other ranks are not left waiting; the step then fails.
    if (view)
      source = view->data;
    else
      status = view.status();
  } else {
    source = home_data(rank, key);
  }
  if (source == nullptr) source = target;
  const comm::DataType type = plan.compute_bytes == 4 ? comm::DataType::fp32 : comm::DataType::bf16;
  Status gathered = rank.comm->all_gather(source, target, size_t(p.shard_numel), type);
  if (status && !gathered) status = gathered;
  if (fetched && status) status = rank.store->release(key, tiers::Tier::host);
  if (!status) return status;
  if (plan.compute_bytes != 4 && !rank.gpu)
    kernels::cpu::widen_to_float(target, compute_type(), rank.gathered_fp32[size_t(op.slot)],
                                 p.padded_numel);
  return Status::ok();
}

// Unit `unit`'s fp32 parameters for compute op `op_index`; `which` picks one of
// two widening buffers at stages 0-2 (the tied head reads two units).
const float* Engine::Impl::unit_params_fp32(Rank& rank, StepRun& run, int op_index, int unit,
                                            int which) {
  if (plan.input.stage == 3) {
    for (int d : plan.ops[size_t(op_index)].deps) {
      const PlanOp& dep = plan.ops[size_t(d)];
      if (dep.kind == OpKind::gather && dep.unit == unit)
        return plan.compute_bytes == 4
                   ? reinterpret_cast<const float*>(rank.gathered[size_t(dep.slot)])
                   : rank.gathered_fp32[size_t(dep.slot)];
    }
    return nullptr;
  }
  wait_params(run.index, rank, unit);
  const std::byte* home = home_data(rank, {unit, ShardKind::param});
  if (plan.compute_bytes == 4) return reinterpret_cast<const float*>(home);
  float* out = rank.widened[size_t(which)];
  kernels::cpu::widen_to_float(home, compute_type(), out, plan.units[size_t(unit)].padded_numel);
  return out;
}

// Unit `unit`'s gathered parameters in compute precision (stage 3, the CUDA backend).
const std::byte* Engine::Impl::gathered_params(Rank& rank, int op_index, int unit) const {
  for (int d : plan.ops[size_t(op_index)].deps) {
    const PlanOp& dep = plan.ops[size_t(d)];
    if (dep.kind == OpKind::gather && dep.unit == unit) return rank.gathered[size_t(dep.slot)];
  }
  return nullptr;
}

// Unit `unit`'s parameters for a GPU computation: its device home (whole
// units there, after this step's update of it), else its gathered host copy.
const std::byte* Engine::Impl::gpu_params(Rank& rank, StepRun& run, int op_index, int unit) {
  if (!plan.gpu_params_in_place()) return gathered_params(rank, op_index, unit);
  wait_params(run.index, rank, unit);
  return home_data(rank, {unit, ShardKind::param});
}

Status Engine::Impl::forward_on_gpu(Rank& rank, StepRun& run, int op_index, const PlanOp& op) {
  const int u = op.unit;
  const std::byte* params = gpu_params(rank, run, op_index, u);
  if (params == nullptr) return Status::error("no parameters for the unit (plan error)");
  const UnitBatch batch = batch_of(rank, run, op.micro);
  if (u != units() - 1) return rank.gpu->forward(u, op.micro, params, batch.tokens, batch.targets);
  const bool tied_model = plan.layout.config.tie_word_embeddings;
  const std::byte* tied = nullptr;
  if (tied_model) {
    tied = gpu_params(rank, run, op_index, 0);
    if (tied == nullptr) return Status::error("no embedding for the tied head (plan error)");
  }
  GpuRank::GradTarget target;
  if (plan.gpu_grads_in_place()) {
    target.grads = grad_home(rank, u);
    target.tied = tied_model ? grad_home(rank, 0) : nullptr;
    target.zero_first = op.micro == 0;
  } else {
    target.grads = rank.grad_slots[size_t(op.slot)];
    target.slot = op.slot;
  }
  Result<double> loss = rank.gpu->head(op.micro, params, tied, batch.loss_scale, target);
  if (!loss) return loss.status();
  if (!std::isfinite(*loss) && plan.input.precision == Precision::fp32)
    return Status::error(
        fmt::format("the loss is {} (micro-batch {}); lower the learning rate or check the data",
                    *loss, op.micro));
  rank.micro_loss[size_t(op.micro)] = *loss;
  return Status::ok();
}

Status Engine::Impl::forward(Rank& rank, StepRun& run, int op_index, const PlanOp& op) {
  if (rank.gpu) return forward_on_gpu(rank, run, op_index, op);
  const int u = op.unit;
  const int head = units() - 1;
  const UnitBatch batch = batch_of(rank, run, op.micro);
  UnitParams params;
  params.flat = unit_params_fp32(rank, run, op_index, u, 0);
  if (params.flat == nullptr) return Status::error("no gathered parameters (plan error)");
  if (u != head) {
    const float* input = u == 0 ? nullptr : rank.checkpoints[size_t(u - 1)];
    unit_forward(plan.layout, u, params, batch, input, rank.checkpoints[size_t(u)], *rank.ws);
    return Status::ok();
  }
  const bool tied = plan.layout.config.tie_word_embeddings;
  if (tied) params.tied_embedding = unit_params_fp32(rank, run, op_index, 0, 1);
  UnitGrads grads;
  grads.flat = rank.grad_slots[size_t(op.slot)];
  std::memset(grads.flat, 0, size_t(plan.units[size_t(u)].padded_numel) * 4);
  if (tied) {
    std::memset(rank.tied_grad, 0, size_t(plan.units[0].padded_numel) * 4);
    grads.tied_embedding = rank.tied_grad;
  }
  const double loss =
      head_forward_backward(plan.layout, params, batch, rank.checkpoints[size_t(head - 1)],
                            rank.activation_grad, grads, *rank.ws);
  if (!std::isfinite(loss) && plan.input.precision == Precision::fp32)
    return Status::error(
        fmt::format("the loss is {} (micro-batch {}); lower the learning rate or check the data",
                    loss, op.micro));
  rank.micro_loss[size_t(op.micro)] = loss;
  return Status::ok();
}

Status Engine::Impl::backward(Rank& rank, StepRun& run, int op_index, const PlanOp& op) {
  const int u = op.unit;
  const int head = units() - 1;
  if (rank.gpu) {
    // The last layer's activations are still on the device (the head keeps its own).
    const bool recompute = !(u == head - 1 && u >= 1);
    const std::byte* params = gpu_params(rank, run, op_index, u);
    if (params == nullptr && u != 0)
      return Status::error("no parameters for the unit (plan error)");
    GpuRank::GradTarget target;
    if (plan.gpu_grads_in_place()) {
      target.grads = grad_home(rank, u);
      // A tied embedding's gradient was zeroed by the head, which added the lm_head's.
      target.zero_first = op.micro == 0 && !(u == 0 && plan.layout.config.tie_word_embeddings);
    } else {
      target.grads = op.slot >= 0 ? rank.grad_slots[size_t(op.slot)] : rank.tied_grad;
      target.slot = op.slot;
    }
    return rank.gpu->backward(u, op.micro, params, recompute, target);
  }
  const UnitBatch batch = batch_of(rank, run, op.micro);
  UnitParams params;
  params.flat = unit_params_fp32(rank, run, op_index, u, 0);
  if (params.flat == nullptr) return Status::error("no gathered parameters (plan error)");
  UnitGrads grads;
  if (op.slot >= 0) {
    grads.flat = rank.grad_slots[size_t(op.slot)];
    std::memset(grads.flat, 0, size_t(plan.units[size_t(u)].padded_numel) * 4);
  } else {
    grads.flat = rank.tied_grad;  // the head has added the tied lm_head's gradient already
  }
  const float* input = u == 0 ? nullptr : rank.checkpoints[size_t(u - 1)];
  // The last layer's activations are still in the workspace (the head keeps its own).
  const bool recompute = !(u == head - 1 && u >= 1);
  unit_backward(plan.layout, u, params, batch, input, rank.activation_grad,
                u == 0 ? nullptr : rank.activation_grad, grads, *rank.ws, recompute);
  return Status::ok();
}

Status Engine::Impl::reduce(Rank& rank, const PlanOp& op) {
  const int u = op.unit;
  const UnitPlacement& p = plan.units[size_t(u)];
  const int r = rank.rank;
  if (plan.gpu_grads_in_place()) {
    // One rank: nothing to reduce; the gradient accumulated in its home on the GPU.
    if (op.micro != plan.input.grad_accum - 1) return Status::ok();
    Result<kernels::cpu::GradNormPartial> partial =
        rank.gpu->grad_norm(grad_home(rank, u), p.shard_numel);
    if (!partial) return partial.status();
    rank.partials[size_t(u)] = *partial;
    return Status::ok();
  }
  // A gradient that failed to arrive still takes part in the collective (with
  // stale bytes), so the other ranks are not left waiting; the step then fails.
  const Status arrived = rank.gpu ? rank.gpu->gradients_ready(op.slot) : Status::ok();
  float* buffer = op.slot >= 0 ? rank.grad_slots[size_t(op.slot)] : rank.tied_grad;
  float* accumulator = reinterpret_cast<float*>(home_data(rank, {u, ShardKind::grad}));
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
  if (grads_on_gpu()) {
    // The reduced gradient accumulates in its home on the GPU, as below.
    if (Status s = rank.gpu->accumulate(accumulator, reduced, count, op.micro == 0); !s) return s;
    if (op.micro != plan.input.grad_accum - 1) return Status::ok();
    const float* slice =
        p.grad_numel == p.padded_numel ? accumulator + int64_t(r) * p.shard_numel : accumulator;
    Result<kernels::cpu::GradNormPartial> partial = rank.gpu->grad_norm(slice, p.shard_numel);
    if (!partial) return partial.status();
    rank.partials[size_t(u)] = *partial;
    return Status::ok();
  }
  if (op.micro == 0) {
    std::memcpy(accumulator, reduced, size_t(count) * 4);
  } else {
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, count, 1 << 16),
                      [&](const tbb::blocked_range<int64_t>& range) {
                        for (int64_t i = range.begin(); i < range.end(); ++i)
                          accumulator[i] += reduced[i];
                      });
  }
  if (op.micro == plan.input.grad_accum - 1) {
    // This rank's slice of the final gradient, the same elements at every stage.
    const float* slice =
        p.grad_numel == p.padded_numel ? accumulator + int64_t(r) * p.shard_numel : accumulator;
    Result<kernels::cpu::GradNormPartial> partial =
        kernels::cpu::grad_norm_squared(slice, ElementType::f32, p.shard_numel);
    if (!partial) return partial.status();
    rank.partials[size_t(u)] = *partial;
  }
  return Status::ok();
}

Status Engine::Impl::exchange(Rank& rank, StepRun& run) {
  const int U = units();
  const int G = int(plan.input.grad_accum);
  const int W = world();
  // Per rank: U norm partials, U non-finite flags, G loss sums, as doubles.
  const size_t per_rank = size_t(2 * U + G);
  std::vector<double> send(per_rank), all(per_rank * size_t(W));
  for (int u = 0; u < U; ++u) {
    send[size_t(u)] = rank.partials[size_t(u)].sum_squares;
    send[size_t(U + u)] = rank.partials[size_t(u)].nonfinite ? 1.0 : 0.0;
  }
  for (int m = 0; m < G; ++m) send[size_t(2 * U + m)] = rank.micro_loss[size_t(m)];
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
  double loss = 0;
  for (int m = 0; m < G; ++m)
    for (int r = 0; r < W; ++r) loss += all[size_t(r) * per_rank + size_t(2 * U + m)];
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
    run.grad_norm[size_t(rank.rank)] = std::sqrt(global.sum_squares);
    return Status::ok();
  }
  Result<StepPlan> decision = rank.optimizer->begin_step(global);
  if (!decision) return decision.status();
  std::lock_guard lock(run.mutex);
  run.decisions[size_t(rank.rank)] = *decision;
  run.loss_sum[size_t(rank.rank)] = loss;
  run.grad_norm[size_t(rank.rank)] = decision->grad_norm;
  return Status::ok();
}

Status Engine::Impl::optimize(Rank& rank, StepRun& run, const PlanOp& op) {
  StepPlan decision;
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
  const int r = rank.rank;
  const UnitPlacement& p = plan.units[size_t(u)];
  const int cb = plan.compute_bytes;
  const int64_t numel = p.optimizer_numel;
  const int64_t offset = plan.optimizer_offset(u, r);
  const float* grad = reinterpret_cast<const float*>(home_data(rank, {u, ShardKind::grad})) +
                      (p.grad_numel == p.padded_numel ? offset : 0);
  // Where the new compute-precision parameters go: their home, or the
  // staging buffer on their way to NVMe or (from the CPU) to the GPU.
  const int64_t param_offset = plan.input.stage == 3 ? 0 : offset;
  std::byte* param_home = plan.homes.param == tiers::Tier::nvme
                              ? nullptr
                              : home_data(rank, {u, ShardKind::param}) + param_offset * cb;
  std::byte* destination = nullptr;
  if (plan.new_params_staged())
    destination = rank.param_out;
  else if (plan.homes.param != tiers::Tier::nvme)
    destination = param_home;
  const ShardKey master_key{u, plan.homes.separate_master ? ShardKind::master : ShardKind::param};
  // In fp32 the parameters may be the master: then the update is already in them.
  const int64_t master_offset = plan.homes.separate_master || plan.input.stage == 3 ? 0 : offset;
  const std::span<const ShardSegment> segments = rank.segments[size_t(u)];
  if (optimizer_on_gpu()) {
    // AdamW on the GPU, over the state's device homes.
    float* master = reinterpret_cast<float*>(home_data(rank, master_key)) + master_offset;
    float* m = reinterpret_cast<float*>(home_data(rank, {u, ShardKind::m}));
    float* v = reinterpret_cast<float*>(home_data(rank, {u, ShardKind::v}));
    // Parameters on the GPU take the copy in place; elsewhere it passes
    // through a device buffer (fp32: the master is the copy) to their home.
    std::byte* copy = nullptr;
    if (plan.homes.separate_master)
      copy = params_on_gpu() ? destination : rank.gpu->new_parameter_buffer();
    for (const ShardSegment& segment : segments) {
      if (segment.begin == segment.end) continue;
      const int64_t b = segment.begin;
      if (Status s = rank.gpu->adamw(master + b, m + b, v + b, grad + b,
                                     copy == nullptr ? nullptr : copy + b * cb, segment.end - b,
                                     rank.optimizer->hyperparams(decision, segment.group));
          !s)
        return s;
    }
    if (params_on_gpu()) return Status::ok();
    // Parameters in host memory (their home) or on NVMe (param_out, then writeback).
    const std::byte* from = copy != nullptr ? copy : reinterpret_cast<const std::byte*>(master);
    return rank.gpu->download(destination, from, numel * cb);
  }
  // The CPU optimizer's new parameters reach their home on the GPU after the update.
  auto publish = [&](Status updated) -> Status {
    if (!updated || !params_on_gpu()) return updated;
    return rank.gpu->upload(param_home, rank.param_out, numel * cb);
  };

  auto update = [&](float* master, float* m, float* v, int64_t begin, int64_t count) -> Status {
    std::vector<ShardSegment> local;
    for (const ShardSegment& s : segments) {
      const int64_t b = std::max(s.begin, begin), e = std::min(s.end, begin + count);
      if (b < e) local.push_back({b - begin, e - begin, s.group});
    }
    OptimizerShard shard;
    shard.arrays.numel = count;
    shard.arrays.master = master;
    shard.arrays.exp_avg = m;
    shard.arrays.exp_avg_sq = v;
    shard.arrays.grad = grad + begin;
    shard.arrays.grad_type = ElementType::f32;
    const bool copy = plan.homes.separate_master && destination != nullptr;
    if (copy && cb != 4) {
      shard.arrays.copy = destination + begin * cb;
      shard.arrays.copy_type = compute_type();
    }
    shard.segments = local;
    if (Status s = rank.optimizer->update_shard(decision, shard); !s) return s;
    if (copy && cb == 4) std::memcpy(destination + begin * 4, master, size_t(count) * 4);
    return Status::ok();
  };

  if (plan.homes.optimizer != tiers::Tier::nvme) {
    float* master = reinterpret_cast<float*>(home_data(rank, master_key)) + master_offset;
    float* m = reinterpret_cast<float*>(home_data(rank, {u, ShardKind::m}));
    float* v = reinterpret_cast<float*>(home_data(rank, {u, ShardKind::v}));
    return publish(update(master, m, v, 0, numel));
  }
  // Optimizer state on NVMe: chunks stream through the pass's buffers (the one chunk loop).
  StreamedOptimizerUnit unit;
  unit.unit = u;
  unit.numel = numel;
  unit.segments = segments;
  unit.grad = grad;
  unit.grad_type = ElementType::f32;
  if (plan.homes.separate_master && destination != nullptr) {
    unit.copy = destination;
    unit.copy_type = cb == 4 ? ElementType::f32 : compute_type();
  }
  unit.master_kind = master_key.kind;
  return publish(rank.streamed->step(*rank.optimizer, decision, {&unit, 1}));
}

Status Engine::Impl::sync(Rank& rank, const PlanOp& op) {
  const UnitPlacement& p = plan.units[size_t(op.unit)];
  std::byte* params = home_data(rank, {op.unit, ShardKind::param});
  const int cb = plan.compute_bytes;
  const comm::DataType type = cb == 4 ? comm::DataType::fp32 : comm::DataType::bf16;
  const int64_t own = int64_t(rank.rank) * p.shard_numel * cb;
  if (!rank.gpu) return rank.comm->all_gather(params + own, params, size_t(p.shard_numel), type);
  // Parameters on the GPU: gathered in pinned host memory, then sent back whole.
  if (world() == 1) return Status::ok();
  Status status = rank.gpu->download(rank.sync_staging + own, params + own, p.shard_numel * cb);
  // A failed copy still takes part in the collective, so the other ranks are not left waiting.
  Status gathered = rank.comm->all_gather(rank.sync_staging + own, rank.sync_staging,
                                          size_t(p.shard_numel), type);
  if (status) status = gathered;
  if (!status) return status;
  return rank.gpu->upload(params, rank.sync_staging, p.padded_numel * cb);
}

}  // namespace strata
