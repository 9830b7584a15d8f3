#include "core/engine/engine.h"

#include <fmt/format.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <span>
#include <thread>
#include <utility>

#include "comm/communicator.h"
#include "comm/nccl_comm.h"
#include "core/checkpoint/checkpoint.h"
#include "core/engine/gpu_rank.h"
#include "core/plan/planner.h"
#include "core/checkpoint/safetensors.h"
#include "io/base/sizes.h"
#include "kernels/cpu/grad_norm.h"
#include "kernels/cpu/simd.h"
#include "tiers/streamed_pass.h"
#include "tiers/tiered_store.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::cpu::ElementType;
using tiers::ShardKey;
using tiers::ShardKind;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Narrows (n) fp32 elements to the compute precision (round to nearest even).
void narrow(const float* source, ElementType type, std::byte* out, int64_t n) {
  if (type == ElementType::f32) {
    std::memcpy(out, source, size_t(n) * 4);
    return;
  }
  auto* bits = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i)
    bits[i] = type == ElementType::bf16 ? kernels::cpu::float_to_bf16(source[i])
                                        : kernels::cpu::float_to_f16(source[i]);
}

// A lane: one thread running closures in the order they were posted.
class LaneThread {
 public:
  LaneThread() : thread_([this] { run(); }) {}
  ~LaneThread() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  void post(std::function<void()> work) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(work));
    }
    wake_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::thread thread_;
};

// One step of every rank: which operations are done, the first error.
struct StepRun {
  int64_t index = 0;  // 0 for the first step
  int world = 1;
  size_t op_count = 0;
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<std::vector<uint8_t>> done;  // [rank][op]
  size_t remaining = 0;
  std::optional<Status> error;
  std::vector<StepPlan> decisions;  // per rank, set by the exchange
  std::vector<double> loss_sum;     // per rank, global loss sum after the exchange
  std::vector<double> grad_norm;
  std::vector<double> stall_seconds;  // per rank: compute lane waiting
  std::vector<uint8_t> exchanged;
  double total_tokens = 0;

  bool failed() {
    std::lock_guard lock(mutex);
    return error.has_value();
  }
};

}  // namespace

struct Engine::Impl {
  uint64_t engine_serial = 0;  // names this engine's swap files
  struct Rank {
    int rank = 0;
    std::shared_ptr<comm::Communicator> comm;
    std::unique_ptr<tiers::TieredStore> store;
    std::unique_ptr<tiers::StreamedPass> pass;
    std::optional<Optimizer> optimizer;
    std::unique_ptr<UnitWorkspace> ws;
    std::unique_ptr<GpuRank> gpu;  // the CUDA backend's compute; null on the CPU backend
    std::vector<tiers::DeviceBlock> device_blocks;
    std::vector<tiers::HostBlock> host_blocks;
    std::vector<std::byte*> gathered;   // [slot] (largest padded) compute precision
    std::vector<float*> gathered_fp32;  // [slot] widened (compute precision != fp32)
    std::vector<float*> widened;        // [2] stages 0-2 with compute precision != fp32
    std::vector<float*> grad_slots;     // [slot] (largest padded) fp32
    float* tied_grad = nullptr;         // (embedding padded)
    float* reduce_out = nullptr;        // (largest shard)
    std::vector<float*> checkpoints;    // [units - 1] (B*T, C)
    float* activation_grad = nullptr;   // (B*T, C)
    int32_t* tokens = nullptr;          // (G, B*T)
    int32_t* targets = nullptr;         // (G, B*T)
    std::byte* param_out = nullptr;     // (largest optimizer range) new parameters, staged
    std::byte* sync_staging = nullptr;  // (largest padded) the CUDA backend's parameter all-gather
    std::vector<std::vector<ShardSegment>> segments;       // per unit, over its optimizer range
    std::vector<double> micro_loss;                        // (G) this rank's token-loss sums
    std::vector<kernels::cpu::GradNormPartial> partials;   // (units) over this rank's slice
    std::unique_ptr<std::atomic<int64_t>[]> params_ready;  // per unit: last step whose update is in
    std::unique_ptr<LaneThread> lanes[kLaneCount];
  };

  EngineOptions options;
  TrainingPlan plan;
  std::vector<bool> publishes;  // op publishes its unit's new parameters
  std::vector<std::unique_ptr<Rank>> ranks;
  int64_t steps_done = 0;
  int64_t sequence_offset = 0;
  std::shared_ptr<StepRun> last_run;
  bool poisoned = false;
  std::string poison_reason;
  Clock::time_point created = Clock::now();
  uint64_t last_read = 0, last_written = 0;
  std::mutex timing_mutex;
  std::vector<OpTiming> timings;
  std::mutex params_mutex;
  std::condition_variable params_changed;

  ElementType compute_type() const { return plan.compute_type(); }
  // One rank of several processes (EngineOptions::process_comm).
  bool process_mode() const { return options.process_comm != nullptr; }
  // True on every process when `flag` is true on any (process mode; else `flag`).
  Result<bool> any_rank(bool flag);
  // `mine`, or `others_failed` when it is ok but another process's was not.
  Status agree(Status mine, const std::string& others_failed);
  int local_count() const { return static_cast<int>(ranks.size()); }
  int world() const { return plan.input.world_size; }
  int units() const { return static_cast<int>(plan.units.size()); }

  // --- set-up ----------------------------------------------------------------------

