#include "core/gpu_rank.h"

#include <fmt/format.h>

#if STRATA_HAS_CUDA
#include <cuda_runtime_api.h>

#include <array>
#include <string>

#include "core/cuda_units.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/matmul.h"
#endif

namespace strata {

#if STRATA_HAS_CUDA
namespace cuda = kernels::cuda;
namespace {

cuda::DType dtype_of(Precision precision) {
  switch (precision) {
    case Precision::bf16:
      return cuda::DType::bf16;
    case Precision::fp16:
      return cuda::DType::f16;
    case Precision::fp32:
      break;
  }
  return cuda::DType::f32;
}

}  // namespace

struct GpuRank::Impl {
  const TrainingPlan& plan;
  int gpu = 0;
  cuda::DType type = cuda::DType::f32;
  int64_t type_bytes = 4;
  int64_t N = 0;  // tokens per micro-batch
  int64_t C = 0;
  cudaStream_t compute = nullptr, to_device = nullptr, to_host = nullptr;
  std::unique_ptr<cuda::Matmuls> matmuls;
  std::unique_ptr<CudaUnits> units;

  // Parameter slots: the upload into a slot waits until the computation that
  // last read it is done (slot_free); the computation waits for the upload (uploaded).
  std::array<std::byte*, kGpuParamSlots> param_slots{};
  std::array<cudaEvent_t, kGpuParamSlots> slot_free{}, uploaded{};
  int next_param_slot = 0;

  // Gradient buffers in rotation: zeroing one waits until its last copy to the host is done.
  std::array<float*, kGpuGradBuffers> grad_buffers{};
  std::array<cudaEvent_t, kGpuGradBuffers> grad_sent{};
  int next_grad_buffer = 0;
  float* tied_grad = nullptr;  // (embedding padded_numel) fp32
  cudaEvent_t computed = nullptr;
  // Per host gradient slot (index 0 for the tied embedding, k + 1 for slot k): copy done.
  std::vector<cudaEvent_t> slot_sent;
  std::vector<char> slot_pending;

  std::vector<std::byte*> checkpoints;   // [units - 1] (N, C) compute type
  std::byte* activation_grad = nullptr;  // (N, C) compute type
  int32_t* tokens = nullptr;             // (G, N)
  int32_t* targets = nullptr;            // (G, N)
  float* losses = nullptr;               // (N)
  std::vector<float> host_losses;        // (N)
  // State on the GPU: the gradient norm's result and scratch.
  bool resident = false;
  cuda::GradNormResult* norm = nullptr;       // (1)
  cuda::GradNormResult* host_norm = nullptr;  // (1) pinned
  cudaEvent_t norm_read = nullptr;
  std::byte* norm_scratch = nullptr;
  int64_t norm_scratch_bytes = 0;

  explicit Impl(const TrainingPlan& p) : plan(p) {}
  ~Impl();

  Status select() {
    return cuda::check_cuda(cudaSetDevice(gpu), fmt::format("selecting GPU {}", gpu));
  }
  // Uploads `bytes` of host parameters into the next slot; returns the slot.
  Result<int> upload(const std::byte* params, int64_t bytes);
  // After the computation that reads slot k is enqueued: frees it and waits for its upload.
  Status computed_with(int slot);
  // Zeroes the next gradient buffer on the compute stream, after its last copy out.
  Result<int> take_grad_buffer(int64_t numel);
  // Sends `device` (numel fp32) to host `grads` once the computation so far is done.
  Status send_gradients(const float* device, float* grads, int64_t numel, int grad_slot,
                        int buffer);
  // Enqueues the upload of micro-batch `micro`'s ids (before the embedding's forward).
  Status upload_ids(int micro, const int32_t* tokens, const int32_t* targets);
  // The head on device parameters; losses summed on the host.
  Result<double> run_head(int micro, const void* params, const void* tied_params, float loss_scale,
                          float* grads, float* tied_grads);
  Status zero(float* grads, int64_t numel) {
    return cuda::check_cuda(cudaMemsetAsync(grads, 0, size_t(numel) * 4, compute),
                            "zeroing a unit gradient");
  }
  CudaUnitBatch batch(int micro, float loss_scale) const {
    CudaUnitBatch b;
    b.tokens = tokens + int64_t(micro) * N;
    b.targets = targets + int64_t(micro) * N;
    b.loss_scale = loss_scale;
    return b;
  }
  int64_t unit_bytes(int unit) const { return plan.units[size_t(unit)].padded_numel * type_bytes; }
};

GpuRank::Impl::~Impl() {
  cudaSetDevice(gpu);
  if (compute) cudaStreamSynchronize(compute);
  if (to_device) cudaStreamSynchronize(to_device);
  if (to_host) cudaStreamSynchronize(to_host);
  units.reset();
  matmuls.reset();
  for (cudaEvent_t e : slot_free)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : uploaded)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : grad_sent)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : slot_sent)
    if (e) cudaEventDestroy(e);
  if (computed) cudaEventDestroy(computed);
  if (norm_read) cudaEventDestroy(norm_read);
  if (host_norm) cudaFreeHost(host_norm);
  for (cudaStream_t s : {compute, to_device, to_host})
    if (s) cudaStreamDestroy(s);
}

