// The AdamW kernels: for each moment format (fp32, bf16, int8; adamw.h) one
// scalar function and two vector loops (AVX2 + F16C + FMA, AVX-512) that
// perform the same IEEE operations, fused multiply-adds included, in the same
// order. This file is compiled with -ffp-contract=off (kernels/CMakeLists.txt)
// so that the compiler fuses no other multiply and add in one path but not in
// another; that is what keeps the paths bitwise identical.
// GCC 12 warns inside its own avx512fintrin.h (the _mm512_undefined_* idiom,
// GCC bug 105593) when AVX-512 intrinsics are used under a target attribute.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/cpu/simd_convert.h"

namespace strata::kernels::cpu {
namespace {

// Every constant of the update, rounded once to fp32 from float64.
struct StepConstants {
  float grad_scale;
  float decay;  // 1 - lr * wd (AdamW), 1 (Adam)
  float l2;     // wd (Adam), 0 (AdamW)
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_step_size;              // -lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^t)
  float eps;
  bool decoupled;
};

StepConstants make_constants(const AdamWHyperparams& h) {
  const double t = static_cast<double>(h.step);
  const double bias_correction1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bias_correction2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  StepConstants c{};
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.decoupled = h.decoupled_weight_decay;
  c.decay = h.decoupled_weight_decay ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.l2 = h.decoupled_weight_decay ? 0.0f : static_cast<float>(h.weight_decay);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.neg_step_size = -static_cast<float>(h.lr / bias_correction1);
  c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  c.eps = static_cast<float>(h.eps);
  return c;
}

// The loops ask for the lines of the fp32 arrays (master, fp32 moments) and of
// the gradient this many elements ahead (4 KiB of fp32). Measured on AMD Zen 5
// (2 threads, 64 Mi parameters, interleaved pairs of steps): against no
// prefetch the fp32 step gains 4-7%; against 1 KiB ahead the int8 step gains
// 30% (its two passes per block keep the core from running ahead by itself)
// and the others are unchanged. The 1- and 2-byte moment streams are left to
// the hardware prefetchers: asking for their lines too (each line twice or
// more) made the bf16 step 10% slower. Prefetches never fault, so running
// past an array's end is harmless.
constexpr int64_t kPrefetchElements = 1024;

// Element i + kPrefetchElements of an array of `size`-byte elements.
template <int64_t size>
inline void prefetch_ahead(const void* data, int64_t i) {
  _mm_prefetch(static_cast<const char*>(data) + (i + kPrefetchElements) * size, _MM_HINT_T0);
}

template <ElementType T>
inline void prefetch_ahead(const void* data, int64_t i) {
  prefetch_ahead<T == ElementType::f32 ? 4 : 2>(data, i);
}

// ---------------------------------------------------------------------------------------
// Scalar: the reference arithmetic, which every vector loop mirrors.

// One element: takes the gradient, master p and moments m, v; leaves the new m
// and v in place and returns the new master.
inline float adamw_element(const StepConstants& c, float grad, float p, float& m, float& v) {
  float g = grad * c.grad_scale;
  if (c.decoupled) {
    p = p * c.decay;
  } else {
    g = std::fma(c.l2, p, g);
  }
  m = std::fma(c.one_minus_beta1, g, m * c.beta1);
  v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = std::fma(std::sqrt(v), c.inv_bias_correction2_sqrt, c.eps);
  return p + (c.neg_step_size * m) / denom;
}

// Moments stored as S (f32 or bf16): element i.
template <ElementType S, ElementType G, CopyKind C>
inline void update_element(const AdamWShard& s, const StepConstants& c, int64_t i) {
  float m = load_as_float<S>(s.exp_avg, i);
  float v = load_as_float<S>(s.exp_avg_sq, i);
  const float p = adamw_element(c, load_as_float<G>(s.grad, i), s.master[i], m, v);
  if constexpr (S == ElementType::f32) {
    static_cast<float*>(s.exp_avg)[i] = m;
    static_cast<float*>(s.exp_avg_sq)[i] = v;
  } else {
    static_cast<uint16_t*>(s.exp_avg)[i] = float_to_bf16(m);
    static_cast<uint16_t*>(s.exp_avg_sq)[i] = float_to_bf16(v);
  }
  s.master[i] = p;
  store_from_float<C>(s.copy, i, p);
}

template <ElementType S, ElementType G, CopyKind C>
void update_scalar(const AdamWShard& s, const StepConstants& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) update_element<S, G, C>(s, c, i);
}

// --- int8 moments: the per-block rules of adamw.h -----------------------------------------

constexpr float kMCodes = 127.0f;     // m codes: [-127, 127]
constexpr float kRootCodes = 255.0f;  // sqrt(v) codes: [0, 255]
constexpr float kSmallestScale = 0x1p-100f;

// The value of one code: the block's scale / codes.
inline float code_unit(float scale, float codes) {
  return scale / codes;
}

// Codes per unit of value, codes / scale: 0 for a scale below 2^-100 (where
// the quotient could overflow; such a block reads back as 0), inf or NaN.
// With |x| <= scale, |x * factor| <= codes * (1 + 3u) < codes + 1/2, so codes
// need no clamp.
inline float code_factor(float scale, float codes) {
  return scale >= kSmallestScale && scale <= 3.40282347e38f ? codes / scale : 0.0f;
}

// The code of t = x * factor: nearest, ties to even (cvtps2dq in the default
// rounding mode); a NaN t gives code 0, the low byte of cvtps2dq's 0x80000000
// that the vector paths keep.
inline int32_t code_of(float t) {
  return t == t ? static_cast<int32_t>(std::nearbyint(t)) : 0;
}

inline int8_t encode_m(float m, float factor) {
  return static_cast<int8_t>(code_of(m * factor));
}

inline uint8_t encode_root(float root, float factor) {
  int32_t code = code_of(root * factor);
  if (root > 0.0f) code = std::max(code, 1);  // a v > 0 never reads back as 0
  return static_cast<uint8_t>(code);
}

// |x| as bits: ordered like |x|, with every NaN above infinity.
inline uint32_t magnitude_bits(float x) {
  return float_bits(x) & 0x7fffffffu;
}

// Elements [begin, end) of one block (begin is its first element, end at most
// kAdamWInt8Block later).
template <ElementType G, CopyKind C>
void update_int8_block_scalar(const AdamWShard& s, const StepConstants& c, int64_t begin,
                              int64_t end) {
  const int64_t block = begin / kAdamWInt8Block;
  auto* const m_codes = static_cast<int8_t*>(s.exp_avg);
  auto* const root_codes = static_cast<uint8_t*>(s.exp_avg_sq);
  const float m_unit = code_unit(s.exp_avg_scale[block], kMCodes);
  const float root_unit = code_unit(s.exp_avg_sq_scale[block], kRootCodes);
  float new_m[kAdamWInt8Block];     // (end - begin)
  float new_root[kAdamWInt8Block];  // (end - begin) sqrt of the new v
  uint32_t m_max = 0, root_max = 0;
  for (int64_t i = begin; i < end; ++i) {
    float m = static_cast<float>(m_codes[i]) * m_unit;
    const float root = static_cast<float>(root_codes[i]) * root_unit;
    float v = root * root;
    const float p = adamw_element(c, load_as_float<G>(s.grad, i), s.master[i], m, v);
    s.master[i] = p;
    store_from_float<C>(s.copy, i, p);
    new_m[i - begin] = m;
    new_root[i - begin] = std::sqrt(v);
    m_max = std::max(m_max, magnitude_bits(m));
    root_max = std::max(root_max, magnitude_bits(new_root[i - begin]));
  }
  const float m_scale = bits_float(m_max), root_scale = bits_float(root_max);
  s.exp_avg_scale[block] = m_scale;
  s.exp_avg_sq_scale[block] = root_scale;
  const float m_factor = code_factor(m_scale, kMCodes);
  const float root_factor = code_factor(root_scale, kRootCodes);
  for (int64_t i = begin; i < end; ++i) {
    m_codes[i] = encode_m(new_m[i - begin], m_factor);
    root_codes[i] = encode_root(new_root[i - begin], root_factor);
  }
}

template <ElementType G, CopyKind C>
void update_int8_scalar(const AdamWShard& s, const StepConstants& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; i += kAdamWInt8Block) {
    update_int8_block_scalar<G, C>(s, c, i, std::min(i + kAdamWInt8Block, end));
  }
}

