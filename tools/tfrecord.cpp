#include "tools/tfrecord.h"

#include <array>

namespace strata::tools {
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;
constexpr uint32_t kMaskDelta = 0xa282ead8u;

// The table of the byte-at-a-time algorithm: the CRC of each byte value.
constexpr std::array<uint32_t, 256> crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t byte = 0; byte < 256; ++byte) {
    uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit)
      crc = (crc & 1) ? (crc >> 1) ^ kCastagnoliReflected : crc >> 1;
    table[byte] = crc;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrcTable = crc_table();

void append_little_endian(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

}  // namespace

uint32_t crc32c(std::string_view data, uint32_t crc) {
  crc = ~crc;
  for (unsigned char byte : data) crc = kCrcTable[(crc ^ byte) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t crc = crc32c(data);
  return ((crc >> 15) | (crc << 17)) + kMaskDelta;
}

std::string tfrecord(std::string_view data) {
  std::string record;
  record.reserve(data.size() + 16);
  append_little_endian(record, data.size(), 8);
  const uint32_t length_crc = masked_crc32c(record);
  append_little_endian(record, length_crc, 4);
  record.append(data);
  append_little_endian(record, masked_crc32c(data), 4);
  return record;
}

}  // namespace strata::tools
