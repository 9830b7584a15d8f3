// The fused CPU AdamW step (kernels/cpu/adamw.h) against a float64 scalar
// reference, and every SIMD path against the scalar path, bit for bit.
#include <gtest/gtest.h>
#include <tbb/task_arena.h>

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

uint64_t fresh_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

class SimdLevelGuard {
 public:
  ~SimdLevelGuard() { reset_simd_level(); }
};

// Sizes around the vector widths (8, 16), the range alignment (64) and the
// threading threshold, so tails and uneven ranges are covered.
const int64_t kSizes[] = {1, 7, 8, 15, 16, 17, 63, 65, 1000, 4099, 40003, 131075};

struct State {
  std::vector<float> master, exp_avg, exp_avg_sq;
  std::vector<uint16_t> grad16;
  std::vector<float> grad32;
  std::vector<uint16_t> copy;
};

State random_state(int64_t n, ElementType grad_type, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  State s;
  s.master.resize(n);
  s.exp_avg.resize(n);
  s.exp_avg_sq.resize(n);
  s.copy.assign(n, 0xdead);
  for (int64_t i = 0; i < n; ++i) {
    s.master[i] = normal(rng);
    s.exp_avg[i] = 1e-2f * normal(rng);
    s.exp_avg_sq[i] = 1e-4f * unit(rng) + 1e-7f;
  }
  // Gradients spanning several orders of magnitude (and a loss scale's worth).
  std::uniform_real_distribution<float> exponent(-6.0f, 1.0f);
  if (grad_type == ElementType::f32) {
    s.grad32.resize(n);
    for (auto& g : s.grad32) g = normal(rng) * std::pow(10.0f, exponent(rng));
  } else {
    s.grad16.resize(n);
    for (auto& g : s.grad16) {
      const float value = normal(rng) * std::pow(10.0f, exponent(rng));
      g = grad_type == ElementType::bf16 ? float_to_bf16(value) : float_to_f16(value);
    }
  }
  return s;
}

AdamWShard shard_of(State& s, ElementType grad_type, bool with_copy, ElementType copy_type) {
  AdamWShard shard;
  shard.numel = static_cast<int64_t>(s.master.size());
  shard.master = s.master.data();
  shard.exp_avg = s.exp_avg.data();
  shard.exp_avg_sq = s.exp_avg_sq.data();
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

// torch.optim.AdamW (or Adam with L2) in float64. The *_magnitude vectors
// hold, per element, the sum of the absolute values of the terms that make
// the result: fp32 rounding is relative to them, and they exceed the result
// itself only where the terms cancel.
struct Reference {
  std::vector<double> master, m, v;
  std::vector<double> master_magnitude, m_magnitude, v_magnitude;
};

Reference reference_step(const State& before, ElementType grad_type, const AdamWHyperparams& h) {
  const int64_t n = static_cast<int64_t>(before.master.size());
  Reference r;
  for (auto* vector :
       {&r.master, &r.m, &r.v, &r.master_magnitude, &r.m_magnitude, &r.v_magnitude}) {
    vector->resize(n);
  }
  for (int64_t i = 0; i < n; ++i) {
    const testing::AdamWReferenceElement e =
        testing::adamw_reference_element(grad_at(before, grad_type, i), before.master[i],
                                         before.exp_avg[i], before.exp_avg_sq[i], h);
    r.master[i] = e.p - e.update;
    r.m[i] = e.m;
    r.v[i] = e.v;
    r.m_magnitude[i] = e.m_magnitude;
    r.v_magnitude[i] = e.v_magnitude;
    r.master_magnitude[i] = std::fabs(e.p) + std::fabs(e.update);
  }
  return r;
}

// Per-tensor relative error |a - b| / |b| (tests/README.md); with
// `magnitude`, relative to the norm of the terms that made b instead.
double relative_error(const std::vector<float>& a, const std::vector<double>& b,
                      const std::vector<double>* magnitude = nullptr) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    const double scale = magnitude ? (*magnitude)[i] : b[i];
    norm += scale * scale;
  }
  return std::sqrt(diff) / std::sqrt(norm);
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

const ElementType kGradTypes[] = {ElementType::f32, ElementType::bf16, ElementType::f16};

TEST(AdamWKernel, MatchesFloat64ReferenceForEveryGradTypeAndSize) {
  std::mt19937_64 rng(fresh_seed());
  std::printf("seed %llu, SIMD level %s\n", static_cast<unsigned long long>(fresh_seed()),
              std::string(simd_level_name(active_simd_level())).c_str());
  for (ElementType grad_type : kGradTypes) {
    for (bool decoupled : {true, false}) {
      for (int64_t n : kSizes) {
        State s = random_state(n, grad_type, rng);
        AdamWHyperparams h = random_hyper(rng);
        h.decoupled_weight_decay = decoupled;
        h.bias_correction = n % 2 == 1;
        const Reference r = reference_step(s, grad_type, h);
        ASSERT_TRUE(adamw_step(shard_of(s, grad_type, true, ElementType::bf16), h));
        SCOPED_TRACE(::testing::Message() << "grad " << element_type_name(grad_type) << " n " << n
                                          << " decoupled " << decoupled);
        // Relative to the terms' magnitudes: one-element shards can cancel.
        EXPECT_LT(relative_error(s.master, r.master, &r.master_magnitude), 1e-6);
        EXPECT_LT(relative_error(s.exp_avg, r.m, &r.m_magnitude), 1e-6);
        EXPECT_LT(relative_error(s.exp_avg_sq, r.v, &r.v_magnitude), 1e-6);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(s.copy[i], float_to_bf16(s.master[i])) << "element " << i;
        }
      }
    }
  }
}