// The vector paths run each block in two passes, update (new master, m and
// sqrt(v) of the block, and its maxima) and encode (the block's codes, once
// its scales are known), and interleave the update of block k with the
// encoding of block k - 1: the update is bound by the divider (sqrt and
// division), the encoding by the other units, and interleaved they overlap.
// The new m and sqrt(v) of two blocks wait on the stack meanwhile (4 KiB).
struct Int8Blocks {
  alignas(64) float new_m[2][kAdamWInt8Block];
  alignas(64) float new_root[2][kAdamWInt8Block];
};

// ---------------------------------------------------------------------------------------
// AVX2 + F16C + FMA: 8 elements per vector.

struct Avx2Constants {
  __m256 grad_scale, decay, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
      inv_bias_correction2_sqrt, eps;
};

STRATA_TARGET_AVX2 inline Avx2Constants avx2_constants(const StepConstants& c) {
  return Avx2Constants{_mm256_set1_ps(c.grad_scale),
                       _mm256_set1_ps(c.decay),
                       _mm256_set1_ps(c.l2),
                       _mm256_set1_ps(c.beta1),
                       _mm256_set1_ps(c.one_minus_beta1),
                       _mm256_set1_ps(c.beta2),
                       _mm256_set1_ps(c.one_minus_beta2),
                       _mm256_set1_ps(c.neg_step_size),
                       _mm256_set1_ps(c.inv_bias_correction2_sqrt),
                       _mm256_set1_ps(c.eps)};
}

