// The ground vocabulary of sizes: sizes, counts and bandwidths as users type
// them and as strata prints them, and rounding to a multiple.
//
// Sizes: a number with an optional suffix. K, M, G, T (and KiB, MiB, GiB, TiB)
// are powers of 1024; KB, MB, GB, TB are powers of 1000; B or nothing is bytes.
// "512M" is 512 MiB, "16G" 16 GiB, "1.5T" 1.5 TiB, "16GB" 16e9 bytes.
// Bandwidths: a size per second, "/s" optional ("25GB/s", "3.5G").
// Counts: a number with an optional K, M, B (billion) or T (trillion) suffix, or
// in e-notation ("30e9", "7B", "1.5M").
// All functions are pure and thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "io/base/status.h"

namespace strata {

Result<uint64_t> parse_size(std::string_view text);
Result<double> parse_bandwidth(std::string_view text);  // bytes per second
Result<int64_t> parse_count(std::string_view text);

// `value` rounded up to a multiple of `multiple` (> 0): buffer sizes to pages,
// O_DIRECT lengths to the device's alignment.
template <typename Integer>
constexpr Integer round_up(Integer value, Integer multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// "1.50 GiB", "812.00 MiB", "4.00 KiB", "17 B".
std::string format_bytes(double bytes);
// "1.24 B", "70.55 B", "124.4 M", "950 K", "12"
std::string format_count(double count);
// "1.25 s", "83 ms", "2.1 min"
std::string format_seconds(double seconds);

}  // namespace strata