Result<int> GpuRank::Impl::upload(const std::byte* params, int64_t bytes) {
  const int k = next_param_slot;
  next_param_slot = (next_param_slot + 1) % kGpuParamSlots;
  // An event never recorded is complete, so the first use of a slot does not wait.
  if (Status s = cuda::check_cuda(cudaStreamWaitEvent(to_device, slot_free[size_t(k)], 0),
                                  "ordering a parameter upload");
      !s)
    return s;
  if (Status s = cuda::check_cuda(cudaMemcpyAsync(param_slots[size_t(k)], params, size_t(bytes),
                                                  cudaMemcpyHostToDevice, to_device),
                                  fmt::format("uploading {} bytes of parameters", bytes));
      !s)
    return s;
  if (Status s =
          cuda::check_cuda(cudaEventRecord(uploaded[size_t(k)], to_device), "recording an upload");
      !s)
    return s;
  if (Status s = cuda::check_cuda(cudaStreamWaitEvent(compute, uploaded[size_t(k)], 0),
                                  "ordering a computation after its upload");
      !s)
    return s;
  return k;
}

Status GpuRank::Impl::computed_with(int slot) {
  if (Status s = cuda::check_cuda(cudaEventRecord(slot_free[size_t(slot)], compute),
                                  "recording a parameter slot's release");
      !s)
    return s;
  // The host memory the upload read belongs to the caller again once this returns.
  return cuda::check_cuda(cudaEventSynchronize(uploaded[size_t(slot)]),
                          "waiting for a parameter upload");
}

Result<int> GpuRank::Impl::take_grad_buffer(int64_t numel) {
  const int k = next_grad_buffer;
  next_grad_buffer = (next_grad_buffer + 1) % kGpuGradBuffers;
  if (Status s = cuda::check_cuda(cudaStreamWaitEvent(compute, grad_sent[size_t(k)], 0),
                                  "ordering a gradient buffer's reuse");
      !s)
    return s;
  if (Status s =
          cuda::check_cuda(cudaMemsetAsync(grad_buffers[size_t(k)], 0, size_t(numel) * 4, compute),
                           "zeroing a unit gradient");
      !s)
    return s;
  return k;
}

Status GpuRank::Impl::send_gradients(const float* device, float* grads, int64_t numel,
                                     int grad_slot, int buffer) {
  if (Status s = cuda::check_cuda(cudaEventRecord(computed, compute), "recording a backward"); !s)
    return s;
  if (Status s = cuda::check_cuda(cudaStreamWaitEvent(to_host, computed, 0),
                                  "ordering a gradient copy after its backward");
      !s)
    return s;
  if (Status s = cuda::check_cuda(
          cudaMemcpyAsync(grads, device, size_t(numel) * 4, cudaMemcpyDeviceToHost, to_host),
          fmt::format("sending {} bytes of gradients to the host", numel * 4));
      !s)
    return s;
  if (buffer >= 0) {
    if (Status s = cuda::check_cuda(cudaEventRecord(grad_sent[size_t(buffer)], to_host),
                                    "recording a gradient copy");
        !s)
      return s;
  }
  const size_t index = size_t(grad_slot + 1);
  if (Status s =
          cuda::check_cuda(cudaEventRecord(slot_sent[index], to_host), "recording a gradient copy");
      !s)
    return s;
  slot_pending[index] = 1;
  return Status::ok();
}

