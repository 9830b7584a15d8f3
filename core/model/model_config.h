// A model's shape (core/README.md, model), from a preset or a Hugging Face
// config.json, and the units the model is cut into. Four families share one
// decoder (RMSNorm, rotary grouped-query attention, SwiGLU) and differ in a few
// features: llama (none), qwen2 (biases on q, k and v), qwen3 (RMSNorm over
// each head of q and k before the rotary embedding, explicit head_dim) and
// mistral (sliding-window attention). Two mixture-of-experts families replace
// the MLP of their sparse layers with a softmax router over E SwiGLU experts,
// each token taking the top k: mixtral (Mistral's attention, top-k weights
// renormalised) and qwen3_moe (Qwen3's attention, `norm_topk_prob`, dense
// layers among the sparse ones by `decoder_sparse_step` and
// `mlp_only_layers`). A config.json asking for anything else (shared experts,
// latent attention, another rope_scaling type, a bias the family has not) is
// refused in one line naming the key.
//
// A ModelConfig is a plain value; the functions here are pure and thread-safe.
// The parameter count is computed from the shapes (no lookup tables), and the
// units are the FSDP2 `fully_shard` granularity: embedding, each decoder layer,
// head (final norm + lm_head; the lm_head belongs to the embedding when tied).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/base/status.h"

namespace strata {

struct RopeScaling {
  std::string type;  // "" for none, or "llama3"
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

// The families strata computes, by their Hugging Face model_type.
enum class ModelFamily { llama, qwen2, qwen3, mistral, mixtral, qwen3_moe };

// "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe".
const char* model_family_name(ModelFamily family);
// The Hugging Face class of the family: "LlamaForCausalLM", "Qwen2ForCausalLM", ...
const char* model_family_architecture(ModelFamily family);

struct ModelConfig {
  std::string name;  // preset name or the config.json it came from
  ModelFamily family = ModelFamily::llama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  // Features of the families (all off for llama).
  bool qkv_bias = false;       // qwen2: q_proj, k_proj and v_proj have biases
  bool qk_norm = false;        // qwen3: RMSNorm (weights of head_dim) on each head of q and k
  int64_t sliding_window = 0;  // mistral: a query sees the last this-many keys; 0: all before it

  // Mixture of experts (mixtral, qwen3_moe); num_experts 0 for the dense families.
  int64_t num_experts = 0;            // E: num_local_experts (mixtral), num_experts (qwen3_moe)
  int64_t num_experts_per_tok = 0;    // k, the experts each token is routed to
  int64_t moe_intermediate_size = 0;  // each expert's I (mixtral: intermediate_size)
  bool norm_topk_prob = true;         // the k weights renormalised to sum to one
  int64_t decoder_sparse_step = 1;    // qwen3_moe: layer i is sparse when (i + 1) % step == 0
  std::vector<int64_t> mlp_only_layers;  // qwen3_moe: dense layers (intermediate_size) whatever the step
  // The load-balancing loss (transformers' load_balancing_loss_func) is
  // computed always; it joins the loss and its gradient, times the coefficient,
  // when output_router_logits is set (as transformers trains).
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;

  // Not a Hugging Face key: the units the embedding and the head are cut
  // into along the vocabulary (strata.vocab_chunks; 1, whole units). Chunk k
  // holds rows [vocab_chunk_begin(k), vocab_chunk_begin(k + 1)) of
  // embed_tokens and of lm_head; the final norm is the first head chunk's.
  int64_t vocab_chunks = 1;
  int64_t vocab_chunk_begin(int64_t chunk) const { return chunk * vocab_size / vocab_chunks; }
  // Not a Hugging Face key either: the units each decoder layer is cut into
  // (strata.layer_pieces): 1, whole layers; 2, its attention (input norm,
  // q, k, v, o and their extras) and its MLP (post-attention norm and the
  // MLP, or the router and the experts) as units of their own.
  int64_t layer_pieces = 1;
  // Not a Hugging Face key either: the pieces a sparse layer's MLP is cut
  // into when the layer is in pieces (strata.expert_groups): 1, one MLP
  // piece; G > 1, a router piece (the post-attention norm and the router)
  // and G pieces of experts, group g holding experts [expert_group_begin(g),
  // expert_group_begin(g + 1)). Dense layers keep their MLP piece.
  int64_t expert_groups = 1;
  int64_t expert_group_begin(int64_t group) const { return group * num_experts / expert_groups; }
  // Not a Hugging Face key either: the parts a dense layer's MLP piece is cut
  // into along its intermediate dimension (strata.mlp_parts; layers in
  // pieces): 1, one MLP piece; P > 1, part p holding rows [mlp_part_begin(p),
  // mlp_part_begin(p + 1)) of gate_proj and up_proj, the same columns of
  // down_proj, and (part 0) the post-attention norm. Sparse layers keep
  // their MLP piece or groups of experts.
  int64_t mlp_parts = 1;
  int64_t mlp_part_begin(int64_t part) const { return part * intermediate_size / mlp_parts; }

  bool is_moe() const { return num_experts > 0; }
  // Whether decoder layer `layer` has a router and experts (false for every
  // layer of a dense family).
  bool layer_is_sparse(int64_t layer) const;
  int64_t sparse_layer_count() const;

