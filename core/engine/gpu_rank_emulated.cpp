// GpuRank::create_emulated: GpuRank's calls on host memory, computed by the
// CPU units, so the engine's GPU data paths run where no GPU is.
#include <algorithm>
#include <cstring>
#include <vector>

#include "core/engine/gpu_rank.h"
#include "core/model/model.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/simd.h"

namespace strata {
namespace {

using kernels::cpu::ElementType;

class EmulatedGpuRank final : public GpuRank {
 public:
  explicit EmulatedGpuRank(const TrainingPlan& plan)
      : plan_(plan),
        N_(plan.tokens_per_micro),
        ws_(plan.input.model, plan.input.micro_batch, plan.input.seq_len) {
    const int64_t C = plan.input.model.hidden_size;
    int64_t largest_padded = 0, largest_optimizer = 0;
    for (const UnitPlacement& p : plan.units) {
      largest_padded = std::max(largest_padded, p.padded_numel);
      largest_optimizer = std::max(largest_optimizer, p.optimizer_numel);
    }
    const int copies = plan.activation_copies();
    saved_inputs_.resize(size_t(plan.saved_input_copies()) * size_t(plan.saved_input_levels()) *
                        size_t(N_ * C));
    activation_grad_.resize(size_t(copies) * size_t(N_ * C));
    tokens_.resize(size_t(N_ * plan.input.grad_accum));
    targets_.resize(tokens_.size());
    for (auto& w : widened_) w.resize(size_t(largest_padded));
    if (plan.input.model.vocab_chunks > 1)
      head_logits_.resize(size_t(copies) * size_t(N_ * plan.input.model.vocab_size));
    if (uses_expert_chain(plan.input.model))
      expert_chains_.resize(size_t(copies) * size_t(expert_chain_floats(plan.input.model, N_)));
    if (!plan.gpu_grads_in_place()) {
      grads_.resize(size_t(largest_padded));
      if (plan.gpu_grads_summed_on_device()) grad_sum_.resize(size_t(largest_padded));
      if (plan.tied_grad_buffer)
        tied_grads_.resize(size_t(copies) * size_t(plan.units[0].padded_numel));
    }
    if (plan.homes.optimizer == tiers::Tier::device && plan.homes.param != tiers::Tier::device &&
        plan.compute_bytes != 4)
      new_params_.resize(size_t(largest_optimizer * plan.compute_bytes));
  }

  Status forward(int unit, int micro, const std::byte* params, const UnitBatch& host) override {
    if (unit == 0) {
      std::memcpy(tokens_.data() + micro * N_, host.tokens, size_t(N_) * 4);
      std::memcpy(targets_.data() + micro * N_, host.targets, size_t(N_) * 4);
    }
    UnitParams p;
    p.flat = widen(unit, params, 0);
    const float* input = unit == 0 ? nullptr : saved_input_at(unit - 1, micro);
    unit_forward(plan_.layout, unit, p, batch(micro, host), input, saved_input_at(unit, micro),
                 ws_);
    return Status::ok();
  }

  Result<double> head(int micro, const std::byte* params, const std::byte* tied_params,
                      const UnitBatch& host, const GradTarget& target) override {
    const int head = int(plan_.units.size()) - 1;
    UnitParams p;
    p.flat = widen(head, params, 0);
    if (tied_params != nullptr) p.tied_embedding = widen(0, tied_params, 1);
    const int64_t numel = plan_.units[size_t(head)].padded_numel;
    const int64_t tied_numel = plan_.units[0].padded_numel;
    UnitGrads g;
    if (plan_.gpu_grads_in_place()) {
      g.flat = target.grads;
      g.tied_embedding = tied_params != nullptr ? target.tied : nullptr;
      if (target.zero_first) {
        std::fill_n(g.flat, numel, 0.0f);
        if (g.tied_embedding != nullptr) std::fill_n(g.tied_embedding, tied_numel, 0.0f);
      }
    } else {
      g.flat = grads_.data();
      std::fill_n(g.flat, numel, 0.0f);
      if (tied_params != nullptr) {
        g.tied_embedding = tied_grads(plan_.activation_copy(micro));
        std::fill_n(g.tied_embedding, tied_numel, 0.0f);
      }
    }
    const double loss =
        head_forward_backward(plan_.layout, p, batch(micro, host), saved_input_at(head - 1, micro),
                              activation_grad(micro), g, ws_);
    if (!plan_.gpu_grads_in_place()) send(g.flat, numel, target);
    return loss;
  }

