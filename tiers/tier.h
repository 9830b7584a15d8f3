// Vocabulary shared by the tiers: which tier, which kind of shard, a shard's
// name, and what a tier has used. Plain values; thread-safe to copy.
#pragma once

#include <cstdint>
#include <string>

namespace strata::tiers {

// Fastest first: a shard moves towards device ahead of use and back to its home after.
enum class Tier { device = 0, host = 1, nvme = 2 };
inline constexpr int kTierCount = 3;
const char* tier_name(Tier tier);  // "device", "host", "nvme"

// A faster tier is closer to compute: device < host < nvme.
inline bool faster_than(Tier a, Tier b) {
  return static_cast<int>(a) < static_cast<int>(b);
}

enum class ShardKind { param, master, m, v, grad };
const char* shard_kind_name(ShardKind kind);  // "param", "master", "m", "v", "grad"

// A shard is named by the unit it belongs to and the kind of state it holds.
struct ShardKey {
  int unit = 0;
  ShardKind kind = ShardKind::param;
  friend auto operator<=>(const ShardKey&, const ShardKey&) = default;
};
std::string shard_name(ShardKey key);  // "(unit 3, m)"

// Part of a shard's bytes, [offset, offset + bytes): TieredStore::prefetch_ranges
// and read_home_ranges read only these of an NVMe home.
struct ByteRange {
  uint64_t offset = 0;
  uint64_t bytes = 0;
  friend bool operator==(const ByteRange&, const ByteRange&) = default;
};

// TieredStore::write_shard / read_shard stage NVMe homes through a host
// block: without reserved blocks (TieredStoreOptions::staging_blocks), one
// of at most this many bytes, charged to the host budget while the call
// lasts; the plan sizes the reserved ones no larger.
inline constexpr uint64_t kShardStagingBytes = uint64_t{64} << 20;

// Bytes a tier holds now, the most it ever held, and its budget.
struct TierUsage {
  uint64_t used = 0;
  uint64_t peak = 0;
  uint64_t capacity = 0;
};

}  // namespace strata::tiers
