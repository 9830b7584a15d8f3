// PoolAllocator: hands out aligned byte ranges of one fixed-size pool and keeps
// the budget. The pool is the budget: a request is charged before any data
// moves, and one that cannot fit fails with the numbers (bytes asked, in use,
// capacity, largest free range) instead of over-committing. Used and peak
// bytes count the aligned sizes actually reserved.
//
// Knows offsets only; the tiers map them to memory or file ranges. First fit
// over free ranges kept sorted by offset, neighbours merged on free.
// Thread-safe: every method may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "io/base/status.h"
#include "tiers/tier.h"

namespace strata::tiers {

class PoolAllocator {
 public:
  // `tier`: "host tier" etc. for messages; `limit_hint`: what the user can raise,
  // in the tier's terms ("the host budget"; the caller that read the flag names
  // it). `alignment` is a power of two.
  PoolAllocator(uint64_t capacity, uint64_t alignment, std::string tier, std::string limit_hint);

  // Reserves round_up(bytes, alignment) bytes (at least one alignment unit) and
  // returns the offset. `what` names the request in the error ("(unit 3, m)").
  Result<uint64_t> allocate(uint64_t bytes, std::string_view what);
  // Returns a range from allocate(); freeing anything else is a bug and aborts.
  void free(uint64_t offset);

  uint64_t alignment() const { return alignment_; }
  uint64_t rounded(uint64_t bytes) const;
  TierUsage usage() const;

 private:
  const uint64_t capacity_;
  const uint64_t alignment_;
  const std::string tier_;
  const std::string limit_hint_;
  mutable std::mutex mutex_;
  std::map<uint64_t, uint64_t> free_ranges_;  // offset -> size
  std::map<uint64_t, uint64_t> allocated_;    // offset -> size
  uint64_t used_ = 0;
  uint64_t peak_ = 0;
};

}  // namespace strata::tiers
