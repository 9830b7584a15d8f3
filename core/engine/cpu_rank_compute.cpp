// RankCompute::cpu: the CPU backend's units in fp32, and the CPU's
// arithmetic on state in host memory (the *_on_host functions, which the
// GPU's compute uses for state offloaded to the host).
#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/engine/rank_buffers.h"
#include "core/engine/rank_compute.h"
#include "kernels/cpu/simd.h"

namespace strata {

Status accumulate_on_host(float* accumulator, const float* reduced, int64_t numel, bool first) {
  if (first) {
    std::memcpy(accumulator, reduced, size_t(numel) * 4);
    return Status::ok();
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, numel, 1 << 16),
                    [&](const tbb::blocked_range<int64_t>& range) {
                      for (int64_t i = range.begin(); i < range.end(); ++i)
                        accumulator[i] += reduced[i];
                    });
  return Status::ok();
}

Result<kernels::cpu::GradNormPartial> grad_norm_on_host(const float* grads, int64_t numel) {
  return kernels::cpu::grad_norm_squared(grads, kernels::cpu::ElementType::f32, numel);
}

Status update_on_host(const UnitUpdate& update) {
  return update.optimizer->update_shard(update.decision, update.shard);
}

namespace {

using kernels::cpu::ElementType;

class CpuRankCompute final : public RankCompute {
 public:
  CpuRankCompute(const TrainingPlan& plan, const RankBuffers& buffers)
      : plan_(plan),
        workspace_(plan.input.model, plan.input.micro_batch, plan.input.seq_len),
        gathered_fp32_(buffers.all_as<float>(BufferRole::gathered_unit_fp32)),
        widened_(buffers.all_as<float>(BufferRole::widened_params)),
        activation_grads_(buffers.all_as<float>(BufferRole::activation_gradient)),
        head_logits_(buffers.all_as<float>(BufferRole::head_logits)),
        expert_chains_(buffers.all_as<float>(BufferRole::expert_chain)),
        saved_inputs_(buffers.all_as<float>(BufferRole::saved_inputs)),
        activation_elements_(plan.tokens_per_micro * plan.input.model.hidden_size) {}

  Status forward(int unit, int micro, const ComputeParams& params,
                 const UnitBatch& batch) override {
    UnitParams p;
    p.flat = fp32(unit, params, 0);
    const float* input = unit == 0 ? nullptr : saved_input_at(unit - 1, micro);
    unit_forward(plan_.layout, unit, p, with_logits(batch, micro), input,
                 saved_input_at(unit, micro), workspace_);
    return Status::ok();
  }

  Result<double> head(int micro, const ComputeParams& params, const ComputeParams& tied,
                      const UnitBatch& batch, const GradTarget& target) override {
    const int head = int(plan_.units.size()) - 1;
    UnitParams p;
    p.flat = fp32(head, params, 0);
    UnitGrads g;
    g.flat = target.grads;
    if (tied.data != nullptr) {
      p.tied_embedding = fp32(0, tied, 1);
      g.tied_embedding = target.tied;
    }
    if (target.zero_first) {
      zero(g.flat, head);
      if (g.tied_embedding != nullptr) zero(g.tied_embedding, 0);
    }
    return head_forward_backward(plan_.layout, p, with_logits(batch, micro),
                                 saved_input_at(head - 1, micro), activation_grad(micro), g,
                                 workspace_);
  }

  Status backward(int unit, int micro, const ComputeParams& params, const UnitBatch& batch,
                  bool recompute, const GradTarget& target) override {
    UnitParams p;
    p.flat = fp32(unit, params, 0);
    UnitGrads g;
    g.flat = target.grads;
    if (target.zero_first) zero(g.flat, unit);
    const float* input = unit == 0 ? nullptr : saved_input_at(unit - 1, micro);
    float* dy = activation_grad(micro);
    unit_backward(plan_.layout, unit, p, with_logits(batch, micro), input, dy,
                  unit == 0 ? nullptr : dy, g, workspace_, recompute);
    return Status::ok();
  }

  // The units compute in fp32: a gathered unit below fp32 is widened as it
  // arrives (on the comm lane), so the compute lane reads it ready.
  Status take_gathered(int unit, int slot, const std::byte* params) override {
    if (plan_.compute_bytes == 4) return Status::ok();
    kernels::cpu::widen_to_float(params, plan_.compute_type(), gathered_fp32_[size_t(slot)],
                                 plan_.units[size_t(unit)].padded_numel);
    return Status::ok();
  }
  Result<std::vector<uint8_t>> routed_experts(int unit, int micro,
                                              const ComputeParams& params) override {
    // A piece of experts takes the routing its router piece left in the chain.
    if (plan_.layout.units[size_t(unit)].unit.piece == LayerPiece::experts)
      return chain_routed_experts(plan_.layout, unit, with_logits({}, micro).experts,
                                  plan_.tokens_per_micro);
    UnitParams p;
    p.flat = fp32(unit, params, 0);
    return strata::routed_experts(plan_.layout, unit, p, saved_input_at(unit - 1, micro),
                                  workspace_);
  }
  Status take_gathered_range(int unit, int slot, const std::byte* params, int64_t begin,
                             int64_t count) override {
    if (plan_.compute_bytes == 4) return Status::ok();
    count = std::min(count, plan_.units[size_t(unit)].padded_numel - begin);
    kernels::cpu::widen_to_float(params + begin * plan_.compute_bytes, plan_.compute_type(),
                                 gathered_fp32_[size_t(slot)] + begin, count);
    return Status::ok();
  }
  std::byte* saved_input(int level, int micro) override {
    return reinterpret_cast<std::byte*>(saved_input_at(level, micro));
  }

