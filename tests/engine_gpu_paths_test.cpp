// The CUDA backend's data paths, run where no GPU is: the engine with
// EngineOptions::emulate_gpu plans every placement as for a GPU and drives
// GpuRank's calls (computing in place or from uploaded copies, gradients in
// place or through pinned host slots, reduced gradients accumulated into
// their device home, new parameters uploaded from the CPU optimizer or
// downloaded from the GPU's, the parameter all-gather staged through host
// memory), with host memory standing in for the GPU and the CPU units
// computing (GpuRank::create_emulated).
//
// The arithmetic is then the CPU backend's, so every placement whose
// gradients pass through host memory must give the CPU backend's losses,
// gradient norms and weights bitwise, at 1, 2 and 3 ranks, in fp32, bf16,
// tied, with a bf16 gradient reduction, with the optimizer running during
// backward and for a mixture of experts (its router statistics in host memory); placements whose
// gradients accumulate in place (one rank, optimizer on the GPU) accumulate inside the backward, so
// they agree with each other bitwise and with the CPU backend closely. A run with its state on the
// GPU resumes bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <string>

#include "core/engine/engine.h"
#include "core/plan/expert_fetch.h"
#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineGpuPaths : public testing::EngineRunsTest {
 protected:
  EngineGpuPaths() : EngineRunsTest("engine_gpu_paths") {}

  static std::vector<EngineRun> placements(int world, const std::string& precision,
                                           const std::string& schedule = "") {
    std::vector<EngineRun> runs = testing::every_placement(world, precision, schedule);
    for (EngineRun& run : runs) run.emulate_gpu = true;
    return runs;
  }
  static bool grads_in_place(const EngineRun& run) {
    return run.world == 1 && run.offload_optimizer == "none" && !run.reduce_in_bf16;
  }
  // Every placement of `runs` against the CPU backend's run of runs[0].
  void expect_cpu_backend_results(std::vector<EngineRun> runs) {
    EngineRun cpu = runs[0];
    cpu.emulate_gpu = false;
    const EngineOutcome reference = train(cpu);
    ASSERT_EQ(reference.steps.size(), size_t(cpu.steps)) << cpu.label();
    std::optional<EngineOutcome> in_place;
    std::string in_place_label;
    for (const EngineRun& run : runs) {
      const EngineOutcome outcome = train(run);
      ASSERT_EQ(outcome.steps.size(), reference.steps.size()) << run.label();
      if (!grads_in_place(run)) {
        testing::expect_identical(outcome, reference, run.label() + " vs the CPU backend");
        continue;
      }
      if (in_place) {
        testing::expect_identical(outcome, *in_place, run.label() + " vs " + in_place_label);
        continue;
      }
      in_place = outcome;
      in_place_label = run.label();
      testing::expect_steps_near(outcome, reference, 1e-5, 1e-4, run.label());
      testing::expect_weights_near(outcome, reference, run.lr, 1e-4, run.label());
      EXPECT_NE(outcome.steps.front().loss, outcome.steps.back().loss) << "it trained";
    }
  }
};

TEST_F(EngineGpuPaths, EveryPlacementGivesTheCpuBackendsResultsAtEachWorldSize) {
  for (int world : {1, 2, 3}) {
    std::vector<EngineRun> runs = placements(world, "fp32");
    for (EngineRun& run : runs) run.steps = 2;
    expect_cpu_backend_results(runs);
  }
  // Layer-major at two ranks: the GPU sums a unit's micro-batch gradients on
  // the device and sends the sum down once, the CPU backend sums them in host
  // memory; both then reduce once, with the same bits.
  std::vector<EngineRun> runs = placements(2, "fp32", "layer");
  for (EngineRun& run : runs) {
    run.steps = 2;
    run.grad_accum = 3;
  }
  expect_cpu_backend_results(runs);
}

TEST_F(EngineGpuPaths, Bf16TiedPlacementsGiveTheCpuBackendsResults) {
  std::vector<EngineRun> runs = placements(2, "bf16");
  for (EngineRun& run : runs) {
    run.tied = true;
    run.steps = 2;
  }
  expect_cpu_backend_results(runs);
  // One rank, tied: the lm_head's gradient meets the embedding's in its home.
  std::vector<EngineRun> one = placements(1, "bf16");
  for (EngineRun& run : one) {
    run.tied = true;
    run.steps = 2;
  }
  expect_cpu_backend_results(one);
}

TEST_F(EngineGpuPaths, OptimizerDuringBackwardGivesTheCpuBackendsResults) {
  // No clipping in fp32: each unit's update runs as soon as its gradient is final.
  std::vector<EngineRun> runs = placements(2, "fp32");
  for (EngineRun& run : runs) {
    run.clipping = 0.0;
    run.steps = 2;
  }
  expect_cpu_backend_results(runs);
}

