// The AdamW kernels with bf16 and int8 moments (kernels/cpu/adamw.h) against
// a float64 reference of the same formats, written here: decode the stored
// state, update in float64 with torch.optim.AdamW's formulas, encode with the
// same rules. And every SIMD path against the scalar path, bit for bit.
//
// Bounds (u = 2^-24, fp32's unit roundoff; "slop" = 16u times the sum of the
// magnitudes of the terms that make the value, the fp32 kernel's own error):
// - bf16: each stored m and v is within half a bf16 ulp (of the larger of it
//   and the reference) plus slop of the float64 m and v.
// - int8: each block's scales are within slop of the float64 maxima; each m
//   decodes to within half a code step (scale / 127) plus 4u * scale plus slop
//   of the float64 m, each sqrt(v) to within half a step (scale / 255) plus
//   4u * scale plus slop of the float64 sqrt(v) (or, for a v > 0 below half a
//   step, to exactly one step); a code differs from the float64 encoding by at
//   most 1, and only where the float64 value lies within the element's and
//   the scale's slop (plus 512u) of a rounding tie.
// - master: per-tensor relative error below 1e-6, relative to the magnitudes
//   of its terms (|p|, the step m's terms would make, the step's share of v's
//   terms), as in adamw_kernel_test; the copy is the master rounded.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "adamw_reference.h"
#include "kernels/cpu/adamw.h"

namespace strata::kernels::cpu {
namespace {

constexpr double kUnitRoundoff = 0x1p-24;

uint64_t fresh_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

class SimdLevelGuard {
 public:
  ~SimdLevelGuard() { reset_simd_level(); }
};

// Sizes around the vector widths (8, 16), the int8 block (256), the range
// alignment and the threading threshold, so tails and partial blocks are covered.
const int64_t kSizes[] = {1, 7, 16, 17, 63, 255, 256, 257, 511, 1000, 4099, 40003, 131075};

const ElementType kGradTypes[] = {ElementType::f32, ElementType::bf16, ElementType::f16};

// One shard's arrays in either compact format.
struct State {
  AdamWStateType type = AdamWStateType::bf16;
  std::vector<float> master;
  std::vector<uint16_t> m16, v16;  // bf16 bits
  std::vector<int8_t> m8;          // int8 codes of m
  std::vector<uint8_t> v8;         // uint8 codes of sqrt(v)
  std::vector<float> m_scale, v_scale;
  std::vector<float> grad32;
  std::vector<uint16_t> grad16;
  std::vector<uint16_t> copy;

  int64_t size() const { return static_cast<int64_t>(master.size()); }
};

// Normal values times 10^U(low, high): several orders of magnitude in one block.
float wide(std::mt19937_64& rng, float low, float high) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> exponent(low, high);
  return normal(rng) * std::pow(10.0f, exponent(rng));
}

State random_state(AdamWStateType type, int64_t n, ElementType grad_type, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  State s;
  s.type = type;
  s.master.resize(n);
  for (auto& p : s.master) p = normal(rng);
  s.copy.assign(n, 0xdead);
  if (type == AdamWStateType::bf16) {
    s.m16.resize(n);
    s.v16.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      s.m16[i] = float_to_bf16(wide(rng, -5.0f, -1.0f));
      s.v16[i] = float_to_bf16(std::fabs(wide(rng, -9.0f, -3.0f)));
    }
  } else {
    const int64_t blocks = adamw_state_scale_count(type, n);
    std::uniform_int_distribution<int> m_code(-127, 127), v_code(0, 255);
    s.m8.resize(n);
    s.v8.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      s.m8[i] = static_cast<int8_t>(m_code(rng));
      s.v8[i] = static_cast<uint8_t>(v_code(rng));
    }
    s.m_scale.resize(blocks);
    s.v_scale.resize(blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      s.m_scale[b] = std::fabs(wide(rng, -5.0f, -1.0f));
      s.v_scale[b] = std::fabs(wide(rng, -5.0f, -2.0f));
      // As the kernel encodes a block: its largest |m| is code 127, its
      // largest sqrt(v) code 255. Otherwise (largest code 170, say) the small
      // gradients leave sqrt(v) * 255 / largest at c * 1.5 for the old codes
      // c, exact ties by construction, not the rare near ties of real states.
      const int64_t begin = b * kAdamWInt8Block, end = std::min(n, begin + kAdamWInt8Block);
      std::uniform_int_distribution<int64_t> element(begin, end - 1);
      s.m8[element(rng)] = unit(rng) < 0.5f ? -127 : 127;
      s.v8[element(rng)] = 255;
    }
  }
  // Gradients spanning seven orders of magnitude, within every block.
  if (grad_type == ElementType::f32) {
    s.grad32.resize(n);
    for (auto& g : s.grad32) g = wide(rng, -6.0f, 1.0f);
  } else {
    s.grad16.resize(n);
    for (auto& g : s.grad16) {
      const float value = wide(rng, -6.0f, 1.0f);
      g = grad_type == ElementType::bf16 ? float_to_bf16(value) : float_to_f16(value);
    }
  }
  return s;
}

