// The engine trains a mixture whose sparse layers' MLP pieces are cut into
// a router piece and groups of experts (strata.expert_groups) as it trains
// the MLP pieces whole:
//  - top 2: every group count, placement and both schedules, at one and two
//    ranks, give the uncut run's bits, losses and weights (the groups add
//    the same products in the same order; tests/model_expert_groups_test.cpp
//    shows it unit by unit);
//  - top 3: the first loss bitwise, the losses and gradient norms within
//    1e-6 and the weights within 1e-4 over three steps (each token's rows'
//    gradients are summed in another order, core/README.md "Expert
//    groups"; AdamW divides each gradient by its own magnitude, so near eps
//    its last bits move the update, as with the vocabulary chunks: eps 1e-6
//    damps that, and testing::expect_weights_near allows the few weights it
//    still flips. With eps 1e-8 a flipped weight moved the routers' logits
//    enough to tip a token's third expert in about 1 seed in 20, and then
//    thousands of weights and the loss moved);
//  - the groups lower the parameter slots the plan sizes by its largest
//    unit, and the run keeps to its plan (NVMe bytes, peaks);
//  - the groups before the last keep no saved input of their own and
//    spill none, kept or spilled to the same bits;
//  - a checkpoint resumes bitwise, and from groups into the whole MLP piece
//    and back; int8 state, blocked per unit, is refused in one line naming
//    the flags;
//  - the CUDA backend's data paths (emulated) carry the groups to the
//    uncut bits too;
//  - whole layers and a count above the experts are refused in one line.
#include <gtest/gtest.h>

#include "core/plan/expert_fetch.h"
#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineExpertGroups : public testing::EngineRunsTest {
 protected:
  EngineExpertGroups() : EngineRunsTest("engine_expert_groups") {}
};

// The mixture (5 experts, top 2) in layer pieces, its MLP pieces cut into `groups`.
std::vector<EngineRun> groups_placements(int world, const std::string& schedule, int64_t groups) {
  return testing::cut_placements(world, schedule, [&](EngineRun& run) {
    run.moe = true;
    run.layer_pieces = 2;
    run.expert_groups = groups;
    run.clipping = 0.0;
  });
}

void expect_same_bits(const EngineOutcome& a, const EngineOutcome& b, const std::string& label) {
  ASSERT_EQ(a.steps.size(), b.steps.size()) << label;
  for (size_t s = 0; s < a.steps.size(); ++s)
    EXPECT_EQ(a.steps[s].loss, b.steps[s].loss) << label << ", step " << s + 1;
  testing::expect_steps_near(a, b, 0, 1e-12, label);  // the norm adds more partial sums
  EXPECT_TRUE(testing::weights_bitwise_equal(a.weights, b.weights)) << label;
}

TEST_F(EngineExpertGroups, TopTwoGivesTheUncutBitsEverywhere) {
  for (int world : {1, 2}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      std::vector<EngineRun> runs = groups_placements(world, schedule, 2);
      const std::vector<size_t> picked =
          world == 1 ? std::vector<size_t>{0, runs.size() / 2, runs.size() - 1}
                     : std::vector<size_t>{runs.size() - 1};
      for (size_t i : picked) {
        for (int64_t groups : {2, 5}) {
          EngineRun cut = runs[i];
          cut.expert_groups = groups;
          EngineRun whole = cut;
          whole.expert_groups = 1;
          const EngineOutcome a = train(cut), b = train(whole);
          EXPECT_GT(a.plan.units.size(), b.plan.units.size()) << cut.label();
          expect_same_bits(a, b, cut.label());
        }
      }
    }
  }
}

TEST_F(EngineExpertGroups, TopThreeStaysWithinTolerance) {
  EngineRun cut = groups_placements(1, "layer", 3).back();  // stage 3, everything on NVMe
  cut.experts_per_token = 3;
  cut.steps = 3;
  cut.eps = 1e-6;  // as the vocabulary chunks': near-cancelled gradients damped
  EngineRun whole = cut;
  whole.expert_groups = 1;
  const EngineOutcome a = train(cut), b = train(whole);
  ASSERT_EQ(a.steps.size(), 3u) << cut.label();
  EXPECT_EQ(a.steps[0].loss, b.steps[0].loss) << cut.label();  // the first forward is bitwise
  testing::expect_steps_near(a, b, 1e-6, 1e-6, cut.label());
  const testing::WeightsDrift drift = testing::expect_weights_near(a, b, cut.lr, 1e-4, cut.label());
  std::printf(
      "expert groups against the MLP piece, top 3: worst weight error %.2e (%s), %lld flipped\n",
      drift.relative, drift.where.c_str(), static_cast<long long>(drift.flipped));
}

