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
  // Llama 3.1 405B: 128256 x 16384 embedding and lm_head (untied), 126 layers of
  // 128 query and 8 key/value heads of 128, MLP 53248, final norm.
  const int64_t layer_405b = 2 * 16384 * 16384 + 2 * 16384 * 1024 + 3 * 16384 * 53248LL + 2 * 16384;
  EXPECT_EQ(count("llama3.1-405b"), 2 * 128256LL * 16384 + 126 * layer_405b + 16384);
  EXPECT_EQ(count("llama3.1-405b"), 405853388800LL);
  const ModelConfig m405 = *load_model_config("llama3.1-405b");
  EXPECT_EQ(m405.head_dim, 128);
  EXPECT_EQ(m405.max_position_embeddings, 131072);
  EXPECT_EQ(m405.rope_theta, 500000.0);
  EXPECT_EQ(m405.rope_scaling.type, "llama3");
  EXPECT_EQ(m405.rope_scaling.factor, 8.0);
  EXPECT_FALSE(m405.tie_word_embeddings);
}

TEST(ModelConfig, FamilyPresetsHaveThePublishedParameterCounts) {
  // Qwen2.5 0.5B from its config.json: vocabulary 151936 x 896 (tied), 24 layers
  // of 14 query and 2 key/value heads of 64 with biases on q, k and v, MLP 4864.
  const int64_t q = 896 * 896 + 896, kv = 2 * (896 * 128 + 128), o = 896 * 896;
  const int64_t qwen_layer = q + kv + o + 3 * 896 * 4864 + 2 * 896;
  EXPECT_EQ(count("qwen2.5-0.5b"), 151936LL * 896 + 24 * qwen_layer + 896);
  EXPECT_EQ(count("qwen2.5-0.5b"), 494032768LL);
  EXPECT_EQ(count("qwen2.5-1.5b"), 1543714304LL);
  EXPECT_EQ(count("qwen2.5-3b"), 3085938688LL);
  EXPECT_EQ(count("qwen2.5-7b"), 7615616512LL);
  // Qwen3 0.6B: head_dim 128 (16 x 128 = 2048 != hidden 1024), q/k norms of 128 per layer.
  const int64_t qwen3_layer =
      1024 * 2048 + 2 * 1024 * 1024 + 2048 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128;
  EXPECT_EQ(count("qwen3-0.6b"), 151936LL * 1024 + 28 * qwen3_layer + 1024);
  EXPECT_EQ(count("qwen3-0.6b"), 596049920LL);
  EXPECT_EQ(count("qwen3-1.7b"), 1720574976LL);
  EXPECT_EQ(count("qwen3-4b"), 4022468096LL);
  EXPECT_EQ(count("qwen3-8b"), 8190735360LL);
  EXPECT_EQ(count("mistral-7b"), 7241732096LL);
  EXPECT_EQ(count("mistral-7b-v0.3"), 7248023552LL);
  EXPECT_EQ(load_model_config("mistral-7b")->sliding_window, 4096);
  EXPECT_EQ(load_model_config("mistral-7b-v0.3")->sliding_window, 0);
}