void new_gradients(State& s, ElementType grad_type, std::mt19937_64& rng) {
  for (auto& g : s.grad32) g = wide(rng, -6.0f, 1.0f);
  for (auto& g : s.grad16) {
    const float value = wide(rng, -6.0f, 1.0f);
    g = grad_type == ElementType::bf16 ? float_to_bf16(value) : float_to_f16(value);
  }
}

AdamWShard shard_of(State& s, ElementType grad_type, bool with_copy, ElementType copy_type) {
  AdamWShard shard;
  shard.numel = s.size();
  shard.state_type = s.type;
  shard.master = s.master.data();
  if (s.type == AdamWStateType::bf16) {
    shard.exp_avg = s.m16.data();
    shard.exp_avg_sq = s.v16.data();
  } else {
    shard.exp_avg = s.m8.data();
    shard.exp_avg_sq = s.v8.data();
    shard.exp_avg_scale = s.m_scale.data();
    shard.exp_avg_sq_scale = s.v_scale.data();
  }
  shard.grad = grad_type == ElementType::f32 ? static_cast<const void*>(s.grad32.data())
                                             : static_cast<const void*>(s.grad16.data());
  shard.grad_type = grad_type;
  shard.copy = with_copy ? s.copy.data() : nullptr;
  shard.copy_type = copy_type;
  return shard;
}

double grad_at(const State& s, ElementType type, int64_t i) {
  if (type == ElementType::f32) return s.grad32[i];
  return type == ElementType::bf16 ? bf16_to_float(s.grad16[i]) : f16_to_float(s.grad16[i]);
}

// --- the float64 reference of the formats ---------------------------------------------

// The stored moments of element i, decoded exactly (int8: q * scale / codes).
double decoded_m(const State& s, int64_t i) {
  if (s.type == AdamWStateType::bf16) return bf16_to_float(s.m16[i]);
  return s.m8[i] * (double(s.m_scale[i / kAdamWInt8Block]) / 127.0);
}

double decoded_root(const State& s, int64_t i) {  // sqrt(v) for int8
  return s.v8[i] * (double(s.v_scale[i / kAdamWInt8Block]) / 255.0);
}

double decoded_v(const State& s, int64_t i) {
  if (s.type == AdamWStateType::bf16) return bf16_to_float(s.v16[i]);
  const double root = decoded_root(s, i);
  return root * root;
}

// New master, m, v in float64 from the decoded state, and the magnitudes of
// their terms (fp32 rounding is relative to them).
struct Reference {
  std::vector<double> master, m, v;
  std::vector<double> master_magnitude, m_magnitude, v_magnitude;

  // The magnitude sqrt(v)'s rounding is relative to: d sqrt(v) = dv / (2 sqrt(v)).
  double root_magnitude(int64_t i) const {
    return v[i] > 0.0 ? v_magnitude[i] / std::sqrt(v[i]) : 0.0;
  }
};

