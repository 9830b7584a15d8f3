// Safetensors: dtype conversions, single and sharded round trips, model
// checkpoints, and errors that name the file and the tensor.
#include "core/checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "core/model/model.h"
#include "io/file_system.h"
#include "tiers_test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("strata-safetensors-" + std::to_string(::getpid()) + "-" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes a file with tensors "a" (2, 3) and "b" (5).
  std::string write_sample(const std::string& name, DType dtype) {
    Result<SafetensorsWriter> w =
        SafetensorsWriter::create(path(name), {{"a", {2, 3}}, {"b", {5}}}, dtype);
    EXPECT_TRUE(w.is_ok()) << w.status().message();
    EXPECT_TRUE(w->write("a", a_.data()).is_ok());
    EXPECT_TRUE(w->write("b", b_.data()).is_ok());
    EXPECT_TRUE(w->finish().is_ok());
    return path(name);
  }

  fs::path dir_;
  std::vector<float> a_ = {1.0f, -2.5f, 3.14159f, 1e-3f, 65504.0f, -0.0f};
  std::vector<float> b_ = {0.1f, 0.2f, 0.3f, 0.4f, 1e-6f};
};

TEST(SafetensorsDtypes, ConvertWithRoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie to even (down)
  EXPECT_EQ(float_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie to even (up)
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(float_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);               // rounds to infinity
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: zero
  EXPECT_EQ(float_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp: tie to even 2
  EXPECT_TRUE(std::isnan(f16_to_float(float_to_f16(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t bits = 0; bits < 0x7c00;
       bits += 7) {  // every finite half survives f16 -> f32 -> f16
    ASSERT_EQ(float_to_f16(f16_to_float(static_cast<uint16_t>(bits))), bits);
  }
}

TEST_F(Safetensors, RoundTripsEveryDtype) {
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    const std::string file =
        write_sample(std::string("sample-") + dtype_name(dtype) + ".safetensors", dtype);
    Result<SafetensorsFile> f = SafetensorsFile::open(file);
    ASSERT_TRUE(f.is_ok()) << f.status().message();
    EXPECT_EQ(f->metadata().at("format"), "pt");
    ASSERT_EQ(f->tensors().size(), 2u);
    EXPECT_EQ(f->find("a")->dtype, dtype_name(dtype));
    std::vector<float> a(6);
    ASSERT_TRUE(f->read_f32("a", {2, 3}, a.data()).is_ok());
    for (size_t i = 0; i < a.size(); ++i) {
      const float expected = dtype == DType::f32    ? a_[i]
                             : dtype == DType::bf16 ? bf16_to_float(float_to_bf16(a_[i]))
                                                    : f16_to_float(float_to_f16(a_[i]));
      EXPECT_EQ(a[i], expected) << dtype_name(dtype) << " element " << i;
    }
  }
}

TEST_F(Safetensors, ErrorsNameTheFileAndTheTensor) {
  const std::string file = write_sample("good.safetensors", DType::f32);
  Result<SafetensorsFile> f = SafetensorsFile::open(file);
  std::vector<float> out(6);
  Status shape = f->read_f32("a", {3, 2}, out.data());
  EXPECT_NE(shape.message().find("good.safetensors"), std::string::npos);
  EXPECT_NE(shape.message().find("tensor a has shape [2, 3], expected [3, 2]"), std::string::npos)
      << shape.message();
  EXPECT_TRUE(shape.is(StatusCode::invalid_argument)) << shape.message();
  Status missing = f->read_f32("c", {1}, out.data());
  EXPECT_NE(missing.message().find("no tensor c"), std::string::npos) << missing.message();
  EXPECT_TRUE(missing.is(StatusCode::not_found)) << missing.message();

  // Truncated: cut into the last tensor.
  fs::copy_file(file, path("cut.safetensors"));
  fs::resize_file(path("cut.safetensors"), fs::file_size(file) - 4);
  Result<SafetensorsFile> cut = SafetensorsFile::open(path("cut.safetensors"));
  ASSERT_FALSE(cut.is_ok());
  EXPECT_NE(cut.status().message().find("cut.safetensors: truncated: tensor b"), std::string::npos)
      << cut.status().message();
  EXPECT_TRUE(cut.status().is(StatusCode::corruption)) << cut.status().message();

  // A header length larger than the file, and a header that is not JSON.
  {
    std::ofstream out(path("short.safetensors"), std::ios::binary);
    const uint64_t n = 1000;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "{}";
  }
  Result<SafetensorsFile> short_file = SafetensorsFile::open(path("short.safetensors"));
  ASSERT_FALSE(short_file.is_ok());
  EXPECT_NE(short_file.status().message().find("truncated"), std::string::npos);
  EXPECT_TRUE(short_file.status().is(StatusCode::corruption)) << short_file.status().message();
  {
    std::ofstream out(path("garbage.safetensors"), std::ios::binary);
    const uint64_t n = 8;
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << "not json";
  }
  Result<SafetensorsFile> garbage = SafetensorsFile::open(path("garbage.safetensors"));
  ASSERT_FALSE(garbage.is_ok());
  EXPECT_NE(garbage.status().message().find("garbage.safetensors"), std::string::npos)
      << garbage.status().message();
  EXPECT_TRUE(garbage.status().is(StatusCode::corruption)) << garbage.status().message();
  {
    std::ofstream out(path("tiny.safetensors"), std::ios::binary);
    out << "abc";
  }
  EXPECT_TRUE(SafetensorsFile::open(path("tiny.safetensors")).status().is(StatusCode::corruption));
}

// --- reads through an io::FileSystem, with faults ----------------------------------------

// A file of 1 to 4 tensors of random shapes, fp32 contents and dtype; what it
// holds is what reading it as fp32 must give.
class SafetensorsReads : public Safetensors {
 protected:
  void SetUp() override {
    Safetensors::SetUp();
    random_.seed(tiers::testing::fresh_seed("safetensors"));
  }

  struct Written {
    std::string path;
    std::vector<TensorSpec> specs;
    std::vector<std::vector<float>> read_back;  // each tensor as fp32 after its dtype's rounding
  };
  Written write_random(const std::string& name) {
    const DType dtype = std::array{DType::f32, DType::bf16, DType::f16}[random_() % 3];
    Written written{path(name), {}, {}};
    std::normal_distribution<float> value(0.0f, 3.0f);
    std::vector<std::vector<float>> data;
    const int count = 1 + int(random_() % 4);
    for (int t = 0; t < count; ++t) {
      TensorSpec spec{"t" + std::to_string(t), {}};
      for (int d = 0, dims = 1 + int(random_() % 2); d < dims; ++d)
        spec.shape.push_back(1 + int64_t(random_() % 700));
      data.emplace_back(size_t(spec.numel()));
      for (float& x : data.back()) x = value(random_);
      std::vector<float> rounded = data.back();
      for (float& x : rounded)
        x = dtype == DType::f32    ? x
            : dtype == DType::bf16 ? bf16_to_float(float_to_bf16(x))
                                   : f16_to_float(float_to_f16(x));
      written.read_back.push_back(std::move(rounded));
      written.specs.push_back(spec);
    }
    Result<SafetensorsWriter> writer =
        SafetensorsWriter::create(written.path, written.specs, dtype);
    EXPECT_TRUE(writer.is_ok()) << writer.status().message();
    for (int t = 0; t < count; ++t)
      EXPECT_TRUE(writer->write(written.specs[size_t(t)].name, data[size_t(t)].data()).is_ok());
    EXPECT_TRUE(writer->finish().is_ok());
    return written;
  }

  std::mt19937_64 random_;
  io::FaultInjectingFileSystem faults_;
};

using strata::io::testing::expect_one_line;

TEST_F(SafetensorsReads, ShortReadsGiveEveryTensorBitwise) {
  const Written written = write_random("random.safetensors");
  faults_.add({.op = io::FileOp::kRead, .kind = io::FileFaultKind::kShortRead, .times = 1000});
  Result<SafetensorsFile> file = SafetensorsFile::open(written.path, faults_);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  for (size_t t = 0; t < written.specs.size(); ++t) {
    std::vector<float> back(written.read_back[t].size());
    ASSERT_TRUE(file->read_f32(written.specs[t].name, written.specs[t].shape, back.data()).is_ok());
    EXPECT_EQ(0, std::memcmp(back.data(), written.read_back[t].data(), back.size() * 4))
        << written.specs[t].name;
  }
  EXPECT_GT(faults_.faults_injected(), 2u);
}

TEST_F(SafetensorsReads, AFailedReadIsAnIoErrorNamingTheFileAndTheTensor) {
  const Written written = write_random("random.safetensors");
  Result<SafetensorsFile> file = SafetensorsFile::open(written.path, faults_);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  const TensorSpec& spec = written.specs[random_() % written.specs.size()];
  faults_.add({.op = io::FileOp::kRead,
               .nth_call = faults_.calls(io::FileOp::kRead) + 1,
               .error_number = EIO});
  std::vector<float> back(size_t(spec.numel()));
  const Status status = file->read_f32(spec.name, spec.shape, back.data());
  expect_one_line(status, StatusCode::io_error, written.path);
  EXPECT_NE(status.message().find("tensor " + spec.name), std::string::npos) << status.message();
  EXPECT_NE(status.message().find(errno_text(EIO)), std::string::npos) << status.message();
}

TEST_F(SafetensorsReads, AFileCutAfterOpeningIsACorruptionNamingTheFile) {
  const Written written = write_random("random.safetensors");
  Result<SafetensorsFile> file = SafetensorsFile::open(written.path, faults_);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  const TensorSpec& last = written.specs.back();  // the writer lays tensors out in order
  fs::resize_file(written.path, fs::file_size(written.path) - 1 - random_() % 2);
  std::vector<float> back(size_t(last.numel()));
  const Status status = file->read_f32(last.name, last.shape, back.data());
  expect_one_line(status, StatusCode::corruption, written.path);
  EXPECT_NE(status.message().find("truncated"), std::string::npos) << status.message();
  // Opened again, the header no longer fits the file.
  expect_one_line(SafetensorsFile::open(written.path, faults_).status(), StatusCode::corruption,
                  "truncated");
}

TEST_F(SafetensorsReads, AMissingFileIsNotFound) {
  const std::string absent = path("absent.safetensors");
  expect_one_line(SafetensorsFile::open(absent, faults_).status(), StatusCode::not_found, absent);
  expect_one_line(SafetensorsCheckpoint::open(absent, faults_).status(), StatusCode::not_found,
                  absent);
  expect_one_line(SafetensorsCheckpoint::open(dir_.string(), faults_).status(),
                  StatusCode::not_found, "no model.safetensors");
}

TEST_F(SafetensorsReads, AFailedReadOfAShardNamesTheShard) {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<float>> data;
  for (int i = 0; i < 4; ++i) {
    specs.push_back({"w" + std::to_string(i), {64, 16 + int64_t(random_() % 32)}});  // a shard each
    data.emplace_back(size_t(specs.back().numel()), float(random_() % 1000));
  }
  ASSERT_TRUE(write_safetensors_checkpoint(path("sharded"), specs, DType::f32, 4096, [&](size_t i) {
                return data[i].data();
              }).is_ok());
  // Every read of a clean open, counted; then one of those after the index's fails.
  ASSERT_TRUE(SafetensorsCheckpoint::open(path("sharded"), faults_).is_ok());
  const uint64_t reads = faults_.calls(io::FileOp::kRead);
  io::FaultInjectingFileSystem faults;
  const uint64_t failing = 3 + random_() % (reads - 2);  // the index takes two reads (then EOF)
  faults.add({.op = io::FileOp::kRead, .nth_call = failing, .error_number = EIO});
  const Status status = SafetensorsCheckpoint::open(path("sharded"), faults).status();
  expect_one_line(status, StatusCode::io_error, "-of-");
  EXPECT_NE(status.message().find("shard listed in the index"), std::string::npos)
      << status.message();
}

TEST_F(Safetensors, ShardedCheckpointsWriteAnIndexAndReadBack) {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<float>> data;
  for (int i = 0; i < 5; ++i) {
    specs.push_back({"t" + std::to_string(i), {100, i + 1}});
    data.emplace_back(100 * (i + 1), static_cast<float>(i));
  }
  ASSERT_TRUE(write_safetensors_checkpoint(path("ckpt"), specs, DType::bf16, 1000, [&](size_t i) {
                return data[i].data();
              }).is_ok());
  EXPECT_TRUE(fs::exists(path("ckpt/model.safetensors.index.json")));
  EXPECT_TRUE(fs::exists(path("ckpt/model-00001-of-00004.safetensors")));
  Result<SafetensorsCheckpoint> ckpt = SafetensorsCheckpoint::open(path("ckpt"));
  ASSERT_TRUE(ckpt.is_ok()) << ckpt.status().message();
  EXPECT_EQ(ckpt->tensor_names().size(), 5u);
  std::vector<float> t3(400);
  ASSERT_TRUE(ckpt->read_f32("t3", {100, 4}, t3.data()).is_ok());
  EXPECT_EQ(t3[399], 3.0f);
  Status missing = ckpt->read_f32("t9", {1}, t3.data());
  EXPECT_NE(missing.message().find("missing tensor t9"), std::string::npos) << missing.message();

  // One shard when everything fits; the stale index goes away.
  ASSERT_TRUE(write_safetensors_checkpoint(path("ckpt"), specs, DType::f32, 1 << 20, [&](size_t i) {
                return data[i].data();
              }).is_ok());
  EXPECT_FALSE(fs::exists(path("ckpt/model.safetensors.index.json")));
  EXPECT_TRUE(SafetensorsCheckpoint::open(path("ckpt")).is_ok());
}

TEST_F(Safetensors, AnIndexPointingAtAMissingTensorIsRefused) {
  write_sample("model-00001-of-00001.safetensors", DType::f32);
  std::ofstream(path("model.safetensors.index.json"))
      << R"({"weight_map": {"a": "model-00001-of-00001.safetensors", "zz": "model-00001-of-00001.safetensors"}})";
  Result<SafetensorsCheckpoint> ckpt = SafetensorsCheckpoint::open(dir_.string());
  ASSERT_FALSE(ckpt.is_ok());
  EXPECT_NE(ckpt.status().message().find("tensor zz"), std::string::npos)
      << ckpt.status().message();
}

TEST_F(Safetensors, UnfinishedWritersLeaveNothingUnderTheRealName) {
  {
    Result<SafetensorsWriter> w =
        SafetensorsWriter::create(path("partial.safetensors"), {{"a", {2, 3}}}, DType::f32);
    ASSERT_TRUE(w.is_ok());
    EXPECT_FALSE(w->write("b", b_.data()).is_ok());  // out of the declared order
  }
  EXPECT_TRUE(fs::is_empty(dir_));  // neither the real name nor a temporary one
}

TEST_F(Safetensors, ModelCheckpointsRoundTripAndNameMissingOrMisShapedTensors) {
  Result<ModelConfig> config = load_model_config("tiny");
  HostModel model = make_host_model(*config);
  init_host_model(model, 9);
  ASSERT_TRUE(save_host_model(model, path("model"), DType::f32, 1 << 16).is_ok());
  Result<ModelConfig> reloaded_config = load_model_config(path("model"));
  ASSERT_TRUE(reloaded_config.is_ok()) << reloaded_config.status().message();
  EXPECT_EQ(reloaded_config->hidden_size, config->hidden_size);
  HostModel copy = make_host_model(*reloaded_config);
  Result<SafetensorsCheckpoint> ckpt = SafetensorsCheckpoint::open(path("model"));
  ASSERT_TRUE(ckpt.is_ok()) << ckpt.status().message();
  ASSERT_TRUE(load_host_model(copy, *ckpt).is_ok());
  EXPECT_EQ(copy.params, model.params);

  // The same weights into a tied model: lm_head.weight is ignored.
  ModelConfig tied = *config;
  tied.tie_word_embeddings = true;
  HostModel tied_model = make_host_model(tied);
  EXPECT_TRUE(load_host_model(tied_model, *ckpt).is_ok());
  // And a tied checkpoint into an untied model: lm_head.weight is missing.
  ASSERT_TRUE(save_host_model(tied_model, path("tied"), DType::bf16).is_ok());
  Result<SafetensorsCheckpoint> tied_ckpt = SafetensorsCheckpoint::open(path("tied"));
  Status missing = load_host_model(copy, *tied_ckpt);
  EXPECT_NE(missing.message().find("missing tensor lm_head.weight"), std::string::npos)
      << missing.message();
  EXPECT_NE(missing.message().find("model.safetensors"), std::string::npos);
  // A model of another width: the first tensor's shape is named.
  ModelConfig wider = *config;
  wider.hidden_size += 6;
  wider.head_dim = wider.hidden_size / wider.num_attention_heads;
  HostModel wide = make_host_model(wider);
  Status shape = load_host_model(wide, *ckpt);
  EXPECT_NE(shape.message().find(
                "tensor model.embed_tokens.weight has shape [256, 96], expected [256, 102]"),
            std::string::npos)
      << shape.message();
}

}  // namespace
}  // namespace strata
