// The engine trains a dense model whose layers' MLP pieces are cut into
// parts along the intermediate dimension (strata.mlp_parts) near the run
// that keeps them whole:
//  - the down products and the normed rows' gradients sum in parts from the
//    first forward on, so the losses and gradient norms stay within 1e-6 of
//    the uncut run's and the weights within 1e-4, in every placement and
//    both schedules at one and two ranks (core/README.md, "MLP parts";
//    AdamW divides each gradient by its own magnitude, so near eps its last
//    bits move the update, as with the vocabulary chunks); the cut run
//    itself gives the same bits in both schedules at one rank;
//  - the parts lower the parameter slots the plan sizes by its largest
//    unit, and the run keeps to its plan (NVMe bytes, peaks);
//  - the middle parts keep no saved input of their own and spill none,
//    kept or spilled to the same bits;
//  - a checkpoint resumes bitwise, fp32 and bf16, and its state crosses
//    into the whole MLP piece or another count of parts exactly (resumed
//    there and saved again, it continues as the straight run); its export
//    is the whole tensors; int8 state, blocked per unit, is refused in one line naming
//    the flags;
//  - automatic parts where the MLP piece is what does not fit;
//  - the CUDA backend's data paths (emulated) carry the parts as the CPU
//    backend does (its bits);
//  - whole layers and a count above the rows are refused in one line.
#include <gtest/gtest.h>

#include "core/checkpoint/checkpoint.h"
#include "core/plan/planner.h"
#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineMlpParts : public testing::EngineRunsTest {
 protected:
  EngineMlpParts() : EngineRunsTest("engine_mlp_parts") {}

  // An engine of `run` resumed from `checkpoint` (none: from the start).
  std::unique_ptr<Engine> engine(const EngineRun& run, const std::string& checkpoint = "") {
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    EXPECT_TRUE(options.is_ok()) << options.status().message();
    if (!options) return nullptr;
    options->resume_from = checkpoint;
    Result<std::unique_ptr<Engine>> made = Engine::create(*options);
    EXPECT_TRUE(made.is_ok()) << run.label() << ": " << made.status().message();
    return made ? std::move(*made) : nullptr;
  }
  // `run` saved after a step, resumed with `through`'s cut and saved again
  // at once, then resumed with `run`'s: the straight run's later losses
  // and final weights, bit for bit.
  void expect_resumes_through(const EngineRun& run, const EngineRun& through) {
    const EngineOutcome straight = train(run);
    std::unique_ptr<Engine> first = engine(run);
    ASSERT_TRUE(first && first->step().is_ok()) << run.label();
    Result<std::string> saved = first->save_checkpoint(dir_.path() + "/first");
    ASSERT_TRUE(saved.is_ok()) << saved.status().message();
    first.reset();
    std::unique_ptr<Engine> middle = engine(through, *saved);
    ASSERT_TRUE(middle) << through.label();
    Result<std::string> again = middle->save_checkpoint(dir_.path() + "/through");
    ASSERT_TRUE(again.is_ok()) << again.status().message();
    middle.reset();
    std::unique_ptr<Engine> last = engine(run, *again);
    ASSERT_TRUE(last) << run.label();
    for (int s = 1; s < run.steps; ++s) {
      Result<StepResult> step = last->step();
      ASSERT_TRUE(step.is_ok()) << step.status().message();
      EXPECT_EQ(step->loss, straight.steps[size_t(s)].loss)
          << run.label() << " through " << through.mlp_parts << " parts, step " << s + 1;
    }
    Result<HostModel> weights = last->read_model();
    ASSERT_TRUE(weights.is_ok());
    EXPECT_TRUE(testing::weights_bitwise_equal(*weights, straight.weights))
        << run.label() << " through " << through.mlp_parts << " parts";
  }
};

std::vector<EngineRun> parts_placements(int world, const std::string& schedule, int64_t parts) {
  return testing::cut_placements(world, schedule, [&](EngineRun& run) {
    run.layer_pieces = 2;
    run.mlp_parts = parts;
    run.eps = 1e-6;  // as the vocabulary chunks': near-cancelled gradients damped (expect_near)
  });
}

void expect_near(const EngineOutcome& a, const EngineOutcome& b, const EngineRun& run) {
  testing::expect_steps_near(a, b, 1e-6, 1e-6, run.label());
  testing::expect_weights_near(a, b, run.lr, 1e-4, run.label());
}