TEST(ModelConfig, EachFamilyIsReadAndWrittenBackAsItself) {
  struct Case {
    const char* text;
    ModelFamily family;
    const char* architecture;
  };
  const Case cases[] = {
      {R"({"model_type": "qwen2", "vocab_size": 151, "hidden_size": 60, "intermediate_size": 86,
           "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
           "use_sliding_window": false, "sliding_window": 32768, "max_window_layers": 21,
           "tie_word_embeddings": true, "rope_theta": 1000000.0})",
       ModelFamily::qwen2, "Qwen2ForCausalLM"},
      {R"({"model_type": "qwen3", "vocab_size": 151, "hidden_size": 60, "intermediate_size": 86,
           "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
           "head_dim": 14, "attention_bias": false, "use_sliding_window": false,
           "sliding_window": null, "layer_types": ["full_attention", "full_attention"]})",
       ModelFamily::qwen3, "Qwen3ForCausalLM"},
      {R"({"model_type": "mistral", "vocab_size": 151, "hidden_size": 60, "intermediate_size": 86,
           "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
           "sliding_window": 4096, "head_dim": null})",
       ModelFamily::mistral, "MistralForCausalLM"},
  };
  for (const Case& c : cases) {
    Result<ModelConfig> model = model_config_from_json(nlohmann::json::parse(c.text), "cfg.json");
    ASSERT_TRUE(model.is_ok()) << model.status().message();
    EXPECT_EQ(model->family, c.family);
    EXPECT_EQ(model->qkv_bias, c.family == ModelFamily::qwen2);
    EXPECT_EQ(model->qk_norm, c.family == ModelFamily::qwen3);
    EXPECT_EQ(model->head_dim, c.family == ModelFamily::qwen3 ? 14 : 10);
    EXPECT_EQ(model->sliding_window, c.family == ModelFamily::mistral ? 4096 : 0);
    const nlohmann::json written = model_config_to_json(*model);
    EXPECT_EQ(written["architectures"][0], c.architecture);
    EXPECT_EQ(written["model_type"], model_family_name(c.family));
    Result<ModelConfig> again = model_config_from_json(written, "again");
    ASSERT_TRUE(again.is_ok()) << again.status().message();
    EXPECT_EQ(again->family, c.family);
    EXPECT_EQ(again->sliding_window, model->sliding_window);
    EXPECT_EQ(again->parameter_count(), model->parameter_count());
  }
  // transformers' Qwen3Config has head_dim 128 when the key is absent.
  Result<ModelConfig> qwen3 = model_config_from_json(
      nlohmann::json::parse(R"({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4})"),
      "cfg.json");
  ASSERT_TRUE(qwen3.is_ok()) << qwen3.status().message();
  EXPECT_EQ(qwen3->head_dim, 128);
  // transformers 5 writes the rotary settings as rope_parameters.
  Result<ModelConfig> v5 = model_config_from_json(
      nlohmann::json::parse(R"({"model_type": "qwen2", "vocab_size": 10, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}})"),
      "cfg.json");
  ASSERT_TRUE(v5.is_ok()) << v5.status().message();
  EXPECT_EQ(v5->rope_theta, 250000.0);
}

TEST(ModelConfig, PublishedConfigFilesGiveThePresets) {
  // The config.json files as published (keys strata has no use for included).
  const char* qwen25 = R"({"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
      "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896,
      "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768,
      "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
      "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
      "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
      "use_mrope": false, "use_sliding_window": false, "vocab_size": 151936})";
  const char* qwen3 = R"({"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
      "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
      "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
      "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
      "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
      "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
      "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false,
      "vocab_size": 151936})";
  const char* mistral = R"({"architectures": ["MistralForCausalLM"], "bos_token_id": 1,
      "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
      "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
      "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
      "vocab_size": 32000})";
  const char* llama31_405b = R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001,
      "hidden_act": "silu", "hidden_size": 16384, "initializer_range": 0.02,
      "intermediate_size": 53248, "max_position_embeddings": 131072, "mlp_bias": false,
      "model_type": "llama", "num_attention_heads": 128, "num_hidden_layers": 126,
      "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
      "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true,
      "vocab_size": 128256})";
  const std::pair<const char*, const char*> cases[] = {{qwen25, "qwen2.5-0.5b"},
                                                       {qwen3, "qwen3-0.6b"},
                                                       {mistral, "mistral-7b"},
                                                       {llama31_405b, "llama3.1-405b"}};
  for (const auto& [text, name] : cases) {
    Result<ModelConfig> read = model_config_from_json(nlohmann::json::parse(text), name);
    ASSERT_TRUE(read.is_ok()) << read.status().message();
    const ModelConfig preset = *load_model_config(name);
    EXPECT_EQ(read->parameter_count(), preset.parameter_count()) << name;
    EXPECT_EQ(read->family, preset.family) << name;
    EXPECT_EQ(read->head_dim, preset.head_dim) << name;
    EXPECT_EQ(read->sliding_window, preset.sliding_window) << name;
    EXPECT_EQ(read->rope_theta, preset.rope_theta) << name;
    EXPECT_EQ(read->rms_norm_eps, preset.rms_norm_eps) << name;
    EXPECT_EQ(read->max_position_embeddings, preset.max_position_embeddings) << name;
    EXPECT_EQ(read->tie_word_embeddings, preset.tie_word_embeddings) << name;
  }
}

