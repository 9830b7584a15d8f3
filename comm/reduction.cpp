// The rank-order sum shared by LocalComm and GlooComm (comm/reduction.h).
#include "comm/reduction.h"

#include <cstring>

namespace strata::comm {
namespace {

// Element `index` of `base` as fp32. memcpy: a buffer inside a received
// message need not be aligned for its type.
float load(const void* base, size_t index, DataType dtype) {
  if (dtype == DataType::fp32) {
    float value;
    std::memcpy(&value, static_cast<const char*>(base) + index * sizeof(float), sizeof(value));
    return value;
  }
  uint16_t value;
  std::memcpy(&value, static_cast<const char*>(base) + index * sizeof(uint16_t), sizeof(value));
  return bf16_to_float(value);
}

}  // namespace

float bf16_to_float(uint16_t value) {
  uint32_t bits = static_cast<uint32_t>(value) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

void sum_in_rank_order(std::span<const void* const> sources, size_t begin, size_t count,
                       DataType dtype, float* sums) {
  for (size_t i = 0; i < count; ++i) {
    float sum = 0.0f;
    for (const void* source : sources) sum += load(source, begin + i, dtype);
    sums[i] = sum;
  }
}

void store_sums(const float* sums, size_t count, DataType dtype, void* out, size_t begin) {
  if (count == 0) return;
  if (dtype == DataType::fp32) {
    std::memcpy(static_cast<float*>(out) + begin, sums, count * sizeof(float));
    return;
  }
  uint16_t* target = static_cast<uint16_t*>(out) + begin;
  for (size_t i = 0; i < count; ++i) target[i] = float_to_bf16(sums[i]);
}

}  // namespace strata::comm
