#include "core/engine/engine_impl.h"

namespace strata {

// --- configuration -------------------------------------------------------------------

OptimizerOptions optimizer_options_from_config(const TrainConfig& config, int64_t total_steps) {
  OptimizerOptions o;
  o.adamw.lr = config.optimizer.lr;
  o.adamw.beta1 = config.optimizer.beta1;
  o.adamw.beta2 = config.optimizer.beta2;
  o.adamw.eps = config.optimizer.eps;
  o.adamw.weight_decay = config.optimizer.weight_decay;
  o.adamw.adam_w_mode = config.optimizer.adam_w_mode;
  o.adamw.bias_correction = config.optimizer.bias_correction;
  const SchedulerConfig& s = config.scheduler;
  if (!s.type.empty()) {
    Result<LrScheduleType> type = parse_lr_schedule_type(s.type);
    if (type) o.lr_schedule.type = *type;
    o.lr_schedule.warmup_min_lr = s.warmup_min_lr;
    o.lr_schedule.warmup_max_lr = s.warmup_max_lr;
    o.lr_schedule.warmup_num_steps = s.warmup_num_steps;
    Result<WarmupType> warmup = parse_warmup_type(s.warmup_type);
    if (warmup) o.lr_schedule.warmup_type = *warmup;
    o.lr_schedule.total_num_steps = s.total_num_steps > 0 ? s.total_num_steps : total_steps;
    o.lr_schedule.warmup_min_ratio = s.warmup_min_ratio;
    o.lr_schedule.cos_min_ratio = s.cos_min_ratio;
  }
  o.loss_scaler.enabled = config.precision == Precision::fp16;
  o.loss_scaler.loss_scale = config.fp16.loss_scale;
  o.loss_scaler.initial_scale_power = config.fp16.initial_scale_power;
  o.loss_scaler.loss_scale_window = config.fp16.loss_scale_window;
  o.loss_scaler.hysteresis = config.fp16.hysteresis;
  o.loss_scaler.consecutive_hysteresis = config.fp16.consecutive_hysteresis;
  o.loss_scaler.min_loss_scale = config.fp16.min_loss_scale;
  o.gradient_clipping = config.gradient_clipping;
  // DeepSpeed checks bf16 gradients for overflow and skips the step; fp32 training is not checked.
  o.skip_nonfinite_steps = config.precision != Precision::fp32;
  return o;
}

// --- creation ------------------------------------------------------------------------

namespace {

// Swap files are named strata-<pid>-<engine>-rank<r>.swap; one whose process
// is gone was left by a run that was killed, and its space is reclaimed.
void remove_stale_swap_files(const std::vector<std::string>& directories,
                             const std::function<void(const std::string&)>& notice) {
  namespace fs = std::filesystem;
  uint64_t count = 0, bytes = 0;
  std::string first;
  for (const std::string& directory : directories) {
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(directory, error)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind("strata-", 0) != 0 || name.size() < 12 ||
          name.substr(name.size() - 5) != ".swap")
        continue;
      char* end = nullptr;
      const long pid = std::strtol(name.c_str() + 7, &end, 10);
      if (end == name.c_str() + 7 || *end != '-' || pid <= 0) continue;
      if (::kill(pid_t(pid), 0) == 0 || errno != ESRCH) continue;  // its process still runs
      const uint64_t size = entry.file_size(error);
      if (fs::remove(entry.path(), error)) {
        ++count;
        bytes += size;
        if (first.empty()) first = entry.path().string();
      }
    }
  }
  if (count == 0) return;
  const std::string line =
      fmt::format("removed {} swap file(s) ({}) left by a run that did not finish, e.g. {}", count,
                  format_bytes(double(bytes)), first);
  if (notice)
    notice(line);
  else
    std::fprintf(stderr, "strata: %s\n", line.c_str());
}

}  // namespace

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (!impl_) return;
  (void)finish();
  impl_->executor.reset();
  // NCCL's staging came from this engine's device pool, which goes with it.
  if (auto* nccl = dynamic_cast<comm::NcclComm*>(impl_->options.process_comm.get()))
    nccl->use_staging(nullptr, nullptr, 0);
}

