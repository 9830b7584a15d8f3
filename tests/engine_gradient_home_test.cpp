// The gradient's home (strata.gradient_home): fp32 gradients on NVMe give
// the run of fp32 gradients in host memory bitwise (1 and 2 ranks, every
// stage, with clipping, over 1 to 3 micro-batches), the NVMe bytes moved equal
// the plan's, bf16 gradients train, auto takes NVMe only where host memory
// would not hold the plan, and homes that cannot work are refused in one line.
#include <gtest/gtest.h>

#include "core/plan/training_plan.h"
#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineGradientHome : public testing::EngineRunsTest {
 protected:
  EngineGradientHome() : EngineRunsTest("engine_gradient_home") {}
};

EngineRun placed(int world, int stage, const char* param, const char* home, int64_t accum) {
  EngineRun run;
  run.world = world;
  run.stage = stage;
  run.offload_param = param;
  run.offload_optimizer = "nvme";
  run.precision = "bf16";
  run.gradient_home = home;
  run.grad_accum = accum;
  run.clipping = 0.5;  // the norm of the final gradients decides every step
  run.steps = 3;
  // Runs are compared within one schedule: at two ranks each sums in its own order.
  if (world > 1) run.schedule = "micro_batch";
  return run;
}

TEST_F(EngineGradientHome, NvmeGradientsEqualHostGradientsBitwise) {
  // At two ranks each schedule sums in its own order: homes compared within each.
  for (auto [world, schedule] :
       {std::pair{1, "auto"}, std::pair{2, "micro_batch"}, std::pair{2, "layer"}}) {
    for (auto [stage, param] : {std::pair{0, "none"}, std::pair{1, "none"}, std::pair{2, "none"},
                                std::pair{3, "nvme"}, std::pair{3, "cpu"}}) {
      for (int64_t accum : {int64_t{1}, int64_t{3}}) {
        EngineRun host_run = placed(world, stage, param, "host", accum);
        host_run.schedule = schedule;
        const EngineOutcome host = train(host_run);
        EngineRun run = placed(world, stage, param, "nvme", accum);
        run.schedule = schedule;
        const EngineOutcome nvme = train(run);
        ASSERT_EQ(nvme.plan.homes.grad, tiers::Tier::nvme) << run.label();
        testing::expect_identical(host, nvme, run.label());
        const uint64_t steps = uint64_t(run.steps), ranks = uint64_t(world);
        EXPECT_EQ(nvme.nvme_read, uint64_t(nvme.plan.traffic_per_step.nvme_read) * steps * ranks)
            << run.label();
        EXPECT_EQ(nvme.nvme_written,
                  uint64_t(nvme.plan.traffic_per_step.nvme_written) * steps * ranks)
            << run.label();
        // The gradient's bytes are in it: more than the state alone moves.
        EXPECT_GT(nvme.nvme_written, host.nvme_written) << run.label();
      }
    }
  }
}

TEST_F(EngineGradientHome, Bf16GradientsTrainAndRoundOncePerMicroBatch) {
  const EngineOutcome fp32 = train(placed(2, 2, "none", "host", 2));
  const EngineRun run = placed(2, 2, "none", "host_bf16", 2);
  const EngineOutcome bf16 = train(run);
  const PlanBuffer* grads = bf16.plan.buffer(BufferRole::grad_state);
  ASSERT_NE(grads, nullptr);
  EXPECT_EQ(grads->element, BufferElement::bf16);
  EXPECT_FALSE(testing::weights_bitwise_equal(bf16.weights, fp32.weights));
  EXPECT_LT(testing::weights_relative_error(bf16.weights, fp32.weights), 0.02);
  // The optimizer in host memory reads them too.
  EngineRun cpu = run;
  cpu.offload_optimizer = "cpu";
  const EngineOutcome on_host = train(cpu);
  testing::expect_identical(bf16, on_host, cpu.label());
}

TEST(GradientHomePlan, AutoTakesNvmeOnlyWhereHostMemoryWouldNotHoldThePlan) {
  PlanInput in;
  in.model = testing::small_gqa_model();
  in.stage = 3;
  in.offload_param = OffloadDevice::nvme;
  in.offload_optimizer = OffloadDevice::nvme;
  in.precision = Precision::bf16;
  in.grad_accum = 2;
  in.optimizer_chunk_elements = 4096;  // small stream buffers, as a large model's are to its state
  in.optimizer_buffers = 2;
  in.schedule = Schedule::micro_batch;
  in.gradient_home = GradientHome::host;
  Result<TrainingPlan> host = build_training_plan(in);
  ASSERT_TRUE(host.is_ok()) << host.status().message();
  in.gradient_home = GradientHome::nvme;
  Result<TrainingPlan> nvme = build_training_plan(in);
  ASSERT_TRUE(nvme.is_ok()) << nvme.status().message();
  ASSERT_LT(nvme->peak(tiers::Tier::host), host->peak(tiers::Tier::host));

  in.gradient_home = GradientHome::automatic;
  in.budgets.host_per_node = host->peak(tiers::Tier::host);
  Result<TrainingPlan> fits = build_training_plan(in);
  ASSERT_TRUE(fits.is_ok());
  EXPECT_EQ(fits->homes.grad, tiers::Tier::host);
  EXPECT_NE(fits->gradient_home_reason.find("fits"), std::string::npos);
  in.budgets.host_per_node = host->peak(tiers::Tier::host) - 1;
  Result<TrainingPlan> over = build_training_plan(in);
  ASSERT_TRUE(over.is_ok());
  EXPECT_EQ(over->homes.grad, tiers::Tier::nvme);
  EXPECT_NE(over->gradient_home_reason.find("over the budget"), std::string::npos);
  EXPECT_EQ(over->traffic_per_step.nvme_read, nvme->traffic_per_step.nvme_read);
  // With the optimizer in host memory the gradients stay there, budget or not.
  in.offload_optimizer = OffloadDevice::cpu;
  Result<TrainingPlan> cpu = build_training_plan(in);
  ASSERT_TRUE(cpu.is_ok());
  EXPECT_EQ(cpu->homes.grad, tiers::Tier::host);

  // Refused: NVMe gradients without the streamed optimizer; any choice with the optimizer on the
  // device.
  in.gradient_home = GradientHome::nvme;
  Result<TrainingPlan> refused = build_training_plan(in);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("--offload-optimizer nvme"), std::string::npos);
  in.offload_optimizer = OffloadDevice::none;
  in.offload_param = OffloadDevice::none;
  in.gradient_home = GradientHome::host_bf16;
  refused = build_training_plan(in);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("strata.gradient_home host_bf16"), std::string::npos);
  EXPECT_EQ(refused.status().message().find('\n'), std::string::npos);
}

}  // namespace
}  // namespace strata
