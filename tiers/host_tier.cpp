#include "tiers/host_tier.h"

#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

#include "io/base/sizes.h"
#include "io/base/status.h"
#include "io/swap_directory.h"
#include "tiers/topology.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::tiers {
namespace {

constexpr uint64_t kPage = 4096;

bool gpu_present() {
#ifdef STRATA_HAS_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return devices > 0;
#else
  return false;
#endif
}

}  // namespace

HostTier::HostTier(std::byte* base, uint64_t capacity)
    : base_(base),
      capacity_(capacity),
      allocator_(capacity, kPage, "host tier", "the host budget") {}

Result<std::unique_ptr<HostTier>> HostTier::open(HostTierOptions options) {
  auto notice = options.notice ? options.notice : [](const std::string& line) {
    std::fprintf(stderr, "strata: %s\n", line.c_str());
  };
  const uint64_t capacity = options.capacity / kPage * kPage;
  std::byte* base = nullptr;
  if (capacity > 0) {
    void* mapped = mmap(nullptr, capacity, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapped == MAP_FAILED)
      return Status::from_errno(errno,
                                fmt::format("host tier: mmap of {} failed", format_bytes(capacity)),
                                "lower the host budget");
    base = static_cast<std::byte*>(mapped);
  }
  std::unique_ptr<HostTier> tier(new HostTier(base, capacity));
  tier->numa_node_ = options.numa_node ? *options.numa_node : choose_host_node(options.gpu_index);
  if (capacity == 0) return tier;

  std::string placement_notice;
  first_touch_on_node(base, capacity, tier->numa_node_, &placement_notice);
  if (!placement_notice.empty()) notice(placement_notice);
  if (!options.pin) return tier;

#ifdef STRATA_HAS_CUDA
  if (gpu_present()) {
    cudaError_t error = cudaHostRegister(base, capacity, cudaHostRegisterDefault);
    if (error == cudaSuccess) {
      tier->pinning_ = HostPinning::cuda_host_register;
      return tier;
    }
    cudaGetLastError();
    notice(fmt::format("host tier: cudaHostRegister of {} failed ({}); trying mlock",
                       format_bytes(capacity), cudaGetErrorString(error)));
  }
#else
  (void)gpu_present;
#endif

  rlimit limit{};
  getrlimit(RLIMIT_MEMLOCK, &limit);
  uint64_t allowed = limit.rlim_cur == RLIM_INFINITY ? UINT64_MAX : limit.rlim_cur;
  if (options.memlock_limit_for_testing) {
    allowed = *options.memlock_limit_for_testing;
  } else if (allowed < capacity && limit.rlim_cur != limit.rlim_max) {
    // Raise the soft limit as far as the hard one goes.
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max;
    if (setrlimit(RLIMIT_MEMLOCK, &raised) == 0)
      allowed = raised.rlim_cur == RLIM_INFINITY ? UINT64_MAX : raised.rlim_cur;
  }
  // root (CAP_IPC_LOCK) may lock past the limit; mlock itself is the judge then.
  if (allowed < capacity && !options.memlock_limit_for_testing && geteuid() == 0)
    allowed = capacity;
  if (allowed < capacity) {
    notice(
        fmt::format("host tier: RLIMIT_MEMLOCK is {}, below the {} pool; the pool is not "
                    "pinned (pages may be swapped out); raise it with `ulimit -l` or "
                    "LimitMEMLOCK= in the service unit",
                    format_bytes(allowed), format_bytes(capacity)));
    return tier;
  }
  if (mlock(base, capacity) != 0) {
    notice(
        fmt::format("host tier: mlock of {} failed ({}); the pool is not pinned; raise "
                    "RLIMIT_MEMLOCK (`ulimit -l`)",
                    format_bytes(capacity), errno_text(errno)));
    return tier;
  }
  tier->pinning_ = HostPinning::mlock;
  return tier;
}

HostTier::~HostTier() {
  if (!base_) return;
#ifdef STRATA_HAS_CUDA
  if (pinning_ == HostPinning::cuda_host_register) cudaHostUnregister(base_);
#endif
  munmap(base_, capacity_);
}

Result<HostBlock> HostTier::allocate(uint64_t bytes, std::string_view what) {
  Result<uint64_t> offset = allocator_.allocate(bytes, what);
  if (!offset) return offset.status();
  return HostBlock{base_ + *offset, bytes, *offset};
}

void HostTier::free(const HostBlock& block) {
  allocator_.free(block.offset);
}

std::string HostTier::description() const {
  const char* pinned = pinning_ == HostPinning::mlock                ? "mlock-ed"
                       : pinning_ == HostPinning::cuda_host_register ? "cudaHostRegister-ed"
                                                                     : "not pinned";
  return fmt::format("{} on numa node {}, {}", format_bytes(capacity_), numa_node_, pinned);
}

}  // namespace strata::tiers
