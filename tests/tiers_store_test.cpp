// TieredStore: shards keep their bytes through any sequence of prefetch, wait,
// change, writeback and release across the three tiers; budgets are never
// exceeded and a request that does not fit fails with the numbers before
// anything moves; several threads at once; injected I/O faults surface as
// errors and leave other shards intact.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <optional>
#include <thread>

#include "tiers_test_support.h"

namespace strata::tiers {
namespace {

using io::testing::TemporaryDirectory;
using testing::fresh_seed;
using testing::Notices;
using testing::open_test_store;
using testing::random_bytes;
using testing::StoreSizes;

void expect_within_budgets(TieredStore& store) {
  for (Tier tier : {Tier::device, Tier::host, Tier::nvme}) {
    TierUsage usage = store.usage(tier);
    EXPECT_LE(usage.used, usage.capacity) << tier_name(tier);
    EXPECT_LE(usage.peak, usage.capacity) << tier_name(tier);
    EXPECT_LE(usage.used, usage.peak) << tier_name(tier);
  }
}

// What every copy of one shard must hold, by the store's contract.
struct ShardModel {
  ShardKey key;
  Tier home = Tier::nvme;
  std::vector<std::byte> home_bytes;
  std::map<Tier, std::vector<std::byte>> copies;  // non-home copies
};

// Random operations on a set of shards that only this driver touches.
class RandomDriver {
 public:
  RandomDriver(TieredStore& store, std::vector<ShardModel>& shards, uint64_t seed)
      : store_(store), shards_(shards), random_(seed) {}

  int budget_failures = 0;

  void step() {
    ShardModel& shard = shards_[random_() % shards_.size()];
    std::vector<Tier> faster;
    for (Tier tier : {Tier::device, Tier::host})
      if (faster_than(tier, shard.home)) faster.push_back(tier);
    if (faster.empty()) return check_home(shard);
    const Tier tier = faster[random_() % faster.size()];
    const bool present = shard.copies.count(tier) > 0;
    switch (random_() % 6) {
      case 0:
      case 1: {  // prefetch
        Status status = store_.prefetch(shard.key, tier);
        if (present) {
          EXPECT_TRUE(status.is_ok()) << status.message();
          return;
        }
        if (!status) {
          // Only a budget may refuse; nothing was charged and no copy appeared.
          EXPECT_NE(status.message().find(" tier: "), std::string::npos) << status.message();
          EXPECT_FALSE(store_.wait(shard.key, tier).is_ok());
          ++budget_failures;
          return;
        }
        const bool from_host =
            tier == Tier::device && shard.home == Tier::nvme && shard.copies.count(Tier::host);
        shard.copies[tier] = from_host ? shard.copies[Tier::host] : shard.home_bytes;
        return;
      }
      case 2: {  // wait and compare
        Result<ShardView> view = store_.wait(shard.key, tier);
        ASSERT_EQ(view.is_ok(), present)
            << shard_name(shard.key) << " " << tier_name(tier) << ": " << view.status().message();
        if (present) {
          ASSERT_EQ(view->bytes, shard.copies[tier].size());
          ASSERT_EQ(std::memcmp(view->data, shard.copies[tier].data(), view->bytes), 0)
              << shard_name(shard.key) << " in " << tier_name(tier) << " holds wrong bytes";
        }
        return;
      }
      case 3: {  // change the copy in place
        if (!present) return;
        Result<ShardView> view = store_.wait(shard.key, tier);
        ASSERT_TRUE(view.is_ok()) << view.status().message();
        std::vector<std::byte> changed = random_bytes(view->bytes, random_);
        std::memcpy(view->data, changed.data(), changed.size());
        shard.copies[tier] = std::move(changed);
        return;
      }
      case 4: {  // write back
        Status status = store_.writeback(shard.key, tier);
        if (present && !status) {
          // Device to NVMe stages through the host, whose budget may refuse.
          EXPECT_NE(status.message().find("host tier: "), std::string::npos) << status.message();
          ++budget_failures;
          return;
        }
        EXPECT_EQ(status.is_ok(), present) << status.message();
        if (!status) return;
        shard.home_bytes = shard.copies[tier];
        return;
      }
      case 5: {  // release
        Status status = store_.release(shard.key, tier);
        EXPECT_TRUE(status.is_ok()) << status.message();
        shard.copies.erase(tier);
        return;
      }
    }
  }

