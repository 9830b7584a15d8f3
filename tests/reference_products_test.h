// A fixture for tests that compare a cut model with the uncut one bit for
// bit: every product on the reference path (kernels/cpu/gemm.h: the same
// bits on any x86-64 CPU and thread count) while the test runs, a fresh
// seed (printed, STRATA_TEST_SEED reruns it) and draws from it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "tiers_test_support.h"

namespace strata::testing {

class ReferenceProductsTest : public ::testing::Test {
 protected:
  explicit ReferenceProductsTest(std::string seed_label) : seed_label_(std::move(seed_label)) {}
  void SetUp() override {
    seed_ = tiers::testing::fresh_seed(seed_label_.c_str());
    rng_.seed(seed_);
    fast_ = kernels::cpu::gemm_info().library_kernel;
    ASSERT_TRUE(kernels::cpu::select_gemm_kernel(kernels::cpu::GemmKernel::reference).is_ok());
  }
  void TearDown() override { EXPECT_TRUE(kernels::cpu::select_gemm_kernel(fast_).is_ok()); }

  int64_t pick(int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
  }
  std::vector<float> normal(size_t n, float scale) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = d(rng_);
    return v;
  }
  static bool same_bits(const float* a, const float* b, size_t n) {
    return std::memcmp(a, b, n * 4) == 0;
  }
  static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && same_bits(a.data(), b.data(), a.size());
  }

  std::string seed_label_;
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  kernels::cpu::GemmKernel fast_ = kernels::cpu::GemmKernel::baseline;
};

}  // namespace strata::testing
