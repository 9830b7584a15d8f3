#include "core/model/model_config.h"

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <algorithm>
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
    ModelConfig llama31_405b = make(128256, 16384, 53248, 126, 128, 8, 131072, 500000.0, false);
    llama31_405b.rope_scaling = llama3_scaling(8.0, 8192);
    p.push_back({"llama3.1-405b", "Llama 3.1 405B", llama31_405b});
    for (auto& preset : p) {
      preset.config.name = preset.name;
      if (preset.config.vocab_size >= 32000) preset.config.rms_norm_eps = 1e-5;
    }
    p[0].config.rms_norm_eps = 1e-6;  // tiny: exercise a non-default eps
    // Qwen2.5: biases on q, k and v; the small sizes tie the embeddings.
    auto qwen2 = [](ModelConfig c) {
      c.family = ModelFamily::qwen2;
      c.qkv_bias = true;
      c.rms_norm_eps = 1e-6;
      return c;
    };
    p.push_back({"qwen2.5-0.5b", "Qwen2.5 0.5B",
                 qwen2(make(151936, 896, 4864, 24, 14, 2, 32768, 1000000.0, true))});
    p.push_back({"qwen2.5-1.5b", "Qwen2.5 1.5B",
                 qwen2(make(151936, 1536, 8960, 28, 12, 2, 131072, 1000000.0, true))});
    p.push_back({"qwen2.5-3b", "Qwen2.5 3B",
                 qwen2(make(151936, 2048, 11008, 36, 16, 2, 32768, 1000000.0, true))});
    p.push_back({"qwen2.5-7b", "Qwen2.5 7B",
                 qwen2(make(152064, 3584, 18944, 28, 28, 4, 131072, 1000000.0, false))});
    // Qwen3 (dense): q/k norms per head, head_dim 128 whatever hidden / heads is.
    auto qwen3 = [](ModelConfig c) {
      c.family = ModelFamily::qwen3;
      c.qk_norm = true;
      c.head_dim = 128;
      c.rms_norm_eps = 1e-6;
      return c;
    };
    p.push_back({"qwen3-0.6b", "Qwen3 0.6B",
                 qwen3(make(151936, 1024, 3072, 28, 16, 8, 40960, 1000000.0, true))});
    p.push_back({"qwen3-1.7b", "Qwen3 1.7B",
                 qwen3(make(151936, 2048, 6144, 28, 16, 8, 40960, 1000000.0, true))});
    p.push_back({"qwen3-4b", "Qwen3 4B",
                 qwen3(make(151936, 2560, 9728, 36, 32, 8, 40960, 1000000.0, true))});
    p.push_back({"qwen3-8b", "Qwen3 8B",
                 qwen3(make(151936, 4096, 12288, 36, 32, 8, 40960, 1000000.0, false))});
    // Mistral 7B: v0.1 attends through a window of 4096 keys, v0.3 has none.
    auto mistral = [](ModelConfig c, int64_t window) {
      c.family = ModelFamily::mistral;
      c.sliding_window = window;
      c.rms_norm_eps = 1e-5;
      return c;
    };
    p.push_back({"mistral-7b", "Mistral 7B v0.1",
                 mistral(make(32000, 4096, 14336, 32, 32, 8, 32768, 10000.0, false), 4096)});
    p.push_back({"mistral-7b-v0.3", "Mistral 7B v0.3",
                 mistral(make(32768, 4096, 14336, 32, 32, 8, 32768, 1000000.0, false), 0)});
    // Mixtures of experts: each sparse layer's MLP is a router and E experts.
    ModelConfig mixtral = mistral(make(32000, 4096, 14336, 32, 32, 8, 32768, 1000000.0, false), 0);
    mixtral.family = ModelFamily::mixtral;
    mixtral.num_experts = 8;
    mixtral.num_experts_per_tok = 2;
    mixtral.moe_intermediate_size = 14336;
    mixtral.router_aux_loss_coef = 0.02;
    p.push_back({"mixtral-8x7b", "Mixtral 8x7B (47B, 13B active)", mixtral});
    auto qwen3_moe = [&](ModelConfig c, int64_t expert_intermediate) {
      c = qwen3(c);
      c.family = ModelFamily::qwen3_moe;
      c.num_experts = 128;
      c.num_experts_per_tok = 8;
      c.moe_intermediate_size = expert_intermediate;
      c.norm_topk_prob = true;
      c.router_aux_loss_coef = 0.001;
      return c;
    };
    p.push_back({"qwen3-30b-a3b", "Qwen3 30B-A3B (128 experts, 8 active)",
                 qwen3_moe(make(151936, 2048, 6144, 48, 32, 4, 40960, 1000000.0, false), 768)});
    p.push_back({"qwen3-235b-a22b", "Qwen3 235B-A22B (128 experts, 8 active)",
                 qwen3_moe(make(151936, 4096, 12288, 94, 64, 4, 40960, 1000000.0, false), 1536)});
    ModelConfig small_moe = qwen3_moe(make(256, 256, 688, 4, 8, 4, 2048, 10000.0, false), 256);
    small_moe.head_dim = 32;  // the small preset's heads
    small_moe.num_experts = 16;
    small_moe.num_experts_per_tok = 2;
    p.push_back({"small-moe",
                 "CPU demo mixture of experts (Qwen3-MoE), byte vocabulary, 16 experts, 2 active, "
                 "~13.5M parameters (~2.5M active)",
                 small_moe});
    for (auto& preset : p) preset.config.name = preset.name;
    return p;
  }();
  return list;
}

}  // namespace