  Status open_rank(Rank& rank);
  Status init_rank(Rank& rank, const std::vector<std::vector<float>>* loaded);
  Status initialize();
  Status init_unit(Rank& rank, int u, const float* full);
  // The NVMe I/O engines' counters, summed over the ranks.
  io::IoCounters nvme_counters() const;
  Status load_moments(Rank& rank, int u, const float* m, const float* v);
  Status resume(const CheckpointReader& checkpoint);
  Status save_rank(Rank& rank, CheckpointWriter& writer, const std::vector<int64_t>& unit_offsets);
  // ready: this process's steps have finished (Engine::finish).
  Result<std::string> save_in_processes(Status ready, const std::string& root, int keep,
                                        const std::vector<int64_t>& unit_offsets, int64_t total,
                                        const nlohmann::ordered_json& units);
  // The JSON files and the manifest, then the rename (Engine::save_checkpoint's end).
  Result<std::string> finish_checkpoint(CheckpointWriter& writer, int keep,
                                        const nlohmann::ordered_json& units);

  // --- execution -------------------------------------------------------------------

  void post_step(const std::shared_ptr<StepRun>& run);
  void run_op(Rank& rank, const std::shared_ptr<StepRun>& run, int op_index);
  Status execute(Rank& rank, StepRun& run, int op_index);
  void wait_params(int64_t step_index, Rank& rank, int unit);
  void publish_params(Rank& rank, int unit, int64_t step_index);

  Status gather(Rank& rank, const PlanOp& op);
  const float* unit_params_fp32(Rank& rank, StepRun& run, int op_index, int unit, int which);
  Status forward(Rank& rank, StepRun& run, int op_index, const PlanOp& op);
  const std::byte* gathered_params(Rank& rank, int op_index, int unit) const;
  const std::byte* gpu_params(Rank& rank, StepRun& run, int op_index, int unit);
  // The CUDA backend: which state lives in GPU memory.
  bool params_on_gpu() const { return plan.input.gpu && plan.homes.param == tiers::Tier::device; }
  bool grads_on_gpu() const { return plan.input.gpu && plan.homes.grad == tiers::Tier::device; }
  bool optimizer_on_gpu() const {
    return plan.input.gpu && plan.homes.optimizer == tiers::Tier::device;
  }
  float* grad_home(Rank& rank, int unit) {
    return reinterpret_cast<float*>(home_data(rank, {unit, ShardKind::grad}));
  }
  Status forward_on_gpu(Rank& rank, StepRun& run, int op_index, const PlanOp& op);
  Status backward(Rank& rank, StepRun& run, int op_index, const PlanOp& op);
  Status reduce(Rank& rank, const PlanOp& op);
  Status exchange(Rank& rank, StepRun& run);
  Status optimize(Rank& rank, StepRun& run, const PlanOp& op);
  Status sync(Rank& rank, const PlanOp& op);

  UnitBatch batch_of(Rank& rank, StepRun& run, int micro) const {
    const int64_t N = plan.tokens_per_micro;
    UnitBatch batch;
    batch.tokens = rank.tokens + micro * N;
    batch.targets = rank.targets + micro * N;
    batch.B = plan.input.micro_batch;
    batch.T = plan.input.seq_len;
    const double scale = rank.optimizer ? rank.optimizer->loss_scale() : 1.0;
    batch.loss_scale = float(scale / run.total_tokens);
    return batch;
  }
  std::byte* home_data(Rank& rank, ShardKey key) {
    Result<tiers::ShardHome> home = rank.store->home(key);
    return home ? home->data : nullptr;
  }
};

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

TrainingPlanInput training_plan_input(const ModelConfig& model, const TrainConfig& config) {
  TrainingPlanInput in;
  in.model = model;
  in.world_size = config.world_size;
  in.stage = config.zero.stage;
  in.offload_param = config.zero.offload_param.device;
  in.offload_optimizer = config.zero.offload_optimizer.device;
  in.precision = config.precision;
  in.micro_batch = config.train_micro_batch_size_per_gpu;
  in.seq_len = effective_seq_len(config, model);
  in.grad_accum = config.gradient_accumulation_steps;
  in.overlap_comm = config.zero.overlap_comm;
  in.reduce_scatter = config.zero.reduce_scatter;
  in.reduce_in_bf16 = config.strata.gradient_reduce_dtype == Precision::bf16;
  // Optimizer::needs_grad_norm() is false exactly then (optimizer_options_from_config).
  in.optimizer_during_backward =
      config.gradient_clipping == 0.0 && config.precision == Precision::fp32;
  in.fetch_slots = std::max(1, config.zero.offload_param.buffer_count);
  in.optimizer_buffers = std::max(2, config.zero.offload_optimizer.buffer_count);
  in.optimizer_chunk_elements = streamed_chunk_elements(config.zero.sub_group_size);
  return in;
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
  for (auto& rank : impl_->ranks)
    for (auto& lane : rank->lanes) lane.reset();
  // NCCL's staging came from this engine's device pool, which goes with it.
  if (auto* nccl = dynamic_cast<comm::NcclComm*>(impl_->options.process_comm.get()))
    nccl->use_staging(nullptr, nullptr, 0);
}