TEST_F(EngineMlpParts, PartsStayNearTheWholeMlpEverywhere) {
  for (int world : {1, 2}) {
    for (const char* schedule : {"micro_batch", "layer"}) {
      std::vector<EngineRun> runs = parts_placements(world, schedule, 3);
      const std::vector<size_t> picked =
          world == 1 ? std::vector<size_t>{0, runs.size() / 2, runs.size() - 1}
                     : std::vector<size_t>{runs.size() - 1};
      for (size_t i : picked) {
        EngineRun cut = runs[i];
        EngineRun whole = cut;
        whole.mlp_parts = 1;
        const EngineOutcome a = train(cut), b = train(whole);
        ASSERT_EQ(a.steps.size(), size_t(cut.steps)) << cut.label();
        EXPECT_EQ(a.plan.units.size(), b.plan.units.size() + 2 * 2) << cut.label();
        expect_near(a, b, cut);
      }
    }
  }
  // The same cut trains to the same bits in both schedules at one rank.
  EngineRun micro = parts_placements(1, "micro_batch", 2).back();
  EngineRun layer = micro;
  layer.schedule = "layer";
  const EngineOutcome a = train(micro), b = train(layer);
  for (size_t s = 0; s < a.steps.size(); ++s) EXPECT_EQ(a.steps[s].loss, b.steps[s].loss);
  EXPECT_TRUE(testing::weights_bitwise_equal(a.weights, b.weights));
}

TEST_F(EngineMlpParts, PartsLowerTheSlotsAndTheRunKeepsToThePlan) {
  EngineRun whole = parts_placements(1, "micro_batch", 1).back();
  whole.intermediate = 256;  // an MLP large enough to set the largest unit
  EngineRun cut = whole;
  cut.mlp_parts = 4;
  expect_cut_lowers_the_slots(whole, cut, "with whole MLP pieces, {} in 4 parts");
}

// Parts 1 and 2 of 4 hand the normed rows on unchanged: 2 layers keep 4
// saved inputs fewer, and spill 3 fewer (the last layer's part 2 is among
// the last two levels, never spilled), in both schedules (the layer-major
// one keeps a copy per micro-batch).
TEST_F(EngineMlpParts, TheMiddlePartsShareTheSavedNormedRows) {
  for (const char* schedule : {"micro_batch", "layer"})
    expect_pieces_share_saved_inputs(parts_placements(1, schedule, 4).back(), 2 * 2, 2 * 2 - 1);
}

TEST_F(EngineMlpParts, ACheckpointResumesBitwiseAndAcrossTheCut) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    for (const char* precision : {"fp32", "bf16"}) {
      EngineRun run = parts_placements(1, schedule, 3).back();  // stage 3, everything on NVMe
      run.precision = precision;
      run.steps = 3;
      expect_resumes_bitwise(run, 1);
      // Across the cut the runs differ (the sums are cut otherwise), but the
      // state crosses exactly: saved in 3 parts, resumed whole (or in 2
      // parts) and saved again at once, resumed in 3 parts again, it
      // continues as the straight run does, bit for bit.
      for (int64_t other : {1, 2}) {
        EngineRun through = run;
        through.mlp_parts = other;
        expect_resumes_through(run, through);
      }
    }
  }
  const EngineRun run = parts_placements(1, "auto", 2).back();
  EngineRun whole = run;
  whole.mlp_parts = 1;
  expect_int8_resume_refused(run, whole,
                             "pass --vocab-chunks 1 --layer-pieces 2 --mlp-parts 2 to resume it");
}

TEST_F(EngineMlpParts, TheExportHoldsTheWholeTensors) {
  EngineRun run = parts_placements(1, "auto", 3).back();
  run.steps = 1;
  Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok()) << options.status().message();
  Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
  ASSERT_TRUE(engine.is_ok()) << engine.status().message();
  ASSERT_TRUE((*engine)->step().is_ok());
  Result<std::string> saved = (*engine)->save_checkpoint(dir_.path() + "/ckpt");
  ASSERT_TRUE(saved.is_ok()) << saved.status().message();
  Result<HostModel> weights = (*engine)->read_model();
  ASSERT_TRUE(weights.is_ok());
  const std::string out = dir_.path() + "/export";
  ASSERT_TRUE(export_checkpoint(*saved, out, DType::f32, 1ull << 30).is_ok());
  Result<SafetensorsCheckpoint> exported = SafetensorsCheckpoint::open(out);
  ASSERT_TRUE(exported.is_ok()) << exported.status().message();
  ModelConfig whole_config = weights->layout.config;
  whole_config.layer_pieces = 1;
  whole_config.mlp_parts = 1;
  HostModel whole = make_host_model(whole_config);
  ASSERT_TRUE(load_host_model(whole, *exported).is_ok());
  std::vector<float> scratch;
  for (const CheckpointTensor& t : checkpoint_tensor_groups(weights->layout)) {
    const float* ours = whole_tensor(
        t, [&](int64_t u) { return weights->params[size_t(u)].data(); }, scratch);
    EXPECT_EQ(std::memcmp(ours, whole.tensor(t.name), size_t(t.numel()) * 4), 0) << t.name;
  }
}

