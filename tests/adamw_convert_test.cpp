// The scalar bf16/fp16 conversions (kernels/cpu/simd.h) against independent
// references: a float64 nearest-even search for bf16, the F16C instructions and
// an exhaustive float64 decoding for fp16.
#include <gtest/gtest.h>
#include <immintrin.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/simd.h"

namespace strata::kernels::cpu {
namespace {

uint64_t fresh_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

// Random floats with uniformly random bit patterns (every exponent, NaNs included).
std::vector<float> random_floats(size_t count, std::mt19937_64& rng) {
  std::vector<float> values(count);
  for (auto& v : values) v = bits_float(static_cast<uint32_t>(rng()));
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            65504.0f,
                            65519.99f,
                            65520.0f,
                            6.1035156e-05f,
                            5.9604645e-08f,
                            2.9802322e-08f,
                            2.9802326e-08f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::max(),
                            bits_float(0x3f808000u),
                            bits_float(0x3f818000u),
                            bits_float(0x7f7fffffu)};
  for (size_t i = 0; i < std::size(specials) && i < count; ++i) values[i] = specials[i];
  return values;
}

// A finite float's value in float64, decoded from its bits: exact for a
// subnormal too, which a conversion (cvtss2sd) reads as zero in the mode
// the kernels run in (kernels/cpu/float_mode.h: denormals are zero).
double exact_double(uint32_t bits) {
  const double sign = (bits & 0x80000000u) ? -1.0 : 1.0;
  const uint32_t exponent = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;
  if (exponent == 0) return sign * std::ldexp(double(mantissa), -149);
  return sign * std::ldexp(double(mantissa | 0x800000u), int(exponent) - 150);
}

// bf16 nearest-even by comparing the two neighbouring bf16 values in float64.
uint16_t bf16_reference(float x) {
  if (std::isnan(x)) return 0x7fc0;
  const uint32_t bits = float_bits(x);
  const uint32_t low = bits & 0xffff0000u;  // truncation toward zero
  if (low == bits) return static_cast<uint16_t>(bits >> 16);
  const uint32_t high = low + 0x10000u;  // next bf16 away from zero (may be inf)
  const double d_low = std::fabs(exact_double(bits) - exact_double(low));
  // Past the largest bf16, the next value up is 2^128, which the format writes as infinity.
  const double high_value = (high & 0x7fffffffu) == 0x7f800000u
                                ? std::ldexp((bits & 0x80000000u) ? -1.0 : 1.0, 128)
                                : exact_double(high);
  const double d_high = std::fabs(high_value - exact_double(bits));
  if (d_low < d_high) return static_cast<uint16_t>(low >> 16);
  if (d_high < d_low) return static_cast<uint16_t>(high >> 16);
  return static_cast<uint16_t>(((low >> 16) & 1u) ? high >> 16 : low >> 16);
}

TEST(AdamWConvert, Bf16RoundsToNearestEven) {
  std::mt19937_64 rng(fresh_seed());
  std::printf("seed %llu\n", static_cast<unsigned long long>(fresh_seed()));
  for (float x : random_floats(1 << 20, rng)) {
    ASSERT_EQ(float_to_bf16(x), bf16_reference(x)) << std::hex << float_bits(x);
  }
}

TEST(AdamWConvert, Bf16WidensExactly) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float x = bf16_to_float(static_cast<uint16_t>(h));
    ASSERT_EQ(float_bits(x), h << 16);
    if (!std::isnan(x)) {
      ASSERT_EQ(float_to_bf16(x), h);
    }
  }
}

TEST(AdamWConvert, Fp16WidensExactlyForEveryValue) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float x = f16_to_float(static_cast<uint16_t>(h));
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    const double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (exponent == 0x1f) {
      ASSERT_TRUE(mantissa ? std::isnan(x) : std::isinf(x)) << h;
      if (!mantissa) continue;
    } else {
      const double expected = exponent == 0
                                  ? sign * std::ldexp(double(mantissa), -24)
                                  : sign * std::ldexp(1024.0 + mantissa, int(exponent) - 25);
      ASSERT_EQ(double(x), expected) << h;
      ASSERT_EQ(std::signbit(x), (h & 0x8000) != 0) << h;
      ASSERT_EQ(float_to_f16(x), h);  // round trip
    }
  }
}

__attribute__((target("f16c"))) uint16_t f16c_narrow(float x) {
  return static_cast<uint16_t>(_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT));
}

__attribute__((target("f16c"))) uint32_t f16c_widen_bits(uint16_t h) {
  return float_bits(_cvtsh_ss(h));
}

TEST(AdamWConvert, Fp16MatchesF16cOnEveryInputKind) {
  if (cpu_simd_level() < SimdLevel::avx2) GTEST_SKIP() << "this CPU has no F16C";
  std::mt19937_64 rng(fresh_seed() + 1);
  for (float x : random_floats(1 << 20, rng)) {
    ASSERT_EQ(float_to_f16(x), f16c_narrow(x)) << std::hex << float_bits(x);
  }
  // Values near the fp16 range, where rounding matters most.
  std::uniform_real_distribution<float> near(-70000.0f, 70000.0f);
  std::uniform_real_distribution<float> tiny(-1e-4f, 1e-4f);
  for (int i = 0; i < (1 << 20); ++i) {
    const float a = near(rng), b = tiny(rng);
    ASSERT_EQ(float_to_f16(a), f16c_narrow(a)) << a;
    ASSERT_EQ(float_to_f16(b), f16c_narrow(b)) << b;
  }
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    ASSERT_EQ(float_bits(f16_to_float(static_cast<uint16_t>(h))), f16c_widen_bits(uint16_t(h)))
        << h;
  }
}

TEST(AdamWConvert, ForcingALevelTheCpuLacksFails) {
  if (cpu_simd_level() == SimdLevel::avx512) GTEST_SKIP() << "this CPU has every level";
  const Status status = force_simd_level(SimdLevel::avx512);
  EXPECT_FALSE(status);
  EXPECT_NE(status.message().find("does not support avx512"), std::string::npos);
  EXPECT_TRUE(force_simd_level(SimdLevel::scalar));
  EXPECT_EQ(active_simd_level(), SimdLevel::scalar);
  reset_simd_level();
  EXPECT_EQ(active_simd_level(), cpu_simd_level());
}

}  // namespace
}  // namespace strata::kernels::cpu