// adamw_element on 8 lanes: m and v in place, sqrt(v) out, new master returned.
STRATA_TARGET_AVX2 inline __m256 adamw8(const Avx2Constants& k, bool decoupled, __m256 grad,
                                        __m256 p, __m256& m, __m256& v, __m256& root) {
  __m256 g = _mm256_mul_ps(grad, k.grad_scale);
  if (decoupled) {
    p = _mm256_mul_ps(p, k.decay);
  } else {
    g = _mm256_fmadd_ps(k.l2, p, g);
  }
  m = _mm256_fmadd_ps(k.one_minus_beta1, g, _mm256_mul_ps(m, k.beta1));
  v = _mm256_fmadd_ps(_mm256_mul_ps(k.one_minus_beta2, g), g, _mm256_mul_ps(v, k.beta2));
  root = _mm256_sqrt_ps(v);
  const __m256 denom = _mm256_fmadd_ps(root, k.inv_bias_correction2_sqrt, k.eps);
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, m), denom));
}

template <ElementType S>
STRATA_TARGET_AVX2 inline void store8_state(void* data, int64_t i, __m256 value) {
  if constexpr (S == ElementType::f32) {
    _mm256_storeu_ps(static_cast<float*>(data) + i, value);
  } else {
    store8_from_float<CopyKind::bf16>(data, i, value);
  }
}

// Updates elements [i, i + 8) of master, m and v; returns the new master.
template <ElementType S, ElementType G>
STRATA_TARGET_AVX2 inline __m256 update8(const Avx2Constants& k, bool decoupled,
                                         const AdamWShard& s, int64_t i) {
  __m256 m = load8_as_float<S>(s.exp_avg, i);
  __m256 v = load8_as_float<S>(s.exp_avg_sq, i);
  __m256 root;
  const __m256 p =
      adamw8(k, decoupled, load8_as_float<G>(s.grad, i), _mm256_loadu_ps(s.master + i), m, v, root);
  store8_state<S>(s.exp_avg, i, m);
  store8_state<S>(s.exp_avg_sq, i, v);
  _mm256_storeu_ps(s.master + i, p);
  return p;
}

// Updates elements [i, i + 16) of master, m and v; returns the new master,
// elements i..i+7 in low and i+8..i+15 in high. bf16 moments are rounded 16 at
// a time, with one check for NaN, and stored 32 bytes at a time.
template <ElementType S, ElementType G>
STRATA_TARGET_AVX2 inline void update16(const Avx2Constants& k, bool decoupled, const AdamWShard& s,
                                        int64_t i, __m256& low, __m256& high) {
  if constexpr (S == ElementType::f32) {
    low = update8<S, G>(k, decoupled, s, i);
    high = update8<S, G>(k, decoupled, s, i + 8);
  } else {
    __m256 m[2], v[2], p[2], root;
    for (int half = 0; half < 2; ++half) {
      const int64_t e = i + 8 * half;
      m[half] = load8_as_float<S>(s.exp_avg, e);
      v[half] = load8_as_float<S>(s.exp_avg_sq, e);
      p[half] = adamw8(k, decoupled, load8_as_float<G>(s.grad, e), _mm256_loadu_ps(s.master + e),
                       m[half], v[half], root);
      _mm256_storeu_ps(s.master + e, p[half]);
    }
    store16_from_float_avx2<CopyKind::bf16, false>(s.exp_avg, i, m[0], m[1]);
    store16_from_float_avx2<CopyKind::bf16, false>(s.exp_avg_sq, i, v[0], v[1]);
    low = p[0];
    high = p[1];
  }
}

template <ElementType S, ElementType G>
inline void prefetch16_ahead(const AdamWShard& s, int64_t i) {
  prefetch_ahead<ElementType::f32>(s.master, i);
  if constexpr (S == ElementType::f32) {
    prefetch_ahead<S>(s.exp_avg, i);
    prefetch_ahead<S>(s.exp_avg_sq, i);
  }
  prefetch_ahead<G>(s.grad, i);
}

template <ElementType S, ElementType G, CopyKind C>
STRATA_TARGET_AVX2 void update_avx2(const AdamWShard& s, const StepConstants& c, int64_t begin,
                                    int64_t end) {
  const Avx2Constants k = avx2_constants(c);
  const AdamWShard a = s;  // a local copy, so the compiler need not reload it after every store
  const bool decoupled = c.decoupled;
  int64_t i = begin;
  if constexpr (C != CopyKind::none) {
    // The copy is written 32 bytes at a time with non-temporal stores (it goes
    // to the GPU, not back to this CPU, and they save reading each line
    // first): peel elements until it is aligned.
    while (i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.copy) + i) & 31) != 0) {
      update_element<S, G, C>(a, c, i++);
    }
  }
  for (; i + 16 <= end; i += 16) {
    prefetch16_ahead<S, G>(a, i);
    __m256 low, high;
    update16<S, G>(k, decoupled, a, i, low, high);
    if constexpr (C != CopyKind::none) store16_from_float_avx2<C>(a.copy, i, low, high);
  }
  if constexpr (C != CopyKind::none) _mm_sfence();  // order the streamed stores before returning
  for (; i + 8 <= end; i += 8) store8_from_float<C>(a.copy, i, update8<S, G>(k, decoupled, a, i));
  for (; i < end; ++i) update_element<S, G, C>(a, c, i);
}

// --- int8 moments ------------------------------------------------------------------------

