// The fp32 rounding bounds the tests of cut units check against
// (core/README.md derives them: "Vocabulary chunks", "Expert groups", "MLP
// parts"): gamma_n, and a bound on the gradient of an RMSNorm's output
// carried through the norm's backward to its input.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace strata::testing {

constexpr double kUnitRoundoff = 1.0 / 16777216.0;  // fp32's, 2^-24
// gamma_n = n u / (1 - n u): a recursive fp32 sum of n terms lies within
// gamma_n times the sum of their magnitudes of the exact value.
inline double gamma_bound(double n) {
  return n * kUnitRoundoff / (1 - n * kUnitRoundoff);
}

// An RMSNorm over the N rows of x (N, C) with weight w, in float64.
struct NormBackwardBound {
  NormBackwardBound(const float* x, const float* weight, int64_t rows, int64_t columns, double eps)
      : C(columns), w(weight, weight + columns), xhat(size_t(rows * columns)), rstd(size_t(rows)) {
    for (int64_t t = 0; t < rows; ++t) {
      double ms = 0;
      for (int64_t j = 0; j < C; ++j) ms += double(x[t * C + j]) * x[t * C + j];
      rstd[size_t(t)] = 1 / std::sqrt(ms / double(C) + eps);
      for (int64_t j = 0; j < C; ++j) xhat[size_t(t * C + j)] = x[t * C + j] * rstd[size_t(t)];
    }
  }
  // The normed row's element: xhat w.
  double normed(int64_t t, int64_t j) const { return xhat[size_t(t * C + j)] * w[size_t(j)]; }
  // |J|^T applied to a bound e (N, C) on the gradient of the normed rows, at
  // (t, j): the norm's backward is dx = rstd (w e - xhat mean(w e xhat)).
  double carried(const std::vector<double>& e, int64_t t, int64_t j) const {
    double mean = 0;
    for (int64_t i = 0; i < C; ++i)
      mean +=
          std::abs(double(w[size_t(i)])) * e[size_t(t * C + i)] * std::abs(xhat[size_t(t * C + i)]);
    mean /= double(C);
    return rstd[size_t(t)] * (std::abs(double(w[size_t(j)])) * e[size_t(t * C + j)] +
                              std::abs(xhat[size_t(t * C + j)]) * mean);
  }
  // The bound on the difference of two computations of the norm's input
  // gradient at (t, j), whose gradients of the normed rows g (magnitudes
  // g_abs) differ within `cut`: `cut` carried through, plus each side's
  // rounding of the backward (gamma_(C+8) of the map applied to |g|).
  double input_gradient(const std::vector<double>& cut, const std::vector<double>& g_abs, int64_t t,
                        int64_t j) const {
    return carried(cut, t, j) + 2 * gamma_bound(double(C + 8)) * carried(g_abs, t, j);
  }
  // Likewise for the norm weight's gradient sum_t g_tj xhat_tj at column j.
  double weight_gradient(const std::vector<double>& cut, const std::vector<double>& g_abs,
                         int64_t j) const {
    const int64_t N = int64_t(rstd.size());
    double bound = 0;
    for (int64_t t = 0; t < N; ++t)
      bound += cut[size_t(t * C + j)] * std::abs(xhat[size_t(t * C + j)]) +
               2 * gamma_bound(double(N + 8)) * g_abs[size_t(t * C + j)] *
                   std::abs(xhat[size_t(t * C + j)]);
    return bound;
  }

  int64_t C;
  std::vector<float> w;
  std::vector<double> xhat, rstd;
};

}  // namespace strata::testing
