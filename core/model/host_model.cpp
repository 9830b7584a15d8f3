// A whole model in host memory for one rank (core/model/model.h): its units'
// buffers, forward and backward over every unit, and Hugging Face checkpoints
// in and out.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/model/model.h"
#include "io/safe_write.h"

namespace strata {

// --- HostModel -----------------------------------------------------------------

UnitParams HostModel::unit_params(int64_t u) const {
  UnitParams p;
  p.flat = params[u].data();
  if (layout.units[u].unit.kind == UnitKind::head && layout.config.tie_word_embeddings) {
    p.tied_embedding = params[0].data();
  }
  return p;
}

UnitGrads HostModel::unit_grads(int64_t u) {
  UnitGrads g;
  g.flat = grads[u].data();
  if (layout.units[u].unit.kind == UnitKind::head && layout.config.tie_word_embeddings) {
    g.tied_embedding = grads[0].data();
  }
  return g;
}

namespace {
template <typename Buffers>
auto find_tensor(const ModelLayout& layout, Buffers& buffers, const std::string& name)
    -> decltype(buffers[0].data()) {
  const std::string target = name == "lm_head.weight" && layout.config.tie_word_embeddings
                                 ? "model.embed_tokens.weight"
                                 : name;
  for (size_t u = 0; u < layout.units.size(); ++u) {
    if (const TensorSlot* slot = layout.units[u].find(target))
      return slot->is_part() ? nullptr : buffers[u].data() + slot->offset;
  }
  return nullptr;
}
}  // namespace

const float* HostModel::tensor(const std::string& name) const {
  return find_tensor(layout, params, name);
}

float* HostModel::tensor_grad(const std::string& name) {
  return find_tensor(layout, grads, name);
}

HostModel make_host_model(const ModelConfig& config, int world_size) {
  HostModel model;
  model.layout = model_layout(config, world_size);
  for (const UnitLayout& unit : model.layout.units) {
    model.params.emplace_back(unit.padded_numel, 0.0f);
    model.grads.emplace_back(unit.padded_numel, 0.0f);
  }
  return model;
}

void init_host_model(HostModel& model, uint64_t seed, float init_std) {
  for (size_t u = 0; u < model.layout.units.size(); ++u) {
    init_unit_parameters(model.layout, static_cast<int64_t>(u), seed, model.params[u].data(),
                         init_std);
  }
}

void zero_host_grads(HostModel& model) {
  for (auto& g : model.grads) std::fill(g.begin(), g.end(), 0.0f);
}

std::vector<NamedTensor> checkpoint_tensors(const ModelLayout& layout) {
  // Hugging Face order: embeddings, layers, final norm, lm_head.
  std::vector<NamedTensor> list;
  for (size_t u = 0; u < layout.units.size(); ++u) {
    for (const TensorSlot& slot : layout.units[u].tensors)
      list.push_back({static_cast<int64_t>(u), &slot});
  }
  return list;
}

int64_t CheckpointTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<CheckpointTensor> checkpoint_tensor_groups(const ModelLayout& layout) {
  std::vector<CheckpointTensor> groups;
  for (const NamedTensor& t : checkpoint_tensors(layout)) {
    if (t.slot->is_part() && !groups.empty()) {
      auto same = std::find_if(groups.begin(), groups.end(),
                               [&](const CheckpointTensor& g) { return g.name == t.slot->name; });
      if (same != groups.end()) {
        same->parts.push_back(t);
        continue;
      }
    }
    groups.push_back({t.slot->name, t.slot->is_part() ? t.slot->fused_shape : t.slot->shape, {t}});
  }
  return groups;
}

const float* whole_tensor(const CheckpointTensor& t,
                          const std::function<const float*(int64_t)>& unit_data,
                          std::vector<float>& scratch) {
  if (t.parts.size() == 1 && !t.parts[0].slot->is_part())
    return unit_data(t.parts[0].unit) + t.parts[0].slot->offset;
  scratch.resize(size_t(t.numel()));
  for (const NamedTensor& part : t.parts) {
    const float* data = unit_data(part.unit) + part.slot->offset;
    const int64_t run = part.slot->run_numel();
    for (int64_t r = 0; r < part.slot->runs(); ++r)
      std::copy(data + r * run, data + (r + 1) * run, scratch.begin() + part.slot->run_first(r));
  }
  return scratch.data();
}

Status check_token_ids(const ModelConfig& config, const int32_t* ids, int64_t count,
                       bool allow_negative, const std::string& origin) {
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] >= config.vocab_size || (ids[i] < 0 && !allow_negative)) {
      return Status::error(
          fmt::format("{}: token id {} at position {} is outside the vocabulary [0, {})", origin,
                      ids[i], i, config.vocab_size));
    }
  }
  return Status::ok();
}

