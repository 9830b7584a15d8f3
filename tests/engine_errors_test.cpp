// What the engine does with bad input: non-finite values fail an fp32 step
// with one line that says what to do (and the engine refuses to go on), fp16
// skips overflowing steps and lowers its loss scale until it gives up, a
// failing data source or a missing NVMe directory is reported by name.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineErrors : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = dir_.why_unusable(); !why.empty()) GTEST_SKIP() << why;
    seed_ = tiers::testing::fresh_seed("engine_errors");
    tokens_ = std::make_shared<std::vector<int32_t>>(
        testing::random_tokens(4096, testing::small_gqa_model().vocab_size, seed_ + 1));
  }
  // A checkpoint of the seed's model with one lm_head element set to `value`.
  std::string poisoned_checkpoint(float value) {
    HostModel model = make_host_model(testing::small_gqa_model(), 1);
    init_host_model(model, seed_);
    const TensorSlot* slot = model.layout.units.back().find("lm_head.weight");
    model.params.back()[size_t(slot->offset + 7)] = value;
    const std::string path = dir_.subdirectory("poisoned");
    EXPECT_TRUE(save_host_model(model, path, DType::f32).is_ok());
    return path;
  }

  io::testing::TemporaryDirectory dir_;
  uint64_t seed_ = 0;
  std::shared_ptr<std::vector<int32_t>> tokens_;
};

TEST_F(EngineErrors, NonFiniteLossFailsAnFp32StepAndStopsTheEngine) {
  EngineRun run;
  run.world = 2;
  run.stage = 3;
  run.offload_optimizer = "nvme";
  run.init = poisoned_checkpoint(std::numeric_limits<float>::infinity());
  Result<EngineOutcome> outcome = testing::train_engine(run, dir_.path(), tokens_, seed_);
  ASSERT_FALSE(outcome.is_ok());
  const std::string& message = outcome.status().message();
  EXPECT_NE(message.find("forward(head)"), std::string::npos) << message;
  EXPECT_NE(message.find("lower the learning rate or check the data"), std::string::npos)
      << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST_F(EngineErrors, AfterAFailedStepTheEngineRefusesToContinue) {
  EngineRun run;
  run.init = poisoned_checkpoint(std::numeric_limits<float>::quiet_NaN());
  Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok());
  Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
  ASSERT_TRUE(engine.is_ok()) << engine.status().message();
  ASSERT_FALSE((*engine)->step().is_ok());
  Result<StepResult> again = (*engine)->step();
  ASSERT_FALSE(again.is_ok());
  EXPECT_NE(again.status().message().find("an earlier step failed"), std::string::npos)
      << again.status().message();
}

TEST_F(EngineErrors, Fp16SkipsOverflowingStepsHalvingTheScaleThenGivesUp) {
  EngineRun run;
  run.precision = "fp16";
  run.initial_scale_power = 3;  // 8, 4, 2, 1, then the minimum scale is reached
  run.steps = 8;
  run.stage = 2;
  run.world = 2;
  run.init = poisoned_checkpoint(std::numeric_limits<float>::infinity());
  Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok());
  Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
  ASSERT_TRUE(engine.is_ok()) << engine.status().message();
  double scale = 8;
  int skipped = 0;
  Status last = Status::ok();
  for (int s = 0; s < run.steps; ++s) {
    Result<StepResult> step = (*engine)->step();
    if (!step) {
      last = step.status();
      break;
    }
    EXPECT_TRUE(step->skipped) << "step " << s + 1;
    EXPECT_EQ(step->loss_scale, scale) << "step " << s + 1;
    scale /= 2;
    ++skipped;
  }
  EXPECT_EQ(skipped, 3);
  EXPECT_FALSE(last.is_ok());
  EXPECT_NE(last.message().find("loss scale"), std::string::npos) << last.message();
  EXPECT_EQ((*engine)->optimizer_state().applied_steps, 0);
}

