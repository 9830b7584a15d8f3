// The lane executor: runs a plan's operations (core/plan/training_plan.h),
// step after step, for the ranks this process holds. It is how the engine
// runs its steps; it knows nothing of what an operation does.
//
// Each rank has one thread per lane. A lane runs its operations in plan
// order, one step after the other; an operation starts once its
// dependencies (earlier operations of the same step on the same rank) are
// done. The lanes are not an optimisation only: an operation may wait for
// work that a later-planned operation of another lane does (a compute
// waiting for a transfer the io lane starts), which one thread running the
// plan in order can never reach (tests/lane_executor_test.cpp shows the
// one-lane executor deadlock where this one finishes).
//
// What happens to one operation, in this order: it waits for its
// dependencies, then for the `before` hook (waits that are not this step's
// dependencies, e.g. the previous step's update of the parameters it reads);
// it runs, unless an operation of this step already failed on one of this
// executor's ranks, in which case only collectives run (every rank takes part
// in them: skipping one would leave the other ranks, threads or processes,
// waiting in it); the `after` hook runs whether it ran, failed or was skipped; then it
// counts as done. The step's error is the first failure, prefixed with
// "rank R, NAME". The time the stall lane's operations spend waiting (for
// their dependencies and in `before`) is summed per step; every operation's
// start and end are kept for traces (take_timings).
//
// Thread-safety: start_step is called by one thread, steps in order;
// take_timings and StepProgress may be used from any thread. The hooks and
// the run function are called from the lane threads, concurrently. The
// destructor waits for every operation of the steps started, then ends the
// lanes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/engine/engine.h"  // OpTiming
#include "io/base/status.h"

namespace strata {

struct TrainingPlan;

// What the executor knows of one operation.
struct LaneOp {
  int lane = 0;             // which of its rank's lane threads runs it, from 0
  std::vector<int> deps;    // indices of earlier operations of the same step and rank
  bool collective = false;  // every rank takes part: it runs even after a failure
  std::string name;         // names it in the step's error: "forward(head) mb 1"
};

// The plan's operations as the executor sees them: each on its lane, the
// collectives (gather, reduce, exchange, sync) marked, named by op_label.
std::vector<LaneOp> lane_ops(const TrainingPlan& plan);

struct LaneExecutorOptions {
  // The ranks to run, by number (errors and timings name them by it); the
  // hooks and the run function get the index into this list.
  std::vector<int> ranks{0};
  // One thread per rank runs every operation in plan order. Never the
  // engine's: it shows what the lanes are for (tests/lane_executor_test.cpp).
  bool one_lane = false;
  // Whose waiting is counted in StepProgress::stall_seconds (-1: none).
  int stall_lane = -1;
  // Called once an operation's dependencies are done, before it runs (it may block).
  std::function<void(int rank, int64_t step, int op)> before;
  // Called once an operation ran, failed or was skipped, before it counts as done.
  std::function<void(int rank, int64_t step, int op)> after;
  // Timings are in seconds since this instant.
  std::chrono::steady_clock::time_point origin = std::chrono::steady_clock::now();
};

// One step on the ranks of one executor: which operations are done, the
// first error, the stall lane's waiting. Thread-safe.
class StepProgress {
 public:
  StepProgress(int64_t step, int ranks, size_t ops);

  int64_t step() const { return step_; }
  // The first error so far, or ok.
  Status status() const;
  bool failed() const;
  // Blocks until operation `op` is done on every rank, or an operation has
  // failed; returns status().
  Status wait_done(int op);
  // Blocks until every operation is done (ran, failed or skipped) on every rank;
  // returns status().
  Status wait_all();
  // Seconds the stall lane's operations have waited so far, summed over the ranks.
  double stall_seconds() const;

 private:
  friend class LaneExecutor;
  void wait_for(int rank, const std::vector<int>& deps);
  void add_stall(double seconds);
  // Operation `op` of `rank` is done; `status` is its outcome (ok when skipped).
  void mark_done(int rank, int op, Status status);

  const int64_t step_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::vector<uint8_t>> done_;  // [rank][op]
  size_t remaining_ = 0;
  std::optional<Status> error_;
  double stall_seconds_ = 0;
};

class LaneExecutor {
 public:
  // Starts the lane threads. `ops` are in plan order.
  LaneExecutor(std::vector<LaneOp> ops, LaneExecutorOptions options);
  ~LaneExecutor();
  LaneExecutor(const LaneExecutor&) = delete;
  LaneExecutor& operator=(const LaneExecutor&) = delete;

  // Hands every operation of step `step` on every rank to its lane, after
  // those of the steps started before; run(rank, op) does operation `op` on
  // rank index `rank`. Returns at once; the progress says when it is done.
  std::shared_ptr<StepProgress> start_step(int64_t step,
                                           std::function<Status(int rank, int op)> run);
  // The timings of every operation done since the last call, in no fixed order.
  std::vector<OpTiming> take_timings();

 private:
  class LaneThread;
  void run_op(int rank, StepProgress& progress, const std::function<Status(int, int)>& run, int op);

  const std::vector<LaneOp> ops_;
  const LaneExecutorOptions options_;
  std::vector<std::vector<std::unique_ptr<LaneThread>>> lanes_;  // [rank][lane]
  std::mutex timing_mutex_;
  std::vector<OpTiming> timings_;
};

}  // namespace strata
