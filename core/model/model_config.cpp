#include "core/model/model_config.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/config/json_util.h"

namespace strata {
namespace {

struct Preset {
  const char* name;
  const char* description;
  ModelConfig config;
};

ModelConfig make(int64_t vocab, int64_t hidden, int64_t intermediate, int64_t layers,
                 int64_t heads, int64_t kv_heads, int64_t max_positions, double theta,
                 bool tied) {
  ModelConfig c;
  c.vocab_size = vocab;
  c.hidden_size = hidden;
  c.intermediate_size = intermediate;
  c.num_hidden_layers = layers;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = hidden / heads;
  c.max_position_embeddings = max_positions;
  c.rope_theta = theta;
  c.tie_word_embeddings = tied;
  return c;
}

RopeScaling llama3_scaling(double factor, int64_t original_max_positions) {
  RopeScaling s;
  s.type = "llama3";
  s.factor = factor;
  s.low_freq_factor = 1.0;
  s.high_freq_factor = 4.0;
  s.original_max_position_embeddings = original_max_positions;
  return s;
}

const std::vector<Preset>& presets() {
  static const std::vector<Preset> list = [] {
    std::vector<Preset> p;
    // Byte-level vocabulary, grouped-query heads, sizes that are not powers of two.
    p.push_back({"tiny", "test model, byte vocabulary, ~0.2M parameters",
                 make(256, 96, 160, 2, 6, 2, 1024, 10000.0, false)});
    p.push_back({"small", "CPU demo model, byte vocabulary, ~3M parameters",
                 make(256, 256, 688, 4, 8, 4, 2048, 10000.0, false)});
    ModelConfig llama32_1b = make(128256, 2048, 8192, 16, 32, 8, 131072, 500000.0, true);
    llama32_1b.rope_scaling = llama3_scaling(32.0, 8192);
    p.push_back({"llama3.2-1b", "Llama 3.2 1B", llama32_1b});
    ModelConfig llama32_3b = make(128256, 3072, 8192, 28, 24, 8, 131072, 500000.0, true);
    llama32_3b.rope_scaling = llama3_scaling(32.0, 8192);
    p.push_back({"llama3.2-3b", "Llama 3.2 3B", llama32_3b});
    p.push_back({"llama3-8b", "Llama 3 8B", make(128256, 4096, 14336, 32, 32, 8, 8192, 500000.0, false)});
    ModelConfig llama31_8b = make(128256, 4096, 14336, 32, 32, 8, 131072, 500000.0, false);
    llama31_8b.rope_scaling = llama3_scaling(8.0, 8192);
    p.push_back({"llama3.1-8b", "Llama 3.1 8B", llama31_8b});
    p.push_back({"llama2-7b", "Llama 2 7B", make(32000, 4096, 11008, 32, 32, 32, 4096, 10000.0, false)});
    p.push_back({"llama2-13b", "Llama 2 13B", make(32000, 5120, 13824, 40, 40, 40, 4096, 10000.0, false)});
    p.push_back({"llama3-70b", "Llama 3 70B", make(128256, 8192, 28672, 80, 64, 8, 8192, 500000.0, false)});
    for (auto& preset : p) {
      preset.config.name = preset.name;
      if (preset.config.vocab_size >= 32000) preset.config.rms_norm_eps = 1e-5;
    }
    p[0].config.rms_norm_eps = 1e-6;  // tiny: exercise a non-default eps
    return p;
  }();
  return list;
}

}  // namespace

int64_t ModelConfig::layer_parameter_count() const {
  const int64_t q = hidden_size * num_attention_heads * head_dim;
  const int64_t kv = 2 * hidden_size * num_key_value_heads * head_dim;
  const int64_t o = num_attention_heads * head_dim * hidden_size;
  const int64_t mlp = 3 * hidden_size * intermediate_size;
  const int64_t norms = 2 * hidden_size;
  return q + kv + o + mlp + norms;
}

int64_t ModelConfig::parameter_count() const {
  int64_t total = 0;
  for (const UnitShape& unit : model_units(*this)) total += unit.numel;
  return total;
}

std::vector<UnitShape> model_units(const ModelConfig& config) {
  std::vector<UnitShape> units;
  units.push_back({UnitKind::embedding, -1, "embedding", config.vocab_size * config.hidden_size});
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    units.push_back({UnitKind::decoder_layer, i, fmt::format("layers.{}", i),
                     config.layer_parameter_count()});
  }
  const int64_t lm_head = config.tie_word_embeddings ? 0 : config.vocab_size * config.hidden_size;
  units.push_back({UnitKind::head, -1, "head", config.hidden_size + lm_head});
  return units;
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& preset : presets()) names.push_back(preset.name);
  return names;
}

