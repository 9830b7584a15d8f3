// Model shapes: parameter counts computed from the shapes match the published
// sizes, and Hugging Face config.json files are read with clear errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/model/model_config.h"

namespace strata {
namespace {

int64_t count(const std::string& preset) {
  Result<ModelConfig> model = load_model_config(preset);
  EXPECT_TRUE(model.is_ok()) << model.status().message();
  return model->parameter_count();
}

TEST(ModelConfig, PresetsHaveThePublishedParameterCounts) {
  // Llama 3.2 1B: embedding 128256 x 2048 (tied) + 16 layers + final norm.
  const int64_t layer_1b = 2048 * 2048 * 2 + 2048 * 512 * 2 + 3 * 2048 * 8192 + 2 * 2048;
  EXPECT_EQ(count("llama3.2-1b"), 128256LL * 2048 + 16 * layer_1b + 2048);
  EXPECT_EQ(count("llama3.2-1b"), 1235814400LL);
  EXPECT_EQ(count("llama3-8b"), 8030261248LL);
  EXPECT_EQ(count("llama2-7b"), 6738415616LL);
  EXPECT_EQ(count("llama2-13b"), 13015864320LL);
  EXPECT_EQ(count("llama3-70b"), 70553706496LL);
}

TEST(ModelConfig, UnitsAreEmbeddingLayersHead) {
  ModelConfig tied = *load_model_config("llama3.2-1b");
  std::vector<UnitShape> units = model_units(tied);
  ASSERT_EQ(units.size(), 18u);
  EXPECT_EQ(units.front().name, "embedding");
  EXPECT_EQ(units[1].name, "layers.0");
  EXPECT_EQ(units.back().name, "head");
  EXPECT_EQ(units.back().numel, 2048);  // tied: the head owns only the final norm
  ModelConfig untied = *load_model_config("llama3-8b");
  EXPECT_EQ(model_units(untied).back().numel, 4096 + 128256LL * 4096);
}

TEST(ModelConfig, ReadsAHuggingFaceConfigAndWritesItBack) {
  nlohmann::json hf = nlohmann::json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000,
    "hidden_size": 120, "intermediate_size": 300, "num_hidden_layers": 3, "num_attention_heads": 6,
    "num_key_value_heads": 3, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256}})");
  Result<ModelConfig> model = model_config_from_json(hf, "config.json");
  ASSERT_TRUE(model.is_ok()) << model.status().message();
  EXPECT_EQ(model->head_dim, 20);
  EXPECT_EQ(model->num_key_value_heads, 3);
  EXPECT_EQ(model->rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(model->rope_scaling.factor, 8.0);
  EXPECT_EQ(model->rope_scaling.original_max_position_embeddings, 256);
  Result<ModelConfig> again = model_config_from_json(model_config_to_json(*model), "again");
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again->parameter_count(), model->parameter_count());
  EXPECT_EQ(again->rope_scaling.factor, 8.0);
}

TEST(ModelConfig, ErrorsNameTheFileAndTheKey) {
  auto error = [](const char* text) {
    Result<ModelConfig> model = model_config_from_json(nlohmann::json::parse(text), "cfg.json");
    EXPECT_FALSE(model.is_ok()) << text;
    return model.is_ok() ? std::string() : model.status().message();
  };
  EXPECT_NE(error(R"({"model_type": "gpt2"})").find("cfg.json: model_type"), std::string::npos);
  EXPECT_NE(error(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
      "num_hidden_layers": 1})").find("num_attention_heads: missing"), std::string::npos);
  EXPECT_NE(error(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 3})").find("multiple of num_key_value_heads"),
            std::string::npos);
  EXPECT_NE(error(R"({"vocab_size": "many", "hidden_size": 8, "intermediate_size": 8,
      "num_hidden_layers": 1, "num_attention_heads": 2})").find("cfg.json: vocab_size: expected an integer"),
            std::string::npos);
  EXPECT_NE(error(R"({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
      "num_attention_heads": 2, "rope_scaling": {"rope_type": "yarn"}})").find("rope_scaling.rope_type"),
            std::string::npos);
}

TEST(ModelConfig, AnUnknownNameListsThePresets) {
  Result<ModelConfig> model = load_model_config("llama-9000");
  ASSERT_FALSE(model.is_ok());
  EXPECT_NE(model.status().message().find("llama3-8b"), std::string::npos);
}

}  // namespace
}  // namespace strata
