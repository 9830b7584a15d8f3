// DeviceTier: device memory as one pool, allocated once and sub-allocated, so
// nothing is allocated on the device while a step runs. On CUDA builds with a
// GPU it is one cudaMalloc with two copy streams (host to device, device to
// host) and an event per copy; elsewhere (CPU backend, or a CUDA build on a
// machine without a GPU) host memory stands in for the device, with the same
// budget rules, and copies are memcpy that are complete when they return.
//
// Ownership: the tier owns the pool; a DeviceBlock is a view into it, valid
// until free() or the tier's destruction. Host memory given to the copy calls
// must stay valid until the copy's DeviceCopy reports done; for asynchronous
// copies on a GPU it should be pinned (HostTier) or the copy is synchronous.
// Thread-safe: every method from any thread. A DeviceCopy is a value for one
// thread at a time; destroying one that is still running waits for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "io/base/status.h"
#include "tiers/pool_allocator.h"

namespace strata::tiers {

struct DeviceTierOptions {
  uint64_t capacity = 0;  // bytes (--device-mem-limit)
  int gpu_index = 0;
  // false: host memory stands in even when a GPU is present (tests, CPU backend).
  bool use_gpu = true;
  std::function<void(const std::string&)> notice{};
};

struct DeviceBlock {
  std::byte* data = nullptr;  // a device pointer on a GPU
  uint64_t size = 0;
  uint64_t offset = 0;
};

// A copy between the host and the device; done once wait() returns ok.
class DeviceCopy {
 public:
  DeviceCopy() = default;
  DeviceCopy(DeviceCopy&& other) noexcept;
  DeviceCopy& operator=(DeviceCopy&& other) noexcept;
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  ~DeviceCopy();

  bool is_done() const;
  Status wait();

 private:
  friend class DeviceTier;
  void* event_ = nullptr;  // cudaEvent_t on a GPU; nullptr: already complete
  Status status_;
};

class DeviceTier {
 public:
  static Result<std::unique_ptr<DeviceTier>> open(DeviceTierOptions options);
  ~DeviceTier();
  DeviceTier(const DeviceTier&) = delete;
  DeviceTier& operator=(const DeviceTier&) = delete;

  // Aligned to 4 KiB. Charges the budget first; fails with the numbers.
  Result<DeviceBlock> allocate(uint64_t bytes, std::string_view what);
  void free(const DeviceBlock& block);

  // Zeroes the block; complete when it returns.
  Status zero(const DeviceBlock& block);

  DeviceCopy copy_to_device(const DeviceBlock& destination, uint64_t offset, const void* source,
                            uint64_t bytes);
  DeviceCopy copy_to_host(void* destination, const DeviceBlock& source, uint64_t offset,
                          uint64_t bytes);

  bool on_gpu() const { return on_gpu_; }
  TierUsage usage() const { return allocator_.usage(); }
  std::string description()
      const;  // "4.0 GiB cudaMalloc pool on GPU 0" / "... host memory standing in"

 private:
  explicit DeviceTier(uint64_t capacity);
  PoolAllocator allocator_;
  uint64_t capacity_ = 0;
  std::byte* base_ = nullptr;
  bool on_gpu_ = false;
  int gpu_index_ = 0;
  void* to_device_stream_ = nullptr;  // cudaStream_t
  void* to_host_stream_ = nullptr;
};

}  // namespace strata::tiers