Result<ModelConfig> model_config_from_json(const nlohmann::json& json, const std::string& origin) {
  if (!json.is_object()) return Status::error(fmt::format("{}: expected a JSON object", origin));
  JsonReader in(json, origin, "");
  ModelConfig c;
  c.name = origin;
  std::string model_type = "llama";
  in.optional_string("model_type", model_type);
  if (model_type != "llama") {
    in.fail("model_type", fmt::format("strata trains the Llama family; got model_type '{}'", model_type));
  }
  in.required_int("vocab_size", c.vocab_size, 1);
  in.required_int("hidden_size", c.hidden_size, 1);
  in.required_int("intermediate_size", c.intermediate_size, 1);
  in.required_int("num_hidden_layers", c.num_hidden_layers, 1);
  in.required_int("num_attention_heads", c.num_attention_heads, 1);
  c.num_key_value_heads = c.num_attention_heads;
  in.optional_int("num_key_value_heads", c.num_key_value_heads, 1);
  c.head_dim = c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0;
  in.optional_int("head_dim", c.head_dim, 1);
  c.max_position_embeddings = 2048;
  in.optional_int("max_position_embeddings", c.max_position_embeddings, 1);
  c.rms_norm_eps = 1e-6;  // LlamaConfig's default
  in.optional_double("rms_norm_eps", c.rms_norm_eps, 0.0);
  in.optional_double("rope_theta", c.rope_theta, 0.0);
  in.optional_bool("tie_word_embeddings", c.tie_word_embeddings);
  std::string hidden_act = "silu";
  in.optional_string("hidden_act", hidden_act);
  if (hidden_act != "silu") in.fail("hidden_act", "strata supports only 'silu' (SwiGLU)");
  bool bias = false;
  in.optional_bool("attention_bias", bias);
  if (bias) in.fail("attention_bias", "strata's Llama has no biases; expected false");
  bias = false;
  in.optional_bool("mlp_bias", bias);
  if (bias) in.fail("mlp_bias", "strata's Llama has no biases; expected false");
  if (json.contains("rope_scaling") && !json["rope_scaling"].is_null()) {
    JsonReader scaling = in.object("rope_scaling");
    std::string type;
    if (!scaling.optional_string("rope_type", type)) scaling.optional_string("type", type);
    if (type == "default" || type.empty()) {
      type.clear();
    } else if (type != "llama3") {
      scaling.fail("rope_type", fmt::format("strata supports rope_scaling of type llama3; got '{}'", type));
    }
    c.rope_scaling.type = type;
    scaling.optional_double("factor", c.rope_scaling.factor, 1e-12);
    scaling.optional_double("low_freq_factor", c.rope_scaling.low_freq_factor, 1e-12);
    scaling.optional_double("high_freq_factor", c.rope_scaling.high_freq_factor, 1e-12);
    scaling.optional_int("original_max_position_embeddings",
                         c.rope_scaling.original_max_position_embeddings, 1);
    if (!scaling.status().is_ok()) return scaling.status();
  }
  if (!in.status().is_ok()) return in.status();
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return Status::error(fmt::format(
        "{}: num_attention_heads ({}) must be a multiple of num_key_value_heads ({})", origin,
        c.num_attention_heads, c.num_key_value_heads));
  }
  if (c.head_dim % 2 != 0) {
    return Status::error(fmt::format("{}: head_dim ({}) must be even for rotary embeddings", origin,
                                     c.head_dim));
  }
  return c;
}

Result<ModelConfig> load_model_config(const std::string& spec) {
  for (const auto& preset : presets()) {
    if (spec == preset.name) return preset.config;
  }
  std::filesystem::path path(spec);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) path /= "config.json";
  if (!std::filesystem::exists(path, ec)) {
    std::string names;
    for (const auto& preset : presets()) names += (names.empty() ? "" : ", ") + std::string(preset.name);
    return Status::error(fmt::format(
        "--model {}: not a preset and no such file; give a config.json, a Hugging Face model "
        "directory, or one of: {}", spec, names));
  }
  Result<nlohmann::json> json = read_json_file(path.string());
  if (!json.is_ok()) return json.status();
  return model_config_from_json(*json, path.string());
}

nlohmann::json model_config_to_json(const ModelConfig& c) {
  nlohmann::json j;
  j["architectures"] = {"LlamaForCausalLM"};
  j["model_type"] = "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  if (c.rope_scaling.type.empty()) {
    j["rope_scaling"] = nullptr;
  } else {
    j["rope_scaling"] = {{"rope_type", c.rope_scaling.type},
                         {"factor", c.rope_scaling.factor},
                         {"low_freq_factor", c.rope_scaling.low_freq_factor},
                         {"high_freq_factor", c.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings",
                          c.rope_scaling.original_max_position_embeddings}};
  }
  return j;
}

}  // namespace strata
