// The decoder model of every family (core/model/model_config.h) as units
// (core/README.md, model), computed on the CPU backend.
//
// Layout. Every unit (embedding, layers.i, head) keeps its parameters in one
// flat fp32 buffer. UnitLayout maps each Hugging Face tensor name to (offset,
// shape) inside that buffer and pads the buffer so that it splits into
// `world_size` equal shards whose size is a multiple of 4 KiB in every dtype
// (2048 elements). Padding is zero and never read. A decoder layer stores
// q, k, v, o, gate, up, down, then the two norms: q/k/v and gate/up sit next
// to each other and run as one matrix product each. The families' extras
// follow: the q, k, v biases (qwen2; adjacent, one bias of the fused product),
// then the q and k norms (qwen3; applied to each head before RoPE). A tied lm_head is the
// embedding unit's tensor: the head unit reads it through
// UnitParams::tied_embedding and adds into UnitGrads::tied_embedding.
// A sparse layer (mixture of experts) stores q, k, v, o, the router (E, C),
// then each expert's gate, up and down together (expert j's gate and up run
// as one product), then the norms and the extras, under the released
// checkpoints' names (mixtral: block_sparse_moe.gate, experts.j.w1 / w3 / w2;
// qwen3_moe: mlp.gate, mlp.experts.j.gate_proj / up_proj / down_proj).
//
// Mixture of experts. A sparse layer's router takes softmax(x W_r^T) in fp32,
// each token its top k experts (ties to the lower index) with those
// probabilities as weights, renormalised to sum to one when norm_topk_prob;
// the layer's MLP output is the weighted sum of the k experts' SwiGLU outputs
// in the order of the experts' indices. The load-balancing loss of a
// micro-batch is transformers' load_balancing_loss_func over its sparse
// layers: E sum_e (a_e / R) (P_e / R), with a_e the token-expert assignments
// and P_e the router probabilities summed over the tokens of every sparse
// layer and R the tokens times the sparse layers; its gradient reaches each
// router through P_e (a_e counts, which have none).
//
// Computation. unit_forward and unit_backward take a unit's gathered flat
// parameters, so an engine can gather and release units one at a time. Only a
// unit's input is kept between forward and backward (per-unit activation
// checkpointing): unit_backward recomputes the unit's forward from that input.
// Parameter gradients accumulate (+=) so micro-batches add up; the gradient
// with respect to a unit's input is overwritten (=).
//
// Initialisation is a function of (seed, tensor name, element index) only, so
// a model starts identical for any world size or sharding.
//
// Thread-safety: layouts are values. A UnitWorkspace is scratch memory for one
// caller at a time; unit functions use TBB and OpenBLAS inside.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/checkpoint/safetensors.h"
#include "core/model/model_config.h"
#include "io/base/status.h"
#include "kernels/cpu/attention.h"

