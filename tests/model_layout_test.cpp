// The model's units: flat-buffer layouts with Hugging Face names, shard padding,
// and initialisation as a function of (seed, tensor name, element index).
#include <gtest/gtest.h>

#include <cmath>

#include "core/model/model.h"

namespace strata {
namespace {

ModelConfig preset(const std::string& name) {
  Result<ModelConfig> config = load_model_config(name);
  EXPECT_TRUE(config.is_ok()) << config.status().message();
  return *config;
}

TEST(ModelLayout, UnitsHoldHuggingFaceTensorsBackToBackAndAgreeWithModelUnits) {
  const ModelConfig config = preset("tiny");
  const ModelLayout layout = model_layout(config);
  const std::vector<UnitShape> units = model_units(config);
  ASSERT_EQ(layout.units.size(), units.size());
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitLayout& unit = layout.units[u];
    EXPECT_EQ(unit.numel, units[u].numel) << unit.unit.name;
    int64_t offset = 0;
    for (const TensorSlot& slot : unit.tensors) {
      EXPECT_EQ(slot.offset, offset) << slot.name;
      offset += slot.numel;
      EXPECT_EQ(slot.weight_decay, slot.shape.size() == 2) << slot.name;
    }
    EXPECT_EQ(offset, unit.numel);
  }
  const TensorSlot* q = layout.units[1].find("model.layers.0.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->shape, (std::vector<int64_t>{config.num_attention_heads * config.head_dim,
                                            config.hidden_size}));
  const TensorSlot* k = layout.units[1].find("model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(k->shape, (std::vector<int64_t>{config.num_key_value_heads * config.head_dim,
                                            config.hidden_size}));
  EXPECT_NE(layout.units.back().find("lm_head.weight"), nullptr);
}

TEST(ModelLayout, FamiliesAddTheirTensorsAfterTheLlamaOnes) {
  const ModelConfig qwen2 = preset("qwen2.5-0.5b"), qwen3 = preset("qwen3-0.6b");
  const ModelLayout l2 = model_layout(qwen2), l3 = model_layout(qwen3);
  const UnitLayout& layer2 = l2.units[1];
  const UnitLayout& layer3 = l3.units[1];
  ASSERT_EQ(layer2.tensors.size(), 12u);
  ASSERT_EQ(layer3.tensors.size(), 11u);
  EXPECT_EQ(layer2.tensors[8].name, "model.layers.0.post_attention_layernorm.weight");
  EXPECT_EQ(layer2.tensors[9].name, "model.layers.0.self_attn.q_proj.bias");
  EXPECT_EQ(layer2.tensors[9].shape, (std::vector<int64_t>{14 * 64}));
  EXPECT_EQ(layer2.tensors[10].name, "model.layers.0.self_attn.k_proj.bias");
  EXPECT_EQ(layer2.tensors[11].name, "model.layers.0.self_attn.v_proj.bias");
  EXPECT_EQ(layer2.tensors[11].shape, (std::vector<int64_t>{2 * 64}));
  EXPECT_FALSE(layer2.tensors[9].weight_decay);  // biases are 1-D: no weight decay
  EXPECT_EQ(layer3.tensors[9].name, "model.layers.0.self_attn.q_norm.weight");
  EXPECT_EQ(layer3.tensors[10].name, "model.layers.0.self_attn.k_norm.weight");
  EXPECT_EQ(layer3.tensors[10].shape, (std::vector<int64_t>{128}));
  // q_proj of Qwen3 0.6B is (16 x 128, 1024): head_dim is not hidden / heads.
  EXPECT_EQ(layer3.find("model.layers.0.self_attn.q_proj.weight")->shape,
            (std::vector<int64_t>{2048, 1024}));
  EXPECT_EQ(layer2.numel, qwen2.layer_parameter_count());
  EXPECT_EQ(layer3.numel, qwen3.layer_parameter_count());
  // Initial biases are zero, norms one (as transformers initialises them).
  std::vector<float> flat(size_t(layer2.padded_numel));
  init_unit_parameters(l2, 1, 7, flat.data());
  for (int64_t i = 0; i < layer2.tensors[9].numel; ++i)
    ASSERT_EQ(flat[size_t(layer2.tensors[9].offset + i)], 0.0f);
  std::vector<float> flat3(size_t(layer3.padded_numel));
  init_unit_parameters(l3, 1, 7, flat3.data());
  EXPECT_EQ(flat3[size_t(layer3.tensors[9].offset)], 1.0f);
}