  void check_home(const ShardModel& shard) {
    std::vector<std::byte> back(shard.home_bytes.size());
    Status status = store_.read_shard(shard.key, back);
    ASSERT_TRUE(status.is_ok()) << status.message();
    ASSERT_EQ(std::memcmp(back.data(), shard.home_bytes.data(), back.size()), 0)
        << shard_name(shard.key) << " home holds wrong bytes";
  }

 private:
  TieredStore& store_;
  std::vector<ShardModel>& shards_;
  std::mt19937_64 random_;
};

std::vector<ShardModel> add_random_shards(TieredStore& store, int first_unit, int count,
                                          std::mt19937_64& random) {
  std::vector<ShardModel> shards;
  for (int i = 0; i < count; ++i) {
    ShardModel shard;
    shard.key = {first_unit + i, ShardKind(random() % 5)};
    const uint64_t roll = random() % 10;
    shard.home = roll < 6 ? Tier::nvme : roll < 9 ? Tier::host : Tier::device;
    // Sizes that are and are not multiples of the I/O alignment.
    const size_t size = random() % 2 ? (1 + random() % 64) * 4096 : 1 + random() % (256 << 10);
    Status added = store.add_shard(shard.key, size, shard.home);
    EXPECT_TRUE(added.is_ok()) << added.message();
    if (!added) continue;
    shard.home_bytes = random_bytes(size, random);
    Status written = store.write_shard(shard.key, shard.home_bytes);
    EXPECT_TRUE(written.is_ok()) << written.message();
    shards.push_back(std::move(shard));
  }
  return shards;
}

TEST(TieredStoreTest, RandomSequencesKeepEveryShardsBytes) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  const uint64_t seed = fresh_seed("RandomSequencesKeepEveryShardsBytes");
  std::mt19937_64 random(seed);
  Notices notices;
  // Small device and host budgets, so that requests are refused now and then.
  auto store = open_test_store(directory.path(), StoreSizes{2 << 20, 3 << 20, 64 << 20}, notices);
  ASSERT_TRUE(store.is_ok()) << store.status().message();
  std::vector<ShardModel> shards = add_random_shards(**store, 0, 24, random);
  RandomDriver driver(**store, shards, random());
  for (int i = 0; i < 3000; ++i) {
    driver.step();
    if (::testing::Test::HasFatalFailure()) return;
    expect_within_budgets(**store);
  }
  for (ShardModel& shard : shards) {
    for (auto& [tier, bytes] : shard.copies) {
      Result<ShardView> view = (*store)->wait(shard.key, tier);
      ASSERT_TRUE(view.is_ok()) << view.status().message();
      EXPECT_EQ(std::memcmp(view->data, bytes.data(), bytes.size()), 0);
      EXPECT_TRUE((*store)->release(shard.key, tier).is_ok());
    }
  }
  for (ShardModel& shard : shards) driver.check_home(shard);
  std::printf("budget refusals: %d\n", driver.budget_failures);
  // Only homes remain.
  uint64_t host_homes = 0;
  for (const ShardModel& shard : shards)
    if (shard.home == Tier::host) host_homes += (shard.home_bytes.size() + 4095) / 4096 * 4096;
  EXPECT_EQ((*store)->usage(Tier::host).used, host_homes);
}

TEST(TieredStoreTest, OverBudgetRequestFailsWithTheNumbersBeforeAnythingMoves) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{4 << 20, 8 << 20, 16 << 20}, notices);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  TieredStore& store = **opened;
  std::mt19937_64 random(7);
  std::vector<std::vector<std::byte>> contents;
  for (int unit = 0; unit < 4; ++unit) {
    ASSERT_TRUE(store.add_shard({unit, ShardKind::m}, 3 << 20, Tier::nvme).is_ok());
    contents.push_back(random_bytes(3 << 20, random));
    ASSERT_TRUE(store.write_shard({unit, ShardKind::m}, contents.back()).is_ok());
  }
  // NVMe: 12 MiB of 16 MiB used; 6 MiB more does not fit.
  Status nvme_full = store.add_shard({9, ShardKind::v}, 6 << 20, Tier::nvme);
  ASSERT_FALSE(nvme_full.is_ok());
  EXPECT_NE(nvme_full.message().find("nvme tier"), std::string::npos) << nvme_full.message();
  EXPECT_NE(nvme_full.message().find("6.00 MiB"), std::string::npos) << nvme_full.message();

  ASSERT_TRUE(store.prefetch({0, ShardKind::m}, Tier::host).is_ok());
  ASSERT_TRUE(store.prefetch({1, ShardKind::m}, Tier::host).is_ok());
  const TierUsage before = store.usage(Tier::host);
  Status refused = store.prefetch({2, ShardKind::m}, Tier::host);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.message().find("host tier: cannot hold 3.00 MiB more for (unit 2, m)"),
            std::string::npos)
      << refused.message();
  EXPECT_NE(refused.message().find("6.00 MiB of 8.00 MiB in use"), std::string::npos)
      << refused.message();
  EXPECT_NE(refused.message().find("raise the host budget"), std::string::npos)
      << refused.message();
  EXPECT_EQ(store.usage(Tier::host).used, before.used);
  EXPECT_FALSE(store.wait({2, ShardKind::m}, Tier::host).is_ok());

  // NVMe -> device stages through the host: the device has room, the host does not.
  const TierUsage device_before = store.usage(Tier::device);
  Status staged = store.prefetch({3, ShardKind::m}, Tier::device);
  ASSERT_FALSE(staged.is_ok());
  EXPECT_NE(staged.message().find("staging"), std::string::npos) << staged.message();
  EXPECT_EQ(store.usage(Tier::device).used, device_before.used);

  // Through the host copy it fits.
  ASSERT_TRUE(store.prefetch({0, ShardKind::m}, Tier::device).is_ok());
  Result<ShardView> on_device = store.wait({0, ShardKind::m}, Tier::device);
  ASSERT_TRUE(on_device.is_ok()) << on_device.status().message();
  EXPECT_EQ(std::memcmp(on_device->data, contents[0].data(), contents[0].size()), 0);
  Status device_full = store.prefetch({1, ShardKind::m}, Tier::device);
  EXPECT_FALSE(device_full.is_ok());
  EXPECT_NE(device_full.message().find("raise the device budget"), std::string::npos)
      << device_full.message();

  for (Tier tier : {Tier::device, Tier::host, Tier::nvme}) {
    EXPECT_LE(store.usage(tier).peak, store.usage(tier).capacity);
  }
  EXPECT_EQ(store.usage(Tier::host).peak, 6u << 20);
  EXPECT_EQ(store.usage(Tier::device).peak, 3u << 20);
  // Everything else is unchanged.
  ASSERT_TRUE(store.release({0, ShardKind::m}, Tier::host).is_ok());
  ASSERT_TRUE(store.release({1, ShardKind::m}, Tier::host).is_ok());
  for (int unit = 0; unit < 4; ++unit) {
    std::vector<std::byte> back(3 << 20);
    Status read = store.read_shard({unit, ShardKind::m}, back);
    ASSERT_TRUE(read.is_ok()) << read.message();
    EXPECT_EQ(back, contents[unit]);
  }
}

