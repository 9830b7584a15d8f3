#include "tiers/device_tier.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "io/base/sizes.h"
#include "io/base/status.h"
#include "io/swap_directory.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::tiers {
namespace {

constexpr uint64_t kAlignment = 4096;

#ifdef STRATA_HAS_CUDA
Status cuda_status(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return Status::ok();
  return Status::error(fmt::format("device tier: {}: {}", what, cudaGetErrorString(error)));
}

// Enqueues one copy on `stream` and records an event after it. On failure
// nothing is left behind and `event_out` is untouched.
Status enqueue_copy(void* destination, const void* source, uint64_t bytes, cudaMemcpyKind kind,
                    void* stream_handle, const char* what, void*& event_out) {
  cudaStream_t stream = static_cast<cudaStream_t>(stream_handle);
  cudaEvent_t event = nullptr;
  Status status = cuda_status(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                              "creating a copy event");
  if (!status) return status;
  status = cuda_status(cudaMemcpyAsync(destination, source, bytes, kind, stream), what);
  if (status) status = cuda_status(cudaEventRecord(event, stream), "recording a copy event");
  if (!status) {
    cudaEventDestroy(event);
    return status;
  }
  event_out = event;
  return status;
}
#endif

}  // namespace

DeviceCopy::DeviceCopy(DeviceCopy&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)), status_(std::move(other.status_)) {}

DeviceCopy& DeviceCopy::operator=(DeviceCopy&& other) noexcept {
  if (this != &other) {
    (void)wait();
    event_ = std::exchange(other.event_, nullptr);
    status_ = std::move(other.status_);
  }
  return *this;
}

DeviceCopy::~DeviceCopy() {
  (void)wait();
}

bool DeviceCopy::is_done() const {
#ifdef STRATA_HAS_CUDA
  if (event_) return cudaEventQuery(static_cast<cudaEvent_t>(event_)) != cudaErrorNotReady;
#endif
  return true;
}

Status DeviceCopy::wait() {
#ifdef STRATA_HAS_CUDA
  if (event_) {
    cudaEvent_t event = static_cast<cudaEvent_t>(event_);
    event_ = nullptr;
    Status status = cuda_status(cudaEventSynchronize(event), "waiting for a copy");
    cudaEventDestroy(event);
    if (!status && status_) status_ = status;
  }
#endif
  return status_;
}

DeviceTier::DeviceTier(uint64_t capacity)
    : allocator_(capacity, kAlignment, "device tier", "the device budget"),
      capacity_(capacity / kAlignment * kAlignment) {}

Result<std::unique_ptr<DeviceTier>> DeviceTier::open(DeviceTierOptions options) {
  auto notice = options.notice ? options.notice : [](const std::string& line) {
    std::fprintf(stderr, "strata: %s\n", line.c_str());
  };
  std::unique_ptr<DeviceTier> tier(new DeviceTier(options.capacity));
  tier->gpu_index_ = options.gpu_index;
  const uint64_t capacity = tier->capacity_;
#ifdef STRATA_HAS_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    devices = 0;
  }
  if (options.use_gpu && devices > options.gpu_index) {
    if (Status status = cuda_status(cudaSetDevice(options.gpu_index), "cudaSetDevice"); !status)
      return status;
    void* pool = nullptr;
    if (capacity > 0) {
      cudaError_t error = cudaMalloc(&pool, capacity);
      if (error != cudaSuccess) {
        cudaGetLastError();
        size_t free_bytes = 0, total_bytes = 0;
        cudaMemGetInfo(&free_bytes, &total_bytes);
        return Status::error(fmt::format(
            "device tier: cudaMalloc of a {} pool on GPU {} failed ({}); {} of {} free; lower "
            "the device budget",
            format_bytes(capacity), options.gpu_index, cudaGetErrorString(error),
            format_bytes(free_bytes), format_bytes(total_bytes)));
      }
    }
    tier->base_ = static_cast<std::byte*>(pool);
    tier->on_gpu_ = true;
    cudaStream_t to_device = nullptr, to_host = nullptr;
    if (Status status = cuda_status(cudaStreamCreateWithFlags(&to_device, cudaStreamNonBlocking),
                                    "creating the host-to-device copy stream");
        !status)
      return status;
    tier->to_device_stream_ = to_device;
    if (Status status = cuda_status(cudaStreamCreateWithFlags(&to_host, cudaStreamNonBlocking),
                                    "creating the device-to-host copy stream");
        !status)
      return status;
    tier->to_host_stream_ = to_host;
    return tier;
  }
  if (options.use_gpu) notice("device tier: no GPU found; host memory stands in for device memory");
