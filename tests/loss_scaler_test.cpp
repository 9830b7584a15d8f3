// The fp16 loss scaler's state machine, step by step, against DeepSpeed's
// DynamicLossScaler rules (core/optimizer/loss_scaler.h).
#include "core/optimizer/loss_scaler.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

LossScaler make(const LossScalerOptions& options) {
  Result<LossScaler> scaler = LossScaler::create(options);
  EXPECT_TRUE(scaler.is_ok()) << scaler.status().message();
  return std::move(scaler).value();
}

LossScalerOptions dynamic_options() {
  LossScalerOptions o;
  o.enabled = true;
  return o;
}

TEST(LossScaler, DisabledAndStaticScalesNeverChange) {
  LossScaler off = make(LossScalerOptions{});
  EXPECT_FALSE(off.dynamic());
  EXPECT_EQ(off.scale(), 1.0);
  EXPECT_TRUE(off.update(true));
  EXPECT_EQ(off.scale(), 1.0);

  LossScalerOptions o = dynamic_options();
  o.loss_scale = 128.0;
  LossScaler fixed = make(o);
  EXPECT_FALSE(fixed.dynamic());
  for (bool overflow : {true, false, true}) {
    EXPECT_TRUE(fixed.update(overflow));
    EXPECT_EQ(fixed.scale(), 128.0);
  }
}

TEST(LossScaler, DefaultsStartAt2To16WithHysteresis2) {
  LossScaler s = make(dynamic_options());
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 65536.0);
  ASSERT_TRUE(s.update(true));  // first overflow spends hysteresis
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().hysteresis_left, 1);
  ASSERT_TRUE(s.update(true));  // second halves
  EXPECT_EQ(s.scale(), 32768.0);
  ASSERT_TRUE(s.update(true));  // hysteresis is not refilled by overflows: halves again
  EXPECT_EQ(s.scale(), 16384.0);
  ASSERT_TRUE(s.update(false));  // one clean step does not refill it either
  EXPECT_EQ(s.state().hysteresis_left, 1);
  ASSERT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 8192.0);
}

TEST(LossScaler, DoublesAfterAWindowOfCleanSteps) {
  LossScalerOptions o = dynamic_options();
  o.initial_scale_power = 4;
  o.loss_scale_window = 3;
  o.hysteresis = 1;
  LossScaler s = make(o);
  // Clean steps 1..3 keep 16; the 4th (3 clean steps before it) doubles.
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(s.update(false));
    EXPECT_EQ(s.scale(), 16.0) << "clean step " << i + 1;
  }
  ASSERT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 32.0);
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 32.0);
  ASSERT_TRUE(s.update(false));  // 6 clean steps before it: doubles again
  EXPECT_EQ(s.scale(), 64.0);
  // An overflow halves and restarts the window: 3 clean steps, then the 4th doubles.
  ASSERT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 32.0);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 32.0);
  ASSERT_TRUE(s.update(false));
  EXPECT_EQ(s.scale(), 64.0);
}

TEST(LossScaler, WindowRefillsHysteresis) {
  LossScalerOptions o = dynamic_options();
  o.initial_scale_power = 10;
  o.loss_scale_window = 2;
  o.hysteresis = 3;
  LossScaler s = make(o);
  ASSERT_TRUE(s.update(true));
  ASSERT_TRUE(s.update(true));
  EXPECT_EQ(s.state().hysteresis_left, 1);
  EXPECT_EQ(s.scale(), 1024.0);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(s.update(false));  // 3rd clean step: 2 before it
  EXPECT_EQ(s.scale(), 2048.0);
  EXPECT_EQ(s.state().hysteresis_left, 3);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsOnEveryCleanStep) {
  LossScalerOptions o = dynamic_options();
  o.hysteresis = 2;
  o.consecutive_hysteresis = true;
  LossScaler s = make(o);
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(s.update(true));
    EXPECT_EQ(s.scale(), 65536.0);  // never two overflows in a row: never halves
    ASSERT_TRUE(s.update(false));
    EXPECT_EQ(s.state().hysteresis_left, 2);
  }
}

TEST(LossScaler, StopsAtTheMinimumScale) {
  LossScalerOptions o = dynamic_options();
  o.initial_scale_power = 3;
  o.hysteresis = 1;
  o.min_loss_scale = 4.0;
  LossScaler s = make(o);
  ASSERT_TRUE(s.update(true));
  EXPECT_EQ(s.scale(), 4.0);
  const LossScalerState before = s.state();
  const Status status = s.update(true);
  ASSERT_FALSE(status);
  EXPECT_NE(status.message().find("minimum"), std::string::npos);
  EXPECT_EQ(s.state().iteration, before.iteration);  // nothing changed
  EXPECT_EQ(s.scale(), 4.0);

  o.raise_error_at_min_scale = false;
  LossScaler lenient = make(o);
  ASSERT_TRUE(lenient.update(true));
  ASSERT_TRUE(lenient.update(true));
  EXPECT_EQ(lenient.scale(), 4.0);
}

TEST(LossScaler, StateRestoresExactly) {
  LossScaler a = make(dynamic_options());
  ASSERT_TRUE(a.update(true));
  ASSERT_TRUE(a.update(false));
  LossScaler b = make(dynamic_options());
  b.restore(a.state());
  for (bool overflow : {true, false, true, true}) {
    ASSERT_TRUE(a.update(overflow));
    ASSERT_TRUE(b.update(overflow));
    EXPECT_EQ(a.scale(), b.scale());
  }
}

TEST(LossScaler, RefusesInvalidOptions) {
  LossScalerOptions o = dynamic_options();
  o.loss_scale_window = 0;
  EXPECT_FALSE(LossScaler::create(o).is_ok());
  o = dynamic_options();
  o.hysteresis = 0;
  EXPECT_FALSE(LossScaler::create(o).is_ok());
  o = dynamic_options();
  o.loss_scale = -1;
  EXPECT_FALSE(LossScaler::create(o).is_ok());
}

}  // namespace
}  // namespace strata