Result<std::unique_ptr<Engine>> Engine::create(EngineOptions options) {
  auto impl = std::make_unique<Impl>();
  const TrainConfig& config = options.config;
  if (!options.data) return Status::invalid_argument("engine: no data source");
  const bool gpu = options.backend == kernels::BackendKind::cuda || options.emulate_gpu;
  const bool nccl = gpu && dynamic_cast<comm::NcclComm*>(options.process_comm.get()) != nullptr;
  // The input this run's plans are built from: its own, unless strata train
  // gave one, and the suggestion's when the plan does not fit.
  auto plan_input = [&] {
    PlanInput input =
        plan_input_from_config(config, options.model, {gpu, nccl, options.budgets.ranks_per_node});
    input.budgets = options.budgets;
    input.nvme_path_known = !options.nvme_paths.empty();
    return input;
  };
  if (options.plan) {
    impl->plan = std::move(*options.plan);
    options.plan.reset();
  } else {
    Result<TrainingPlan> plan = plan_training(plan_input());
    if (!plan) return plan.status();
    impl->plan = std::move(*plan);
  }
  const TrainingPlan& p = impl->plan;
  const int W = p.input.world_size;
  if (p.input.gpu != gpu)
    return Status::invalid_argument(
        fmt::format("engine: the plan was built for the {} backend but the engine runs the {} one",
                    p.input.gpu ? "CUDA" : "CPU", gpu ? "CUDA" : "CPU"));

  // The budgets, checked before anything is allocated.
  if (options.process_comm && options.process_comm->world_size() != W)
    return Status::invalid_argument(fmt::format(
        "this process is one of {} ranks but the configuration says world_size {}; launch as "
        "many processes as --world-size",
        options.process_comm->world_size(), W));
  const PlanBudgets& budgets = options.budgets;
  auto refuse = [&](const char* tier, int64_t need, int64_t budget, const char* flag) -> Status {
    // The suggestion searches plans built by the same code as this one (core/plan/planner.h).
    PlanInput planner = plan_input();
    planner.budgets.device_source = "--device-mem-limit";
    planner.budgets.host_source = "--host-mem-limit";
    Result<PlanReport> suggestion = plan_with_suggestion(planner);
    std::string hint = !suggestion || suggestion->suggestion.empty() ? std::string("raise ") + flag
                                                                     : suggestion->suggestion;
    return Status::no_space(fmt::format(
        "the plan does not fit: it needs {} of {} per rank but {} allows {}; {} (`strata train "
        "--print-plan` lists every buffer)",
        format_bytes(double(need)), tier, flag, format_bytes(double(budget)), hint));
  };
  if (budgets.device_per_rank && p.peak(tiers::Tier::device) > *budgets.device_per_rank)
    return refuse("device memory", p.peak(tiers::Tier::device), *budgets.device_per_rank,
                  "--device-mem-limit");
  if (const std::optional<int64_t> host = budgets.host_per_rank(W);
      host && p.peak(tiers::Tier::host) > *host)
    return refuse(
        "host memory", p.peak(tiers::Tier::host), *host,
        budgets.node_ranks(W) > 1 ? "--host-mem-limit (shared by the ranks)" : "--host-mem-limit");
  if (p.peak(tiers::Tier::nvme) > 0 && options.nvme_paths.empty())
    return Status::not_found(
        "offload to nvme needs a directory: pass --nvme-path DIR (or "
        "zero_optimization.offload_*.nvme_path)");

  // Which operation finishes each unit's update (its parameters are then ready for the next step).
  impl->publishes.assign(p.ops.size(), false);
  for (int i : parameter_publishers(p))
    if (i >= 0) impl->publishes[size_t(i)] = true;

  impl->options = std::move(options);
  impl->sequence_offset = impl->options.sequence_offset;
  static std::atomic<uint64_t> serials{0};
  impl->engine_serial = serials.fetch_add(1);
  if (p.peak(tiers::Tier::nvme) > 0)
    remove_stale_swap_files(impl->options.nvme_paths, impl->options.notice);
  if (impl->process_mode()) {
    auto rank = std::make_unique<Impl::Rank>();
    rank->rank = impl->options.process_comm->rank();
    rank->comm = impl->options.process_comm;
    impl->ranks.push_back(std::move(rank));
  } else {
    std::vector<std::unique_ptr<comm::Communicator>> group = comm::make_local_group(W);
    for (int r = 0; r < W; ++r) {
      auto rank = std::make_unique<Impl::Rank>();
      rank->rank = r;
      rank->comm = std::move(group[size_t(r)]);
      impl->ranks.push_back(std::move(rank));
    }
  }

  std::vector<Status> results(impl->ranks.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < impl->ranks.size(); ++i) {
      threads.emplace_back([&, i] { results[i] = impl->open_rank(*impl->ranks[i]); });
    }
    for (auto& t : threads) t.join();
  }
  Status started = Status::ok();
  for (const Status& s : results)
    if (!s && started) started = s;
  if (started && !impl->options.resume_from.empty()) {
    Result<CheckpointReader> checkpoint = CheckpointReader::open(impl->options.resume_from);
    if (!checkpoint)
      started = checkpoint.status().with_context("--resume");
    else if (Status s = impl->resume(*checkpoint); !s)
      started = s.with_context("--resume " + impl->options.resume_from);
  } else if (started) {
    started = impl->initialize();
  }
  // Every process starts, or none does (the others would wait for it in the first step).
  if (Status s = impl->agree(started, "another rank failed to start (its own error says why)"); !s)
    return s;
  impl->start_lanes();
  // Step results count the I/O of steps, not of initialisation.
  const io::IoCounters counters = impl->nvme_counters();
  impl->last_read = counters.bytes_read;
  impl->last_written = counters.bytes_written;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