  // The units run on the calling thread: their results are there when they return.
  Status gradients_ready(int) override { return Status::ok(); }
  Status synchronize() override { return Status::ok(); }

  // The device tier is host memory.
  Result<const std::byte*> readable_on_host(const std::byte* device, std::byte*, int64_t) override {
    return device;
  }
  Status download(void* host, const void* device, int64_t bytes) override {
    std::memcpy(host, device, size_t(bytes));
    return Status::ok();
  }
  Status upload(void* device, const void* host, int64_t bytes) override {
    std::memcpy(device, host, size_t(bytes));
    return Status::ok();
  }

  // Both tiers are host memory here.
  Status accumulate(tiers::Tier, float* accumulator, const float* reduced, int64_t numel,
                    bool first) override {
    return accumulate_on_host(accumulator, reduced, numel, first);
  }
  Result<kernels::cpu::GradNormPartial> grad_norm(tiers::Tier, const float* grads,
                                                  int64_t numel) override {
    return grad_norm_on_host(grads, numel);
  }
  Status update(tiers::Tier, const UnitUpdate& update) override { return update_on_host(update); }

 private:
  // Unit `unit`'s parameters in fp32: as they are in fp32, the gather's
  // widened copy, or their home widened into buffer `which` (the tied head
  // reads two units).
  const float* fp32(int unit, const ComputeParams& params, int which) {
    if (plan_.compute_bytes == 4) return reinterpret_cast<const float*>(params.data);
    if (params.gathered_slot >= 0) return gathered_fp32_[size_t(params.gathered_slot)];
    float* out = widened_[size_t(which)];
    kernels::cpu::widen_to_float(params.data, plan_.compute_type(), out,
                                 plan_.units[size_t(unit)].padded_numel);
    return out;
  }
  // Unit `unit`'s output (the next unit's input) of micro-batch `micro`.
  float* saved_input_at(int unit, int micro) const {
    const TrainingPlan::SavedInputPlace place = plan_.saved_input_place(unit, micro);
    return saved_inputs_[size_t(place.copy)] + place.level * activation_elements_;
  }
  // A vocabulary-cut head's chunks share the micro-batch's logits
  // (UnitBatch::head_logits), a sparse layer's expert groups its chain
  // (UnitBatch::experts).
  UnitBatch with_logits(const UnitBatch& batch, int micro) const {
    UnitBatch b = batch;
    const size_t copy = size_t(plan_.activation_copy(micro));
    if (!head_logits_.empty()) b.head_logits = head_logits_[copy];
    if (!expert_chains_.empty())
      b.experts =
          expert_chain_view(plan_.input.model, plan_.tokens_per_micro, expert_chains_[copy]);
    return b;
  }
  float* activation_grad(int micro) const {
    return activation_grads_[size_t(plan_.activation_copy(micro))];
  }
  void zero(float* grads, int unit) const {
    std::memset(grads, 0, size_t(plan_.units[size_t(unit)].padded_numel) * 4);
  }

  const TrainingPlan& plan_;
  // Allocates its own memory; the plan's unit_working_set line charged its bytes.
  UnitWorkspace workspace_;
  std::vector<float*> gathered_fp32_;     // [gather slot] (largest padded), below fp32 at stage 3
  std::vector<float*> widened_;           // [2] (largest padded), below fp32 at stages 0-2
  std::vector<float*> activation_grads_;  // [activation copies] (B*T, C)
  std::vector<float*> head_logits_;       // [activation copies] (B*T, V); none for a whole head
  std::vector<float*> expert_chains_;     // [activation copies] ExpertChain; none uncut
  // [saved-input copies] (saved-input levels, B*T, C): each unit's output, the next's input
  std::vector<float*> saved_inputs_;
  int64_t activation_elements_ = 0;  // B*T*C
};

}  // namespace

std::unique_ptr<RankCompute> RankCompute::cpu(const TrainingPlan& plan,
                                              const RankBuffers& buffers) {
  return std::make_unique<CpuRankCompute>(plan, buffers);
}

}  // namespace strata