namespace {

Status check_batch(const HostModel& model, const UnitBatch& batch, const UnitWorkspace& ws) {
  if (batch.B != ws.B() || batch.T != ws.T()) {
    return Status::error(fmt::format("batch is {}x{} but the workspace was made for {}x{}", batch.B,
                                     batch.T, ws.B(), ws.T()));
  }
  const int64_t N = batch.B * batch.T;
  if (Status s = check_token_ids(model.layout.config, batch.tokens, N, false, "input tokens"); !s)
    return s;
  if (batch.targets != nullptr) {
    if (Status s = check_token_ids(model.layout.config, batch.targets, N, true, "targets"); !s)
      return s;
  }
  return Status::ok();
}

// Runs the forward of every unit, keeping each unit's input in `inputs` (L + 1 buffers).
double forward_all(const HostModel& model, const UnitBatch& batch, UnitWorkspace& ws,
                   std::vector<std::vector<float>>& inputs, float* logits) {
  const ModelLayout& layout = model.layout;
  const int64_t units = static_cast<int64_t>(layout.units.size());
  const int64_t NC = batch.B * batch.T * layout.config.hidden_size;
  inputs.assign(units - 1, std::vector<float>(NC));
  unit_forward(layout, 0, model.unit_params(0), batch, nullptr, inputs[0].data(), ws);
  for (int64_t u = 1; u + 1 < units; ++u) {
    unit_forward(layout, u, model.unit_params(u), batch, inputs[u - 1].data(), inputs[u].data(),
                 ws);
  }
  return unit_forward(layout, units - 1, model.unit_params(units - 1), batch,
                      inputs[units - 2].data(), logits, ws);
}

// A vocabulary-cut head's logits store, when the caller gave none.
void own_head_logits(const ModelConfig& config, UnitBatch& batch, std::vector<float>& own) {
  if (config.vocab_chunks <= 1 || batch.head_logits != nullptr) return;
  own.resize(size_t(batch.B * batch.T * config.vocab_size));
  batch.head_logits = own.data();
}

// A mixture cut into expert groups, or an MLP into parts: its chain, when
// the caller gave none.
void own_expert_chain(const ModelConfig& config, UnitBatch& batch, std::vector<float>& own) {
  if (!uses_expert_chain(config) || !batch.experts.empty()) return;
  own.resize(size_t(expert_chain_floats(config, batch.B * batch.T)));
  batch.experts = expert_chain_view(config, batch.B * batch.T, own.data());
}

}  // namespace

Result<double> model_forward(const HostModel& model, const UnitBatch& given, UnitWorkspace& ws,
                             float* logits) {
  if (Status s = check_batch(model, given, ws); !s) return s;
  RouterStats own;
  UnitBatch batch = given;
  if (model.layout.config.is_moe() && batch.router == nullptr) batch.router = &own;
  std::vector<float> own_logits;
  own_head_logits(model.layout.config, batch, own_logits);
  std::vector<float> own_chain;
  own_expert_chain(model.layout.config, batch, own_chain);
  std::vector<std::vector<float>> inputs;
  return forward_all(model, batch, ws, inputs, logits);
}

Result<double> model_forward_backward(HostModel& model, const UnitBatch& given, UnitWorkspace& ws,
                                      float* logits) {
  if (Status s = check_batch(model, given, ws); !s) return s;
  RouterStats own;
  UnitBatch batch = given;
  if (model.layout.config.is_moe() && batch.router == nullptr) batch.router = &own;
  if (batch.targets == nullptr) return Status::error("model_forward_backward needs targets");
  std::vector<float> own_logits;
  own_head_logits(model.layout.config, batch, own_logits);
  std::vector<float> own_chain;
  own_expert_chain(model.layout.config, batch, own_chain);
  const ModelLayout& layout = model.layout;
  const int64_t units = static_cast<int64_t>(layout.units.size());
  // Forward through the last layer keeping unit inputs; the head runs forward and
  // backward at once, then the layers and the embedding go backward.
  std::vector<std::vector<float>> inputs(
      units - 1, std::vector<float>(batch.B * batch.T * layout.config.hidden_size));
  unit_forward(layout, 0, model.unit_params(0), batch, nullptr, inputs[0].data(), ws);
  for (int64_t u = 1; u + 1 < units; ++u) {
    unit_forward(layout, u, model.unit_params(u), batch, inputs[u - 1].data(), inputs[u].data(),
                 ws);
  }
  std::vector<float> grad(inputs[0].size());
  const double loss_sum =
      head_forward_backward(layout, model.unit_params(units - 1), batch, inputs[units - 2].data(),
                            grad.data(), model.unit_grads(units - 1), ws, logits);
  for (int64_t u = units - 2; u >= 1; --u) {
    // The last layer's activations are still in the workspace (the head keeps its own).
    unit_backward(layout, u, model.unit_params(u), batch, inputs[u - 1].data(), grad.data(),
                  grad.data(), model.unit_grads(u), ws, /*recompute=*/u != units - 2);
  }
  unit_backward(layout, 0, model.unit_params(0), batch, nullptr, grad.data(), nullptr,
                model.unit_grads(0), ws);
  return loss_sum;
}

