// Internal to kernels/cpu: loads of fp32/bf16/fp16 arrays as fp32 vectors and
// stores of fp32 vectors as bf16/fp16, for the scalar, AVX2 + F16C and
// AVX-512 paths. Each vector function carries its own target attribute, so
// this header may be included by files compiled for baseline x86-64; callers
// run a vector function only when active_simd_level() allows it. All
// conversions agree bit for bit with the scalar ones in simd.h.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/cpu/simd.h"

#define STRATA_TARGET_AVX2 __attribute__((target("avx2,f16c,fma")))
#define STRATA_TARGET_AVX512 __attribute__((target("avx512f,avx2,f16c,fma")))

namespace strata::kernels::cpu {

// Copy kinds: none (fp32 mode), bf16, fp16.
enum class CopyKind { none, bf16, f16 };

template <ElementType T>
inline float load_as_float(const void* data, int64_t i) {
  if constexpr (T == ElementType::f32) {
    return static_cast<const float*>(data)[i];
  } else if constexpr (T == ElementType::bf16) {
    return bf16_to_float(static_cast<const uint16_t*>(data)[i]);
  } else {
    return f16_to_float(static_cast<const uint16_t*>(data)[i]);
  }
}

template <CopyKind C>
inline void store_from_float(void* data, int64_t i, float value) {
  if constexpr (C == CopyKind::bf16) {
    static_cast<uint16_t*>(data)[i] = float_to_bf16(value);
  } else if constexpr (C == CopyKind::f16) {
    static_cast<uint16_t*>(data)[i] = float_to_f16(value);
  }
}

// --- AVX2 + F16C: 8 elements ------------------------------------------------------

template <ElementType T>
STRATA_TARGET_AVX2 inline __m256 load8_as_float(const void* data, int64_t i) {
  if constexpr (T == ElementType::f32) {
    return _mm256_loadu_ps(static_cast<const float*>(data) + i);
  } else {
    const __m128i half =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(data) + i));
    if constexpr (T == ElementType::bf16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    } else {
      return _mm256_cvtph_ps(half);
    }
  }
}

// Round-to-nearest-even bf16 bits of 8 floats, in the low 16 bits of each
// 32-bit lane. NaN lanes are not fixed here (see the callers).
STRATA_TARGET_AVX2 inline __m256i bf16_round8_unchecked(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                           16);
}

template <CopyKind C>
STRATA_TARGET_AVX2 inline void store8_from_float(void* data, int64_t i, __m256 value) {
  if constexpr (C == CopyKind::none) {
    return;
  } else {
    __m128i packed;
    if constexpr (C == CopyKind::bf16) {
      const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
      const __m256i rounded =
          _mm256_blendv_epi8(bf16_round8_unchecked(value), _mm256_set1_epi32(0x7fc0), is_nan);
      // packus works within 128-bit lanes: reorder the 64-bit quarters afterwards.
      const __m256i pairs = _mm256_packus_epi32(rounded, rounded);
      packed = _mm256_castsi256_si128(_mm256_permute4x64_epi64(pairs, 0xd8));
    } else {
      packed = _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(data) + i), packed);
  }
}

// Stores 16 floats (low: elements i..i+7, high: i+8..i+15) as bf16 or fp16
// with one 32-byte store. Stream: non-temporal, and data + i must be 32-byte
// aligned.
template <CopyKind C, bool Stream = true>
STRATA_TARGET_AVX2 inline void store16_from_float_avx2(void* data, int64_t i, __m256 low,
                                                       __m256 high) {
  __m256i packed;
  if constexpr (C == CopyKind::bf16) {
    __m256i r_low = bf16_round8_unchecked(low);
    __m256i r_high = bf16_round8_unchecked(high);
    // One unordered compare finds a NaN in either vector; NaN is rare, so
    // the fix-up (every NaN becomes 0x7fc0, as in PyTorch) sits off the hot path.
    if (_mm256_movemask_ps(_mm256_cmp_ps(low, high, _CMP_UNORD_Q)) != 0) {
      const __m256i nan = _mm256_set1_epi32(0x7fc0);
      r_low = _mm256_blendv_epi8(r_low, nan,
                                 _mm256_castps_si256(_mm256_cmp_ps(low, low, _CMP_UNORD_Q)));
      r_high = _mm256_blendv_epi8(r_high, nan,
                                  _mm256_castps_si256(_mm256_cmp_ps(high, high, _CMP_UNORD_Q)));
    }
    // packus works within 128-bit lanes: reorder the 64-bit quarters afterwards.
    packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r_low, r_high), 0xd8);
  } else {
    packed = _mm256_set_m128i(_mm256_cvtps_ph(high, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                              _mm256_cvtps_ph(low, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  __m256i* const target = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(data) + i);
  if constexpr (Stream) {
    _mm256_stream_si256(target, packed);
  } else {
    _mm256_storeu_si256(target, packed);
  }
}

// --- AVX-512: 16 elements ---------------------------------------------------------

template <ElementType T>
STRATA_TARGET_AVX512 inline __m512 load16_as_float(const void* data, int64_t i) {
  if constexpr (T == ElementType::f32) {
    return _mm512_loadu_ps(static_cast<const float*>(data) + i);
  } else {
    const __m256i half = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + i));
    if constexpr (T == ElementType::bf16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    } else {
      return _mm512_cvtph_ps(half);
    }
  }
}

// Round-to-nearest-even bf16 bits of 16 floats, in the low 16 bits of each
// 32-bit lane. NaN lanes are not fixed here (see the callers).
STRATA_TARGET_AVX512 inline __m512i bf16_round16_unchecked(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                           16);
}

// Stores two vectors of 16 floats as bf16 (a at first + i, b at second + i)
// with one check for NaN in either (rare; every NaN becomes 0x7fc0).
STRATA_TARGET_AVX512 inline void store16_bf16_pair(void* first, void* second, int64_t i, __m512 a,
                                                   __m512 b) {
  __m512i rounded_a = bf16_round16_unchecked(a);
  __m512i rounded_b = bf16_round16_unchecked(b);
  if (_mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q) != 0) {
    const __m512i nan = _mm512_set1_epi32(0x7fc0);
    rounded_a = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), rounded_a, nan);
    rounded_b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q), rounded_b, nan);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(first) + i),
                      _mm512_cvtepi32_epi16(rounded_a));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(second) + i),
                      _mm512_cvtepi32_epi16(rounded_b));
}

// Stream: a non-temporal store (data + i must be 32-byte aligned), for output
// that the CPU will not read again soon; it also saves reading the line first.
template <CopyKind C, bool Stream = false>
STRATA_TARGET_AVX512 inline void store16_from_float(void* data, int64_t i, __m512 value) {
  if constexpr (C == CopyKind::none) {
    return;
  } else {
    __m256i packed;
    if constexpr (C == CopyKind::bf16) {
      __m512i rounded = bf16_round16_unchecked(value);
      const __mmask16 is_nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
      rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(0x7fc0));
      packed = _mm512_cvtepi32_epi16(rounded);
    } else {
      packed = _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    __m256i* const target = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(data) + i);
    if constexpr (Stream) {
      _mm256_stream_si256(target, packed);
    } else {
      _mm256_storeu_si256(target, packed);
    }
  }
}

}  // namespace strata::kernels::cpu