  Status backward(int unit, int micro, const std::byte* params, const UnitBatch& host,
                  bool recompute, const GradTarget& target) override {
    const int64_t numel = plan_.units[size_t(unit)].padded_numel;
    const bool embedding = plan_.layout.units[size_t(unit)].unit.kind == UnitKind::embedding;
    if (params == nullptr && !embedding)
      return Status::error("emulated GPU: no parameters for a layer's backward");
    UnitParams p;
    // The embedding's backward reads only the tokens and the gradient.
    p.flat = params != nullptr ? widen(unit, params, 0) : widened_[0].data();
    UnitGrads g;
    if (plan_.gpu_grads_in_place()) {
      g.flat = target.grads;
      if (target.zero_first) std::fill_n(g.flat, numel, 0.0f);
    } else if (target.slot < 0) {
      g.flat = tied_grads(-1 - target.slot);  // the head left the lm_head's gradient here
    } else {
      g.flat = grads_.data();
      std::fill_n(g.flat, numel, 0.0f);
    }
    const float* input = unit == 0 ? nullptr : saved_input_at(unit - 1, micro);
    float* dy = activation_grad(micro);
    unit_backward(plan_.layout, unit, p, batch(micro, host), input, dy, unit == 0 ? nullptr : dy, g,
                  ws_, recompute);
    if (!plan_.gpu_grads_in_place()) send(g.flat, numel, target);
    return Status::ok();
  }

  Result<std::vector<uint8_t>> routed_experts(int unit, int micro,
                                              const std::byte* params) override {
    // A piece of experts takes the routing its router piece left in the chain.
    if (plan_.layout.units[size_t(unit)].unit.piece == LayerPiece::experts)
      return chain_routed_experts(plan_.layout, unit, batch(micro, {}).experts, N_);
    UnitParams p;
    p.flat = widen(unit, params, 0);
    return strata::routed_experts(plan_.layout, unit, p, saved_input_at(unit - 1, micro), ws_);
  }
  // Nothing is uploaded: the next computation widens the host copy whole.
  Status take_gathered_range(int, const std::byte*, int64_t, int64_t) override {
    return Status::ok();
  }

  std::byte* saved_input(int level, int micro) override {
    return reinterpret_cast<std::byte*>(saved_input_at(level, micro));
  }
  Status gradients_ready(int) override { return Status::ok(); }
  // Nothing is uploaded: the computations read host memory.
  void forget_uploads(const std::byte*) override {}
  Status synchronize() override { return Status::ok(); }

  Status download(void* host, const void* device, int64_t bytes) override {
    std::memcpy(host, device, size_t(bytes));
    return Status::ok();
  }
  Status upload(void* device, const void* host, int64_t bytes) override {
    std::memcpy(device, host, size_t(bytes));
    return Status::ok();
  }
  Status accumulate(float* device, const float* host, int64_t numel, bool first) override {
    if (first) {
      std::memcpy(device, host, size_t(numel) * 4);
    } else {
      for (int64_t i = 0; i < numel; ++i) device[i] += host[i];
    }
    return Status::ok();
  }
  Result<kernels::cpu::GradNormPartial> grad_norm(const float* grads, int64_t numel) override {
    return kernels::cpu::grad_norm_squared(grads, ElementType::f32, numel);
  }
  Status adamw(const kernels::cpu::AdamWShard& shard,
               const kernels::cpu::AdamWHyperparams& hyper) override {
    // As the GPU: the kernel writes bf16 and fp16 copies, an fp32 copy is the master.
    const bool copies_master = shard.copy != nullptr && shard.copy_type == ElementType::f32;
    kernels::cpu::AdamWShard kernel_shard = shard;
    if (copies_master) kernel_shard.copy = nullptr;
    if (Status s = kernels::cpu::adamw_step(kernel_shard, hyper); !s) return s;
    if (copies_master) std::memcpy(shard.copy, shard.master, size_t(shard.numel) * 4);
    return Status::ok();
  }
  std::byte* new_parameter_buffer() const override {
    return new_params_.empty() ? nullptr : const_cast<std::byte*>(new_params_.data());
  }