GpuRank::GpuRank(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuRank::~GpuRank() = default;

Result<std::unique_ptr<GpuRank>> GpuRank::create(const TrainingPlan& plan, int gpu_index,
                                                 tiers::DeviceTier& device,
                                                 std::vector<tiers::DeviceBlock>& blocks) {
  if (!device.on_gpu())
    return Status::error(
        "the CUDA backend needs its device tier on a GPU; none is usable here (run with "
        "--backend cpu)");
  const TrainingPlanInput& in = plan.input;
  auto impl = std::make_unique<Impl>(plan);
  Impl& g = *impl;
  g.gpu = gpu_index;
  if (Status s = g.select(); !s) return s;
  g.type = dtype_of(in.precision);
  g.type_bytes = int64_t(cuda::dtype_size(g.type));
  g.N = plan.tokens_per_micro;
  g.C = in.model.hidden_size;
  const int units = int(plan.units.size());
  int64_t largest_padded = 0;
  for (const UnitPlacement& p : plan.units)
    largest_padded = std::max(largest_padded, p.padded_numel);

  for (cudaStream_t* s : {&g.compute, &g.to_device, &g.to_host})
    if (Status st = cuda::check_cuda(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking),
                                     "creating a stream");
        !st)
      return st;
  auto event = [](cudaEvent_t& e) {
    return cuda::check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                            "creating an event");
  };
  for (int k = 0; k < kGpuParamSlots; ++k) {
    if (Status s = event(g.slot_free[size_t(k)]); !s) return s;
    if (Status s = event(g.uploaded[size_t(k)]); !s) return s;
  }
  for (int k = 0; k < kGpuGradBuffers; ++k)
    if (Status s = event(g.grad_sent[size_t(k)]); !s) return s;
  if (Status s = event(g.computed); !s) return s;
  g.slot_sent.assign(size_t(plan.grad_slots + 1), nullptr);
  g.slot_pending.assign(size_t(plan.grad_slots + 1), 0);
  for (cudaEvent_t& e : g.slot_sent)
    if (Status s = event(e); !s) return s;

  // The working set, named as the plan lists it.
  auto take = [&](int64_t bytes, const std::string& what) -> Result<std::byte*> {
    Result<tiers::DeviceBlock> block = device.allocate(uint64_t(bytes), what);
    if (!block) return block.status();
    blocks.push_back(*block);
    return block->data;
  };
  g.resident = plan.homes.param == tiers::Tier::device;
  for (int k = 0; k < kGpuParamSlots && !g.resident; ++k) {
    Result<std::byte*> slot = take(largest_padded * g.type_bytes, "device parameter slot");
    if (!slot) return slot.status();
    g.param_slots[size_t(k)] = *slot;
  }
  for (int k = 0; k < kGpuGradBuffers && !g.resident; ++k) {
    Result<std::byte*> buffer = take(largest_padded * 4, "device unit gradient");
    if (!buffer) return buffer.status();
    g.grad_buffers[size_t(k)] = reinterpret_cast<float*>(*buffer);
  }
  if (g.resident) {
    g.norm_scratch_bytes = int64_t(cuda::grad_norm_scratch_bytes(largest_padded));
    Result<std::byte*> scratch = take(g.norm_scratch_bytes + 4096, "gradient norm scratch");
    if (!scratch) return scratch.status();
    g.norm = reinterpret_cast<cuda::GradNormResult*>(*scratch);
    g.norm_scratch = *scratch + 4096;
    if (Status s = cuda::check_cuda(
            cudaMallocHost(reinterpret_cast<void**>(&g.host_norm), sizeof(cuda::GradNormResult)),
            "allocating a pinned gradient norm");
        !s)
      return s;
    if (Status s = event(g.norm_read); !s) return s;
  }
  if (plan.tied_grad_buffer && !g.resident) {
    Result<std::byte*> buffer =
        take(plan.units[0].padded_numel * 4, "device tied embedding gradient");
    if (!buffer) return buffer.status();
    g.tied_grad = reinterpret_cast<float*>(*buffer);
  }
  const int64_t activation_bytes = g.N * g.C * g.type_bytes;
  Result<std::byte*> checkpoints = take((units - 1) * activation_bytes, "activation checkpoints");
  if (!checkpoints) return checkpoints.status();
  for (int u = 0; u + 1 < units; ++u) g.checkpoints.push_back(*checkpoints + u * activation_bytes);
  Result<std::byte*> activation_grad = take(activation_bytes, "activation gradient");
  if (!activation_grad) return activation_grad.status();
  g.activation_grad = *activation_grad;
  Result<std::byte*> ids = take(2 * g.N * 4 * in.grad_accum, "device tokens and targets");
  if (!ids) return ids.status();
  g.tokens = reinterpret_cast<int32_t*>(*ids);
  g.targets = g.tokens + g.N * in.grad_accum;
  Result<std::byte*> losses = take(g.N * 4, "per-token losses");
  if (!losses) return losses.status();
  g.losses = reinterpret_cast<float*>(*losses);
  g.host_losses.resize(size_t(g.N));
  Result<std::byte*> matmul_workspace = take(kGpuMatmulWorkspaceBytes, "cuBLASLt workspace");
  if (!matmul_workspace) return matmul_workspace.status();
  const int64_t workspace_bytes =
      cuda_unit_workspace_bytes(in.model, in.micro_batch, in.seq_len, int(g.type_bytes));
  Result<std::byte*> workspace = take(workspace_bytes, "GPU unit working set");
  if (!workspace) return workspace.status();

  Result<std::unique_ptr<cuda::Matmuls>> matmuls =
      cuda::Matmuls::create_in(*matmul_workspace, size_t(kGpuMatmulWorkspaceBytes));
  if (!matmuls) return matmuls.status();
  g.matmuls = std::move(*matmuls);
  Result<std::unique_ptr<CudaUnits>> created = CudaUnits::create(
      plan.layout, in.micro_batch, in.seq_len, g.type, *workspace, workspace_bytes, *g.matmuls);
  if (!created) return created.status();
  g.units = std::move(*created);
  return std::unique_ptr<GpuRank>(new GpuRank(std::move(impl)));
}

