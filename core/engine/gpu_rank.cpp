#include "core/engine/gpu_rank.h"

#include <fmt/format.h>

#if STRATA_HAS_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <string>

#include "core/engine/rank_buffers.h"
#include "core/model/cuda_units.h"
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

// The GPU implementation.
class CudaGpuRank final : public GpuRank {
 public:
  struct Impl;
  explicit CudaGpuRank(std::unique_ptr<Impl> impl);
  ~CudaGpuRank() override;

  Status forward(int unit, int micro, const std::byte* params, const UnitBatch& batch) override;
  Result<double> head(int micro, const std::byte* params, const std::byte* tied_params,
                      const UnitBatch& batch, const GradTarget& target) override;
  Status backward(int unit, int micro, const std::byte* params, const UnitBatch& batch,
                  bool recompute, const GradTarget& target) override;
  Result<std::vector<uint8_t>> routed_experts(int unit, int micro,
                                              const std::byte* params) override;
  Status take_gathered_range(int unit, const std::byte* params, int64_t begin,
                             int64_t count) override;
  std::byte* saved_input(int level, int micro) override;
  Status saved_input_to_host(void* host, const void* device, int64_t bytes) override;
  Status saved_input_to_device(void* device, const void* host, int64_t bytes) override;
  Status gradients_ready(int grad_slot) override;
  Status synchronize() override;
  Status download(void* host, const void* device, int64_t bytes) override;
  Status upload(void* device, const void* host, int64_t bytes) override;
  Status accumulate(float* device, const float* host, int64_t numel, bool first) override;
  Result<kernels::cpu::GradNormPartial> grad_norm(const float* grads, int64_t numel) override;
  Status adamw(const kernels::cpu::AdamWShard& shard,
               const kernels::cpu::AdamWHyperparams& hyper) override;
  std::byte* new_parameter_buffer() const override;
  void forget_uploads(const std::byte* host) override;

 private:
  std::unique_ptr<Impl> impl_;
};

struct CudaGpuRank::Impl {
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
  // What each slot holds: the host parameters it was uploaded from, until
  // new ones arrive there (forget_uploads); consecutive computations on the
  // same unit (the layer-major schedule) read one upload.
  std::mutex slot_mutex;
  std::array<const std::byte*, kGpuParamSlots> slot_source{};
  std::array<int, kGpuParamSlots> slot_unit{};

  // Gradient buffers in rotation: zeroing one waits until its last copy to the host is done.
  std::array<float*, kGpuGradBuffers> grad_buffers{};
  std::array<cudaEvent_t, kGpuGradBuffers> grad_sent{};
  int next_grad_buffer = 0;
  std::vector<float*> tied_grads;  // [activation copies] (embedding padded_numel) fp32
  // TrainingPlan::gpu_grads_summed_on_device: a unit's gradient summed over
  // its micro-batches; the next unit's first waits until it went down (sum_sent).
  float* grad_sum = nullptr;  // (largest padded) fp32
  cudaEvent_t sum_sent = nullptr;
  cudaEvent_t computed = nullptr;
  // Per host gradient slot s (-1 - c for copy c of the tied embedding's, k for
  // rotating slot k), at index s + tied copies: copy done.
  std::vector<cudaEvent_t> slot_sent;
  std::vector<char> slot_pending;
  int tied_copies = 1;
  size_t sent_index(int grad_slot) const { return size_t(grad_slot + tied_copies); }

