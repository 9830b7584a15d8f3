// Safetensors: dtype conversions, single and sharded round trips, model
// checkpoints, and errors that name the file and the tensor.
#include "core/checkpoint/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/model/model.h"

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
  Status missing = f->read_f32("c", {1}, out.data());
  EXPECT_NE(missing.message().find("no tensor c"), std::string::npos) << missing.message();

  // Truncated: cut into the last tensor.
  fs::copy_file(file, path("cut.safetensors"));
  fs::resize_file(path("cut.safetensors"), fs::file_size(file) - 4);
  Result<SafetensorsFile> cut = SafetensorsFile::open(path("cut.safetensors"));
  ASSERT_FALSE(cut.is_ok());
  EXPECT_NE(cut.status().message().find("cut.safetensors: truncated: tensor b"), std::string::npos)
      << cut.status().message();

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
  {
    std::ofstream out(path("tiny.safetensors"), std::ios::binary);
    out << "abc";
  }
  EXPECT_FALSE(SafetensorsFile::open(path("tiny.safetensors")).is_ok());
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
