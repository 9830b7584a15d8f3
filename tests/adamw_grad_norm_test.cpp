// The gradient norm reduction (kernels/cpu/grad_norm.h): float64 accuracy,
// inf/NaN detection anywhere, and the same bits for every SIMD path and every
// thread count.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/grad_norm.h"

namespace strata::kernels::cpu {
namespace {

uint64_t fresh_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

struct Grad {
  ElementType type;
  std::vector<float> f32;
  std::vector<uint16_t> half;
  const void* data() const {
    return type == ElementType::f32 ? static_cast<const void*>(f32.data())
                                    : static_cast<const void*>(half.data());
  }
  double at(size_t i) const {
    if (type == ElementType::f32) return f32[i];
    return type == ElementType::bf16 ? bf16_to_float(half[i]) : f16_to_float(half[i]);
  }
  void set(size_t i, float value) {
    if (type == ElementType::f32)
      f32[i] = value;
    else
      half[i] = type == ElementType::bf16 ? float_to_bf16(value) : float_to_f16(value);
  }
};

Grad random_grad(ElementType type, int64_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(-4.0f, 2.0f);
  Grad g{type, {}, {}};
  if (type == ElementType::f32)
    g.f32.resize(n);
  else
    g.half.resize(n);
  for (int64_t i = 0; i < n; ++i) g.set(i, normal(rng) * std::pow(10.0f, exponent(rng)));
  return g;
}

const ElementType kTypes[] = {ElementType::f32, ElementType::bf16, ElementType::f16};
const int64_t kSizes[] = {1, 15, 16, 17, 4095, 4096, 4097, 70001, 1000003};

TEST(GradNorm, MatchesLongDoubleSum) {
  std::mt19937_64 rng(fresh_seed());
  std::printf("seed %llu\n", static_cast<unsigned long long>(fresh_seed()));
  for (ElementType type : kTypes) {
    for (int64_t n : kSizes) {
      const Grad g = random_grad(type, n, rng);
      long double expected = 0;
      for (int64_t i = 0; i < n; ++i) expected += (long double)g.at(i) * g.at(i);
      const auto result = grad_norm_squared(g.data(), type, n);
      ASSERT_TRUE(result.is_ok()) << result.status().message();
      EXPECT_FALSE(result->nonfinite);
      EXPECT_NEAR(result->sum_squares / double(expected), 1.0, 1e-13) << "n " << n;
    }
  }
}

TEST(GradNorm, EmptyShardIsZero) {
  const auto result = grad_norm_squared(nullptr, ElementType::f32, 0);
  ASSERT_TRUE(result.is_ok());
  EXPECT_EQ(result->sum_squares, 0.0);
  EXPECT_FALSE(result->nonfinite);
  EXPECT_FALSE(grad_norm_squared(nullptr, ElementType::f32, 5).is_ok());
  EXPECT_FALSE(grad_norm_squared(nullptr, ElementType::f32, -1).is_ok());
}

TEST(GradNorm, FindsInfAndNanAnywhere) {
  std::mt19937_64 rng(fresh_seed() + 1);
  const float bad[] = {std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(),
                       std::numeric_limits<float>::quiet_NaN()};
  for (ElementType type : kTypes) {
    for (int64_t n : {int64_t{1}, int64_t{17}, int64_t{4097}, int64_t{200003}}) {
      for (float value : bad) {
        Grad g = random_grad(type, n, rng);
        const int64_t positions[] = {0, n - 1, static_cast<int64_t>(rng() % n)};
        for (int64_t position : positions) {
          Grad copy = g;
          copy.set(position, value);
          const auto result = grad_norm_squared(copy.data(), type, n);
          ASSERT_TRUE(result.is_ok());
          EXPECT_TRUE(result->nonfinite) << "n " << n << " at " << position;
        }
      }
    }
  }
  // Finite values near fp32's maximum do not overflow the float64 sum.
  std::vector<float> big(1000, std::numeric_limits<float>::max());
  const auto result = grad_norm_squared(big.data(), ElementType::f32, 1000);
  EXPECT_FALSE(result->nonfinite);
}

TEST(GradNorm, SameBitsForEverySimdPathAndThreadCount) {
  std::mt19937_64 rng(fresh_seed() + 2);
  std::vector<SimdLevel> levels = {SimdLevel::scalar};
  if (cpu_simd_level() >= SimdLevel::avx2) levels.push_back(SimdLevel::avx2);
  if (cpu_simd_level() >= SimdLevel::avx512) levels.push_back(SimdLevel::avx512);
  for (ElementType type : kTypes) {
    for (int64_t n : kSizes) {
      const Grad g = random_grad(type, n, rng);
      ASSERT_TRUE(force_simd_level(SimdLevel::scalar));
      const double expected = grad_norm_squared(g.data(), type, n)->sum_squares;
      for (SimdLevel level : levels) {
        ASSERT_TRUE(force_simd_level(level));
        for (int threads : {1, 2, 5}) {
          tbb::task_arena arena(threads);
          double sum = 0;
          arena.execute([&] { sum = grad_norm_squared(g.data(), type, n)->sum_squares; });
          ASSERT_EQ(sum, expected)
              << simd_level_name(level) << " threads " << threads << " n " << n;
        }
      }
    }
  }
  reset_simd_level();
}

}  // namespace
}  // namespace strata::kernels::cpu