TEST(AdamWKernel, SeveralStepsStayWithinToleranceOfFloat64) {
  std::mt19937_64 rng(fresh_seed() + 1);
  const int64_t n = 50001;
  State s = random_state(n, ElementType::f32, rng);
  AdamWHyperparams h = random_hyper(rng);
  h.step = 1;
  std::vector<double> master(s.master.begin(), s.master.end());
  std::vector<double> m(s.exp_avg.begin(), s.exp_avg.end());
  std::vector<double> v(s.exp_avg_sq.begin(), s.exp_avg_sq.end());
  for (int step = 1; step <= 5; ++step) {
    h.step = step;
    // The float64 reference carries its own state from step to step.
    const double bc1 = 1.0 - std::pow(h.beta1, step), bc2 = 1.0 - std::pow(h.beta2, step);
    for (int64_t i = 0; i < n; ++i) {
      const double g = double(s.grad32[i]) * h.grad_scale;
      master[i] *= 1.0 - h.lr * h.weight_decay;
      m[i] = h.beta1 * m[i] + (1.0 - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1.0 - h.beta2) * g * g;
      master[i] -= (h.lr / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + h.eps);
    }
    ASSERT_TRUE(adamw_step(shard_of(s, ElementType::f32, false, ElementType::bf16), h));
  }
  EXPECT_LT(relative_error(s.master, master), 1e-6);
  EXPECT_LT(relative_error(s.exp_avg, m), 1e-6);
  EXPECT_LT(relative_error(s.exp_avg_sq, v), 1e-6);
}

// Runs one step on a copy of `s` at `level` and returns the resulting state.
State step_at_level(const State& s, SimdLevel level, ElementType grad_type, bool with_copy,
                    ElementType copy_type, const AdamWHyperparams& h) {
  State out = s;
  EXPECT_TRUE(force_simd_level(level));
  EXPECT_TRUE(adamw_step(shard_of(out, grad_type, with_copy, copy_type), h));
  return out;
}

void expect_bitwise_equal(const State& a, const State& b) {
  ASSERT_EQ(std::memcmp(a.master.data(), b.master.data(), a.master.size() * 4), 0);
  ASSERT_EQ(std::memcmp(a.exp_avg.data(), b.exp_avg.data(), a.exp_avg.size() * 4), 0);
  ASSERT_EQ(std::memcmp(a.exp_avg_sq.data(), b.exp_avg_sq.data(), a.exp_avg_sq.size() * 4), 0);
  ASSERT_EQ(a.copy, b.copy);
}

void check_level_matches_scalar(SimdLevel level) {
  SimdLevelGuard guard;
  std::mt19937_64 rng(fresh_seed() + 2 + static_cast<int>(level));
  for (ElementType grad_type : kGradTypes) {
    for (int copy = 0; copy < 3; ++copy) {
      const bool with_copy = copy > 0;
      const ElementType copy_type = copy == 2 ? ElementType::f16 : ElementType::bf16;
      for (int64_t n : kSizes) {
        const State s = random_state(n, grad_type, rng);
        AdamWHyperparams h = random_hyper(rng);
        h.decoupled_weight_decay = n % 3 != 0;
        SCOPED_TRACE(::testing::Message()
                     << "grad " << element_type_name(grad_type) << " copy " << copy << " n " << n);
        const State scalar =
            step_at_level(s, SimdLevel::scalar, grad_type, with_copy, copy_type, h);
        const State vector = step_at_level(s, level, grad_type, with_copy, copy_type, h);
        expect_bitwise_equal(scalar, vector);
      }
    }
  }
}

// Sub-shards at every offset: the vector paths peel elements until the copy is
// aligned for non-temporal stores, and must still agree with the scalar path.
void check_unaligned_shards_match_scalar(SimdLevel level) {
  SimdLevelGuard guard;
  std::mt19937_64 rng(fresh_seed() + 20 + static_cast<int>(level));
  for (int64_t offset = 1; offset < 20; offset += 3) {
    for (int64_t n : {int64_t{40}, int64_t{40003}}) {
      const State s = random_state(n + offset, ElementType::bf16, rng);
      const AdamWHyperparams h = random_hyper(rng);
      State results[2] = {s, s};
      const SimdLevel levels[2] = {SimdLevel::scalar, level};
      for (int k = 0; k < 2; ++k) {
        ASSERT_TRUE(force_simd_level(levels[k]));
        AdamWShard shard = shard_of(results[k], ElementType::bf16, true, ElementType::bf16);
        shard.numel = n;
        shard.master += offset;
        shard.exp_avg = results[k].exp_avg.data() + offset;
        shard.exp_avg_sq = results[k].exp_avg_sq.data() + offset;
        shard.grad = results[k].grad16.data() + offset;
        shard.copy = results[k].copy.data() + offset;
        ASSERT_TRUE(adamw_step(shard, h));
      }
      SCOPED_TRACE(::testing::Message() << "offset " << offset << " n " << n);
      expect_bitwise_equal(results[0], results[1]);
    }
  }
}

