// Sizes, bandwidths and counts as users type them.
#include <gtest/gtest.h>

#include "io/base/sizes.h"

namespace strata {
namespace {

TEST(Units, SizesUseBinarySuffixesAndDecimalOnesWhenSpelledOut) {
  EXPECT_EQ(*parse_size("512M"), 512ull << 20);
  EXPECT_EQ(*parse_size("16G"), 16ull << 30);
  EXPECT_EQ(*parse_size("16GiB"), 16ull << 30);
  EXPECT_EQ(*parse_size("16GB"), 16000000000ull);
  EXPECT_EQ(*parse_size("1.5T"), 3ull << 39);
  EXPECT_EQ(*parse_size("4096"), 4096u);
  EXPECT_EQ(*parse_size("4K"), 4096u);
  for (const char* bad : {"", "G", "12X", "-1G", "ten"}) {
    Result<uint64_t> size = parse_size(bad);
    EXPECT_FALSE(size.is_ok()) << bad;
    if (!size.is_ok()) {
      EXPECT_NE(size.status().message().find("512M"), std::string::npos);
    }
  }
}

TEST(Units, BandwidthsAndCounts) {
  EXPECT_DOUBLE_EQ(*parse_bandwidth("25GB/s"), 25e9);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("3.5G"), 3.5 * (1ull << 30));
  EXPECT_FALSE(parse_bandwidth("0GB/s").is_ok());
  EXPECT_EQ(*parse_count("30e9"), 30000000000LL);
  EXPECT_EQ(*parse_count("7B"), 7000000000LL);
  EXPECT_EQ(*parse_count("1.5M"), 1500000);
  EXPECT_FALSE(parse_count("lots").is_ok());
  EXPECT_FALSE(parse_count("-3").is_ok());
}

TEST(Units, Formatting) {
  EXPECT_EQ(format_bytes(17), "17 B");
  EXPECT_EQ(format_bytes(1.5 * (1 << 30)), "1.50 GiB");
  EXPECT_EQ(format_count(8030261248.0), "8.03 B");
  EXPECT_EQ(format_seconds(0.083), "83 ms");
}

}  // namespace
}  // namespace strata