Reference reference_step(const State& before, ElementType grad_type, const AdamWHyperparams& h) {
  const int64_t n = before.size();
  Reference r;
  for (auto* vector :
       {&r.master, &r.m, &r.v, &r.master_magnitude, &r.m_magnitude, &r.v_magnitude}) {
    vector->resize(n);
  }
  for (int64_t i = 0; i < n; ++i) {
    const testing::AdamWReferenceElement e =
        testing::adamw_reference_element(grad_at(before, grad_type, i), before.master[i],
                                         decoded_m(before, i), decoded_v(before, i), h);
    r.master[i] = e.p - e.update;
    r.m[i] = e.m;
    r.v[i] = e.v;
    r.m_magnitude[i] = e.m_magnitude;
    r.v_magnitude[i] = e.v_magnitude;
    // The step made from m's terms (where they cancel, m's rounding is
    // relative to them, not to m; random states put m far above sqrt(v)),
    // and the step's sensitivity to v's rounding (g = grad + wd * p cancels).
    r.master_magnitude[i] = std::fabs(e.p) + (h.lr / e.bias_correction1) * e.m_magnitude / e.denom +
                            (e.v > 0.0 ? std::fabs(e.update) * e.v_magnitude / e.v : 0.0);
  }
  return r;
}

// Per-tensor relative error, relative to the norm of the terms' magnitudes.
double relative_error(const std::vector<float>& a, const std::vector<double>& b,
                      const std::vector<double>& magnitude) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += magnitude[i] * magnitude[i];
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

// A bf16 ulp at x (x normal in bf16).
double bf16_ulp(double x) {
  int exponent = 0;
  std::frexp(x, &exponent);  // |x| in [2^(exponent-1), 2^exponent)
  return std::ldexp(1.0, exponent - 8);
}

double slop(double magnitude) {
  return 16.0 * kUnitRoundoff * magnitude;
}

void expect_bf16_state_matches(const State& after, const Reference& r) {
  for (int64_t i = 0; i < after.size(); ++i) {
    const double m = bf16_to_float(after.m16[i]), v = bf16_to_float(after.v16[i]);
    const double m_bound =
        0.5 * bf16_ulp(std::max(std::fabs(m), std::fabs(r.m[i]))) + slop(r.m_magnitude[i]);
    const double v_bound = 0.5 * bf16_ulp(std::max(v, r.v[i])) + slop(r.v_magnitude[i]);
    ASSERT_LE(std::fabs(m - r.m[i]), m_bound) << "m of element " << i;
    ASSERT_LE(std::fabs(v - r.v[i]), v_bound) << "v of element " << i;
  }
}

// Ties-to-even rounding of a float64.
double round_even(double x) {
  return std::nearbyint(x);
}