 private:
  // A fresh gradient to the host, or into the sum over the micro-batches
  // (added in fp32 in micro-batch order, as the host would), which goes down
  // after the last.
  void send(const float* fresh, int64_t numel, const GradTarget& target) {
    if (!target.sum_on_device) {
      std::memcpy(target.grads, fresh, size_t(numel) * 4);
      return;
    }
    if (target.sum_first)
      std::memcpy(grad_sum_.data(), fresh, size_t(numel) * 4);
    else
      for (int64_t i = 0; i < numel; ++i) grad_sum_[size_t(i)] += fresh[i];
    if (target.send) std::memcpy(target.grads, grad_sum_.data(), size_t(numel) * 4);
  }

  // The slot of each level a micro-batch keeps to its backward
  // (TrainingPlan::saved_input_place), and copy activation_copy(micro) of the rest.
  float* saved_input_at(int unit, int micro) {
    const int64_t C = plan_.input.model.hidden_size;
    const TrainingPlan::SavedInputPlace place = plan_.saved_input_place(unit, micro);
    return saved_inputs_.data() + (place.copy * plan_.saved_input_levels() + place.level) * N_ * C;
  }
  float* activation_grad(int micro) {
    return activation_grad_.data() +
           plan_.activation_copy(micro) * N_ * plan_.input.model.hidden_size;
  }
  float* tied_grads(int copy) {
    return tied_grads_.data() + int64_t(copy) * plan_.units[0].padded_numel;
  }
  // The micro-batch as the device holds it: its ids, the head's logits
  // store and the pieces' chain; the loss scale and a mixture's router statistics (host memory on
  // a GPU too) are the engine's.
  UnitBatch batch(int micro, const UnitBatch& host) {
    UnitBatch b;
    b.tokens = tokens_.data() + micro * N_;
    b.targets = targets_.data() + micro * N_;
    b.B = plan_.input.micro_batch;
    b.T = plan_.input.seq_len;
    b.loss_scale = host.loss_scale;
    b.router = host.router;
    b.aux_loss_scale = host.aux_loss_scale;
    if (!head_logits_.empty())
      b.head_logits = head_logits_.data() +
                      int64_t(plan_.activation_copy(micro)) * N_ * plan_.input.model.vocab_size;
    if (!expert_chains_.empty()) {
      const int64_t floats = expert_chain_floats(plan_.input.model, N_);
      b.experts = expert_chain_view(plan_.input.model, N_,
                                    expert_chains_.data() + plan_.activation_copy(micro) * floats);
    }
    return b;
  }
  // Unit `unit`'s compute-precision parameters in fp32 (buffer `which`).
  const float* widen(int unit, const std::byte* params, int which) {
    std::vector<float>& out = widened_[size_t(which)];
    kernels::cpu::widen_to_float(params, plan_.compute_type(), out.data(),
                                 plan_.units[size_t(unit)].padded_numel);
    return out.data();
  }

  const TrainingPlan& plan_;
  int64_t N_;
  UnitWorkspace ws_;
  std::vector<float> saved_inputs_, activation_grad_;
  std::vector<float> head_logits_;  // [activation copies] (N, V): a vocabulary-cut head's
  // [activation copies] ExpertChain: expert groups' or MLP parts'; none uncut
  std::vector<float> expert_chains_;
  std::vector<int32_t> tokens_, targets_;
  std::vector<float> widened_[2];
  std::vector<float> grads_, tied_grads_;
  std::vector<float> grad_sum_;  // (largest padded): gpu_grads_summed_on_device
  std::vector<std::byte> new_params_;
};

}  // namespace

Result<std::unique_ptr<GpuRank>> GpuRank::create_emulated(const TrainingPlan& plan) {
  if (!plan.input.gpu)
    return Status::error("an emulated GPU rank needs a plan for the CUDA backend (input.gpu)");
  // Its saved inputs are fp32 where the plan's (and a GPU's) are in compute
  // precision: a spill of plan.saved_input_bytes() would carry half of one.
  if (plan.activations_spilled() && plan.compute_bytes != 4)
    return Status::error(
        "an emulated GPU rank keeps fp32 saved inputs: it spills them only in fp32");
  return std::unique_ptr<GpuRank>(new EmulatedGpuRank(plan));
}

}  // namespace strata
