#include <utility>

#include "core/engine/engine_impl.h"

namespace strata {

// --- steps ---------------------------------------------------------------------------

Result<StepResult> Engine::step() {
  Impl& im = *impl_;
  if (im.poisoned)
    return Status::error("engine: an earlier step failed (" + im.poison_reason + "); start again");
  const Clock::time_point start = Clock::now();
  const uint64_t network_at_start = im.network_bytes_sent();
  const PlanInput& in = im.plan.input;
  const int W = im.world();
  const int64_t N = im.plan.tokens_per_micro;

  auto run = std::make_shared<StepRun>();
  run->index = im.steps_done;
  run->decisions.resize(size_t(W));
  run->loss_sum.assign(size_t(W), 0.0);
  run->aux_sum.assign(size_t(W), 0.0);
  run->grad_norm.assign(size_t(W), 0.0);

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

  // The StepRun lives as long as the step's operations (they hold it); the
  // progress does not hold them.
  run->progress = im.executor->start_step(run->index, [&im, run](int rank, int op) {
    return im.execute(*im.ranks[size_t(rank)], *run, op);
  });
  (void)run->progress->wait_done(im.exchange_op);
  // The previous step's updates ran alongside this step's forward; each
  // unit's was over before this step read that unit's parameters, so by this
  // step's exchange the previous step is complete. An update of it that failed
  // after it returned fails this step: its parameters were never updated.
  const std::shared_ptr<StepRun> previous = std::exchange(im.last_run, run);
  Status failed = previous ? previous->progress->wait_all() : Status::ok();
  if (failed) failed = run->progress->status();
  if (!failed) {
    (void)finish();
    im.poisoned = true;
    im.poison_reason = failed.message();
    return failed;
  }
  im.steps_done += 1;
  im.sequence_offset += in.grad_accum * W * in.micro_batch;

  StepResult result;
  const size_t first = size_t(im.ranks[0]->rank);  // every rank has the same results
  const StepDecision& decision = run->decisions[first];
  result.step = im.steps_done;
  result.loss = run->loss_sum[first] / run->total_tokens;
  const ModelConfig& model = im.plan.layout.config;
  if (model.is_moe()) {
    result.aux_loss = run->aux_sum[first] / double(in.grad_accum * W);
    if (model.output_router_logits) result.loss += model.router_aux_loss_coef * *result.aux_loss;
  }
  result.grad_norm = run->grad_norm[first];
  result.lr = decision.lr;
  result.loss_scale = decision.loss_scale;
  result.skipped = !decision.apply;
  result.tokens = counted;
  result.sequence_offset = im.sequence_offset;
  result.seconds = seconds_between(start, Clock::now());
  result.stall_seconds = run->progress->stall_seconds() / im.local_count();
  const io::IoCounters counters = im.nvme_counters();
  result.nvme_read_bytes = counters.bytes_read - im.last_read;
  result.nvme_written_bytes = counters.bytes_written - im.last_written;
  im.last_read = counters.bytes_read;
  im.last_written = counters.bytes_written;
  result.network_bytes = im.network_bytes_sent() - network_at_start;
  if (im.plan.routed_expert_fetch) result.routing = im.ranks[0]->routing;
  return result;
}

void Engine::Impl::start_lanes() {
  LaneExecutorOptions lanes;
  lanes.ranks.clear();
  for (const auto& rank : ranks) lanes.ranks.push_back(rank->rank);
  lanes.stall_lane = static_cast<int>(Lane::compute);
  lanes.before = [this](int rank, int64_t step_index, int op) {
    before_op(*ranks[size_t(rank)], step_index, op);
  };
  lanes.after = [this](int rank, int64_t step_index, int op) {
    after_op(*ranks[size_t(rank)], step_index, op);
  };
  lanes.origin = created;
  exchange_op = strata::exchange_op(plan);
  executor = std::make_unique<LaneExecutor>(lane_ops(plan), std::move(lanes));
}

void Engine::Impl::before_op(Rank& rank, int64_t step_index, int op_index) {
  const PlanOp& op = plan.ops[size_t(op_index)];
  if (reads_parameters(plan, op)) wait_params(step_index, rank, op.unit);
}

void Engine::Impl::after_op(Rank& rank, int64_t step_index, int op_index) {
  if (publishes[size_t(op_index)])
    publish_params(rank, plan.ops[size_t(op_index)].unit, step_index);
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
      if (routes_expert_reads(plan, op.unit))
        return rank.store->prefetch_ranges(
            {op.unit, ShardKind::param},
            rank_ranges(
                plan, op.unit,
                fetch_ranges(plan, op.unit, experts_read_ahead(plan, op_index, &rank.routing),
                             rank.store->nvme_alignment()),
                rank.rank));
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
      Result<StepDecision> decision = rank.optimizer->begin_step(std::nullopt);
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
    case OpKind::spill:
      return spill(rank, op);
    case OpKind::restore:
      return restore(rank, op);
    case OpKind::route:
      return route(rank, run, op_index, op);
    case OpKind::share:
      return share(rank, op);
  }
  return Status::ok();
}

// --- results -------------------------------------------------------------------------

std::pair<uint64_t, uint64_t> Engine::take_nvme_bytes() {
  Impl& im = *impl_;
  const io::IoCounters counters = im.nvme_counters();
  const std::pair<uint64_t, uint64_t> taken{counters.bytes_read - im.last_read,
                                            counters.bytes_written - im.last_written};
  im.last_read = counters.bytes_read;
  im.last_written = counters.bytes_written;
  return taken;
}

Status Engine::finish() {
  Impl& im = *impl_;
  std::shared_ptr<StepRun> run = im.last_run;
  if (!run) return Status::ok();
  if (Status s = run->progress->wait_all(); !s) return s;
  // Every operation is enqueued; on a GPU its work may still run (AdamW on
  // state there): the homes are read through the device tier's own streams.
  for (auto& rank : im.ranks) {
    if (Status s = rank->compute->synchronize(); !s)
      return s.with_context(fmt::format("rank {}", rank->rank));
  }
  return Status::ok();
}

}  // namespace strata