void expect_int8_state_matches(const State& after, const Reference& r) {
  const int64_t n = after.size();
  for (int64_t begin = 0; begin < n; begin += kAdamWInt8Block) {
    const int64_t end = std::min(begin + kAdamWInt8Block, n);
    const int64_t block = begin / kAdamWInt8Block;
    double m_max = 0.0, root_max = 0.0, m_slop = 0.0, root_slop = 0.0;
    for (int64_t i = begin; i < end; ++i) {
      m_max = std::max(m_max, std::fabs(r.m[i]));
      root_max = std::max(root_max, std::sqrt(r.v[i]));
      m_slop = std::max(m_slop, slop(r.m_magnitude[i]));
      root_slop = std::max(root_slop, slop(r.root_magnitude(i)));
    }
    const double m_scale = after.m_scale[block], root_scale = after.v_scale[block];
    ASSERT_LE(std::fabs(m_scale - m_max), m_slop) << "m scale of block " << block;
    ASSERT_LE(std::fabs(root_scale - root_max), root_slop) << "v scale of block " << block;
    const double m_step = m_scale / 127.0, root_step = root_scale / 255.0;
    for (int64_t i = begin; i < end; ++i) {
      SCOPED_TRACE(::testing::Message() << "element " << i << " of block " << block);
      // Decoded within half a step of the float64 value.
      const double m_tolerance = 4.0 * kUnitRoundoff * m_scale + slop(r.m_magnitude[i]);
      if (m_scale >= 0x1p-100) {
        ASSERT_LE(std::fabs(decoded_m(after, i) - r.m[i]), 0.5 * m_step + m_tolerance);
      } else {
        ASSERT_EQ(after.m8[i], 0);
      }
      const double root = std::sqrt(r.v[i]);
      const double root_tolerance = 4.0 * kUnitRoundoff * root_scale + slop(r.root_magnitude(i));
      const double root_decoded = decoded_root(after, i);
      if (after.v8[i] == 1 && root <= 0.5 * root_step + root_tolerance) {
        ASSERT_GT(r.v[i], 0.0);  // raised from code 0: only a v > 0 is
      } else {
        ASSERT_LE(std::fabs(root_decoded - root), 0.5 * root_step + root_tolerance);
      }
      if (r.v[i] > 0.0) {
        ASSERT_NE(after.v8[i], 0) << "a v > 0 stored as code 0";
      }
      // Codes: the float64 encoding, except next to a tie.
      // A block whose largest |m| is below 2^-100 is stored as codes 0.
      const double m_exact = m_scale >= 0x1p-100 ? r.m[i] * 127.0 / m_max : 0.0;
      const double m_code = std::clamp(round_even(m_exact), -127.0, 127.0);
      if (after.m8[i] != m_code) {
        ASSERT_EQ(std::fabs(after.m8[i] - m_code), 1.0);
        const double tie_distance = std::fabs(std::fabs(m_exact - std::trunc(m_exact)) - 0.5);
        ASSERT_LE(tie_distance, (slop(r.m_magnitude[i]) + m_slop) / m_step + 512 * kUnitRoundoff);
      }
      const double root_exact = root_max > 0.0 ? root * 255.0 / root_max : 0.0;
      double root_code = std::clamp(round_even(root_exact), 0.0, 255.0);
      if (root > 0.0 && root_code == 0.0) root_code = 1.0;
      if (after.v8[i] != root_code) {
        ASSERT_EQ(std::fabs(after.v8[i] - root_code), 1.0);
        const double tie_distance = std::fabs(std::fabs(root_exact - std::trunc(root_exact)) - 0.5);
        ASSERT_LE(tie_distance,
                  (slop(r.root_magnitude(i)) + root_slop) / root_step + 512 * kUnitRoundoff);
      }
    }
  }
  // No count of the differing codes is asserted: each is one off and next
  // to a tie (above), and how many codes lie that near a tie depends on the
  // data. bf16 gradients put many exactly on one: where they set sqrt(v),
  // 255 * sqrt(v) / largest is 255 times a ratio of 8-bit mantissas, often
  // a half-integer.
}

AdamWHyperparams random_hyper(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  AdamWHyperparams h;
  h.lr = 1e-4 + 1e-3 * unit(rng);
  h.beta1 = 0.85 + 0.1 * unit(rng);
  h.beta2 = 0.99 + 0.0099 * unit(rng);
  h.eps = 1e-8;
  h.weight_decay = 0.1 * unit(rng);
  h.step = 1 + static_cast<int64_t>(unit(rng) * 1000);
  h.grad_scale = 0.25 + unit(rng);
  return h;
}

const AdamWStateType kCompactTypes[] = {AdamWStateType::bf16, AdamWStateType::int8};

void check_one_step(State& s, ElementType grad_type, const AdamWHyperparams& h) {
  const Reference r = reference_step(s, grad_type, h);
  ASSERT_TRUE(adamw_step(shard_of(s, grad_type, true, ElementType::bf16), h));
  EXPECT_LT(relative_error(s.master, r.master, r.master_magnitude), 1e-6);
  if (s.type == AdamWStateType::bf16) {
    expect_bf16_state_matches(s, r);
  } else {
    expect_int8_state_matches(s, r);
  }
  for (int64_t i = 0; i < s.size(); ++i) {
    ASSERT_EQ(s.copy[i], float_to_bf16(s.master[i])) << "copy of element " << i;
  }
}

TEST(AdamWCompact, MatchesFloat64ReferenceOfTheSameFormat) {
  std::mt19937_64 rng(fresh_seed());
  std::printf("seed %llu, SIMD level %s\n", static_cast<unsigned long long>(fresh_seed()),
              std::string(simd_level_name(active_simd_level())).c_str());
  for (AdamWStateType type : kCompactTypes) {
    for (ElementType grad_type : kGradTypes) {
      for (bool decoupled : {true, false}) {
        for (int64_t n : kSizes) {
          SCOPED_TRACE(::testing::Message()
                       << adamw_state_type_name(type) << " grad " << element_type_name(grad_type)
                       << " n " << n << " decoupled " << decoupled);
          State s = random_state(type, n, grad_type, rng);
          AdamWHyperparams h = random_hyper(rng);
          h.decoupled_weight_decay = decoupled;
          h.bias_correction = n % 2 == 1;
          check_one_step(s, grad_type, h);
        }
      }
    }
  }
}

