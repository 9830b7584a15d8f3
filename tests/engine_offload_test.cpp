// Offload is real and bounded: the bytes the I/O engines moved equal what the
// plan says, the recorded peak of every tier stays within its budget and the
// plan's peak, a configuration that cannot fit is refused before anything is
// allocated, an I/O failure fails its step with the operation's name (and
// never hangs the other ranks), and the tightest buffer settings still finish.
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "core/plan/planner.h"
#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineOffload : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = dir_.why_unusable(); !why.empty()) GTEST_SKIP() << why;
    seed_ = tiers::testing::fresh_seed("engine_offload");
    tokens_ = std::make_shared<std::vector<int32_t>>(
        testing::random_tokens(4096, testing::small_gqa_model().vocab_size, seed_ + 1));
  }
  Result<EngineOutcome> train(const EngineRun& run) {
    return testing::train_engine(run, dir_.path(), tokens_, seed_);
  }

  io::testing::TemporaryDirectory dir_;
  uint64_t seed_ = 0;
  std::shared_ptr<std::vector<int32_t>> tokens_;
};

TEST_F(EngineOffload, NvmeBytesEqualThePlanAndPeaksStayInBudget) {
  int configurations = 0;
  for (int world : {1, 2}) {
    for (const char* precision : {"fp32", "bf16"}) {
      for (EngineRun run : testing::every_placement(world, precision)) {
        run.tied = configurations % 2 == 1;
        ++configurations;
        Result<EngineOutcome> outcome = train(run);
        ASSERT_TRUE(outcome.is_ok()) << run.label() << ": " << outcome.status().message();
        const TrainingPlan& plan = outcome->plan;
        const uint64_t steps = uint64_t(run.steps), ranks = uint64_t(world);
        EXPECT_EQ(outcome->nvme_read, uint64_t(plan.traffic_per_step.nvme_read) * steps * ranks)
            << run.label();
        EXPECT_EQ(outcome->nvme_written,
                  uint64_t(plan.traffic_per_step.nvme_written) * steps * ranks)
            << run.label();
        const bool on_nvme = run.offload_param == "nvme" || run.offload_optimizer == "nvme";
        EXPECT_EQ(on_nvme, outcome->nvme_read > 0) << run.label();
        EXPECT_EQ(on_nvme, outcome->nvme_written > 0) << run.label();
        for (int t = 0; t < tiers::kTierCount; ++t) {
          const tiers::TierUsage& usage = outcome->rank_usage[t];
          const auto tier = static_cast<tiers::Tier>(t);
          EXPECT_LE(usage.peak, usage.capacity) << run.label() << " " << tiers::tier_name(tier);
          if (tier != tiers::Tier::nvme) {
            EXPECT_LE(int64_t(usage.peak), plan.peak(tier))
                << run.label() << " " << tiers::tier_name(tier);
          }
        }
      }
    }
  }
  EXPECT_EQ(configurations, 2 * 2 * 18);
}

TEST_F(EngineOffload, StrataPlanIsAViewOfTheEnginesPlan) {
  // `strata plan` (core/plan/planner.h) reports the buffers of the plan the
  // engine runs, for the same config: every line, every tier, byte for byte.
  for (EngineRun run : testing::every_placement(2, "bf16")) {
    Result<TrainConfig> config = testing::engine_config(run, dir_.path());
    ASSERT_TRUE(config.is_ok()) << config.status().message();
    Result<TrainingPlan> plan =
        plan_training(plan_input_from_config(*config, testing::small_gqa_model()));
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    Result<PlanReport> planner =
        plan_memory(plan_input_from_config(*config, testing::small_gqa_model()));
    ASSERT_TRUE(planner.is_ok()) << planner.status().message();
    ASSERT_EQ(planner->buffers.size(), plan->buffers.size()) << run.label();
    for (size_t i = 0; i < plan->buffers.size(); ++i) {
      EXPECT_EQ(planner->buffers[i].name, plan->buffers[i].name) << run.label();
      EXPECT_EQ(planner->buffers[i].bytes, plan->buffers[i].bytes) << run.label();
    }
    EXPECT_EQ(planner->total_per_rank.device, plan->peak(tiers::Tier::device)) << run.label();
    EXPECT_EQ(planner->total_per_rank.host, plan->peak(tiers::Tier::host)) << run.label();
    EXPECT_EQ(planner->total_per_rank.nvme, plan->peak(tiers::Tier::nvme)) << run.label();
    int64_t states[tiers::kTierCount] = {0, 0, 0};
    for (const PlanBuffer& b : plan->buffers)
      if (state_shard_kind(b.role)) states[static_cast<int>(b.tier)] += b.bytes;
    EXPECT_EQ(states[0], planner->model_states.device) << run.label();
    EXPECT_EQ(states[1], planner->model_states.host) << run.label();
    EXPECT_EQ(states[2], planner->model_states.nvme) << run.label();
  }
}

