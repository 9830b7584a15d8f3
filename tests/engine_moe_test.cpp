// The engine trains a mixture of experts (small_moe_model: mixtral's router,
// 5 experts, top 2, the load-balancing loss in the loss) as it trains a dense
// model: every placement gives the same bits at a fixed world size and
// schedule, both schedules the same bits at one rank, 2 and 3 ranks agree
// with one within the dense engine's 1e-6 (at its eps, 1e-4); NVMe bytes are the plan's; a
// checkpoint resumes bitwise; the
// step reports the load-balancing loss, the mean over the global batch's
// micro-batches, and the loss includes it times the coefficient.
#include <gtest/gtest.h>

#include <cmath>

#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineMoe : public testing::EngineRunsTest {
 protected:
  EngineMoe() : EngineRunsTest("engine_moe") {}
};

std::vector<EngineRun> moe_placements(int world, const std::string& schedule) {
  std::vector<EngineRun> runs = testing::every_placement(world, "fp32", schedule);
  for (EngineRun& run : runs) {
    run.moe = true;
    run.grad_accum = 6 / world;  // the same global batch at every world size
    run.lr = 1e-3;
    run.eps = 1e-4;  // as engine_equivalence_test: a near-cancelled gradient's update damped
    run.steps = 2;
  }
  return runs;
}

TEST_F(EngineMoe, EveryPlacementAndScheduleGivesTheSameBits) {
  EngineOutcome one_rank;
  for (auto [world, schedule] :
       {std::pair{1, "micro_batch"}, std::pair{1, "layer"}, std::pair{2, "micro_batch"},
        std::pair{2, "layer"}, std::pair{3, "layer"}}) {
    std::vector<EngineRun> runs = moe_placements(world, schedule);
    const EngineOutcome reference = train(runs[0]);
    ASSERT_EQ(reference.steps.size(), 2u) << runs[0].label();
    EXPECT_NE(reference.steps[0].loss, reference.steps[1].loss);
    // Every few placements (the whole list at one rank): stage 3 with NVMe among them.
    const size_t stride = world == 1 ? 1 : 4;
    for (size_t i = stride; i < runs.size(); i += stride)
      testing::expect_identical(train(runs[i]), reference,
                                runs[i].label() + " vs " + runs[0].label());
    if (world == 1 && one_rank.steps.empty()) {
      one_rank = reference;
      continue;
    }
    if (world == 1) {  // both schedules at one rank: the same additions
      testing::expect_identical(reference, one_rank, std::string("schedule ") + schedule);
      continue;
    }
    for (size_t s = 0; s < reference.steps.size(); ++s) {
      EXPECT_NEAR(reference.steps[s].loss, one_rank.steps[s].loss, 1e-6 * one_rank.steps[s].loss)
          << "world " << world << ", step " << s + 1;
      ASSERT_TRUE(reference.steps[s].aux_loss.has_value());
      EXPECT_NEAR(*reference.steps[s].aux_loss, *one_rank.steps[s].aux_loss,
                  1e-6 * *one_rank.steps[s].aux_loss);
    }
    std::string worst;
    const double error =
        testing::weights_relative_error(reference.weights, one_rank.weights, &worst);
    std::printf("moe, world %d, schedule %s, against one rank: worst weight error %.2e (%s)\n",
                world, schedule, error, worst.c_str());
    EXPECT_LT(error, 1e-6) << "world " << world << ", worst tensor " << worst;
  }
}

TEST_F(EngineMoe, TheStepReportsTheLoadBalancingLossInsideTheLoss) {
  EngineRun run = moe_placements(1, "auto")[0];
  run.steps = 1;
  const EngineOutcome with_aux = train(run);
  ASSERT_EQ(with_aux.steps.size(), 1u);
  ASSERT_TRUE(with_aux.steps[0].aux_loss.has_value());
  const double aux = *with_aux.steps[0].aux_loss;
  // E sum_e f_e P_e (the f_e summing to k) is k when the routing is even (here 2), at most E (5).
  EXPECT_GE(aux, 0.5);
  EXPECT_LE(aux, 5.0);
  // A dense model reports none.
  EngineRun dense = run;
  dense.moe = false;
  EXPECT_FALSE(train(dense).steps.at(0).aux_loss.has_value());
  // The first step's loss is the cross-entropy plus 0.02 x aux: the same
  // initial weights and tokens without output_router_logits give the
  // cross-entropy alone (and the same aux, which needs no gradient to be known).
  Result<testing::EngineOutcome> plain = [&]() -> Result<testing::EngineOutcome> {
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    if (!options) return options.status();
    options->model.output_router_logits = false;
    Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
    if (!engine) return engine.status();
    Result<StepResult> step = (*engine)->step();
    if (!step) return step.status();
    testing::EngineOutcome outcome;
    outcome.steps.push_back(*step);
    return outcome;
  }();
  ASSERT_TRUE(plain.is_ok()) << plain.status().message();
  EXPECT_EQ(*plain->steps[0].aux_loss, aux);
  EXPECT_NEAR(with_aux.steps[0].loss, plain->steps[0].loss + 0.02 * aux,
              1e-12 * with_aux.steps[0].loss);
}

TEST_F(EngineMoe, NvmeBytesEqualThePlanAndPeaksStayInBudget) {
  // A decoder layer is one unit: its experts travel with it, whatever the
  // routing, so the bytes are the plan's (its worst case) every step.
  for (int world : {1, 2}) {
    for (const char* precision : {"fp32", "bf16"}) {
      EngineRun run = moe_placements(world, "auto").back();  // stage 3, everything on NVMe
      run.precision = precision;
      const EngineOutcome outcome = train(run);
      ASSERT_EQ(outcome.steps.size(), 2u) << run.label();
      testing::expect_run_keeps_to_its_plan(outcome, uint64_t(run.steps) * uint64_t(world),
                                            run.label());
    }
  }
}

TEST_F(EngineMoe, ACheckpointResumesBitwise) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun run = moe_placements(1, schedule).back();  // stage 3, everything on NVMe
    run.steps = 3;
    expect_resumes_bitwise(run, 1);
  }
}

}  // namespace
}  // namespace strata