#else
  (void)notice;
#endif
  if (capacity > 0) {
    void* mapped = mmap(nullptr, capacity, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapped == MAP_FAILED)
      return Status::from_errno(
          errno,
          fmt::format("device tier: mmap of {} (host memory standing in for the device) failed",
                      format_bytes(capacity)),
          "lower the device budget");
    tier->base_ = static_cast<std::byte*>(mapped);
  }
  return tier;
}

DeviceTier::~DeviceTier() {
#ifdef STRATA_HAS_CUDA
  if (on_gpu_) {
    cudaSetDevice(gpu_index_);
    if (to_device_stream_) cudaStreamSynchronize(static_cast<cudaStream_t>(to_device_stream_));
    if (to_host_stream_) cudaStreamSynchronize(static_cast<cudaStream_t>(to_host_stream_));
    if (to_device_stream_) cudaStreamDestroy(static_cast<cudaStream_t>(to_device_stream_));
    if (to_host_stream_) cudaStreamDestroy(static_cast<cudaStream_t>(to_host_stream_));
    if (base_) cudaFree(base_);
    return;
  }
#endif
  if (base_) munmap(base_, capacity_);
}

Result<DeviceBlock> DeviceTier::allocate(uint64_t bytes, std::string_view what) {
  Result<uint64_t> offset = allocator_.allocate(bytes, what);
  if (!offset) return offset.status();
  return DeviceBlock{base_ + *offset, bytes, *offset};
}

void DeviceTier::free(const DeviceBlock& block) {
  allocator_.free(block.offset);
}

Status DeviceTier::zero(const DeviceBlock& block) {
#ifdef STRATA_HAS_CUDA
  if (on_gpu_) {
    // The calling thread may have another current device (or none yet).
    if (Status s = cuda_status(cudaSetDevice(gpu_index_), "cudaSetDevice"); !s) return s;
    cudaStream_t stream = static_cast<cudaStream_t>(to_device_stream_);
    Status status =
        cuda_status(cudaMemsetAsync(block.data, 0, block.size, stream), "zeroing a block");
    if (status) status = cuda_status(cudaStreamSynchronize(stream), "zeroing a block");
    return status;
  }
#endif
  std::memset(block.data, 0, block.size);
  return Status::ok();
}

DeviceCopy DeviceTier::copy_to_device(const DeviceBlock& destination, uint64_t offset,
                                      const void* source, uint64_t bytes) {
  DeviceCopy copy;
#ifdef STRATA_HAS_CUDA
  if (on_gpu_) {
    copy.status_ = cuda_status(cudaSetDevice(gpu_index_), "cudaSetDevice");
    if (!copy.status_) return copy;
    copy.status_ = enqueue_copy(destination.data + offset, source, bytes, cudaMemcpyHostToDevice,
                                to_device_stream_, "copy to the device", copy.event_);
    return copy;
  }
#endif
  std::memcpy(destination.data + offset, source, bytes);
  return copy;
}

DeviceCopy DeviceTier::copy_to_host(void* destination, const DeviceBlock& source, uint64_t offset,
                                    uint64_t bytes) {
  DeviceCopy copy;
#ifdef STRATA_HAS_CUDA
  if (on_gpu_) {
    copy.status_ = cuda_status(cudaSetDevice(gpu_index_), "cudaSetDevice");
    if (!copy.status_) return copy;
    copy.status_ = enqueue_copy(destination, source.data + offset, bytes, cudaMemcpyDeviceToHost,
                                to_host_stream_, "copy to the host", copy.event_);
    return copy;
  }
#endif
  std::memcpy(destination, source.data + offset, bytes);
  return copy;
}

std::string DeviceTier::description() const {
  if (on_gpu_)
    return fmt::format("{} cudaMalloc pool on GPU {}", format_bytes(capacity_), gpu_index_);
  return fmt::format("{} of host memory standing in for the device", format_bytes(capacity_));
}

}  // namespace strata::tiers
