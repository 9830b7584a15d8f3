// GpuRank: one rank's compute on a GPU, for the engine's CUDA backend, in
// every placement of the state (core/plan/training_plan.h chooses the paths).
//
// The units run on one compute stream (core/model/cuda_units.h). Where the data
// comes from and goes to depends on the placement:
//  - Parameters: with whole units in their device home
//    (TrainingPlan::gpu_params_in_place: stages 0-2, or one rank) the units
//    compute straight from it; otherwise each computation uploads the unit's
//    gathered compute-precision copy from pinned host memory into one of
//    three rotating device slots on the host-to-device stream.
//  - Gradients: with one rank and the optimizer on the GPU
//    (TrainingPlan::gpu_grads_in_place) they accumulate straight into their
//    device home; otherwise each unit's fp32 gradient is computed into one of
//    two rotating device buffers and sent to a pinned host slot on the
//    device-to-host stream, where the collectives reduce it.
//  - The gradient norm and AdamW run on the GPU when the gradients' and the
//    optimizer's homes are there (kernels/cuda/adamw.h); the engine moves
//    reduced gradients and new parameters between host and device with the
//    transfer calls below.
// Streams are ordered by events; nothing synchronises the device inside a
// step. Saved inputs stay on the device unless the plan spills them
// (the engine moves them with saved_input_to_host and saved_input_to_device, on a copy
// stream of their own); the activation gradient and the tokens stay there. Every device buffer
// comes from the rank's DeviceTier (one cudaMalloc), so the device budget holds and nothing is
// allocated in a step.
//
// Host memory handed in must stay valid until the call that reads it
// returns (uploads finish before it returns) or, for gradients, until
// gradients_ready(slot) returns; it should be pinned (the host tier is) so
// copies run asynchronously.
//
// Thread-safety: forward, head and backward come from one thread (the
// compute lane), and so do routed_experts and take_gathered_range (the
// route operation is on the compute lane): they share the parameter slots'
// rotation and the units' workspace unlocked. The other calls may come from
// any lane; they take turns, and run in stream order after the computation
// enqueued before them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/engine/rank_compute.h"
#include "core/plan/training_plan.h"
#include "io/base/status.h"
#include "kernels/cpu/adamw_shard.h"
#include "kernels/cpu/grad_norm.h"
#include "tiers/device_tier.h"

namespace strata {

class GpuRank {
 public:
  // Allocates the working set the plan lists for the device from `device`
  // (which must be on the GPU `gpu_index`); the blocks are appended to `blocks`.
  static Result<std::unique_ptr<GpuRank>> create(const TrainingPlan& plan, int gpu_index,
                                                 tiers::DeviceTier& device,
                                                 std::vector<tiers::DeviceBlock>& blocks);
  // For tests on machines without a GPU: the same calls on host memory
  // (the device tier then stands in for GPU memory), computed by the CPU
  // units in fp32 (io/base/sizes.h), so the engine's GPU data paths (what is
  // computed in place, staged, reduced, uploaded and downloaded) run and can
  // be checked against the CPU backend. In-place gradients accumulate inside
  // the backward as on the GPU; the rest is the CPU backend's arithmetic.
  static Result<std::unique_ptr<GpuRank>> create_emulated(const TrainingPlan& plan);
  virtual ~GpuRank() = default;
  GpuRank() = default;
  GpuRank(const GpuRank&) = delete;
  GpuRank& operator=(const GpuRank&) = delete;

  // Forward of the embedding or a decoder layer of micro-batch `micro`.
  // params: the whole unit (padded_numel) in compute precision: its device
  // home when the plan's parameters are in place, else host memory.
  // batch (here and below): the micro-batch in host memory; the embedding's
  // forward also uploads its tokens and targets (B*T each). A mixture's
  // router statistics (UnitBatch::router) stay in host memory, where its
  // sparse layers' forwards add to them.
  virtual Status forward(int unit, int micro, const std::byte* params, const UnitBatch& batch) = 0;

  // The head's forward and backward: returns the sum of the token losses.
  // tied_params: unit 0 (the embedding) in a tied model, else null. `target`
  // (here and in backward): where the gradient goes (core/engine/rank_compute.h).
  virtual Result<double> head(int micro, const std::byte* params, const std::byte* tied_params,
                              const UnitBatch& batch, const GradTarget& target) = 0;

