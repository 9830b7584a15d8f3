// TieredStore: named shards in three tiers (device, pinned host, NVMe), each
// with a home tier, moved to a faster tier ahead of use and back after, inside
// fixed budgets.
//
// A shard is (unit, kind) with a size and a home tier. add_shard reserves its
// home bytes (zeroed). prefetch(key, to) makes a copy in a faster tier: it
// charges `to` first (and a host staging block when NVMe data goes to the
// device), then starts the transfer; a request that does not fit fails with
// the numbers and nothing moves. wait(key, at) blocks until the copy in `at`
// is complete (loaded, or written back) and returns where its bytes are; the
// caller may then read and change them. writeback(key, from) starts copying
// that copy's bytes to the home; wait(key, from) returning ok means the home
// holds them (for NVMe: in the page cache of the device, not yet durable).
// release(key, at) waits for the copy's transfers and frees its bytes; changes
// not written back are dropped. prefetch_ranges(key, ranges) is a prefetch
// of an NVMe-homed shard to the host that reads only `ranges` (each offset and
// length a multiple of nvme_alignment(), inside the shard's rounded size); the
// copy's other bytes are unspecified. read_home_ranges reads ranges of an
// NVMe home straight into a caller's buffer, at the same offsets, and returns
// when they are there. A prefetch to the device takes the host copy
// when there is one (even if it was changed and not written back), else the
// home; the source must not be changed until the new copy's wait() returns.
// Copies in other tiers are never updated by a writeback.
//
// Every byte is charged against its tier: the device and host pools are the
// device and host budgets the caller gives, NVMe is one striped swap file
// whose size is checked against the free space at open. usage(tier) reports
// bytes in use and the peak, which never exceeds the capacity.
//
// Errors are values: an I/O failure surfaces from wait() (or release()) of the
// copy it hit, naming the shard, the tiers and the engine's errno/file/offset;
// a failed load leaves no copy behind, a failed writeback leaves the copy in
// place (the home may hold part of it); other shards are never touched.
//
// Thread safety: every method may be called from any thread. Calls on the same
// shard are serialised (a wait on one shard never blocks calls on another);
// transfers of different shards run concurrently on the I/O threads.
// Ownership: the store owns the tiers, the I/O engine and the swap file (removed
// at destruction). A ShardView stays valid until the copy is released or the
// shard removed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "io/io_engine.h"
#include "io/base/status.h"
#include "tiers/device_tier.h"
#include "tiers/host_tier.h"
#include "tiers/nvme_tier.h"
#include "tiers/tier.h"

namespace strata::tiers {

struct TieredStoreOptions {
  uint64_t device_capacity = 0;  // device budget in bytes; 0: no device tier
  uint64_t host_capacity = 0;    // host budget (the pinned pool); 0: no host tier
  uint64_t nvme_capacity = 0;    // bytes of swap file; 0: no NVMe tier
  io::IoOptions io;              // NVMe paths, block size, queue depth (when nvme_capacity > 0)
  std::string nvme_file_name = "strata-tiers.swap";  // one per store sharing a directory
  bool use_gpu = true;           // CUDA builds: the device tier on the GPU when one is present
  int gpu_index = 0;
  bool pin_host = true;
  std::optional<unsigned> numa_node;  // default: chosen with hwloc
  std::optional<uint64_t> memlock_limit_for_testing;
  // Host copies of NVMe-homed parameter shards (fetches, range prefetches,
  // staging to the device) come and go in every size of unit; first fit
  // over mixed sizes fragments the pool until a copy finds no range long
  // enough though the bytes are free. With this set, each such copy of a
  // shard no larger takes exactly this many bytes (the plan's largest
  // parameter shard), so the copies are interchangeable slots; 0: their
  // own sizes.
  uint64_t param_copy_bytes = 0;
  // write_shard and read_shard stage an NVMe home through a host block.
  // With staging_blocks > 0 they take one of that many blocks of
  // staging_bytes (rounded up to the NVMe alignment), reserved from the host
  // pool when the store opens, and wait while all are in use: the staging of
  // every step's writes (new parameters, gradients homed on NVMe) then never
  // allocates, so it neither fragments the pool nor takes more than the plan
  // counts. 0: each call allocates min(shard, kShardStagingBytes) while it lasts.
  uint64_t staging_bytes = 0;
  int staging_blocks = 0;
  // One-line notices (fallbacks); default: stderr.
  std::function<void(const std::string&)> notice{};
};

// Where a copy's bytes are: host memory, or device memory (a device pointer on a GPU).
struct ShardView {
  std::byte* data = nullptr;
  uint64_t bytes = 0;
  Tier tier = Tier::host;
};

// A shard's home, for passes that work on homes directly (StreamedPass).
struct ShardHome {
  Tier tier = Tier::host;
  uint64_t bytes = 0;
  std::byte* data = nullptr;  // host or device homes
  NvmeExtent extent;          // NVMe homes
};

class TieredStore {
 public:
  static Result<std::unique_ptr<TieredStore>> open(TieredStoreOptions options);
  ~TieredStore();
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  Status add_shard(ShardKey key, uint64_t bytes, Tier home);
  // Waits for the shard's transfers and frees every copy and the home.
  Status remove_shard(ShardKey key);