// Steps in a row on one state, each checked from the state the kernel left.
TEST(AdamWCompact, SeveralStepsInARowStayWithinTheBounds) {
  std::mt19937_64 rng(fresh_seed() + 1);
  for (AdamWStateType type : kCompactTypes) {
    SCOPED_TRACE(adamw_state_type_name(type));
    State s = random_state(type, 50001, ElementType::bf16, rng);
    AdamWHyperparams h = random_hyper(rng);
    for (int step = 1; step <= 6; ++step) {
      SCOPED_TRACE(::testing::Message() << "step " << step);
      h.step = step;
      check_one_step(s, ElementType::bf16, h);
      new_gradients(s, ElementType::bf16, rng);
    }
  }
}

// From the zero state (step 1), the first update reads m = v = 0 in every
// format, so the master and copy are bitwise those of fp32 moments.
TEST(AdamWCompact, FirstStepFromZeroStateEqualsFp32Moments) {
  std::mt19937_64 rng(fresh_seed() + 2);
  const int64_t n = 70001;
  for (AdamWStateType type : kCompactTypes) {
    SCOPED_TRACE(adamw_state_type_name(type));
    State s = random_state(type, n, ElementType::f32, rng);
    AdamWShard shard = shard_of(s, ElementType::f32, true, ElementType::bf16);
    first_touch_zero(shard);
    std::vector<float> master = s.master, m(n, 0.0f), v(n, 0.0f);
    std::vector<uint16_t> copy(n);
    AdamWShard fp32;
    fp32.numel = n;
    fp32.master = master.data();
    fp32.exp_avg = m.data();
    fp32.exp_avg_sq = v.data();
    fp32.grad = s.grad32.data();
    fp32.copy = copy.data();
    AdamWHyperparams h = random_hyper(rng);
    h.step = 1;
    ASSERT_TRUE(adamw_step(fp32, h));
    ASSERT_TRUE(adamw_step(shard, h));
    ASSERT_EQ(std::memcmp(master.data(), s.master.data(), n * sizeof(float)), 0);
    ASSERT_EQ(copy, s.copy);
  }
}

// Inside one block: gradients from 1e-9 to 1 make most second moments fall
// below half a code step of the block's largest; none may read back as 0.
TEST(AdamWCompact, Int8SecondMomentIsNeverReadBackAsZero) {
  std::mt19937_64 rng(fresh_seed() + 3);
  State s = random_state(AdamWStateType::int8, 4096, ElementType::f32, rng);
  for (auto& g : s.grad32) g = wide(rng, -9.0f, 0.0f);
  AdamWShard shard = shard_of(s, ElementType::f32, false, ElementType::bf16);
  first_touch_zero(shard);
  AdamWHyperparams h = random_hyper(rng);
  h.step = 1;
  const Reference r = reference_step(s, ElementType::f32, h);
  ASSERT_TRUE(adamw_step(shard, h));
  expect_int8_state_matches(s, r);
  int64_t ones = 0;
  for (int64_t i = 0; i < s.size(); ++i) {
    ASSERT_GT(s.v8[i], 0) << "element " << i;
    ones += s.v8[i] == 1;
  }
  EXPECT_GT(ones, s.size() / 4);  // the rule was exercised
}

// A block of gradients near 1e-33 makes m below 2^-100 (where 127 / max |m|
// would overflow fp32): its codes are 0, and v's too (fp32 v = 1e-3 g^2
// underflows to 0, so that block is outside the bounds above, which ignore
// underflow).
TEST(AdamWCompact, Int8BlockOfNegligibleMomentsReadsBackAsZero) {
  std::mt19937_64 rng(fresh_seed() + 4);
  State s = random_state(AdamWStateType::int8, 1000, ElementType::f32, rng);
  for (int64_t i = 256; i < 512; ++i) s.grad32[i] = wide(rng, -34.0f, -32.0f);
  AdamWShard shard = shard_of(s, ElementType::f32, false, ElementType::bf16);
  first_touch_zero(shard);
  AdamWHyperparams h = random_hyper(rng);
  h.step = 1;
  const Reference r = reference_step(s, ElementType::f32, h);
  ASSERT_TRUE(adamw_step(shard, h));
  EXPECT_GT(s.m_scale[1], 0.0f);
  EXPECT_LT(s.m_scale[1], 0x1p-100f);
  EXPECT_EQ(s.v_scale[1], 0.0f);
  for (int64_t i = 256; i < 512; ++i) {
    ASSERT_EQ(s.m8[i], 0) << "element " << i;
    ASSERT_EQ(s.v8[i], 0) << "element " << i;
  }
  EXPECT_GT(s.m_scale[0], 0x1p-100f);  // the blocks around it are ordinary
  EXPECT_GT(s.m_scale[2], 0x1p-100f);
  EXPECT_LT(relative_error(s.master, r.master, r.master_magnitude), 1e-6);
}