TEST(ModelLayout, TiedHeadHasOnlyTheFinalNorm) {
  ModelConfig config = preset("tiny");
  config.tie_word_embeddings = true;
  const ModelLayout layout = model_layout(config);
  ASSERT_EQ(layout.units.back().tensors.size(), 1u);
  EXPECT_EQ(layout.units.back().tensors[0].name, "model.norm.weight");
  EXPECT_EQ(checkpoint_tensors(layout).size(), 2u + 9u * config.num_hidden_layers);
}

TEST(ModelLayout, PaddingMakesEqualShardsOf4KiBInEveryDtype) {
  const ModelConfig config = preset("tiny");
  for (int world : {1, 3, 8}) {
    const ModelLayout layout = model_layout(config, world);
    for (const UnitLayout& unit : layout.units) {
      EXPECT_GE(unit.padded_numel, unit.numel);
      EXPECT_EQ(unit.padded_numel, unit.shard_numel * world);
      EXPECT_EQ(unit.shard_numel * 2 % 4096, 0) << unit.unit.name << " world " << world;
      EXPECT_LT(unit.padded_numel - unit.numel, world * kShardAlignElements);
    }
  }
}

TEST(ModelInit, DependsOnlyOnSeedNameAndIndex) {
  const ModelConfig config = preset("tiny");
  const ModelLayout one = model_layout(config, 1), four = model_layout(config, 4);
  for (size_t u = 0; u < one.units.size(); ++u) {
    std::vector<float> a(one.units[u].padded_numel), b(four.units[u].padded_numel);
    init_unit_parameters(one, static_cast<int64_t>(u), 7, a.data());
    init_unit_parameters(four, static_cast<int64_t>(u), 7, b.data());
    ASSERT_TRUE(std::equal(a.begin(), a.begin() + one.units[u].numel, b.begin()))
        << one.units[u].unit.name;
    for (int64_t i = four.units[u].numel; i < four.units[u].padded_numel; ++i)
      ASSERT_EQ(b[i], 0.0f);
  }
  EXPECT_NE(init_normal(7, "model.norm.weight", 3), init_normal(8, "model.norm.weight", 3));
  EXPECT_NE(init_normal(7, "lm_head.weight", 3), init_normal(7, "model.embed_tokens.weight", 3));
}

TEST(ModelInit, ProjectionsAreNormalWithTheRequestedStdAndNormsAreOne) {
  const ModelConfig config = preset("tiny");
  HostModel model = make_host_model(config);
  init_host_model(model, 11);
  const TensorSlot* gate = model.layout.units[1].find("model.layers.0.mlp.gate_proj.weight");
  const float* w = model.tensor(gate->name);
  double sum = 0.0, sum_squares = 0.0;
  for (int64_t i = 0; i < gate->numel; ++i) {
    sum += w[i];
    sum_squares += static_cast<double>(w[i]) * w[i];
  }
  const double mean = sum / gate->numel, std = std::sqrt(sum_squares / gate->numel - mean * mean);
  EXPECT_NEAR(mean, 0.0, 0.002);
  EXPECT_NEAR(std, 0.02, 0.001);
  const float* norm = model.tensor("model.layers.1.input_layernorm.weight");
  for (int64_t c = 0; c < config.hidden_size; ++c) ASSERT_EQ(norm[c], 1.0f);
}

}  // namespace
}  // namespace strata
