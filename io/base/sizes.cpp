#include "io/base/sizes.h"

#include <fmt/format.h>

#include <cctype>
#include <cmath>
#include <string>

namespace strata {
namespace {

// Splits "1.5GiB" into 1.5 and "GiB"; fails if there is no leading number.
bool split_number(std::string_view text, double& number, std::string& suffix) {
  std::string trimmed;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) trimmed += c;
  }
  if (trimmed.empty()) return false;
  size_t consumed = 0;
  try {
    number = std::stod(trimmed, &consumed);
  } catch (...) {
    return false;
  }
  if (!std::isfinite(number)) return false;
  suffix = trimmed.substr(consumed);
  return true;
}

bool size_multiplier(const std::string& suffix, double& multiplier) {
  struct Unit {
    const char* name;
    double multiplier;
  };
  static const Unit units[] = {
      {"", 1},          {"B", 1},          {"K", 1024.0},    {"KiB", 1024.0},
      {"M", 1 << 20},   {"MiB", 1 << 20},  {"G", 1 << 30},   {"GiB", 1 << 30},
      {"T", 1099511627776.0}, {"TiB", 1099511627776.0},
      {"KB", 1e3},      {"MB", 1e6},       {"GB", 1e9},      {"TB", 1e12},
      {"k", 1024.0},    {"m", 1 << 20},    {"g", 1 << 30},   {"t", 1099511627776.0},
  };
  for (const auto& unit : units) {
    if (suffix == unit.name) {
      multiplier = unit.multiplier;
      return true;
    }
  }
  return false;
}

}  // namespace

Result<uint64_t> parse_size(std::string_view text) {
  double number = 0, multiplier = 1;
  std::string suffix;
  if (!split_number(text, number, suffix) || !size_multiplier(suffix, multiplier) || number < 0) {
    return Status::error(fmt::format(
        "'{}' is not a size; write bytes with an optional suffix: 512M, 16G, 1.5T (powers of 1024) "
        "or 16GB (powers of 1000)", text));
  }
  double bytes = number * multiplier;
  if (bytes > 1.8e19) return Status::error(fmt::format("'{}' is too large a size", text));
  return static_cast<uint64_t>(std::llround(bytes));
}

Result<double> parse_bandwidth(std::string_view text) {
  std::string_view body = text;
  if (body.size() >= 2 && body.substr(body.size() - 2) == "/s") body.remove_suffix(2);
  double number = 0, multiplier = 1;
  std::string suffix;
  if (!split_number(body, number, suffix) || !size_multiplier(suffix, multiplier) || number <= 0) {
    return Status::error(fmt::format(
        "'{}' is not a bandwidth; write a size per second such as 25GB/s, 3.5GB/s or 12G", text));
  }
  return number * multiplier;
}

Result<int64_t> parse_count(std::string_view text) {
  double number = 0;
  std::string suffix;
  double multiplier = 0;
  if (split_number(text, number, suffix)) {
    if (suffix.empty()) multiplier = 1;
    if (suffix == "K" || suffix == "k") multiplier = 1e3;
    if (suffix == "M" || suffix == "m") multiplier = 1e6;
    if (suffix == "B" || suffix == "b" || suffix == "G") multiplier = 1e9;
    if (suffix == "T" || suffix == "t") multiplier = 1e12;
  }
  if (multiplier == 0 || number <= 0 || number * multiplier > 9e18) {
    return Status::error(fmt::format(
        "'{}' is not a count; write a positive number such as 30e9, 7B, 1.5M or 125000000", text));
  }
  return static_cast<int64_t>(std::llround(number * multiplier));
}

std::string format_bytes(double bytes) {
  const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int unit = 0;
  double value = bytes;
  while (std::fabs(value) >= 1024.0 && unit < 5) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return fmt::format("{:.0f} B", value);
  return fmt::format("{:.2f} {}", value, names[unit]);
}

std::string format_count(double count) {
  if (count >= 1e12) return fmt::format("{:.2f} T", count / 1e12);
  if (count >= 1e9) return fmt::format("{:.2f} B", count / 1e9);
  if (count >= 1e6) return fmt::format("{:.2f} M", count / 1e6);
  if (count >= 1e3) return fmt::format("{:.1f} K", count / 1e3);
  return fmt::format("{:.0f}", count);
}

std::string format_seconds(double seconds) {
  if (seconds < 1e-3) return fmt::format("{:.0f} us", seconds * 1e6);
  if (seconds < 1.0) return fmt::format("{:.0f} ms", seconds * 1e3);
  if (seconds < 120.0) return fmt::format("{:.2f} s", seconds);
  if (seconds < 7200.0) return fmt::format("{:.1f} min", seconds / 60.0);
  return fmt::format("{:.1f} h", seconds / 3600.0);
}

}  // namespace strata
