#include "kernels/cpu/embedding.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>

namespace strata::kernels::cpu {

void embedding_forward(float* out, const int32_t* tokens, const float* weight, int64_t N,
                       int64_t C) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N),
                    [&](const tbb::blocked_range<int64_t>& rows) {
                      for (int64_t n = rows.begin(); n < rows.end(); ++n) {
                        const float* row = weight + static_cast<int64_t>(tokens[n]) * C;
                        std::copy(row, row + C, out + n * C);
                      }
                    });
}

void embedding_backward(float* dweight, const float* dout, const int32_t* tokens, int64_t N,
                        int64_t C) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, C, 64),
                    [&](const tbb::blocked_range<int64_t>& cols) {
                      for (int64_t n = 0; n < N; ++n) {
                        float* row = dweight + static_cast<int64_t>(tokens[n]) * C;
                        const float* dy = dout + n * C;
                        for (int64_t c = cols.begin(); c < cols.end(); ++c) row[c] += dy[c];
                      }
                    });
}

void embedding_forward_rows(float* out, const int32_t* tokens, const float* weight, int64_t N,
                            int64_t C, int64_t begin, int64_t end) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N),
                    [&](const tbb::blocked_range<int64_t>& rows) {
                      for (int64_t n = rows.begin(); n < rows.end(); ++n) {
                        const int64_t token = tokens[n];
                        if (token < begin || token >= end) continue;
                        const float* row = weight + (token - begin) * C;
                        std::copy(row, row + C, out + n * C);
                      }
                    });
}

void embedding_backward_rows(float* dweight, const float* dout, const int32_t* tokens, int64_t N,
                             int64_t C, int64_t begin, int64_t end) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, C, 64),
                    [&](const tbb::blocked_range<int64_t>& cols) {
                      for (int64_t n = 0; n < N; ++n) {
                        const int64_t token = tokens[n];
                        if (token < begin || token >= end) continue;
                        float* row = dweight + (token - begin) * C;
                        const float* dy = dout + n * C;
                        for (int64_t c = cols.begin(); c < cols.end(); ++c) row[c] += dy[c];
                      }
                    });
}

}  // namespace strata::kernels::cpu