  Status prefetch(ShardKey key, Tier to);
  Status prefetch_ranges(ShardKey key, std::span<const ByteRange> ranges);
  // `buffer` (aligned to nvme_alignment()) holds the shard's bytes at their offsets.
  Status read_home_ranges(ShardKey key, std::span<const ByteRange> ranges, std::byte* buffer);
  // The other way: the ranges of `buffer` (aligned, the shard's bytes at
  // their offsets) into the NVMe home, once the shard's transfers in flight
  // have ended; the rest of the home keeps its bytes. Synchronous.
  Status write_home_ranges(ShardKey key, std::span<const ByteRange> ranges,
                           const std::byte* buffer);
  uint64_t nvme_alignment() const;
  Result<ShardView> wait(ShardKey key, Tier at);
  Status writeback(ShardKey key, Tier from);
  Status release(ShardKey key, Tier at);

  // Whole-shard copies into / out of the home, for NVMe homes through a host
  // staging block (TieredStoreOptions::staging_blocks; else one of at most
  // 64 MiB charged to the host budget while it lasts). Synchronous.
  Status write_shard(ShardKey key, std::span<const std::byte> bytes);
  Status read_shard(ShardKey key, std::span<std::byte> bytes);

  Result<ShardHome> home(ShardKey key) const;
  bool has_tier(Tier tier) const;
  TierUsage usage(Tier tier) const;
  HostTier& host_tier() { return *host_; }
  DeviceTier* device_tier() { return device_.get(); }
  NvmeTier* nvme_tier() { return nvme_.get(); }
  // One line per tier: size, placement, pinning, paths.
  std::string description() const;

 private:
  struct Copy;
  struct Shard;
  TieredStore() = default;
  class ShardHold;
  Result<Shard*> acquire(ShardKey key);
  Result<ShardHold> hold(ShardKey key);
  void unlock_shard(Shard* shard);
  Status finish(Shard& shard, Tier tier);
  // write_shard / read_shard: checks the length and lets every transfer of the shard end.
  Status settle_for_whole_copy(Shard& shard, ShardKey key, size_t given, const char* operation);
  void free_copy(Shard& shard, Tier tier);
  Status check_tier(Tier tier, const char* operation, ShardKey key) const;
  // prefetch_ranges / read_home_ranges: the home is NVMe, each range aligned and inside it.
  Status check_ranges(const Shard& shard, ShardKey key, std::span<const ByteRange> ranges,
                      const char* operation) const;
  // A load from the home must not overtake a write-back to it.
  Status settle_writes(Shard& shard);

  std::unique_ptr<HostTier> host_;
  uint64_t param_copy_bytes_ = 0;  // TieredStoreOptions::param_copy_bytes
  // A host copy of an NVMe-homed shard: a parameter shard's in a slot of param_copy_bytes_.
  Result<HostBlock> allocate_host_copy(ShardKey key, uint64_t bytes, const std::string& what);
  // write_shard / read_shard's block: a reserved one (waiting for it) or,
  // with none reserved, one of min(padded, kShardStagingBytes) allocated.
  Result<HostBlock> take_staging(ShardKey key, uint64_t padded, const char* operation);
  void return_staging(const HostBlock& block);
  bool staging_reserved_ = false;
  std::mutex staging_mutex_;
  std::condition_variable staging_returned_;
  std::vector<HostBlock> staging_free_;  // the reserved blocks not in use
  std::unique_ptr<DeviceTier> device_;
  std::unique_ptr<NvmeTier> nvme_;
  bool host_registered_ = false;
  std::function<void(const std::string&)> notice_;

  mutable std::mutex mutex_;
  std::condition_variable shard_released_;
  std::map<ShardKey, std::unique_ptr<Shard>> shards_;
};

}  // namespace strata::tiers
