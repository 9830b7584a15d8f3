// The lane executor (core/engine/lane_executor.h), the engine's way of running
// a plan: why it needs a thread per lane (an operation waiting for one planned
// after it on another lane finishes with lanes and deadlocks on one), that
// dependencies and each lane's plan order hold on random plans, and what a
// failure does to the rest of the step.
//
// A deadlock is detected by waiting for the step on another thread with a
// timeout; the test then opens whatever the operations wait on, so that every
// thread ends and the executor's destructor returns.
#include "core/engine/lane_executor.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <tuple>

#include "core/plan/training_plan.h"
#include "tiers_test_support.h"

namespace strata {
namespace {

using namespace std::chrono_literals;

// A working executor finishes these plans in microseconds; only a deadlock waits this long.
constexpr auto kDeadlock = 30s;

constexpr int kIo = static_cast<int>(Lane::io);
constexpr int kComm = static_cast<int>(Lane::comm);
constexpr int kCompute = static_cast<int>(Lane::compute);
constexpr int kOptimizer = static_cast<int>(Lane::optimizer);

// Closed until opened, then open for good; opening twice is fine.
class Gate {
 public:
  void open() {
    {
      std::lock_guard lock(mutex_);
      open_ = true;
    }
    opened_.notify_all();
  }
  void wait() {
    std::unique_lock lock(mutex_);
    opened_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

// `parties` threads wait for each other, as the ranks do in a collective;
// abandon() lets them all go (the test's way out of a deadlock).
class Rendezvous {
 public:
  explicit Rendezvous(int parties) : parties_(parties) {}
  void arrive_and_wait() {
    std::unique_lock lock(mutex_);
    arrived_ += 1;
    changed_.notify_all();
    changed_.wait(lock, [&] { return abandoned_ || arrived_ >= parties_; });
  }
  void abandon() {
    {
      std::lock_guard lock(mutex_);
      abandoned_ = true;
    }
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  const int parties_;
  int arrived_ = 0;
  bool abandoned_ = false;
};

// Waits for the whole step on another thread; the future is ready once every
// operation is done. Keep it until whatever the step waits on is opened (its
// destructor waits for the thread).
std::future<Status> step_done(const std::shared_ptr<StepProgress>& progress) {
  return std::async(std::launch::async, [progress] { return progress->wait_all(); });
}

bool ready_within(std::future<Status>& future, std::chrono::seconds limit) {
  return future.wait_for(limit) == std::future_status::ready;
}

// For plans with nothing the test could open: a deadlock there leaves threads
// that cannot be ended, so the test reports it and ends the process instead of hanging.
void exit_on_deadlock(std::future<Status>& future, const std::string& what) {
  if (ready_within(future, kDeadlock)) return;
  ADD_FAILURE() << "deadlock: " << what;
  std::fprintf(stderr, "lane_executor_test: deadlock (%s); exiting\n", what.c_str());
  std::_Exit(1);
}

LaneOp op_on(int lane, std::vector<int> deps, std::string name, bool collective = false) {
  return {lane, std::move(deps), collective, std::move(name)};
}

// The plan the lanes exist for: the compute lane's first operation waits for
// a transfer that the io lane starts, planned after it and not among its
// dependencies (as a forward waits on parameters a prefetch brings).
struct TransferPlan {
  std::vector<LaneOp> ops() const {
    return {
        op_on(kCompute, {}, "forward, waits for the transfer"),  // 0
        op_on(kCompute, {0}, "backward"),                        // 1
        op_on(kIo, {}, "transfer"),                              // 2: opens the gate
    };
  }
  Status run(int op) {
    if (op == 0) transfer_done.wait();
    {
      std::lock_guard lock(mutex);
      order.push_back(op);
    }
    if (op == 2) transfer_done.open();  // after its entry, so that the order is fixed
    return Status::ok();
  }
  std::vector<int> ran() {
    std::lock_guard lock(mutex);
    return order;
  }

  Gate transfer_done;
  std::mutex mutex;
  std::vector<int> order;  // operations in the order they did their work
};

TEST(LaneExecutor, AnOperationWaitingForALaterOneOnAnotherLaneFinishes) {
  TransferPlan plan;
  LaneExecutor executor(plan.ops(), {});
  std::shared_ptr<StepProgress> progress =
      executor.start_step(0, [&](int, int op) { return plan.run(op); });
  std::future<Status> done = step_done(progress);
  const bool finished = ready_within(done, kDeadlock);
  plan.transfer_done.open();  // on a deadlock: lets the waiting operation go
  ASSERT_TRUE(finished) << "the lanes deadlocked";
  EXPECT_TRUE(done.get().is_ok());
  EXPECT_EQ(plan.ran(), (std::vector<int>{2, 0, 1}));
}

TEST(LaneExecutor, OneLaneRunningThePlanInOrderDeadlocksOnTheSamePlan) {
  TransferPlan plan;
  LaneExecutorOptions options;
  options.one_lane = true;
  LaneExecutor executor(plan.ops(), options);
  std::shared_ptr<StepProgress> progress =
      executor.start_step(0, [&](int, int op) { return plan.run(op); });
  std::future<Status> done = step_done(progress);
  // It cannot finish before the test opens the gate below, so this wait can
  // only time out; the time bounds nothing but the test's length.
  const bool finished = ready_within(done, 2s);
  const std::vector<int> ran_before_opening = plan.ran();
  plan.transfer_done.open();
  EXPECT_FALSE(finished) << "one lane finished a plan that needs two";
  EXPECT_TRUE(ran_before_opening.empty()) << "the one lane should be stuck in operation 0";
  ASSERT_TRUE(ready_within(done, kDeadlock));
  EXPECT_TRUE(done.get().is_ok());
  EXPECT_EQ(plan.ran(), (std::vector<int>{0, 1, 2}));  // plan order, once let go
}

// When each hook and each operation happened, on one clock shared by all threads.
struct Ticks {
  int64_t before = -1, start = -1, end = -1, after = -1;
};

TEST(LaneExecutor, OperationsRunAfterTheirDependenciesAndEachLaneInPlanOrder) {
  const uint64_t seed = tiers::testing::fresh_seed("lane_executor");
  std::mt19937_64 random(seed);
  for (int trial = 0; trial < 30; ++trial) {
    const int lanes = 1 + int(random() % 4);
    const int op_count = 1 + int(random() % 30);
    const int rank_count = 1 + int(random() % 3);
    const int steps = 1 + int(random() % 3);
    std::vector<LaneOp> ops;
    std::vector<int> yields;  // per operation: how long it takes, in yields
    for (int i = 0; i < op_count; ++i) {
      LaneOp op = op_on(int(random() % lanes), {}, "op " + std::to_string(i));
      for (int d = 0; d < i; ++d)
        if (random() % 6 == 0) op.deps.push_back(d);
      ops.push_back(std::move(op));
      yields.push_back(int(random() % 50));
    }
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << ": " << op_count << " operations on " << lanes
                 << " lanes, " << rank_count << " ranks, " << steps << " steps");

    std::atomic<int64_t> clock{0};
    // [step][rank][op]; each element written by one lane thread, read once the steps are done.
    const std::vector<Ticks> one_rank(static_cast<size_t>(op_count));
    const std::vector<std::vector<Ticks>> one_step(static_cast<size_t>(rank_count), one_rank);
    std::vector<std::vector<std::vector<Ticks>>> ticks(static_cast<size_t>(steps), one_step);
    LaneExecutorOptions options;
    options.ranks.clear();
    for (int r = 0; r < rank_count; ++r) options.ranks.push_back(10 + r);
    options.before = [&](int rank, int64_t step, int op) {
      ticks[size_t(step)][size_t(rank)][size_t(op)].before = clock++;
    };
    options.after = [&](int rank, int64_t step, int op) {
      ticks[size_t(step)][size_t(rank)][size_t(op)].after = clock++;
    };
    LaneExecutor executor(ops, options);
    std::vector<std::shared_ptr<StepProgress>> progress;
    for (int s = 0; s < steps; ++s) {
      progress.push_back(executor.start_step(s, [&, s](int rank, int op) {
        Ticks& t = ticks[size_t(s)][size_t(rank)][size_t(op)];
        t.start = clock++;
        for (int y = 0; y < yields[size_t(op)]; ++y) std::this_thread::yield();
        t.end = clock++;
        return Status::ok();
      }));
    }
    for (const auto& step : progress) {
      std::future<Status> done = step_done(step);
      exit_on_deadlock(done, "step " + std::to_string(step->step()));
      ASSERT_TRUE(done.get().is_ok());
    }

    for (int s = 0; s < steps; ++s) {
      for (int r = 0; r < rank_count; ++r) {
        const std::vector<Ticks>& t = ticks[size_t(s)][size_t(r)];
        for (int i = 0; i < op_count; ++i) {
          ASSERT_GE(t[size_t(i)].before, 0) << "step " << s << " rank " << r << " op " << i;
          EXPECT_LT(t[size_t(i)].before, t[size_t(i)].start);
          EXPECT_LT(t[size_t(i)].start, t[size_t(i)].end);
          EXPECT_LT(t[size_t(i)].end, t[size_t(i)].after);
          // A dependency is done, its `after` hook included, before the operation's `before`.
          for (int d : ops[size_t(i)].deps)
            EXPECT_LT(t[size_t(d)].after, t[size_t(i)].before)
                << "step " << s << " rank " << r << ": op " << i << " ran before its dependency "
                << d;
        }
      }
    }
    // Each lane of each rank: its operations in plan order, step after step, never two at once.
    for (int r = 0; r < rank_count; ++r) {
      for (int lane = 0; lane < lanes; ++lane) {
        int64_t last_after = -1;
        for (int s = 0; s < steps; ++s) {
          for (int i = 0; i < op_count; ++i) {
            if (ops[size_t(i)].lane != lane) continue;
            const Ticks& t = ticks[size_t(s)][size_t(r)][size_t(i)];
            EXPECT_LT(last_after, t.before)
                << "rank " << r << " lane " << lane << ": step " << s << " op " << i
                << " began before the lane's previous operation was done";
            last_after = t.after;
          }
        }
      }
    }
    // One timing per operation, rank and step, naming the rank by its number.
    std::set<std::tuple<int, int64_t, int>> timed;
    for (const OpTiming& t : executor.take_timings()) {
      EXPECT_LE(t.start_seconds, t.end_seconds);
      EXPECT_TRUE(timed.insert({t.rank, t.step, t.op}).second) << "timed twice";
    }
    EXPECT_EQ(timed.size(), size_t(steps * rank_count * op_count));
    for (const auto& [rank, step, op] : timed) {
      EXPECT_GE(rank, 10);
      EXPECT_LT(rank, 10 + rank_count);
    }
    EXPECT_TRUE(executor.take_timings().empty()) << "taken twice";
  }
}

TEST(LaneExecutor, AfterAFailureOnlyCollectivesRunAndTheFirstErrorIsTheSteps) {
  // Two ranks, numbered 4 and 7; the second fails its first operation.
  const std::vector<LaneOp> ops = {
      op_on(kCompute, {}, "forward(unit 0)"),                    // 0: fails on rank 7
      op_on(kComm, {0}, "reduce(unit 0)", /*collective=*/true),  // 1: the ranks meet
      op_on(kCompute, {1}, "backward(unit 0)"),                  // 2
      op_on(kIo, {1}, "fetch(unit 1)"),                          // 3
      op_on(kComm, {1}, "sync(unit 0)", /*collective=*/true),    // 4: fails on rank 4
      op_on(kOptimizer, {1}, "optimizer(unit 0)"),               // 5
  };
  Rendezvous forward(2), reduce(2);
  std::mutex mutex;
  std::map<std::pair<int, int>, int> ran, after;  // (rank, op) -> times
  auto times = [&](const std::map<std::pair<int, int>, int>& counts, int rank, int op) {
    std::lock_guard lock(mutex);
    auto it = counts.find({rank, op});
    return it == counts.end() ? 0 : it->second;
  };
  LaneExecutorOptions options;
  options.ranks = {4, 7};
  options.after = [&](int rank, int64_t, int op) {
    std::lock_guard lock(mutex);
    after[{rank, op}] += 1;
  };
  LaneExecutor executor(ops, options);
  std::shared_ptr<StepProgress> progress = executor.start_step(0, [&](int rank, int op) {
    {
      std::lock_guard lock(mutex);
      ran[{rank, op}] += 1;
    }
    // Both forwards run (neither starts after the other's end); the reduce on
    // rank 4 can only end once rank 7, whose forward failed, joins it, so
    // everything after the reduce starts after the failure.
    if (op == 0) forward.arrive_and_wait();
    if (op == 1) reduce.arrive_and_wait();
    if (op == 0 && rank == 1) return Status::error("no space left on device");
    if (op == 4 && rank == 0) return Status::error("a later failure");
    return Status::ok();
  });
  std::future<Status> done = step_done(progress);
  const bool finished = ready_within(done, kDeadlock);
  forward.abandon();  // on a deadlock: lets a lone rank out
  reduce.abandon();
  ASSERT_TRUE(finished) << "deadlock: a rank skipped the collective its peer waits in";

  const Status status = done.get();
  EXPECT_EQ(status.message(), "rank 7, forward(unit 0): no space left on device");
  EXPECT_TRUE(progress->failed());
  EXPECT_EQ(progress->status().message(), status.message());
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(testing::Message() << "rank index " << rank);
    EXPECT_EQ(times(ran, rank, 0), 1);
    EXPECT_EQ(times(ran, rank, 1), 1) << "a collective is run after a failure";
    EXPECT_EQ(times(ran, rank, 2), 0) << "compute is skipped after a failure";
    EXPECT_EQ(times(ran, rank, 3), 0) << "a fetch is skipped after a failure";
    EXPECT_EQ(times(ran, rank, 4), 1) << "a collective is run after a failure";
    EXPECT_EQ(times(ran, rank, 5), 0) << "the optimizer is skipped after a failure";
    for (int op = 0; op < int(ops.size()); ++op)
      EXPECT_EQ(times(after, rank, op), 1) << "op " << op << ": the after hook, run or skipped";
  }
}

TEST(LaneExecutor, WaitingForAnOperationEndsWhenTheStepFails) {
  // The engine's step() waits for the exchange this way: a failure must end
  // the wait even though the exchange does not end.
  const std::vector<LaneOp> ops = {
      op_on(kCompute, {}, "forward(head) mb 0"),           // 0: fails
      op_on(kComm, {0}, "exchange", /*collective=*/true),  // 1: runs, waits for the gate
  };
  Gate gate;
  std::atomic<bool> exchange_started{false};
  LaneExecutor executor(ops, {});
  std::shared_ptr<StepProgress> progress = executor.start_step(3, [&](int, int op) {
    if (op == 0) return Status::error("non-finite loss");
    exchange_started = true;
    gate.wait();
    return Status::ok();
  });
  std::future<Status> exchanged =
      std::async(std::launch::async, [progress] { return progress->wait_done(1); });
  const bool returned = ready_within(exchanged, kDeadlock);
  gate.open();
  ASSERT_TRUE(returned) << "waiting for an operation outlived the step's failure";
  EXPECT_EQ(exchanged.get().message(), "rank 0, forward(head) mb 0: non-finite loss");
  EXPECT_EQ(progress->step(), 3);
  std::future<Status> done = step_done(progress);
  ASSERT_TRUE(ready_within(done, kDeadlock));
  EXPECT_EQ(done.get().message(), "rank 0, forward(head) mb 0: non-finite loss");
  EXPECT_TRUE(exchange_started) << "a collective runs after a failure";
}

TEST(LaneExecutor, OnlyTheStallLanesWaitingCounts) {
  // Every `before` hook sleeps 20 ms (the engine waits there for the previous
  // step's update): counted on the stall lane, not on the others.
  const int stall_lane = kCompute;
  auto stall_of = [&](std::vector<LaneOp> ops) {
    LaneExecutorOptions options;
    options.stall_lane = stall_lane;
    options.before = [](int, int64_t, int) { std::this_thread::sleep_for(20ms); };
    LaneExecutor executor(std::move(ops), options);
    std::shared_ptr<StepProgress> progress =
        executor.start_step(0, [](int, int) { return Status::ok(); });
    std::future<Status> done = step_done(progress);
    exit_on_deadlock(done, "the stall plan");
    return progress->stall_seconds();
  };
  EXPECT_EQ(stall_of({op_on(kIo, {}, "fetch"), op_on(kComm, {0}, "gather"),
                      op_on(kOptimizer, {1}, "optimizer")}),
            0.0);
  // At least the sleep (sleep_for never wakes early), less the rounding to seconds.
  EXPECT_GE(stall_of({op_on(kIo, {}, "fetch"), op_on(stall_lane, {0}, "forward")}), 0.0199);
}

}  // namespace
}  // namespace strata
