// The optimizer driver (core/optimizer/optimizer.h): parameter groups, skipped fp16
// steps, clipping by global norm, the schedule's step-by-step rates and state
// restore, checked against direct calls of the AdamW kernel.
#include "core/optimizer/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace strata {
namespace {

using kernels::cpu::ElementType;
using kernels::cpu::GradNormPartial;

uint64_t fresh_seed() {
  static const uint64_t seed = std::random_device{}();
  return seed;
}

struct Buffers {
  std::vector<float> master, m, v, grad;
  std::vector<uint16_t> copy;
  explicit Buffers(int64_t n, std::mt19937_64& rng) : master(n), m(n), v(n), grad(n), copy(n) {
    std::normal_distribution<float> normal;
    for (int64_t i = 0; i < n; ++i) {
      master[i] = normal(rng);
      m[i] = 0.01f * normal(rng);
      v[i] = 1e-4f * std::fabs(normal(rng)) + 1e-8f;
      grad[i] = 0.1f * normal(rng);
    }
  }
  kernels::cpu::AdamWShard shard() {
    kernels::cpu::AdamWShard s;
    s.numel = static_cast<int64_t>(master.size());
    s.master = master.data();
    s.exp_avg = m.data();
    s.exp_avg_sq = v.data();
    s.grad = grad.data();
    s.grad_type = ElementType::f32;
    s.copy = copy.data();
    s.copy_type = ElementType::bf16;
    return s;
  }
  GradNormPartial norm() const {
    return *kernels::cpu::grad_norm_squared(grad.data(), ElementType::f32,
                                            static_cast<int64_t>(grad.size()));
  }
};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

Optimizer make(const OptimizerOptions& options) {
  Result<Optimizer> optimizer = Optimizer::create(options);
  EXPECT_TRUE(optimizer.is_ok()) << optimizer.status().message();
  return std::move(optimizer).value();
}

TEST(Optimizer, WeightDecayOnlyOnTwoDimensionalTensors) {
  const int64_t matrix[] = {4, 8}, vector[] = {8}, cube[] = {2, 2, 2};
  EXPECT_EQ(param_group_for_shape(matrix), ParamGroup::decay);
  EXPECT_EQ(param_group_for_shape(vector), ParamGroup::no_decay);
  EXPECT_EQ(param_group_for_shape(cube), ParamGroup::no_decay);
}

TEST(Optimizer, SegmentsGetTheirGroupsWeightDecay) {
  std::mt19937_64 rng(fresh_seed());
  std::printf("seed %llu\n", static_cast<unsigned long long>(fresh_seed()));
  OptimizerOptions o;
  o.adamw.lr = 1e-2;
  o.adamw.weight_decay = 0.1;
  o.skip_nonfinite_steps = false;
  Optimizer optimizer = make(o);
  EXPECT_FALSE(optimizer.needs_grad_norm());
  Buffers driven(300, rng);
  Buffers direct = driven;
  const ShardSegment segments[] = {
      {0, 200, ParamGroup::decay}, {200, 264, ParamGroup::no_decay}, {264, 300, ParamGroup::decay}};
  const Result<StepDecision> plan = optimizer.begin_step(std::nullopt);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  EXPECT_TRUE(plan->apply);
  EXPECT_EQ(plan->step, 1);
  EXPECT_EQ(plan->lr, 1e-2);
  kernels::cpu::AdamWShard whole = driven.shard();
  whole.segments = segments;
  ASSERT_TRUE(optimizer.update_shard(*plan, whole));

  kernels::cpu::AdamWHyperparams h;
  h.lr = 1e-2;
  h.step = 1;
  for (const ShardSegment& s : segments) {
    kernels::cpu::AdamWShard part = direct.shard();
    part.numel = s.end - s.begin;
    part.master += s.begin;
    part.exp_avg = direct.m.data() + s.begin;
    part.exp_avg_sq = direct.v.data() + s.begin;
    part.grad = direct.grad.data() + s.begin;
    part.copy = direct.copy.data() + s.begin;
    h.weight_decay = s.group == ParamGroup::decay ? 0.1 : 0.0;
    ASSERT_TRUE(kernels::cpu::adamw_step(part, h));
  }
  EXPECT_TRUE(same_bits(driven.master, direct.master));
  EXPECT_TRUE(same_bits(driven.m, direct.m));
  EXPECT_TRUE(same_bits(driven.v, direct.v));
  EXPECT_EQ(driven.copy, direct.copy);
}

TEST(Optimizer, RejectsSegmentsThatDoNotCoverTheShard) {
  std::mt19937_64 rng(fresh_seed() + 1);
  Optimizer optimizer = make(OptimizerOptions{});
  Buffers b(100, rng);
  const Buffers before = b;
  const StepDecision plan = *optimizer.begin_step(b.norm());
  const ShardSegment gap[] = {{0, 40, ParamGroup::decay}, {50, 100, ParamGroup::no_decay}};
  kernels::cpu::AdamWShard with_gap = b.shard();
  with_gap.segments = gap;
  EXPECT_FALSE(optimizer.update_shard(plan, with_gap));
  const ShardSegment short_cover[] = {{0, 90, ParamGroup::decay}};
  kernels::cpu::AdamWShard short_covered = b.shard();
  short_covered.segments = short_cover;
  EXPECT_FALSE(optimizer.update_shard(plan, short_covered));
  EXPECT_TRUE(same_bits(b.master, before.master));
}

TEST(Optimizer, ClipsByGlobalNormOfUnscaledGradients) {
  OptimizerOptions o;
  o.gradient_clipping = 1.0;
  o.loss_scaler.enabled = true;  // fp16: gradients carry 2^16
  Optimizer optimizer = make(o);
  EXPECT_TRUE(optimizer.needs_grad_norm());
  EXPECT_EQ(optimizer.loss_scale(), 65536.0);
  GradNormPartial grads;
  grads.sum_squares = std::pow(10.0 * 65536.0, 2);  // unscaled norm 10
  const StepDecision plan = *optimizer.begin_step(grads);
  EXPECT_TRUE(plan.apply);
  EXPECT_DOUBLE_EQ(plan.grad_norm, 10.0);
  EXPECT_DOUBLE_EQ(plan.clip_coef, 1.0 / (10.0 + 1e-6));
  EXPECT_DOUBLE_EQ(plan.grad_scale, plan.clip_coef / 65536.0);
  // Below the threshold the coefficient is 1.
  grads.sum_squares = std::pow(0.5 * 65536.0, 2);
  const StepDecision small = *optimizer.begin_step(grads);
  EXPECT_EQ(small.clip_coef, 1.0);
  EXPECT_EQ(small.step, 2);
}

TEST(Optimizer, Fp16OverflowSkipsTheStepAndHoldsTheSchedule) {
  std::mt19937_64 rng(fresh_seed() + 2);
  OptimizerOptions o;
  o.loss_scaler.enabled = true;
  o.loss_scaler.hysteresis = 1;
  o.lr_schedule.type = LrScheduleType::warmup_lr;
  o.lr_schedule.warmup_type = WarmupType::linear;
  o.lr_schedule.warmup_num_steps = 4;
  o.lr_schedule.warmup_min_lr = 0.0;
  o.lr_schedule.warmup_max_lr = 0.4;
  Optimizer optimizer = make(o);
  Buffers b(64, rng);

  GradNormPartial clean;
  clean.sum_squares = 1.0;
  GradNormPartial overflow;
  overflow.sum_squares = INFINITY;
  overflow.nonfinite = true;

  // Applied steps 1 and 2 both run at the warm-up's start (DeepSpeed's order),
  // then 0.1, 0.2, ...; skipped steps advance neither Adam's t nor the schedule.
  struct Expect {
    bool overflow;
    bool apply;
    int64_t step;
    double lr;
    double scale;
  };
  const Expect script[] = {{false, true, 1, 0.0, 65536}, {true, false, 0, 0.0, 65536},
                           {false, true, 2, 0.0, 32768}, {false, true, 3, 0.1, 32768},
                           {true, false, 0, 0.0, 32768}, {false, true, 4, 0.2, 16384}};
  for (const Expect& e : script) {
    const Buffers before = b;
    EXPECT_EQ(optimizer.loss_scale(), e.scale);
    const Result<StepDecision> plan = optimizer.begin_step(e.overflow ? overflow : clean);
    ASSERT_TRUE(plan.is_ok());
    EXPECT_EQ(plan->apply, e.apply);
    EXPECT_EQ(plan->overflow, e.overflow);
    EXPECT_EQ(plan->step, e.step);
    if (e.apply) {
      EXPECT_DOUBLE_EQ(plan->lr, e.lr);
    }
    ASSERT_TRUE(optimizer.update_shard(*plan, b.shard()));
    if (!e.apply) {
      EXPECT_TRUE(same_bits(b.master, before.master));
    }
  }
  EXPECT_EQ(optimizer.state().applied_steps, 4);
  EXPECT_EQ(optimizer.state().skipped_steps, 2);
  EXPECT_EQ(optimizer.state().scheduler_iteration, 3);
}

TEST(Optimizer, Bf16NonFiniteGradientsSkipUnlessDisabled) {
  Optimizer guarded = make(OptimizerOptions{});
  GradNormPartial nan;
  nan.sum_squares = NAN;
  nan.nonfinite = true;
  EXPECT_FALSE(guarded.begin_step(nan)->apply);
  OptimizerOptions o;
  o.skip_nonfinite_steps = false;
  Optimizer unguarded = make(o);
  EXPECT_TRUE(unguarded.begin_step(nan)->apply);
}

TEST(Optimizer, NeedsTheNormWhenClippingOrScaling) {
  OptimizerOptions o;
  o.gradient_clipping = 1.0;
  Optimizer optimizer = make(o);
  const Result<StepDecision> plan = optimizer.begin_step(std::nullopt);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_EQ(optimizer.state().applied_steps, 0);
}

TEST(Optimizer, OverflowAtMinimumScaleStopsWithAnError) {
  OptimizerOptions o;
  o.loss_scaler.enabled = true;
  o.loss_scaler.initial_scale_power = 0;
  o.loss_scaler.hysteresis = 1;
  Optimizer optimizer = make(o);
  GradNormPartial overflow;
  overflow.sum_squares = INFINITY;
  overflow.nonfinite = true;
  const Result<StepDecision> plan = optimizer.begin_step(overflow);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_NE(plan.status().message().find("min_loss_scale"), std::string::npos);
  EXPECT_EQ(optimizer.state().skipped_steps, 0);
}

TEST(Optimizer, RestoredStateContinuesIdentically) {
  std::mt19937_64 rng(fresh_seed() + 3);
  OptimizerOptions o;
  o.adamw.weight_decay = 0.01;
  o.lr_schedule.type = LrScheduleType::warmup_cosine_lr;
  o.lr_schedule.warmup_num_steps = 3;
  o.lr_schedule.total_num_steps = 10;
  Optimizer first = make(o);
  Buffers b(500, rng);
  for (int i = 0; i < 4; ++i) {
    const StepDecision plan = *first.begin_step(b.norm());
    ASSERT_TRUE(first.update_shard(plan, b.shard()));
  }
  Optimizer second = make(o);
  second.restore(first.state());
  Buffers c = b;
  for (int i = 0; i < 3; ++i) {
    const StepDecision p1 = *first.begin_step(b.norm());
    const StepDecision p2 = *second.begin_step(c.norm());
    EXPECT_EQ(p1.lr, p2.lr);
    EXPECT_EQ(p1.step, p2.step);
    ASSERT_TRUE(first.update_shard(p1, b.shard()));
    ASSERT_TRUE(second.update_shard(p2, c.shard()));
  }
  EXPECT_TRUE(same_bits(b.master, c.master));
}

TEST(Optimizer, RefusesInvalidOptionsNamingTheKey) {
  OptimizerOptions o;
  o.adamw.beta2 = 1.0;
  Result<Optimizer> bad = Optimizer::create(o);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("optimizer.params.betas"), std::string::npos);
  o = OptimizerOptions{};
  o.gradient_clipping = -1;
  bad = Optimizer::create(o);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("gradient_clipping"), std::string::npos);
  o = OptimizerOptions{};
  o.loss_scaler.enabled = true;
  o.loss_scaler.loss_scale_window = 0;
  EXPECT_FALSE(Optimizer::create(o).is_ok());
}

}  // namespace
}  // namespace strata