  // Parameters of decoder layer `layer`: q, k, v, o, the MLP (gate, up, down;
  // or the router and every expert's gate, up, down), the two norms, and the
  // q/k/v biases or q/k norms of the families that have them.
  int64_t layer_parameter_count(int64_t layer = 0) const;
  // The attention piece's share of it: input norm, q, k, v, o, biases, q/k norms.
  int64_t attention_parameter_count() const;
  // Parameters one token's forward reads in decoder layer `layer`: the
  // router and k experts of a sparse layer, the whole layer otherwise.
  int64_t layer_active_parameter_count(int64_t layer = 0) const;
  // Every parameter of the model, counted from the shapes (a tied lm_head once).
  int64_t parameter_count() const;
  // The parameters one token's forward reads (parameter_count for dense models).
  int64_t active_parameter_count() const;
};

// A unit's flat buffer is padded so that it splits into equal shards over the
// ranks, each a multiple of this many elements: 4 KiB in every 2-byte dtype
// (O_DIRECT needs aligned offsets and lengths; io/io_engine.h).
inline constexpr int64_t kShardAlignElements = 2048;

enum class UnitKind { embedding, decoder_layer, head };

// The part of a decoder layer a unit holds (ModelConfig::layer_pieces).
// (ModelConfig::expert_groups cuts a sparse layer's MLP into a router and
// groups of experts.)
// (ModelConfig::mlp_parts cuts a dense layer's MLP into parts.)
enum class LayerPiece { whole, attention, mlp, router, experts, mlp_part };

struct UnitShape {
  UnitKind kind = UnitKind::embedding;
  int64_t layer = -1;  // decoder layer index, -1 for embedding and head
  std::string name;    // "embedding", "layers.3", "head"; cut: "embedding.1", "head.0"
  int64_t numel = 0;   // parameters owned by the unit (the tied lm_head is the embedding's)
  int64_t chunk = -1;  // the vocabulary chunk of a cut embedding or head; -1: whole
  LayerPiece piece = LayerPiece::whole;  // a decoder layer's: "layers.3.attention", "layers.3.mlp"
  // A sparse layer's piece of experts: its group ("layers.3.experts.1"); -1 otherwise.
  int64_t expert_group = -1;
  // A dense layer's part of its MLP: its part ("layers.3.mlp.1"); -1 otherwise.
  int64_t mlp_part = -1;
};

// The units in forward order: embedding, layers.0 .. layers.{L-1}, head; with
// vocab_chunks K > 1, embedding.0 .. embedding.{K-1} and head.0 .. head.{K-1};
// with layer_pieces 2, layers.i.attention and layers.i.mlp for each layer;
// with expert_groups G > 1 a sparse layer's MLP is layers.i.router and
// layers.i.experts.0 .. layers.i.experts.{G-1}; with mlp_parts P > 1 a
// dense layer's MLP is layers.i.mlp.0 .. layers.i.mlp.{P-1}.
std::vector<UnitShape> model_units(const ModelConfig& config);

// OK for a dense model (num_experts 0), and for a mixture (mixtral or
// qwen3_moe) with experts of at least one row and 1 to num_experts per token.
Status check_mixture(const ModelConfig& config);

// OK when config.layer_pieces is 1 or 2; the message names strata.layer_pieces.
Status check_layer_pieces(const ModelConfig& config);

// OK when config.expert_groups is 1, or 2 to num_experts for a mixture in
// layer pieces; the message names strata.expert_groups.
Status check_expert_groups(const ModelConfig& config);

// OK when config.mlp_parts is 1, or 2 to intermediate_size for a model with
// a dense layer, in layer pieces; the message names strata.mlp_parts.
Status check_mlp_parts(const ModelConfig& config);

// Whether `unit`'s output is its input, bit for bit: a group of experts
// before the last and an MLP part between the first and the last add into
// the layer's chain (ExpertChain) and hand the normed rows on unchanged.
bool unit_passes_input(const ModelConfig& config, const UnitShape& unit);

// OK when config.vocab_chunks can cut this model: 1 to vocab_size chunks, and
// an untied lm_head when more than one (a tied head reads the embedding
// unit's whole table). The message names strata.vocab_chunks.
Status check_vocab_chunks(const ModelConfig& config);

// The names accepted by load_model_config as presets.
std::vector<std::string> model_preset_names();

// OK when a sequence of `seq_len` tokens is computed as the model defines it:
// mistral's sliding window must hold the whole sequence on the CUDA backend
// (whose attention kernels have no window); otherwise a one-line error naming
// the window and --seq-len.
Status check_sequence_window(const ModelConfig& config, int64_t seq_len);

// A preset ("tiny", "llama3.2-1b", ...), a path to a config.json, or a Hugging
// Face model directory holding config.json. Errors name the file and key.
Result<ModelConfig> load_model_config(const std::string& spec);

// Parses a Hugging Face config of a family above (LlamaConfig, Qwen2Config,
// Qwen3Config, MistralConfig); `origin` names it in errors.
Result<ModelConfig> model_config_from_json(const nlohmann::json& json, const std::string& origin);

// The Hugging Face config.json for this shape, with the family's model_type
// and architectures, so transformers loads it as that family.
nlohmann::json model_config_to_json(const ModelConfig& config);

}  // namespace strata