// A store of `host` bytes of pool and 16 MiB of swap in `directory`, on the CPU.
TieredStoreOptions small_nvme_store(const TemporaryDirectory& directory, uint64_t host,
                                    Notices& notices) {
  TieredStoreOptions options;
  options.host_capacity = host;
  options.nvme_capacity = 16 << 20;
  options.io.paths = {directory.path()};
  options.io.block_size = 64 << 10;
  options.io.queue_depth = 8;
  options.use_gpu = false;
  options.notice = notices.sink();
  return options;
}

// Host copies of parameter shards of mixed sizes: three slots' worth of
// pool, a copy of 768 KiB between two of 1 MiB released, and a 1 MiB copy
// finds 1 MiB free in two ranges (first fit fragments); with
// param_copy_bytes each copy takes a whole slot and it fits.
TEST(TieredStoreTest, ParameterCopiesInSlotsDoNotFragmentThePool) {
  for (uint64_t slot : {uint64_t{0}, uint64_t{1} << 20}) {
    TemporaryDirectory directory;
    STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
    Notices notices;
    TieredStoreOptions options = small_nvme_store(directory, 3 << 20, notices);
    options.param_copy_bytes = slot;
    auto opened = TieredStore::open(options);
    ASSERT_TRUE(opened.is_ok()) << opened.status().message();
    TieredStore& store = **opened;
    const uint64_t sizes[4] = {1 << 20, 768 << 10, 1 << 20, 1 << 20};
    for (int unit = 0; unit < 4; ++unit)
      ASSERT_TRUE(store.add_shard({unit, ShardKind::param}, sizes[unit], Tier::nvme).is_ok());
    for (int unit = 0; unit < 3; ++unit)
      ASSERT_TRUE(store.prefetch({unit, ShardKind::param}, Tier::host).is_ok()) << unit;
    ASSERT_TRUE(store.release({1, ShardKind::param}, Tier::host).is_ok());
    const Status fourth = store.prefetch({3, ShardKind::param}, Tier::host);
    if (slot == 0) {
      ASSERT_FALSE(fourth.is_ok()) << "the pool did not fragment: the check shows nothing";
      EXPECT_NE(fourth.message().find("(fragmented)"), std::string::npos) << fourth.message();
    } else {
      EXPECT_TRUE(fourth.is_ok()) << fourth.message();
    }
  }
}