  // [saved-input copies] (saved-input levels, N, C) compute type: each unit's output, the next's
  // input
  std::vector<std::byte*> saved_input_copies;
  std::vector<std::byte*> activation_grads;  // [activation copies] (N, C) compute type
  // [activation copies] (N, V) compute type: a vocabulary-cut head's logits; none for a whole head
  std::vector<std::byte*> head_logits;
  // [activation copies] expert_chain_floats words: expert groups' or MLP parts' chain; none uncut
  std::vector<float*> expert_chains;
  std::byte* saved_input(int unit, int micro) const {
    const TrainingPlan::SavedInputPlace place = plan.saved_input_place(unit, micro);
    return saved_input_copies[size_t(place.copy)] + place.level * N * C * type_bytes;
  }
  std::byte* activation_grad(int micro) const {
    return activation_grads[size_t(plan.activation_copy(micro))];
  }
  int32_t* tokens = nullptr;       // (G, N)
  int32_t* targets = nullptr;      // (G, N)
  float* losses = nullptr;         // (N)
  std::vector<float> host_losses;  // (N)
  bool params_in_place = false;    // TrainingPlan::gpu_params_in_place
  bool grads_in_place = false;     // TrainingPlan::gpu_grads_in_place
  // The calls from other lanes (transfers, norm, AdamW) take turns; each
  // waits for its own work through `side_done`.
  std::mutex side;
  cudaEvent_t side_done = nullptr;
  // Spilled saved inputs move on a stream of their own (one at a
  // time: the activations lane runs them in turn), after the work enqueued
  // so far on the compute stream, which runs on meanwhile.
  cudaStream_t spill_stream = nullptr;
  cudaEvent_t saved_input_ready = nullptr, saved_input_copied = nullptr;
  // Gradients' home on the GPU: the gradient norm's result and scratch.
  cuda::GradNormResult* norm = nullptr;       // (1)
  cuda::GradNormResult* host_norm = nullptr;  // (1) pinned
  std::byte* norm_scratch = nullptr;
  int64_t norm_scratch_bytes = 0;
  float* reduced = nullptr;         // (largest padded) a reduced gradient on its way to its home
  std::byte* new_params = nullptr;  // (largest optimizer range) AdamW's copy for a host home

  explicit Impl(const TrainingPlan& p) : plan(p) {}
  ~Impl();

