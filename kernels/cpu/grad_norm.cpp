// Each block of kGradNormBlock elements is summed into 16 float64 lanes
// (element j of the block goes to lane j % 16, in order), and the lanes are
// combined by one fixed pairwise tree. The vector paths fill the same lanes
// in the same order as the scalar path, so every path agrees bit for bit.
// GCC 12 warns inside its own avx512fintrin.h (the _mm512_undefined_* idiom,
// GCC bug 105593) when AVX-512 intrinsics are used under a target attribute.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernels/cpu/grad_norm.h"

#include <tbb/parallel_reduce.h>

#include <cmath>
#include <string>

#include "kernels/cpu/simd_convert.h"

namespace strata::kernels::cpu {
namespace {

constexpr int kLanes = 16;

double combine_lanes(const double* lanes) {  // lanes: (16)
  double level[kLanes];
  for (int i = 0; i < kLanes; ++i) level[i] = lanes[i];
  for (int width = kLanes / 2; width >= 1; width /= 2) {
    for (int i = 0; i < width; ++i) level[i] = level[2 * i] + level[2 * i + 1];
  }
  return level[0];
}

template <ElementType T>
void accumulate_scalar(const void* grad, int64_t begin, int64_t end, double* lanes) {
  for (int64_t i = begin; i < end; ++i) {
    const double x = load_as_float<T>(grad, i);
    lanes[(i - begin) % kLanes] += x * x;
  }
}

template <ElementType T>
double block_scalar(const void* grad, int64_t begin, int64_t end) {
  double lanes[kLanes] = {};
  accumulate_scalar<T>(grad, begin, end, lanes);
  return combine_lanes(lanes);
}

// Written out without arrays of vectors: at -O2 GCC keeps such arrays in
// memory, and the store-to-load chains cost more than the memory reads.
template <ElementType T>
STRATA_TARGET_AVX2 double block_avx2(const void* grad, int64_t begin, int64_t end) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const __m256 low = load8_as_float<T>(grad, i);
    const __m256 high = load8_as_float<T>(grad, i + 8);
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(low));
    const __m256d d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(low, 1));
    const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(high));
    const __m256d d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(high, 1));
    acc0 = _mm256_add_pd(acc0, _mm256_mul_pd(d0, d0));
    acc1 = _mm256_add_pd(acc1, _mm256_mul_pd(d1, d1));
    acc2 = _mm256_add_pd(acc2, _mm256_mul_pd(d2, d2));
    acc3 = _mm256_add_pd(acc3, _mm256_mul_pd(d3, d3));
  }
  double lanes[kLanes];
  _mm256_storeu_pd(lanes, acc0);
  _mm256_storeu_pd(lanes + 4, acc1);
  _mm256_storeu_pd(lanes + 8, acc2);
  _mm256_storeu_pd(lanes + 12, acc3);
  accumulate_scalar<T>(grad, i, end, lanes);  // i - begin is a multiple of 16: lanes line up
  return combine_lanes(lanes);
}

template <ElementType T>
STRATA_TARGET_AVX512 double block_avx512(const void* grad, int64_t begin, int64_t end) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const __m512 x = load16_as_float<T>(grad, i);
    const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d d1 =
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    acc0 = _mm512_add_pd(acc0, _mm512_mul_pd(d0, d0));
    acc1 = _mm512_add_pd(acc1, _mm512_mul_pd(d1, d1));
  }
  double lanes[kLanes];
  _mm512_storeu_pd(lanes, acc0);
  _mm512_storeu_pd(lanes + 8, acc1);
  accumulate_scalar<T>(grad, i, end, lanes);
  return combine_lanes(lanes);
}

using BlockFunction = double (*)(const void*, int64_t, int64_t);

template <ElementType T>
BlockFunction pick_for_level(SimdLevel level) {
  switch (level) {
    case SimdLevel::avx512:
      return &block_avx512<T>;
    case SimdLevel::avx2:
      return &block_avx2<T>;
    case SimdLevel::scalar:
      break;
  }
  return &block_scalar<T>;
}

BlockFunction pick(ElementType type, SimdLevel level) {
  switch (type) {
    case ElementType::f32:
      return pick_for_level<ElementType::f32>(level);
    case ElementType::bf16:
      return pick_for_level<ElementType::bf16>(level);
    case ElementType::f16:
      return pick_for_level<ElementType::f16>(level);
  }
  return nullptr;
}

// Blocks per leaf of the deterministic reduction (64 Ki elements).
constexpr int64_t kBlocksPerLeaf = 16;

}  // namespace

Result<GradNormPartial> grad_norm_squared(const void* grad, ElementType type, int64_t numel) {
  if (numel < 0) {
    return Status::error("grad_norm_squared: negative length " + std::to_string(numel));
  }
  if (numel > 0 && grad == nullptr) return Status::error("grad_norm_squared: null gradient");
  const BlockFunction block_sum = pick(type, active_simd_level());
  const int64_t blocks = (numel + kGradNormBlock - 1) / kGradNormBlock;
  // The split of [0, blocks) depends only on `blocks` and the grain size, never
  // on the threads, so the float64 sum is reproducible.
  const double sum = tbb::parallel_deterministic_reduce(
      tbb::blocked_range<int64_t>(0, blocks, kBlocksPerLeaf), 0.0,
      [&](const tbb::blocked_range<int64_t>& range, double partial) {
        for (int64_t b = range.begin(); b != range.end(); ++b) {
          const int64_t begin = b * kGradNormBlock;
          const int64_t end = begin + kGradNormBlock < numel ? begin + kGradNormBlock : numel;
          partial += block_sum(grad, begin, end);
        }
        return partial;
      },
      [](double left, double right) { return left + right; });
  GradNormPartial result;
  result.sum_squares = sum;
  result.nonfinite = !std::isfinite(sum);
  return result;
}

}  // namespace strata::kernels::cpu
