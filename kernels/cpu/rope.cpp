#include "kernels/cpu/rope.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <cmath>
#include <numbers>

namespace strata::kernels::cpu {

void rope_inv_freq(float* inv_freq, const RopeParams& p) {
  const int64_t half = p.head_dim / 2;
  const float base = static_cast<float>(p.theta);
  for (int64_t i = 0; i < half; ++i) {
    // Hugging Face: 1 / base ** (arange(0, D, 2).float() / D), all in fp32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(p.head_dim);
    inv_freq[i] = 1.0f / std::pow(base, exponent);
  }
  if (!p.llama3_scaling) return;
  // _compute_llama3_parameters of transformers' modeling_rope_utils, in fp32.
  const float factor = static_cast<float>(p.factor);
  const float low = static_cast<float>(p.low_freq_factor);
  const float high = static_cast<float>(p.high_freq_factor);
  const float old_context = static_cast<float>(p.original_max_positions);
  const float low_freq_wavelen = old_context / low;
  const float high_freq_wavelen = old_context / high;
  for (int64_t i = 0; i < half; ++i) {
    const float f = inv_freq[i];
    const float wavelen = static_cast<float>(2.0 * std::numbers::pi) / f;
    float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    if (medium) {
      const float smooth = (old_context / wavelen - low) / (high - low);
      scaled = (1.0f - smooth) * scaled / factor + smooth * scaled;
    }
    inv_freq[i] = scaled;
  }
}

void rope_cos_sin(float* cos, float* sin, const float* inv_freq, int64_t T, int64_t D) {
  const int64_t half = D / 2;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, T), [&](const tbb::blocked_range<int64_t>& ts) {
    for (int64_t t = ts.begin(); t < ts.end(); ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const float angle = inv_freq[i] * static_cast<float>(t);  // fp32, as Hugging Face
        cos[t * half + i] = static_cast<float>(std::cos(static_cast<double>(angle)));
        sin[t * half + i] = static_cast<float>(std::sin(static_cast<double>(angle)));
      }
    }
  });
}

namespace {

// sign = +1: forward rotation; -1: its transpose (the backward).
void rotate(float* x, const float* cos, const float* sin, int64_t B, int64_t T, int64_t heads,
            int64_t D, int64_t row_stride, float sign) {
  const int64_t half = D / 2;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, B * T),
                    [&](const tbb::blocked_range<int64_t>& rows) {
                      for (int64_t n = rows.begin(); n < rows.end(); ++n) {
                        const int64_t t = n % T;
                        const float* c = cos + t * half;
                        const float* s = sin + t * half;
                        for (int64_t h = 0; h < heads; ++h) {
                          float* first = x + n * row_stride + h * D;
                          float* second = first + half;
                          for (int64_t i = 0; i < half; ++i) {
                            const float a = first[i];
                            const float b = second[i];
                            // x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1).
                            first[i] = a * c[i] - sign * b * s[i];
                            second[i] = b * c[i] + sign * a * s[i];
                          }
                        }
                      }
                    });
}

}  // namespace

void rope_forward(float* x, const float* cos, const float* sin, int64_t B, int64_t T, int64_t heads,
                  int64_t D, int64_t row_stride) {
  rotate(x, cos, sin, B, T, heads, D, row_stride, 1.0f);
}

void rope_backward(float* dx, const float* cos, const float* sin, int64_t B, int64_t T,
                   int64_t heads, int64_t D, int64_t row_stride) {
  rotate(dx, cos, sin, B, T, heads, D, row_stride, -1.0f);
}

}  // namespace strata::kernels::cpu