  Status select() {
    return cuda::check_cuda(cudaSetDevice(gpu), fmt::format("selecting GPU {}", gpu));
  }
  // A saved input between its device slot and pinned host memory; done when it returns.
  Status copy_saved_input(void* to, const void* from, int64_t bytes, cudaMemcpyKind kind) {
    if (Status s = select(); !s) return s;
    const char* what = kind == cudaMemcpyDeviceToHost ? "spilling a saved input"
                                                      : "restoring a saved input";
    if (Status s = cuda::check_cuda(cudaEventRecord(saved_input_ready, compute), what); !s) return s;
    if (Status s = cuda::check_cuda(cudaStreamWaitEvent(spill_stream, saved_input_ready, 0), what);
        !s)
      return s;
    if (Status s = cuda::check_cuda(cudaMemcpyAsync(to, from, size_t(bytes), kind, spill_stream),
                                    fmt::format("{} ({} bytes)", what, bytes));
        !s)
      return s;
    if (Status s = cuda::check_cuda(cudaEventRecord(saved_input_copied, spill_stream), what); !s)
      return s;
    // A restored input is read by work enqueued after this returns.
    if (kind == cudaMemcpyHostToDevice) {
      if (Status s = cuda::check_cuda(cudaStreamWaitEvent(compute, saved_input_copied, 0), what); !s)
        return s;
    }
    return cuda::check_cuda(cudaEventSynchronize(saved_input_copied), what);
  }
  // Uploads `bytes` of host parameters into the next slot but `keep` (a slot
  // the same computation reads: the head's beside its tied embedding);
  // returns the slot.
  Result<int> upload(const std::byte* params, int64_t bytes, int keep = -1);
  // The unit's parameters on the device: `params` in place, else uploaded
  // into a slot (*slot; -1 when in place) other than `keep`.
  Result<const std::byte*> unit_params(int unit, const std::byte* params, int* slot, int keep = -1);
  // The slot still holding `unit` uploaded from `params`, or -1.
  int uploaded_slot(int unit, const std::byte* params) {
    std::lock_guard lock(slot_mutex);
    for (int k = 0; k < kGpuParamSlots; ++k)
      if (slot_source[size_t(k)] == params && slot_unit[size_t(k)] == unit) return k;
    return -1;
  }
  // A side call's copy, in stream order after the computation enqueued so far; done on return.
  Status copy(void* to, const void* from, int64_t bytes, cudaMemcpyKind kind, const char* where) {
    std::lock_guard lock(side);
    if (Status s = select(); !s) return s;
    if (Status s = cuda::check_cuda(cudaMemcpyAsync(to, from, size_t(bytes), kind, compute),
                                    fmt::format("copying {} bytes {}", bytes, where));
        !s)
      return s;
    return side_wait("waiting for a copy between host and GPU");
  }
  // Waits for everything enqueued on the compute stream so far (side calls).
  Status side_wait(const char* what) {
    if (Status s = cuda::check_cuda(cudaEventRecord(side_done, compute), what); !s) return s;
    return cuda::check_cuda(cudaEventSynchronize(side_done), what);
  }
  // After the computation that reads slot k is enqueued: frees it and waits for its upload.
  Status computed_with(int slot);
  // Zeroes the next gradient buffer on the compute stream, after its last copy out.
  Result<int> take_grad_buffer(int64_t numel);
  // Sends `device` (numel fp32) to host `grads` once the computation so far is done.
  Status send_gradients(const float* device, float* grads, int64_t numel, int grad_slot,
                        int buffer);
  // A computation's fresh gradient (in rotating buffer `buffer`, or -1): sent,
  // or added to the sum over the micro-batches, which is sent after the last.
  Status deliver(const float* fresh, const GradTarget& target, int64_t numel, int buffer);
  // Enqueues the upload of micro-batch `micro`'s ids (before the embedding's forward).
  Status upload_ids(int micro, const int32_t* tokens, const int32_t* targets);
  // The head on device parameters; losses summed on the host.
  Result<double> run_head(int micro, const void* params, const void* tied_params,
                          const UnitBatch& host, float* grads, float* tied_grads);
  Status zero(float* grads, int64_t numel) {
    return cuda::check_cuda(cudaMemsetAsync(grads, 0, size_t(numel) * 4, compute),
                            "zeroing a unit gradient");
  }
  // Micro-batch `micro` as the device holds it, with the host's loss scale
  // and router statistics.
  CudaUnitBatch batch(int micro, const UnitBatch& host) const {
    CudaUnitBatch b;
    b.tokens = tokens + int64_t(micro) * N;
    b.targets = targets + int64_t(micro) * N;
    b.loss_scale = host.loss_scale;
    b.router = host.router;
    b.aux_loss_scale = host.aux_loss_scale;
    if (!head_logits.empty()) b.head_logits = head_logits[size_t(plan.activation_copy(micro))];
    if (!expert_chains.empty()) b.expert_chain = expert_chains[size_t(plan.activation_copy(micro))];
    return b;
  }
  int64_t unit_bytes(int unit) const { return plan.units[size_t(unit)].padded_numel * type_bytes; }
};

CudaGpuRank::Impl::~Impl() {
  cudaSetDevice(gpu);
  if (compute) cudaStreamSynchronize(compute);
  if (to_device) cudaStreamSynchronize(to_device);
  if (to_host) cudaStreamSynchronize(to_host);
  if (spill_stream) cudaStreamSynchronize(spill_stream);
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
  if (sum_sent) cudaEventDestroy(sum_sent);
  if (side_done) cudaEventDestroy(side_done);
  if (saved_input_ready) cudaEventDestroy(saved_input_ready);
  if (saved_input_copied) cudaEventDestroy(saved_input_copied);
  if (host_norm) cudaFreeHost(host_norm);
  for (cudaStream_t s : {compute, to_device, to_host, spill_stream})
    if (s) cudaStreamDestroy(s);
}