// The largest of 8 unsigned lanes.
STRATA_TARGET_AVX2 inline uint32_t reduce_max_epu32_avx2(__m256i x) {
  __m128i y = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  y = _mm_max_epu32(y, _mm_shuffle_epi32(y, 0x4e));
  y = _mm_max_epu32(y, _mm_shuffle_epi32(y, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(y));
}

// The low byte of each 32-bit lane, in the low 8 bytes (as vpmovdb).
STRATA_TARGET_AVX2 inline __m128i low_bytes8(__m256i x) {
  const __m256i pick =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i gathered = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(x, pick),
                                                       _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
  return _mm256_castsi256_si128(gathered);
}

struct Avx2BlockScales {
  __m256 m_unit, root_unit;  // the stored block's value of one code
  __m256i m_max, root_max;   // the new block's largest magnitudes (as bits)
};

// Update pass over elements [i, i + 16) of a block: new master (and copy),
// new m and sqrt(v) into m_out and root_out (16 each).
template <ElementType G, CopyKind C, bool Stream>
STRATA_TARGET_AVX2 inline void update_int8_16_avx2(const Avx2Constants& k, bool decoupled,
                                                   const AdamWShard& s, int64_t i,
                                                   Avx2BlockScales& scales, float* m_out,
                                                   float* root_out) {
  const auto* const m_codes = static_cast<const int8_t*>(s.exp_avg);
  const auto* const root_codes = static_cast<const uint8_t*>(s.exp_avg_sq);
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256 p[2];
  for (int half = 0; half < 2; ++half) {
    const int64_t e = i + 8 * half;
    __m256 m = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m_codes + e)))),
                             scales.m_unit);
    __m256 root = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                    reinterpret_cast<const __m128i*>(root_codes + e)))),
                                scales.root_unit);
    __m256 v = _mm256_mul_ps(root, root);
    p[half] = adamw8(k, decoupled, load8_as_float<G>(s.grad, e), _mm256_loadu_ps(s.master + e), m,
                     v, root);
    _mm256_storeu_ps(s.master + e, p[half]);
    _mm256_store_ps(m_out + 8 * half, m);
    _mm256_store_ps(root_out + 8 * half, root);
    scales.m_max =
        _mm256_max_epu32(scales.m_max, _mm256_and_si256(_mm256_castps_si256(m), magnitude));
    scales.root_max =
        _mm256_max_epu32(scales.root_max, _mm256_and_si256(_mm256_castps_si256(root), magnitude));
  }
  if constexpr (C != CopyKind::none) {
    if constexpr (Stream) {
      store16_from_float_avx2<C>(s.copy, i, p[0], p[1]);
    } else {
      store8_from_float<C>(s.copy, i, p[0]);
      store8_from_float<C>(s.copy, i + 8, p[1]);
    }
  }
}

// Encoding pass over elements [i, i + 16) of a block, from its new m and
// sqrt(v) (16 each) and its code factors.
STRATA_TARGET_AVX2 inline void encode_int8_16_avx2(const AdamWShard& s, int64_t i,
                                                   const float* m_in, const float* root_in,
                                                   __m256 m_factor, __m256 root_factor) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256i one = _mm256_set1_epi32(1);
  for (int64_t j = 0; j < 16; j += 8) {
    const __m256 root = _mm256_load_ps(root_in + j);
    const __m256i m_code = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(m_in + j), m_factor));
    __m256i root_code = _mm256_cvtps_epi32(_mm256_mul_ps(root, root_factor));
    // A v > 0 gets code 1 at least (a NaN lane, 0x80000000, stays below it).
    const __m256i positive = _mm256_castps_si256(_mm256_cmp_ps(root, zero, _CMP_GT_OQ));
    root_code = _mm256_max_epi32(root_code, _mm256_and_si256(positive, one));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<int8_t*>(s.exp_avg) + i + j),
                     low_bytes8(m_code));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(s.exp_avg_sq) + i + j),
                     low_bytes8(root_code));
  }
}

// Whole blocks [begin, end); Stream: the copy is written with non-temporal
// stores (copy + begin is 32-byte aligned).
template <ElementType G, CopyKind C, bool Stream>
STRATA_TARGET_AVX2 void update_int8_blocks_avx2(const Avx2Constants& k, bool decoupled,
                                                const AdamWShard& s, int64_t begin, int64_t end) {
  Int8Blocks buffers;
  __m256 m_factor = _mm256_setzero_ps(), root_factor = _mm256_setzero_ps();  // of block k - 1
  int half = 0;
  for (int64_t first = begin; first < end; first += kAdamWInt8Block, half ^= 1) {
    const int64_t block = first / kAdamWInt8Block;
    Avx2BlockScales scales{_mm256_set1_ps(code_unit(s.exp_avg_scale[block], kMCodes)),
                           _mm256_set1_ps(code_unit(s.exp_avg_sq_scale[block], kRootCodes)),
                           _mm256_setzero_si256(), _mm256_setzero_si256()};
    float* const m_out = buffers.new_m[half];
    float* const root_out = buffers.new_root[half];
    const float* const m_in = buffers.new_m[half ^ 1];
    const float* const root_in = buffers.new_root[half ^ 1];
    for (int64_t j = 0; j < kAdamWInt8Block; j += 16) {
      const int64_t i = first + j;
      prefetch_ahead<ElementType::f32>(s.master, i);
      prefetch_ahead<G>(s.grad, i);
      update_int8_16_avx2<G, C, Stream>(k, decoupled, s, i, scales, m_out + j, root_out + j);
      if (first > begin) {
        encode_int8_16_avx2(s, i - kAdamWInt8Block, m_in + j, root_in + j, m_factor, root_factor);
      }
    }
    const float m_scale = bits_float(reduce_max_epu32_avx2(scales.m_max));
    const float root_scale = bits_float(reduce_max_epu32_avx2(scales.root_max));
    s.exp_avg_scale[block] = m_scale;
    s.exp_avg_sq_scale[block] = root_scale;
    m_factor = _mm256_set1_ps(code_factor(m_scale, kMCodes));
    root_factor = _mm256_set1_ps(code_factor(root_scale, kRootCodes));
  }
  if (begin < end) {  // the last block's encoding
    for (int64_t j = 0; j < kAdamWInt8Block; j += 16) {
      encode_int8_16_avx2(s, end - kAdamWInt8Block + j, buffers.new_m[half ^ 1] + j,
                          buffers.new_root[half ^ 1] + j, m_factor, root_factor);
    }
  }
}

