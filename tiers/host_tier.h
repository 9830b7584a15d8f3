// HostTier: the pinned host pool. One anonymous mmap of `capacity` bytes (the
// host budget), placed on one NUMA node (the GPU's on CUDA builds, chosen with
// hwloc) and first-touched there, then pinned: cudaHostRegister when built
// with CUDA and a GPU is present (cudaHostAlloc memory cannot always be
// registered with io_uring), else mlock. When the memlock limit is too low
// the pool stays unpinned and `notice` says so once; everything still works.
// The store registers the pool with the I/O rings once.
//
// Ownership: the tier owns the mapping; a HostBlock is a view into it, valid
// until free() or the tier's destruction. Allocation charges the budget first
// (PoolAllocator): a request that does not fit fails with the numbers.
// Thread-safe: allocate/free/usage from any thread; the bytes of one block
// belong to whoever allocated it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "io/base/status.h"
#include "tiers/pool_allocator.h"

namespace strata::tiers {

struct HostTierOptions {
  uint64_t capacity = 0;              // bytes; rounded down to 4 KiB
  std::optional<unsigned> numa_node;  // default: choose_host_node()
  int gpu_index = 0;
  bool pin = true;
  // Receives one-line warnings (pinning fallback, NUMA binding). Default: stderr.
  std::function<void(const std::string&)> notice{};
  // Tests only: behave as if RLIMIT_MEMLOCK were this many bytes.
  std::optional<uint64_t> memlock_limit_for_testing{};
};

struct HostBlock {
  std::byte* data = nullptr;
  uint64_t size = 0;    // bytes asked for
  uint64_t offset = 0;  // within the pool
};

enum class HostPinning { none, mlock, cuda_host_register };

class HostTier {
 public:
  static Result<std::unique_ptr<HostTier>> open(HostTierOptions options);
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // 4 KiB-aligned, zeroed the first time the pool is touched (not on every allocation).
  Result<HostBlock> allocate(uint64_t bytes, std::string_view what);
  void free(const HostBlock& block);

  uint64_t rounded(uint64_t bytes) const { return allocator_.rounded(bytes); }
  std::byte* base() const { return base_; }
  uint64_t capacity() const { return capacity_; }
  TierUsage usage() const { return allocator_.usage(); }
  unsigned numa_node() const { return numa_node_; }
  HostPinning pinning() const { return pinning_; }
  std::string description() const;  // "1.0 GiB on numa node 0, mlock-ed"

 private:
  HostTier(std::byte* base, uint64_t capacity);
  std::byte* base_ = nullptr;
  uint64_t capacity_ = 0;
  PoolAllocator allocator_;
  unsigned numa_node_ = 0;
  HostPinning pinning_ = HostPinning::none;
};

}  // namespace strata::tiers