// Initial parameters: from --init, else from the seed (identical for any
// sharding). One unit at a time: the full fp32 unit is made once and every

int64_t Engine::steps_done() const {
  return impl_->steps_done;
}

const TrainingPlan& Engine::plan() const {
  return impl_->plan;
}
const ModelLayout& Engine::layout() const {
  return impl_->plan.layout;
}
int64_t Engine::sequence_offset() const {
  return impl_->sequence_offset;
}
const OptimizerState& Engine::optimizer_state() const {
  return impl_->ranks[0]->optimizer->state();
}

int Engine::local_rank_count() const {
  return impl_->local_count();
}

Result<bool> Engine::any_rank(bool flag) {
  return impl_->any_rank(flag);
}

Result<bool> Engine::Impl::any_rank(bool flag) {
  if (!process_mode()) return flag;
  float value = flag ? 1.0f : 0.0f;
  if (Status s = ranks[0]->comm->all_reduce(&value, &value, 1, comm::DataType::fp32); !s) return s;
  return value > 0;
}

Status Engine::Impl::agree(Status mine, const std::string& others_failed) {
  Result<bool> any_failed = any_rank(!mine);
  if (!any_failed) return any_failed.status();
  if (!mine) return mine;
  return *any_failed ? Status::error(others_failed) : Status::ok();
}

tiers::TierUsage Engine::rank_usage(int rank, tiers::Tier tier) const {
  tiers::TieredStore& store = *impl_->ranks[size_t(rank)]->store;
  if (!store.has_tier(tier)) return {};
  return store.usage(tier);
}

tiers::TierUsage Engine::usage(tiers::Tier tier) const {
  tiers::TierUsage total;
  for (size_t r = 0; r < impl_->ranks.size(); ++r) {
    const tiers::TierUsage u = rank_usage(int(r), tier);
    total.used += u.used;
    total.capacity += u.capacity;
    total.peak = std::max(total.peak, u.peak);
  }
  return total;
}

io::IoCounters Engine::Impl::nvme_counters(int only) const {
  io::IoCounters total;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const auto& rank = ranks[r];
    if (only >= 0 && size_t(only) != r) continue;
    if (!rank->store || !rank->store->nvme_tier()) continue;
    const io::IoCounters c = rank->store->nvme_tier()->engine().counters();
    total.bytes_read += c.bytes_read;
    total.bytes_written += c.bytes_written;
  }
  return total;
}

uint64_t Engine::nvme_bytes_read(int rank) const {
  return impl_->nvme_counters(rank).bytes_read;
}

uint64_t Engine::nvme_bytes_written(int rank) const {
  return impl_->nvme_counters(rank).bytes_written;
}

std::vector<OpTiming> Engine::take_timings() {
  return impl_->executor->take_timings();
}

}  // namespace strata