// --- SIMD paths against the scalar path ----------------------------------------------

State step_at_level(const State& s, SimdLevel level, ElementType grad_type, bool with_copy,
                    ElementType copy_type, const AdamWHyperparams& h) {
  State out = s;
  EXPECT_TRUE(force_simd_level(level));
  EXPECT_TRUE(adamw_step(shard_of(out, grad_type, with_copy, copy_type), h));
  return out;
}

void expect_bitwise_equal(const State& a, const State& b) {
  ASSERT_EQ(std::memcmp(a.master.data(), b.master.data(), a.master.size() * 4), 0);
  ASSERT_EQ(a.m16, b.m16);
  ASSERT_EQ(a.v16, b.v16);
  ASSERT_EQ(a.m8, b.m8);
  ASSERT_EQ(a.v8, b.v8);
  ASSERT_EQ(std::memcmp(a.m_scale.data(), b.m_scale.data(), a.m_scale.size() * 4), 0);
  ASSERT_EQ(std::memcmp(a.v_scale.data(), b.v_scale.data(), a.v_scale.size() * 4), 0);
  ASSERT_EQ(a.copy, b.copy);
}

void check_level_matches_scalar(SimdLevel level) {
  SimdLevelGuard guard;
  std::mt19937_64 rng(fresh_seed() + 10 + static_cast<int>(level));
  for (AdamWStateType type : kCompactTypes) {
    for (ElementType grad_type : kGradTypes) {
      for (int copy = 0; copy < 3; ++copy) {
        const bool with_copy = copy > 0;
        const ElementType copy_type = copy == 2 ? ElementType::f16 : ElementType::bf16;
        for (int64_t n : kSizes) {
          SCOPED_TRACE(::testing::Message()
                       << adamw_state_type_name(type) << " grad " << element_type_name(grad_type)
                       << " copy " << copy << " n " << n);
          const State s = random_state(type, n, grad_type, rng);
          AdamWHyperparams h = random_hyper(rng);
          h.decoupled_weight_decay = n % 3 != 0;
          const State scalar =
              step_at_level(s, SimdLevel::scalar, grad_type, with_copy, copy_type, h);
          const State vector = step_at_level(s, level, grad_type, with_copy, copy_type, h);
          expect_bitwise_equal(scalar, vector);
        }
      }
    }
  }
}

// Shards at every offset from an aligned allocation: the vector paths stream
// the copy only where it is aligned and must agree with the scalar path.
void check_unaligned_shards_match_scalar(SimdLevel level) {
  SimdLevelGuard guard;
  std::mt19937_64 rng(fresh_seed() + 20 + static_cast<int>(level));
  for (AdamWStateType type : kCompactTypes) {
    for (int64_t offset = 1; offset < 20; offset += 3) {
      for (int64_t n : {int64_t{300}, int64_t{40003}}) {
        const State base = random_state(type, n + offset, ElementType::bf16, rng);
        const AdamWHyperparams h = random_hyper(rng);
        State results[2] = {base, base};
        const SimdLevel levels[2] = {SimdLevel::scalar, level};
        for (int k = 0; k < 2; ++k) {
          ASSERT_TRUE(force_simd_level(levels[k]));
          State& s = results[k];
          AdamWShard shard = shard_of(s, ElementType::bf16, true, ElementType::bf16);
          shard.numel = n;
          shard.master += offset;
          shard.grad = s.grad16.data() + offset;
          shard.copy = s.copy.data() + offset;
          if (type == AdamWStateType::bf16) {
            shard.exp_avg = s.m16.data() + offset;
            shard.exp_avg_sq = s.v16.data() + offset;
          } else {
            shard.exp_avg = s.m8.data() + offset;
            shard.exp_avg_sq = s.v8.data() + offset;
          }
          ASSERT_TRUE(adamw_step(shard, h));
        }
        SCOPED_TRACE(::testing::Message()
                     << adamw_state_type_name(type) << " offset " << offset << " n " << n);
        expect_bitwise_equal(results[0], results[1]);
      }
    }
  }
}

