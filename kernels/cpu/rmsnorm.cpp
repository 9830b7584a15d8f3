#include "kernels/cpu/rmsnorm.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cmath>

namespace strata::kernels::cpu {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                     int64_t C, float eps) {
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, N), [&](const tbb::blocked_range<int64_t>& rows) {
        for (int64_t n = rows.begin(); n < rows.end(); ++n) {
          const float* x = inp + n * C;
          float* y = out + n * C;
          double sum_squares = 0.0;
          for (int64_t c = 0; c < C; ++c) sum_squares += static_cast<double>(x[c]) * x[c];
          const float mean_square = static_cast<float>(sum_squares / static_cast<double>(C));
          const float r = 1.0f / std::sqrt(mean_square + eps);
          rstd[n] = r;
          for (int64_t c = 0; c < C; ++c) y[c] = weight[c] * (x[c] * r);
        }
      });
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                      const float* weight, const float* rstd, int64_t N, int64_t C) {
  // With xhat = x * r and y = w * xhat:
  //   dx = r * (dxhat - xhat * mean(dxhat * xhat)),  dxhat = dy * w;  dw = sum_n dy * xhat.
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N),
                    [&](const tbb::blocked_range<int64_t>& rows) {
                      for (int64_t n = rows.begin(); n < rows.end(); ++n) {
                        const float* x = inp + n * C;
                        const float* dy = dout + n * C;
                        float* dx = dinp + n * C;
                        const float r = rstd[n];
                        double dot = 0.0;
                        for (int64_t c = 0; c < C; ++c)
                          dot += static_cast<double>(dy[c] * weight[c]) * (x[c] * r);
                        const float mean_dot = static_cast<float>(dot / static_cast<double>(C));
                        for (int64_t c = 0; c < C; ++c) {
                          const float xhat = x[c] * r;
                          dx[c] += r * (dy[c] * weight[c] - xhat * mean_dot);
                        }
                      }
                    });
  // Columns split over threads, rows summed in order: the same bits for any thread count.
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, C, 64),
                    [&](const tbb::blocked_range<int64_t>& cols) {
                      for (int64_t n = 0; n < N; ++n) {
                        const float* x = inp + n * C;
                        const float* dy = dout + n * C;
                        const float r = rstd[n];
                        for (int64_t c = cols.begin(); c < cols.end(); ++c)
                          dweight[c] += dy[c] * (x[c] * r);
                      }
                    });
}

}  // namespace strata::kernels::cpu