TEST_F(EngineGpuPaths, Bf16GradientReductionRoundsAsOnTheCpuBackend) {
  // Even with one rank the reduction rounds each micro-batch's gradient to
  // bf16, so gradients pass through host memory there too.
  for (int world : {1, 2}) {
    std::vector<EngineRun> runs = placements(world, "fp32");
    for (EngineRun& run : runs) {
      run.reduce_in_bf16 = true;
      run.steps = 2;
    }
    expect_cpu_backend_results(runs);
  }
}

TEST_F(EngineGpuPaths, AMixtureOfExpertsGivesTheCpuBackendsResults) {
  // The router's statistics stay in host memory beside a GPU: each sparse
  // layer's forward adds to them and the backwards take the load-balancing
  // gradient from them, through GpuRank's calls as through the CPU's.
  for (int world : {1, 2}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      std::vector<EngineRun> runs = placements(world, "fp32", schedule);
      for (EngineRun& run : runs) {
        run.moe = true;
        run.steps = 2;
        run.grad_accum = 2;
        run.lr = 1e-3;
      }
      expect_cpu_backend_results(runs);
    }
  }
  // A sparse layer in pieces, its MLP piece routing on its own.
  std::vector<EngineRun> pieces = placements(1, "bf16");
  for (EngineRun& run : pieces) {
    run.moe = true;
    run.steps = 2;
    run.layer_pieces = 2;
  }
  expect_cpu_backend_results(pieces);
}

// Routed expert reads through GpuRank: the routing computed from the
// upload of the norm and router, the experts read from NVMe then taken by
// that upload. The bits are the CPU backend's, the NVMe bytes each step
// reads those the plan counts for its routing; deferred updates (the
// optimizer on the CPU) give the eager bits.
TEST_F(EngineGpuPaths, RoutedExpertReadsAndDeferredUpdatesGiveTheCpuBackendsResults) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun routed = testing::routed_moe_run(schedule, "bf16");
    routed.offload_optimizer = "cpu";
    routed.grad_accum = 3;
    routed.steps = 3;
    routed.emulate_gpu = true;
    EngineRun cpu = routed;
    cpu.emulate_gpu = false;
    const EngineOutcome g = train(routed), c = train(cpu);
    ASSERT_EQ(g.steps.size(), 3u) << routed.label();
    ASSERT_TRUE(g.plan.input.gpu) << routed.label();
    ASSERT_TRUE(g.plan.routed_expert_fetch) << routed.label() << ": " << g.plan.expert_fetch_reason;
    testing::expect_identical(g, c, routed.label() + " vs the CPU backend");
    bool some_left_out = false;
    for (size_t s = 0; s < g.steps.size(); ++s) {
      EXPECT_EQ(g.steps[s].routing, c.steps[s].routing) << routed.label() << " step " << s + 1;
      EXPECT_EQ(int64_t(g.steps[s].nvme_read_bytes),
                routed_parameter_reads(g.plan, g.steps[s].routing))
          << routed.label() << " step " << s + 1;
      for (const auto& unit : g.steps[s].routing)
        for (const auto& micro : unit)
          some_left_out = some_left_out || std::count(micro.begin(), micro.end(), 0) > 0;
    }
    EXPECT_TRUE(some_left_out) << "every expert reached: the test shows nothing";

    for (const char* optimizer : {"nvme", "cpu"}) {
      EngineRun deferred = routed;
      deferred.offload_optimizer = optimizer;
      deferred.grad_accum = 2;
      deferred.steps = 4;
      deferred.expert_update = "deferred";
      EngineRun eager = deferred;
      eager.expert_update = "eager";
      eager.emulate_gpu = false;
      const EngineOutcome d = train(deferred), e = train(eager);
      ASSERT_EQ(d.steps.size(), 4u) << deferred.label();
      ASSERT_TRUE(d.plan.deferred_expert_updates)
          << deferred.label() << ": " << d.plan.expert_update_reason;
      testing::expect_identical(d, e, deferred.label() + " vs the CPU backend's eager update");
    }
  }
  // The optimizer on the GPU steps every element: no deferral there.
  EngineRun on_gpu = testing::routed_moe_run("layer", "bf16");
  on_gpu.offload_optimizer = "none";
  on_gpu.expert_update = "deferred";
  on_gpu.emulate_gpu = true;
  on_gpu.steps = 2;
  const EngineOutcome o = train(on_gpu);
  ASSERT_EQ(o.steps.size(), 2u) << on_gpu.label();
  EXPECT_TRUE(o.plan.routed_expert_fetch) << o.plan.expert_fetch_reason;
  EXPECT_FALSE(o.plan.deferred_expert_updates);
  EXPECT_NE(o.plan.expert_update_reason.find("optimizer state is on the GPU"), std::string::npos)
      << o.plan.expert_update_reason;
}

TEST_F(EngineGpuPaths, StateOnTheGpuResumesBitwise) {
  for (const char* optimizer : {"none", "cpu"}) {
    EngineRun run;
    run.stage = 2;
    run.world = 2;
    run.offload_optimizer = optimizer;
    run.precision = "bf16";
    run.emulate_gpu = true;
    run.steps = 4;
    expect_resumes_bitwise(run, 2);
  }
}

}  // namespace
}  // namespace strata