template <ElementType G, CopyKind C>
STRATA_TARGET_AVX2 void update_int8_avx2(const AdamWShard& s, const StepConstants& c, int64_t begin,
                                         int64_t end) {
  const Avx2Constants k = avx2_constants(c);
  const AdamWShard a = s;
  const int64_t whole_end = begin + (end - begin) / kAdamWInt8Block * kAdamWInt8Block;
  const bool stream =
      C != CopyKind::none &&
      (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.copy) + begin) & 31) == 0;
  if (stream) {
    update_int8_blocks_avx2<G, C, true>(k, c.decoupled, a, begin, whole_end);
    _mm_sfence();
  } else {
    update_int8_blocks_avx2<G, C, false>(k, c.decoupled, a, begin, whole_end);
  }
  if (whole_end < end) update_int8_block_scalar<G, C>(a, c, whole_end, end);
}

// ---------------------------------------------------------------------------------------
// AVX-512: 16 elements per vector.

struct Avx512Constants {
  __m512 grad_scale, decay, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
      inv_bias_correction2_sqrt, eps;
};

STRATA_TARGET_AVX512 inline Avx512Constants avx512_constants(const StepConstants& c) {
  return Avx512Constants{_mm512_set1_ps(c.grad_scale),
                         _mm512_set1_ps(c.decay),
                         _mm512_set1_ps(c.l2),
                         _mm512_set1_ps(c.beta1),
                         _mm512_set1_ps(c.one_minus_beta1),
                         _mm512_set1_ps(c.beta2),
                         _mm512_set1_ps(c.one_minus_beta2),
                         _mm512_set1_ps(c.neg_step_size),
                         _mm512_set1_ps(c.inv_bias_correction2_sqrt),
                         _mm512_set1_ps(c.eps)};
}

// adamw_element on 16 lanes: m and v in place, sqrt(v) out, new master returned.
STRATA_TARGET_AVX512 inline __m512 adamw16(const Avx512Constants& k, bool decoupled, __m512 grad,
                                           __m512 p, __m512& m, __m512& v, __m512& root) {
  __m512 g = _mm512_mul_ps(grad, k.grad_scale);
  if (decoupled) {
    p = _mm512_mul_ps(p, k.decay);
  } else {
    g = _mm512_fmadd_ps(k.l2, p, g);
  }
  m = _mm512_fmadd_ps(k.one_minus_beta1, g, _mm512_mul_ps(m, k.beta1));
  v = _mm512_fmadd_ps(_mm512_mul_ps(k.one_minus_beta2, g), g, _mm512_mul_ps(v, k.beta2));
  root = _mm512_sqrt_ps(v);
  const __m512 denom = _mm512_fmadd_ps(root, k.inv_bias_correction2_sqrt, k.eps);
  return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(k.neg_step_size, m), denom));
}

template <ElementType S, ElementType G, CopyKind C>
STRATA_TARGET_AVX512 void update_avx512(const AdamWShard& s, const StepConstants& c, int64_t begin,
                                        int64_t end) {
  const Avx512Constants k = avx512_constants(c);
  const AdamWShard a = s;  // a local copy, so the compiler need not reload it after every store
  const bool decoupled = c.decoupled;
  int64_t i = begin;
  // The copy is written with non-temporal stores (it goes to the GPU, not back
  // to this CPU, and they save reading each line first): peel elements until
  // it is aligned.
  if constexpr (C != CopyKind::none) {
    while (i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.copy) + i) & 31) != 0) {
      update_element<S, G, C>(a, c, i++);
    }
  }
  for (; i + 16 <= end; i += 16) {
    prefetch16_ahead<S, G>(a, i);
    __m512 m = load16_as_float<S>(a.exp_avg, i);
    __m512 v = load16_as_float<S>(a.exp_avg_sq, i);
    __m512 root;
    const __m512 p = adamw16(k, decoupled, load16_as_float<G>(a.grad, i),
                             _mm512_loadu_ps(a.master + i), m, v, root);
    if constexpr (S == ElementType::f32) {
      _mm512_storeu_ps(static_cast<float*>(a.exp_avg) + i, m);
      _mm512_storeu_ps(static_cast<float*>(a.exp_avg_sq) + i, v);
    } else {
      store16_bf16_pair(a.exp_avg, a.exp_avg_sq, i, m, v);
    }
    _mm512_storeu_ps(a.master + i, p);
    store16_from_float<C, true>(a.copy, i, p);
  }
  if constexpr (C != CopyKind::none) _mm_sfence();
  for (; i < end; ++i) update_element<S, G, C>(a, c, i);
}

