#include "kernels/cpu/attention.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>

#include "kernels/cpu/gemm.h"

namespace strata::kernels::cpu {

void attention_forward(float* out, float* probs, const float* q, const float* k, const float* v,
                       const AttentionShape& s) {
  const int64_t T = s.T, D = s.D, group = s.H / s.KV, ld = s.row_stride;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t kvh = h / group;
      const float* qh = q + b * T * ld + h * D;    // (T, D), leading dimension ld
      const float* kh = k + b * T * ld + kvh * D;  // (T, D)
      const float* vh = v + b * T * ld + kvh * D;  // (T, D)
      float* p = probs + (b * s.H + h) * T * T;    // (T, T)
      float* oh = out + b * T * s.H * D + h * D;   // (T, D), leading dimension H*D
      for (int64_t r0 = 0; r0 < T; r0 += s.row_block) {
        // Rows [r0, r1) attend to keys [0, r1): scores = scale * q k^T, softmax, out = p v.
        const int64_t r1 = std::min(T, r0 + s.row_block), rows_n = r1 - r0;
        float* pb = p + r0 * T;
        sgemm(false, true, rows_n, r1, D, scale, qh + r0 * ld, ld, kh, ld, 0.0f, pb, T);
        tbb::parallel_for(
            tbb::blocked_range<int64_t>(r0, r1, 16), [&](const tbb::blocked_range<int64_t>& rows) {
              for (int64_t i = rows.begin(); i < rows.end(); ++i) {
                float* row = p + i * T;
                // Keys [first, i]: causal, and within the window if any.
                const int64_t first = s.window > 0 ? std::max<int64_t>(0, i - s.window + 1) : 0;
                float max_score = row[first];
                for (int64_t j = first + 1; j <= i; ++j) max_score = std::max(max_score, row[j]);
                float sum = 0.0f;
                for (int64_t j = first; j <= i; ++j) {
                  row[j] = std::exp(row[j] - max_score);
                  sum += row[j];
                }
                const float inv_sum = 1.0f / sum;
                for (int64_t j = first; j <= i; ++j) row[j] *= inv_sum;
                std::fill(row, row + first, 0.0f);
                std::fill(row + i + 1, row + T, 0.0f);
              }
            });
        sgemm(false, false, rows_n, D, r1, 1.0f, pb, T, vh, ld, 0.0f, oh + r0 * s.H * D, s.H * D);
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, float* scratch, const float* dout,
                        const float* probs, const float* q, const float* k, const float* v,
                        const AttentionShape& s) {
  const int64_t T = s.T, D = s.D, group = s.H / s.KV, ld = s.row_stride;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // dk and dv collect every query head of their group, so they start at zero.
  for (int64_t n = 0; n < s.B * T; ++n) {
    std::fill(dk + n * ld, dk + n * ld + s.KV * D, 0.0f);
    std::fill(dv + n * ld, dv + n * ld + s.KV * D, 0.0f);
  }
  for (int64_t b = 0; b < s.B; ++b) {
    for (int64_t h = 0; h < s.H; ++h) {
      const int64_t kvh = h / group;
      const float* qh = q + b * T * ld + h * D;
      const float* kh = k + b * T * ld + kvh * D;
      const float* vh = v + b * T * ld + kvh * D;
      float* dqh = dq + b * T * ld + h * D;
      float* dkh = dk + b * T * ld + kvh * D;
      float* dvh = dv + b * T * ld + kvh * D;
      const float* p = probs + (b * s.H + h) * T * T;     // (T, T)
      const float* doh = dout + b * T * s.H * D + h * D;  // (T, D), leading dimension H*D
      float* dp = scratch;                                // (T, T)
      for (int64_t r0 = 0; r0 < T; r0 += s.row_block) {
        // Rows [r0, r1) of p touch keys [0, r1) only.
        const int64_t r1 = std::min(T, r0 + s.row_block), rows_n = r1 - r0;
        const float* pb = p + r0 * T;
        const float* dob = doh + r0 * s.H * D;
        float* dpb = dp + r0 * T;
        // dv += p^T do;  dp = do v^T
        sgemm(true, false, r1, D, rows_n, 1.0f, pb, T, dob, s.H * D, 1.0f, dvh, ld);
        sgemm(false, true, rows_n, r1, D, 1.0f, dob, s.H * D, vh, ld, 0.0f, dpb, T);
        // Softmax backward, in place: ds = p * (dp - sum_j p dp) * scale (zero where p is
        // masked, the window's keys included).
        tbb::parallel_for(tbb::blocked_range<int64_t>(r0, r1, 16),
                          [&](const tbb::blocked_range<int64_t>& rows) {
                            for (int64_t i = rows.begin(); i < rows.end(); ++i) {
                              const float* prow = p + i * T;
                              float* row = dp + i * T;
                              float dot = 0.0f;
                              for (int64_t j = 0; j <= i; ++j) dot += prow[j] * row[j];
                              for (int64_t j = 0; j <= i; ++j)
                                row[j] = prow[j] * (row[j] - dot) * scale;
                              std::fill(row + i + 1, row + r1, 0.0f);
                            }
                          });
        // dq = ds k;  dk += ds^T q
        sgemm(false, false, rows_n, D, r1, 1.0f, dpb, T, kh, ld, 0.0f, dqh + r0 * ld, ld);
        sgemm(true, false, r1, D, rows_n, 1.0f, dpb, T, qh + r0 * ld, ld, 1.0f, dkh, ld);
      }
    }
  }
}

}  // namespace strata::kernels::cpu