namespace strata {

struct TensorSlot {
  std::string name;            // Hugging Face name: "model.layers.3.self_attn.q_proj.weight"
  int64_t offset = 0;          // elements from the start of the unit's flat buffer
  std::vector<int64_t> shape;  // Hugging Face shape, [out, in] for projections
  int64_t numel = 0;
  bool weight_decay = false;  // 2-D tensors decay; norm weights do not (core/optimizer/optimizer.h)
  // An expert's tensor also reads from the layout transformers 5 keeps in
  // memory and may save: elements [fused_first, fused_first + numel) of
  // `fused_name` of `fused_shape` (mlp.experts.gate_up_proj (E, 2 I, C),
  // mlp.experts.down_proj (E, C, I), mixtral's router as mlp.gate.weight).
  // A vocabulary chunk's embed_tokens or lm_head (ModelConfig::vocab_chunks)
  // is a part of the tensor of its own name: fused_name is `name`, and its
  // rows are elements [fused_first, fused_first + numel) of it.
  // A part of a dense MLP (ModelConfig::mlp_parts) holds rows of gate_proj
  // and up_proj that way, and columns of down_proj: `columns` set, its row r
  // is elements [fused_first + r W, fused_first + r W + shape[1]) of the
  // tensor of W = fused_shape[1] columns.
  std::string fused_name;
  std::vector<int64_t> fused_shape;
  int64_t fused_first = 0;
  bool columns = false;
  bool is_part() const { return !fused_name.empty() && fused_name == name; }
  // A part's runs of adjacent elements in the whole tensor: run r is the
  // slot's elements [r run_numel(), (r + 1) run_numel()), which start at
  // element run_first(r) of the tensor (one run, unless `columns`).
  int64_t runs() const { return columns ? shape[0] : 1; }
  int64_t run_numel() const { return columns ? shape[1] : numel; }
  int64_t run_first(int64_t r) const {
    return fused_first + (columns ? r * fused_shape[1] : r * numel);
  }
  // The element of the whole tensor that a part's element i is.
  int64_t part_element(int64_t i) const { return run_first(i / run_numel()) + i % run_numel(); }
};

// The experts of a sparse layer's unit (whole, its MLP piece, or a piece of
// experts): its expert e (the layer's expert first + e) has its gate, up
// and down at elements [offset + e numel, offset + (e + 1) numel) of the
// unit's flat buffer; count 0 for any other unit (a router piece too).
struct ExpertBlocks {
  int64_t offset = 0;
  int64_t numel = 0;
  int64_t count = 0;
  int64_t first = 0;  // the layer's index of the unit's expert 0
};

struct UnitLayout {
  UnitShape unit;
  std::vector<TensorSlot> tensors;  // in flat-buffer order
  int64_t numel = 0;                // parameters, without padding
  int64_t padded_numel = 0;         // a multiple of world_size * kShardAlignElements
  int64_t shard_numel = 0;          // padded_numel / world_size
  ExpertBlocks experts;             // locate_experts(config, *this), kept by model_layout
  const TensorSlot* find(const std::string& name) const;
};

// Shards are multiples of kShardAlignElements (core/model/model_config.h).

struct ModelLayout {
  ModelConfig config;
  int world_size = 1;
  std::vector<UnitLayout> units;  // forward order: embedding, layers.0 .., head
};

ModelLayout model_layout(const ModelConfig& config, int world_size = 1);

// Writes the initial parameters of unit `u` (padding zero): projections and
// embeddings ~ N(0, init_std) (Hugging Face's initializer_range 0.02), norms 1,
// biases 0.
void init_unit_parameters(const ModelLayout& model, int64_t u, uint64_t seed, float* flat,
                          float init_std = 0.02f);

// The value of element `index` of tensor `name` for `seed` before scaling by std.
float init_normal(uint64_t seed, const std::string& name, int64_t index);

// The attention shape of a decoder layer at (B, T): q, k and v heads packed
// in fused qkv rows of (H + 2 KV) * D elements. Shared by both backends.
kernels::cpu::AttentionShape layer_attention_shape(const ModelConfig& config, int64_t B, int64_t T);

// The rotary embedding's fp32 tables for positions [0, T): cos and sin (T, D/2),
// with the model's theta and rope_scaling. Shared by both backends.
void rope_tables(const ModelConfig& config, int64_t T, float* cos, float* sin);

// The lm_head rows of a head unit (the whole table, or its chunk's rows); null
// for a tied head, which reads UnitParams::tied_embedding.
const TensorSlot* lm_head_slot(const UnitLayout& head);

// A unit's gathered parameters and where its gradients accumulate.
struct UnitParams {
  const float* flat = nullptr;            // (padded_numel) in UnitLayout order
  const float* tied_embedding = nullptr;  // head of a tied model: (V, C) of the embedding unit
};
struct UnitGrads {
  float* flat = nullptr;  // (padded_numel), +=
  float* tied_embedding =
      nullptr;  // head of a tied model: (V, C) of the embedding unit's grads, +=
};

// The load-balancing statistics of one micro-batch (mixture of experts),
// gathered by its sparse layers' forwards: each adds its tokens.
struct RouterStats {
  std::vector<double> assigned;  // (E) token-expert assignments over the sparse layers
  std::vector<double> prob_sum;  // (E) router probabilities summed over tokens and layers
  double rows = 0;               // tokens times sparse layers forwarded
  void reset(int64_t experts);
  // A sparse layer's forward over N tokens: expert_begin (E + 1) of its
  // grouped rows (group_routed_rows), prob_sums (E) its probabilities summed
  // over the tokens.
  void add(const int64_t* expert_begin, const double* prob_sums, int64_t N);
  // E sum_e (assigned_e / rows) (prob_sum_e / rows); 0 before any sparse layer.
  double aux_loss() const;
};

// What the pieces of a sparse layer cut into expert groups
// (ModelConfig::expert_groups > 1) hand each other within one micro-batch:
// views of one buffer of expert_chain_floats(config, N) floats (int32 and
// float alike 4 bytes). The pieces of a layer run in plan order for a
// micro-batch (router, experts.0 .. experts.{G-1}; backwards the other way)
// and a micro-batch's layers one after another, so one chain per kept
// micro-batch serves every layer.
struct ExpertChain {
  // (N, C): in the forward the layer's residual x2 (from the router piece to
  // the last group); in the backward the layer's output gradient (from the
  // last group to the others and the router piece).
  float* rows = nullptr;
  float* sum = nullptr;       // (N, C): the weighted expert outputs added so far (forward)
  float* d_weight = nullptr;  // (N, K): each slot's weight's gradient (the groups' backwards)
  // (sparse layers, N, K): each token's k experts and weights, written by
  // the router piece's forward and read by its groups' forwards and
  // backwards (the router's backward computes them again, the same bits).
  int32_t* top_expert = nullptr;
  float* top_weight = nullptr;
  bool empty() const { return rows == nullptr; }
};
// A dense layer's MLP cut into parts (ModelConfig::mlp_parts) hands on the
// same rows and sum (the residual x2, then the layer's output gradient; the
// down products added so far), and nothing else.
int64_t expert_chain_floats(const ModelConfig& config, int64_t N);
// Whether a micro-batch of this model needs a chain: expert groups or MLP parts.
bool uses_expert_chain(const ModelConfig& config);
ExpertChain expert_chain_view(const ModelConfig& config, int64_t N, float* buffer);
// Layer `layer`'s index among the sparse layers before it (its routing's
// place in ExpertChain::top_expert and top_weight).
int64_t sparse_layer_index(const ModelConfig& config, int64_t layer);

// One micro-batch: B sequences of T tokens.
struct UnitBatch {
  const int32_t* tokens = nullptr;   // (B, T), inputs of the embedding unit, in [0, V)
  const int32_t* targets = nullptr;  // (B, T), for the head; < 0 is ignored
  int64_t B = 0;
  int64_t T = 0;
  // Head backward: d(objective)/d(each token's loss); 1 / (tokens in the global batch)
  // for the mean loss over the global batch (core/README.md, model).
  float loss_scale = 1.0f;
  // Mixture of experts: the micro-batch's router statistics. The embedding's
  // forward resets them, each sparse layer's forward adds to them, each
  // sparse layer's backward reads them (every forward of a micro-batch runs
  // before its first backward, in both schedules). Null: the forwards gather
  // nothing and the backwards take no load-balancing gradient.
  RouterStats* router = nullptr;
  // d(objective)/d(this micro-batch's load-balancing loss): the coefficient
  // over the micro-batches of the global batch (times the fp16 loss scale)
  // when the loss includes it (output_router_logits), else 0.
  float aux_loss_scale = 0.0f;
  // A head cut along the vocabulary (ModelConfig::vocab_chunks > 1): this
  // micro-batch's logits, (N, V) chunk after chunk, each chunk's (N, rows)
  // block. Each head chunk's forward writes its block; the last chunk's
  // forward reads every block for the loss, its backward (the one pass)
  // turns every block into the logits' gradient, which the other chunks'
  // backwards read. Null for a whole head; a cut one needs it.
  float* head_logits = nullptr;
  // A mixture cut into expert groups, or a dense MLP into parts: the
  // micro-batch's chain (ExpertChain); empty otherwise, where a cut one needs it.
  ExpertChain experts = {};
};

// Scratch for the forward and backward of any unit at one (B, T).
class UnitWorkspace {
 public:
  UnitWorkspace(const ModelConfig& config, int64_t B, int64_t T);
  int64_t B() const { return B_; }
  int64_t T() const { return T_; }
  // Bytes a workspace for (config, B, T) holds, for memory plans.
  static int64_t bytes_for(const ModelConfig& config, int64_t B, int64_t T);

