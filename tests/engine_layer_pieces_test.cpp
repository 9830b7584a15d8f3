// The engine trains a model whose decoder layers are cut into their
// attention and their MLP (strata.layer_pieces 2) as it trains whole layers:
//  - every placement and both schedules give the same bits at a fixed world size;
//  - without clipping, the pieces give the whole layers' bits, losses and
//    weights, dense and mixture, in several homes and both schedules: the cut
//    sums nothing another way (tests/model_gradient_test.cpp shows it unit by
//    unit); the reported gradient norm adds each layer's sum of squares as
//    two partial sums, within 1e-12;
//  - with clipping, the losses and gradient norms stay within 1e-12 and the
//    weights within 1e-6: the norm adds the layers' two partial sums of
//    squares as two, and the clipping factor follows its last bits;
//  - the pieces lower the parameter slots the plan sizes by its largest
//    unit, and the run keeps to its plan (NVMe bytes, peaks);
//  - a checkpoint resumes bitwise, and into whole layers and back; int8
//    state, blocked per unit, is refused in one line naming the flags;
//  - on the CUDA backend's data paths (emulated) the pieces give the whole
//    layers' bits too, and the run keeps to its plan;
//  - a count other than 1 or 2 is refused in one line.
#include <gtest/gtest.h>

#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineLayerPieces : public testing::EngineRunsTest {
 protected:
  EngineLayerPieces() : EngineRunsTest("engine_layer_pieces") {}
};

std::vector<EngineRun> pieces_placements(int world, const std::string& schedule, int64_t pieces) {
  return testing::cut_placements(world, schedule,
                                 [&](EngineRun& run) { run.layer_pieces = pieces; });
}

TEST_F(EngineLayerPieces, EveryPlacementAndScheduleGivesTheSameBits) {
  expect_placements_and_schedules_identical(
      [](int world, const std::string& schedule) { return pieces_placements(world, schedule, 2); },
      1u + 2u * 2u + 1u);
}

TEST_F(EngineLayerPieces, PiecesGiveTheWholeLayersBits) {
  for (bool moe : {false, true}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      std::vector<EngineRun> runs = pieces_placements(1, schedule, 2);
      for (size_t i : {size_t(0), runs.size() / 2, runs.size() - 1}) {
        EngineRun cut = runs[i];
        cut.moe = moe;
        cut.clipping = 0.0;
        EngineRun whole = cut;
        whole.layer_pieces = 1;
        const EngineOutcome a = train(cut), b = train(whole);
        ASSERT_EQ(a.steps.size(), 2u) << cut.label();
        for (size_t s = 0; s < a.steps.size(); ++s)
          EXPECT_EQ(a.steps[s].loss, b.steps[s].loss) << cut.label() << ", step " << s + 1;
        testing::expect_steps_near(a, b, 0, 1e-12, cut.label());  // the norm as reported
        EXPECT_TRUE(testing::weights_bitwise_equal(a.weights, b.weights)) << cut.label();
      }
    }
  }
}

TEST_F(EngineLayerPieces, WithClippingTheNormsGroupingIsAllThatDiffers) {
  EngineRun cut = pieces_placements(1, "layer", 2).back();  // stage 3, everything on NVMe
  cut.steps = 3;
  cut.clipping = 0.05;  // below the gradients' norm: every step is clipped
  EngineRun whole = cut;
  whole.layer_pieces = 1;
  const EngineOutcome a = train(cut), b = train(whole);
  ASSERT_EQ(a.steps.size(), 3u) << cut.label();
  EXPECT_EQ(a.steps[0].loss, b.steps[0].loss) << cut.label();
  EXPECT_GT(a.steps[0].grad_norm, cut.clipping) << cut.label();
  testing::expect_steps_near(a, b, 1e-12, 1e-12, cut.label());
  std::string worst;
  const double error = testing::weights_relative_error(a.weights, b.weights, &worst);
  std::printf("layer pieces against whole layers, clipped: worst weight error %.2e (%s)\n", error,
              worst.c_str());
  EXPECT_LT(error, 1e-6) << cut.label() << ", worst tensor " << worst;
}