// --- int8 moments ------------------------------------------------------------------------

struct Avx512BlockScales {
  __m512 m_unit, root_unit;  // the stored block's value of one code
  __m512i m_max, root_max;   // the new block's largest magnitudes (as bits)
};

// Update pass over elements [i, i + 16) of a block: new master (and copy),
// new m and sqrt(v) into m_out and root_out (16 each).
template <ElementType G, CopyKind C, bool Stream>
STRATA_TARGET_AVX512 inline void update_int8_16_avx512(const Avx512Constants& k, bool decoupled,
                                                       const AdamWShard& s, int64_t i,
                                                       Avx512BlockScales& scales, float* m_out,
                                                       float* root_out) {
  const auto* const m_codes = static_cast<const int8_t*>(s.exp_avg);
  const auto* const root_codes = static_cast<const uint8_t*>(s.exp_avg_sq);
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512 m = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(m_codes + i)))),
                           scales.m_unit);
  __m512 root = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(root_codes + i)))),
                              scales.root_unit);
  __m512 v = _mm512_mul_ps(root, root);
  const __m512 p = adamw16(k, decoupled, load16_as_float<G>(s.grad, i),
                           _mm512_loadu_ps(s.master + i), m, v, root);
  _mm512_storeu_ps(s.master + i, p);
  store16_from_float<C, Stream>(s.copy, i, p);
  _mm512_store_ps(m_out, m);
  _mm512_store_ps(root_out, root);
  scales.m_max =
      _mm512_max_epu32(scales.m_max, _mm512_and_si512(_mm512_castps_si512(m), magnitude));
  scales.root_max =
      _mm512_max_epu32(scales.root_max, _mm512_and_si512(_mm512_castps_si512(root), magnitude));
}

// Encoding pass over elements [i, i + 16) of a block, from its new m and
// sqrt(v) (16 each) and its code factors.
STRATA_TARGET_AVX512 inline void encode_int8_16_avx512(const AdamWShard& s, int64_t i,
                                                       const float* m_in, const float* root_in,
                                                       __m512 m_factor, __m512 root_factor) {
  const __m512 root = _mm512_load_ps(root_in);
  const __m512i m_code = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(m_in), m_factor));
  __m512i root_code = _mm512_cvtps_epi32(_mm512_mul_ps(root, root_factor));
  // A v > 0 gets code 1 at least.
  const __mmask16 positive = _mm512_cmp_ps_mask(root, _mm512_setzero_ps(), _CMP_GT_OQ);
  root_code = _mm512_mask_max_epi32(root_code, positive, root_code, _mm512_set1_epi32(1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<int8_t*>(s.exp_avg) + i),
                   _mm512_cvtepi32_epi8(m_code));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(s.exp_avg_sq) + i),
                   _mm512_cvtepi32_epi8(root_code));
}

// Whole blocks [begin, end); Stream: the copy is written with non-temporal
// stores (copy + begin is 32-byte aligned).
template <ElementType G, CopyKind C, bool Stream>
STRATA_TARGET_AVX512 void update_int8_blocks_avx512(const Avx512Constants& k, bool decoupled,
                                                    const AdamWShard& s, int64_t begin,
                                                    int64_t end) {
  Int8Blocks buffers;
  __m512 m_factor = _mm512_setzero_ps(), root_factor = _mm512_setzero_ps();  // of block k - 1
  int half = 0;
  for (int64_t first = begin; first < end; first += kAdamWInt8Block, half ^= 1) {
    const int64_t block = first / kAdamWInt8Block;
    Avx512BlockScales scales{_mm512_set1_ps(code_unit(s.exp_avg_scale[block], kMCodes)),
                             _mm512_set1_ps(code_unit(s.exp_avg_sq_scale[block], kRootCodes)),
                             _mm512_setzero_si512(), _mm512_setzero_si512()};
    float* const m_out = buffers.new_m[half];
    float* const root_out = buffers.new_root[half];
    const float* const m_in = buffers.new_m[half ^ 1];
    const float* const root_in = buffers.new_root[half ^ 1];
    for (int64_t j = 0; j < kAdamWInt8Block; j += 16) {
      const int64_t i = first + j;
      prefetch_ahead<ElementType::f32>(s.master, i);
      prefetch_ahead<G>(s.grad, i);
      update_int8_16_avx512<G, C, Stream>(k, decoupled, s, i, scales, m_out + j, root_out + j);
      if (first > begin) {
        encode_int8_16_avx512(s, i - kAdamWInt8Block, m_in + j, root_in + j, m_factor, root_factor);
      }
    }
    const float m_scale = bits_float(_mm512_reduce_max_epu32(scales.m_max));
    const float root_scale = bits_float(_mm512_reduce_max_epu32(scales.root_max));
    s.exp_avg_scale[block] = m_scale;
    s.exp_avg_sq_scale[block] = root_scale;
    m_factor = _mm512_set1_ps(code_factor(m_scale, kMCodes));
    root_factor = _mm512_set1_ps(code_factor(root_scale, kRootCodes));
  }
  if (begin < end) {  // the last block's encoding
    for (int64_t j = 0; j < kAdamWInt8Block; j += 16) {
      encode_int8_16_avx512(s, end - kAdamWInt8Block + j, buffers.new_m[half ^ 1] + j,
                            buffers.new_root[half ^ 1] + j, m_factor, root_factor);
    }
  }
}

