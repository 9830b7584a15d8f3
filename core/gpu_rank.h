// GpuRank: one rank's compute on a GPU, for the engine's CUDA backend, in one
// of two placements (core/training_plan.cpp refuses the others).
//
// State on the GPU (one rank, stage 0, nothing offloaded): parameters,
// gradients and the AdamW state live in the rank's device tier; the units
// compute from the parameters' home and accumulate into the gradients' home,
// the gradient norm and AdamW (kernels/cuda/adamw.h) run on the GPU, all on
// one compute stream; the *_resident calls below take device pointers.
//
// State offloaded (ZeRO-3 with offload_param and offload_optimizer
// cpu|nvme): the collectives, gradient accumulation and the CPU optimizer
// work on pinned host buffers as on the CPU backend. The GPU runs the units:
// a compute operation uploads the unit's compute-precision
// parameters from host memory into one of three rotating device slots on the
// host-to-device stream, computes on the compute stream (core/cuda_units.h),
// and a backward sends the unit's fp32 gradient back on the device-to-host
// stream. Streams are ordered by events only; nothing synchronises the device.
// Activation checkpoints, the activation gradient and the tokens stay on the
// device. Every device buffer comes from the rank's DeviceTier (one
// cudaMalloc), so the device budget holds and nothing is allocated in a step.
//
// Host memory handed in must stay valid until the call that reads it
// returns (uploads finish before it returns) or, for gradients, until
// gradients_ready(slot) returns; it should be pinned (the host tier is) so
// copies run asynchronously.
//
// Thread-safety: the compute calls come from one thread (the compute lane);
// gradients_ready may be called from another (the comm lane), after the
// backward that sent the gradients has returned.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/training_plan.h"
#include "io/status.h"
#include "kernels/cpu/adamw.h"
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
  ~GpuRank();
  GpuRank(const GpuRank&) = delete;
  GpuRank& operator=(const GpuRank&) = delete;

  // Forward of the embedding or a decoder layer of micro-batch `micro`.
  // params: the whole unit (padded_numel) in compute precision, host memory.
  // The embedding's forward also uploads the micro-batch's tokens and targets (B*T each).
  Status forward(int unit, int micro, const std::byte* params, const int32_t* tokens,
                 const int32_t* targets);

  // The head's forward and backward: returns the sum of the token losses.
  // tied_params: unit 0 (the embedding) in a tied model, else null. The head's
  // fp32 gradient goes to host `grads` (padded_numel, =) and is there once
  // gradients_ready(grad_slot) returns; a tied lm_head's gradient stays on the
  // device until the embedding's backward adds to it.
  Result<double> head(int micro, const std::byte* params, const std::byte* tied_params,
                      float loss_scale, float* grads, int grad_slot);

  // Backward of the embedding or a decoder layer. recompute false: the layer's
  // activations are those of its forward (the last layer before the head).
  // The fp32 gradient goes to host `grads` (=), ready after gradients_ready(grad_slot);
  // grad_slot -1 is the tied embedding (head's lm_head gradient plus the embedding's).
  Status backward(int unit, int micro, const std::byte* params, bool recompute, float* grads,
                  int grad_slot);

  // Waits until the gradient last sent for `grad_slot` is in host memory.
  Status gradients_ready(int grad_slot);

  // Waits until every piece of work enqueued so far has run (before the
  // state's device homes are read through the device tier's own streams).
  Status synchronize();

  // --- state on the GPU: device pointers into the rank's device tier -------------

  // As forward, from the unit's device-resident parameters.
  Status forward_resident(int unit, int micro, const std::byte* params, const int32_t* tokens,
                          const int32_t* targets);
  // As head; the gradient accumulates (+=) into device `grads` (and the tied
  // lm_head's into device `tied_grads`), zeroed first when `zero_first`.
  Result<double> head_resident(int micro, const std::byte* params, const std::byte* tied_params,
                               float loss_scale, float* grads, float* tied_grads, bool zero_first);
  // As backward; the gradient accumulates into device `grads`, zeroed first when `zero_first`.
  Status backward_resident(int unit, int micro, const std::byte* params, bool recompute,
                           float* grads, bool zero_first);
  // The squared norm and non-finite flag of `numel` fp32 device gradients, after the
  // work enqueued so far (waits for it). From any lane, one call at a time.
  Result<kernels::cpu::GradNormPartial> grad_norm(const float* grads, int64_t numel);
  // AdamW on device-resident state after the work enqueued so far (not waiting for it).
  // copy: the compute-precision parameters to write (device), or null when the
  // fp32 master is the parameters. From any lane, one call at a time.
  Status adamw(float* master, float* m, float* v, const float* grad, std::byte* copy, int64_t numel,
               const kernels::cpu::AdamWHyperparams& hyper);

 private:
  struct Impl;
  explicit GpuRank(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The working set every rank keeps on the device on the CUDA backend, beyond
// what scales with the batch; core/training_plan.cpp lists these buffers.
inline constexpr int kGpuParamSlots = 3;   // rotating device copies of a unit's parameters
inline constexpr int kGpuGradBuffers = 2;  // rotating device fp32 unit gradients
inline constexpr int64_t kGpuMatmulWorkspaceBytes = int64_t{32} << 20;  // cuBLASLt's

}  // namespace strata