// Inf and NaN gradients: every path writes the same bits, and an int8 block
// holding a NaN reads back as NaN (its scale is NaN).
void check_nonfinite_gradients_match_scalar(SimdLevel level) {
  SimdLevelGuard guard;
  std::mt19937_64 rng(fresh_seed() + 40 + static_cast<int>(level));
  for (AdamWStateType type : kCompactTypes) {
    for (ElementType grad_type : kGradTypes) {
      State s = random_state(type, 1003, grad_type, rng);
      for (int64_t i = 0; i < 1003; i += 97) {
        const float bad = i % 2 ? INFINITY : NAN;
        if (grad_type == ElementType::f32) {
          s.grad32[i] = bad;
        } else {
          s.grad16[i] = grad_type == ElementType::bf16 ? float_to_bf16(bad) : float_to_f16(bad);
        }
      }
      const AdamWHyperparams h = random_hyper(rng);
      const State scalar =
          step_at_level(s, SimdLevel::scalar, grad_type, true, ElementType::bf16, h);
      const State vector = step_at_level(s, level, grad_type, true, ElementType::bf16, h);
      SCOPED_TRACE(::testing::Message()
                   << adamw_state_type_name(type) << " grad " << element_type_name(grad_type));
      expect_bitwise_equal(scalar, vector);
      EXPECT_TRUE(std::isnan(scalar.master[0]));
      if (type == AdamWStateType::int8) {
        EXPECT_TRUE(std::isnan(scalar.m_scale[0]));  // element 0's gradient is NaN
        EXPECT_TRUE(std::isnan(decoded_m(scalar, 1)));
      }
    }
  }
}

TEST(AdamWCompact, Avx2PathEqualsScalarPathBitwise) {
  if (cpu_simd_level() < SimdLevel::avx2) GTEST_SKIP() << "this CPU has no AVX2 + F16C";
  check_level_matches_scalar(SimdLevel::avx2);
  check_unaligned_shards_match_scalar(SimdLevel::avx2);
  check_nonfinite_gradients_match_scalar(SimdLevel::avx2);
}

TEST(AdamWCompact, Avx512PathEqualsScalarPathBitwise) {
  if (cpu_simd_level() < SimdLevel::avx512) GTEST_SKIP() << "this CPU has no AVX-512";
  check_level_matches_scalar(SimdLevel::avx512);
  check_unaligned_shards_match_scalar(SimdLevel::avx512);
  check_nonfinite_gradients_match_scalar(SimdLevel::avx512);
}

TEST(AdamWCompact, ResultDoesNotDependOnThreadCount) {
  std::mt19937_64 rng(fresh_seed() + 7);
  for (AdamWStateType type : kCompactTypes) {
    const State s = random_state(type, 300007, ElementType::bf16, rng);
    const AdamWHyperparams h = random_hyper(rng);
    std::vector<State> results;
    for (int threads : {1, 2, 3}) {
      tbb::task_arena arena(threads);
      State out = s;
      arena.execute([&] {
        ASSERT_TRUE(adamw_step(shard_of(out, ElementType::bf16, true, ElementType::bf16), h));
      });
      results.push_back(std::move(out));
    }
    SCOPED_TRACE(adamw_state_type_name(type));
    expect_bitwise_equal(results[0], results[1]);
    expect_bitwise_equal(results[0], results[2]);
  }
}