Status GpuRank::forward(int unit, int micro, const std::byte* params, const int32_t* tokens,
                        const int32_t* targets) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  if (unit == 0) {
    if (Status s = g.upload_ids(micro, tokens, targets); !s) return s;
  }
  Result<int> slot = g.upload(params, g.unit_bytes(unit));
  if (!slot) return slot.status();
  const void* input = unit == 0 ? nullptr : g.checkpoints[size_t(unit - 1)];
  Status status = g.units->forward(unit, g.param_slots[size_t(*slot)], g.batch(micro, 1.0f), input,
                                   g.checkpoints[size_t(unit)], g.compute);
  Status released = g.computed_with(*slot);
  return status ? released : status;
}

Result<double> GpuRank::head(int micro, const std::byte* params, const std::byte* tied_params,
                             float loss_scale, float* grads, int grad_slot) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  const int head = int(g.plan.units.size()) - 1;
  Result<int> slot = g.upload(params, g.unit_bytes(head));
  if (!slot) return slot.status();
  int tied_slot = -1;
  if (tied_params != nullptr) {
    Result<int> uploaded = g.upload(tied_params, g.unit_bytes(0));
    if (!uploaded) return uploaded.status();
    tied_slot = *uploaded;
    // The previous micro-batch's tied gradient must have reached the host first.
    if (Status s = cuda::check_cuda(cudaStreamWaitEvent(g.compute, g.slot_sent[0], 0),
                                    "ordering the tied embedding's gradient");
        !s)
      return s;
    if (Status s = cuda::check_cuda(
            cudaMemsetAsync(g.tied_grad, 0, size_t(g.plan.units[0].padded_numel) * 4, g.compute),
            "zeroing the tied embedding's gradient");
        !s)
      return s;
  }
  const int64_t numel = g.plan.units[size_t(head)].padded_numel;
  Result<int> buffer = g.take_grad_buffer(numel);
  if (!buffer) return buffer.status();
  float* device_grads = g.grad_buffers[size_t(*buffer)];
  Result<double> loss =
      g.run_head(micro, g.param_slots[size_t(*slot)],
                 tied_params != nullptr ? g.param_slots[size_t(tied_slot)] : nullptr, loss_scale,
                 device_grads, tied_params != nullptr ? g.tied_grad : nullptr);
  Status status = loss.status();
  if (status) status = g.send_gradients(device_grads, grads, numel, grad_slot, *buffer);
  Status released = g.computed_with(*slot);
  if (tied_params != nullptr && released) released = g.computed_with(tied_slot);
  if (status) status = released;
  if (!status) return status;
  return loss;
}

Status GpuRank::Impl::upload_ids(int micro, const int32_t* host_tokens,
                                 const int32_t* host_targets) {
  // In stream order before every computation that reads them. The host ids
  // stay untouched until the next step(), which comes after this step's
  // head has synchronised the compute stream (run_head), so the copy is done.
  const size_t bytes = size_t(N) * 4;
  if (Status s = cuda::check_cuda(cudaMemcpyAsync(tokens + int64_t(micro) * N, host_tokens, bytes,
                                                  cudaMemcpyHostToDevice, compute),
                                  "uploading tokens");
      !s)
    return s;
  return cuda::check_cuda(cudaMemcpyAsync(targets + int64_t(micro) * N, host_targets, bytes,
                                          cudaMemcpyHostToDevice, compute),
                          "uploading targets");
}

