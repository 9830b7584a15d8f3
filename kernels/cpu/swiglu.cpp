#include "kernels/cpu/swiglu.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cmath>

namespace strata::kernels::cpu {

void swiglu_forward(float* out, const float* gate_up, int64_t N, int64_t I) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N),
                    [&](const tbb::blocked_range<int64_t>& rows) {
                      for (int64_t n = rows.begin(); n < rows.end(); ++n) {
                        const float* gate = gate_up + n * 2 * I;
                        const float* up = gate + I;
                        float* y = out + n * I;
                        for (int64_t i = 0; i < I; ++i) {
                          const float g = gate[i];
                          y[i] = g / (1.0f + std::exp(-g)) * up[i];
                        }
                      }
                    });
}

void swiglu_backward(float* dgate_up, const float* dout, const float* gate_up, int64_t N,
                     int64_t I) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N),
                    [&](const tbb::blocked_range<int64_t>& rows) {
                      for (int64_t n = rows.begin(); n < rows.end(); ++n) {
                        const float* gate = gate_up + n * 2 * I;
                        const float* up = gate + I;
                        const float* dy = dout + n * I;
                        float* dgate = dgate_up + n * 2 * I;
                        float* dup = dgate + I;
                        for (int64_t i = 0; i < I; ++i) {
                          const float g = gate[i];
                          const float sig = 1.0f / (1.0f + std::exp(-g));
                          const float silu = g * sig;
                          dup[i] = dy[i] * silu;
                          dgate[i] = dy[i] * up[i] * sig * (1.0f + g * (1.0f - sig));
                        }
                      }
                    });
}

}  // namespace strata::kernels::cpu
