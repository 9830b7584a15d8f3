#include "tiers/tiered_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "io/swap_directory.h"

namespace strata::tiers {

// One copy of a shard in one tier. Only the thread holding the shard touches it.
struct TieredStore::Copy {
  bool present = false;
  enum class Phase { idle, loading, writing } phase = Phase::idle;
  Tier source = Tier::host;  // where a load reads from
  HostBlock host;
  DeviceBlock device;
  NvmeExtent nvme;
  // In flight.
  io::IoHandle io;
  std::vector<io::IoHandle> more_io;  // prefetch_ranges: the ranges after the first
  DeviceCopy device_copy;
  std::optional<HostBlock> staging;  // NVMe <-> device goes through the host
  bool staging_to_device = false;    // load: after the NVMe read, copy staging -> device
};

struct TieredStore::Shard {
  ShardKey key;
  uint64_t bytes = 0;
  Tier home = Tier::host;
  Copy copies[kTierCount];
  bool busy = false;  // a thread is working on this shard
  Copy& at(Tier tier) { return copies[static_cast<int>(tier)]; }
};

namespace {

// Waits for every transfer (none is left running) and returns the first failure.
Status wait_for_all(std::vector<io::IoHandle>& transfers) {
  Status status = Status::ok();
  for (io::IoHandle& transfer : transfers) {
    Status done = transfer.wait();
    if (status && !done) status = done;
  }
  return status;
}

void print_notice(const std::string& line) {
  std::fprintf(stderr, "strata: %s\n", line.c_str());
}

}  // namespace

Result<std::unique_ptr<TieredStore>> TieredStore::open(TieredStoreOptions options) {
  std::unique_ptr<TieredStore> store(new TieredStore());
  store->notice_ = options.notice ? options.notice : print_notice;
  store->param_copy_bytes_ = options.param_copy_bytes;

  HostTierOptions host;
  host.capacity = options.host_capacity;
  host.numa_node = options.numa_node;
  host.gpu_index = options.gpu_index;
  host.pin = options.pin_host;
  host.notice = store->notice_;
  host.memlock_limit_for_testing = options.memlock_limit_for_testing;
  Result<std::unique_ptr<HostTier>> host_tier = HostTier::open(host);
  if (!host_tier) return host_tier.status();
  store->host_ = std::move(*host_tier);

  if (options.device_capacity > 0) {
    DeviceTierOptions device;
    device.capacity = options.device_capacity;
    device.gpu_index = options.gpu_index;
    device.use_gpu = options.use_gpu;
    device.notice = store->notice_;
    Result<std::unique_ptr<DeviceTier>> device_tier = DeviceTier::open(device);
    if (!device_tier) return device_tier.status();
    store->device_ = std::move(*device_tier);
  }

  if (options.nvme_capacity > 0) {
    NvmeTierOptions nvme;
    nvme.io = options.io;
    if (!nvme.io.notice) nvme.io.notice = store->notice_;
    nvme.capacity = options.nvme_capacity;
    nvme.file_name = options.nvme_file_name;
    Result<std::unique_ptr<NvmeTier>> nvme_tier = NvmeTier::open(nvme);
    if (!nvme_tier) return nvme_tier.status();
    store->nvme_ = std::move(*nvme_tier);
    if (store->host_->capacity() > 0) {
      // Once, for the whole pool: every NVMe transfer then uses the fixed-buffer calls.
      Status registered =
          store->nvme_->engine().register_buffer(store->host_->base(), store->host_->capacity());
      if (registered) {
        store->host_registered_ = true;
      } else {
        store->notice_(
            fmt::format("host tier: pool not registered with the I/O rings ({}); "
                        "NVMe transfers use unregistered buffers",
                        registered.message()));
      }
    }
    if (options.staging_blocks > 0 && options.staging_bytes > 0) {
      const uint64_t bytes = store->nvme_->rounded(options.staging_bytes);
      for (int i = 0; i < options.staging_blocks; ++i) {
        Result<HostBlock> block =
            store->host_->allocate(bytes, fmt::format("NVMe shard staging block {}", i));
        if (!block) return block.status();
        store->staging_free_.push_back(*block);
      }
      store->staging_reserved_ = true;
    }
  }
  return store;
}

TieredStore::~TieredStore() {
  {
    std::unique_lock lock(mutex_);
    shard_released_.wait(lock, [&] {
      for (auto& [key, shard] : shards_)
        if (shard->busy) return false;
      return true;
    });
  }
  for (auto& [key, shard] : shards_) {
    for (int tier = 0; tier < kTierCount; ++tier) {
      (void)finish(*shard, Tier(tier));
      free_copy(*shard, Tier(tier));
    }
  }
  shards_.clear();
  if (host_registered_) (void)nvme_->engine().unregister_buffer(host_->base());
  nvme_.reset();
  device_.reset();
  host_.reset();
}

bool TieredStore::has_tier(Tier tier) const {
  switch (tier) {
    case Tier::device:
      return device_ != nullptr;
    case Tier::host:
      return host_ && host_->capacity() > 0;
    case Tier::nvme:
      return nvme_ != nullptr;
  }
  return false;
}

Status TieredStore::check_tier(Tier tier, const char* operation, ShardKey key) const {
  if (has_tier(tier)) return Status::ok();
  return Status::error(
      fmt::format("tiers: {} {}: the store has no {} tier; give it a budget "
                  "(device/host capacity or NVMe paths and capacity)",
                  operation, shard_name(key), tier_name(tier)));
}

TierUsage TieredStore::usage(Tier tier) const {
  switch (tier) {
    case Tier::device:
      return device_ ? device_->usage() : TierUsage{};
    case Tier::host:
      return host_->usage();
    case Tier::nvme:
      return nvme_ ? nvme_->usage() : TierUsage{};
  }
  return {};
}

std::string TieredStore::description() const {
  std::string text = fmt::format("host tier: {}\n", host_->description());
  if (device_) text += fmt::format("device tier: {}\n", device_->description());
  if (nvme_) text += fmt::format("nvme tier: {}\n", nvme_->description());
  return text;
}

Result<TieredStore::Shard*> TieredStore::acquire(ShardKey key) {
  std::unique_lock lock(mutex_);
  Shard* shard = nullptr;
  shard_released_.wait(lock, [&] {
    auto found = shards_.find(key);
    shard = found == shards_.end() ? nullptr : found->second.get();
    return shard == nullptr || !shard->busy;
  });
  if (!shard)
    return Status::error(fmt::format("tiers: no shard {}; add_shard it first", shard_name(key)));
  shard->busy = true;
  return shard;
}

void TieredStore::unlock_shard(Shard* shard) {
  {
    std::lock_guard lock(mutex_);
    shard->busy = false;
  }
  shard_released_.notify_all();
}

// Holds a shard for the length of one call; other calls on it wait.
class TieredStore::ShardHold {
 public:
  ShardHold(TieredStore* store, Shard* shard) : store_(store), shard_(shard) {}
  ShardHold(ShardHold&& other) noexcept
      : store_(other.store_), shard_(std::exchange(other.shard_, nullptr)) {}
  ShardHold& operator=(ShardHold&&) = delete;
  ~ShardHold() {
    if (shard_) store_->unlock_shard(shard_);
  }
  Shard& shard() const { return *shard_; }

