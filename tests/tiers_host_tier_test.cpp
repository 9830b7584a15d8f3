// The pools under the store: PoolAllocator's first fit, merging and messages;
// HostTier pinning (and the warning fallback when RLIMIT_MEMLOCK is too low);
// DeviceTier's host stand-in; the topology report.
#include <gtest/gtest.h>

#include <cstring>

#include "tiers/device_tier.h"
#include "tiers/host_tier.h"
#include "tiers/pool_allocator.h"
#include "tiers/topology.h"
#include "tiers_test_support.h"

namespace strata::tiers {
namespace {

TEST(PoolAllocatorTest, FirstFitMergesNeighboursAndTracksThePeak) {
  PoolAllocator pool(64 << 10, 4096, "host tier", "--host-mem-limit");
  Result<uint64_t> a = pool.allocate(4096, "a");
  Result<uint64_t> b = pool.allocate(5000, "b");  // rounds to 8 KiB
  Result<uint64_t> c = pool.allocate(4096, "c");
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, 4096u);
  EXPECT_EQ(*c, 12288u);
  EXPECT_EQ(pool.usage().used, 16384u);
  pool.free(*a);
  pool.free(*b);  // merges with a's range: 12 KiB free at 0
  Result<uint64_t> d = pool.allocate(12288, "d");
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(*d, 0u);
  EXPECT_EQ(pool.usage().peak, 16384u);
  EXPECT_EQ(pool.usage().capacity, 65536u);
}

TEST(PoolAllocatorTest, RefusalsSayWhyWithTheNumbers) {
  PoolAllocator pool(16 << 10, 4096, "device tier", "--device-mem-limit");
  Result<uint64_t> a = pool.allocate(4096, "a");
  Result<uint64_t> b = pool.allocate(4096, "b");
  Result<uint64_t> c = pool.allocate(4096, "c");
  ASSERT_TRUE(a && b && c);
  pool.free(*b);
  Result<uint64_t> fragmented = pool.allocate(8192, "(unit 1, param)");
  ASSERT_FALSE(fragmented.is_ok());
  EXPECT_EQ(fragmented.status().message(),
            "device tier: cannot place 8.00 KiB for (unit 1, param): 8.00 KiB of 16.00 KiB free but "
            "the largest free range is 4.00 KiB (fragmented); release shards first or raise "
            "--device-mem-limit");
  Result<uint64_t> full = pool.allocate(12288, "(unit 2, grad)");
  ASSERT_FALSE(full.is_ok());
  EXPECT_EQ(full.status().message(),
            "device tier: cannot hold 12.00 KiB more for (unit 2, grad): 8.00 KiB of 16.00 KiB in use "
            "(budget); release shards first or raise --device-mem-limit");
  EXPECT_EQ(pool.usage().used, 8192u);
}

TEST(HostTierTest, PinsOrWarnsAndWorksEitherWay) {
  testing::Notices notices;
  HostTierOptions options;
  options.capacity = 1 << 20;
  options.notice = notices.sink();
  options.memlock_limit_for_testing = 64 << 10;
  auto low = HostTier::open(options);
  ASSERT_TRUE(low.is_ok()) << low.status().message();
  EXPECT_EQ((*low)->pinning(), HostPinning::none);
  ASSERT_FALSE(notices.lines.empty());
  EXPECT_NE(notices.lines.back().find("RLIMIT_MEMLOCK is 64.00 KiB, below the 1.00 MiB pool"),
            std::string::npos)
      << notices.lines.back();
  Result<HostBlock> block = (*low)->allocate(5000, "x");
  ASSERT_TRUE(block.is_ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(block->data) % 4096, 0u);
  std::memset(block->data, 7, block->size);
  (*low)->free(*block);

  // With the real limit: pinned (mlock) or the same warning, never a failure.
  options.memlock_limit_for_testing.reset();
  auto real = HostTier::open(options);
  ASSERT_TRUE(real.is_ok()) << real.status().message();
  std::printf("host tier: %s\n", (*real)->description().c_str());
  EXPECT_NE((*real)->description().find("numa node"), std::string::npos);
}

TEST(DeviceTierTest, HostMemoryStandsInWithTheSameBudgetRules) {
  DeviceTierOptions options;
  options.capacity = 64 << 10;
  options.use_gpu = false;
  auto tier = DeviceTier::open(options);
  ASSERT_TRUE(tier.is_ok()) << tier.status().message();
  EXPECT_FALSE((*tier)->on_gpu());
  Result<DeviceBlock> block = (*tier)->allocate(40000, "(unit 0, param)");
  ASSERT_TRUE(block.is_ok());
  EXPECT_FALSE((*tier)->allocate(40000, "(unit 1, param)").is_ok());
  std::vector<std::byte> in(40000, std::byte{9}), out(40000);
  ASSERT_TRUE((*tier)->copy_to_device(*block, 0, in.data(), in.size()).wait().is_ok());
  ASSERT_TRUE((*tier)->copy_to_host(out.data(), *block, 0, out.size()).wait().is_ok());
  EXPECT_EQ(in, out);
  ASSERT_TRUE((*tier)->zero(*block).is_ok());
  (*tier)->free(*block);
  EXPECT_EQ((*tier)->usage().used, 0u);
  EXPECT_EQ((*tier)->usage().peak, 40960u);
}

TEST(TopologyTest, ReportsNodesCpusAndPaths) {
  io::testing::TemporaryDirectory directory;
  Result<TopologyReport> report =
      inspect_topology({directory.path(), "/nonexistent-strata-path"}, 2);
  ASSERT_TRUE(report.is_ok()) << report.status().message();
  ASSERT_FALSE(report->nodes.empty());
  EXPECT_FALSE(report->io_cpus.empty());
  ASSERT_EQ(report->nvme.size(), 2u);
  EXPECT_TRUE(report->nvme[0].error.empty()) << report->nvme[0].error;
  EXPECT_FALSE(report->nvme[0].filesystem.empty());
  EXPECT_FALSE(report->nvme[1].error.empty());
  const std::string text = format_topology(*report);
  std::printf("%s", text.c_str());
  EXPECT_NE(text.find("numa node"), std::string::npos);
  EXPECT_NE(text.find("cpus for the optimizer"), std::string::npos);
  EXPECT_NE(text.find("unusable"), std::string::npos);
}

}  // namespace
}  // namespace strata::tiers
