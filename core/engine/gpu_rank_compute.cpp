// RankCompute::gpu: the CUDA backend's compute over a GpuRank. State in the
// device tier is the GPU's; state offloaded to host memory is the CPU's.
#include <memory>
#include <utility>

#include "core/engine/gpu_rank.h"
#include "core/engine/rank_compute.h"

namespace strata {
namespace {

class GpuRankCompute final : public RankCompute {
 public:
  GpuRankCompute(const TrainingPlan& plan, std::unique_ptr<GpuRank> gpu)
      : plan_(plan), gpu_(std::move(gpu)) {}

  // The embedding's forward also takes the micro-batch's tokens and targets to the GPU.
  Status forward(int unit, int micro, const ComputeParams& params,
                 const UnitBatch& batch) override {
    return gpu_->forward(unit, micro, params.data, batch);
  }
  Result<double> head(int micro, const ComputeParams& params, const ComputeParams& tied,
                      const UnitBatch& batch, const GradTarget& target) override {
    return gpu_->head(micro, params.data, tied.data, batch, target);
  }
  Status backward(int unit, int micro, const ComputeParams& params, const UnitBatch& batch,
                  bool recompute, const GradTarget& target) override {
    return gpu_->backward(unit, micro, params.data, batch, recompute, target);
  }

  // A gathered unit is uploaded by the first computation that reads it, in
  // compute precision; what was uploaded from this slot before is stale.
  Status take_gathered(int, int, const std::byte* params) override {
    gpu_->forget_uploads(params);
    return Status::ok();
  }
  Result<std::vector<uint8_t>> routed_experts(int unit, int micro,
                                              const ComputeParams& params) override {
    return gpu_->routed_experts(unit, micro, params.data);
  }
  Status take_gathered_range(int unit, int, const std::byte* params, int64_t begin,
                             int64_t count) override {
    return gpu_->take_gathered_range(unit, params, begin, count);
  }
  std::byte* saved_input(int level, int micro) override { return gpu_->saved_input(level, micro); }
  Status saved_input_to_host(void* host, const void* device, int64_t bytes) override {
    return gpu_->saved_input_to_host(host, device, bytes);
  }
  Status saved_input_to_device(void* device, const void* host, int64_t bytes) override {
    return gpu_->saved_input_to_device(device, host, bytes);
  }
  Status gradients_ready(int slot) override { return gpu_->gradients_ready(slot); }
  Status synchronize() override { return gpu_->synchronize(); }

  Result<const std::byte*> readable_on_host(const std::byte* device, std::byte* host,
                                            int64_t bytes) override {
    if (Status s = gpu_->download(host, device, bytes); !s) return s;
    return static_cast<const std::byte*>(host);
  }
  Status download(void* host, const void* device, int64_t bytes) override {
    return gpu_->download(host, device, bytes);
  }
  Status upload(void* device, const void* host, int64_t bytes) override {
    return gpu_->upload(device, host, bytes);
  }

  Status accumulate(tiers::Tier home, float* accumulator, const float* reduced, int64_t numel,
                    bool first) override {
    if (home != tiers::Tier::device) return accumulate_on_host(accumulator, reduced, numel, first);
    return gpu_->accumulate(accumulator, reduced, numel, first);
  }
  Result<kernels::cpu::GradNormPartial> grad_norm(tiers::Tier home, const float* grads,
                                                  int64_t numel) override {
    if (home != tiers::Tier::device) return grad_norm_on_host(grads, numel);
    return gpu_->grad_norm(grads, numel);
  }
  Status update(tiers::Tier home, const UnitUpdate& update) override {
    if (home != tiers::Tier::device) return update_on_host(update);
    return update_on_device(update);
  }

 private:
  // AdamW over the state's device homes: the GPU runs the shard in the CPU
  // optimizer's runs (a parameter group; int8: with its own blocks and
  // scales). Parameters in the device tier take the new values in place;
  // elsewhere they pass through the GPU's new-parameter buffer (in fp32 the
  // master is the copy) and come down.
  Status update_on_device(const UnitUpdate& update) {
    const bool downloaded = update.shard.copy != nullptr && update.copy_home != tiers::Tier::device;
    kernels::cpu::AdamWShard shard = update.shard;
    if (downloaded) shard.copy = gpu_->new_parameter_buffer();
    if (Status s = gpu_->adamw(shard, update.optimizer->hyperparams(update.decision)); !s) return s;
    if (!downloaded) return Status::ok();
    const void* from = shard.copy != nullptr ? shard.copy : static_cast<const void*>(shard.master);
    return gpu_->download(update.shard.copy, from, shard.numel * plan_.compute_bytes);
  }

  const TrainingPlan& plan_;
  std::unique_ptr<GpuRank> gpu_;
};

}  // namespace

std::unique_ptr<RankCompute> RankCompute::gpu(const TrainingPlan& plan,
                                              std::unique_ptr<GpuRank> gpu) {
  return std::make_unique<GpuRankCompute>(plan, std::move(gpu));
}

}  // namespace strata
