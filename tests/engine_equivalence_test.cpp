// The engine computes the same mathematics wherever the bytes live: every
// stage x offload_param x offload_optimizer gives bitwise-identical losses and
// weights at a fixed world size and schedule; 2 and 3 ranks agree with one
// within 1e-6 of each tensor's norm (Adam's eps 1e-4, see below);
// overlap_comm and reduce_scatter change timing only; gradient accumulation
// 2 x B matches 1 x 2B.
#include <gtest/gtest.h>

#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineEquivalence : public testing::EngineRunsTest {
 protected:
  EngineEquivalence() : EngineRunsTest("engine_equivalence") {}
  void expect_identical(const EngineOutcome& a, const EngineOutcome& b, const std::string& what) {
    testing::expect_identical(a, b, what);
  }
};

TEST_F(EngineEquivalence, EveryPlacementIsBitwiseIdenticalAtEachWorldSize) {
  EngineOutcome one_rank;
  // At more than one rank each schedule sums in its own order: placements
  // agree bitwise within each.
  for (auto [world, schedule] :
       {std::pair{1, "auto"}, std::pair{2, "micro_batch"}, std::pair{2, "layer"},
        std::pair{3, "micro_batch"}, std::pair{3, "layer"}}) {
    // The same global batch at every world size: 6 micro-batches of 2 sequences.
    std::vector<EngineRun> runs = testing::every_placement(world, "fp32", schedule);
    // Adam divides each element's gradient by its own magnitude plus eps: an
    // element whose gradient is a near-total cancellation (|g| near 1e-8, where
    // the summation order of ranks and micro-batches decides even its sign)
    // moves by up to lr either way. Near g = 0 the update is lr g / eps, so
    // a rounding difference dg between two orders moves the weight by
    // lr dg / eps: dg reaches 2e-9 on these models (a sum of terms near 1e-2
    // with 2^-24 each), 2e-6 of a weight at eps 1e-6, as much as the whole
    // tolerance below on one element. At eps 1e-4 it is 2e-8, and what is
    // compared is the engine's arithmetic: a gradient that is wrong still
    // moves its update, linearly below eps and by its sign above.
    for (EngineRun& run : runs) {
      run.grad_accum = 6 / world;
      run.lr = 1e-3;
      run.eps = 1e-4;
      run.steps = 2;
    }
    const EngineOutcome reference = train(runs[0]);
    ASSERT_EQ(reference.steps.size(), 2u);
    // Training happened: the loss moved.
    EXPECT_NE(reference.steps[0].loss, reference.steps[1].loss);
    for (size_t i = 1; i < runs.size(); ++i) {
      const EngineOutcome outcome = train(runs[i]);
      expect_identical(outcome, reference, runs[i].label() + " vs " + runs[0].label());
    }
    if (world == 1) {
      one_rank = reference;
      continue;
    }
    for (size_t s = 0; s < reference.steps.size(); ++s)
      EXPECT_NEAR(reference.steps[s].loss, one_rank.steps[s].loss, 1e-6 * one_rank.steps[s].loss)
          << "world " << world << ", step " << s + 1;
    std::string worst;
    const double error =
        testing::weights_relative_error(reference.weights, one_rank.weights, &worst);
    std::printf(
        "world %d, schedule %s, against one rank: worst per-tensor weight error %.2e (%s)\n", world,
        schedule, error, worst.c_str());
    EXPECT_LT(error, 1e-6) << "world " << world << ", worst tensor " << worst;
  }
}

TEST_F(EngineEquivalence, MixedPrecisionPlacementsAgreeBitwise) {
  for (const char* precision : {"bf16", "fp16"}) {
    std::vector<EngineRun> runs = testing::every_placement(2, precision);
    const EngineOutcome reference = train(runs[0]);
    for (size_t i = 1; i < runs.size(); ++i) {
      // Every placement at two ranks would take long; stage 3 and the optimizer tiers cover the
      // rest.
      if (runs[i].stage != 3 && runs[i].stage != 1) continue;
      expect_identical(train(runs[i]), reference, runs[i].label());
    }
  }
}

TEST_F(EngineEquivalence, OverlapAndReduceScatterChangeTimingNotResults) {
  for (int stage : {1, 2, 3}) {
    EngineRun base;
    base.stage = stage;
    base.world = 2;
    base.offload_optimizer = "cpu";
    const EngineOutcome reference = train(base);
    EngineRun no_overlap = base;
    no_overlap.overlap_comm = false;
    expect_identical(train(no_overlap), reference, no_overlap.label());
    EngineRun all_reduce = base;
    all_reduce.reduce_scatter = false;
    expect_identical(train(all_reduce), reference, all_reduce.label());
  }
}

