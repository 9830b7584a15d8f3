// Checkpoints lose nothing: a run saved after k steps and resumed ends with
// the straight run's weights (bitwise at the same world size, whatever the
// offload settings; within fp32 tolerance at another world size), and a
// truncated, corrupted, incomplete or foreign checkpoint is refused by name.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/checkpoint/checkpoint.h"
#include "engine_test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::EngineRun;

class EngineCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = dir_.why_unusable(); !why.empty()) GTEST_SKIP() << why;
    seed_ = tiers::testing::fresh_seed("engine_checkpoint");
    tokens_ = std::make_shared<std::vector<int32_t>>(
        testing::random_tokens(4096, testing::small_gqa_model().vocab_size, seed_ + 1));
  }
  std::unique_ptr<Engine> engine(const EngineRun& run, const std::string& resume = "") {
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    EXPECT_TRUE(options.is_ok());
    options->resume_from = resume;
    Result<std::unique_ptr<Engine>> made = Engine::create(*options);
    EXPECT_TRUE(made.is_ok()) << made.status().message();
    return made ? std::move(*made) : nullptr;
  }
  std::vector<double> steps(Engine& e, int n) {
    std::vector<double> losses;
    for (int s = 0; s < n; ++s) {
      Result<StepResult> step = e.step();
      EXPECT_TRUE(step.is_ok()) << step.status().message();
      if (step) losses.push_back(step->loss);
    }
    return losses;
  }
  std::string save(Engine& e, const std::string& name, int keep = 0) {
    Result<std::string> saved = e.save_checkpoint(dir_.path() + "/" + name, keep);
    EXPECT_TRUE(saved.is_ok()) << saved.status().message();
    return saved ? *saved : "";
  }

  io::testing::TemporaryDirectory dir_;
  uint64_t seed_ = 0;
  std::shared_ptr<std::vector<int32_t>> tokens_;
};

TEST_F(EngineCheckpoint, Crc32cMatchesTheStandardCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("56789", 5, crc32c("1234", 4)), 0xE3069283u);
}

TEST_F(EngineCheckpoint, ResumingGivesTheStraightRunBitwiseWhateverTheOffload) {
  for (const char* precision : {"fp32", "bf16"}) {
    EngineRun straight_run;
    straight_run.world = 2;
    straight_run.precision = precision;
    straight_run.stage = 3;
    straight_run.offload_param = "nvme";
    straight_run.offload_optimizer = "nvme";
    straight_run.scheduler = "WarmupDecayLR";
    auto straight = engine(straight_run);
    const std::vector<double> all = steps(*straight, 5);
    Result<HostModel> expected = straight->read_model();
    ASSERT_TRUE(expected.is_ok());

    // Two steps, saved, then resumed under other placements.
    auto first = engine(straight_run);
    steps(*first, 2);
    const std::string saved = save(*first, std::string("save-") + precision);
    first.reset();
    for (auto [stage, param, optimizer] :
         {std::tuple{3, "nvme", "nvme"}, std::tuple{1, "none", "cpu"},
          std::tuple{0, "none", "none"}, std::tuple{2, "none", "nvme"}}) {
      EngineRun run = straight_run;
      run.stage = stage;
      run.offload_param = param;
      run.offload_optimizer = optimizer;
      auto resumed = engine(run, saved);
      ASSERT_TRUE(resumed);
      EXPECT_EQ(resumed->steps_done(), 2);
      const std::vector<double> rest = steps(*resumed, 3);
      ASSERT_EQ(rest.size(), 3u);
      for (size_t s = 0; s < 3; ++s)
        EXPECT_EQ(rest[s], all[s + 2]) << run.label() << " step " << s + 3;
      Result<HostModel> got = resumed->read_model();
      ASSERT_TRUE(got.is_ok());
      EXPECT_TRUE(testing::weights_bitwise_equal(*got, *expected)) << run.label();
    }
  }
}

TEST_F(EngineCheckpoint, ResumesWithAnotherWorldSize) {
  // The same global batch at 2 and 3 ranks: 6 sequences per step.
  EngineRun two;
  two.eps = 1e-6;  // damps near-zero gradients, whose sign rounding decides (engine_equivalence_test)
  two.world = 2;
  two.micro_batch = 1;
  two.grad_accum = 3;
  EngineRun three = two;
  three.world = 3;
  three.grad_accum = 2;
  three.stage = 3;
  three.offload_optimizer = "nvme";
  auto straight = engine(two);
  const std::vector<double> all = steps(*straight, 4);
  Result<HostModel> expected = straight->read_model();
  auto first = engine(two);
  steps(*first, 2);
  const std::string saved = save(*first, "reshard");
  auto resumed = engine(three, saved);
  ASSERT_TRUE(resumed);
  const std::vector<double> rest = steps(*resumed, 2);
  ASSERT_EQ(rest.size(), 2u);
  for (size_t s = 0; s < 2; ++s) EXPECT_NEAR(rest[s], all[s + 2], 1e-6 * all[s + 2]);
  Result<HostModel> got = resumed->read_model();
  ASSERT_TRUE(got.is_ok() && expected.is_ok());
  EXPECT_LT(testing::weights_relative_error(*got, *expected), 1e-5);
}