Result<double> GpuRank::Impl::run_head(int micro, const void* params, const void* tied_params,
                                       float loss_scale, float* grads, float* tied_grads) {
  const int head = int(plan.units.size()) - 1;
  Status status = units->head_forward_backward(params, tied_params, batch(micro, loss_scale),
                                               checkpoints[size_t(head - 1)], activation_grad,
                                               grads, tied_grads, losses, compute);
  // To pageable memory, the copy returns once it (and the work before it) is done.
  if (status)
    status = cuda::check_cuda(
        cudaMemcpyAsync(host_losses.data(), losses, size_t(N) * 4, cudaMemcpyDeviceToHost, compute),
        "reading the losses");
  if (status)
    status = cuda::check_cuda(cudaStreamSynchronize(compute), "waiting for the head's losses");
  if (!status) return status;
  double sum = 0.0;
  for (float loss : host_losses) sum += loss;
  return sum;
}

Status GpuRank::forward_resident(int unit, int micro, const std::byte* params,
                                 const int32_t* tokens, const int32_t* targets) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  if (unit == 0) {
    if (Status s = g.upload_ids(micro, tokens, targets); !s) return s;
  }
  const void* input = unit == 0 ? nullptr : g.checkpoints[size_t(unit - 1)];
  return g.units->forward(unit, params, g.batch(micro, 1.0f), input, g.checkpoints[size_t(unit)],
                          g.compute);
}

Result<double> GpuRank::head_resident(int micro, const std::byte* params,
                                      const std::byte* tied_params, float loss_scale, float* grads,
                                      float* tied_grads, bool zero_first) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  const int head = int(g.plan.units.size()) - 1;
  if (zero_first) {
    if (Status s = g.zero(grads, g.plan.units[size_t(head)].padded_numel); !s) return s;
    if (tied_grads != nullptr) {
      if (Status s = g.zero(tied_grads, g.plan.units[0].padded_numel); !s) return s;
    }
  }
  return g.run_head(micro, params, tied_params, loss_scale, grads, tied_grads);
}

Status GpuRank::backward_resident(int unit, int micro, const std::byte* params, bool recompute,
                                  float* grads, bool zero_first) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  if (zero_first) {
    if (Status s = g.zero(grads, g.plan.units[size_t(unit)].padded_numel); !s) return s;
  }
  const void* input = unit == 0 ? nullptr : g.checkpoints[size_t(unit - 1)];
  void* dinput = unit == 0 ? nullptr : g.activation_grad;
  return g.units->backward(unit, params, g.batch(micro, 1.0f), input, g.activation_grad, dinput,
                           grads, recompute, g.compute);
}

Result<kernels::cpu::GradNormPartial> GpuRank::grad_norm(const float* grads, int64_t numel) {
  Impl& g = *impl_;
  if (g.norm == nullptr) return Status::error("GpuRank::grad_norm: the state is not on the GPU");
  if (Status s = g.select(); !s) return s;
  if (Status s = cuda::grad_norm_squared(g.norm, grads, cuda::DType::f32, numel, g.norm_scratch,
                                         size_t(g.norm_scratch_bytes), g.compute);
      !s)
    return s;
  // Waits for the norm, not for the work other lanes enqueued after it.
  if (Status s = cuda::check_cuda(cudaMemcpyAsync(g.host_norm, g.norm, sizeof(cuda::GradNormResult),
                                                  cudaMemcpyDeviceToHost, g.compute),
                                  "reading a gradient norm");
      !s)
    return s;
  if (Status s =
          cuda::check_cuda(cudaEventRecord(g.norm_read, g.compute), "recording a gradient norm");
      !s)
    return s;
  if (Status s = cuda::check_cuda(cudaEventSynchronize(g.norm_read), "waiting for a gradient norm");
      !s)
    return s;
  const cuda::GradNormResult result = *g.host_norm;
  kernels::cpu::GradNormPartial partial;
  partial.sum_squares = result.sum_squares;
  partial.nonfinite = result.nonfinite != 0;
  return partial;
}

