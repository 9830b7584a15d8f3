#include "core/optimizer/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

namespace strata {

Result<LrScheduleType> parse_lr_schedule_type(std::string_view name) {
  if (name == "WarmupLR") return LrScheduleType::warmup_lr;
  if (name == "WarmupDecayLR") return LrScheduleType::warmup_decay_lr;
  if (name == "WarmupCosineLR") return LrScheduleType::warmup_cosine_lr;
  return Status::error("scheduler.type: unknown schedule \"" + std::string(name) +
                       "\"; use WarmupLR, WarmupDecayLR or WarmupCosineLR");
}

Result<WarmupType> parse_warmup_type(std::string_view name) {
  if (name == "log") return WarmupType::log;
  if (name == "linear") return WarmupType::linear;
  return Status::error("scheduler.params.warmup_type: unknown \"" + std::string(name) +
                       "\"; use log or linear");
}

std::string_view lr_schedule_type_name(LrScheduleType type) {
  switch (type) {
    case LrScheduleType::constant:
      return "constant";
    case LrScheduleType::warmup_lr:
      return "WarmupLR";
    case LrScheduleType::warmup_decay_lr:
      return "WarmupDecayLR";
    case LrScheduleType::warmup_cosine_lr:
      return "WarmupCosineLR";
  }
  return "unknown";
}

Result<LrSchedule> LrSchedule::create(const LrScheduleOptions& options, double optimizer_lr) {
  if (!(optimizer_lr >= 0.0)) {
    return Status::error("optimizer.params.lr must be >= 0, got " + std::to_string(optimizer_lr));
  }
  if (options.type == LrScheduleType::constant) return LrSchedule(options, optimizer_lr);
  if (options.warmup_num_steps <= 0) {
    return Status::error("scheduler.params.warmup_num_steps must be a positive integer, got " +
                         std::to_string(options.warmup_num_steps));
  }
  const bool needs_total = options.type != LrScheduleType::warmup_lr;
  if (needs_total && options.total_num_steps <= 0) {
    return Status::error("scheduler.params.total_num_steps must be set to a positive integer for " +
                         std::string(lr_schedule_type_name(options.type)));
  }
  if (!(options.warmup_min_lr >= 0.0) ||
      (options.warmup_max_lr && !(*options.warmup_max_lr >= 0.0))) {
    return Status::error("scheduler.params.warmup_min_lr and warmup_max_lr must be >= 0");
  }
  return LrSchedule(options, optimizer_lr);
}

LrSchedule::LrSchedule(const LrScheduleOptions& options, double optimizer_lr)
    : options_(options), optimizer_lr_(optimizer_lr) {
  min_lr_ = options.warmup_min_lr;
  const double default_max = options.type == LrScheduleType::warmup_decay_lr ? 0.001 : optimizer_lr;
  max_lr_ = options.warmup_max_lr.value_or(default_max);
  warmup_steps_ = std::max<int64_t>(2, options.warmup_num_steps);
}

double LrSchedule::warmup_fraction(int64_t iteration) const {
  if (options_.warmup_type == WarmupType::log) {
    return (1.0 / std::log(static_cast<double>(warmup_steps_))) *
           std::log(static_cast<double>(iteration + 1));
  }
  return static_cast<double>(iteration) / static_cast<double>(warmup_steps_);
}

double LrSchedule::lr_at(int64_t iteration) const {
  switch (options_.type) {
    case LrScheduleType::constant:
      return optimizer_lr_;
    case LrScheduleType::warmup_lr:
    case LrScheduleType::warmup_decay_lr: {
      if (iteration < 0) return min_lr_;
      double gamma = 1.0;
      if (iteration < warmup_steps_) {
        gamma = warmup_fraction(iteration);
      } else if (options_.type == LrScheduleType::warmup_decay_lr) {
        const double remaining = static_cast<double>(options_.total_num_steps - iteration);
        const double span =
            std::max(1.0, static_cast<double>(options_.total_num_steps - warmup_steps_));
        gamma = std::max(0.0, remaining / span);
      }
      return min_lr_ + (max_lr_ - min_lr_) * gamma;
    }
    case LrScheduleType::warmup_cosine_lr: {
      if (iteration < 0) return 0.0;
      double ratio;
      if (iteration < warmup_steps_) {
        ratio = options_.warmup_min_ratio +
                warmup_fraction(iteration) * (1.0 - options_.warmup_min_ratio);
      } else {
        const double real_last_step = static_cast<double>(iteration - warmup_steps_ + 1);
        const double real_total_steps =
            static_cast<double>(std::max<int64_t>(1, options_.total_num_steps - warmup_steps_));
        const double progress = std::min(1.0, real_last_step / real_total_steps);
        const double cosine = (1.0 + std::cos(std::numbers::pi * progress)) / 2.0;
        ratio = std::max(0.0, options_.cos_min_ratio + (1.0 - options_.cos_min_ratio) * cosine);
      }
      return optimizer_lr_ * ratio;
    }
  }
  return optimizer_lr_;
}

}  // namespace strata
