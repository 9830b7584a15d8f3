// Training in the shuffled order (strata.shuffle): every world size and batch
// split reads the same sequences each step, a run resumed from a checkpoint
// continues it bitwise across passes over the data, and a resume in another
// order is refused in one line that says what to pass.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <set>

#include "engine_test_support.h"

namespace strata {
namespace {

using testing::EngineRun;

// 9 sequences of 16 tokens: a step of 4 or 6 sequences crosses a pass within a few steps.
constexpr int64_t kSequences = 9;

class EngineShuffle : public testing::EngineRunsTest {
 protected:
  EngineShuffle() : EngineRunsTest("engine_shuffle") {}
  void SetUp() override {
    EngineRunsTest::SetUp();
    if (IsSkipped()) return;
    tokens_ = std::make_shared<std::vector<int32_t>>(testing::random_tokens(
        kSequences * 16 + 1, testing::small_gqa_model().vocab_size, seed_ + 2));
  }
  static EngineRun shuffled(int world, int64_t micro_batch, int64_t grad_accum) {
    EngineRun run;
    run.shuffle = true;
    run.world = world;
    run.micro_batch = micro_batch;
    run.grad_accum = grad_accum;
    run.seq_len = 16;
    // Damps near-zero gradients, whose sign rounding decides (engine_equivalence_test).
    run.eps = 1e-6;
    return run;
  }
  Result<std::unique_ptr<Engine>> engine(const EngineRun& run, const std::string& resume = "") {
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    if (!options) return options.status();
    options->resume_from = resume;
    return Engine::create(*options);
  }
};

TEST_F(EngineShuffle, ResumesBitwiseAcrossPassesOverTheData) {
  // 4 sequences a step over 9: step 3 ends inside the second pass, step 7 in the fourth.
  for (EngineRun run : {shuffled(1, 2, 2), shuffled(2, 1, 2)}) {
    run.steps = 7;
    run.stage = 2;
    SCOPED_TRACE(run.label());
    expect_resumes_bitwise(run, 3);
  }
}

TEST_F(EngineShuffle, EveryWorldSizeReadsTheSameSequencesEachStep) {
  struct Read {
    std::set<int64_t> positions;
    std::multiset<int64_t> sequences;
    int rows = 0;
  };
  // The order the engine is given: strata.shuffle with the run's seed.
  const SequenceOrder order = SequenceOrder::shuffled(seed_);
  std::vector<std::map<int64_t, Read>> reads;  // per world size: step's offset -> what it read
  std::vector<std::vector<StepResult>> results;
  for (EngineRun run : {shuffled(1, 3, 2), shuffled(2, 3, 1), shuffled(3, 1, 2)}) {
    run.steps = 5;  // 30 positions: more than three passes over 9 sequences
    SCOPED_TRACE(run.label());
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    ASSERT_TRUE(options.is_ok()) << options.status().message();
    auto read = std::make_shared<std::map<int64_t, Read>>();
    auto mutex = std::make_shared<std::mutex>();
    // Wraps the reader the engine is given, noting which positions each rank asks for.
    options->data = [inner = options->data, read, mutex, order](
                        int64_t offset, int64_t micro, int rank, int world, int64_t B, int64_t T,
                        int32_t* inputs, int32_t* targets) {
      {
        std::lock_guard lock(*mutex);
        Read& step = (*read)[offset];
        for (int64_t b = 0; b < B; ++b) {
          const int64_t position = batch_position(offset, micro, rank, world, B, b);
          step.positions.insert(position);
          step.sequences.insert(order.sequence(position, kSequences));
          ++step.rows;
        }
      }
      return inner(offset, micro, rank, world, B, T, inputs, targets);
    };
    Result<std::unique_ptr<Engine>> engine = Engine::create(*options);
    ASSERT_TRUE(engine.is_ok()) << engine.status().message();
    results.emplace_back();
    for (int s = 0; s < run.steps; ++s) {
      Result<StepResult> step = (*engine)->step();
      ASSERT_TRUE(step.is_ok()) << step.status().message();
      results.back().push_back(*step);
    }
    ASSERT_TRUE((*engine)->finish().is_ok());
    // Step s read positions [6s, 6s + 6), each once, whatever the split.
    ASSERT_EQ(read->size(), size_t(run.steps));
    for (const auto& [offset, step] : *read) {
      EXPECT_EQ(offset % 6, 0);
      EXPECT_EQ(step.rows, 6) << "offset " << offset;
      EXPECT_EQ(step.positions, (std::set<int64_t>{offset, offset + 1, offset + 2, offset + 3,
                                                   offset + 4, offset + 5}));
    }
    reads.push_back(*read);
  }
  for (size_t w = 1; w < reads.size(); ++w) {
    for (const auto& [offset, step] : reads[0])
      EXPECT_EQ(reads[w][offset].sequences, step.sequences)
          << "world " << w + 1 << ", offset " << offset;
    for (size_t s = 0; s < results[0].size(); ++s)
      EXPECT_NEAR(results[w][s].loss, results[0][s].loss, 1e-6 * results[0][s].loss)
          << "world " << w + 1 << ", step " << s + 1;
  }
  // The order is not the file's: some step reads another set than the sequential one.
  bool differs = false;
  for (const auto& [offset, step] : reads[0]) {
    std::multiset<int64_t> sequential;
    for (int64_t i = offset; i < offset + 6; ++i) sequential.insert(i % kSequences);
    differs = differs || sequential != step.sequences;
  }
  EXPECT_TRUE(differs);
}

TEST_F(EngineShuffle, AResumeInAnotherOrderIsRefusedSayingWhatToPass) {
  EngineRun run = shuffled(1, 2, 1);
  run.shuffle_seed = 77;
  Result<std::unique_ptr<Engine>> first = engine(run);
  ASSERT_TRUE(first.is_ok()) << first.status().message();
  ASSERT_TRUE((*first)->step().is_ok());
  Result<std::string> saved = (*first)->save_checkpoint(dir_.path() + "/shuffled");
  ASSERT_TRUE(saved.is_ok()) << saved.status().message();
  first->reset();

  EngineRun other_seed = run;
  other_seed.shuffle_seed = 78;
  EngineRun in_order = run;
  in_order.shuffle = false;
  in_order.shuffle_seed.reset();
  for (const auto& [resumed, expected] :
       {std::pair{other_seed, std::string("the checkpoint read its data shuffled with seed 77 but "
                                          "this run reads them shuffled with seed 78; pass "
                                          "--shuffle --shuffle-seed 77")},
        std::pair{in_order, std::string("shuffled with seed 77 but this run reads them in "
                                        "sequential order; pass --shuffle --shuffle-seed 77")}}) {
    Result<std::unique_ptr<Engine>> refused = engine(resumed, *saved);
    ASSERT_FALSE(refused.is_ok());
    const std::string& message = refused.status().message();
    EXPECT_NE(message.find(expected), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
  // The same order resumes.
  EXPECT_TRUE(engine(run, *saved).is_ok());

  // A checkpoint of a run in the file's order does not resume shuffled.
  Result<std::unique_ptr<Engine>> sequential = engine(in_order);
  ASSERT_TRUE(sequential.is_ok()) << sequential.status().message();
  ASSERT_TRUE((*sequential)->step().is_ok());
  Result<std::string> sequential_saved = (*sequential)->save_checkpoint(dir_.path() + "/in-order");
  ASSERT_TRUE(sequential_saved.is_ok()) << sequential_saved.status().message();
  sequential->reset();
  Result<std::unique_ptr<Engine>> refused = engine(run, *sequential_saved);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find(
                "read its data in sequential order but this run reads them shuffled with seed 77; "
                "leave out --shuffle"),
            std::string::npos)
      << refused.status().message();
}

}  // namespace
}  // namespace strata