template <ElementType G, CopyKind C>
STRATA_TARGET_AVX512 void update_int8_avx512(const AdamWShard& s, const StepConstants& c,
                                             int64_t begin, int64_t end) {
  const Avx512Constants k = avx512_constants(c);
  const AdamWShard a = s;
  const int64_t whole_end = begin + (end - begin) / kAdamWInt8Block * kAdamWInt8Block;
  const bool stream =
      C != CopyKind::none &&
      (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(a.copy) + begin) & 31) == 0;
  if (stream) {
    update_int8_blocks_avx512<G, C, true>(k, c.decoupled, a, begin, whole_end);
    _mm_sfence();
  } else {
    update_int8_blocks_avx512<G, C, false>(k, c.decoupled, a, begin, whole_end);
  }
  if (whole_end < end) update_int8_block_scalar<G, C>(a, c, whole_end, end);
}

// ---------------------------------------------------------------------------------------
// Dispatch.

using RangeFunction = void (*)(const AdamWShard&, const StepConstants&, int64_t, int64_t);

template <AdamWStateType S, ElementType G, CopyKind C>
RangeFunction pick_for_level(SimdLevel level) {
  if constexpr (S == AdamWStateType::int8) {
    switch (level) {
      case SimdLevel::avx512:
        return &update_int8_avx512<G, C>;
      case SimdLevel::avx2:
        return &update_int8_avx2<G, C>;
      case SimdLevel::scalar:
        break;
    }
    return &update_int8_scalar<G, C>;
  } else {
    constexpr ElementType E = S == AdamWStateType::f32 ? ElementType::f32 : ElementType::bf16;
    switch (level) {
      case SimdLevel::avx512:
        return &update_avx512<E, G, C>;
      case SimdLevel::avx2:
        return &update_avx2<E, G, C>;
      case SimdLevel::scalar:
        break;
    }
    return &update_scalar<E, G, C>;
  }
}

template <AdamWStateType S, ElementType G>
RangeFunction pick_for_copy(bool has_copy, ElementType copy_type, SimdLevel level) {
  if (!has_copy) return pick_for_level<S, G, CopyKind::none>(level);
  if (copy_type == ElementType::bf16) return pick_for_level<S, G, CopyKind::bf16>(level);
  return pick_for_level<S, G, CopyKind::f16>(level);
}

template <AdamWStateType S>
RangeFunction pick_for_grad(ElementType grad_type, bool has_copy, ElementType copy_type,
                            SimdLevel level) {
  switch (grad_type) {
    case ElementType::f32:
      return pick_for_copy<S, ElementType::f32>(has_copy, copy_type, level);
    case ElementType::bf16:
      return pick_for_copy<S, ElementType::bf16>(has_copy, copy_type, level);
    case ElementType::f16:
      return pick_for_copy<S, ElementType::f16>(has_copy, copy_type, level);
  }
  return nullptr;
}

RangeFunction pick(AdamWStateType state, ElementType grad_type, bool has_copy,
                   ElementType copy_type, SimdLevel level) {
  switch (state) {
    case AdamWStateType::f32:
      return pick_for_grad<AdamWStateType::f32>(grad_type, has_copy, copy_type, level);
    case AdamWStateType::bf16:
      return pick_for_grad<AdamWStateType::bf16>(grad_type, has_copy, copy_type, level);
    case AdamWStateType::int8:
      return pick_for_grad<AdamWStateType::int8>(grad_type, has_copy, copy_type, level);
  }
  return nullptr;
}

// Thread ranges start on whole int8 blocks.
int64_t range_alignment(AdamWStateType state) {
  return state == AdamWStateType::int8 ? kAdamWInt8Block : kRangeAlignment;
}

Status check_hyperparams(const AdamWHyperparams& h) {
  if (h.step < 1)
    return Status::error("adamw_step: step must be >= 1, got " + std::to_string(h.step));
  if (!(h.lr >= 0.0))
    return Status::error("adamw_step: invalid learning rate " + std::to_string(h.lr));
  if (!(h.eps >= 0.0)) return Status::error("adamw_step: invalid eps " + std::to_string(h.eps));
  if (!(h.beta1 >= 0.0 && h.beta1 < 1.0) || !(h.beta2 >= 0.0 && h.beta2 < 1.0)) {
    return Status::error("adamw_step: betas must lie in [0, 1), got " + std::to_string(h.beta1) +
                         ", " + std::to_string(h.beta2));
  }
  if (!(h.weight_decay >= 0.0)) {
    return Status::error("adamw_step: invalid weight_decay " + std::to_string(h.weight_decay));
  }
  return Status::ok();
}

