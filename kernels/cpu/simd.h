// Run-time SIMD dispatch, element types and the fixed range-to-thread mapping
// shared by the CPU optimizer kernels (adamw.h, grad_norm.h).
//
// One binary runs on any x86-64: the best instruction set the CPU has (AVX-512,
// AVX2 + FMA + F16C, or plain scalar code) is chosen the first time a kernel runs.
// The environment variable STRATA_SIMD (scalar | avx2 | avx512) lowers the
// choice for a whole process; tests call force_simd_level() to run each path.
// Every path computes bitwise-identical results (the kernels use the same IEEE
// operations in the same order, fused multiply-adds included), so the choice
// changes speed, never numbers.
//
// The conversions here are exact (bf16/fp16 -> fp32) or round to nearest even
// (fp32 -> bf16/fp16), matching PyTorch's bf16 cast and the F16C instructions
// on every input, NaN and subnormals included. All functions are thread-safe;
// force_simd_level() should be called while no kernel is running.
#pragma once

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <cstdint>
#include <cstring>
#include <string_view>

#include "io/base/status.h"

namespace strata::kernels::cpu {

enum class SimdLevel { scalar = 0, avx2 = 1, avx512 = 2 };

// Element types of gradients and compute-precision copies.
enum class ElementType { f32, bf16, f16 };

std::string_view simd_level_name(SimdLevel level);
std::string_view element_type_name(ElementType type);
std::size_t element_size(ElementType type);

// Widens n elements of `type` to fp32 (exact), in parallel for large arrays.
void widen_to_float(const void* source, ElementType type, float* out, int64_t n);

// The best level this CPU (and its operating system) supports.
SimdLevel cpu_simd_level();

// The level kernels use now: the forced one, else min(cpu, STRATA_SIMD), else cpu.
SimdLevel active_simd_level();

// Makes kernels use `level` (tests, benchmarks). Fails when the CPU lacks it.
Status force_simd_level(SimdLevel level);

// Undoes force_simd_level: back to the automatic choice.
void reset_simd_level();

// --- scalar conversions (bit patterns in uint16_t) ------------------------------

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline float bf16_to_float(uint16_t bits) {
  return bits_float(uint32_t{bits} << 16);
}

// Round to nearest even, as PyTorch's c10::BFloat16 (every NaN becomes 0x7fc0).
inline uint16_t float_to_bf16(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Exact, subnormals included; a NaN keeps its payload and becomes quiet (as F16C).
inline float f16_to_float(uint16_t half) {
  const uint32_t sign = uint32_t{half & 0x8000u} << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) {
    return bits_float(sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u));
  }
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * bits_float(0x33800000u);  // 2^-24
    return bits_float(sign | float_bits(magnitude));
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// Round to nearest even, overflow to infinity, as F16C's vcvtps2ph (imm 0).
inline uint16_t float_to_f16(float value) {
  uint32_t bits = float_bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7fffffffu;
  if (bits >= 0x7f800000u) {  // inf or NaN (quiet, upper payload kept)
    return sign | (bits > 0x7f800000u ? static_cast<uint16_t>(0x7e00u | ((bits >> 13) & 0x3ffu))
                                      : uint16_t{0x7c00});
  }
  if (bits >= 0x477ff000u) return sign | 0x7c00;  // >= 65520 rounds to infinity
  if (bits < 0x38800000u) {
    // Result is subnormal (or zero): let an fp32 addition do the rounding at 2^-24.
    const float shifted = bits_float(bits) + bits_float(0x3f000000u);  // + 0.5
    return sign | static_cast<uint16_t>(float_bits(shifted) - 0x3f000000u);
  }
  const uint32_t odd = (bits >> 13) & 1u;
  bits += 0xc8000fffu + odd;  // rebias exponent (-112 << 23) and round half to even
  return sign | static_cast<uint16_t>(bits >> 13);
}

// --- fixed range-to-thread mapping -----------------------------------------------

// Elements per range boundary: ranges start on multiples of this many elements
// (64 elements are whole cache lines in fp32, bf16 and fp16).
inline constexpr int64_t kRangeAlignment = 64;

// Shards shorter than this run on the calling thread (threads cost more than they save).
inline constexpr int64_t kParallelThreshold = int64_t{1} << 15;

// Range `part` of `parts` contiguous ranges covering [0, n), each starting on a
// multiple of `alignment` elements.
inline void static_range(int64_t n, int part, int parts, int64_t* begin, int64_t* end,
                         int64_t alignment = kRangeAlignment) {
  const int64_t blocks = (n + alignment - 1) / alignment;
  const int64_t first = blocks * part / parts;
  const int64_t last = blocks * (part + 1) / parts;
  *begin = first * alignment < n ? first * alignment : n;
  *end = last * alignment < n ? last * alignment : n;
}

// Calls body(begin, end) on one contiguous range per thread of the current TBB
// arena, each range starting on a multiple of `alignment` elements (a multiple
// of kRangeAlignment; ranges of two alignments differ only near their ends).
// Range i always covers the same elements
// for a given n and thread count, and tbb::static_partitioner keeps handing
// range i to the same worker, so pages first touched through this function
// stay near the thread that later updates them.
template <typename Body>
void for_each_static_range(int64_t n, const Body& body, int64_t alignment = kRangeAlignment) {
  if (n <= 0) return;
  const int parts = tbb::this_task_arena::max_concurrency();
  if (n < kParallelThreshold || parts <= 1) {
    body(int64_t{0}, n);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<int>(0, parts, 1),
      [&](const tbb::blocked_range<int>& parts_range) {
        for (int part = parts_range.begin(); part != parts_range.end(); ++part) {
          int64_t begin = 0, end = 0;
          static_range(n, part, parts, &begin, &end, alignment);
          if (begin < end) body(begin, end);
        }
      },
      tbb::static_partitioner());
}

}  // namespace strata::kernels::cpu
