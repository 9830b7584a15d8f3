// RankCompute: what one engine rank computes with. The operations of a step
// (core/engine/step_operations.cpp) call it without asking which backend
// runs. Two implementations:
//  - RankCompute::cpu, the CPU backend: the units of core/model/model.h in
//    fp32 over the rank's UnitWorkspace, saved inputs and
//    activation gradient (the plan's buffers of owner `rank`, found by role);
//    parameters below fp32 are widened first. Its device tier is host memory
//    standing in for a GPU's.
//  - RankCompute::gpu, the CUDA backend: GpuRank (core/engine/gpu_rank.h),
//    on a GPU or emulated on the CPU. Its device tier is GPU memory.
//
// Where data lives is the plan's (core/plan/training_plan.h): the operations
// ask it where a unit's parameters, gradients and optimizer state are, and
// pass the answer in (a pointer, its home tier). How memory of the device
// tier is reached is the compute's: the GPU copies it to and from host
// memory, the CPU reads it in place. State homed in host memory is computed
// by the CPU on either backend (the *_on_host functions below).
//
// Thread-safety: forward, head and backward come from one thread (the
// compute lane). The other calls may come from any lane: take_gathered
// touches only its gather slot, which the plan gives to one operation at a
// time; the state's arithmetic and the transfers take turns on the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/model/model.h"
#include "core/optimizer/optimizer.h"
#include "core/plan/training_plan.h"
#include "io/base/status.h"
#include "kernels/cpu/adamw_shard.h"
#include "kernels/cpu/grad_norm.h"
#include "tiers/tier.h"

namespace strata {

class GpuRank;
class RankBuffers;

// A unit's parameters in compute precision, as a computation reads them.
struct ComputeParams {
  const std::byte* data = nullptr;  // (padded_numel) compute precision
  // The gather slot they arrived in (take_gathered), or -1: their home, which
  // the units read in place.
  int gathered_slot = -1;
};

// Where a computation's fp32 gradient goes, for both computes (and GpuRank,
// core/engine/gpu_rank.h); the operation fills it in from the plan
// (TrainingPlan::gpu_grads_in_place). Gradients add (+=) into it.
struct GradTarget {
  // (padded_numel) fp32: the unit's gradient home in the device tier (in
  // place); else a host slot, or for slot -1 the tied embedding's host
  // buffer, where the head left the lm_head's gradient. A GPU's host slot is
  // there once gradients_ready(slot) returns.
  float* grads = nullptr;
  // The head of a tied model: (embedding padded_numel) fp32, where the
  // lm_head's gradient to the embedding adds: unit 0's device home (in
  // place), else the tied embedding's host buffer (the GPU keeps it on the
  // device until the embedding's backward sends the sum there).
  float* tied = nullptr;
  // Not in place: the host slot's index, or -1 - c for copy c of the tied
  // embedding's buffer (what gradients_ready waits for). Unused in place.
  int slot = -1;
  // Zero `grads` (and `tied`) before adding: the buffer's first gradient.
  bool zero_first = false;
  // TrainingPlan::gpu_grads_summed_on_device: the fresh gradient adds to the
  // device's sum over the micro-batches (`sum_first`: becomes it) and goes to
  // `grads` only when `send` (the last micro-batch).
  bool sum_on_device = false;
  bool sum_first = false;
  bool send = true;
};

// AdamW over one unit's optimizer range of this rank: the range's shard
// update (kernels/cpu/adamw_shard.h) with the driver's decision and where
// its copy goes.
struct UnitUpdate {
  const Optimizer* optimizer = nullptr;  // the rank's driver: hyperparameters
  StepDecision decision;
  // Every array in its home. master, exp_avg, exp_avg_sq: the optimizer's,
  // the moments as shard.state_type stores them (null on NVMe: the streamed
  // optimizer brings them); int8 scales beside the optimizer that updates
  // them (device memory for the GPU's optimizer, else host memory); grad
  // (fp32; bf16 for strata.gradient_home host_bf16) in the gradient's home
  // (the optimizer's tier or host memory; null on NVMe, read with the
  // chunks); copy: where the new compute-precision parameters go, of the
  // compute precision (in fp32 the master is copied there), in tier
  // `copy_home`; null when the master is the parameters. Segments: the
  // parameter groups over [0, numel).
  kernels::cpu::AdamWShard shard;
  tiers::Tier copy_home = tiers::Tier::host;
};

class RankCompute {
 public:
  // The CPU backend over the rank's buffers (`buffers` holds the plan's
  // buffers of owner `rank`; `plan` must outlive the compute).
  static std::unique_ptr<RankCompute> cpu(const TrainingPlan& plan, const RankBuffers& buffers);
  // The CUDA backend over `gpu` (created for `plan`, which must outlive it).
  static std::unique_ptr<RankCompute> gpu(const TrainingPlan& plan, std::unique_ptr<GpuRank> gpu);

