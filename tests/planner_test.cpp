// The planner's numbers, each derived by hand in the test from core/README.md's
// bytes per parameter (strata's) and the ZeRO paper's (2 + 2 + 12 bytes).
#include "core/plan/planner.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/model/model.h"
#include "io/base/sizes.h"

namespace strata {
namespace {

PlanInput bare(int64_t parameters, int world, int stage, Precision precision) {
  PlanInput in;
  in.parameters = parameters;
  in.world_size = world;
  in.stage = stage;
  in.precision = precision;
  return in;
}

TEST(Planner, ShardsArePaddedTo4KiBInEveryDtype) {
  EXPECT_EQ(padded_shard_elements(2048, 1), 2048);
  EXPECT_EQ(padded_shard_elements(2049, 1), 4096);
  EXPECT_EQ(padded_shard_elements(10000, 3), 4096);  // ceil(10000 / 3) = 3334 -> 4096
  EXPECT_EQ(padded_shard_elements(1, 8), 2048);
}

TEST(Planner, StageZeroOneRankBf16IsEighteenBytesPerPaddedParameter) {
  MemoryPlan plan = *plan_memory(bare(1000000000, 1, 0, Precision::bf16));
  const int64_t padded = 488282LL * 2048;  // 1e9 / 2048 = 488281.25 -> 488282 blocks
  EXPECT_EQ(plan.shard_elements, padded);
  EXPECT_EQ(plan.model_states.device, 18 * padded);
  EXPECT_EQ(plan.model_states.host, 0);
  EXPECT_EQ(plan.model_states.nvme, 0);
  EXPECT_EQ(plan.model_states_zero.device, 16000000000LL);  // (2 + 2 + 12) * 1e9
}

TEST(Planner, StageThreeDividesEverythingByTheRanks) {
  MemoryPlan plan = *plan_memory(bare(1000000000, 4, 3, Precision::bf16));
  const int64_t shard = 122071LL * 2048;  // 2.5e8 / 2048 = 122070.3 -> 122071 blocks
  EXPECT_EQ(plan.shard_elements, shard);
  EXPECT_EQ(plan.model_states.device, 18 * shard);
  EXPECT_EQ(plan.model_states_zero.device, 4000000000LL);  // 16e9 / 4
}

TEST(Planner, FpThirtyTwoWithTheOptimizerOnTheHostKeepsASeparateMaster) {
  PlanInput in = bare(1000000000, 2, 2, Precision::fp32);
  in.offload_optimizer = OffloadDevice::cpu;
  MemoryPlan plan = *plan_memory(in);
  const int64_t shard = 244141LL * 2048;  // 5e8 / 2048 = 244140.6 -> 244141 blocks
  // Stage 2: parameters whole (both shards) on the device in fp32.
  EXPECT_EQ(plan.model_states.device, 4 * 2 * shard);
  // Gradient shard (fp32), master, m and v on the host: 16 bytes per shard element.
  EXPECT_EQ(plan.model_states.host, 16 * shard);
  // ZeRO: 2N params on the device; grads 2N/2 and optimizer 12N/2 on the host.
  EXPECT_EQ(plan.model_states_zero.device, 2000000000LL);
  EXPECT_EQ(plan.model_states_zero.host, 7000000000LL);
}

TEST(Planner, FpThirtyTwoWithoutOffloadHasNoSeparateMaster) {
  MemoryPlan plan = *plan_memory(bare(1000000000, 1, 0, Precision::fp32));
  EXPECT_EQ(plan.model_states.device, 16 * plan.shard_elements);
}

TEST(Planner, EverythingOnNvmeStagesThroughPinnedBuffers) {
  PlanInput in = bare(1000000000, 1, 3, Precision::bf16);
  in.offload_optimizer = OffloadDevice::nvme;
  in.offload_param = OffloadDevice::nvme;
  MemoryPlan plan = *plan_memory(in);
  const int64_t s = plan.shard_elements;
  EXPECT_EQ(plan.model_states.nvme, 14 * s);  // params 2 + master 4 + m 4 + v 4
  EXPECT_EQ(plan.model_states.host, 4 * s);   // the fp32 gradient shard
  EXPECT_EQ(plan.model_states.device, 0);
  // A bare parameter count has no units to size working buffers by: the states alone.
  EXPECT_EQ(plan.host_staging_bytes, 0);
  EXPECT_EQ(plan.device_staging_bytes, 0);
  EXPECT_EQ(plan.total_per_rank.nvme, plan.model_states.nvme);
  // NVMe per step: optimizer state read and written (12 bytes), params read for the
  // forward and the backward (2 * 2 bytes) and written once after the step (2 bytes).
  EXPECT_EQ(plan.traffic.nvme_read_bytes, 12 * s + 4 * s);
  EXPECT_EQ(plan.traffic.nvme_write_bytes, 12 * s + 2 * s);
  EXPECT_EQ(plan.traffic.h2d_bytes, 4 * s);
  EXPECT_EQ(plan.traffic.d2h_bytes, 4 * s);
  EXPECT_EQ(plan.traffic.slowest_link, "NVMe");
}

TEST(Planner, FpThirtyTwoOnNvmeStreamsTheParametersAsTheMaster) {
  PlanInput in = bare(1000000000, 1, 3, Precision::fp32);
  in.offload_optimizer = OffloadDevice::nvme;
  in.offload_param = OffloadDevice::nvme;
  in.sub_group_size = 500000;  // not a multiple of 1024: the chunk rounds down to 488 * 1024
  MemoryPlan plan = *plan_memory(in);
  const int64_t s = plan.shard_elements;
  EXPECT_EQ(plan.model_states.nvme, 12 * s);  // params (the master), m, v
  EXPECT_EQ(plan.model_states.host, 4 * s);
  EXPECT_EQ(plan.total_per_rank.host, plan.model_states.host);
  EXPECT_EQ(plan.traffic.nvme_read_bytes, 12 * s + 2 * 4 * s);
  EXPECT_EQ(plan.traffic.nvme_write_bytes, 12 * s);  // the optimizer's write is the parameters'
}

TEST(Planner, CollectiveVolumeFollowsTheStage) {
  PlanInput in = bare(1000000000, 4, 3, Precision::bf16);
  in.grad_accum = 2;
  MemoryPlan plan = *plan_memory(in);
  const int64_t padded = 4 * 122071LL * 2048;
  // Per micro-batch: reduce-scatter fp32 grads (3/4 of 4 bytes) and all-gather bf16
  // params for the forward and again for the backward (3/4 of 2 bytes each).
  const int64_t reduce_scatter = padded * 4 * 3 / 4;
  const int64_t all_gather = padded * 2 * 3 / 4;
  EXPECT_EQ(plan.traffic.collective_bytes, 2 * reduce_scatter + 2 * 2 * all_gather);
  EXPECT_EQ(plan.traffic.collective_bytes_zero, 3 * 2 * 1000000000LL);  // 3 psi, fp16
  in.stage = 1;
  MemoryPlan stage1 = *plan_memory(in);
  EXPECT_EQ(stage1.traffic.collective_bytes_zero, 2 * 2 * 1000000000LL);  // 2 psi
  // Stage 1 without offload: one all-reduce per step, one all-gather after the step.
  EXPECT_EQ(stage1.traffic.collective_bytes, 2 * padded * 4 * 3 / 4 + all_gather);
  in.world_size = 1;
  EXPECT_EQ(plan_memory(in)->traffic.collective_bytes, 0);
}

TEST(Planner, TinyModelUnitsAndActivationsByHand) {
  ModelConfig tiny = *load_model_config("tiny");  // V 256, H 96, I 160, L 2, 6 heads, 2 KV heads
  PlanInput in;
  in.model = tiny;
  in.precision = Precision::bf16;
  in.micro_batch = 2;
  in.seq_len = 64;
  MemoryPlan plan = *plan_memory(in);
  const int64_t layer = 96 * 96 + 2 * 96 * 32 + 96 * 96 + 3 * 96 * 160 + 2 * 96;  // 70848
  EXPECT_EQ(plan.parameters, 256 * 96 + 2 * layer + 96 + 256 * 96);
  EXPECT_EQ(plan.units, 4);
  // Padded per unit: 24576 = 12 blocks; 70848 -> 35 blocks; 24672 -> 13 blocks.
  EXPECT_EQ(plan.shard_elements, (12 + 2 * 35 + 13) * 2048);
  // The CPU backend's activations (fp32): the inputs of the three units after the
  // embedding, the activation gradient, the tokens and targets, each on whole pages.
  const int64_t tokens = 2 * 64;
  EXPECT_EQ(plan.activation_checkpoint_bytes,
            3 * tokens * 96 * 4 + tokens * 96 * 4 + round_up<int64_t>(2 * tokens * 4, 4096));
  EXPECT_EQ(plan.activation_working_bytes,
            round_up<int64_t>(UnitWorkspace::bytes_for(tiny, 2, 64), 4096));
  // The whole table is the engine's plan for the same input.
  Result<TrainingPlan> engine_plan = build_training_plan(step_input(in));
  ASSERT_TRUE(engine_plan.is_ok()) << engine_plan.status().message();
  EXPECT_EQ(plan.total_per_rank.device, engine_plan->peak(Tier::device));
  EXPECT_EQ(plan.total_per_rank.host, engine_plan->peak(Tier::host));
  EXPECT_EQ(plan.buffers.size(), engine_plan->buffers.size());
}

TEST(Planner, ABudgetThatOverflowsNamesTheTierAndSuggestsTheSmallestChange) {
  PlanInput in;
  in.model = *load_model_config("llama3-8b");
  in.precision = Precision::bf16;
  in.device_budget = 80LL << 30;
  in.host_budget = 1LL << 40;
  MemoryPlan plan = *plan_with_suggestion(in);
  EXPECT_FALSE(plan.fits);
  EXPECT_FALSE(plan.verdicts[0].fits());  // device: 18 bytes x 8B parameters
  EXPECT_TRUE(plan.verdicts[1].fits());
  EXPECT_EQ(plan.suggestion, "--offload-optimizer cpu");

  in.host_budget = 100LL << 30;  // too little host memory for the optimizer state
  MemoryPlan tight = *plan_with_suggestion(in);
  EXPECT_EQ(tight.suggestion, "--offload-optimizer nvme --nvme-path DIR");

  in.world_size = 8;  // with ranks to shard over, a higher stage is the smallest change
  in.host_budget = 1LL << 40;
  MemoryPlan ranks = *plan_with_suggestion(in);
  EXPECT_EQ(ranks.suggestion, "--stage 1");
}

TEST(Planner, ShardSizesAreTheModelLayoutsOwn) {
  for (const char* preset : {"tiny", "small", "llama3.2-1b"}) {
    for (int world : {1, 3, 8}) {
      PlanInput in;
      in.model = *load_model_config(preset);
      in.world_size = world;
      in.stage = 3;
      ModelLayout layout = model_layout(*in.model, world);
      int64_t shards = 0;
      for (const UnitLayout& unit : layout.units) shards += unit.shard_numel;
      EXPECT_EQ(plan_memory(in)->shard_elements, shards) << preset << " over " << world;
    }
  }
}

TEST(Planner, OffloadingParametersBelowStageThreeIsRefused) {
  PlanInput in = bare(1000, 1, 2, Precision::bf16);
  in.offload_param = OffloadDevice::cpu;
  Status status = validate_plan_input(in);
  ASSERT_FALSE(status.is_ok());
  EXPECT_NE(status.message().find("needs ZeRO stage 3"), std::string::npos);
}

TEST(Planner, JsonHasThePerRankModelStates) {
  MemoryPlan plan = *plan_memory(bare(1000000000, 1, 0, Precision::bf16));
  nlohmann::ordered_json j = plan_to_json(plan, false);
  EXPECT_EQ(j["per_rank"]["device_bytes"].get<int64_t>(), plan.model_states.device);
  EXPECT_EQ(j["per_rank"]["host_bytes"].get<int64_t>(), 0);
  nlohmann::ordered_json zero = plan_to_json(plan, true);
  EXPECT_EQ(zero["per_rank"]["device_bytes"].get<int64_t>(), 16000000000LL);
}

}  // namespace
}  // namespace strata