 private:
  friend struct UnitKernels;
  friend struct VocabChunkKernels;
  friend struct MoeKernels;
  friend struct MlpPartKernels;
  int64_t B_, T_;
  std::vector<float> rope_cos, rope_sin;  // (T, D/2)
  // Decoder layer activations (N = B*T), recomputed in the backward.
  std::vector<float> xn1, rstd1;  // (N, C), (N)
  std::vector<float> qkv;         // (N, (H + 2 KV) D), q and k rotated
  std::vector<float> probs;       // (B, H, T, T)
  std::vector<float> attn;        // (N, H D)
  std::vector<float> x2;          // (N, C) residual after attention
  std::vector<float> xn2, rstd2;  // (N, C), (N)
  std::vector<float> gate_up;     // (N, 2 I)
  std::vector<float> mlp;         // (N, I)
  // Backward scratch.
  std::vector<float> d_mlp, d_gate_up, d_xn, d_attn, d_qkv, d_scores;
  // Per-head q/k norms (qk_norm only): their inputs and rstd, and two (N * heads, D) scratches.
  std::vector<float> q_raw, k_raw;    // (N, H, D), (N, KV, D)
  std::vector<float> q_rstd, k_rstd;  // (N * H), (N * KV)
  std::vector<float> heads, d_heads;  // (N * max(H, KV), D)
  // Head: its own norm output (so a layer's activations survive it), logits of a
  // block of rows, the per-token losses.
  // Sparse layers (N K routed rows, grouped by expert): the router's logits,
  // then probabilities, and their gradient (N, E); each token's k experts and
  // weights and their gradient (N, K); the routed rows' expert, by expert, and
  // where each expert's rows begin (E + 1); the rows' inputs, gate_up,
  // SwiGLU outputs and expert outputs (then their weighted gradient), and the
  // inputs' and gate_up's gradients.
  std::vector<float> router_probs, d_router;
  std::vector<int32_t> top_expert, row_of;  // (N, K): expert; (N, K): routed row of (n, k)
  std::vector<float> top_weight, d_top_weight;
  std::vector<int64_t> expert_begin;  // (E + 1)
  std::vector<int32_t> row_token;     // (N K): the token of each routed row
  std::vector<float> moe_x, moe_gate_up, moe_act, moe_y, d_moe_x, d_moe_gate_up, d_moe_act;
  std::vector<float> head_xn, head_rstd;  // (N, C), (N)
  std::vector<float> logits;              // (head_rows, V)
  std::vector<float> losses;              // (N)
  int64_t head_rows = 0;
};

// Forward of unit `u`.
//  embedding: output (B, T, C) = embeddings of batch.tokens; input unused.
//  layer:     output (B, T, C) from input (B, T, C).
//  head:      input (B, T, C); writes logits (B, T, V) to `output` unless null.
// Returns the sum of the token losses for the head (needs batch.targets), 0 otherwise.
// Cut along the vocabulary (ModelConfig::vocab_chunks), every chunk but the
// last is a unit with an input and an output (B, T, C) like a layer's:
//  embedding.k: output = input (none for k = 0: zeros) with the rows of the
//               tokens in chunk k's range set, so the last chunk's output is
//               the whole embedding's, bit for bit;
//  head.0:      output = the final norm of input; its logits block written;
//  head.k:      output = input (the normed rows); its logits block written;
//  the last head chunk is the head: its loss reads every block.
// Backward: embedding.k adds its rows' gradients and passes doutput on;
// head.k (not the last) adds its block's product to the gradient of the
// normed rows that doutput carries (head.0 then takes it through the final
// norm into dinput); the last chunk's pass starts that gradient. The
// embedding's gradients and the head's logits, loss and lm_head gradients are
// the whole units' bits on the reference products (kernels/cpu/gemm.h); the
// normed rows' gradient sums over the chunks in another order (chunk K-1
// first, the whole head's sum in vocabulary order), within the bound that
// core/README.md ("vocabulary chunks") derives.
// Cut into expert groups (ModelConfig::expert_groups), a sparse layer's
// router piece outputs the normed rows of its input, each piece of experts
// passes them on and the last outputs the layer's output; backward, each
// piece of experts passes on the normed rows' gradient with its experts'
// part added, and the router piece turns it into its input's gradient.
// They hand the rest over in UnitBatch::experts, which a cut layer needs
// (core/model/moe_kernels.h).
// Cut into MLP parts (ModelConfig::mlp_parts), a dense layer's part 0 takes
// x2 and outputs the normed rows, the later parts pass them on and the last
// outputs the layer's output; backward, each passes on the normed rows'
// gradient with its part added, and part 0 turns it into its input's
// gradient; the chain carries x2 and the down products' sum
// (core/model/mlp_part_kernels.h).
double unit_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                    const UnitBatch& batch, const float* input, float* output, UnitWorkspace& ws);

