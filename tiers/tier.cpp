#include "tiers/tier.h"

#include <fmt/format.h>

namespace strata::tiers {

const char* tier_name(Tier tier) {
  switch (tier) {
    case Tier::device:
      return "device";
    case Tier::host:
      return "host";
    case Tier::nvme:
      return "nvme";
  }
  return "?";
}

const char* shard_kind_name(ShardKind kind) {
  switch (kind) {
    case ShardKind::param:
      return "param";
    case ShardKind::master:
      return "master";
    case ShardKind::m:
      return "m";
    case ShardKind::v:
      return "v";
    case ShardKind::grad:
      return "grad";
  }
  return "?";
}

std::string shard_name(ShardKey key) {
  return fmt::format("(unit {}, {})", key.unit, shard_kind_name(key.kind));
}

}  // namespace strata::tiers