TEST_F(EngineLayerPieces, PiecesLowerTheSlotsAndTheRunKeepsToThePlan) {
  // The fetched and gathered parameter copies and the unit gradients are
  // sized by the largest unit: in pieces, a layer's MLP.
  expect_cut_lowers_the_slots(pieces_placements(1, "micro_batch", 1).back(),
                              pieces_placements(1, "micro_batch", 2).back(),
                              "with whole layers, {} in pieces");
}

TEST_F(EngineLayerPieces, ACheckpointResumesBitwise) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun run = pieces_placements(1, schedule, 2).back();  // stage 3, everything on NVMe
    run.steps = 3;
    expect_resumes_bitwise(run, 1);
  }
}

TEST_F(EngineLayerPieces, ACheckpointResumesIntoWholeLayersAndBack) {
  for (int64_t from : {2, 1}) {
    EngineRun run = pieces_placements(1, "auto", from).back();
    run.vocab_chunks = 2;  // both cuts at once: each tensor is read where it lies
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    ASSERT_TRUE(options.is_ok()) << options.status().message();
    Result<std::unique_ptr<Engine>> first = Engine::create(*options);
    ASSERT_TRUE(first.is_ok()) << first.status().message();
    ASSERT_TRUE((*first)->step().is_ok());
    const std::string where = dir_.path() + "/ckpt-" + std::to_string(from);
    Result<std::string> saved = (*first)->save_checkpoint(where);
    ASSERT_TRUE(saved.is_ok()) << saved.status().message();
    Result<HostModel> before = (*first)->read_model();
    ASSERT_TRUE(before.is_ok());
    first->reset();
    EngineRun other = run;
    other.layer_pieces = 3 - from;
    other.vocab_chunks = 1;
    Result<EngineOptions> resumed = testing::engine_options(other, dir_.path(), tokens_, seed_);
    ASSERT_TRUE(resumed.is_ok());
    resumed->resume_from = *saved;
    Result<std::unique_ptr<Engine>> second = Engine::create(*resumed);
    ASSERT_TRUE(second.is_ok()) << second.status().message();
    Result<HostModel> after = (*second)->read_model();
    ASSERT_TRUE(after.is_ok());
    EXPECT_TRUE(testing::weights_bitwise_equal(*after, *before)) << other.label();
    EXPECT_TRUE((*second)->step().is_ok()) << other.label();
  }
  // int8 moments are blocked per unit: another cut is refused in one line.
  const EngineRun run = pieces_placements(1, "auto", 2).back();
  EngineRun whole = run;
  whole.layer_pieces = 1;
  expect_int8_resume_refused(run, whole, "pass --vocab-chunks 1 --layer-pieces 2 to resume it");
}

// The CUDA backend's data paths (EngineOptions::emulate_gpu: plans for a
// GPU, device buffers in host memory, computed by the CPU units) carry the
// pieces as they carry whole layers.
TEST_F(EngineLayerPieces, OnTheGpuPathsPiecesGiveTheWholeLayersBits) {
  std::vector<EngineRun> runs = pieces_placements(1, "layer", 2);
  for (size_t i : {size_t(0), runs.size() - 1}) {
    EngineRun cut = runs[i];
    cut.emulate_gpu = true;
    cut.clipping = 0.0;
    EngineRun whole = cut;
    whole.layer_pieces = 1;
    const EngineOutcome a = train(cut), b = train(whole);
    ASSERT_EQ(a.steps.size(), 2u) << cut.label();
    EXPECT_TRUE(a.plan.input.gpu) << cut.label();
    EXPECT_GT(a.plan.units.size(), b.plan.units.size()) << cut.label();
    for (size_t s = 0; s < a.steps.size(); ++s)
      EXPECT_EQ(a.steps[s].loss, b.steps[s].loss) << cut.label() << ", step " << s + 1;
    EXPECT_TRUE(testing::weights_bitwise_equal(a.weights, b.weights)) << cut.label();
    if (i == runs.size() - 1)  // everything on NVMe
      testing::expect_run_keeps_to_its_plan(a, uint64_t(cut.steps), cut.label());
  }
}

TEST_F(EngineLayerPieces, OtherCountsAreRefused) {
  EngineRun three = pieces_placements(1, "auto", 3)[0];
  Result<EngineOptions> options = testing::engine_options(three, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok());
  Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_NE(engine.status().message().find("strata.layer_pieces: expected 1 (whole decoder "
                                           "layers) or 2"),
            std::string::npos)
      << engine.status().message();
}

}  // namespace
}  // namespace strata