TEST_F(EngineExpertGroups, GroupsLowerTheSlotsAndTheRunKeepsToThePlan) {
  EngineRun runs[2];
  for (int64_t groups : {1, 5}) {
    EngineRun& run = runs[groups == 1 ? 0 : 1];
    run = groups_placements(1, "micro_batch", groups).back();
    run.intermediate = 96;  // experts large enough to set the largest unit
    // Every expert read with its unit (the uncut run would read as routed,
    // fewer bytes than the plan's worst case when an expert gets no token).
    run.expert_fetch = "all";
  }
  expect_cut_lowers_the_slots(runs[0], runs[1], "with whole MLP pieces, {} in groups");
}

// Groups 0 and 1 of 3 hand the normed rows on unchanged: 2 sparse layers
// keep 4 saved inputs fewer and spill 3 fewer (the last layer's group 1 is
// among the last two levels), in both schedules (every expert read, so the
// NVMe bytes are the plan's, not fewer as routed), and sharing, the run
// keeps the uncut bits.
TEST_F(EngineExpertGroups, TheGroupsBeforeTheLastShareTheSavedNormedRows) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun run = groups_placements(1, schedule, 3).back();
    run.expert_fetch = "all";
    expect_pieces_share_saved_inputs(run, 2 * 2, 2 * 2 - 1);
    EngineRun uncut = run;
    uncut.expert_groups = 1;
    run.activation_home = "host";
    expect_same_bits(train(run), train(uncut), run.label());
  }
}

TEST_F(EngineExpertGroups, ACheckpointResumesBitwiseAndAcrossTheCut) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun run = groups_placements(1, schedule, 2).back();  // stage 3, everything on NVMe
    run.steps = 3;
    expect_resumes_bitwise(run, 1);
    EngineRun whole = run;
    whole.expert_groups = 1;
    expect_resumes_bitwise(run, 1, whole);  // saved in groups, resumed whole
    expect_resumes_bitwise(whole, 2, run);  // and the other way
  }
  const EngineRun run = groups_placements(1, "auto", 2).back();
  EngineRun whole = run;
  whole.expert_groups = 1;
  expect_int8_resume_refused(
      run, whole, "pass --vocab-chunks 1 --layer-pieces 2 --expert-groups 2 to resume it");
}

// The CUDA backend's data paths (EngineOptions::emulate_gpu: plans for a
// GPU, the chain in its device tier, computed by the CPU units) carry the
// groups as the CPU backend does: the uncut run's bits, in both schedules,
// at one and two ranks; at one rank each expert read as routed, the run's
// NVMe reads what the plan counts for its steps' routings, within the worst
// case. (These experts are smaller than an NVMe block: at the layer-major
// schedule a routing that reaches two experts sharing a block at different
// micro-batches reads the block twice, more than every expert at once
// would; the worst case counts each expert's blocks apart.)
TEST_F(EngineExpertGroups, OnTheGpuPathsTopTwoGivesTheUncutBits) {
  for (int world : {1, 2}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      EngineRun cut = groups_placements(world, schedule, 2).back();  // everything on NVMe
      cut.emulate_gpu = true;
      EngineRun whole = cut;
      whole.expert_groups = 1;
      const EngineOutcome a = train(cut), b = train(whole);
      EXPECT_TRUE(a.plan.input.gpu) << cut.label();
      EXPECT_NE(a.plan.buffer(BufferRole::gpu_expert_chain), nullptr) << cut.label();
      EXPECT_EQ(b.plan.buffer(BufferRole::gpu_expert_chain), nullptr) << cut.label();
      expect_same_bits(a, b, cut.label());
      if (world > 1) continue;
      ASSERT_TRUE(a.plan.routed_expert_fetch) << a.plan.expert_fetch_reason;
      const int64_t worst = a.plan.traffic_per_step.nvme_read;
      const int64_t rest = worst - worst_parameter_reads(a.plan);  // the optimizer's
      int64_t counted = 0;
      for (const StepResult& step : a.steps)
        counted += routed_parameter_reads(a.plan, step.routing) + rest;
      EXPECT_EQ(int64_t(a.nvme_read), counted) << cut.label();
      EXPECT_LE(int64_t(a.nvme_read), worst * int64_t(a.steps.size())) << cut.label();
    }
  }
}

TEST_F(EngineExpertGroups, WhatIsNotBuiltIsRefused) {
  EngineRun whole_layers = groups_placements(1, "auto", 2).back();
  whole_layers.layer_pieces = 1;
  expect_refused(whole_layers, "the layers must be in pieces; add --layer-pieces 2");
  EngineRun too_many = groups_placements(1, "auto", 6).back();
  expect_refused(too_many, "strata.expert_groups 6: expected 1, or 2 to the 5 experts");
}

}  // namespace
}  // namespace strata