const char* model_family_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::llama:
      return "llama";
    case ModelFamily::qwen2:
      return "qwen2";
    case ModelFamily::qwen3:
      return "qwen3";
    case ModelFamily::mistral:
      return "mistral";
    case ModelFamily::mixtral:
      return "mixtral";
    case ModelFamily::qwen3_moe:
      return "qwen3_moe";
  }
  return "llama";
}

const char* model_family_architecture(ModelFamily family) {
  switch (family) {
    case ModelFamily::llama:
      return "LlamaForCausalLM";
    case ModelFamily::qwen2:
      return "Qwen2ForCausalLM";
    case ModelFamily::qwen3:
      return "Qwen3ForCausalLM";
    case ModelFamily::mistral:
      return "MistralForCausalLM";
    case ModelFamily::mixtral:
      return "MixtralForCausalLM";
    case ModelFamily::qwen3_moe:
      return "Qwen3MoeForCausalLM";
  }
  return "LlamaForCausalLM";
}

bool ModelConfig::layer_is_sparse(int64_t layer) const {
  if (num_experts <= 0) return false;
  if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end())
    return false;
  return (layer + 1) % std::max<int64_t>(1, decoder_sparse_step) == 0;
}

int64_t ModelConfig::sparse_layer_count() const {
  int64_t count = 0;
  for (int64_t i = 0; i < num_hidden_layers; ++i) count += layer_is_sparse(i) ? 1 : 0;
  return count;
}