// Backward of unit `u`, recomputing its forward from `input` (the checkpoint).
//  embedding: grads += from doutput (B, T, C); dinput unused.
//  layer:     dinput (B, T, C) = from doutput (B, T, C); dinput may alias doutput.
//  head:      dinput (B, T, C) = from the loss (batch.targets, batch.loss_scale); doutput unused.
// Parameter gradients accumulate (+=) into `grads`. A layer may skip the
// recomputation (recompute = false) only when `ws` still holds its activations:
// its unit_forward, with the same parameters and input, was the last layer
// forward on `ws` (head_forward_backward leaves them alone).
void unit_backward(const ModelLayout& model, int64_t u, const UnitParams& params,
                   const UnitBatch& batch, const float* input, const float* doutput, float* dinput,
                   const UnitGrads& grads, UnitWorkspace& ws, bool recompute = true);

// The head's forward and backward in one pass (it is the last unit, so its
// backward follows its forward at once and nothing is recomputed): returns the
// sum of token losses; dinput (B, T, C) =; gradients +=; logits (B, T, V)
// written unless null.
double head_forward_backward(const ModelLayout& model, const UnitParams& params,
                             const UnitBatch& batch, const float* input, float* dinput,
                             const UnitGrads& grads, UnitWorkspace& ws, float* logits = nullptr);

