// Helpers for the kernel tests: random inputs, float64 references, and
// vector-Jacobian products by central differences of a float64 function
// (accurate to ~1e-9, far below the fp32 errors under test).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace strata::testing {

inline std::vector<float> random_floats(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) {
  return {v.begin(), v.end()};
}

// |a - b| / |b| over the whole tensor (tests/README.md).
inline double relative_error(const std::vector<float>& a, const std::vector<double>& b) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

// d/dx of sum(dy * f(x)), by central differences in float64.
inline std::vector<double> numeric_vjp(
    const std::function<std::vector<double>(const std::vector<double>&)>& f, std::vector<double> x,
    const std::vector<double>& dy, double h = 1e-6) {
  std::vector<double> dx(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + h;
    const std::vector<double> plus = f(x);
    x[i] = saved - h;
    const std::vector<double> minus = f(x);
    x[i] = saved;
    double sum = 0.0;
    for (size_t j = 0; j < dy.size(); ++j) sum += dy[j] * (plus[j] - minus[j]);
    dx[i] = sum / (2 * h);
  }
  return dx;
}

// v + offset, elementwise: what a += kernel should produce from a prefilled buffer.
inline std::vector<double> plus(const std::vector<float>& prefill, const std::vector<double>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = prefill[i] + v[i];
  return out;
}

inline constexpr double kFp32Tolerance = 1e-5;

}  // namespace strata::testing