Status check(const AdamWShard& s, const AdamWHyperparams& h) {
  if (s.numel < 0)
    return Status::error("adamw_step: negative shard length " + std::to_string(s.numel));
  if (s.numel > 0 && (s.master == nullptr || s.exp_avg == nullptr || s.exp_avg_sq == nullptr ||
                      s.grad == nullptr)) {
    return Status::error("adamw_step: master, exp_avg, exp_avg_sq and grad must all be given");
  }
  const bool int8 = s.state_type == AdamWStateType::int8;
  if (int8 && s.numel > 0 && (s.exp_avg_scale == nullptr || s.exp_avg_sq_scale == nullptr)) {
    return Status::error("adamw_step: int8 moments need exp_avg_scale and exp_avg_sq_scale");
  }
  if (!int8 && (s.exp_avg_scale != nullptr || s.exp_avg_sq_scale != nullptr)) {
    return Status::error("adamw_step: only int8 moments have scales; " +
                         std::string(adamw_state_type_name(s.state_type)) +
                         " moments were given some");
  }
  if (s.copy != nullptr && s.copy_type == ElementType::f32) {
    return Status::error(
        "adamw_step: the compute copy must be bf16 or fp16 (fp32 mode has no copy)");
  }
  return check_hyperparams(h);
}

std::size_t state_element_size(AdamWStateType type) {
  switch (type) {
    case AdamWStateType::f32:
      return 4;
    case AdamWStateType::bf16:
      return 2;
    case AdamWStateType::int8:
      return 1;
  }
  return 0;
}

// One kernel pass over one run (a shard of one group), checked by adamw_step.
void update_run(const AdamWShard& run, const AdamWHyperparams& hyper) {
  const StepConstants constants = make_constants(hyper);
  const RangeFunction update =
      pick(run.state_type, run.grad_type, run.copy != nullptr, run.copy_type, active_simd_level());
  for_each_static_range(
      run.numel, [&](int64_t begin, int64_t end) { update(run, constants, begin, end); },
      range_alignment(run.state_type));
}

void zero_run(const AdamWShard& run) {
  const std::size_t size = state_element_size(run.state_type);
  const bool int8 = run.state_type == AdamWStateType::int8;
  for_each_static_range(
      run.numel,
      [&](int64_t begin, int64_t end) {
        const std::size_t offset = static_cast<std::size_t>(begin) * size;
        const std::size_t bytes = static_cast<std::size_t>(end - begin) * size;
        std::memset(static_cast<char*>(run.exp_avg) + offset, 0, bytes);
        std::memset(static_cast<char*>(run.exp_avg_sq) + offset, 0, bytes);
        if (int8) {
          const int64_t first = begin / kAdamWInt8Block;
          const int64_t count = (end - begin + kAdamWInt8Block - 1) / kAdamWInt8Block;
          std::memset(run.exp_avg_scale + first, 0, static_cast<std::size_t>(count) * 4);
          std::memset(run.exp_avg_sq_scale + first, 0, static_cast<std::size_t>(count) * 4);
        }
      },
      range_alignment(run.state_type));
}

}  // namespace

std::string_view adamw_state_type_name(AdamWStateType type) {
  switch (type) {
    case AdamWStateType::f32:
      return "fp32";
    case AdamWStateType::bf16:
      return "bf16";
    case AdamWStateType::int8:
      return "int8";
  }
  return "unknown";
}

int64_t adamw_state_scale_count(AdamWStateType type, int64_t numel) {
  if (type != AdamWStateType::int8 || numel <= 0) return 0;
  return (numel + kAdamWInt8Block - 1) / kAdamWInt8Block;
}

int64_t adamw_state_bytes(AdamWStateType type, int64_t numel) {
  if (numel <= 0) return 0;
  return 2 * numel * static_cast<int64_t>(state_element_size(type)) +
         2 * adamw_state_scale_count(type, numel) * static_cast<int64_t>(sizeof(float));
}

Status adamw_step(const AdamWShard& shard, const AdamWHyperparams& hyper) {
  if (Status status = check(shard, hyper); !status) return status;
  Result<std::vector<CompactRun>> runs =
      compact_runs(shard.segments, shard.numel, shard.state_type);
  if (!runs) return runs.status();
  for (const CompactRun& run : *runs)
    update_run(run_of(shard, run), group_hyperparams(hyper, run.group));
  return Status::ok();
}

void first_touch_zero(float* data, int64_t n) {
  for_each_static_range(n, [&](int64_t begin, int64_t end) {
    std::memset(data + begin, 0, static_cast<std::size_t>(end - begin) * sizeof(float));
  });
}

Status first_touch_zero(const AdamWShard& shard) {
  Result<std::vector<CompactRun>> runs =
      compact_runs(shard.segments, shard.numel, shard.state_type);
  if (!runs) return runs.status();
  for (const CompactRun& run : *runs) zero_run(run_of(shard, run));
  return Status::ok();
}

}  // namespace strata::kernels::cpu