TEST_F(EngineCheckpoint, DamagedOrForeignCheckpointsAreRefused) {
  EngineRun run;
  run.stage = 2;
  run.world = 2;
  auto e = engine(run);
  steps(*e, 1);
  const std::string saved = save(*e, "damage");
  const std::string pristine = dir_.path() + "/pristine";
  fs::copy(saved, pristine, fs::copy_options::recursive);
  auto restore = [&] {
    fs::remove_all(saved);
    fs::copy(pristine, saved, fs::copy_options::recursive);
  };
  auto refused = [&](const std::string& expect) {
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    options->resume_from = saved;
    Result<std::unique_ptr<Engine>> made = Engine::create(*options);
    EXPECT_FALSE(made.is_ok()) << expect;
    if (made) return;
    EXPECT_NE(made.status().message().find(expect), std::string::npos) << made.status().message();
    EXPECT_EQ(made.status().message().find('\n'), std::string::npos) << made.status().message();
  };
  for (const char* name :
       {"master.bin", "m.bin", "v.bin", "state.json", "model.json", "train.json"}) {
    const std::string path = saved + "/" + name;
    // One flipped byte in the middle.
    {
      std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(std::streamoff(fs::file_size(path) / 2));
      char c = 0;
      f.read(&c, 1);
      c = char(c ^ 0x10);
      f.seekp(std::streamoff(fs::file_size(path) / 2));
      f.write(&c, 1);
    }
    refused(std::string(name) + ": CRC32C");
    restore();
    fs::resize_file(path, fs::file_size(path) - 4);
    refused(std::string(name) + ": ");
    restore();
    fs::remove(path);
    refused(std::string(name) + ": missing");
    restore();
  }
  fs::remove(saved + "/manifest.json");
  refused("manifest.json: missing");
  restore();
  // The manifest itself: a changed byte breaks its JSON or changes a size or CRC it lists.
  {
    const std::string path = saved + "/manifest.json";
    std::ifstream in(path);
    std::string text((std::istreambuf_iterator<char>(in)), {});
    in.close();
    const size_t at = text.find("crc32c");
    ASSERT_NE(at, std::string::npos);
    text[at + 10] = text[at + 10] == '0' ? '1' : '0';
    std::ofstream(path) << text;
    refused("CRC32C");
    restore();
  }

  // Another model shape.
  EngineRun tied = run;
  tied.tied = true;
  Result<EngineOptions> options = testing::engine_options(tied, dir_.path(), tokens_, seed_);
  options->resume_from = saved;
  Result<std::unique_ptr<Engine>> made = Engine::create(*options);
  ASSERT_FALSE(made.is_ok());
  EXPECT_NE(made.status().message().find("another model shape"), std::string::npos)
      << made.status().message();
  // And the pristine copy still loads.
  EXPECT_TRUE(engine(run, saved) != nullptr);
}

TEST_F(EngineCheckpoint, SwapFilesOfAFinishedProcessAreRemovedAndSaid) {
  // A pid above the kernel's maximum (2^22) belongs to no process.
  const std::string stale = dir_.path() + "/strata-9999999-0-rank0.swap";
  std::ofstream(stale) << std::string(8192, 'x');
  const std::string other = dir_.path() + "/unrelated.swap";
  std::ofstream(other) << "keep me";
  EngineRun run;
  run.offload_optimizer = "nvme";
  Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
  std::vector<std::string> notices;
  options->notice = [&](const std::string& line) { notices.push_back(line); };
  Result<std::unique_ptr<Engine>> made = Engine::create(*options);
  ASSERT_TRUE(made.is_ok()) << made.status().message();
  EXPECT_FALSE(fs::exists(stale));
  EXPECT_TRUE(fs::exists(other));
  ASSERT_FALSE(notices.empty());
  EXPECT_NE(notices[0].find("removed 1 swap file(s)"), std::string::npos) << notices[0];
}

TEST_F(EngineCheckpoint, KeepsTheNewestAndIgnoresUnfinishedOnes) {
  EngineRun run;
  auto e = engine(run);
  std::string last;
  for (int s = 0; s < 4; ++s) {
    steps(*e, 1);
    last = save(*e, "kept", 2);
  }
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir_.path() + "/kept"))
    names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"step-3", "step-4"}));
  // A checkpoint cut short (no manifest) is not a checkpoint.
  fs::create_directories(dir_.path() + "/kept/step-9");
  Result<std::string> latest = find_latest_checkpoint(dir_.path() + "/kept");
  ASSERT_TRUE(latest.is_ok());
  EXPECT_EQ(*latest, last);
}

}  // namespace
}  // namespace strata