// fp32 moments, by default or named, are the fp32 kernel.
// A shard that names no state type is an fp32 one: the same bits as one that says so.
TEST(AdamWCompact, AShardWithoutAStateTypeIsFp32) {
  EXPECT_EQ(AdamWShard{}.state_type, AdamWStateType::f32);
  std::mt19937_64 rng(fresh_seed() + 8);
  const int64_t n = 40003;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> master(n), m(n), v(n), grad(n);
  for (int64_t i = 0; i < n; ++i) {
    master[i] = normal(rng);
    m[i] = 1e-2f * normal(rng);
    v[i] = 1e-4f * std::fabs(normal(rng));
    grad[i] = wide(rng, -6.0f, 1.0f);
  }
  std::vector<float> master2 = master, m2 = m, v2 = v;
  std::vector<uint16_t> copy(n), copy2(n);
  const AdamWHyperparams h = random_hyper(rng);
  AdamWShard defaults;  // state_type f32 by default
  defaults.numel = n;
  defaults.master = master.data();
  defaults.exp_avg = m.data();
  defaults.exp_avg_sq = v.data();
  defaults.grad = grad.data();
  defaults.copy = copy.data();
  ASSERT_TRUE(adamw_step(defaults, h));
  AdamWShard shard;
  shard.numel = n;
  shard.state_type = AdamWStateType::f32;
  shard.master = master2.data();
  shard.exp_avg = m2.data();
  shard.exp_avg_sq = v2.data();
  shard.grad = grad.data();
  shard.copy = copy2.data();
  ASSERT_TRUE(adamw_step(shard, h));
  EXPECT_EQ(std::memcmp(master.data(), master2.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(m.data(), m2.data(), n * 4), 0);
  EXPECT_EQ(std::memcmp(v.data(), v2.data(), n * 4), 0);
  EXPECT_EQ(copy, copy2);
}

TEST(AdamWCompact, RejectsMissingOrUnexpectedScalesWithoutTouchingState) {
  std::mt19937_64 rng(fresh_seed() + 9);
  State s = random_state(AdamWStateType::int8, 1000, ElementType::f32, rng);
  const State before = s;
  AdamWHyperparams h;
  AdamWShard shard = shard_of(s, ElementType::f32, false, ElementType::bf16);
  shard.exp_avg_sq_scale = nullptr;
  Status status = adamw_step(shard, h);
  EXPECT_FALSE(status);
  EXPECT_NE(status.message().find("scale"), std::string::npos) << status.message();
  shard.exp_avg_sq_scale = s.v_scale.data();
  shard.state_type = AdamWStateType::bf16;
  status = adamw_step(shard, h);
  EXPECT_FALSE(status);
  EXPECT_NE(status.message().find("only int8"), std::string::npos) << status.message();
  shard.state_type = AdamWStateType::int8;
  h.beta1 = 1.0;
  EXPECT_FALSE(adamw_step(shard, h));
  expect_bitwise_equal(s, before);
}

TEST(AdamWCompact, SizesOfTheFormats) {
  EXPECT_EQ(adamw_state_scale_count(AdamWStateType::int8, 1), 1);
  EXPECT_EQ(adamw_state_scale_count(AdamWStateType::int8, 256), 1);
  EXPECT_EQ(adamw_state_scale_count(AdamWStateType::int8, 257), 2);
  EXPECT_EQ(adamw_state_scale_count(AdamWStateType::bf16, 257), 0);
  EXPECT_EQ(adamw_state_bytes(AdamWStateType::f32, 1000), 8000);
  EXPECT_EQ(adamw_state_bytes(AdamWStateType::bf16, 1000), 4000);
  EXPECT_EQ(adamw_state_bytes(AdamWStateType::int8, 1000), 2000 + 4 * 8);
}

TEST(AdamWCompact, FirstTouchZeroClearsMomentsAndScales) {
  std::mt19937_64 rng(fresh_seed() + 11);
  for (AdamWStateType type : kCompactTypes) {
    State s = random_state(type, 200003, ElementType::f32, rng);
    const std::vector<float> master = s.master;
    first_touch_zero(shard_of(s, ElementType::f32, false, ElementType::bf16));
    for (int64_t i = 0; i < s.size(); ++i) {
      ASSERT_EQ(decoded_m(s, i), 0.0);
      ASSERT_EQ(decoded_v(s, i), 0.0);
    }
    for (float scale : s.m_scale) ASSERT_EQ(scale, 0.0f);
    for (float scale : s.v_scale) ASSERT_EQ(scale, 0.0f);
    EXPECT_EQ(master, s.master);
  }
}

}  // namespace
}  // namespace strata::kernels::cpu
