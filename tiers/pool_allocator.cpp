#include "tiers/pool_allocator.h"

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>

#include "io/swap_directory.h"
#include "io/base/sizes.h"

namespace strata::tiers {

PoolAllocator::PoolAllocator(uint64_t capacity, uint64_t alignment, std::string tier,
                             std::string limit_hint)
    : capacity_(capacity - capacity % alignment),
      alignment_(alignment),
      tier_(std::move(tier)),
      limit_hint_(std::move(limit_hint)) {
  if (capacity_ > 0) free_ranges_[0] = capacity_;
}

uint64_t PoolAllocator::rounded(uint64_t bytes) const {
  if (bytes == 0) return alignment_;
  return (bytes + alignment_ - 1) / alignment_ * alignment_;
}

Result<uint64_t> PoolAllocator::allocate(uint64_t bytes, std::string_view what) {
  const uint64_t size = rounded(bytes);
  std::lock_guard lock(mutex_);
  uint64_t largest = 0;
  for (auto range = free_ranges_.begin(); range != free_ranges_.end(); ++range) {
    if (range->second < size) {
      largest = std::max(largest, range->second);
      continue;
    }
    const uint64_t offset = range->first;
    const uint64_t left = range->second - size;
    free_ranges_.erase(range);
    if (left > 0) free_ranges_[offset + size] = left;
    allocated_[offset] = size;
    used_ += size;
    peak_ = std::max(peak_, used_);
    return offset;
  }
  if (capacity_ - used_ >= size) {
    return Status::error(
        fmt::format("{}: cannot place {} for {}: {} of {} free but the largest free range is {} "
                    "(fragmented); release shards first or raise {}",
                    tier_, format_bytes(size), what, format_bytes(capacity_ - used_),
                    format_bytes(capacity_), format_bytes(largest), limit_hint_));
  }
  return Status::error(fmt::format(
      "{}: cannot hold {} more for {}: {} of {} in use (budget); "
      "release shards first or raise {}",
      tier_, format_bytes(size), what, format_bytes(used_), format_bytes(capacity_), limit_hint_));
}

void PoolAllocator::free(uint64_t offset) {
  std::lock_guard lock(mutex_);
  auto found = allocated_.find(offset);
  if (found == allocated_.end()) {
    std::fprintf(stderr, "strata: %s: free of offset %llu that was never allocated\n",
                 tier_.c_str(), static_cast<unsigned long long>(offset));
    std::abort();
  }
  uint64_t start = offset;
  uint64_t size = found->second;
  allocated_.erase(found);
  used_ -= size;
  auto next = free_ranges_.lower_bound(start);
  if (next != free_ranges_.end() && next->first == start + size) {
    size += next->second;
    next = free_ranges_.erase(next);
  }
  if (next != free_ranges_.begin()) {
    auto previous = std::prev(next);
    if (previous->first + previous->second == start) {
      start = previous->first;
      size += previous->second;
      free_ranges_.erase(previous);
    }
  }
  free_ranges_[start] = size;
}

TierUsage PoolAllocator::usage() const {
  std::lock_guard lock(mutex_);
  return TierUsage{used_, peak_, capacity_};
}

}  // namespace strata::tiers
