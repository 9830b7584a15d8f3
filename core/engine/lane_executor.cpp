#include "core/engine/lane_executor.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <thread>
#include <utility>

#include "core/plan/training_plan.h"

namespace strata {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

bool is_collective(OpKind kind) {
  return kind == OpKind::gather || kind == OpKind::reduce || kind == OpKind::exchange ||
         kind == OpKind::sync || kind == OpKind::share;
}

}  // namespace

std::vector<LaneOp> lane_ops(const TrainingPlan& plan) {
  std::vector<LaneOp> ops;
  ops.reserve(plan.ops.size());
  for (const PlanOp& op : plan.ops)
    ops.push_back({static_cast<int>(op.lane), op.deps, is_collective(op.kind), op_label(plan, op)});
  return ops;
}

// --- progress ------------------------------------------------------------------------

StepProgress::StepProgress(int64_t step, int ranks, size_t ops)
    : step_(step),
      done_(size_t(ranks), std::vector<uint8_t>(ops, 0)),
      remaining_(size_t(ranks) * ops) {}

Status StepProgress::status() const {
  std::lock_guard lock(mutex_);
  return error_.value_or(Status::ok());
}

bool StepProgress::failed() const {
  std::lock_guard lock(mutex_);
  return error_.has_value();
}

Status StepProgress::wait_done(int op) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return error_.has_value() || std::all_of(done_.begin(), done_.end(),
                                             [&](const auto& rank) { return rank[size_t(op)]; });
  });
  return error_.value_or(Status::ok());
}

Status StepProgress::wait_all() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return remaining_ == 0; });
  return error_.value_or(Status::ok());
}

double StepProgress::stall_seconds() const {
  std::lock_guard lock(mutex_);
  return stall_seconds_;
}

void StepProgress::wait_for(int rank, const std::vector<int>& deps) {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] {
    return std::all_of(deps.begin(), deps.end(),
                       [&](int d) { return done_[size_t(rank)][size_t(d)] != 0; });
  });
}

void StepProgress::add_stall(double seconds) {
  std::lock_guard lock(mutex_);
  stall_seconds_ += seconds;
}

void StepProgress::mark_done(int rank, int op, Status status) {
  {
    std::lock_guard lock(mutex_);
    if (!status && !error_) error_ = std::move(status);
    done_[size_t(rank)][size_t(op)] = 1;
    remaining_ -= 1;
  }
  changed_.notify_all();
}

// --- lanes ---------------------------------------------------------------------------

// One thread running closures in the order they were posted; it ends once
// told to stop and its queue is empty.
class LaneExecutor::LaneThread {
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
  std::thread thread_;  // last: starts once the members above exist
};

LaneExecutor::LaneExecutor(std::vector<LaneOp> ops, LaneExecutorOptions options)
    : ops_(std::move(ops)), options_(std::move(options)) {
  int lanes = 1;
  if (!options_.one_lane)
    for (const LaneOp& op : ops_) lanes = std::max(lanes, op.lane + 1);
  lanes_.resize(options_.ranks.size());
  for (auto& rank : lanes_)
    for (int l = 0; l < lanes; ++l) rank.push_back(std::make_unique<LaneThread>());
}

LaneExecutor::~LaneExecutor() {
  // The lanes first: their operations use the options and record timings.
  lanes_.clear();
}

std::shared_ptr<StepProgress> LaneExecutor::start_step(
    int64_t step, std::function<Status(int rank, int op)> run) {
  auto progress = std::make_shared<StepProgress>(step, int(lanes_.size()), ops_.size());
  // Shared by the step's closures and gone with the last of them (the
  // progress does not hold it, so a `run` that holds the progress is no cycle).
  auto shared_run = std::make_shared<const std::function<Status(int, int)>>(std::move(run));
  for (size_t r = 0; r < lanes_.size(); ++r) {
    for (size_t i = 0; i < ops_.size(); ++i) {
      const size_t lane = options_.one_lane ? 0 : size_t(ops_[i].lane);
      lanes_[r][lane]->post(
          [this, progress, shared_run, r, i] { run_op(int(r), *progress, *shared_run, int(i)); });
    }
  }
  return progress;
}

void LaneExecutor::run_op(int rank, StepProgress& progress,
                          const std::function<Status(int, int)>& run, int op_index) {
  const LaneOp& op = ops_[size_t(op_index)];
  const Clock::time_point wait_start = Clock::now();
  progress.wait_for(rank, op.deps);
  if (options_.before) options_.before(rank, progress.step(), op_index);
  if (op.lane == options_.stall_lane) progress.add_stall(seconds_between(wait_start, Clock::now()));
  const Clock::time_point start = Clock::now();
  Status status = Status::ok();
  // After a failure the remaining operations only keep the ranks in step:
  // collectives still run (their ranks wait for each other), the rest is skipped.
  if (!progress.failed() || op.collective) status = run(rank, op_index);
  const Clock::time_point end = Clock::now();
  if (options_.after) options_.after(rank, progress.step(), op_index);
  const int rank_number = options_.ranks[size_t(rank)];
  {
    std::lock_guard lock(timing_mutex_);
    timings_.push_back({rank_number, op_index, progress.step(),
                        seconds_between(options_.origin, start),
                        seconds_between(options_.origin, end)});
  }
  if (!status) status = status.with_context(fmt::format("rank {}, {}", rank_number, op.name));
  progress.mark_done(rank, op_index, std::move(status));
}

std::vector<OpTiming> LaneExecutor::take_timings() {
  std::lock_guard lock(timing_mutex_);
  return std::exchange(timings_, {});
}

}  // namespace strata