TEST(TieredStoreTest, ContractMisusesAreErrors) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{}, notices);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  TieredStore& store = **opened;
  ASSERT_TRUE(store.add_shard({0, ShardKind::grad}, 4096, Tier::host).is_ok());
  EXPECT_FALSE(store.add_shard({0, ShardKind::grad}, 4096, Tier::host).is_ok());
  EXPECT_FALSE(store.prefetch({0, ShardKind::grad}, Tier::host).is_ok());     // its home
  EXPECT_FALSE(store.prefetch({0, ShardKind::grad}, Tier::nvme).is_ok());     // slower
  EXPECT_FALSE(store.writeback({0, ShardKind::grad}, Tier::device).is_ok());  // no copy
  EXPECT_FALSE(store.release({0, ShardKind::grad}, Tier::host).is_ok());      // its home
  Status missing = store.prefetch({5, ShardKind::m}, Tier::host);
  EXPECT_NE(missing.message().find("no shard (unit 5, m)"), std::string::npos) << missing.message();
  EXPECT_TRUE(store.remove_shard({0, ShardKind::grad}).is_ok());
  EXPECT_EQ(store.usage(Tier::host).used, 0u);
}

TEST(TieredStoreTest, WholeShardCopiesStageThroughABoundedBlock) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{0, 70 << 20, 160 << 20}, notices);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  TieredStore& store = **opened;
  std::mt19937_64 random(11);
  const size_t size = (150 << 20) + 123;  // three staging blocks, the last one ragged
  ASSERT_TRUE(store.add_shard({0, ShardKind::master}, size, Tier::nvme).is_ok());
  const std::vector<std::byte> bytes = random_bytes(size, random);
  Status written = store.write_shard({0, ShardKind::master}, bytes);
  ASSERT_TRUE(written.is_ok()) << written.message();
  std::vector<std::byte> back(size);
  Status read = store.read_shard({0, ShardKind::master}, back);
  ASSERT_TRUE(read.is_ok()) << read.message();
  EXPECT_TRUE(back == bytes);
  EXPECT_EQ(store.usage(Tier::host).peak, 64u << 20);
}