namespace {
// A layer's parameters with `experts` of its experts (all of them, or the k a token reads).
int64_t layer_parameters(const ModelConfig& c, int64_t layer, int64_t experts) {
  const int64_t q = c.hidden_size * c.num_attention_heads * c.head_dim;
  const int64_t kv = 2 * c.hidden_size * c.num_key_value_heads * c.head_dim;
  const int64_t o = c.num_attention_heads * c.head_dim * c.hidden_size;
  const int64_t mlp = c.layer_is_sparse(layer) ? c.num_experts * c.hidden_size +
                                                     experts * 3 * c.hidden_size *
                                                         c.moe_intermediate_size
                                               : 3 * c.hidden_size * c.intermediate_size;
  const int64_t norms = 2 * c.hidden_size;
  const int64_t biases =
      c.qkv_bias ? (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim : 0;
  const int64_t qk_norms = c.qk_norm ? 2 * c.head_dim : 0;
  return q + kv + o + mlp + norms + biases + qk_norms;
}
}  // namespace

int64_t ModelConfig::layer_parameter_count(int64_t layer) const {
  return layer_parameters(*this, layer, num_experts);
}

int64_t ModelConfig::attention_parameter_count() const {
  const int64_t q = hidden_size * num_attention_heads * head_dim;
  const int64_t kv = 2 * hidden_size * num_key_value_heads * head_dim;
  const int64_t o = num_attention_heads * head_dim * hidden_size;
  const int64_t biases = qkv_bias ? (num_attention_heads + 2 * num_key_value_heads) * head_dim : 0;
  const int64_t qk_norms = qk_norm ? 2 * head_dim : 0;
  return q + kv + o + hidden_size + biases + qk_norms;
}

int64_t ModelConfig::layer_active_parameter_count(int64_t layer) const {
  return layer_parameters(*this, layer, num_experts_per_tok);
}

int64_t ModelConfig::parameter_count() const {
  int64_t total = 0;
  for (const UnitShape& unit : model_units(*this)) total += unit.numel;
  return total;
}

int64_t ModelConfig::active_parameter_count() const {
  int64_t total = parameter_count();
  for (int64_t i = 0; i < num_hidden_layers; ++i)
    total -= layer_parameter_count(i) - layer_active_parameter_count(i);
  return total;
}

std::vector<UnitShape> model_units(const ModelConfig& config) {
  std::vector<UnitShape> units;
  const int64_t C = config.hidden_size, K = std::max<int64_t>(1, config.vocab_chunks);
  auto rows = [&](int64_t k) {
    return K == 1 ? config.vocab_size
                  : config.vocab_chunk_begin(k + 1) - config.vocab_chunk_begin(k);
  };
  auto name = [&](const char* unit, int64_t k) {
    return K == 1 ? std::string(unit) : fmt::format("{}.{}", unit, k);
  };
  for (int64_t k = 0; k < K; ++k)
    units.push_back({UnitKind::embedding, -1, name("embedding", k), rows(k) * C, K == 1 ? -1 : k});
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    const std::string layer = fmt::format("layers.{}", i);
    const int64_t numel = config.layer_parameter_count(i);
    if (config.layer_pieces <= 1) {
      units.push_back({UnitKind::decoder_layer, i, layer, numel});
      continue;
    }
    const int64_t attention = config.attention_parameter_count();
    units.push_back(
        {UnitKind::decoder_layer, i, layer + ".attention", attention, -1, LayerPiece::attention});
    if (!config.layer_is_sparse(i) && config.mlp_parts > 1) {
      for (int64_t p = 0; p < config.mlp_parts; ++p) {
        const int64_t rows = config.mlp_part_begin(p + 1) - config.mlp_part_begin(p);
        UnitShape part{UnitKind::decoder_layer,         i,  fmt::format("{}.mlp.{}", layer, p),
                       3 * rows * C + (p == 0 ? C : 0), -1, LayerPiece::mlp_part};
        part.mlp_part = p;
        units.push_back(std::move(part));
      }
      continue;
    }
    if (config.expert_groups <= 1 || !config.layer_is_sparse(i)) {
      units.push_back(
          {UnitKind::decoder_layer, i, layer + ".mlp", numel - attention, -1, LayerPiece::mlp});
      continue;
    }
    const int64_t expert = 3 * C * config.moe_intermediate_size;
    units.push_back({UnitKind::decoder_layer, i, layer + ".router", config.num_experts * C + C, -1,
                     LayerPiece::router});
    for (int64_t g = 0; g < config.expert_groups; ++g) {
      const int64_t experts = config.expert_group_begin(g + 1) - config.expert_group_begin(g);
      units.push_back({UnitKind::decoder_layer, i, fmt::format("{}.experts.{}", layer, g),
                       experts * expert, -1, LayerPiece::experts, g});
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const int64_t lm_head = config.tie_word_embeddings ? 0 : rows(k) * C;
    units.push_back(
        {UnitKind::head, -1, name("head", k), (k == 0 ? C : 0) + lm_head, K == 1 ? -1 : k});
  }
  return units;
}

Status check_vocab_chunks(const ModelConfig& config) {
  if (config.vocab_chunks < 1 || config.vocab_chunks > config.vocab_size)
    return Status::invalid_argument(
        fmt::format("strata.vocab_chunks: expected 1 to the vocabulary's {} rows, got {}",
                    config.vocab_size, config.vocab_chunks));
  if (config.vocab_chunks > 1 && config.tie_word_embeddings)
    return Status::invalid_argument(fmt::format(
        "strata.vocab_chunks {}: {} ties lm_head to the embedding (tie_word_embeddings), whose "
        "head reads the whole table; use strata.vocab_chunks 1 for a tied model",
        config.vocab_chunks, config.name));
  return Status::ok();
}

Status check_mixture(const ModelConfig& config) {
  if (!config.is_moe()) return Status::ok();
  if (config.family != ModelFamily::mixtral && config.family != ModelFamily::qwen3_moe)
    return Status::invalid_argument(
        fmt::format("{}: num_experts {} on a dense family ({}); a mixture of experts is mixtral or "
                    "qwen3_moe, a dense model has num_experts 0",
                    config.name, config.num_experts, model_family_name(config.family)));
  if (config.moe_intermediate_size < 1 || config.num_experts_per_tok < 1 ||
      config.num_experts_per_tok > config.num_experts)
    return Status::invalid_argument(fmt::format(
        "{}: a mixture needs moe_intermediate_size at least 1 (got {}) and 1 to num_experts {} "
        "experts per token (got {})",
        config.name, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok));
  return Status::ok();
}

Status check_layer_pieces(const ModelConfig& config) {
  if (config.layer_pieces == 1 || config.layer_pieces == 2) return Status::ok();
  return Status::invalid_argument(fmt::format(
      "strata.layer_pieces: expected 1 (whole decoder layers) or 2 (each layer's attention and "
      "MLP as units of their own), got {}",
      config.layer_pieces));
}

Status check_expert_groups(const ModelConfig& config) {
  if (config.expert_groups == 1) return Status::ok();
  if (config.expert_groups < 1 || !config.is_moe() || config.expert_groups > config.num_experts)
    return Status::invalid_argument(fmt::format(
        "strata.expert_groups {}: expected 1, or 2 to the {} experts of a mixture's sparse layer",
        config.expert_groups, config.num_experts));
  if (config.layer_pieces != 2)
    return Status::invalid_argument(fmt::format(
        "strata.expert_groups {}: the groups cut a sparse layer's MLP piece, so the layers must "
        "be in pieces; add --layer-pieces 2",
        config.expert_groups));
  return Status::ok();
}

bool unit_passes_input(const ModelConfig& config, const UnitShape& unit) {
  if (unit.expert_group >= 0) return unit.expert_group < config.expert_groups - 1;
  return unit.mlp_part >= 1 && unit.mlp_part < config.mlp_parts - 1;
}

Status check_mlp_parts(const ModelConfig& config) {
  if (config.mlp_parts == 1) return Status::ok();
  if (config.mlp_parts < 1 || config.sparse_layer_count() == config.num_hidden_layers ||
      config.mlp_parts > config.intermediate_size)
    return Status::invalid_argument(
        fmt::format("strata.mlp_parts {}: expected 1, or 2 to the {} rows of a dense layer's MLP "
                    "(intermediate_size){}",
                    config.mlp_parts, config.intermediate_size,
                    config.sparse_layer_count() == config.num_hidden_layers
                        ? "; every layer of this mixture is sparse, so use strata.expert_groups"
                        : ""));
  if (config.layer_pieces != 2)
    return Status::invalid_argument(fmt::format(
        "strata.mlp_parts {}: the parts cut a dense layer's MLP piece, so the layers must be in "
        "pieces; add --layer-pieces 2",
        config.mlp_parts));
  return Status::ok();
}

Status check_sequence_window(const ModelConfig& config, int64_t seq_len) {
  if (config.sliding_window <= 0 || seq_len <= config.sliding_window) return Status::ok();
  return Status::error(fmt::format(
      "{}: sliding_window {} is shorter than --seq-len {}, and the CUDA attention kernels have no "
      "window; pass --seq-len {} or less, or train on the CPU backend",
      config.name, config.sliding_window, seq_len, config.sliding_window));
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> names;
  for (const auto& preset : presets()) names.push_back(preset.name);
  return names;
}

namespace {

// Reads rope_scaling (or transformers' newer rope_parameters, which also carries
// rope_theta) into `c`: none, "default" or "llama3"; any other type is refused.
void read_rope(JsonReader& in, const nlohmann::json& json, const std::string& key, ModelConfig& c) {
  if (!json.contains(key) || json[key].is_null()) return;
  JsonReader scaling = in.object(key);
  std::string type;
  if (!scaling.optional_string("rope_type", type)) scaling.optional_string("type", type);
  if (type == "default" || type.empty()) {
    type.clear();
  } else if (type != "llama3") {
    scaling.fail(
        "rope_type",
        fmt::format("strata supports rope_scaling of type llama3 or default; got '{}'", type));
  }
  c.rope_scaling.type = type;
  scaling.optional_double("rope_theta", c.rope_theta, 0.0);
  if (type.empty()) {
    // A default rope reads no factor; one present with another value would be ignored.
    double factor = 1.0;
    if (scaling.optional_double("factor", factor) && factor != 1.0)
      scaling.fail("factor", "a rope of type default takes no factor; expected 1 or none");
    return;
  }
  scaling.optional_double("factor", c.rope_scaling.factor, 1e-12);
  scaling.optional_double("low_freq_factor", c.rope_scaling.low_freq_factor, 1e-12);
  scaling.optional_double("high_freq_factor", c.rope_scaling.high_freq_factor, 1e-12);
  scaling.optional_int("original_max_position_embeddings",
                       c.rope_scaling.original_max_position_embeddings, 1);
}

// A key that must be absent, null, false or zero: what it asks for strata does not compute.
void refuse_if_set(JsonReader& in, const nlohmann::json& json, const std::string& key,
                   const std::string& why) {
  if (!json.contains(key)) return;
  const nlohmann::json& value = json[key];
  const bool unset = value.is_null() || (value.is_boolean() && !value.get<bool>()) ||
                     (value.is_number() && value.get<double>() == 0.0);
  if (!unset) in.fail(key, why);
}

// The experts of mixtral (num_local_experts, each of intermediate_size) and
// qwen3_moe (num_experts of moe_intermediate_size, dense layers by
// decoder_sparse_step and mlp_only_layers), with transformers' defaults.
void read_experts(JsonReader& in, const nlohmann::json& json, ModelConfig& c) {
  const bool mixtral = c.family == ModelFamily::mixtral;
  c.num_experts = mixtral ? 8 : 128;
  c.num_experts_per_tok = mixtral ? 2 : 8;
  c.norm_topk_prob = mixtral;  // Mixtral always renormalises; Qwen3MoeConfig defaults to false
  // Qwen3-MoE's released configs say num_experts; transformers 5 writes it as
  // num_local_experts (its attribute_map), as Mixtral's are.
  in.optional_int("num_local_experts", c.num_experts, 1);
  if (!mixtral) {
    const int64_t local = c.num_experts;
    if (in.optional_int("num_experts", c.num_experts, 1) && json.contains("num_local_experts") &&
        !json["num_local_experts"].is_null() && local != c.num_experts)
      in.fail("num_experts", fmt::format("{} disagrees with num_local_experts {}; give one",
                                         c.num_experts, local));
  }
  in.optional_int("num_experts_per_tok", c.num_experts_per_tok, 1, c.num_experts);
  in.optional_bool("output_router_logits", c.output_router_logits);
  in.optional_double("router_aux_loss_coef", c.router_aux_loss_coef, 0.0);
  if (mixtral) {
    refuse_if_set(in, json, "router_jitter_noise",
                  "strata's router has no jitter noise (it would make training runs differ); "
                  "expected 0");
    return;  // the experts' size is intermediate_size, read with the dense keys
  }
  c.moe_intermediate_size = 768;
  in.optional_int("moe_intermediate_size", c.moe_intermediate_size, 1);
  in.optional_bool("norm_topk_prob", c.norm_topk_prob);
  in.optional_int("decoder_sparse_step", c.decoder_sparse_step, 1);
  if (json.contains("mlp_only_layers") && !json["mlp_only_layers"].is_null()) {
    const nlohmann::json& layers = json["mlp_only_layers"];
    bool ok = layers.is_array();
    for (const nlohmann::json& layer : ok ? layers : nlohmann::json::array()) {
      ok = ok && layer.is_number_integer() && layer.get<int64_t>() >= 0;
      if (ok) c.mlp_only_layers.push_back(layer.get<int64_t>());
    }
    if (!ok)
      in.fail("mlp_only_layers", "expected a list of layer indices (integers from 0); got " +
                                     json_excerpt(layers));
    in.accept("mlp_only_layers");
  }
}

}  // namespace

Result<ModelConfig> model_config_from_json(const nlohmann::json& json, const std::string& origin) {
  if (!json.is_object()) return Status::error(fmt::format("{}: expected a JSON object", origin));
  JsonReader in(json, origin, "");
  ModelConfig c;
  c.name = origin;
  std::string model_type = "llama";
  in.optional_string("model_type", model_type);
  // Mixtures strata does not compute yet, refused by the field that makes them different.
  if (model_type == "qwen2_moe") {
    in.fail("shared_expert_intermediate_size",
            "shared experts (qwen2_moe) are not built in strata; it trains mixtral and qwen3_moe");
    return in.status();
  }
  if (model_type.starts_with("deepseek")) {
    in.fail("kv_lora_rank", fmt::format("multi-head latent attention ({}) is not built in strata; "
                                        "it trains mixtral and qwen3_moe",
                                        model_type));
    return in.status();
  }
  if (model_type == "gpt_oss") {
    in.fail("model_type",
            "gpt_oss's attention sinks are not built in strata; it trains mixtral and qwen3_moe");
    return in.status();
  }
  if (model_type == "llama") {
    c.family = ModelFamily::llama;
  } else if (model_type == "qwen2") {
    c.family = ModelFamily::qwen2;
  } else if (model_type == "qwen3") {
    c.family = ModelFamily::qwen3;
  } else if (model_type == "mistral") {
    c.family = ModelFamily::mistral;
  } else if (model_type == "mixtral") {
    c.family = ModelFamily::mixtral;
  } else if (model_type == "qwen3_moe") {
    c.family = ModelFamily::qwen3_moe;
  } else {
    in.fail("model_type", fmt::format("strata trains the families llama, qwen2, qwen3, mistral, "
                                      "mixtral and qwen3_moe; got '{}'",
                                      model_type));
    return in.status();
  }
  const std::string family = model_family_name(c.family);
  if (c.family == ModelFamily::mixtral || c.family == ModelFamily::qwen3_moe) {
    read_experts(in, json, c);
  } else {
    // Mixture-of-experts keys in a dense family's config ask for what it does not compute.
    for (const char* key :
         {"num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
          "moe_intermediate_size", "shared_expert_intermediate_size"}) {
      refuse_if_set(in, json, key,
                    fmt::format("mixture of experts in a {} config; strata's mixtures are the "
                                "families mixtral and qwen3_moe",
                                family));
    }
  }
  in.required_int("vocab_size", c.vocab_size, 1);
  in.required_int("hidden_size", c.hidden_size, 1);
  in.required_int("intermediate_size", c.intermediate_size, 1);
  in.required_int("num_hidden_layers", c.num_hidden_layers, 1);
  in.required_int("num_attention_heads", c.num_attention_heads, 1);
  c.num_key_value_heads = c.num_attention_heads;
  in.optional_int("num_key_value_heads", c.num_key_value_heads, 1);
  // transformers' defaults per family: Qwen3Config's head_dim is 128, the others
  // derive it; LlamaConfig's eps is 1e-6 like the others', its context 2048.
  if (c.family == ModelFamily::mixtral) c.moe_intermediate_size = c.intermediate_size;
  c.head_dim = c.family == ModelFamily::qwen3 ? 128
               : c.num_attention_heads > 0    ? c.hidden_size / c.num_attention_heads
                                              : 0;
  in.optional_int("head_dim", c.head_dim, 1);
  const bool mistral_like = c.family == ModelFamily::mistral || c.family == ModelFamily::mixtral;
  c.max_position_embeddings = c.family == ModelFamily::llama ? 2048
                              : mistral_like                 ? 4096 * 32
                                                             : 32768;
  in.optional_int("max_position_embeddings", c.max_position_embeddings, 1);
  c.rms_norm_eps = 1e-6;
  in.optional_double("rms_norm_eps", c.rms_norm_eps, 0.0);
  in.optional_double("rope_theta", c.rope_theta, 0.0);
  in.optional_bool("tie_word_embeddings", c.tie_word_embeddings);
  std::string hidden_act = "silu";
  in.optional_string("hidden_act", hidden_act);
  if (hidden_act != "silu") in.fail("hidden_act", "strata supports only 'silu' (SwiGLU)");
  refuse_if_set(in, json, "mlp_bias",
                fmt::format("strata's {} has no MLP biases; expected false", family));
  refuse_if_set(in, json, "attention_dropout", "strata has no attention dropout; expected 0");
  if (c.family == ModelFamily::qwen2) {
    // Qwen2's q, k and v always have biases (transformers reads no attention_bias for it).
    c.qkv_bias = true;
    if (json.contains("attention_bias") && json["attention_bias"] == false)
      in.fail("attention_bias", "qwen2 always has q, k and v biases; expected true or none");
  } else {
    refuse_if_set(in, json, "attention_bias",
                  fmt::format("strata's {} has no attention biases; expected false", family));
  }
  refuse_if_set(in, json, "use_mrope", "multimodal rotary embeddings: strata computes 1-D RoPE");
  c.qk_norm = c.family == ModelFamily::qwen3 || c.family == ModelFamily::qwen3_moe;
  if (c.family == ModelFamily::qwen2 || c.family == ModelFamily::qwen3 ||
      c.family == ModelFamily::qwen3_moe) {
    // sliding_window only counts with use_sliding_window, which strata does not compute.
    refuse_if_set(
        in, json, "use_sliding_window",
        fmt::format("strata's {} has full attention in every layer; expected false", family));
    in.accept("sliding_window");
    in.accept("max_window_layers");
  } else if (mistral_like) {
    in.optional_int("sliding_window", c.sliding_window, 1);
  } else {
    refuse_if_set(in, json, "sliding_window",
                  "strata's llama has no sliding window; expected null");
  }
  if (json.contains("layer_types") && json["layer_types"].is_array()) {
    for (const nlohmann::json& type : json["layer_types"]) {
      if (type != "full_attention") {
        in.fail("layer_types",
                fmt::format("strata computes full_attention layers only; got {}", type.dump()));
        break;
      }
    }
  }
  read_rope(in, json, "rope_scaling", c);
  read_rope(in, json, "rope_parameters", c);
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
  j["architectures"] = {model_family_architecture(c.family)};
  j["model_type"] = model_family_name(c.family);
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
  switch (c.family) {
    case ModelFamily::llama:
      j["attention_bias"] = false;
      j["mlp_bias"] = false;
      break;
    case ModelFamily::qwen2:
    case ModelFamily::qwen3:
    case ModelFamily::qwen3_moe:
      if (c.family != ModelFamily::qwen2) j["attention_bias"] = false;
      j["use_sliding_window"] = false;
      j["sliding_window"] = nullptr;
      break;
    case ModelFamily::mistral:
    case ModelFamily::mixtral:
      if (c.sliding_window > 0) {
        j["sliding_window"] = c.sliding_window;
      } else {
        j["sliding_window"] = nullptr;
      }
      break;
  }
  if (c.family == ModelFamily::mixtral) {
    j["num_local_experts"] = c.num_experts;
    j["router_jitter_noise"] = 0.0;
  } else if (c.family == ModelFamily::qwen3_moe) {
    j["num_experts"] = c.num_experts;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = c.decoder_sparse_step;
    j["mlp_only_layers"] = c.mlp_only_layers;
  }
  if (c.is_moe()) {
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["output_router_logits"] = c.output_router_logits;
    j["router_aux_loss_coef"] = c.router_aux_loss_coef;
  }
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