Result<std::unique_ptr<Engine>> Engine::create(EngineOptions options) {
  auto impl = std::make_unique<Impl>();
  const TrainConfig& config = options.config;
  if (!options.data) return Status::error("engine: no data source");
  TrainingPlanInput input = training_plan_input(options.model, config);
  input.gpu = options.backend == kernels::BackendKind::cuda || options.emulate_gpu;
  input.nccl_staging =
      input.gpu && dynamic_cast<comm::NcclComm*>(options.process_comm.get()) != nullptr;
  Result<TrainingPlan> plan = build_training_plan(input);
  if (!plan) return plan.status();
  impl->plan = std::move(*plan);
  const TrainingPlan& p = impl->plan;
  const int W = input.world_size;

  // The budgets, checked before anything is allocated.
  if (options.process_comm && options.process_comm->world_size() != W)
    return Status::error(fmt::format(
        "this process is one of {} ranks but the configuration says world_size {}; launch as "
        "many processes as --world-size",
        options.process_comm->world_size(), W));
  // The host budget is shared by the ranks this process holds.
  const int local = options.process_comm ? 1 : W;
  const uint64_t host_per_rank = options.host_budget / uint64_t(local);
  auto refuse = [&](const char* tier, int64_t need, uint64_t budget, const char* flag) -> Status {
    PlanInput planner = plan_input_from_config(config, options.model);
    planner.nvme_path_known = !options.nvme_paths.empty();
    planner.device_budget = int64_t(options.device_budget);
    planner.host_budget = int64_t(options.host_budget);
    planner.device_budget_source = "--device-mem-limit";
    planner.host_budget_source = "--host-mem-limit";
    MemoryPlan suggestion = plan_with_suggestion(planner);
    std::string hint =
        suggestion.suggestion.empty() ? std::string("raise ") + flag : suggestion.suggestion;
    return Status::error(fmt::format(
        "the plan does not fit: it needs {} of {} per rank but {} allows {}; {} (`strata train "
        "--print-plan` lists every buffer)",
        format_bytes(double(need)), tier, flag, format_bytes(double(budget)), hint));
  };
  if (p.peak(tiers::Tier::device) > int64_t(options.device_budget))
    return refuse("device memory", p.peak(tiers::Tier::device), options.device_budget,
                  "--device-mem-limit");
  if (p.peak(tiers::Tier::host) > int64_t(host_per_rank))
    return refuse("host memory", p.peak(tiers::Tier::host), host_per_rank,
                  local > 1 ? "--host-mem-limit (shared by the ranks)" : "--host-mem-limit");
  if (p.peak(tiers::Tier::nvme) > 0 && options.nvme_paths.empty())
    return Status::error(
        "offload to nvme needs a directory: pass --nvme-path DIR (or "
        "zero_optimization.offload_*.nvme_path)");

  // Which operation finishes each unit's update (its parameters are then ready for the next step).
  impl->publishes.assign(p.ops.size(), false);
  {
    std::vector<int> last(size_t(impl->units()), -1);
    for (size_t i = 0; i < p.ops.size(); ++i) {
      const OpKind k = p.ops[i].kind;
      if (k == OpKind::optimizer || k == OpKind::writeback || k == OpKind::sync)
        last[size_t(p.ops[i].unit)] = int(i);
    }
    for (int i : last) impl->publishes[size_t(i)] = true;
  }

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
  for (auto& rank : impl->ranks)
    for (auto& lane : rank->lanes) lane = std::make_unique<LaneThread>();
  // Step results count the I/O of steps, not of initialisation.
  const io::IoCounters counters = impl->nvme_counters();
  impl->last_read = counters.bytes_read;
  impl->last_written = counters.bytes_written;
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

// Initial parameters: from --init, else from the seed (identical for any
// sharding). One unit at a time: the full fp32 unit is made once and every
// rank takes its part.
Status Engine::Impl::initialize() {
  std::optional<SafetensorsCheckpoint> checkpoint;
  if (!options.init_checkpoint.empty()) {
    Result<SafetensorsCheckpoint> opened = SafetensorsCheckpoint::open(options.init_checkpoint);
    if (!opened) return opened.status().with_context("--init");
    checkpoint.emplace(std::move(*opened));
  }
  std::vector<float> full;
  for (int u = 0; u < units(); ++u) {
    full.assign(size_t(plan.units[size_t(u)].padded_numel), 0.0f);
    if (checkpoint) {
      if (Status s = load_unit_parameters(*checkpoint, plan.layout, u, full.data()); !s)
        return s.with_context("--init " + options.init_checkpoint);
    } else {
      init_unit_parameters(plan.layout, u, options.seed, full.data());
    }
    for (auto& rank : ranks)
      if (Status s = init_unit(*rank, u, full.data()); !s) return s;
  }
  return Status::ok();
}

Status Engine::Impl::open_rank(Rank& rank) {
  const TrainingPlanInput& in = plan.input;
  const int r = rank.rank;
  const int W = world();
  tiers::TieredStoreOptions store;
  // The pools hold what the plan needs (plus a page per buffer of slack),
  // never more than the budgets: a budget is a limit, and the host pool is
  // resident (first-touched, pinned) from the start.
  const uint64_t slack = (plan.buffers.size() + 16) * 4096;
  store.device_capacity =
      std::min<uint64_t>(options.device_budget, uint64_t(plan.peak(tiers::Tier::device)) + slack);
  store.host_capacity = std::min<uint64_t>(options.host_budget / uint64_t(local_count()),
                                           uint64_t(plan.peak(tiers::Tier::host)) + slack);
  // The CPU backend: host memory stands in for the device.
  const bool gpu = in.gpu;
  store.use_gpu = gpu && !options.emulate_gpu;
  store.gpu_index = options.gpu_index;
  store.pin_host = options.pin_host;
  store.notice = options.notice;
  if (plan.peak(tiers::Tier::nvme) > 0) {
    store.io.paths = options.nvme_paths;
    store.io.block_size = uint64_t(options.config.aio.block_size);
    store.io.queue_depth = unsigned(std::max(1, options.config.aio.queue_depth));
    store.io.threads_per_path = unsigned(std::max(1, options.config.aio.intra_op_parallelism));
    store.io.fault_injector = options.fault_injector;
    store.io.notice = options.notice;
    // Extents are rounded to the alignment; a stripe of slack covers the last block.
    const uint64_t stripe = store.io.block_size * std::max<size_t>(1, options.nvme_paths.size());
    store.nvme_capacity =
        (uint64_t(plan.peak(tiers::Tier::nvme)) + stripe - 1) / stripe * stripe + stripe;
    // One file per engine and rank: engines of one process (or of several) may share a directory.
    store.nvme_file_name = fmt::format("strata-{}-{}-rank{}.swap", ::getpid(), engine_serial, r);
  }
  Result<std::unique_ptr<tiers::TieredStore>> opened = tiers::TieredStore::open(store);
  if (!opened) return opened.status().with_context(fmt::format("rank {}", r));
  rank.store = std::move(*opened);
  tiers::TieredStore& s = *rank.store;

  const int cb = plan.compute_bytes;
  for (int u = 0; u < units(); ++u) {
    const UnitPlacement& p = plan.units[size_t(u)];
    Status added =
        s.add_shard({u, ShardKind::param}, uint64_t(p.param_numel * cb), plan.homes.param);
    if (added)
      added = s.add_shard({u, ShardKind::grad}, uint64_t(p.grad_numel * 4), plan.homes.grad);
    if (added && plan.homes.separate_master)
      added = s.add_shard({u, ShardKind::master}, uint64_t(p.optimizer_numel * 4),
                          plan.homes.optimizer);
    if (added)
      added = s.add_shard({u, ShardKind::m}, uint64_t(p.optimizer_numel * 4), plan.homes.optimizer);
    if (added)
      added = s.add_shard({u, ShardKind::v}, uint64_t(p.optimizer_numel * 4), plan.homes.optimizer);
    if (!added) return added.with_context(fmt::format("rank {}", r));
  }

  // Buffers, named as the plan lists them.
  auto device = [&](int64_t bytes, const std::string& what) -> Result<std::byte*> {
    Result<tiers::DeviceBlock> block = s.device_tier()->allocate(uint64_t(bytes), what);
    if (!block) return block.status().with_context(fmt::format("rank {}", r));
    rank.device_blocks.push_back(*block);
    return block->data;
  };
  auto host = [&](int64_t bytes, const std::string& what) -> Result<std::byte*> {
    Result<tiers::HostBlock> block = s.host_tier().allocate(uint64_t(bytes), what);
    if (!block) return block.status().with_context(fmt::format("rank {}", r));
    rank.host_blocks.push_back(*block);
    return block->data;
  };
  int64_t largest_padded = 0, largest_shard = 0, largest_optimizer = 0;
  for (const UnitPlacement& p : plan.units) {
    largest_padded = std::max(largest_padded, p.padded_numel);
    largest_shard = std::max(largest_shard, p.shard_numel);
    largest_optimizer = std::max(largest_optimizer, p.optimizer_numel);
  }
  // Takes a block for `out`, or returns the allocation's error.
  auto take = [](Result<std::byte*> block, auto*& out) -> Status {
    if (!block) return block.status();
    out = reinterpret_cast<std::remove_reference_t<decltype(out)>>(*block);
    return Status::ok();
  };
  // On the CUDA backend the buffers of the collectives and the optimizer are
  // pinned host memory; GpuRank holds the device's working set.
  auto staging = [&](int64_t bytes, const std::string& what) {
    return gpu ? host(bytes, what) : device(bytes, what);
  };
  for (int k = 0; k < plan.gather_slots && !plan.gpu_params_in_place(); ++k) {
    std::byte* g = nullptr;
    if (Status t = take(staging(largest_padded * cb, "gathered unit"), g); !t) return t;
    rank.gathered.push_back(g);
    if (cb != 4 && !gpu) {
      float* f = nullptr;
      if (Status t = take(device(largest_padded * 4, "gathered unit (fp32)"), f); !t) return t;
      rank.gathered_fp32.push_back(f);
    }
  }
  if (in.stage < 3 && cb != 4 && !gpu) {
    for (int k = 0; k < 2; ++k) {
      float* f = nullptr;
      if (Status t = take(device(largest_padded * 4, "parameters widened to fp32"), f); !t)
        return t;
      rank.widened.push_back(f);
    }
  }
  // Gradients may accumulate straight into their homes on the GPU.
  const bool in_homes = plan.gpu_grads_in_place();
  for (int k = 0; k < plan.grad_slots && !in_homes; ++k) {
    float* g = nullptr;
    if (Status t = take(staging(largest_padded * 4, "unit gradient"), g); !t) return t;
    rank.grad_slots.push_back(g);
  }
  if (plan.tied_grad_buffer && !in_homes) {
    if (Status t = take(staging(plan.units[0].padded_numel * 4, "tied embedding gradient"),
                        rank.tied_grad);
        !t)
      return t;
  }
  if (in.stage >= 2 && in.reduce_scatter && W > 1 && !in_homes) {
    if (Status t = take(staging(largest_shard * 4, "reduce-scatter output"), rank.reduce_out); !t)
      return t;
  }
  if (gpu && (in.stage == 1 || in.stage == 2) && W > 1) {
    if (Status t =
            take(host(largest_padded * cb, "parameter all-gather staging"), rank.sync_staging);
        !t)
      return t;
  }
  const int64_t N = plan.tokens_per_micro, C = in.model.hidden_size;
  int32_t* ids = nullptr;
  if (Status t = take(staging(2 * N * 4 * in.grad_accum, "tokens and targets"), ids); !t) return t;
  rank.tokens = ids;
  rank.targets = ids + N * in.grad_accum;
  if (plan.input.nccl_staging) {
    // NCCL stages the collectives' host buffers through the pool, not memory of its own.
    std::byte* send = nullptr;
    std::byte* recv = nullptr;
    if (Status t = take(device(largest_padded * 4, "NCCL staging (send)"), send); !t) return t;
    if (Status t = take(device(largest_padded * 4, "NCCL staging (receive)"), recv); !t) return t;
    if (auto* nccl = dynamic_cast<comm::NcclComm*>(rank.comm.get()))
      nccl->use_staging(send, recv, size_t(largest_padded) * 4);
  }
  if (gpu) {
    Result<std::unique_ptr<GpuRank>> created =
        options.emulate_gpu
            ? GpuRank::create_emulated(plan)
            : GpuRank::create(plan, options.gpu_index, *s.device_tier(), rank.device_blocks);
    if (!created) return created.status().with_context(fmt::format("rank {}", r));
    rank.gpu = std::move(*created);
  } else {
    float* checkpoints = nullptr;
    if (Status t = take(device((units() - 1) * N * C * 4, "activation checkpoints"), checkpoints);
        !t)
      return t;
    for (int u = 0; u + 1 < units(); ++u)
      rank.checkpoints.push_back(checkpoints + int64_t(u) * N * C);
    if (Status t = take(device(N * C * 4, "activation gradient"), rank.activation_grad); !t)
      return t;
    // The workspace allocates its own memory; its bytes are charged to the device budget here.
    std::byte* reserved = nullptr;
    if (Status t = take(device(UnitWorkspace::bytes_for(in.model, in.micro_batch, in.seq_len),
                               "unit working set"),
                        reserved);
        !t)
      return t;
    rank.ws = std::make_unique<UnitWorkspace>(in.model, in.micro_batch, in.seq_len);
  }
  // NVMe parameter copies (plan.fetch_slots) are the store's prefetched copies, charged when
  // fetched.
  if (plan.new_params_staged()) {
    if (Status t = take(host(largest_optimizer * cb, "new parameters"), rank.param_out); !t)
      return t;
  }
  if (plan.streamed_optimizer) {
    tiers::StreamedPassOptions pass;
    pass.buffer_count = unsigned(in.optimizer_buffers);
    pass.buffer_bytes = uint64_t(plan.optimizer_chunk_elements) * 12;
    Result<std::unique_ptr<tiers::StreamedPass>> created = tiers::StreamedPass::create(s, pass);
    if (!created)
      return created.status().with_context(fmt::format("rank {}: streamed optimizer", r));
    rank.pass = std::move(*created);
  }

  Result<Optimizer> optimizer =
      Optimizer::create(optimizer_options_from_config(options.config, options.total_steps));
  if (!optimizer) return optimizer.status();
  rank.optimizer.emplace(std::move(*optimizer));

  // Parameter groups over this rank's optimizer range of each unit; padding has no decay.
  rank.segments.resize(size_t(units()));
  for (int u = 0; u < units(); ++u) {
    const int64_t begin = plan.optimizer_offset(u, r);
    const int64_t end = begin + plan.units[size_t(u)].optimizer_numel;
    std::vector<ShardSegment>& out = rank.segments[size_t(u)];
    int64_t at = begin;
    for (const TensorSlot& slot : plan.layout.units[size_t(u)].tensors) {
      const int64_t b = std::max(begin, slot.offset), e = std::min(end, slot.offset + slot.numel);
      if (b >= e) continue;
      if (b > at) out.push_back({at - begin, b - begin, ParamGroup::no_decay});
      out.push_back({b - begin, e - begin, param_group_for_shape(slot.shape)});
      at = e;
    }
    if (at < end) out.push_back({at - begin, end - begin, ParamGroup::no_decay});
  }
  rank.micro_loss.assign(size_t(in.grad_accum), 0.0);
  rank.partials.assign(size_t(units()), {});
  rank.params_ready = std::make_unique<std::atomic<int64_t>[]>(size_t(units()));
  for (int u = 0; u < units(); ++u) rank.params_ready[size_t(u)] = -1;
  return Status::ok();
}

Status Engine::Impl::init_unit(Rank& rank, int u, const float* full) {
  const UnitPlacement& p = plan.units[size_t(u)];
  const int r = rank.rank;
  const int cb = plan.compute_bytes;
  const int64_t param_begin = plan.input.stage == 3 ? int64_t(r) * p.shard_numel : 0;
  std::vector<std::byte> bytes(size_t(p.param_numel * cb));
  narrow(full + param_begin, compute_type(), bytes.data(), p.param_numel);
  if (Status s = rank.store->write_shard({u, ShardKind::param}, bytes); !s) return s;
  if (plan.homes.separate_master) {
    const int64_t begin = plan.optimizer_offset(u, r);
    std::span<const std::byte> master(reinterpret_cast<const std::byte*>(full + begin),
                                      size_t(p.optimizer_numel) * 4);
    if (Status s = rank.store->write_shard({u, ShardKind::master}, master); !s) return s;
  }
  return Status::ok();
}

Status Engine::Impl::load_moments(Rank& rank, int u, const float* m, const float* v) {
  const UnitPlacement& p = plan.units[size_t(u)];
  const int64_t begin = plan.optimizer_offset(u, rank.rank);
  const size_t bytes = size_t(p.optimizer_numel) * 4;
  if (Status s = rank.store->write_shard({u, ShardKind::m},
                                         {reinterpret_cast<const std::byte*>(m + begin), bytes});
      !s)
    return s;
  return rank.store->write_shard({u, ShardKind::v},
                                 {reinterpret_cast<const std::byte*>(v + begin), bytes});
}

// --- checkpoints -----------------------------------------------------------------------

namespace {

// The shape keys a checkpoint must share with the model it resumes.
nlohmann::json model_shape(const nlohmann::json& config) {
  nlohmann::json shape;
  for (const char* key :
       {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"})
    shape[key] = config.contains(key) ? config[key] : nlohmann::json();
  return shape;
}

}  // namespace

Status Engine::Impl::resume(const CheckpointReader& checkpoint) {
  const nlohmann::json here = model_shape(model_config_to_json(plan.layout.config));
  const nlohmann::json there = model_shape(checkpoint.model);
  for (const auto& [key, value] : here.items()) {
    if (there[key] != value)
      return Status::error(
          fmt::format("the checkpoint belongs to another model shape: {} is {} there and {} "
                      "here; pass the model it was trained with",
                      key, there[key].dump(), value.dump()));
  }
  const nlohmann::json& state = checkpoint.state;
  int64_t offset = 0;
  std::vector<float> master, m, v;
  for (int u = 0; u < units(); ++u) {
    const UnitLayout& unit = plan.layout.units[size_t(u)];
    const nlohmann::json& stored = state["units"][size_t(u)];
    if (stored.value("numel", int64_t{-1}) != unit.numel ||
        stored.value("name", std::string()) != unit.unit.name)
      return Status::error(
          fmt::format("state.json: unit {} differs from this model's {}", u, unit.unit.name));
    const size_t padded = size_t(unit.padded_numel);
    master.assign(padded, 0.0f);
    m.assign(padded, 0.0f);
    v.assign(padded, 0.0f);
    const uint64_t bytes = uint64_t(unit.numel) * 4;
    if (Status s = checkpoint.read(0, uint64_t(offset) * 4, master.data(), bytes); !s) return s;
    if (Status s = checkpoint.read(1, uint64_t(offset) * 4, m.data(), bytes); !s) return s;
    if (Status s = checkpoint.read(2, uint64_t(offset) * 4, v.data(), bytes); !s) return s;
    for (auto& rank : ranks) {
      if (Status s = init_unit(*rank, u, master.data()); !s) return s;
      if (Status s = load_moments(*rank, u, m.data(), v.data()); !s) return s;
    }
    offset += unit.numel;
  }
  OptimizerState optimizer;
  const nlohmann::json& o = state["optimizer"];
  optimizer.applied_steps = o.value("applied_steps", int64_t{0});
  optimizer.skipped_steps = o.value("skipped_steps", int64_t{0});
  optimizer.scheduler_iteration = o.value("scheduler_iteration", int64_t{-1});
  optimizer.loss_scaler.scale = o["loss_scaler"].value("scale", 1.0);
  optimizer.loss_scaler.iteration = o["loss_scaler"].value("iteration", int64_t{0});
  optimizer.loss_scaler.last_overflow_iteration =
      o["loss_scaler"].value("last_overflow_iteration", int64_t{-1});
  optimizer.loss_scaler.hysteresis_left = o["loss_scaler"].value("hysteresis_left", 2);
  for (auto& rank : ranks) rank->optimizer->restore(optimizer);
  steps_done = state.value("step", int64_t{0});
  sequence_offset = state.value("sequence_offset", int64_t{0});
  // The loaded parameters are the update of the step before the next one.
  for (auto& rank : ranks)
    for (int u = 0; u < units(); ++u) rank->params_ready[size_t(u)] = steps_done - 1;
  return Status::ok();
}

Status Engine::Impl::save_rank(Rank& rank, CheckpointWriter& writer,
                               const std::vector<int64_t>& unit_offsets) {
  const bool master_is_param = !plan.homes.separate_master;
  for (int u = 0; u < units(); ++u) {
    const UnitLayout& unit = plan.layout.units[size_t(u)];
    const UnitPlacement& p = plan.units[size_t(u)];
    const int64_t begin = plan.optimizer_offset(u, rank.rank);
    const int64_t count = std::min(unit.numel, begin + p.optimizer_numel) - begin;  // unpadded part
    if (count <= 0) continue;
    const uint64_t file_offset = uint64_t(unit_offsets[size_t(u)] + begin) * 4;
    const ShardKey keys[3] = {{u, master_is_param ? ShardKind::param : ShardKind::master},
                              {u, ShardKind::m},
                              {u, ShardKind::v}};
    // Element `begin` of the unit sits at this element of each shard.
    const int64_t master_start = master_is_param && plan.input.stage < 3 ? begin : 0;
    if (optimizer_on_gpu()) {
      // Homes on the GPU: each shard passes through host memory once (outside the budgets).
      for (int f = 0; f < 3; ++f) {
        Result<tiers::ShardHome> home = rank.store->home(keys[f]);
        if (!home) return home.status();
        std::vector<std::byte> bytes(size_t(home->bytes));
        if (Status s = rank.store->read_shard(keys[f], bytes); !s) return s;
        const std::byte* data = bytes.data() + (f == 0 ? master_start : 0) * 4;
        if (Status s = writer.write(f, file_offset, data, uint64_t(count) * 4); !s) return s;
      }
      continue;
    }
    if (plan.homes.optimizer != tiers::Tier::nvme) {
      for (int f = 0; f < 3; ++f) {
        const std::byte* data = home_data(rank, keys[f]) + (f == 0 ? master_start : 0) * 4;
        if (Status s = writer.write(f, file_offset, data, uint64_t(count) * 4); !s) return s;
      }
      continue;
    }
    // NVMe homes: chunk by chunk through the streamed pass's buffers, read-only.
    std::vector<tiers::StreamItem> items;
    const int64_t chunk = plan.optimizer_chunk_elements;
    for (int64_t at = 0; at < p.optimizer_numel; at += chunk) {
      const int64_t n = std::min(chunk, p.optimizer_numel - at);
      tiers::StreamItem item;
      for (int f = 0; f < 3; ++f) {
        tiers::StreamPiece piece{keys[f], uint64_t(at) * 4, uint64_t(n) * 4};
        piece.write = false;
        item.pieces.push_back(piece);
      }
      items.push_back(std::move(item));
    }
    Status status =
        rank.pass->run(items, [&](size_t index, std::span<std::byte* const> pieces) -> Status {
          const int64_t at = int64_t(index) * chunk;
          const int64_t n = std::min(chunk, count - at);
          if (n <= 0) return Status::ok();
          for (int f = 0; f < 3; ++f) {
            if (Status s = writer.write(f, file_offset + uint64_t(at) * 4, pieces[size_t(f)],
                                        uint64_t(n) * 4);
                !s)
              return s;
          }
          return Status::ok();
        });
    if (!status) return status;
  }
  return Status::ok();
}

Result<std::string> Engine::save_checkpoint(const std::string& root, int keep) {
  Impl& im = *impl_;
  if (im.poisoned)
    return Status::error("engine: an earlier step failed (" + im.poison_reason + "); not saving");
  // Several processes agree on it first (save_in_processes).
  const Status finished = finish();
  if (!finished && !im.process_mode()) return finished;
  std::vector<int64_t> unit_offsets;
  int64_t total = 0;
  nlohmann::ordered_json units = nlohmann::ordered_json::array();
  for (const UnitLayout& unit : im.plan.layout.units) {
    unit_offsets.push_back(total);
    units.push_back({{"name", unit.unit.name}, {"numel", unit.numel}, {"offset", total}});
    total += unit.numel;
  }
  // At stage 0 every rank holds the whole state: rank 0 writes it.
  auto writes = [&](const Impl::Rank& rank) { return im.plan.input.stage != 0 || rank.rank == 0; };
  if (im.process_mode())
    return im.save_in_processes(finished, root, keep, unit_offsets, total, units);
  Result<CheckpointWriter> writer =
      CheckpointWriter::begin(root, im.steps_done, uint64_t(total) * 4);
  if (!writer) return writer.status();
  std::vector<Status> results(im.ranks.size());
  {
    std::vector<std::thread> threads;
    for (size_t i = 0; i < im.ranks.size(); ++i)
      threads.emplace_back([&, i] {
        if (writes(*im.ranks[i])) results[i] = im.save_rank(*im.ranks[i], *writer, unit_offsets);
      });
    for (auto& t : threads) t.join();
  }
  for (const Status& s : results)
    if (!s) return s.with_context("saving a checkpoint");
  return im.finish_checkpoint(*writer, keep, units);
}

// One rank of several processes: rank 0 begins the checkpoint, every rank
// writes its part into the same files, rank 0 finishes it once all have.
// Every step is followed by an agreement, so a failure on one rank fails all.
Result<std::string> Engine::Impl::save_in_processes(Status ready, const std::string& root, int keep,
                                                    const std::vector<int64_t>& unit_offsets,
                                                    int64_t total,
                                                    const nlohmann::ordered_json& units) {
  Rank& rank = *ranks[0];
  auto agree = [&](Status status, const char* what) {
    return this->agree(status, fmt::format("saving a checkpoint: another rank failed to {}", what));
  };
  std::optional<CheckpointWriter> writer;
  Status begun = ready;
  if (begun && rank.rank == 0) {
    Result<CheckpointWriter> made = CheckpointWriter::begin(root, steps_done, uint64_t(total) * 4);
    if (made)
      writer.emplace(std::move(*made));
    else
      begun = made.status();
  }
  if (Status s = agree(begun, "begin it"); !s) return s;
  Status written = Status::ok();
  if (rank.rank != 0) {
    Result<CheckpointWriter> joined = CheckpointWriter::join(root, steps_done);
    if (joined)
      writer.emplace(std::move(*joined));
    else
      written = joined.status();
  }
  if (written && (plan.input.stage != 0 || rank.rank == 0))
    written = save_rank(rank, *writer, unit_offsets);
  if (written) written = writer->flush();
  if (Status s = agree(written.with_context("saving a checkpoint"), "write its part"); !s) return s;
  Result<std::string> finished = writer->final_directory();
  if (rank.rank == 0) finished = finish_checkpoint(*writer, keep, units);
  if (Status s = agree(finished.status(), "finish it"); !s) return s;
  return finished;
}

Result<std::string> Engine::Impl::finish_checkpoint(CheckpointWriter& writer, int keep,
                                                    const nlohmann::ordered_json& units) {
  const OptimizerState& o = ranks[0]->optimizer->state();
  nlohmann::ordered_json state;
  state["format"] = kCheckpointFormat;
  state["step"] = steps_done;
  state["sequence_offset"] = sequence_offset;
  state["seed"] = options.seed;
  state["world_size"] = world();
  state["stage"] = plan.input.stage;
  state["precision"] = precision_name(plan.input.precision);
  state["optimizer"] = {{"applied_steps", o.applied_steps},
                        {"skipped_steps", o.skipped_steps},
                        {"scheduler_iteration", o.scheduler_iteration},
                        {"loss_scaler",
                         {{"scale", o.loss_scaler.scale},
                          {"iteration", o.loss_scaler.iteration},
                          {"last_overflow_iteration", o.loss_scaler.last_overflow_iteration},
                          {"hysteresis_left", o.loss_scaler.hysteresis_left}}}};
  state["units"] = units;
  if (Status s = writer.write_json("model.json", model_config_to_json(plan.layout.config)); !s)
    return s;
  if (Status s = writer.write_json("train.json", train_config_to_json(options.config)); !s)
    return s;
  if (Status s = writer.write_json("state.json", state); !s) return s;
  return writer.finish(keep);
}

int64_t Engine::steps_done() const {
  return impl_->steps_done;
}

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
  // Optimizer state on NVMe: chunks stream through the pass's buffers.
  std::vector<tiers::StreamItem> items;
  std::vector<int64_t> begins;
  const int64_t chunk = plan.optimizer_chunk_elements;
  for (int64_t begin = 0; begin < numel; begin += chunk) {
    const int64_t count = std::min(chunk, numel - begin);
    tiers::StreamItem item;
    item.pieces.push_back({master_key, uint64_t(begin) * 4, uint64_t(count) * 4});
    item.pieces.push_back({{u, ShardKind::m}, uint64_t(begin) * 4, uint64_t(count) * 4});
    item.pieces.push_back({{u, ShardKind::v}, uint64_t(begin) * 4, uint64_t(count) * 4});
    items.push_back(std::move(item));
    begins.push_back(begin);
  }
  return publish(
      rank.pass->run(items, [&](size_t index, std::span<std::byte* const> pieces) -> Status {
        const int64_t begin = begins[index];
        const int64_t count = std::min(chunk, numel - begin);
        return update(reinterpret_cast<float*>(pieces[0]), reinterpret_cast<float*>(pieces[1]),
                      reinterpret_cast<float*>(pieces[2]), begin, count);
      }));
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
    if (!rank->gpu) continue;
    if (Status s = rank->gpu->synchronize(); !s)
      return s.with_context(fmt::format("rank {}", rank->rank));
  }
  return Status::ok();
}

Status Engine::read_unit_parameters(int unit, float* flat) {
  Impl& im = *impl_;
  if (unit < 0 || unit >= im.units()) return Status::error(fmt::format("no unit {}", unit));
  const UnitPlacement& p = im.plan.units[size_t(unit)];
  const bool master = im.plan.homes.separate_master;
  const int ranks = im.plan.input.stage == 0 ? 1 : im.world();
  if (im.process_mode() && ranks > 1) {
    // Each process holds one rank's range: read it, then gather every rank's.
    // The processes agree first, so one that failed does not leave the others waiting.
    Impl::Rank& rank = *im.ranks[0];
    const ShardKey key{unit, master ? ShardKind::master : ShardKind::param};
    const int64_t stored = master ? p.optimizer_numel : p.param_numel;
    std::vector<std::byte> bytes(size_t(stored) * 4);
    Status read = finish();
    if (read) read = rank.store->read_shard(key, bytes);
    if (Status s =
            im.agree(read, "another rank failed to read its parameters (its own error says why)");
        !s)
      return s;
    const int64_t from =
        master || im.plan.input.stage == 3 ? 0 : im.plan.optimizer_offset(unit, rank.rank);
    return rank.comm->all_gather(bytes.data() + from * 4, flat, size_t(p.optimizer_numel),
                                 comm::DataType::fp32);
  }
  if (Status s = finish(); !s) return s;
  for (int r = 0; r < ranks; ++r) {
    Impl::Rank& rank = *im.ranks[size_t(r)];
    const int64_t offset = im.plan.optimizer_offset(unit, r);
    const ShardKey key{unit, master ? ShardKind::master : ShardKind::param};
    const int64_t stored = master ? p.optimizer_numel : p.param_numel;
    std::vector<std::byte> bytes(size_t(stored) * 4);
    if (Status s = rank.store->read_shard(key, bytes); !s) return s;
    const int64_t from = master || im.plan.input.stage == 3 ? 0 : offset;
    std::memcpy(flat + offset, bytes.data() + from * 4, size_t(p.optimizer_numel) * 4);
  }
  return Status::ok();
}

Result<HostModel> Engine::read_model() {
  Impl& im = *impl_;
  HostModel model = make_host_model(im.plan.layout.config, 1);
  std::vector<float> flat;
  for (int u = 0; u < im.units(); ++u) {
    flat.assign(size_t(im.plan.units[size_t(u)].padded_numel), 0.0f);
    if (Status s = read_unit_parameters(u, flat.data()); !s) return s;
    for (const TensorSlot& slot : im.plan.layout.units[size_t(u)].tensors)
      std::memcpy(model.params[size_t(u)].data() + slot.offset, flat.data() + slot.offset,
                  size_t(slot.numel) * 4);
  }
  return model;
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

io::IoCounters Engine::Impl::nvme_counters() const {
  io::IoCounters total;
  for (const auto& rank : ranks) {
    if (!rank->store || !rank->store->nvme_tier()) continue;
    const io::IoCounters c = rank->store->nvme_tier()->engine().counters();
    total.bytes_read += c.bytes_read;
    total.bytes_written += c.bytes_written;
  }
  return total;
}

uint64_t Engine::nvme_bytes_read() const {
  return impl_->nvme_counters().bytes_read;
}

uint64_t Engine::nvme_bytes_written() const {
  return impl_->nvme_counters().bytes_written;
}

std::vector<OpTiming> Engine::take_timings() {
  std::lock_guard lock(impl_->timing_mutex);
  return std::exchange(impl_->timings, {});
}

}  // namespace strata