// --- a whole model in host memory, for one rank (tests, tools, benchmarks) ------

struct HostModel {
  ModelLayout layout;
  std::vector<std::vector<float>> params;  // per unit, (padded_numel)
  std::vector<std::vector<float>> grads;   // per unit, (padded_numel)

  UnitParams unit_params(int64_t u) const;
  UnitGrads unit_grads(int64_t u);
  // Pointer to a tensor by Hugging Face name (lm_head.weight of a tied model
  // is the embedding); null for a vocabulary-cut tensor, which has parts.
  const float* tensor(const std::string& name) const;
  float* tensor_grad(const std::string& name);
};

HostModel make_host_model(const ModelConfig& config, int world_size = 1);
void init_host_model(HostModel& model, uint64_t seed, float init_std = 0.02f);
void zero_host_grads(HostModel& model);

// Every tensor of the model as it is stored in Hugging Face checkpoints, in unit
// order (lm_head.weight only when untied), with the unit and slot it lives in.
struct NamedTensor {
  int64_t unit = 0;
  const TensorSlot* slot = nullptr;
};
// (A vocabulary-cut tensor is listed once per chunk, each its part.)
std::vector<NamedTensor> checkpoint_tensors(const ModelLayout& layout);

// The same tensors whole, as a checkpoint stores them: each with its parts in
// row order (one slot, or a vocabulary-cut tensor's chunks).
struct CheckpointTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<NamedTensor> parts;
  int64_t numel() const;
};
std::vector<CheckpointTensor> checkpoint_tensor_groups(const ModelLayout& layout);
// Tensor `t` from the units' flat buffers (unit_data(u) is unit u's): its one
// part's own elements, or its parts copied one after another into `scratch`.
const float* whole_tensor(const CheckpointTensor& t,
                          const std::function<const float*(int64_t)>& unit_data,
                          std::vector<float>& scratch);

