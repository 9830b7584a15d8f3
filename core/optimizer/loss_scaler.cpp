#include "core/optimizer/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace strata {

Result<LossScaler> LossScaler::create(const LossScalerOptions& options) {
  if (!options.enabled) return LossScaler(options);
  if (!(options.loss_scale >= 0.0)) {
    return Status::error("fp16.loss_scale must be 0 (dynamic) or a positive static scale, got " +
                         std::to_string(options.loss_scale));
  }
  if (options.loss_scale == 0.0) {
    if (options.loss_scale_window <= 0) {
      return Status::error("fp16.loss_scale_window must be positive, got " +
                           std::to_string(options.loss_scale_window));
    }
    if (options.hysteresis <= 0) {
      return Status::error("fp16.hysteresis must be positive, got " +
                           std::to_string(options.hysteresis));
    }
    if (!(options.min_loss_scale > 0.0)) {
      return Status::error("fp16.min_loss_scale must be positive, got " +
                           std::to_string(options.min_loss_scale));
    }
    if (options.initial_scale_power < -126 || options.initial_scale_power > 127) {
      return Status::error("fp16.initial_scale_power must lie in [-126, 127], got " +
                           std::to_string(options.initial_scale_power));
    }
  }
  return LossScaler(options);
}

LossScaler::LossScaler(const LossScalerOptions& options) : options_(options) {
  dynamic_ = options.enabled && options.loss_scale == 0.0;
  state_.hysteresis_left = options.hysteresis;
  if (!options.enabled) {
    state_.scale = 1.0;
  } else if (dynamic_) {
    state_.scale = std::ldexp(1.0, options.initial_scale_power);
  } else {
    state_.scale = options.loss_scale;
  }
}

Status LossScaler::update(bool overflow) {
  if (!dynamic_) return Status::ok();
  LossScalerState& s = state_;
  if (overflow) {
    if (options_.hysteresis == 1 || s.hysteresis_left == 1) {
      if (s.scale == options_.min_loss_scale && options_.raise_error_at_min_scale) {
        return Status::error(
            "fp16 loss scale is already at its minimum (" +
            std::to_string(options_.min_loss_scale) +
            ") and the gradients still overflow; lower fp16.min_loss_scale, lower the learning "
            "rate, or train in bf16");
      }
      s.scale = std::max(s.scale / 2.0, options_.min_loss_scale);
    } else {
      --s.hysteresis_left;
    }
    s.last_overflow_iteration = s.iteration;
  } else {
    if (options_.consecutive_hysteresis) s.hysteresis_left = options_.hysteresis;
    const int64_t stable_interval = (s.iteration - s.last_overflow_iteration) - 1;
    if (stable_interval > 0 && stable_interval % options_.loss_scale_window == 0) {
      if (!options_.consecutive_hysteresis) s.hysteresis_left = options_.hysteresis;
      s.scale *= 2.0;
    }
  }
  ++s.iteration;
  return Status::ok();
}

}  // namespace strata