// Inf and NaN gradients (an fp16 overflow that was not skipped) make NaN
// weights; every path must write the same NaN bits and the same copies.
void check_nonfinite_gradients_match_scalar(SimdLevel level) {
  SimdLevelGuard guard;
  std::mt19937_64 rng(fresh_seed() + 40 + static_cast<int>(level));
  for (ElementType grad_type : kGradTypes) {
    for (int copy = 1; copy < 3; ++copy) {
      const ElementType copy_type = copy == 2 ? ElementType::f16 : ElementType::bf16;
      State s = random_state(1003, grad_type, rng);
      for (int64_t i = 0; i < 1003; i += 97) {
        const float bad = i % 2 ? INFINITY : NAN;
        if (grad_type == ElementType::f32) {
          s.grad32[i] = bad;
        } else {
          s.grad16[i] = grad_type == ElementType::bf16 ? float_to_bf16(bad) : float_to_f16(bad);
        }
      }
      const AdamWHyperparams h = random_hyper(rng);
      const State scalar = step_at_level(s, SimdLevel::scalar, grad_type, true, copy_type, h);
      const State vector = step_at_level(s, level, grad_type, true, copy_type, h);
      SCOPED_TRACE(::testing::Message() << "grad " << element_type_name(grad_type) << " copy "
                                        << element_type_name(copy_type));
      expect_bitwise_equal(scalar, vector);
      EXPECT_TRUE(std::isnan(scalar.master[0]));
    }
  }
}

TEST(AdamWKernel, Avx2PathEqualsScalarPathBitwise) {
  if (cpu_simd_level() < SimdLevel::avx2) GTEST_SKIP() << "this CPU has no AVX2 + F16C";
  check_level_matches_scalar(SimdLevel::avx2);
  check_unaligned_shards_match_scalar(SimdLevel::avx2);
  check_nonfinite_gradients_match_scalar(SimdLevel::avx2);
}

TEST(AdamWKernel, Avx512PathEqualsScalarPathBitwise) {
  if (cpu_simd_level() < SimdLevel::avx512) GTEST_SKIP() << "this CPU has no AVX-512";
  check_level_matches_scalar(SimdLevel::avx512);
  check_unaligned_shards_match_scalar(SimdLevel::avx512);
  check_nonfinite_gradients_match_scalar(SimdLevel::avx512);
}

TEST(AdamWKernel, ResultDoesNotDependOnThreadCount) {
  std::mt19937_64 rng(fresh_seed() + 7);
  const State s = random_state(300007, ElementType::bf16, rng);
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
  expect_bitwise_equal(results[0], results[1]);
  expect_bitwise_equal(results[0], results[2]);
}

TEST(AdamWKernel, Fp16CopyIsRoundToNearestEvenOfMaster) {
  std::mt19937_64 rng(fresh_seed() + 8);
  State s = random_state(10007, ElementType::f16, rng);
  ASSERT_TRUE(adamw_step(shard_of(s, ElementType::f16, true, ElementType::f16), random_hyper(rng)));
  for (size_t i = 0; i < s.master.size(); ++i) ASSERT_EQ(s.copy[i], float_to_f16(s.master[i]));
}

TEST(AdamWKernel, RejectsInvalidArgumentsWithoutTouchingState) {
  std::mt19937_64 rng(fresh_seed() + 9);
  State s = random_state(100, ElementType::f32, rng);
  const State before = s;
  AdamWHyperparams h;
  AdamWShard shard = shard_of(s, ElementType::f32, true, ElementType::f32);
  Status status = adamw_step(shard, h);
  EXPECT_FALSE(status);
  EXPECT_NE(status.message().find("bf16 or fp16"), std::string::npos) << status.message();
  shard.copy = nullptr;
  h.step = 0;
  EXPECT_FALSE(adamw_step(shard, h));
  h.step = 1;
  h.beta2 = 1.0;
  EXPECT_FALSE(adamw_step(shard, h));
  h.beta2 = 0.999;
  shard.exp_avg = nullptr;
  EXPECT_FALSE(adamw_step(shard, h));
  shard.exp_avg = s.exp_avg.data();
  shard.numel = -1;
  EXPECT_FALSE(adamw_step(shard, h));
  expect_bitwise_equal(s, before);
}

TEST(AdamWKernel, FirstTouchZeroClearsEveryElement) {
  std::vector<float> data(200003, 1.5f);
  first_touch_zero(data.data(), static_cast<int64_t>(data.size()));
  for (float x : data) ASSERT_EQ(x, 0.0f);
}

}  // namespace
}  // namespace strata::kernels::cpu
