#include "kernels/cpu/cross_entropy.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>

namespace strata::kernels::cpu {
namespace {

// log(sum_j exp(x_j - max)) + max, summed in double for long vocabularies.
float log_sum_exp(const float* x, int64_t V, float& max_out) {
  float max_value = x[0];
  for (int64_t j = 1; j < V; ++j) max_value = std::max(max_value, x[j]);
  double sum = 0.0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - max_value);
  max_out = max_value;
  return static_cast<float>(std::log(sum)) + max_value;
}

}  // namespace

void cross_entropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N),
                    [&](const tbb::blocked_range<int64_t>& rows) {
                      for (int64_t n = rows.begin(); n < rows.end(); ++n) {
                        if (targets[n] < 0) {
                          losses[n] = 0.0f;
                          continue;
                        }
                        const float* x = logits + n * V;
                        float max_value;
                        losses[n] = log_sum_exp(x, V, max_value) - x[targets[n]];
                      }
                    });
}

void cross_entropy_forward_backward(float* losses, float* dlogits, const float* logits,
                                    const int32_t* targets, float dloss, int64_t N, int64_t V) {
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, N), [&](const tbb::blocked_range<int64_t>& rows) {
        for (int64_t n = rows.begin(); n < rows.end(); ++n) {
          float* dx = dlogits + n * V;
          if (targets[n] < 0) {
            if (losses != nullptr) losses[n] = 0.0f;
            std::fill(dx, dx + V, 0.0f);
            continue;
          }
          const float* x = logits + n * V;
          const float target_logit = x[targets[n]];  // read before dx may overwrite it
          float max_value = x[0];
          for (int64_t j = 1; j < V; ++j) max_value = std::max(max_value, x[j]);
          double sum = 0.0;
          for (int64_t j = 0; j < V; ++j) {
            dx[j] = std::exp(x[j] - max_value);
            sum += dx[j];
          }
          if (losses != nullptr) {
            losses[n] = static_cast<float>(std::log(sum)) + max_value - target_logit;
          }
          const float scale = static_cast<float>(dloss / sum);
          for (int64_t j = 0; j < V; ++j) dx[j] *= scale;
          dx[targets[n]] -= dloss;
        }
      });
}

void cross_entropy_backward(float* dlogits, const float* logits, const int32_t* targets,
                            float dloss, int64_t N, int64_t V) {
  cross_entropy_forward_backward(nullptr, dlogits, logits, targets, dloss, N, V);
}

}  // namespace strata::kernels::cpu
