#include "core/engine/engine_impl.h"

namespace strata {

// --- steps ---------------------------------------------------------------------------

Result<StepResult> Engine::step() {
  Impl& im = *impl_;
  if (im.poisoned)
    return Status::error("engine: an earlier step failed (" + im.poison_reason + "); start again");
  const Clock::time_point start = Clock::now();
  const TrainingPlanInput& in = im.plan.input;
  const int W = im.world();
  const int64_t N = im.plan.tokens_per_micro;

  auto run = std::make_shared<StepRun>();
  run->index = im.steps_done;
  run->world = W;
  run->op_count = im.plan.ops.size();
  run->done.assign(size_t(W), std::vector<uint8_t>(run->op_count, 0));
  run->remaining = run->op_count * size_t(im.local_count());
  run->decisions.resize(size_t(W));
  run->loss_sum.assign(size_t(W), 0.0);
  run->grad_norm.assign(size_t(W), 0.0);
  run->stall_seconds.assign(size_t(W), 0.0);
  run->exchanged.assign(size_t(W), 0);

  // The global batch: every rank's micro-batches, read before the step (the
  // previous step's compute is over, so the token buffers are free).
  // One rank of several processes reads the other ranks' targets too, only
  // to count them (the loss is a mean over the global batch).
  int64_t counted = 0;
  std::vector<int32_t> other_tokens, other_targets;
  for (int r = 0; r < W; ++r) {
    Impl::Rank* held = nullptr;
    for (auto& rank : im.ranks)
      if (rank->rank == r) held = rank.get();
    if (held == nullptr) {
      other_tokens.resize(size_t(N));
      other_targets.resize(size_t(N));
    }
    for (int64_t m = 0; m < in.grad_accum; ++m) {
      int32_t* tokens = held ? held->tokens + m * N : other_tokens.data();
      int32_t* targets = held ? held->targets + m * N : other_targets.data();
      Status s =
          im.options.data(im.sequence_offset, m, r, W, in.micro_batch, in.seq_len, tokens, targets);
      if (!s) return s;
      if (Status ids = check_token_ids(in.model, tokens, N, false, "input tokens"); !ids)
        return ids;
      if (Status ids = check_token_ids(in.model, targets, N, true, "targets"); !ids) return ids;
      for (int64_t i = 0; i < N; ++i) counted += targets[i] >= 0;
    }
  }
  if (counted == 0)
    return Status::error(
        "every target of this step's global batch is masked out; nothing to learn from");
  run->total_tokens = double(counted);

  im.post_step(run);
  {
    std::unique_lock lock(run->mutex);
    run->changed.wait(lock, [&] {
      if (run->error) return true;
      return std::all_of(im.ranks.begin(), im.ranks.end(),
                         [&](const auto& rank) { return run->exchanged[size_t(rank->rank)] != 0; });
    });
  }
  im.last_run = run;
  if (run->failed()) {
    (void)finish();
    im.poisoned = true;
    std::lock_guard lock(run->mutex);
    im.poison_reason = run->error->message();
    return *run->error;
  }
  im.steps_done += 1;
  im.sequence_offset += in.grad_accum * W * in.micro_batch;

  StepResult result;
  const size_t first = size_t(im.ranks[0]->rank);  // every rank has the same results
  const StepPlan& decision = run->decisions[first];
  result.step = im.steps_done;
  result.loss = run->loss_sum[first] / run->total_tokens;
  result.grad_norm = run->grad_norm[first];
  result.lr = decision.lr;
  result.loss_scale = decision.loss_scale;
  result.skipped = !decision.apply;
  result.tokens = counted;
  result.sequence_offset = im.sequence_offset;
  result.seconds = seconds_between(start, Clock::now());
  {
    std::lock_guard lock(run->mutex);
    double stall = 0;
    for (double s : run->stall_seconds) stall += s;
    result.stall_seconds = stall / im.local_count();
  }
  const io::IoCounters counters = im.nvme_counters();
  result.nvme_read_bytes = counters.bytes_read - im.last_read;
  result.nvme_written_bytes = counters.bytes_written - im.last_written;
  im.last_read = counters.bytes_read;
  im.last_written = counters.bytes_written;
  return result;
}

void Engine::Impl::post_step(const std::shared_ptr<StepRun>& run) {
  for (auto& rank : ranks) {
    for (size_t i = 0; i < plan.ops.size(); ++i) {
      const PlanOp& op = plan.ops[i];
      Rank* r = rank.get();
      r->lanes[static_cast<int>(op.lane)]->post([this, r, run, i] { run_op(*r, run, int(i)); });
    }
  }
}

void Engine::Impl::run_op(Rank& rank, const std::shared_ptr<StepRun>& run, int op_index) {
  const PlanOp& op = plan.ops[size_t(op_index)];
  // Dependencies of the same step, same rank.
  const Clock::time_point wait_start = Clock::now();
  {
    std::unique_lock lock(run->mutex);
    run->changed.wait(lock, [&] {
      for (int d : op.deps)
        if (!run->done[size_t(rank.rank)][size_t(d)]) return false;
      return true;
    });
  }
  // And the previous step's update of the parameters it reads.
  const bool reads_params =
      op.kind == OpKind::fetch || op.kind == OpKind::gather ||
      (plan.input.stage < 3 && (op.kind == OpKind::forward || op.kind == OpKind::backward));
  if (reads_params) wait_params(run->index, rank, op.unit);
  if (op.lane == Lane::compute) {
    std::lock_guard lock(run->mutex);
    run->stall_seconds[size_t(rank.rank)] += seconds_between(wait_start, Clock::now());
  }
  const Clock::time_point start = Clock::now();
  Status status = Status::ok();
  // After a failure the remaining operations only keep the ranks in step:
  // collectives still run (their ranks wait for each other), the rest is skipped.
  const bool collective = op.kind == OpKind::gather || op.kind == OpKind::reduce ||
                          op.kind == OpKind::exchange || op.kind == OpKind::sync;
  if (!run->failed() || collective) status = execute(rank, *run, op_index);
  const Clock::time_point end = Clock::now();
  if (publishes[size_t(op_index)]) publish_params(rank, op.unit, run->index);
  {
    std::lock_guard lock(timing_mutex);
    timings.push_back({rank.rank, op_index, run->index, seconds_between(created, start),
                       seconds_between(created, end)});
  }
  {
    std::lock_guard lock(run->mutex);
    if (!status && !run->error)
      run->error = status.with_context(fmt::format("rank {}, {}", rank.rank, op_label(plan, op)));
    run->done[size_t(rank.rank)][size_t(op_index)] = 1;
    run->remaining -= 1;
    if (op.kind == OpKind::exchange) run->exchanged[size_t(rank.rank)] = 1;
  }
  run->changed.notify_all();
}

void Engine::Impl::wait_params(int64_t step_index, Rank& rank, int unit) {
  std::unique_lock lock(params_mutex);
  params_changed.wait(lock,
                      [&] { return rank.params_ready[size_t(unit)].load() >= step_index - 1; });
}

void Engine::Impl::publish_params(Rank& rank, int unit, int64_t step_index) {
  {
    std::lock_guard lock(params_mutex);
    rank.params_ready[size_t(unit)].store(step_index);
  }
  params_changed.notify_all();
}

Status Engine::Impl::execute(Rank& rank, StepRun& run, int op_index) {
  const PlanOp& op = plan.ops[size_t(op_index)];
  switch (op.kind) {
    case OpKind::fetch:
      return rank.store->prefetch({op.unit, ShardKind::param}, tiers::Tier::host);
    case OpKind::gather:
      return gather(rank, op);
    case OpKind::forward:
      return forward(rank, run, op_index, op);
    case OpKind::backward:
      return backward(rank, run, op_index, op);
    case OpKind::release:
      return Status::ok();
    case OpKind::reduce:
      return reduce(rank, op);
    case OpKind::exchange:
      return exchange(rank, run);
    case OpKind::decide: {
      Result<StepPlan> decision = rank.optimizer->begin_step(std::nullopt);
      if (!decision) return decision.status();
      std::lock_guard lock(run.mutex);
      run.decisions[size_t(rank.rank)] = *decision;
      return Status::ok();
    }
    case OpKind::optimizer:
      return optimize(rank, run, op);
    case OpKind::writeback:
      if (!run.decisions[size_t(rank.rank)].apply) return Status::ok();
      return rank.store->write_shard(
          {op.unit, ShardKind::param},
          std::span<const std::byte>(
              rank.param_out,
              size_t(plan.units[size_t(op.unit)].param_numel * plan.compute_bytes)));
    case OpKind::sync:
      return sync(rank, op);
  }
  return Status::ok();
}

// --- results -------------------------------------------------------------------------

Status Engine::finish() {
  Impl& im = *impl_;
  std::shared_ptr<StepRun> run = im.last_run;
  if (!run) return Status::ok();
  {
    std::unique_lock lock(run->mutex);
    run->changed.wait(lock, [&] { return run->remaining == 0; });
    if (run->error) return *run->error;
  }
  // Every operation is enqueued; on a GPU its work may still run (AdamW on
  // state there): the homes are read through the device tier's own streams.
  for (auto& rank : im.ranks) {
    if (Status s = rank->compute->synchronize(); !s)
      return s.with_context(fmt::format("rank {}", rank->rank));
  }
  return Status::ok();
}

}  // namespace strata
