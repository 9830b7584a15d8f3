// The reference product (gemm.h): element (i, j) is the fp32 sum, k = 0 .. K-1
// in order from +0, of the rounded products op(A)[i][k] * op(B)[k][j], then
// times alpha (alpha != 1) and plus C (beta == 1). Blocks of rows and columns
// are packed and run as separate TBB tasks; inside a block, tiles of
// kTileRows x kTileCols elements keep their sums in vector registers. A vector
// only holds several elements' sums side by side, so every element sees the
// same additions in the same order whatever the vector width, the tiling or
// the thread count. This file is compiled with -ffp-contract=off
// (kernels/CMakeLists.txt): no multiply and add are fused into one rounding.
#include <tbb/blocked_range2d.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/simd.h"

namespace strata::kernels::cpu {
namespace {

constexpr int64_t kTileRows = 4;
constexpr int64_t kTileCols = 16;
constexpr int64_t kBlockRows = 64;   // rows of one task, a multiple of kTileRows
constexpr int64_t kBlockCols = 128;  // columns of one task, a multiple of kTileCols

// Sixteen floats; GCC splits it into what the function's target has (one
// AVX-512 register, two AVX2 or four SSE registers).
typedef float Floats16 __attribute__((vector_size(64)));

// The product of packed blocks: a (rows, K) and b (K, cols), both row-major,
// rows a multiple of kTileRows and cols of kTileCols; out (rows, cols).
[[gnu::always_inline]] inline void block_product(const float* a, const float* b, int64_t rows,
                                                 int64_t cols, int64_t K, float* out) {
  for (int64_t i = 0; i < rows; i += kTileRows) {
    const float* a0 = a + (i + 0) * K;
    const float* a1 = a + (i + 1) * K;
    const float* a2 = a + (i + 2) * K;
    const float* a3 = a + (i + 3) * K;
    for (int64_t j = 0; j < cols; j += kTileCols) {
      Floats16 s0 = {}, s1 = {}, s2 = {}, s3 = {};
      for (int64_t k = 0; k < K; ++k) {
        Floats16 bk;
        std::memcpy(&bk, b + k * cols + j, sizeof bk);
        s0 = s0 + a0[k] * bk;
        s1 = s1 + a1[k] * bk;
        s2 = s2 + a2[k] * bk;
        s3 = s3 + a3[k] * bk;
      }
      std::memcpy(out + (i + 0) * cols + j, &s0, sizeof s0);
      std::memcpy(out + (i + 1) * cols + j, &s1, sizeof s1);
      std::memcpy(out + (i + 2) * cols + j, &s2, sizeof s2);
      std::memcpy(out + (i + 3) * cols + j, &s3, sizeof s3);
    }
  }
}

[[gnu::target("avx512f")]] void block_product_avx512(const float* a, const float* b, int64_t rows,
                                                     int64_t cols, int64_t K, float* out) {
  block_product(a, b, rows, cols, K, out);
}

[[gnu::target("avx2")]] void block_product_avx2(const float* a, const float* b, int64_t rows,
                                                int64_t cols, int64_t K, float* out) {
  block_product(a, b, rows, cols, K, out);
}

void block_product_baseline(const float* a, const float* b, int64_t rows, int64_t cols, int64_t K,
                            float* out) {
  block_product(a, b, rows, cols, K, out);
}

int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace

void sgemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                     int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  auto* product = block_product_baseline;
  switch (active_simd_level()) {
    case SimdLevel::avx512:
      product = block_product_avx512;
      break;
    case SimdLevel::avx2:
      product = block_product_avx2;
      break;
    case SimdLevel::scalar:
      break;
  }
  const int64_t row_blocks = (M + kBlockRows - 1) / kBlockRows;
  const int64_t col_blocks = (N + kBlockCols - 1) / kBlockCols;
  tbb::parallel_for(tbb::blocked_range2d<int64_t>(0, row_blocks, 1, 0, col_blocks, 1),
                    [&](const tbb::blocked_range2d<int64_t>& range) {
                      std::vector<float> a_packed, b_packed, out;
                      for (int64_t rb = range.rows().begin(); rb < range.rows().end(); ++rb) {
                        const int64_t i0 = rb * kBlockRows, rows = std::min(kBlockRows, M - i0);
                        const int64_t rows_p = round_up(rows, kTileRows);
                        // a_packed (rows_p, K) = op(A)[i0 .. i0 + rows), zero rows below.
                        a_packed.assign(size_t(rows_p * K), 0.0f);
                        for (int64_t r = 0; r < rows; ++r)
                          for (int64_t k = 0; k < K; ++k)
                            a_packed[size_t(r * K + k)] =
                                trans_a ? A[k * lda + i0 + r] : A[(i0 + r) * lda + k];
                        for (int64_t cb = range.cols().begin(); cb < range.cols().end(); ++cb) {
                          const int64_t j0 = cb * kBlockCols, cols = std::min(kBlockCols, N - j0);
                          const int64_t cols_p = round_up(cols, kTileCols);
                          // b_packed (K, cols_p) = op(B)[:, j0 .. j0 + cols), zero columns right.
                          b_packed.assign(size_t(K * cols_p), 0.0f);
                          for (int64_t k = 0; k < K; ++k)
                            for (int64_t c = 0; c < cols; ++c)
                              b_packed[size_t(k * cols_p + c)] =
                                  trans_b ? B[(j0 + c) * ldb + k] : B[k * ldb + j0 + c];
                          out.resize(size_t(rows_p * cols_p));
                          product(a_packed.data(), b_packed.data(), rows_p, cols_p, K, out.data());
                          for (int64_t r = 0; r < rows; ++r) {
                            float* c_row = C + (i0 + r) * ldc + j0;
                            const float* sums = out.data() + r * cols_p;
                            for (int64_t c = 0; c < cols; ++c) {
                              const float scaled = alpha == 1.0f ? sums[c] : alpha * sums[c];
                              c_row[c] = beta == 0.0f ? scaled : c_row[c] + scaled;
                            }
                          }
                        }
                      }
                    });
}

}  // namespace strata::kernels::cpu