TEST_F(EngineOffload, RefusesAPlanThatDoesNotFitBeforeAllocating) {
  EngineRun run;
  run.stage = 3;
  run.device_budget = 1 << 20;
  Result<EngineOutcome> outcome = train(run);
  ASSERT_FALSE(outcome.is_ok());
  const std::string& message = outcome.status().message();
  EXPECT_NE(message.find("does not fit"), std::string::npos) << message;
  EXPECT_NE(message.find("--device-mem-limit"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;

  run.device_budget = 64 << 20;
  run.host_budget = 64 << 10;
  run.offload_optimizer = "cpu";
  outcome = train(run);
  ASSERT_FALSE(outcome.is_ok());
  EXPECT_NE(outcome.status().message().find("--host-mem-limit"), std::string::npos)
      << outcome.status().message();
}

TEST_F(EngineOffload, AnNvmeFailureFailsItsStepNamingTheOperation) {
  for (int world : {1, 2}) {
    for (io::RingOp op : {io::RingOp::kRead, io::RingOp::kWrite}) {
      EngineRun run;
      run.world = world;
      run.stage = 3;
      run.offload_param = "nvme";
      run.offload_optimizer = "nvme";
      run.steps = 3;
      // A clean run counts the calls; the second fails every call from the middle on,
      // which is inside the steps (initialisation is a small part of the traffic).
      auto counter = std::make_shared<io::FaultInjector>();
      run.fault_injector = counter;
      ASSERT_TRUE(train(run).is_ok());
      auto injector = std::make_shared<io::FaultInjector>();
      io::Fault fault;
      fault.op = op;
      fault.nth_call = counter->calls(op) / 2;
      fault.error_number = EIO;
      fault.times = 1000000;
      injector->add(fault);
      run.fault_injector = injector;
      Result<EngineOutcome> outcome = train(run);
      ASSERT_FALSE(outcome.is_ok()) << "world " << world;
      const std::string& message = outcome.status().message();
      std::printf("world %d: %s\n", world, message.c_str());
      EXPECT_NE(message.find("rank "), std::string::npos) << message;
      EXPECT_TRUE(message.find("fetch") != std::string::npos ||
                  message.find("gather") != std::string::npos ||
                  message.find("optimizer") != std::string::npos ||
                  message.find("writeback") != std::string::npos ||
                  message.find("write_shard") != std::string::npos)
          << message;
      EXPECT_NE(message.find("Input/output error"), std::string::npos) << message;
    }
  }
}

// Runs `work` and fails the whole test binary (instead of hanging CI) when it
// takes longer than `limit`: a plan whose lanes wait on each other in a cycle
// never finishes.
void with_watchdog(std::chrono::seconds limit, const std::function<void()>& work) {
  std::mutex mutex;
  std::condition_variable done_changed;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock lock(mutex);
    if (!done_changed.wait_for(lock, limit, [&] { return done; })) {
      std::fprintf(stderr, "engine_offload: no progress in %lld s: the lanes deadlocked\n",
                   static_cast<long long>(limit.count()));
      std::_Exit(3);
    }
  });
  work();
  {
    std::lock_guard lock(mutex);
    done = true;
  }
  done_changed.notify_all();
  watchdog.join();
}

TEST_F(EngineOffload, TightestBuffersAndEveryOverlapSettingFinish) {
  with_watchdog(std::chrono::seconds(240), [&] {
    for (int world : {1, 3}) {
      for (bool overlap : {true, false}) {
        for (bool tied : {false, true}) {
          EngineRun run;
          run.world = world;
          run.stage = 3;
          run.offload_param = "nvme";
          run.offload_optimizer = "nvme";
          run.param_buffers = 1;
          run.optimizer_buffers = 2;
          run.sub_group_size = 1024;
          run.grad_accum = 3;
          run.steps = 4;
          run.overlap_comm = overlap;
          run.tied = tied;
          Result<EngineOutcome> outcome = train(run);
          EXPECT_TRUE(outcome.is_ok()) << run.label() << ": " << outcome.status().message();
        }
      }
    }
  });
}

}  // namespace
}  // namespace strata