TEST(ModelConfig, WhatNoFamilyComputesIsRefusedNamingTheKey) {
  auto error = [](const std::string& family, const std::string& extra) {
    const std::string text = R"({"model_type": ")" + family +
                             R"(", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, )" +
                             extra + "}";
    Result<ModelConfig> model = model_config_from_json(nlohmann::json::parse(text), "cfg.json");
    EXPECT_FALSE(model.is_ok()) << text;
    const std::string message = model.is_ok() ? std::string() : model.status().message();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    return message;
  };
  auto names = [](const std::string& message, const std::string& key) {
    return message.find("cfg.json: " + key + ":") != std::string::npos;
  };
  EXPECT_TRUE(names(error("qwen2", R"("num_experts": 60)"), "num_experts"));
  EXPECT_TRUE(names(error("mistral", R"("num_local_experts": 8)"), "num_local_experts"));
  EXPECT_TRUE(names(error("qwen3", R"("num_experts_per_tok": 8)"), "num_experts_per_tok"));
  EXPECT_TRUE(names(error("llama", R"("attention_bias": true)"), "attention_bias"));
  EXPECT_TRUE(names(error("qwen3", R"("attention_bias": true)"), "attention_bias"));
  EXPECT_TRUE(names(error("qwen2", R"("attention_bias": false)"), "attention_bias"));
  EXPECT_TRUE(names(error("qwen2", R"("use_sliding_window": true)"), "use_sliding_window"));
  EXPECT_TRUE(names(error("qwen3", R"("use_sliding_window": true)"), "use_sliding_window"));
  EXPECT_TRUE(names(error("llama", R"("sliding_window": 4096)"), "sliding_window"));
  EXPECT_TRUE(names(error("llama", R"("mlp_bias": true)"), "mlp_bias"));
  EXPECT_TRUE(names(error("qwen2", R"("attention_dropout": 0.1)"), "attention_dropout"));
  EXPECT_TRUE(names(error("qwen2", R"("use_mrope": true)"), "use_mrope"));
  EXPECT_TRUE(names(error("qwen3", R"("layer_types": ["sliding_attention"])"), "layer_types"));
  EXPECT_TRUE(names(error("qwen2", R"("rope_scaling": {"type": "yarn", "factor": 4.0})"),
                    "rope_scaling.rope_type"));
  EXPECT_TRUE(names(error("qwen3", R"("rope_parameters": {"rope_type": "dynamic"})"),
                    "rope_parameters.rope_type"));
  // Mixtures not built yet, by the field that sets them apart.
  EXPECT_TRUE(names(error("qwen2_moe", R"("num_experts": 60)"), "shared_expert_intermediate_size"));
  EXPECT_TRUE(names(error("deepseek_v3", R"("kv_lora_rank": 512)"), "kv_lora_rank"));
  EXPECT_TRUE(names(error("gpt_oss", R"("num_local_experts": 32)"), "model_type"));
  EXPECT_TRUE(names(error("mixtral", R"("router_jitter_noise": 0.01)"), "router_jitter_noise"));
  EXPECT_TRUE(names(error("qwen3_moe", R"("mlp_only_layers": [1, -2])"), "mlp_only_layers"));
  EXPECT_TRUE(names(error("qwen3_moe", R"("num_experts": 4, "num_experts_per_tok": 5)"),
                    "num_experts_per_tok"));
  EXPECT_TRUE(names(error("gemma", R"("head_dim": 4)"), "model_type"));
}

TEST(ModelConfig, MixturePresetsHaveThePublishedParameterCounts) {
  auto config = [](const char* name) { return *load_model_config(name); };
  // Mixtral-8x7B: 46.7B parameters, 12.9B active (two of eight experts).
  EXPECT_EQ(config("mixtral-8x7b").parameter_count(), 46702792704LL);
  EXPECT_EQ(config("mixtral-8x7b").active_parameter_count(), 12879925248LL);
  // Qwen3-30B-A3B: 30.5B, 3.3B active; Qwen3-235B-A22B: 235.1B, 22.2B active.
  EXPECT_EQ(config("qwen3-30b-a3b").parameter_count(), 30532122624LL);
  EXPECT_EQ(config("qwen3-30b-a3b").active_parameter_count(), 3353032704LL);
  EXPECT_EQ(config("qwen3-235b-a22b").parameter_count(), 235093634560LL);
  EXPECT_EQ(config("qwen3-235b-a22b").active_parameter_count(), 22190763520LL);
  EXPECT_EQ(config("llama3-8b").active_parameter_count(), config("llama3-8b").parameter_count());
  // small-moe, by hand: a layer is two norms (256 each), q 256 x 8 x 32, k
  // and v 256 x 4 x 32, o 256 x 256, q and k norms (32 each), the router
  // 16 x 256 and 16 experts of 3 x 256 x 256; four layers, the untied
  // embedding and head (256 x 256 each) and the final norm.
  const int64_t expert = 3 * 256 * 256;
  const int64_t layer = 2 * 256 + 256 * 256 + 2 * 256 * 128 + 256 * 256 + 2 * 32 + 16 * 256;
  const int64_t outside = 2 * 256 * 256 + 256;
  EXPECT_EQ(config("small-moe").parameter_count(), 4 * (layer + 16 * expert) + outside);
  EXPECT_EQ(config("small-moe").active_parameter_count(), 4 * (layer + 2 * expert) + outside);
  EXPECT_EQ(config("small-moe").parameter_count(), 13519360);
}