// With staging blocks reserved, whole-shard copies of every kind and size
// stage through them and allocate nothing: they go on though no byte of the
// pool is free (where a block of their own is refused), and threads at once
// take turns at the one block, each shard keeping its bytes.
TEST(TieredStoreTest, ReservedStagingBlocksServeEveryWholeShardCopy) {
  for (int blocks : {0, 1}) {
    SCOPED_TRACE(::testing::Message() << blocks << " staging blocks reserved");
    TemporaryDirectory directory;
    STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
    Notices notices;
    TieredStoreOptions options = small_nvme_store(directory, 2 << 20, notices);
    options.staging_bytes = 200000;  // rounded up to the alignment
    options.staging_blocks = blocks;
    auto opened = TieredStore::open(options);
    ASSERT_TRUE(opened.is_ok()) << opened.status().message();
    TieredStore& store = **opened;
    const uint64_t reserved = store.usage(Tier::host).used;
    EXPECT_EQ(reserved, blocks == 0 ? 0
                                    : (200000 + store.nvme_alignment() - 1) /
                                          store.nvme_alignment() * store.nvme_alignment());
    std::mt19937_64 random(fresh_seed("tiers_store_staging"));
    const ShardKey keys[4] = {
        {0, ShardKind::grad}, {1, ShardKind::m}, {2, ShardKind::param}, {3, ShardKind::v}};
    const size_t sizes[4] = {(1 << 20) + 123, 300001, 4096, 777};
    std::vector<std::byte> bytes[4];
    for (int i = 0; i < 4; ++i) {
      ASSERT_TRUE(store.add_shard(keys[i], sizes[i], Tier::nvme).is_ok());
      bytes[i] = random_bytes(sizes[i], random);
    }
    // Nothing of the pool left beside the reserved blocks.
    Result<HostBlock> rest =
        store.host_tier().allocate(options.host_capacity - reserved, "the rest of the pool");
    ASSERT_TRUE(rest.is_ok()) << rest.status().message();
    if (blocks == 0) {
      const Status refused = store.write_shard(keys[0], bytes[0]);
      ASSERT_FALSE(refused.is_ok()) << "staged though the pool is full: the check shows nothing";
      EXPECT_NE(refused.message().find("write_shard staging"), std::string::npos)
          << refused.message();
      continue;
    }
    std::vector<std::thread> threads;
    Status results[4];
    for (int i = 0; i < 4; ++i)
      threads.emplace_back([&, i] {
        std::vector<std::byte> back(sizes[i]);
        for (int round = 0; round < 3 && results[i].is_ok(); ++round) {
          results[i] = store.write_shard(keys[i], bytes[i]);
          if (results[i].is_ok()) results[i] = store.read_shard(keys[i], back);
          if (results[i].is_ok() && back != bytes[i])
            results[i] = Status::error(fmt::format("shard {} read back other bytes", i));
        }
      });
    for (std::thread& thread : threads) thread.join();
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(results[i].is_ok()) << results[i].message();
    EXPECT_EQ(store.usage(Tier::host).peak, options.host_capacity);
  }
}

// Ranges of an NVMe home, read ahead into a host copy or straight into a
// caller's buffer, hold the home's bytes there; a range off the alignment or
// past the shard, or of a home elsewhere, is refused in one line.
TEST(TieredStoreTest, RangesOfAnNvmeHomeReadAndWriteOnlyThoseBytes) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{}, notices);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  TieredStore& store = **opened;
  std::mt19937_64 random(fresh_seed("tiers_store_ranges"));
  const uint64_t a = store.nvme_alignment();
  const size_t size = 9 * a;
  const ShardKey key{3, ShardKind::param};
  ASSERT_TRUE(store.add_shard(key, size, Tier::nvme).is_ok());
  const std::vector<std::byte> bytes = random_bytes(size, random);
  ASSERT_TRUE(store.write_shard(key, bytes).is_ok());
  const std::vector<ByteRange> ranges = {{0, a}, {3 * a, 2 * a}, {8 * a, a}};
  auto holds_ranges = [&](const std::byte* got) {
    for (const ByteRange& r : ranges)
      EXPECT_EQ(std::memcmp(got + r.offset, bytes.data() + r.offset, r.bytes), 0) << r.offset;
  };
  const uint64_t read_before = store.nvme_tier()->engine().counters().bytes_read;
  ASSERT_TRUE(store.prefetch_ranges(key, ranges).is_ok());
  Result<ShardView> view = store.wait(key, Tier::host);
  ASSERT_TRUE(view.is_ok()) << view.status().message();
  holds_ranges(view->data);
  ASSERT_TRUE(store.release(key, Tier::host).is_ok());
  EXPECT_EQ(store.nvme_tier()->engine().counters().bytes_read - read_before, 4 * a);

  Result<HostBlock> block = store.host_tier().allocate(size, "test buffer");
  ASSERT_TRUE(block.is_ok()) << block.status().message();
  std::memset(block->data, 0x5a, size);
  ASSERT_TRUE(store.read_home_ranges(key, ranges, block->data).is_ok());
  holds_ranges(block->data);
  EXPECT_EQ(std::to_integer<int>(block->data[a]), 0x5a);  // outside the ranges: untouched
  store.host_tier().free(*block);

  // Written in ranges: those bytes change, the rest of the home keeps its own.
  Result<HostBlock> source = store.host_tier().allocate(size, "test source");
  ASSERT_TRUE(source.is_ok()) << source.status().message();
  const std::vector<std::byte> fresh = random_bytes(size, random);
  std::memcpy(source->data, fresh.data(), size);
  const uint64_t written_before = store.nvme_tier()->engine().counters().bytes_written;
  ASSERT_TRUE(store.write_home_ranges(key, ranges, source->data).is_ok());
  EXPECT_EQ(store.nvme_tier()->engine().counters().bytes_written - written_before, 4 * a);
  store.host_tier().free(*source);
  std::vector<std::byte> back(size);
  ASSERT_TRUE(store.read_shard(key, back).is_ok());
  for (uint64_t block = 0; block < 9; ++block) {
    const bool in_range = block == 0 || block == 3 || block == 4 || block == 8;
    const std::byte* expected = (in_range ? fresh : bytes).data() + block * a;
    EXPECT_EQ(std::memcmp(back.data() + block * a, expected, a), 0) << "block " << block;
  }
  Status ragged_write = store.write_home_ranges(key, std::vector<ByteRange>{{a / 2, a}}, nullptr);
  EXPECT_NE(ragged_write.message().find("write_home_ranges"), std::string::npos)
      << ragged_write.message();

  const std::vector<ByteRange> ragged = {{a / 2, a}};
  Status refused = store.prefetch_ranges(key, ragged);
  EXPECT_NE(refused.message().find("is not " + std::to_string(a) + "-byte aligned"),
            std::string::npos)
      << refused.message();
  const std::vector<ByteRange> past = {{9 * a, a}};
  EXPECT_FALSE(store.read_home_ranges(key, past, nullptr).is_ok());
  ASSERT_TRUE(store.add_shard({4, ShardKind::param}, a, Tier::host).is_ok());
  Status host_home = store.prefetch_ranges({4, ShardKind::param}, ranges);
  EXPECT_NE(host_home.message().find("its home is host"), std::string::npos) << host_home.message();
}