TEST_F(EngineEquivalence, Bf16GradientReductionIsCloseAndPlacementIndependent) {
  EngineRun base;
  base.world = 3;
  base.grad_accum = 2;
  const EngineOutcome fp32_reduce = train(base);
  base.reduce_in_bf16 = true;
  const EngineOutcome reference = train(base);
  for (int stage : {1, 2, 3}) {
    for (bool scatter : {true, false}) {
      EngineRun run = base;
      run.stage = stage;
      run.reduce_scatter = scatter;
      run.offload_optimizer = "cpu";
      expect_identical(train(run), reference, "bf16 reduce " + run.label());
    }
  }
  // bf16 keeps 8 bits of mantissa: the gradients differ at about 2^-9, the losses barely.
  for (size_t s = 0; s < reference.steps.size(); ++s) {
    EXPECT_NE(reference.steps[s].grad_norm, fp32_reduce.steps[s].grad_norm) << "step " << s + 1;
    EXPECT_NEAR(reference.steps[s].grad_norm, fp32_reduce.steps[s].grad_norm,
                1e-2 * fp32_reduce.steps[s].grad_norm);
    EXPECT_NEAR(reference.steps[s].loss, fp32_reduce.steps[s].loss,
                1e-3 * fp32_reduce.steps[s].loss);
  }
}

TEST_F(EngineEquivalence, OptimizerDuringBackwardChangesTimingNotResults) {
  // Without clipping (fp32) each unit's update runs as soon as its gradient is
  // final; a clipping bound no norm reaches keeps the exact schedule and the
  // same arithmetic (a multiply by 1).
  for (EngineRun run : testing::every_placement(2, "fp32")) {
    if (run.stage == 0 && run.offload_optimizer != "none") continue;
    run.clipping = 1e9;
    const EngineOutcome exact = train(run);
    run.clipping = 0.0;
    Result<TrainConfig> config = testing::engine_config(run, dir_.path());
    ASSERT_TRUE(config.is_ok());
    Result<TrainingPlan> plan =
        plan_training(plan_input_from_config(*config, testing::small_gqa_model()));
    ASSERT_TRUE(plan.is_ok());
    ASSERT_TRUE(plan->input.optimizer_during_backward);
    size_t first_update = 0, exchange = 0;
    for (size_t i = 0; i < plan->ops.size(); ++i) {
      if (plan->ops[i].kind == OpKind::optimizer && first_update == 0) first_update = i;
      if (plan->ops[i].kind == OpKind::exchange) exchange = i;
    }
    EXPECT_LT(first_update, exchange) << run.label();
    expect_identical(train(run), exact, "during backward, " + run.label());
  }
}

TEST_F(EngineEquivalence, TiedEmbeddingsAcrossStages) {
  EngineRun base;
  base.tied = true;
  base.world = 2;
  base.schedule = "micro_batch";  // the stages are compared within one schedule
  const EngineOutcome reference = train(base);
  for (int stage : {2, 3}) {
    EngineRun run = base;
    run.stage = stage;
    run.offload_param = stage == 3 ? "nvme" : "none";
    run.offload_optimizer = "nvme";
    expect_identical(train(run), reference, "tied " + run.label());
  }
}

TEST_F(EngineEquivalence, GradientAccumulationMatchesALargerMicroBatch) {
  EngineRun accumulated;
  accumulated.eps = 1e-6;  // see EveryPlacementIsBitwiseIdenticalAtEachWorldSize
  accumulated.micro_batch = 2;
  accumulated.grad_accum = 2;
  accumulated.stage = 2;
  accumulated.world = 2;
  EngineRun wide = accumulated;
  wide.micro_batch = 4;
  wide.grad_accum = 1;
  // Section 5's order gives both the same global batch (sequences 0-7 of each step).
  const EngineOutcome a = train(accumulated);
  const EngineOutcome b = train(wide);
  ASSERT_EQ(a.steps.size(), b.steps.size());
  for (size_t s = 0; s < a.steps.size(); ++s)
    EXPECT_NEAR(a.steps[s].loss, b.steps[s].loss, 1e-6 * b.steps[s].loss) << "step " << s + 1;
  // The two add the micro-batches' gradients in other orders: near, but for
  // the few weights AdamW's division flips (testing::expect_weights_near).
  testing::expect_weights_near(a, b, accumulated.lr, 1e-4, "accumulated against wide");
}

TEST_F(EngineEquivalence, SchedulesAndClippingReachTheUpdate) {
  EngineRun run;
  run.scheduler = "WarmupLR";
  run.steps = 3;
  const EngineOutcome warm = train(run);
  ASSERT_EQ(warm.steps.size(), 3u);
  // DeepSpeed's WarmupLR: the first updates use warmup_min_lr, then the log ramp.
  EXPECT_LE(warm.steps[0].lr, warm.steps[1].lr);
  EXPECT_LT(warm.steps[1].lr, warm.steps[2].lr);
  run.scheduler = "";
  run.clipping = 1e-3;  // every step clipped
  const EngineOutcome clipped = train(run);
  run.clipping = 0.0;
  const EngineOutcome unclipped = train(run);
  EXPECT_EQ(clipped.steps[0].loss, unclipped.steps[0].loss);
  EXPECT_GT(testing::weights_relative_error(clipped.weights, unclipped.weights), 1e-4);
}

}  // namespace
}  // namespace strata