TEST(ModelConfig, MixturesAreReadAndWrittenBackAsThemselves) {
  // As published (Mixtral-8x7B-v0.1), keys strata has no use for included.
  const char* mixtral = R"({"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0,
      "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
      "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
      "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
      "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
      "output_router_logits": false, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
      "router_aux_loss_coef": 0.02, "sliding_window": null, "tie_word_embeddings": false,
      "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": true,
      "vocab_size": 32000})";
  // Qwen3-30B-A3B's, with its 128 experts of 768 and 8 per token.
  const char* qwen3_moe = R"({"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
      "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
      "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
      "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
      "moe_intermediate_size": 768, "norm_topk_prob": true, "num_attention_heads": 32,
      "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
      "num_key_value_heads": 4, "output_router_logits": false, "rms_norm_eps": 1e-06,
      "rope_scaling": null, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
      "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
      "transformers_version": "4.51.0", "use_cache": true, "use_sliding_window": false,
      "vocab_size": 151936})";
  for (const auto& [text, preset] :
       {std::pair{mixtral, "mixtral-8x7b"}, std::pair{qwen3_moe, "qwen3-30b-a3b"}}) {
    Result<ModelConfig> model = model_config_from_json(nlohmann::json::parse(text), "cfg.json");
    ASSERT_TRUE(model.is_ok()) << model.status().message();
    const ModelConfig expected = *load_model_config(preset);
    EXPECT_EQ(model->family, expected.family);
    EXPECT_EQ(model->parameter_count(), expected.parameter_count()) << preset;
    EXPECT_EQ(model->num_experts, expected.num_experts);
    EXPECT_EQ(model->num_experts_per_tok, expected.num_experts_per_tok);
    EXPECT_EQ(model->moe_intermediate_size, expected.moe_intermediate_size);
    EXPECT_EQ(model->norm_topk_prob, expected.norm_topk_prob);
    EXPECT_EQ(model->router_aux_loss_coef, expected.router_aux_loss_coef);
    EXPECT_FALSE(model->output_router_logits);
    Result<ModelConfig> again = model_config_from_json(model_config_to_json(*model), "again");
    ASSERT_TRUE(again.is_ok()) << again.status().message();
    EXPECT_EQ(again->parameter_count(), model->parameter_count());
    EXPECT_EQ(again->sparse_layer_count(), model->num_hidden_layers);
    EXPECT_EQ(model_config_to_json(*again)["architectures"][0],
              model_family_architecture(model->family));
  }
  // Dense layers among sparse ones: mlp_only_layers and decoder_sparse_step.
  Result<ModelConfig> mixed = model_config_from_json(
      nlohmann::json::parse(R"({"model_type": "qwen3_moe", "vocab_size": 10, "hidden_size": 16,
          "intermediate_size": 24, "moe_intermediate_size": 6, "num_hidden_layers": 6,
          "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
          "decoder_sparse_step": 2, "mlp_only_layers": [3], "output_router_logits": true})"),
      "cfg.json");
  ASSERT_TRUE(mixed.is_ok()) << mixed.status().message();
  EXPECT_EQ(mixed->head_dim, 8);  // Qwen3MoeConfig derives it, unlike Qwen3Config
  EXPECT_FALSE(mixed->norm_topk_prob);  // Qwen3MoeConfig's default
  EXPECT_TRUE(mixed->output_router_logits);
  std::vector<bool> sparse;
  for (int64_t i = 0; i < 6; ++i) sparse.push_back(mixed->layer_is_sparse(i));
  EXPECT_EQ(sparse, (std::vector<bool>{false, true, false, false, false, true}));
  EXPECT_EQ(mixed->layer_parameter_count(0) - mixed->layer_parameter_count(1),
            3 * 16 * 24 - (4 * 16 + 4 * 3 * 16 * 6));
  EXPECT_EQ(mixed->layer_active_parameter_count(1), mixed->layer_parameter_count(1) - 2 * 3 * 16 * 6);
}

TEST(ModelConfig, ASequenceLongerThanTheSlidingWindowIsNamed) {
  ModelConfig mistral = *load_model_config("mistral-7b");
  EXPECT_TRUE(check_sequence_window(mistral, 4096).is_ok());
  const Status longer = check_sequence_window(mistral, 4097);
  ASSERT_FALSE(longer.is_ok());
  EXPECT_NE(longer.message().find("sliding_window 4096"), std::string::npos) << longer.message();
  EXPECT_NE(longer.message().find("--seq-len 4097"), std::string::npos) << longer.message();
  EXPECT_TRUE(check_sequence_window(*load_model_config("mistral-7b-v0.3"), 32768).is_ok());
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
