#include "kernels/cpu/bias.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <vector>

namespace strata::kernels::cpu {

void bias_forward(float* out, const float* bias, int64_t N, int64_t OC) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, 16),
                    [&](const tbb::blocked_range<int64_t>& rows) {
                      for (int64_t n = rows.begin(); n < rows.end(); ++n) {
                        float* row = out + n * OC;
                        for (int64_t c = 0; c < OC; ++c) row[c] += bias[c];
                      }
                    });
}

void bias_backward(float* dbias, const float* dout, int64_t N, int64_t OC) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, OC, 256),
                    [&](const tbb::blocked_range<int64_t>& cols) {
                      // Sums in fp64, one add per row in row order, then one add into dbias.
                      std::vector<double> sum(size_t(cols.size()), 0.0);
                      for (int64_t n = 0; n < N; ++n) {
                        const float* row = dout + n * OC + cols.begin();
                        for (size_t c = 0; c < sum.size(); ++c) sum[c] += row[c];
                      }
                      for (size_t c = 0; c < sum.size(); ++c)
                        dbias[cols.begin() + int64_t(c)] += static_cast<float>(sum[c]);
                    });
}

}  // namespace strata::kernels::cpu
