// NvmeTier: shard storage in one swap file striped over every NVMe path by the
// I/O engine (io/io_engine.h), sub-allocated like the other tiers. The file is
// created (fallocate) at open with `capacity` bytes of the striped address
// space, after checking that each path has its share free, and removed when
// the tier is destroyed. Extents start at multiples of the engine's alignment
// and their sizes are rounded up to it, so whole-extent transfers never need
// a read-modify-write.
//
// Ownership: the tier owns the engine and the file. Thread-safe: every method
// from any thread; the handles follow IoEngine's rules (the buffer must stay
// valid until the handle is done).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "io/io_engine.h"
#include "io/base/status.h"
#include "tiers/pool_allocator.h"

namespace strata::tiers {

struct NvmeTierOptions {
  io::IoOptions io;  // paths, block_size, queue_depth, threads_per_path, ...
  uint64_t capacity = 0;
  std::string file_name = "strata-tiers.swap";
};

struct NvmeExtent {
  uint64_t offset = 0;  // in the swap file's striped address space
  uint64_t size = 0;    // bytes asked for
};

class NvmeTier {
 public:
  static Result<std::unique_ptr<NvmeTier>> open(NvmeTierOptions options);
  ~NvmeTier();
  NvmeTier(const NvmeTier&) = delete;
  NvmeTier& operator=(const NvmeTier&) = delete;

  Result<NvmeExtent> allocate(uint64_t bytes, std::string_view what);
  void free(const NvmeExtent& extent);

  // [offset, offset + length) of `extent`, into / from `buffer`.
  io::IoHandle read(const NvmeExtent& extent, uint64_t offset, void* buffer, uint64_t length);
  io::IoHandle write(const NvmeExtent& extent, uint64_t offset, const void* buffer,
                     uint64_t length);

  io::IoEngine& engine() { return *engine_; }
  uint64_t alignment() const { return allocator_.alignment(); }
  uint64_t rounded(uint64_t bytes) const { return allocator_.rounded(bytes); }
  TierUsage usage() const { return allocator_.usage(); }
  std::string description() const;

 private:
  NvmeTier(std::unique_ptr<io::IoEngine> engine, io::FileId file, uint64_t capacity);
  std::unique_ptr<io::IoEngine> engine_;
  io::FileId file_ = -1;
  PoolAllocator allocator_;
};

}  // namespace strata::tiers