  virtual ~RankCompute() = default;
  RankCompute() = default;
  RankCompute(const RankCompute&) = delete;
  RankCompute& operator=(const RankCompute&) = delete;

  // --- the units, from the compute lane -----------------------------------------------

  // Forward of the embedding or a decoder layer of micro-batch `micro`.
  // batch: the micro-batch's tokens and targets in host memory.
  virtual Status forward(int unit, int micro, const ComputeParams& params,
                         const UnitBatch& batch) = 0;
  // The head's forward and backward; returns the sum of the token losses.
  // tied: unit 0's parameters in a tied model (data null otherwise).
  virtual Result<double> head(int micro, const ComputeParams& params, const ComputeParams& tied,
                              const UnitBatch& batch, const GradTarget& target) = 0;
  // Backward of the embedding or a decoder layer. recompute false: the last
  // layer before the head, whose activations are still those of its forward.
  virtual Status backward(int unit, int micro, const ComputeParams& params, const UnitBatch& batch,
                          bool recompute, const GradTarget& target) = 0;

  // Where level `level` (unit `level`'s output) of micro-batch `micro` sits:
  // memory of the device tier, TrainingPlan::saved_input_place's slot. The
  // engine spills and restores it (TrainingPlan::activations_spilled):
  // saved_input_to_host copies it to host memory after the work enqueued so far,
  // saved_input_to_device copies it back before the work enqueued after it returns;
  // on a GPU on a copy stream of their own, while the computation runs on.
  // By default the download and upload below, which are in that order already.
  virtual std::byte* saved_input(int level, int micro) = 0;
  virtual Status saved_input_to_host(void* host, const void* device, int64_t bytes) {
    return download(host, device, bytes);
  }
  virtual Status saved_input_to_device(void* device, const void* host, int64_t bytes) {
    return upload(device, host, bytes);
  }

  // Unit `unit`'s compute-precision parameters have arrived in gather slot
  // `slot` (`params`, host memory); a computation reads them next.
  virtual Status take_gathered(int unit, int slot, const std::byte* params) = 0;
  // Routed expert fetch (core/plan/expert_fetch.h): the experts sparse MLP
  // piece `unit` routes micro-batch `micro` to (routed_experts,
  // core/model/model.h), from its gathered parameters, of which only the
  // norm and the router are read (the experts may not have arrived); for a
  // piece of experts, from its router piece's routing in the micro-batch's
  // chain (chain_routed_experts; the CPU backend's); and
  // elements [begin, begin + count) of gather slot `slot` changed after
  // take_gathered (the experts read since), to be taken likewise.
  virtual Result<std::vector<uint8_t>> routed_experts(int unit, int micro,
                                                      const ComputeParams& params) = 0;
  virtual Status take_gathered_range(int unit, int slot, const std::byte* params, int64_t begin,
                                     int64_t count) = 0;
  // Waits until the gradient last sent to host slot `slot` is there.
  virtual Status gradients_ready(int slot) = 0;
  // Waits until every piece of work enqueued so far has run.
  virtual Status synchronize() = 0;

  // --- memory of the device tier, from any lane -----------------------------------------

  // `bytes` of the device tier at `device` where the host can read them:
  // `device` itself when the device tier is host memory, else copied into
  // `host`, which is returned.
  virtual Result<const std::byte*> readable_on_host(const std::byte* device, std::byte* host,
                                                    int64_t bytes) = 0;
  // Copies between host memory and the device tier, after the work enqueued
  // so far; done when they return.
  virtual Status download(void* host, const void* device, int64_t bytes) = 0;
  virtual Status upload(void* device, const void* host, int64_t bytes) = 0;

  // --- arithmetic on state homed in `home` (device or host), from any lane --------------

  // accumulator = reduced (first) or accumulator += reduced, `numel` fp32 in
  // fp32; `reduced` is host memory, done with when it returns.
  virtual Status accumulate(tiers::Tier home, float* accumulator, const float* reduced,
                            int64_t numel, bool first) = 0;
  // The squared norm and non-finite flag of `numel` fp32 gradients (after
  // the work enqueued so far).
  virtual Result<kernels::cpu::GradNormPartial> grad_norm(tiers::Tier home, const float* grads,
                                                          int64_t numel) = 0;
  // AdamW on optimizer state (and gradients) homed in `home`. The new
  // parameters reach update.shard.copy: by the return when it is host
  // memory, else before any work enqueued after it.
  virtual Status update(tiers::Tier home, const UnitUpdate& update) = 0;
};

// The CPU's arithmetic on state in host memory, which both computes use.
Status accumulate_on_host(float* accumulator, const float* reduced, int64_t numel, bool first);
Result<kernels::cpu::GradNormPartial> grad_norm_on_host(const float* grads, int64_t numel);
Status update_on_host(const UnitUpdate& update);

}  // namespace strata
