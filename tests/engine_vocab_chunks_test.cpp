// The engine trains a model whose embedding and head are cut along the
// vocabulary (strata.vocab_chunks) as it trains whole units: every placement
// and both schedules give the same bits at a fixed world size; against the
// whole units the first step's loss is the same bits, the losses and gradient
// norms stay within the dense engine's 1e-6 and the weights within 1e-4 (the
// head's input gradient sums over the chunks in another order:
// tests/model_vocab_chunks_test.cpp bounds it); the
// chunks lower the plan's peak and the run stays inside it, NVMe bytes are the
// plan's; a checkpoint resumes bitwise, and into another cut; the CUDA
// backend's data paths (emulated) give the same agreement.
#include <gtest/gtest.h>

#include "engine_test_support.h"
#include "kernels/cpu/gemm.h"

namespace strata {
namespace {

using testing::EngineOutcome;
using testing::EngineRun;

class EngineVocabChunks : public testing::EngineRunsTest {
 protected:
  EngineVocabChunks() : EngineRunsTest("engine_vocab_chunks") {}
};

std::vector<EngineRun> chunked_placements(int world, const std::string& schedule, int64_t chunks) {
  return testing::cut_placements(world, schedule,
                                 [&](EngineRun& run) { run.vocab_chunks = chunks; });
}

TEST_F(EngineVocabChunks, EveryPlacementAndScheduleGivesTheSameBits) {
  expect_placements_and_schedules_identical(
      [](int world, const std::string& schedule) { return chunked_placements(world, schedule, 3); },
      3u + 2u + 3u);
}

TEST_F(EngineVocabChunks, CutAndWholeUnitsAgree) {
  // The reference products: each logit and lm_head gradient is then the
  // whole head's bits, so the first loss is equal and only the head's input
  // gradient differs, by the rounding of a sum taken in another order.
  const kernels::cpu::GemmKernel fast = kernels::cpu::gemm_info().library_kernel;
  ASSERT_TRUE(kernels::cpu::select_gemm_kernel(kernels::cpu::GemmKernel::reference).is_ok());
  EngineRun whole = chunked_placements(1, "auto", 1).back();  // stage 3, everything on NVMe
  whole.steps = 2;
  whole.eps = 1e-6;  // as engine_equivalence_test: near-cancelled gradients damped
  const EngineOutcome reference = train(whole);
  for (int64_t chunks : {2, 3, 5}) {
    EngineRun run = whole;
    run.vocab_chunks = chunks;
    const EngineOutcome cut = train(run);
    ASSERT_EQ(cut.steps.size(), 2u) << run.label();
    EXPECT_EQ(cut.steps[0].loss, reference.steps[0].loss) << run.label();
    testing::expect_steps_near(cut, reference, 1e-6, 1e-6, run.label());
    // AdamW divides each gradient by its own magnitude (plus eps): where a
    // gradient is near eps its last bits move the update, so the weights get
    // a looser tolerance than the losses.
    const testing::WeightsDrift drift =
        testing::expect_weights_near(cut, reference, run.lr, 1e-4, run.label());
    std::printf(
        "%lld vocabulary chunks against whole units: worst weight error %.2e (%s), %lld flipped\n",
        static_cast<long long>(chunks), drift.relative, drift.where.c_str(),
        static_cast<long long>(drift.flipped));
  }
  EXPECT_TRUE(kernels::cpu::select_gemm_kernel(fast).is_ok());
}

// The CUDA backend's data paths (EngineOptions::emulate_gpu: plans for a
// GPU, the logits store in its device tier, computed by the CPU units) carry
// the chunks as the CPU backend does: against whole units, as above.
TEST_F(EngineVocabChunks, OnTheGpuPathsCutAndWholeUnitsAgree) {
  const kernels::cpu::GemmKernel fast = kernels::cpu::gemm_info().library_kernel;
  ASSERT_TRUE(kernels::cpu::select_gemm_kernel(kernels::cpu::GemmKernel::reference).is_ok());
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun whole = chunked_placements(1, schedule, 1).back();  // stage 3, everything on NVMe
    whole.emulate_gpu = true;
    whole.grad_accum = 2;
    whole.eps = 1e-6;
    const EngineOutcome reference = train(whole);
    EngineRun run = whole;
    run.vocab_chunks = 3;
    const EngineOutcome cut = train(run);
    ASSERT_EQ(cut.steps.size(), 2u) << run.label();
    EXPECT_TRUE(cut.plan.input.gpu) << run.label();
    EXPECT_NE(cut.plan.buffer(BufferRole::gpu_head_logits), nullptr) << run.label();
    EXPECT_EQ(cut.steps[0].loss, reference.steps[0].loss) << run.label();
    testing::expect_steps_near(cut, reference, 1e-6, 1e-6, run.label());
    testing::expect_weights_near(cut, reference, run.lr, 1e-4, run.label());
    testing::expect_run_keeps_to_its_plan(cut, uint64_t(run.steps), run.label());
  }
  EXPECT_TRUE(kernels::cpu::select_gemm_kernel(fast).is_ok());
}

TEST_F(EngineVocabChunks, ChunksLowerThePeakAndTheRunKeepsToThePlan) {
  // A vocabulary of 3000 rows makes the embedding and the head the largest
  // units by far (192,000 parameters against a layer's 37,000): cut in 4,
  // the units the plan sizes its slots by shrink, and so do the working buffers.
  int64_t whole_peak = 0;
  for (int64_t chunks : {1, 4}) {
    // The micro-batch order: one copy of the cut head's logits (the
    // layer-major order keeps one per micro-batch, B T V floats each).
    EngineRun run = chunked_placements(1, "micro_batch", chunks).back();
    run.vocab_size = 3000;
    const EngineOutcome outcome = train(run);
    ASSERT_EQ(outcome.steps.size(), 2u) << run.label();
    const TrainingPlan& plan = outcome.plan;
    testing::expect_run_keeps_to_its_plan(outcome, uint64_t(run.steps), run.label());
    // What the chunks change: the working buffers (the state is the same bytes either way).
    int64_t peak = 0;
    for (const PlanBuffer& buffer : plan.buffers)
      if (!state_shard_kind(buffer.role) && buffer.tier != tiers::Tier::nvme) peak += buffer.bytes;
    if (chunks == 1) {
      whole_peak = peak;
    } else {
      std::printf("working buffers in device and host: %lld bytes whole, %lld cut in %lld\n",
                  static_cast<long long>(whole_peak), static_cast<long long>(peak),
                  static_cast<long long>(chunks));
      EXPECT_LT(double(peak), 0.6 * double(whole_peak)) << run.label();
    }
  }
}

TEST_F(EngineVocabChunks, ACheckpointResumesBitwise) {
  for (const char* schedule : {"micro_batch", "layer"}) {
    EngineRun run = chunked_placements(1, schedule, 3).back();  // stage 3, everything on NVMe
    run.steps = 3;
    expect_resumes_bitwise(run, 1);
  }
}

TEST_F(EngineVocabChunks, ACheckpointResumesIntoAnotherCut) {
  EngineRun run = chunked_placements(1, "auto", 3).back();
  Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok()) << options.status().message();
  Result<std::unique_ptr<Engine>> first = Engine::create(*options);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  ASSERT_TRUE((*first)->step().is_ok());
  Result<std::string> saved = (*first)->save_checkpoint(dir_.path() + "/cut-ckpt");
  ASSERT_TRUE(saved.is_ok()) << saved.status().message();
  Result<HostModel> before = (*first)->read_model();
  ASSERT_TRUE(before.is_ok());
  first->reset();
  // Whole units read the cut run's state where the whole tensors' rows lie.
  for (int64_t chunks : {1, 2}) {
    EngineRun other = run;
    other.vocab_chunks = chunks;
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
  EngineRun whole = run;
  whole.vocab_chunks = 1;
  expect_int8_resume_refused(run, whole, "pass --vocab-chunks 3 --layer-pieces 1 to resume it");
}

TEST_F(EngineVocabChunks, ModelsThatCannotBeCutAreRefused) {
  EngineRun tied = chunked_placements(1, "auto", 2)[0];
  tied.tied = true;
  Result<EngineOptions> options = testing::engine_options(tied, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok());
  Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_NE(engine.status().message().find("tie_word_embeddings"), std::string::npos)
      << engine.status().message();
  EngineRun too_many = chunked_placements(1, "auto", 97)[0];
  options = testing::engine_options(too_many, dir_.path(), tokens_, seed_);
  ASSERT_TRUE(options.is_ok());
  engine = Engine::create(*options);
  ASSERT_FALSE(engine.is_ok());
  EXPECT_NE(engine.status().message().find(
                "strata.vocab_chunks: expected 1 to the vocabulary's 96 rows, got 97"),
            std::string::npos)
      << engine.status().message();
}

}  // namespace
}  // namespace strata