// Unit u's experts (UnitLayout::experts: found once, when the layout is made,
// since the planner asks for them per expert and operation).
ExpertBlocks expert_blocks(const ModelLayout& model, int64_t u);
// Where a unit's experts lie, found from its tensors' names.
ExpertBlocks locate_experts(const ModelConfig& config, const UnitLayout& unit);

// The experts unit u (a sparse layer's, whole or its MLP piece) routes the
// micro-batch's tokens to: [E], 1 for each expert that gets a token. The
// same routing its unit_forward computes from `input` and `params`, which
// it leaves in `ws` as a forward would.
std::vector<uint8_t> routed_experts(const ModelLayout& model, int64_t u, const UnitParams& params,
                                    const float* input, UnitWorkspace& ws);

// The experts of piece of experts u (LayerPiece::experts) that its
// micro-batch's N tokens are routed to: [E], 1 for each of the piece's
// experts that gets a token, 0 elsewhere, from the routing the layer's
// router piece left in `chain` (its forward runs first).
std::vector<uint8_t> chain_routed_experts(const ModelLayout& model, int64_t u,
                                          const ExpertChain& chain, int64_t N);
// The same from the layer's routing alone: chosen (N, K), each token's experts.
std::vector<uint8_t> group_routed_experts(const ModelLayout& model, int64_t u,
                                          const int32_t* chosen, int64_t N);

// A sparse layer's N K routed rows grouped by expert (by token within an
// expert), from each token's K chosen experts top_expert (N, K) in [0, E):
// expert_begin (E + 1) where each expert's rows begin, row_of (N, K) the
// row of token n's k-th slot, row_token (N K) the token of each row. Both
// backends group this way (the CUDA backend on the host).
void group_routed_rows(const int32_t* top_expert, int64_t N, int64_t K, int64_t E,
                       int64_t* expert_begin, int32_t* row_of, int32_t* row_token);

// The load-balancing loss's gradient to each router probability of a
// sparse layer, scale E a_e / R^2 (RouterStats): (E), or empty when the
// batch takes none (no statistics, or aux_loss_scale 0).
std::vector<float> router_aux_grad(const ModelConfig& config, const UnitBatch& batch);

// Checks that tokens lie in [0, V) and targets in [-inf, V): the message names `origin`.
Status check_token_ids(const ModelConfig& config, const int32_t* ids, int64_t count,
                       bool allow_negative, const std::string& origin);

// Forward and backward of every unit over one micro-batch, keeping only unit
// inputs between the two. Gradients accumulate (+=) into model.grads. Returns
// the sum of token losses; `logits` (B, T, V) is filled when not null.
// A mixture of experts gathers its router statistics into batch.router, or
// into its own when that is null; the load-balancing gradient follows
// batch.aux_loss_scale.
Result<double> model_forward_backward(HostModel& model, const UnitBatch& batch, UnitWorkspace& ws,
                                      float* logits = nullptr);
// Forward only: the sum of token losses (and the logits when not null).
Result<double> model_forward(const HostModel& model, const UnitBatch& batch, UnitWorkspace& ws,
                             float* logits = nullptr);

// Loads the tensors of unit `u` into its flat buffer (padding left untouched),
// so an engine can load a checkpoint one unit at a time. A tied head reads
// nothing beyond model.norm.weight. Experts read from the released names or,
// when those are absent, transformers 5's fused tensors (TensorSlot::fused_name).
Status load_unit_parameters(const SafetensorsCheckpoint& checkpoint, const ModelLayout& layout,
                            int64_t u, float* flat);

// Loads every tensor from a checkpoint (F32/BF16/F16 converted to fp32). A tied
// model ignores a stored lm_head.weight; an untied one requires it.
Status load_host_model(HostModel& model, const SafetensorsCheckpoint& checkpoint);

// Writes the parameters (or, with `gradients`, the gradients under the same
// names) as a Hugging Face checkpoint directory: config.json plus safetensors
// (sharded above max_shard_bytes).
// Writes <dir>/config.json (Hugging Face's, with torch_dtype) through a temporary name.
Status write_model_config_json(const ModelConfig& model, const std::string& dir, DType dtype);

Status save_host_model(const HostModel& model, const std::string& dir, DType dtype,
                       uint64_t max_shard_bytes = 5ull << 30, bool gradients = false);

}  // namespace strata