  // Backward of the embedding or a decoder layer. recompute false: the layer's
  // activations are those of its forward (the last layer before the head).
  virtual Status backward(int unit, int micro, const std::byte* params, const UnitBatch& batch,
                          bool recompute, const GradTarget& target) = 0;

  // Routed expert fetch (core/plan/expert_fetch.h): the experts sparse MLP
  // piece `unit` routes micro-batch `micro`'s tokens to ([E], 1 for each
  // expert that gets a token): its norm and router over its saved input on
  // the GPU, the routing downloaded (waits for the compute stream). Reads
  // only the norm and the router of `params` (host memory, uploaded as a
  // forward uploads it; the experts may not have arrived there yet).
  virtual Result<std::vector<uint8_t>> routed_experts(int unit, int micro,
                                                      const std::byte* params) = 0;
  // Elements [begin, begin + count) of `params` (host memory, compute
  // precision) changed since a computation uploaded them for `unit` (the
  // experts read since its routing): the upload still on the device takes
  // them, before the work enqueued after this returns; none there, nothing
  // to do (the next computation uploads the whole unit). Done with `params`
  // when it returns.
  virtual Status take_gathered_range(int unit, const std::byte* params, int64_t begin,
                                     int64_t count) = 0;

  // Level `level` (unit `level`'s output) of micro-batch `micro`, in device
  // memory (TrainingPlan::saved_input_place), for the engine to spill and restore.
  virtual std::byte* saved_input(int level, int micro) = 0;
  // A saved input to and from pinned host memory on a stream of its own,
  // after the work enqueued so far on the compute stream, which runs on
  // meanwhile (saved_input_to_device: before the work enqueued after it returns);
  // done when they return. One at a time. By default download and upload,
  // which are in that order already (the emulated rank: host memory).
  virtual Status saved_input_to_host(void* host, const void* device, int64_t bytes) {
    return download(host, device, bytes);
  }
  virtual Status saved_input_to_device(void* device, const void* host, int64_t bytes) {
    return upload(device, host, bytes);
  }

  // Waits until the gradient last sent for host slot `grad_slot` is in host memory.
  virtual Status gradients_ready(int grad_slot) = 0;

  // Waits until every piece of work enqueued so far has run (before the
  // state's device homes are read through the device tier's own streams).
  virtual Status synchronize() = 0;

  // --- transfers and the state's work on the GPU: from any lane, one at a time --------

  // Copies `bytes` between host and device memory after the work enqueued so
  // far; done when they return.
  virtual Status download(void* host, const void* device, int64_t bytes) = 0;
  virtual Status upload(void* device, const void* host, int64_t bytes) = 0;
  // device = host (first) or device += host, `numel` fp32, in fp32 (as the
  // CPU backend accumulates); done with `host` when it returns.
  virtual Status accumulate(float* device, const float* host, int64_t numel, bool first) = 0;
  // The squared norm and non-finite flag of `numel` fp32 device gradients,
  // after the work enqueued so far (waits for it).
  virtual Result<kernels::cpu::GradNormPartial> grad_norm(const float* grads, int64_t numel) = 0;
  // AdamW on device-resident state (every pointer of `shard` device memory)
  // after the work enqueued so far (not waiting for it), with the CPU
  // kernel's arithmetic, moment formats and runs; an fp32 copy is the new
  // master, copied there.
  virtual Status adamw(const kernels::cpu::AdamWShard& shard,
                       const kernels::cpu::AdamWHyperparams& hyper) = 0;
  // The device buffer AdamW writes new parameters into when their home is
  // not on the GPU (optimizer on the GPU, parameters in host memory or on
  // NVMe, compute precision below fp32); null otherwise.
  virtual std::byte* new_parameter_buffer() const = 0;
  // New parameters arrived in host memory at `host` (a gather slot): an
  // upload made from there is stale. Until then a computation on the same
  // unit from the same host memory reads the upload still on the device.
  virtual void forget_uploads(const std::byte* host) = 0;
};

}  // namespace strata