Status load_unit_parameters(const SafetensorsCheckpoint& checkpoint, const ModelLayout& layout,
                            int64_t u, float* flat) {
  for (const TensorSlot& slot : layout.units[u].tensors) {
    const bool fused =
        slot.is_part() || (!slot.fused_name.empty() && checkpoint.find(slot.name) == nullptr &&
                           checkpoint.find(slot.fused_name) != nullptr);
    if (!fused) {
      if (Status s = checkpoint.read_f32(slot.name, slot.shape, flat + slot.offset); !s) return s;
      continue;
    }
    const int64_t run = slot.run_numel();  // an MLP part's columns: one read per row
    for (int64_t r = 0; r < slot.runs(); ++r)
      if (Status s = checkpoint.read_f32(slot.fused_name, slot.fused_shape,
                                         flat + slot.offset + r * run, slot.run_first(r), run);
          !s)
        return s;
  }
  return Status::ok();
}

Status load_host_model(HostModel& model, const SafetensorsCheckpoint& checkpoint) {
  for (size_t u = 0; u < model.layout.units.size(); ++u) {
    Status s = load_unit_parameters(checkpoint, model.layout, static_cast<int64_t>(u),
                                    model.params[u].data());
    if (!s) return s;
  }
  return Status::ok();
}

Status write_model_config_json(const ModelConfig& model, const std::string& dir, DType dtype) {
  nlohmann::json config = model_config_to_json(model);
  config["torch_dtype"] = dtype == DType::f32    ? "float32"
                          : dtype == DType::bf16 ? "bfloat16"
                                                 : "float16";
  return io::write_file_atomically((std::filesystem::path(dir) / "config.json").string(),
                                   config.dump(2) + "\n");
}

Status save_host_model(const HostModel& model, const std::string& dir, DType dtype,
                       uint64_t max_shard_bytes, bool gradients) {
  const std::vector<CheckpointTensor> list = checkpoint_tensor_groups(model.layout);
  std::vector<TensorSpec> specs;
  for (const CheckpointTensor& t : list) specs.push_back({t.name, t.shape});
  const auto& buffers = gradients ? model.grads : model.params;
  std::vector<float> scratch;
  Status s = write_safetensors_checkpoint(dir, specs, dtype, max_shard_bytes, [&](size_t i) {
    return whole_tensor(
        list[i], [&](int64_t u) { return buffers[size_t(u)].data(); }, scratch);
  });
  if (!s) return s;
  return write_model_config_json(model.layout.config, dir, dtype);
  return Status::ok();
}

ExpertBlocks expert_blocks(const ModelLayout& model, int64_t u) {
  return model.units[size_t(u)].experts;
}

ExpertBlocks locate_experts(const ModelConfig& c, const UnitLayout& layout) {
  const UnitShape& unit = layout.unit;
  if (unit.kind != UnitKind::decoder_layer || unit.piece == LayerPiece::attention ||
      unit.piece == LayerPiece::router || !c.layer_is_sparse(unit.layer))
    return {};
  const bool group = unit.piece == LayerPiece::experts;
  const int64_t first = group ? c.expert_group_begin(unit.expert_group) : 0;
  const int64_t end = group ? c.expert_group_begin(unit.expert_group + 1) : c.num_experts;
  const std::string first_name = fmt::format(".experts.{}.", first);
  for (const TensorSlot& slot : layout.tensors) {
    if (slot.name.find(first_name) == std::string::npos) continue;
    return {slot.offset, 3 * c.moe_intermediate_size * c.hidden_size, end - first, first};
  }
  return {};
}

}  // namespace strata
