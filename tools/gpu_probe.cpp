// The GPU part of `strata plan --probe --backend cuda` (tools/hardware_probe.h):
// the first GPU's matmul rates at the model's linear-layer shapes (cuBLASLt,
// as the CUDA backend runs them), its memory's copy bandwidth, and PCIe each
// way between pinned host memory and the device, a launch's and a host wait's
// time (core/plan/gpu_launches.h). Timed with CUDA events (the launches and
// waits by the host's clock), the median of several runs after a warm-up.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "kernels/backend.h"
#include "tools/hardware_probe.h"

#if STRATA_HAS_CUDA
#include <cuda_runtime_api.h>

#include "kernels/cuda/matmul.h"
#include "kernels/cuda/ops.h"
#endif

namespace strata::tools {

#if STRATA_HAS_CUDA
namespace {

using kernels::cuda::check_cuda;
using kernels::cuda::DType;

// Device and pinned host memory, freed on every path out of the probe.
struct DeviceBuffer {
  void* data = nullptr;
  ~DeviceBuffer() {
    if (data != nullptr) (void)cudaFree(data);
  }
};
struct PinnedBuffer {
  void* data = nullptr;
  ~PinnedBuffer() {
    if (data != nullptr) (void)cudaFreeHost(data);
  }
};
struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Events() {
    if (start != nullptr) (void)cudaEventDestroy(start);
    if (stop != nullptr) (void)cudaEventDestroy(stop);
  }
};
struct Stream {
  cudaStream_t stream = nullptr;
  ~Stream() {
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

Status allocate(DeviceBuffer& buffer, size_t bytes) {
  return check_cuda(cudaMalloc(&buffer.data, bytes),
                    fmt::format("GPU probe: cudaMalloc of {} MiB", bytes >> 20));
}

// The median seconds of `runs` runs of `work` (enqueued on `stream`), after one warm-up.
template <typename Work>
Result<double> median_on_device(cudaStream_t stream, Events& events, int runs, Work&& work) {
  if (Status s = work(); !s) return s;
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    if (Status s = check_cuda(cudaEventRecord(events.start, stream), "GPU probe: cudaEventRecord");
        !s)
      return s;
    if (Status s = work(); !s) return s;
    if (Status s = check_cuda(cudaEventRecord(events.stop, stream), "GPU probe: cudaEventRecord");
        !s)
      return s;
    if (Status s = check_cuda(cudaEventSynchronize(events.stop), "GPU probe: a timed run"); !s)
      return s;
    float ms = 0;
    if (Status s = check_cuda(cudaEventElapsedTime(&ms, events.start, events.stop),
                              "GPU probe: cudaEventElapsedTime");
        !s)
      return s;
    times.push_back(double(ms) * 1e-3);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// The median seconds of `runs` runs of `work` (which waits for what it
// enqueues) by the host's clock, after one warm-up.
template <typename Work>
Result<double> median_on_host(int runs, Work&& work) {
  if (Status s = work(); !s) return s;
  std::vector<double> times;
  for (int i = 0; i < runs; ++i) {
    const auto start = std::chrono::steady_clock::now();
    if (Status s = work(); !s) return s;
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace

Status probe_gpu(const ProbeOptions& options, HardwareProfile& p) {
  const kernels::GpuQuery gpus = kernels::query_gpus();
  if (gpus.devices.empty())
    return Status::invalid_argument(
        fmt::format("--probe --backend cuda: {}; --hardware PRESET predicts for a GPU "
                    "(h100-sxm, h200, a100-80gb, rtx-4090, l40s)",
                    gpus.why_none));
  const kernels::GpuInfo& gpu = gpus.devices.front();
  if (Status s = check_cuda(cudaSetDevice(gpu.index), "GPU probe: cudaSetDevice"); !s) return s;
  Stream stream;
  Events events;
  if (Status s = check_cuda(cudaStreamCreate(&stream.stream), "GPU probe: cudaStreamCreate"); !s)
    return s;
  if (Status s = check_cuda(cudaEventCreate(&events.start), "GPU probe: cudaEventCreate"); !s)
    return s;
  if (Status s = check_cuda(cudaEventCreate(&events.stop), "GPU probe: cudaEventCreate"); !s)
    return s;
  p.gpu = true;
  p.name += " (" + gpu.name + ")";
  p.matmul_efficiency = 1.0;  // measured at the model's shapes, not a peak
  p.memory_gib = double(gpu.total_bytes) / double(int64_t(1) << 30);

  // The decoder layer's products at up to 8192 tokens: q (C -> H*D), gate and
  // up (C -> I), down (I -> C); the rate over the three.
  const ModelConfig& m = options.model;
  const int64_t N = std::min<int64_t>(options.micro_batch * options.seq_len, 8192);
  const int64_t D = m.head_dim > 0 ? m.head_dim : m.hidden_size / m.num_attention_heads;
  const int64_t C = m.hidden_size, I = m.intermediate_size, Q = m.num_attention_heads * D;
  struct Shape {
    int64_t in, out;
  };
  const Shape shapes[] = {{C, Q}, {C, I}, {I, C}};
  const int64_t widest = std::max({C, I, Q});
  DeviceBuffer input, weight, output;
  if (Status s = allocate(input, size_t(N * widest) * 4); !s) return s;
  if (Status s = allocate(weight, size_t(widest * widest) * 4); !s) return s;
  if (Status s = allocate(output, size_t(N * widest) * 4); !s) return s;
  for (auto [buffer, size] : {std::pair{input.data, size_t(N * widest) * 4},
                              std::pair{weight.data, size_t(widest * widest) * 4}})
    if (Status s = check_cuda(cudaMemsetAsync(buffer, 0x3c, size, stream.stream),
                              "GPU probe: cudaMemsetAsync");
        !s)
      return s;
  Result<std::unique_ptr<kernels::cuda::Matmuls>> matmuls = kernels::cuda::Matmuls::create();
  if (!matmuls) return matmuls.status().with_context("GPU probe");
  for (auto [type, rate] : {std::pair{DType::bf16, &p.matmul_tflops_bf16},
                            std::pair{DType::f16, &p.matmul_tflops_fp16},
                            std::pair{DType::f32, &p.matmul_tflops_fp32}}) {
    double flops = 0, seconds = 0;
    for (const Shape& shape : shapes) {
      Result<double> t = median_on_device(stream.stream, events, 5, [&] {
        return (*matmuls)->forward(output.data, input.data, weight.data, N, shape.in, shape.out,
                                   type, false, stream.stream);
      });
      if (!t) return t.status();
      flops += 2.0 * double(N) * double(shape.in) * double(shape.out);
      seconds += *t;
    }
    *rate = flops / seconds / 1e12;
  }

  // The device's memory: a copy within it reads and writes each byte.
  const size_t bytes = size_t(256) << 20;
  DeviceBuffer from, to;
  if (Status s = allocate(from, bytes); !s) return s;
  if (Status s = allocate(to, bytes); !s) return s;
  Result<double> copy = median_on_device(stream.stream, events, 5, [&] {
    return check_cuda(cudaMemcpyAsync(to.data, from.data, bytes, cudaMemcpyDeviceToDevice,
                                      stream.stream),
                      "GPU probe: a device copy");
  });
  if (!copy) return copy.status();
  p.memory_gbps = 2.0 * double(bytes) / *copy / 1e9;

  // PCIe each way, from and to pinned host memory, and a small copy's latency.
  PinnedBuffer host;
  if (Status s = check_cuda(cudaMallocHost(&host.data, bytes),
                            fmt::format("GPU probe: cudaMallocHost of {} MiB", bytes >> 20));
      !s)
    return s;
  for (auto [kind, gbps] : {std::pair{cudaMemcpyHostToDevice, &p.pcie_h2d_gbps},
                            std::pair{cudaMemcpyDeviceToHost, &p.pcie_d2h_gbps}}) {
    void* target = kind == cudaMemcpyHostToDevice ? to.data : host.data;
    const void* source = kind == cudaMemcpyHostToDevice ? host.data : from.data;
    Result<double> t = median_on_device(stream.stream, events, 5, [&] {
      return check_cuda(cudaMemcpyAsync(target, source, bytes, kind, stream.stream),
                        "GPU probe: a PCIe copy");
    });
    if (!t) return t.status();
    *gbps = double(bytes) / *t / 1e9;
  }
  Result<double> small = median_on_device(stream.stream, events, 21, [&] {
    return check_cuda(
        cudaMemcpyAsync(to.data, host.data, 4, cudaMemcpyHostToDevice, stream.stream),
        "GPU probe: a small PCIe copy");
  });
  if (!small) return small.status();
  p.pcie_latency_us = *small * 1e6;
  // A launch and a host wait, timed from the host as the units' loops meet
  // them (core/plan/gpu_launches.h): small products (8 rows) back to back,
  // then one wait, per product; a small copy down and the wait for it.
  constexpr int kLaunches = 256;
  Result<double> launch = median_on_host(5, [&]() -> Status {
    for (int i = 0; i < kLaunches; ++i)
      if (Status s = (*matmuls)->forward(output.data, input.data, weight.data, 8, shapes[0].in,
                                         shapes[0].out, DType::bf16, false, stream.stream);
          !s)
        return s;
    return check_cuda(cudaStreamSynchronize(stream.stream), "GPU probe: small products");
  });
  if (!launch) return launch.status();
  p.launch_us = *launch / kLaunches * 1e6;
  Result<double> wait = median_on_host(21, [&]() -> Status {
    if (Status s = check_cuda(
            cudaMemcpyAsync(host.data, from.data, 4, cudaMemcpyDeviceToHost, stream.stream),
            "GPU probe: a small copy down");
        !s)
      return s;
    return check_cuda(cudaStreamSynchronize(stream.stream), "GPU probe: a host wait");
  });
  if (!wait) return wait.status();
  p.host_wait_us = *wait * 1e6;
  // Ranks of one process share this GPU: their collectives are device copies.
  p.intra_node_gbps = p.memory_gbps / 2;
  p.intra_node_latency_us = p.pcie_latency_us;
  if (options.progress)
    options.progress(fmt::format(
        "{}: matmuls at {} tokens {:.0f} TFLOP/s bf16, {:.0f} fp16, {:.1f} fp32; memory {:.0f} "
        "GB/s (read + written), {:.0f} GiB; PCIe {:.1f} GB/s up, {:.1f} down, {:.0f} us a copy; "
        "{:.1f} us a launch, {:.0f} us a host wait",
        gpu.name, N, p.matmul_tflops_bf16, p.matmul_tflops_fp16, p.matmul_tflops_fp32,
        p.memory_gbps, p.memory_gib, p.pcie_h2d_gbps, p.pcie_d2h_gbps, p.pcie_latency_us,
        p.launch_us, p.host_wait_us));
  return Status::ok();
}

#else

Status probe_gpu(const ProbeOptions&, HardwareProfile&) {
  return Status::invalid_argument(
      "--probe --backend cuda: this strata was built without CUDA; --hardware PRESET predicts "
      "for a GPU (h100-sxm, h200, a100-80gb, rtx-4090, l40s)");
}

#endif

}  // namespace strata::tools