Result<int> CudaGpuRank::Impl::upload(const std::byte* params, int64_t bytes, int keep) {
  int k = next_param_slot;
  if (k == keep) k = (k + 1) % kGpuParamSlots;
  next_param_slot = (k + 1) % kGpuParamSlots;
  {
    std::lock_guard lock(slot_mutex);
    slot_source[size_t(k)] = nullptr;
  }
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

Status CudaGpuRank::Impl::computed_with(int slot) {
  if (Status s = cuda::check_cuda(cudaEventRecord(slot_free[size_t(slot)], compute),
                                  "recording a parameter slot's release");
      !s)
    return s;
  // The host memory the upload read belongs to the caller again once this returns.
  return cuda::check_cuda(cudaEventSynchronize(uploaded[size_t(slot)]),
                          "waiting for a parameter upload");
}

Result<const std::byte*> CudaGpuRank::Impl::unit_params(int unit, const std::byte* params,
                                                        int* slot, int keep) {
  *slot = -1;
  if (params_in_place) return params;
  // Still there from an earlier computation: the compute stream is already past its upload.
  if (const int k = uploaded_slot(unit, params); k >= 0) {
    *slot = k;
    return param_slots[size_t(k)];
  }
  Result<int> taken = upload(params, unit_bytes(unit), keep);
  if (!taken) return taken.status();
  *slot = *taken;
  std::lock_guard lock(slot_mutex);
  slot_source[size_t(*taken)] = params;
  slot_unit[size_t(*taken)] = unit;
  return param_slots[size_t(*taken)];
}

void CudaGpuRank::forget_uploads(const std::byte* host) {
  Impl& g = *impl_;
  std::lock_guard lock(g.slot_mutex);
  for (const std::byte*& source : g.slot_source)
    if (source == host) source = nullptr;
}

Result<int> CudaGpuRank::Impl::take_grad_buffer(int64_t numel) {
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

Status CudaGpuRank::Impl::send_gradients(const float* device, float* grads, int64_t numel,
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
  const size_t index = sent_index(grad_slot);
  if (Status s =
          cuda::check_cuda(cudaEventRecord(slot_sent[index], to_host), "recording a gradient copy");
      !s)
    return s;
  slot_pending[index] = 1;
  return Status::ok();
}

Status CudaGpuRank::Impl::deliver(const float* fresh, const GradTarget& target, int64_t numel,
                                  int buffer) {
  if (!target.sum_on_device) return send_gradients(fresh, target.grads, numel, target.slot, buffer);
  if (grad_sum == nullptr) return Status::error("GpuRank: no gradient sum buffer (plan error)");
  // In stream order after the computation; the rotating buffer is zeroed
  // for its next use on the same stream, after this has read it.
  if (target.sum_first) {
    if (Status s = cuda::check_cuda(cudaStreamWaitEvent(compute, sum_sent, 0),
                                    "ordering the gradient sum's reuse");
        !s)
      return s;
    if (Status s = cuda::check_cuda(
            cudaMemcpyAsync(grad_sum, fresh, size_t(numel) * 4, cudaMemcpyDeviceToDevice, compute),
            "starting a gradient sum");
        !s)
      return s;
  } else if (Status s = cuda::residual_forward(grad_sum, grad_sum, fresh, numel, cuda::DType::f32,
                                               compute);
             !s) {
    return s;
  }
  if (!target.send) return Status::ok();
  if (Status s = send_gradients(grad_sum, target.grads, numel, target.slot, -1); !s) return s;
  return cuda::check_cuda(cudaEventRecord(sum_sent, to_host), "recording a gradient sum's copy");
}

CudaGpuRank::CudaGpuRank(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaGpuRank::~CudaGpuRank() = default;

Result<std::unique_ptr<GpuRank>> GpuRank::create(const TrainingPlan& plan, int gpu_index,
                                                 tiers::DeviceTier& device,
                                                 std::vector<tiers::DeviceBlock>& blocks) {
  if (!device.on_gpu())
    return Status::error(
        "the CUDA backend needs its device tier on a GPU; none is usable here (run with "
        "--backend cpu)");
  const PlanInput& in = plan.input;
  auto impl = std::make_unique<CudaGpuRank::Impl>(plan);
  CudaGpuRank::Impl& g = *impl;
  g.gpu = gpu_index;
  if (Status s = g.select(); !s) return s;
  g.type = dtype_of(in.precision);
  g.type_bytes = int64_t(cuda::dtype_size(g.type));
  g.N = plan.tokens_per_micro;
  g.C = in.model.hidden_size;
  int64_t largest_padded = 0;
  for (const UnitPlacement& p : plan.units)
    largest_padded = std::max(largest_padded, p.padded_numel);

  for (cudaStream_t* s : {&g.compute, &g.to_device, &g.to_host, &g.spill_stream})
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
  if (Status s = event(g.sum_sent); !s) return s;
  g.tied_copies = plan.activation_copies();
  g.slot_sent.assign(size_t(plan.grad_slots + g.tied_copies), nullptr);
  g.slot_pending.assign(g.slot_sent.size(), 0);
  for (cudaEvent_t& e : g.slot_sent)
    if (Status s = event(e); !s) return s;

  // The device working set: the plan's buffers of owner `gpu`, walked (core/engine/rank_buffers.h).
  g.params_in_place = plan.gpu_params_in_place();
  g.grads_in_place = plan.gpu_grads_in_place();
  if (Status s = event(g.side_done); !s) return s;
  if (Status s = event(g.saved_input_ready); !s) return s;
  if (Status s = event(g.saved_input_copied); !s) return s;
  Result<RankBuffers> taken = RankBuffers::allocate(
      plan, BufferOwner::gpu,
      [&](tiers::Tier, uint64_t bytes, const std::string& what) -> Result<std::byte*> {
        Result<tiers::DeviceBlock> block = device.allocate(bytes, what);
        if (!block) return block.status();
        blocks.push_back(*block);
        return block->data;
      });
  if (!taken) return taken.status();
  const RankBuffers& b = *taken;
  using R = BufferRole;
  for (int k = 0; k < kGpuParamSlots; ++k) g.param_slots[size_t(k)] = b.at(R::gpu_param_slots, k);
  for (int k = 0; k < kGpuGradBuffers; ++k)
    g.grad_buffers[size_t(k)] = b.as<float>(R::gpu_unit_gradients, k);
  g.tied_grads = b.all_as<float>(R::gpu_tied_gradient);
  if (std::byte* scratch = b.at(R::gpu_grad_norm_scratch)) {
    // The result first, then the reduction's scratch.
    g.norm_scratch_bytes = int64_t(cuda::grad_norm_scratch_bytes(largest_padded));
    g.norm = reinterpret_cast<cuda::GradNormResult*>(scratch);
    g.norm_scratch = scratch + 4096;
    if (Status s = cuda::check_cuda(
            cudaMallocHost(reinterpret_cast<void**>(&g.host_norm), sizeof(cuda::GradNormResult)),
            "allocating a pinned gradient norm");
        !s)
      return s;
  }
  g.reduced = b.as<float>(R::gpu_reduced_gradient);
  g.grad_sum = b.as<float>(R::gpu_gradient_sum);
  g.new_params = b.at(R::gpu_new_parameters);
  g.saved_input_copies = b.all_as<std::byte>(R::gpu_saved_inputs);
  g.activation_grads = b.all_as<std::byte>(R::gpu_activation_gradient);
  g.head_logits = b.all_as<std::byte>(R::gpu_head_logits);
  g.expert_chains = b.all_as<float>(R::gpu_expert_chain);
  g.tokens = b.as<int32_t>(R::gpu_tokens_and_targets);
  g.targets = g.tokens + g.N * in.grad_accum;
  g.losses = b.as<float>(R::gpu_token_losses);
  g.host_losses.resize(size_t(g.N));
  std::byte* matmul_workspace = b.at(R::gpu_matmul_workspace);
  std::byte* workspace = b.at(R::gpu_unit_working_set);
  const int64_t workspace_bytes = plan.buffer(R::gpu_unit_working_set)->elements;

  Result<std::unique_ptr<cuda::Matmuls>> matmuls =
      cuda::Matmuls::create_in(matmul_workspace, size_t(kGpuMatmulWorkspaceBytes));
  if (!matmuls) return matmuls.status();
  g.matmuls = std::move(*matmuls);
  Result<std::unique_ptr<CudaUnits>> created = CudaUnits::create(
      plan.layout, in.micro_batch, in.seq_len, g.type, workspace, workspace_bytes, *g.matmuls);
  if (!created) return created.status();
  g.units = std::move(*created);
  return std::unique_ptr<GpuRank>(new CudaGpuRank(std::move(impl)));
}

Status CudaGpuRank::forward(int unit, int micro, const std::byte* params, const UnitBatch& batch) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  if (unit == 0) {
    if (Status s = g.upload_ids(micro, batch.tokens, batch.targets); !s) return s;
  }
  int slot = -1;
  Result<const std::byte*> device_params = g.unit_params(unit, params, &slot);
  if (!device_params) return device_params.status();
  const void* input = unit == 0 ? nullptr : g.saved_input(unit - 1, micro);
  Status status = g.units->forward(unit, *device_params, g.batch(micro, batch), input,
                                   g.saved_input(unit, micro), g.compute);
  if (slot < 0) return status;
  Status released = g.computed_with(slot);
  return status ? released : status;
}

Result<std::vector<uint8_t>> CudaGpuRank::routed_experts(int unit, int micro,
                                                         const std::byte* params) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  std::vector<uint8_t> used(size_t(g.plan.layout.config.num_experts), 0);
  // A piece of experts takes the routing its router piece left in the chain.
  if (g.plan.layout.units[size_t(unit)].unit.piece == LayerPiece::experts) {
    Status status = g.units->route_from_chain(unit, g.batch(micro, {}), used.data(), g.compute);
    return status ? Result<std::vector<uint8_t>>(std::move(used)) : status;
  }
  int slot = -1;
  Result<const std::byte*> device_params = g.unit_params(unit, params, &slot);
  if (!device_params) return device_params.status();
  Status status =
      g.units->route(unit, *device_params, g.saved_input(unit - 1, micro), used.data(), g.compute);
  if (slot < 0) return status ? Result<std::vector<uint8_t>>(std::move(used)) : status;
  Status released = g.computed_with(slot);
  if (!status) return status;
  if (!released) return released;
  return used;
}

Status CudaGpuRank::take_gathered_range(int unit, const std::byte* params, int64_t begin,
                                        int64_t count) {
  Impl& g = *impl_;
  if (g.params_in_place) return Status::ok();
  const int k = g.uploaded_slot(unit, params);
  if (k < 0) return Status::ok();  // the next computation uploads it whole
  std::byte* device = g.param_slots[size_t(k)];
  count = std::min(count, g.plan.units[size_t(unit)].padded_numel - begin);
  const int64_t offset = begin * g.type_bytes;
  // On the compute stream, so the computations enqueued after it read it.
  return g.copy(device + offset, params + offset, count * g.type_bytes, cudaMemcpyHostToDevice,
                "taking the routed experts");
}

Result<double> CudaGpuRank::head(int micro, const std::byte* params, const std::byte* tied_params,
                                 const UnitBatch& batch, const GradTarget& target) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  const int head = int(g.plan.units.size()) - 1;
  const int64_t numel = g.plan.units[size_t(head)].padded_numel;
  const int64_t tied_numel = g.plan.units[0].padded_numel;
  int slot = -1, tied_slot = -1;
  Result<const std::byte*> device_params = g.unit_params(head, params, &slot);
  if (!device_params) return device_params.status();
  Result<const std::byte*> device_tied = static_cast<const std::byte*>(nullptr);
  // The embedding's upload must not land in the slot the head's parameters
  // were found in (the oldest upload is the next slot taken).
  if (tied_params != nullptr) device_tied = g.unit_params(0, tied_params, &tied_slot, slot);
  if (!device_tied) {
    // The head's upload may be in flight: the slot is released only once it is done.
    if (slot >= 0) (void)g.computed_with(slot);
    return device_tied.status();
  }

  Status status = Status::ok();
  float* device_grads = target.grads;
  float* device_tied_grads = target.tied;
  int buffer = -1;
  if (g.grads_in_place) {
    if (target.zero_first) {
      status = g.zero(target.grads, numel);
      if (status && target.tied != nullptr) status = g.zero(target.tied, tied_numel);
    }
  } else {
    if (tied_params != nullptr) {
      // This copy's last tied gradient must have reached the host first.
      const int copy = g.plan.activation_copy(micro);
      status =
          cuda::check_cuda(cudaStreamWaitEvent(g.compute, g.slot_sent[g.sent_index(-1 - copy)], 0),
                           "ordering the tied embedding's gradient");
      if (status) status = g.zero(g.tied_grads[size_t(copy)], tied_numel);
      device_tied_grads = g.tied_grads[size_t(copy)];
    }
    Result<int> taken = status ? g.take_grad_buffer(numel) : Result<int>(status);
    if (taken) {
      buffer = *taken;
      device_grads = g.grad_buffers[size_t(buffer)];
    } else {
      status = taken.status();
    }
  }
  Result<double> loss = status;
  if (status) {
    loss = g.run_head(micro, *device_params, *device_tied, batch, device_grads,
                      tied_params != nullptr ? device_tied_grads : nullptr);
    status = loss.status();
  }
  if (status && !g.grads_in_place) status = g.deliver(device_grads, target, numel, buffer);
  Status released = slot >= 0 ? g.computed_with(slot) : Status::ok();
  if (tied_slot >= 0 && released) released = g.computed_with(tied_slot);
  if (status) status = released;
  if (!status) return status;
  return loss;
}