// A step returns once its loss and norm are known; its updates go on while
// the next step's forward runs. An update that fails then must fail that next
// step (naming the operation), not vanish while the next step trains on
// parameters that were never updated.
TEST_F(EngineErrors, AnUpdateFailingAfterItsStepReturnedFailsTheNextStep) {
  EngineRun run;
  run.stage = 3;
  run.offload_param = "cpu";
  run.offload_optimizer = "nvme";  // the update's writes are the only NVMe writes of a step
  Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok()) << options.status().message();
  // Count the writes of initialisation alone, then fail the first write after it.
  auto counter = std::make_shared<io::FaultInjector>();
  options->fault_injector = counter;
  ASSERT_TRUE(Engine::create(*options).is_ok());
  const uint64_t initial_writes = counter->calls(io::RingOp::kWrite);
  auto injector = std::make_shared<io::FaultInjector>();
  io::Fault fault;
  fault.op = io::RingOp::kWrite;
  fault.nth_call = initial_writes + 1;
  fault.error_number = EIO;
  injector->add(fault);
  options->fault_injector = injector;
  Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
  ASSERT_TRUE(engine.is_ok()) << engine.status().message();
  // The first step may see its own update fail (the update can finish before
  // step() returns); if it does not, the second step must.
  Result<StepResult> first = (*engine)->step();
  Result<StepResult> failed = first;
  if (first.is_ok()) failed = (*engine)->step();
  ASSERT_FALSE(failed.is_ok()) << "an update's failure went unreported";
  EXPECT_EQ(injector->faults_injected(), 1u);
  const std::string& message = failed.status().message();
  EXPECT_NE(message.find("optimizer"), std::string::npos) << message;
  EXPECT_NE(message.find("Input/output error"), std::string::npos) << message;
  EXPECT_FALSE((*engine)->step().is_ok());  // and the engine refuses to go on
}

TEST_F(EngineErrors, DataSourceFailuresAndMissingDirectoriesAreNamed) {
  EngineRun run;
  Result<TrainConfig> config = testing::engine_config(run, dir_.path());
  ASSERT_TRUE(config.is_ok());
  EngineOptions options;
  options.model = testing::small_gqa_model();
  options.config = *config;
  options.budgets.device_per_rank = options.budgets.host_per_node = 64 << 20;
  options.pin_host = false;
  options.data = [](int64_t, int64_t, int, int, int64_t, int64_t, int32_t*, int32_t*) {
    return Status::error("tokens.bin: truncated at byte 4096");
  };
  Result<std::unique_ptr<Engine>> engine = Engine::create(options);
  ASSERT_TRUE(engine.is_ok());
  Result<StepResult> step = (*engine)->step();
  ASSERT_FALSE(step.is_ok());
  EXPECT_NE(step.status().message().find("tokens.bin: truncated"), std::string::npos);

  // Out-of-vocabulary tokens from a reader are refused before any compute.
  options.data = [](int64_t, int64_t, int, int, int64_t B, int64_t T, int32_t* inputs,
                    int32_t* targets) {
    for (int64_t i = 0; i < B * T; ++i) inputs[i] = targets[i] = 1000;
    return Status::ok();
  };
  engine = Engine::create(options);
  ASSERT_TRUE(engine.is_ok());
  step = (*engine)->step();
  ASSERT_FALSE(step.is_ok());
  EXPECT_NE(step.status().message().find("input tokens"), std::string::npos)
      << step.status().message();

  run.offload_optimizer = "nvme";
  config = testing::engine_config(run, dir_.path() + "/no-such-directory");
  ASSERT_TRUE(config.is_ok());
  options.config = *config;
  options.nvme_paths = config->effective_nvme_paths();
  engine = Engine::create(options);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_NE(engine.status().message().find("no-such-directory"), std::string::npos)
      << engine.status().message();
  options.nvme_paths.clear();
  engine = Engine::create(options);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_NE(engine.status().message().find("--nvme-path"), std::string::npos)
      << engine.status().message();
}

}  // namespace
}  // namespace strata
