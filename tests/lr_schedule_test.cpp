// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, step by step
// (deepspeed/runtime/lr_schedules.py), through core/optimizer/lr_schedule.h.
#include "core/optimizer/lr_schedule.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

namespace strata {
namespace {

LrSchedule make(const LrScheduleOptions& options, double optimizer_lr) {
  Result<LrSchedule> schedule = LrSchedule::create(options, optimizer_lr);
  EXPECT_TRUE(schedule.is_ok()) << schedule.status().message();
  return std::move(schedule).value();
}

TEST(LrSchedule, ConstantWithoutScheduler) {
  const LrSchedule s = make(LrScheduleOptions{}, 3e-4);
  for (int64_t k : {-1, 0, 1, 1000000}) EXPECT_EQ(s.lr_at(k), 3e-4);
}

TEST(LrSchedule, WarmupLrLogRisesFromMinToMaxThenHolds) {
  LrScheduleOptions o;
  o.type = LrScheduleType::warmup_lr;
  o.warmup_min_lr = 0.01;
  o.warmup_max_lr = 0.11;
  o.warmup_num_steps = 10;
  const LrSchedule s = make(o, 0.5);
  EXPECT_EQ(s.lr_at(-1), 0.01);  // before the first scheduler step: the minimum
  EXPECT_EQ(s.lr_at(0), 0.01);   // log(1) = 0
  EXPECT_DOUBLE_EQ(s.lr_at(1), 0.01 + 0.1 * std::log(2.0) / std::log(10.0));
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.01 + 0.1 * std::log(5.0) / std::log(10.0));
  EXPECT_DOUBLE_EQ(s.lr_at(9), 0.11);  // log(10) / log(10)
  EXPECT_DOUBLE_EQ(s.lr_at(10), 0.11);
  EXPECT_DOUBLE_EQ(s.lr_at(123456), 0.11);
}

TEST(LrSchedule, WarmupLrLinearAndDefaults) {
  LrScheduleOptions o;
  o.type = LrScheduleType::warmup_lr;
  o.warmup_type = WarmupType::linear;
  o.warmup_num_steps = 4;
  const LrSchedule s = make(o, 0.2);  // max defaults to the optimizer's lr, min to 0
  EXPECT_EQ(s.lr_at(-1), 0.0);
  EXPECT_EQ(s.lr_at(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(1), 0.05);
  EXPECT_DOUBLE_EQ(s.lr_at(3), 0.15);
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.2);
}

TEST(LrSchedule, WarmupOfOneStepIsTwoStepsAsInDeepSpeed) {
  LrScheduleOptions o;
  o.type = LrScheduleType::warmup_lr;
  o.warmup_type = WarmupType::linear;
  o.warmup_num_steps = 1;
  o.warmup_max_lr = 1.0;
  const LrSchedule s = make(o, 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(1), 0.5);  // 1 / max(2, 1)
  EXPECT_DOUBLE_EQ(s.lr_at(2), 1.0);
}

TEST(LrSchedule, WarmupDecayLrDecaysLinearlyToMinAfterWarmup) {
  LrScheduleOptions o;
  o.type = LrScheduleType::warmup_decay_lr;
  o.warmup_type = WarmupType::linear;
  o.warmup_min_lr = 0.0;
  o.warmup_num_steps = 5;
  o.total_num_steps = 25;
  const LrSchedule s = make(o, 0.7);  // warmup_max_lr defaults to 0.001, not the optimizer's lr
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(4), 0.001 * 4 / 5);
  EXPECT_DOUBLE_EQ(s.lr_at(5), 0.001);             // (25 - 5) / 20
  EXPECT_DOUBLE_EQ(s.lr_at(15), 0.001 * 10 / 20);  // halfway down
  EXPECT_DOUBLE_EQ(s.lr_at(25), 0.0);
  EXPECT_DOUBLE_EQ(s.lr_at(40), 0.0);  // never below the minimum
}

TEST(LrSchedule, WarmupCosineLrUsesRatiosOfTheOptimizerLr) {
  LrScheduleOptions o;
  o.type = LrScheduleType::warmup_cosine_lr;
  o.warmup_type = WarmupType::linear;
  o.warmup_num_steps = 5;
  o.total_num_steps = 19;
  o.warmup_min_ratio = 0.1;
  o.cos_min_ratio = 0.01;
  const LrSchedule s = make(o, 0.5);
  EXPECT_EQ(s.lr_at(-1), 0.0);  // DeepSpeed starts it at 0
  EXPECT_DOUBLE_EQ(s.lr_at(0), 0.5 * 0.1);
  EXPECT_DOUBLE_EQ(s.lr_at(2), 0.5 * (0.1 + 0.4 * 0.9));
  const double at5 = 0.01 + 0.99 * (1 + std::cos(std::numbers::pi / 14)) / 2;
  EXPECT_DOUBLE_EQ(s.lr_at(5), 0.5 * at5);                   // progress (5 - 5 + 1) / (19 - 5)
  EXPECT_DOUBLE_EQ(s.lr_at(11), 0.5 * (0.01 + 0.99 * 0.5));  // progress 7 / 14: cos = 0
  EXPECT_DOUBLE_EQ(s.lr_at(19), 0.5 * 0.01);                 // progress 1: the floor
  EXPECT_DOUBLE_EQ(s.lr_at(100), 0.5 * 0.01);
}

TEST(LrSchedule, RefusesInvalidOptionsNamingTheKey) {
  LrScheduleOptions o;
  o.type = LrScheduleType::warmup_lr;
  o.warmup_num_steps = 0;
  Result<LrSchedule> bad = LrSchedule::create(o, 1e-3);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("warmup_num_steps"), std::string::npos);
  o.warmup_num_steps = 10;
  o.type = LrScheduleType::warmup_cosine_lr;
  bad = LrSchedule::create(o, 1e-3);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("total_num_steps"), std::string::npos);
}

TEST(LrSchedule, ParsesDeepSpeedNames) {
  EXPECT_EQ(*parse_lr_schedule_type("WarmupLR"), LrScheduleType::warmup_lr);
  EXPECT_EQ(*parse_lr_schedule_type("WarmupDecayLR"), LrScheduleType::warmup_decay_lr);
  EXPECT_EQ(*parse_lr_schedule_type("WarmupCosineLR"), LrScheduleType::warmup_cosine_lr);
  EXPECT_FALSE(parse_lr_schedule_type("OneCycle").is_ok());
  EXPECT_EQ(*parse_warmup_type("linear"), WarmupType::linear);
  EXPECT_FALSE(parse_warmup_type("cubic").is_ok());
}

}  // namespace
}  // namespace strata