TEST_F(EngineMlpParts, AutomaticPartsWhereTheMlpPieceDoesNotFit) {
  EngineRun run = parts_placements(1, "micro_batch", 0).back();
  run.intermediate = 2048;  // the MLP piece, 3 x 64 x 2048 fp32 (1.5 MiB), sets the slots
  Result<TrainConfig> config = testing::engine_config(run, dir_.path());
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  ModelConfig model = testing::small_gqa_model();
  model.intermediate_size = run.intermediate;
  PlanInput in = plan_input_from_config(*config, model, PlanTarget{});
  ASSERT_TRUE(in.mlp_parts_auto);
  Result<PlanReport> roomy = plan_memory(in);
  ASSERT_TRUE(roomy.is_ok()) << roomy.status().message();
  EXPECT_EQ(roomy->input.model.mlp_parts, 1);
  EXPECT_NE(roomy->input.mlp_parts_reason.find("fits the budgets"), std::string::npos);
  // A device budget a little below the whole MLP piece's plan.
  PlanInput tight = in;
  tight.budgets.device_per_rank = roomy->verdicts[0].need - roomy->verdicts[0].need / 5;
  Result<PlanReport> cut = plan_memory(tight);
  ASSERT_TRUE(cut.is_ok()) << cut.status().message();
  EXPECT_TRUE(cut->fits) << cut->input.mlp_parts_reason;
  EXPECT_GT(cut->input.model.mlp_parts, 1);
  EXPECT_NE(cut->input.mlp_parts_reason.find("the fewest that fit"), std::string::npos)
      << cut->input.mlp_parts_reason;
}

// The CUDA backend's data paths (EngineOptions::emulate_gpu: plans for a
// GPU, the chain in its device tier, computed by the CPU units) carry the
// parts as the CPU backend does, at one and two ranks: near the whole MLP
// as above, and the CPU backend's cut run's bits (both compute with the
// CPU units in fp32).
TEST_F(EngineMlpParts, OnTheGpuPathsPartsStayNearTheWholeMlp) {
  for (const auto& [world, schedule] :
       {std::pair{1, "micro_batch"}, std::pair{1, "layer"}, std::pair{2, "micro_batch"}}) {
    // stage 3, everything on NVMe
    EngineRun cpu = parts_placements(world, schedule, 3).back();
    EngineRun cut = cpu;
    cut.emulate_gpu = true;
    EngineRun whole = cut;
    whole.mlp_parts = 1;
    const EngineOutcome a = train(cut), b = train(whole), c = train(cpu);
    EXPECT_TRUE(a.plan.input.gpu) << cut.label();
    EXPECT_NE(a.plan.buffer(BufferRole::gpu_expert_chain), nullptr) << cut.label();
    expect_near(a, b, cut);
    for (size_t s = 0; s < a.steps.size(); ++s)
      EXPECT_EQ(a.steps[s].loss, c.steps[s].loss) << cut.label() << ", step " << s + 1;
    EXPECT_TRUE(testing::weights_bitwise_equal(a.weights, c.weights)) << cut.label();
    if (world == 1) testing::expect_run_keeps_to_its_plan(a, uint64_t(cut.steps), cut.label());
  }
}

TEST_F(EngineMlpParts, WhatIsNotBuiltIsRefused) {
  EngineRun whole_layers = parts_placements(1, "auto", 2).back();
  whole_layers.layer_pieces = 1;
  expect_refused(whole_layers, "the layers must be in pieces; add --layer-pieces 2");
  EngineRun too_many = parts_placements(1, "auto", 97).back();
  expect_refused(too_many, "strata.mlp_parts 97: expected 1, or 2 to the 96 rows");
}

}  // namespace
}  // namespace strata
