// fp16 loss scaling with DeepSpeed's rules (deepspeed/runtime/fp16/loss_scaler.py,
// DynamicLossScaler as of DeepSpeed 0.19).
//
// The loss is multiplied by scale() before backward; the optimizer divides it
// out of the gradients (in the AdamW pass itself). After each step, update()
// gets the overflow verdict (inf/NaN anywhere in the gradients):
//   - overflow: the step is skipped. With hysteresis left (> 1), one unit of
//     hysteresis is spent and the scale stays; otherwise the scale halves,
//     never below min_loss_scale. At the minimum already, DeepSpeed stops the
//     run (raise_error_at_min_scale), and update() returns that error.
//   - clean: with consecutive_hysteresis, hysteresis refills at once. A clean
//     step preceded by a positive multiple of loss_scale_window clean steps
//     since the last overflow (or the start) doubles the scale and refills
//     hysteresis: with the default window of 1000, the 1001st clean step.
// A static scale (loss_scale > 0) and a disabled scaler (bf16, fp32: scale 1)
// never change. A LossScaler is a plain value, not thread-safe to mutate.
#pragma once

#include <cstdint>

#include "io/base/status.h"

namespace strata {

// DeepSpeed's "fp16" section, with its defaults.
struct LossScalerOptions {
  bool enabled = false;              // fp16.enabled; off: scale 1, nothing to do
  double loss_scale = 0.0;           // 0: dynamic; > 0: this static scale
  int initial_scale_power = 16;      // dynamic scale starts at 2^initial_scale_power
  int64_t loss_scale_window = 1000;  // clean steps before the scale doubles
  int hysteresis = 2;                // overflows tolerated before the scale halves
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
  bool raise_error_at_min_scale = true;
};

// Everything that a checkpoint must keep to resume the scaler exactly.
struct LossScalerState {
  double scale = 1.0;
  int64_t iteration = 0;  // DeepSpeed's cur_iter
  int64_t last_overflow_iteration = -1;
  int hysteresis_left = 2;  // DeepSpeed's cur_hysteresis
};

class LossScaler {
 public:
  // Fails on a non-positive window, hysteresis or minimum scale, or a negative static scale.
  static Result<LossScaler> create(const LossScalerOptions& options);

  bool dynamic() const { return dynamic_; }
  double scale() const { return state_.scale; }

  // Records one step's verdict (see the contract above). On error nothing changes.
  Status update(bool overflow);

  const LossScalerState& state() const { return state_; }
  void restore(const LossScalerState& state) { state_ = state; }

 private:
  explicit LossScaler(const LossScalerOptions& options);

  LossScalerOptions options_;
  bool dynamic_ = false;
  LossScalerState state_;
};

}  // namespace strata