Status GpuRank::adamw(float* master, float* m, float* v, const float* grad, std::byte* copy,
                      int64_t numel, const kernels::cpu::AdamWHyperparams& hyper) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  cuda::AdamWDeviceShard shard;
  shard.numel = numel;
  shard.master = master;
  shard.exp_avg = m;
  shard.exp_avg_sq = v;
  shard.grad = grad;
  shard.grad_type = cuda::DType::f32;
  shard.copy = copy;
  shard.copy_type = g.type == cuda::DType::f32 ? cuda::DType::bf16 : g.type;
  return cuda::adamw_step(shard, hyper, g.compute);
}

Status GpuRank::backward(int unit, int micro, const std::byte* params, bool recompute, float* grads,
                         int grad_slot) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  const int64_t numel = g.plan.units[size_t(unit)].padded_numel;
  // The embedding's backward reads only the tokens and the gradient: no upload.
  const bool needs_params = g.plan.layout.units[size_t(unit)].unit.kind != UnitKind::embedding;
  Result<int> slot = -1;
  if (needs_params) slot = g.upload(params, g.unit_bytes(unit));
  if (!slot) return slot.status();
  // The tied embedding adds to the lm_head's gradient the head left on the device.
  const bool tied = grad_slot < 0;
  int buffer = -1;
  float* device_grads = g.tied_grad;
  if (!tied) {
    Result<int> taken = g.take_grad_buffer(numel);
    if (!taken) return taken.status();
    buffer = *taken;
    device_grads = g.grad_buffers[size_t(buffer)];
  }
  const void* input = unit == 0 ? nullptr : g.checkpoints[size_t(unit - 1)];
  void* dinput = unit == 0 ? nullptr : g.activation_grad;
  Status status = g.units->backward(unit, needs_params ? g.param_slots[size_t(*slot)] : nullptr,
                                    g.batch(micro, 1.0f), input, g.activation_grad, dinput,
                                    device_grads, recompute, g.compute);
  if (status) status = g.send_gradients(device_grads, grads, numel, grad_slot, buffer);
  if (!needs_params) return status;
  Status released = g.computed_with(*slot);
  return status ? released : status;
}

Status GpuRank::synchronize() {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  for (cudaStream_t stream : {g.compute, g.to_device, g.to_host})
    if (Status s = cuda::check_cuda(cudaStreamSynchronize(stream), "waiting for the GPU"); !s)
      return s;
  return Status::ok();
}

Status GpuRank::gradients_ready(int grad_slot) {
  Impl& g = *impl_;
  const size_t index = size_t(grad_slot + 1);
  if (index >= g.slot_pending.size() || !g.slot_pending[index]) return Status::ok();
  if (Status s = g.select(); !s) return s;
  g.slot_pending[index] = 0;
  return cuda::check_cuda(cudaEventSynchronize(g.slot_sent[index]), "waiting for gradients");
}

#else  // built without CUDA

struct GpuRank::Impl {};
GpuRank::GpuRank(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GpuRank::~GpuRank() = default;

Result<std::unique_ptr<GpuRank>> GpuRank::create(const TrainingPlan&, int, tiers::DeviceTier&,
                                                 std::vector<tiers::DeviceBlock>&) {
  return Status::error("this strata was built without CUDA; run with --backend cpu");
}
Status GpuRank::forward(int, int, const std::byte*, const int32_t*, const int32_t*) {
  return Status::error("built without CUDA");
}
Result<double> GpuRank::head(int, const std::byte*, const std::byte*, float, float*, int) {
  return Status::error("built without CUDA");
}
Status GpuRank::backward(int, int, const std::byte*, bool, float*, int) {
  return Status::error("built without CUDA");
}
Status GpuRank::gradients_ready(int) {
  return Status::error("built without CUDA");
}
Status GpuRank::synchronize() {
  return Status::error("built without CUDA");
}
Status GpuRank::forward_resident(int, int, const std::byte*, const int32_t*, const int32_t*) {
  return Status::error("built without CUDA");
}
Result<double> GpuRank::head_resident(int, const std::byte*, const std::byte*, float, float*,
                                      float*, bool) {
  return Status::error("built without CUDA");
}
Status GpuRank::backward_resident(int, int, const std::byte*, bool, float*, bool) {
  return Status::error("built without CUDA");
}
Result<kernels::cpu::GradNormPartial> GpuRank::grad_norm(const float*, int64_t) {
  return Status::error("built without CUDA");
}
Status GpuRank::adamw(float*, float*, float*, const float*, std::byte*, int64_t,
                      const kernels::cpu::AdamWHyperparams&) {
  return Status::error("built without CUDA");
}

#endif

}  // namespace strata
