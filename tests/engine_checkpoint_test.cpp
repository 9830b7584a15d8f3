// Checkpoints lose nothing: a run saved after k steps and resumed ends with
// the straight run's weights (bitwise at the same world size, whatever the
// offload settings; within fp32 tolerance at another world size), and a
// truncated, corrupted, incomplete or foreign checkpoint is refused by name
// and by code; every read goes through the io::FileSystem it is given.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/checkpoint/checkpoint.h"
#include "engine_test_support.h"
#include "io/file_system.h"

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
    // The placements resumed under sum in the micro-batch order (at two
    // ranks layer-major's sums differ from it; tests/cli_train_launch.sh
    // resumes a layer-major run at two processes).
    straight_run.schedule = "micro_batch";
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
  auto refused = [&](const std::string& expect, StatusCode code = StatusCode::corruption) {
    Result<EngineOptions> options = testing::engine_options(run, dir_.path(), tokens_, seed_);
    options->resume_from = saved;
    Result<std::unique_ptr<Engine>> made = Engine::create(*options);
    EXPECT_FALSE(made.is_ok()) << expect;
    if (made) return;
    EXPECT_NE(made.status().message().find(expect), std::string::npos) << made.status().message();
    EXPECT_EQ(made.status().message().find('\n'), std::string::npos) << made.status().message();
    EXPECT_TRUE(made.status().is(code)) << made.status().message();
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
    refused(std::string(name) + ": missing", StatusCode::not_found);
    restore();
  }
  fs::remove(saved + "/manifest.json");
  refused("manifest.json: missing", StatusCode::not_found);
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

// --- CheckpointReader through an io::FileSystem, with faults ---------------------------

// A checkpoint of random state files written by CheckpointWriter alone (no engine).
class CheckpointReads : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    random_.seed(tiers::testing::fresh_seed("checkpoint_reads"));
    const uint64_t bytes = 4 * (1 + random_() % 200000);
    Result<CheckpointWriter> writer = CheckpointWriter::begin(dir_.path() + "/ck", 7, bytes);
    ASSERT_TRUE(writer.is_ok()) << writer.status().message();
    for (int f = 0; f < 3; ++f) {
      state_[f].resize(bytes);
      for (char& byte : state_[f]) byte = char(random_());
      ASSERT_TRUE(writer->write(f, 0, state_[f].data(), bytes).is_ok());
    }
    for (const char* name : {"model.json", "train.json", "state.json"})
      ASSERT_TRUE(writer->write_json(name, {{"value", random_()}}).is_ok());
    Result<std::string> finished = writer->finish(0);
    ASSERT_TRUE(finished.is_ok()) << finished.status().message();
    checkpoint_ = *finished;
  }

  io::testing::TemporaryDirectory dir_;
  std::mt19937_64 random_;
  std::string state_[3];
  std::string checkpoint_;
  io::FaultInjectingFileSystem faults_;
};

using strata::io::testing::expect_one_line;

TEST_F(CheckpointReads, ShortReadsGiveEveryRangeBitwise) {
  faults_.add({.op = io::FileOp::kRead, .kind = io::FileFaultKind::kShortRead, .times = 10000});
  Result<CheckpointReader> reader = CheckpointReader::open(checkpoint_, faults_);
  ASSERT_TRUE(reader.is_ok()) << reader.status().message();
  for (int trial = 0; trial < 20; ++trial) {
    const int file = int(random_() % 3);
    const uint64_t offset = random_() % state_[file].size();
    const uint64_t size = 1 + random_() % (state_[file].size() - offset);
    std::string back(size, '\0');
    ASSERT_TRUE(reader->read(file, offset, back.data(), size).is_ok());
    EXPECT_EQ(0, std::memcmp(back.data(), state_[file].data() + offset, size));
  }
  EXPECT_GT(faults_.faults_injected(), 20u);
}

TEST_F(CheckpointReads, AFailedReadOfAStateFileIsAnIoErrorNamingIt) {
  Result<CheckpointReader> reader = CheckpointReader::open(checkpoint_, faults_);
  ASSERT_TRUE(reader.is_ok()) << reader.status().message();
  const int file = int(random_() % 3);
  faults_.add({.op = io::FileOp::kRead,
               .nth_call = faults_.calls(io::FileOp::kRead) + 1,
               .error_number = EIO});
  std::string back(state_[file].size(), '\0');
  const Status status = reader->read(file, 0, back.data(), back.size());
  expect_one_line(status, StatusCode::io_error, checkpoint_ + "/" + kCheckpointStateFiles[file]);
  EXPECT_NE(status.message().find(errno_text(EIO)), std::string::npos) << status.message();
}

TEST_F(CheckpointReads, AFailedReadWhileCheckingIsAnIoErrorNamingTheFile) {
  // Every read of a clean open, counted; then any one of them fails.
  ASSERT_TRUE(CheckpointReader::open(checkpoint_, faults_).is_ok());
  io::FaultInjectingFileSystem faults;
  const uint64_t failing = 1 + random_() % faults_.calls(io::FileOp::kRead);
  faults.add({.op = io::FileOp::kRead, .nth_call = failing, .error_number = EIO});
  const Status status = CheckpointReader::open(checkpoint_, faults).status();
  expect_one_line(status, StatusCode::io_error, checkpoint_ + "/");
  EXPECT_EQ(faults.calls(io::FileOp::kOpen), faults.calls(io::FileOp::kClose))
      << "a descriptor was left open";
}

TEST_F(CheckpointReads, MissingTruncatedOrChangedFilesHaveTheirCodes) {
  expect_one_line(CheckpointReader::open(dir_.path() + "/absent", faults_).status(),
                  StatusCode::not_found, "absent/manifest.json: missing");
  const std::string state_file = checkpoint_ + "/" + kCheckpointStateFiles[random_() % 3];
  const std::string kept = state_file + ".kept";
  fs::copy_file(state_file, kept);
  fs::remove(state_file);
  expect_one_line(CheckpointReader::open(checkpoint_, faults_).status(), StatusCode::not_found,
                  state_file + ": missing");
  fs::copy_file(kept, state_file);
  fs::resize_file(state_file, fs::file_size(state_file) - 1 - random_() % 4);
  expect_one_line(CheckpointReader::open(checkpoint_, faults_).status(), StatusCode::corruption,
                  "truncated");
  fs::remove(state_file);
  fs::copy_file(kept, state_file);
  {
    std::fstream f(state_file, std::ios::in | std::ios::out | std::ios::binary);
    const auto at = std::streamoff(random_() % fs::file_size(state_file));
    char c = 0;
    f.seekg(at);
    f.read(&c, 1);
    c = char(c ^ (1 << (random_() % 8)));
    f.seekp(at);
    f.write(&c, 1);
  }
  expect_one_line(CheckpointReader::open(checkpoint_, faults_).status(), StatusCode::corruption,
                  state_file + ": CRC32C");
  expect_one_line(find_latest_checkpoint(dir_.path() + "/absent").status(), StatusCode::not_found,
                  "no such directory");
}

}  // namespace
}  // namespace strata