 private:
  TieredStore* store_;
  Shard* shard_;
};

Result<TieredStore::ShardHold> TieredStore::hold(ShardKey key) {
  Result<Shard*> acquired = acquire(key);
  if (!acquired) return acquired.status();
  return ShardHold(this, *acquired);
}

void TieredStore::free_copy(Shard& shard, Tier tier) {
  Copy& copy = shard.at(tier);
  if (!copy.present) return;
  switch (tier) {
    case Tier::device:
      device_->free(copy.device);
      break;
    case Tier::host:
      host_->free(copy.host);
      break;
    case Tier::nvme:
      nvme_->free(copy.nvme);
      break;
  }
  copy.present = false;
}

// Completes whatever is in flight on `tier`'s copy. A failed load frees the
// copy; a failed writeback keeps it.
Status TieredStore::finish(Shard& shard, Tier tier) {
  Copy& copy = shard.at(tier);
  if (copy.phase == Copy::Phase::idle) return Status::ok();
  Status status;
  if (copy.io.valid()) status = copy.io.wait();
  copy.io = io::IoHandle();
  for (io::IoHandle& more : copy.more_io) {
    Status done = more.wait();
    if (status && !done) status = done;
  }
  copy.more_io.clear();
  if (status && copy.staging_to_device) {
    copy.device_copy = device_->copy_to_device(copy.device, 0, copy.staging->data, shard.bytes);
  }
  copy.staging_to_device = false;
  Status copied = copy.device_copy.wait();
  copy.device_copy = DeviceCopy();
  if (status && !copied) status = copied;
  if (copy.staging) {
    host_->free(*copy.staging);
    copy.staging.reset();
  }
  const bool loading = copy.phase == Copy::Phase::loading;
  copy.phase = Copy::Phase::idle;
  if (status) return status;
  if (loading) {
    free_copy(shard, tier);
    return status.with_context(fmt::format("tiers: loading {} into {} from {}",
                                           shard_name(shard.key), tier_name(tier),
                                           tier_name(copy.source)));
  }
  return status.with_context(
      fmt::format("tiers: writing back {} from {} to its home ({}); the "
                  "home may hold part of it, the {} copy is kept",
                  shard_name(shard.key), tier_name(tier), tier_name(shard.home), tier_name(tier)));
}

Status TieredStore::add_shard(ShardKey key, uint64_t bytes, Tier home) {
  if (Status status = check_tier(home, "add_shard", key); !status) return status;
  auto shard = std::make_unique<Shard>();
  shard->key = key;
  shard->bytes = bytes;
  shard->home = home;
  {
    std::lock_guard lock(mutex_);
    if (shards_.count(key))
      return Status::error(
          fmt::format("tiers: add_shard {}: the shard exists already", shard_name(key)));
  }
  Copy& copy = shard->at(home);
  const std::string what = shard_name(key);
  switch (home) {
    case Tier::device: {
      Result<DeviceBlock> block = device_->allocate(bytes, what);
      if (!block) return block.status();
      copy.device = *block;
      if (Status zeroed = device_->zero(*block); !zeroed) {
        device_->free(*block);
        return zeroed;
      }
      break;
    }
    case Tier::host: {
      Result<HostBlock> block = host_->allocate(bytes, what);
      if (!block) return block.status();
      copy.host = *block;
      std::memset(block->data, 0, host_->rounded(bytes));
      break;
    }
    case Tier::nvme: {
      Result<NvmeExtent> extent = nvme_->allocate(bytes, what);
      if (!extent) return extent.status();
      copy.nvme = *extent;
      break;
    }
  }
  copy.present = true;
  std::lock_guard lock(mutex_);
  if (shards_.count(key)) {
    free_copy(*shard, home);
    return Status::error(fmt::format("tiers: add_shard {}: the shard exists already", what));
  }
  shards_[key] = std::move(shard);
  return Status::ok();
}

Status TieredStore::remove_shard(ShardKey key) {
  Result<Shard*> acquired = acquire(key);
  if (!acquired) return acquired.status();
  Shard& shard = **acquired;
  Status result;
  for (int tier = 0; tier < kTierCount; ++tier) {
    Status status = finish(shard, Tier(tier));
    if (!status && result) result = status;
    free_copy(shard, Tier(tier));
  }
  {
    std::lock_guard lock(mutex_);
    shards_.erase(key);
  }
  shard_released_.notify_all();
  return result;
}

Result<HostBlock> TieredStore::allocate_host_copy(ShardKey key, uint64_t bytes,
                                                  const std::string& what) {
  const bool slot = key.kind == ShardKind::param && bytes <= param_copy_bytes_;
  return host_->allocate(slot ? param_copy_bytes_ : bytes, what);
}

Status TieredStore::prefetch(ShardKey key, Tier to) {
  if (Status status = check_tier(to, "prefetch", key); !status) return status;
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  if (!faster_than(to, shard.home))
    return Status::error(
        fmt::format("tiers: prefetch {} to {}: its home is {}; a prefetch moves "
                    "a shard to a faster tier than its home",
                    shard_name(key), tier_name(to), tier_name(shard.home)));
  Copy& copy = shard.at(to);
  if (copy.present) return Status::ok();  // there already, or on its way

  Tier source = shard.home;
  if (to == Tier::device && shard.home == Tier::nvme && shard.at(Tier::host).present) {
    if (Status status = finish(shard, Tier::host); !status) return status;
    if (shard.at(Tier::host).present) source = Tier::host;
  }
  if (source == shard.home) {
    if (Status status = settle_writes(shard); !status) return status;
  }
  const std::string what = shard_name(key);
  const Copy& from = shard.at(source);
  if (to == Tier::host) {  // from the NVMe home
    Result<HostBlock> block = allocate_host_copy(key, shard.bytes, what);
    if (!block) return block.status();
    copy.host = *block;
    copy.present = true;
    copy.io = nvme_->read(from.nvme, 0, block->data, nvme_->rounded(shard.bytes));
  } else {  // to the device
    Result<DeviceBlock> block = device_->allocate(shard.bytes, what);
    if (!block) return block.status();
    copy.device = *block;
    if (source == Tier::host) {
      copy.device_copy = device_->copy_to_device(*block, 0, from.host.data, shard.bytes);
    } else {  // NVMe -> host staging -> device
      Result<HostBlock> staging =
          allocate_host_copy(key, shard.bytes, what + " (staging to the device)");
      if (!staging) {
        device_->free(*block);
        return staging.status();
      }
      copy.staging = *staging;
      copy.staging_to_device = true;
      copy.io = nvme_->read(from.nvme, 0, staging->data, nvme_->rounded(shard.bytes));
    }
    copy.present = true;
  }
  copy.source = source;
  copy.phase = Copy::Phase::loading;
  return Status::ok();
}

Status TieredStore::settle_writes(Shard& shard) {
  for (int tier = 0; tier < kTierCount; ++tier) {
    if (shard.at(Tier(tier)).phase == Copy::Phase::writing) {
      if (Status status = finish(shard, Tier(tier)); !status) return status;
    }
  }
  return Status::ok();
}

uint64_t TieredStore::nvme_alignment() const {
  return nvme_ ? nvme_->alignment() : 1;
}

Status TieredStore::check_ranges(const Shard& shard, ShardKey key,
                                 std::span<const ByteRange> ranges, const char* operation) const {
  if (shard.home != Tier::nvme)
    return Status::error(
        fmt::format("tiers: {} {}: its home is {}; only an NVMe home is read or written "
                    "in ranges",
                    operation, shard_name(key), tier_name(shard.home)));
  const uint64_t alignment = nvme_->alignment(), size = nvme_->rounded(shard.bytes);
  for (const ByteRange& range : ranges) {
    if (range.offset % alignment != 0 || range.bytes % alignment != 0 ||
        range.offset + range.bytes > size)
      return Status::error(fmt::format(
          "tiers: {} {}: range [{}, {}) is not {}-byte aligned inside the shard's {} bytes",
          operation, shard_name(key), range.offset, range.offset + range.bytes, alignment, size));
  }
  return Status::ok();
}

Status TieredStore::prefetch_ranges(ShardKey key, std::span<const ByteRange> ranges) {
  if (Status status = check_tier(Tier::host, "prefetch_ranges", key); !status) return status;
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  if (Status status = check_ranges(shard, key, ranges, "prefetch_ranges"); !status) return status;
  Copy& copy = shard.at(Tier::host);
  if (copy.present) return Status::ok();  // there already, or on its way
  if (Status status = settle_writes(shard); !status) return status;
  Result<HostBlock> block = allocate_host_copy(key, shard.bytes, shard_name(key));
  if (!block) return block.status();
  copy.host = *block;
  copy.present = true;
  const Copy& home = shard.at(Tier::nvme);
  for (const ByteRange& range : ranges) {
    io::IoHandle read =
        nvme_->read(home.nvme, range.offset, block->data + range.offset, range.bytes);
    if (!copy.io.valid())
      copy.io = std::move(read);
    else
      copy.more_io.push_back(std::move(read));
  }
  copy.source = Tier::nvme;
  copy.phase = Copy::Phase::loading;
  return Status::ok();
}

Status TieredStore::read_home_ranges(ShardKey key, std::span<const ByteRange> ranges,
                                     std::byte* buffer) {
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  if (Status status = check_ranges(shard, key, ranges, "read_home_ranges"); !status) return status;
  if (Status status = settle_writes(shard); !status) return status;
  std::vector<io::IoHandle> reads;
  for (const ByteRange& range : ranges)
    reads.push_back(
        nvme_->read(shard.at(Tier::nvme).nvme, range.offset, buffer + range.offset, range.bytes));
  return wait_for_all(reads).with_context(
      fmt::format("tiers: read_home_ranges {}", shard_name(key)));
}

Status TieredStore::write_home_ranges(ShardKey key, std::span<const ByteRange> ranges,
                                      const std::byte* buffer) {
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  if (Status status = check_ranges(shard, key, ranges, "write_home_ranges"); !status) return status;
  // Transfers in flight read or write the home: let them end first.
  for (int tier = 0; tier < kTierCount; ++tier) {
    if (Status status = finish(shard, Tier(tier)); !status) return status;
  }
  std::vector<io::IoHandle> writes;
  for (const ByteRange& range : ranges)
    writes.push_back(
        nvme_->write(shard.at(Tier::nvme).nvme, range.offset, buffer + range.offset, range.bytes));
  return wait_for_all(writes).with_context(
      fmt::format("tiers: write_home_ranges {}", shard_name(key)));
}

Result<ShardView> TieredStore::wait(ShardKey key, Tier at) {
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  Copy& copy = shard.at(at);
  if (!copy.present)
    return Status::error(fmt::format("tiers: wait {} in {}: no copy there; prefetch it first",
                                     shard_name(key), tier_name(at)));
  if (Status status = finish(shard, at); !status) return status;
  std::byte* data = at == Tier::device ? copy.device.data
                    : at == Tier::host ? copy.host.data
                                       : nullptr;
  return ShardView{data, shard.bytes, at};
}

Status TieredStore::writeback(ShardKey key, Tier from) {
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  Copy& copy = shard.at(from);
  if (from == shard.home || !copy.present)
    return Status::error(
        fmt::format("tiers: writeback {} from {}: {}", shard_name(key), tier_name(from),
                    from == shard.home ? "that is its home" : "no copy there; prefetch it first"));
  // The load must be complete; nothing else may read or write the home meanwhile
  // (another copy's write-back, or a load from the home).
  if (Status status = finish(shard, from); !status) return status;
  for (int tier = 0; tier < kTierCount; ++tier) {
    if (Tier(tier) != from && shard.at(Tier(tier)).phase != Copy::Phase::idle) {
      if (Status status = finish(shard, Tier(tier)); !status) return status;
    }
  }
  Copy& home = shard.at(shard.home);
  if (from == Tier::host) {  // to the NVMe home
    copy.io = nvme_->write(home.nvme, 0, copy.host.data, nvme_->rounded(shard.bytes));
  } else if (shard.home == Tier::host) {  // device -> host home
    copy.device_copy = device_->copy_to_host(home.host.data, copy.device, 0, shard.bytes);
  } else {  // device -> host staging -> NVMe home
    Result<HostBlock> staging =
        host_->allocate(shard.bytes, shard_name(key) + " (staging from the device)");
    if (!staging) return staging.status();
    Status copied = device_->copy_to_host(staging->data, copy.device, 0, shard.bytes).wait();
    if (!copied) {
      host_->free(*staging);
      return copied.with_context(
          fmt::format("tiers: writing back {} from device", shard_name(key)));
    }
    copy.staging = *staging;
    copy.io = nvme_->write(home.nvme, 0, staging->data, nvme_->rounded(shard.bytes));
  }
  copy.phase = Copy::Phase::writing;
  return Status::ok();
}

Status TieredStore::release(ShardKey key, Tier at) {
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  if (at == shard.home)
    return Status::error(
        fmt::format("tiers: release {} in {}: that is its home; remove_shard frees it",
                    shard_name(key), tier_name(at)));
  Copy& copy = shard.at(at);
  if (!copy.present) return Status::ok();
  Status result;
  // A load still reading from this copy must end before its bytes go.
  for (int tier = 0; tier < kTierCount; ++tier) {
    Copy& other = shard.at(Tier(tier));
    if (Tier(tier) != at && other.phase == Copy::Phase::loading && other.source == at) {
      Status status = finish(shard, Tier(tier));
      if (!status && result) result = status;
    }
  }
  Status status = finish(shard, at);
  if (!status && result) result = status;
  free_copy(shard, at);
  return result;
}

Result<ShardHome> TieredStore::home(ShardKey key) const {
  std::lock_guard lock(mutex_);
  auto found = shards_.find(key);
  if (found == shards_.end())
    return Status::error(fmt::format("tiers: no shard {}; add_shard it first", shard_name(key)));
  const Shard& shard = *found->second;
  const Copy& copy = shard.copies[static_cast<int>(shard.home)];
  ShardHome result;
  result.tier = shard.home;
  result.bytes = shard.bytes;
  result.data = shard.home == Tier::device ? copy.device.data
                : shard.home == Tier::host ? copy.host.data
                                           : nullptr;
  result.extent = copy.nvme;
  return result;
}

Status TieredStore::settle_for_whole_copy(Shard& shard, ShardKey key, size_t given,
                                          const char* operation) {
  if (given != shard.bytes) {
    return Status::error(fmt::format("tiers: {} {}: {} bytes given, the shard has {}", operation,
                                     shard_name(key), given, shard.bytes));
  }
  // Transfers in flight read or write the home: let them end first.
  for (int tier = 0; tier < kTierCount; ++tier) {
    if (Status status = finish(shard, Tier(tier)); !status) return status;
  }
  return Status::ok();
}

Result<HostBlock> TieredStore::take_staging(ShardKey key, uint64_t padded, const char* operation) {
  if (!staging_reserved_)
    return host_->allocate(std::min(padded, kShardStagingBytes),
                           fmt::format("{} ({} staging)", shard_name(key), operation));
  std::unique_lock lock(staging_mutex_);
  staging_returned_.wait(lock, [&] { return !staging_free_.empty(); });
  const HostBlock block = staging_free_.back();
  staging_free_.pop_back();
  return block;
}

void TieredStore::return_staging(const HostBlock& block) {
  if (!staging_reserved_) {
    host_->free(block);
    return;
  }
  {
    std::lock_guard lock(staging_mutex_);
    staging_free_.push_back(block);
  }
  staging_returned_.notify_one();
}

Status TieredStore::write_shard(ShardKey key, std::span<const std::byte> bytes) {
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  if (Status settled = settle_for_whole_copy(shard, key, bytes.size(), "write_shard"); !settled) {
    return settled;
  }
  Copy& home = shard.at(shard.home);
  switch (shard.home) {
    case Tier::host:
      std::memcpy(home.host.data, bytes.data(), bytes.size());
      return Status::ok();
    case Tier::device:
      return device_->copy_to_device(home.device, 0, bytes.data(), bytes.size()).wait();
    case Tier::nvme:
      break;
  }
  // Through a bounded staging block, so a large shard needs little host budget.
  const uint64_t padded = nvme_->rounded(shard.bytes);
  Result<HostBlock> staging = take_staging(key, padded, "write_shard");
  if (!staging) return staging.status();
  const uint64_t step = std::min(padded, staging->size);
  Status status;
  for (uint64_t offset = 0; offset < padded && status; offset += step) {
    const uint64_t length = std::min(step, padded - offset);
    const uint64_t given =
        offset < bytes.size() ? std::min<uint64_t>(length, bytes.size() - offset) : 0;
    std::memcpy(staging->data, bytes.data() + offset, given);
    std::memset(staging->data + given, 0, length - given);
    status = nvme_->write(home.nvme, offset, staging->data, length).wait();
  }
  return_staging(*staging);
  return status.with_context(fmt::format("tiers: write_shard {}", shard_name(key)));
}

Status TieredStore::read_shard(ShardKey key, std::span<std::byte> bytes) {
  Result<ShardHold> held = hold(key);
  if (!held) return held.status();
  Shard& shard = held->shard();
  if (Status settled = settle_for_whole_copy(shard, key, bytes.size(), "read_shard"); !settled) {
    return settled;
  }
  Copy& home = shard.at(shard.home);
  switch (shard.home) {
    case Tier::host:
      std::memcpy(bytes.data(), home.host.data, bytes.size());
      return Status::ok();
    case Tier::device:
      return device_->copy_to_host(bytes.data(), home.device, 0, bytes.size()).wait();
    case Tier::nvme:
      break;
  }
  const uint64_t padded = nvme_->rounded(shard.bytes);
  Result<HostBlock> staging = take_staging(key, padded, "read_shard");
  if (!staging) return staging.status();
  const uint64_t step = std::min(padded, staging->size);
  Status status;
  for (uint64_t offset = 0; offset < padded && status; offset += step) {
    const uint64_t length = std::min(step, padded - offset);
    status = nvme_->read(home.nvme, offset, staging->data, length).wait();
    if (status && offset < bytes.size())
      std::memcpy(bytes.data() + offset, staging->data,
                  std::min<uint64_t>(length, bytes.size() - offset));
  }
  return_staging(*staging);
  return status.with_context(fmt::format("tiers: read_shard {}", shard_name(key)));
}

}  // namespace strata::tiers
