// TFRecord framing, the container of TensorBoard's event files: each record is
//   uint64 length, uint32 masked CRC-32C of those 8 bytes,
//   the data, uint32 masked CRC-32C of the data,
// little-endian. CRC-32C is the Castagnoli polynomial (iSCSI, RFC 3720),
// reflected, 0x82F63B78; "masked" is TensorFlow's rotation plus a constant,
// so that a CRC of bytes that contain CRCs stays a good check. Pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace strata::tools {

// CRC-32C of `data`, continuing from `crc` (0 to start).
uint32_t crc32c(std::string_view data, uint32_t crc = 0);

// TensorFlow's masking: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(std::string_view data);

// `data` framed as one record.
std::string tfrecord(std::string_view data);

}  // namespace strata::tools