TEST(TieredStoreTest, SeveralThreadsAtOnce) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  const uint64_t seed = fresh_seed("SeveralThreadsAtOnce");
  std::mt19937_64 random(seed);
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{4 << 20, 8 << 20, 96 << 20}, notices);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  TieredStore& store = **opened;

  // Shared, read-only shards every thread prefetches and checks.
  std::vector<std::vector<std::byte>> shared;
  for (int unit = 1000; unit < 1004; ++unit) {
    ASSERT_TRUE(store.add_shard({unit, ShardKind::param}, 100000, Tier::nvme).is_ok());
    shared.push_back(random_bytes(100000, random));
    ASSERT_TRUE(store.write_shard({unit, ShardKind::param}, shared.back()).is_ok());
  }
  constexpr int kThreads = 4;
  std::vector<std::vector<ShardModel>> owned(kThreads);
  for (int t = 0; t < kThreads; ++t) owned[t] = add_random_shards(store, t * 100, 6, random);
  std::vector<uint64_t> seeds;
  for (int t = 0; t < kThreads; ++t) seeds.push_back(random());

  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      RandomDriver driver(store, owned[t], seeds[t]);
      std::mt19937_64 local(seeds[t] + 1);
      for (int i = 0; i < 600; ++i) {
        driver.step();
        if (i % 10 == 0) {
          const int s = int(local() % shared.size());
          const ShardKey key{1000 + s, ShardKind::param};
          Status prefetched = store.prefetch(key, Tier::host);
          if (!prefetched) continue;  // another thread holds the budget
          Result<ShardView> view = store.wait(key, Tier::host);
          EXPECT_TRUE(view.is_ok()) << view.status().message();
          if (view) {
            EXPECT_EQ(std::memcmp(view->data, shared[s].data(), shared[s].size()), 0);
          }
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  expect_within_budgets(store);
  RandomDriver checker(store, owned[0], 0);
  for (int t = 0; t < kThreads; ++t)
    for (const ShardModel& shard : owned[t])
      for (const auto& [tier, bytes] : shard.copies) {
        Result<ShardView> view = store.wait(shard.key, tier);
        ASSERT_TRUE(view.is_ok()) << view.status().message();
        EXPECT_EQ(std::memcmp(view->data, bytes.data(), bytes.size()), 0);
        EXPECT_TRUE(store.release(shard.key, tier).is_ok());
      }
  for (int unit = 1000; unit < 1004; ++unit)
    EXPECT_TRUE(store.release({unit, ShardKind::param}, Tier::host).is_ok());
  for (int t = 0; t < kThreads; ++t)
    for (const ShardModel& shard : owned[t]) checker.check_home(shard);
}

TEST(TieredStoreTest, InjectedFaultsSurfaceWithoutCorruptingOtherShards) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto injector = std::make_shared<io::FaultInjector>();
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{}, notices, injector);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  TieredStore& store = **opened;
  std::mt19937_64 random(3);
  std::vector<std::vector<std::byte>> contents;
  for (int unit = 0; unit < 3; ++unit) {
    ASSERT_TRUE(store.add_shard({unit, ShardKind::v}, 300000, Tier::nvme).is_ok());
    contents.push_back(random_bytes(300000, random));
    ASSERT_TRUE(store.write_shard({unit, ShardKind::v}, contents.back()).is_ok());
  }

  // A read fails: the load reports it, leaves no copy and charges nothing.
  injector->add({.op = io::RingOp::kRead,
                 .nth_call = injector->calls(io::RingOp::kRead) + 2,
                 .kind = io::FaultKind::kError,
                 .error_number = EIO});
  ASSERT_TRUE(store.prefetch({0, ShardKind::v}, Tier::host).is_ok());
  Result<ShardView> failed = store.wait({0, ShardKind::v}, Tier::host);
  ASSERT_FALSE(failed.is_ok());
  EXPECT_NE(failed.status().message().find("loading (unit 0, v) into host from nvme"),
            std::string::npos)
      << failed.status().message();
  EXPECT_EQ(store.usage(Tier::host).used, 0u);
  // Tried again, it works.
  ASSERT_TRUE(store.prefetch({0, ShardKind::v}, Tier::host).is_ok());
  Result<ShardView> loaded = store.wait({0, ShardKind::v}, Tier::host);
  ASSERT_TRUE(loaded.is_ok()) << loaded.status().message();
  EXPECT_EQ(std::memcmp(loaded->data, contents[0].data(), contents[0].size()), 0);

  // A write-back fails: reported, the copy is kept, a second write-back lands.
  std::vector<std::byte> changed = random_bytes(300000, random);
  std::memcpy(loaded->data, changed.data(), changed.size());
  injector->add({.op = io::RingOp::kWrite,
                 .nth_call = injector->calls(io::RingOp::kWrite) + 1,
                 .kind = io::FaultKind::kError,
                 .error_number = ENOSPC});
  ASSERT_TRUE(store.writeback({0, ShardKind::v}, Tier::host).is_ok());
  Result<ShardView> write_failed = store.wait({0, ShardKind::v}, Tier::host);
  ASSERT_FALSE(write_failed.is_ok());
  EXPECT_NE(write_failed.status().message().find("writing back (unit 0, v) from host"),
            std::string::npos)
      << write_failed.status().message();
  ASSERT_TRUE(store.writeback({0, ShardKind::v}, Tier::host).is_ok());
  ASSERT_TRUE(store.wait({0, ShardKind::v}, Tier::host).is_ok());
  ASSERT_TRUE(store.release({0, ShardKind::v}, Tier::host).is_ok());

  // Short transfers are retried by the engine and never seen here.
  injector->add({.op = io::RingOp::kRead,
                 .nth_call = injector->calls(io::RingOp::kRead) + 1,
                 .kind = io::FaultKind::kShortTransfer,
                 .times = 3});
  ASSERT_TRUE(store.prefetch({1, ShardKind::v}, Tier::device).is_ok());
  Result<ShardView> staged = store.wait({1, ShardKind::v}, Tier::device);
  ASSERT_TRUE(staged.is_ok()) << staged.status().message();
  EXPECT_EQ(std::memcmp(staged->data, contents[1].data(), contents[1].size()), 0);

  contents[0] = changed;
  for (int unit = 0; unit < 3; ++unit) {
    std::vector<std::byte> back(300000);
    ASSERT_TRUE(store.read_shard({unit, ShardKind::v}, back).is_ok());
    EXPECT_EQ(back, contents[unit]) << "unit " << unit;
  }
  EXPECT_GE(injector->faults_injected(), 3u);
}

}  // namespace
}  // namespace strata::tiers