Status CudaGpuRank::Impl::upload_ids(int micro, const int32_t* host_tokens,
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

Result<double> CudaGpuRank::Impl::run_head(int micro, const void* params, const void* tied_params,
                                           const UnitBatch& host, float* grads, float* tied_grads) {
  const int head = int(plan.units.size()) - 1;
  Status status = units->head_forward_backward(params, tied_params, batch(micro, host),
                                               saved_input(head - 1, micro), activation_grad(micro),
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

Result<kernels::cpu::GradNormPartial> CudaGpuRank::grad_norm(const float* grads, int64_t numel) {
  Impl& g = *impl_;
  if (g.norm == nullptr)
    return Status::error("GpuRank::grad_norm: the gradients' home is not on the GPU");
  std::lock_guard lock(g.side);
  if (Status s = g.select(); !s) return s;
  if (Status s = cuda::grad_norm_squared(g.norm, grads, cuda::DType::f32, numel, g.norm_scratch,
                                         size_t(g.norm_scratch_bytes), g.compute);
      !s)
    return s;
  if (Status s = cuda::check_cuda(cudaMemcpyAsync(g.host_norm, g.norm, sizeof(cuda::GradNormResult),
                                                  cudaMemcpyDeviceToHost, g.compute),
                                  "reading a gradient norm");
      !s)
    return s;
  if (Status s = g.side_wait("waiting for a gradient norm"); !s) return s;
  const cuda::GradNormResult result = *g.host_norm;
  kernels::cpu::GradNormPartial partial;
  partial.sum_squares = result.sum_squares;
  partial.nonfinite = result.nonfinite != 0;
  return partial;
}

Status CudaGpuRank::adamw(const kernels::cpu::AdamWShard& shard,
                          const kernels::cpu::AdamWHyperparams& hyper) {
  Impl& g = *impl_;
  std::lock_guard lock(g.side);
  if (Status s = g.select(); !s) return s;
  // The kernel writes bf16 and fp16 copies in its pass; fp32 parameters apart
  // from their master are the master itself.
  const bool copies_master =
      shard.copy != nullptr && shard.copy_type == kernels::cpu::ElementType::f32;
  kernels::cpu::AdamWShard kernel_shard = shard;
  if (copies_master) kernel_shard.copy = nullptr;
  if (Status s = cuda::adamw_step(kernel_shard, hyper, g.compute); !s) return s;
  if (!copies_master) return Status::ok();
  return cuda::check_cuda(cudaMemcpyAsync(shard.copy, shard.master, size_t(shard.numel) * 4,
                                          cudaMemcpyDeviceToDevice, g.compute),
                          "copying fp32 parameters from their master");
}

std::byte* CudaGpuRank::new_parameter_buffer() const {
  return impl_->new_params;
}

std::byte* CudaGpuRank::saved_input(int level, int micro) {
  return impl_->saved_input(level, micro);
}

Status CudaGpuRank::saved_input_to_host(void* host, const void* device, int64_t bytes) {
  return impl_->copy_saved_input(host, device, bytes, cudaMemcpyDeviceToHost);
}

Status CudaGpuRank::saved_input_to_device(void* device, const void* host, int64_t bytes) {
  return impl_->copy_saved_input(device, host, bytes, cudaMemcpyHostToDevice);
}

Status CudaGpuRank::download(void* host, const void* device, int64_t bytes) {
  return impl_->copy(host, device, bytes, cudaMemcpyDeviceToHost, "from the GPU");
}

Status CudaGpuRank::upload(void* device, const void* host, int64_t bytes) {
  return impl_->copy(device, host, bytes, cudaMemcpyHostToDevice, "to the GPU");
}

Status CudaGpuRank::accumulate(float* device, const float* host, int64_t numel, bool first) {
  Impl& g = *impl_;
  if (!first && g.reduced == nullptr)
    return Status::error("GpuRank::accumulate: the gradients' home is not on the GPU");
  std::lock_guard lock(g.side);
  if (Status s = g.select(); !s) return s;
  float* into = first ? device : g.reduced;
  if (Status s = cuda::check_cuda(
          cudaMemcpyAsync(into, host, size_t(numel) * 4, cudaMemcpyHostToDevice, g.compute),
          fmt::format("copying {} bytes of reduced gradients to the GPU", numel * 4));
      !s)
    return s;
  if (!first) {
    if (Status s =
            cuda::residual_forward(device, device, g.reduced, numel, cuda::DType::f32, g.compute);
        !s)
      return s;
  }
  // The host buffer is the caller's again, and `reduced` free for the next call.
  return g.side_wait("waiting for reduced gradients to reach the GPU");
}

Status CudaGpuRank::backward(int unit, int micro, const std::byte* params, const UnitBatch& batch,
                             bool recompute, const GradTarget& target) {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  const int64_t numel = g.plan.units[size_t(unit)].padded_numel;
  // The embedding's backward reads only the tokens and the gradient: no upload.
  const bool needs_params = g.plan.layout.units[size_t(unit)].unit.kind != UnitKind::embedding;
  int slot = -1;
  Result<const std::byte*> device_params = static_cast<const std::byte*>(nullptr);
  if (needs_params) device_params = g.unit_params(unit, params, &slot);
  if (!device_params) return device_params.status();
  Status status = Status::ok();
  int buffer = -1;
  float* device_grads = target.grads;
  if (g.grads_in_place) {
    if (target.zero_first) status = g.zero(target.grads, numel);
  } else if (target.slot < 0) {
    // The head left the lm_head's gradient here.
    device_grads = g.tied_grads[size_t(-1 - target.slot)];
  } else {
    Result<int> taken = g.take_grad_buffer(numel);
    if (taken) {
      buffer = *taken;
      device_grads = g.grad_buffers[size_t(buffer)];
    } else {
      status = taken.status();
    }
  }
  const void* input = unit == 0 ? nullptr : g.saved_input(unit - 1, micro);
  void* dy = g.activation_grad(micro);
  void* dinput = unit == 0 ? nullptr : dy;
  if (status)
    status = g.units->backward(unit, *device_params, g.batch(micro, batch), input, dy, dinput,
                               device_grads, recompute, g.compute);
  if (status && !g.grads_in_place) status = g.deliver(device_grads, target, numel, buffer);
  if (slot < 0) return status;
  Status released = g.computed_with(slot);
  return status ? released : status;
}

Status CudaGpuRank::synchronize() {
  Impl& g = *impl_;
  if (Status s = g.select(); !s) return s;
  for (cudaStream_t stream : {g.compute, g.to_device, g.to_host, g.spill_stream})
    if (Status s = cuda::check_cuda(cudaStreamSynchronize(stream), "waiting for the GPU"); !s)
      return s;
  return Status::ok();
}

Status CudaGpuRank::gradients_ready(int grad_slot) {
  Impl& g = *impl_;
  const size_t index = g.sent_index(grad_slot);
  if (index >= g.slot_pending.size() || !g.slot_pending[index]) return Status::ok();
  if (Status s = g.select(); !s) return s;
  g.slot_pending[index] = 0;
  return cuda::check_cuda(cudaEventSynchronize(g.slot_sent[index]), "waiting for gradients");
}

#else  // built without CUDA

Result<std::unique_ptr<GpuRank>> GpuRank::create(const TrainingPlan&, int, tiers::DeviceTier&,
                                                 std::vector<tiers::DeviceBlock>&) {
  return Status::error("this strata was built without CUDA; run with --backend cpu");
}
#endif

}  // namespace strata
