// Learning-rate schedules with DeepSpeed's parameters and semantics
// (deepspeed/runtime/lr_schedules.py): WarmupLR, WarmupDecayLR, WarmupCosineLR,
// or a constant rate when the config has no "scheduler" section.
//
// DeepSpeed keeps `last_batch_iteration`, -1 before the first optimizer step,
// and steps the scheduler after every optimizer step that was applied (a step
// skipped for an fp16 overflow does not advance it). So the k-th applied step
// (k = 1, 2, ...) uses lr_at(k - 2): the first two steps of a warm-up both run
// at its starting rate, exactly as in DeepSpeed. An LrSchedule is an immutable
// value; lr_at() is pure and thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "io/base/status.h"

namespace strata {

enum class LrScheduleType { constant, warmup_lr, warmup_decay_lr, warmup_cosine_lr };
enum class WarmupType { log, linear };

// DeepSpeed's "scheduler": {"type": ..., "params": {...}}, with its defaults.
struct LrScheduleOptions {
  LrScheduleType type = LrScheduleType::constant;  // no "scheduler" section
  // WarmupLR and WarmupDecayLR.
  double warmup_min_lr = 0.0;
  // Unset: WarmupLR uses the optimizer's lr, WarmupDecayLR uses 0.001 (DeepSpeed's defaults).
  std::optional<double> warmup_max_lr;
  // All three. DeepSpeed warms up over max(2, warmup_num_steps) steps.
  int64_t warmup_num_steps = 1000;
  WarmupType warmup_type = WarmupType::log;
  // WarmupDecayLR and WarmupCosineLR (required there).
  int64_t total_num_steps = 0;
  // WarmupCosineLR: ratios of the optimizer's lr.
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 0.0001;
};

// "WarmupLR", "WarmupDecayLR", "WarmupCosineLR" (DeepSpeed's names).
Result<LrScheduleType> parse_lr_schedule_type(std::string_view name);
// "log" or "linear". (DeepSpeed falls back to log with a warning; strata refuses.)
Result<WarmupType> parse_warmup_type(std::string_view name);
std::string_view lr_schedule_type_name(LrScheduleType type);

class LrSchedule {
 public:
  // `optimizer_lr` is the optimizer's "lr" (WarmupLR's default peak, WarmupCosineLR's
  // peak, the constant rate). Fails on non-positive step counts or negative rates.
  static Result<LrSchedule> create(const LrScheduleOptions& options, double optimizer_lr);

  // The rate after `last_batch_iteration` scheduler steps (-1: before the first).
  double lr_at(int64_t last_batch_iteration) const;

  const LrScheduleOptions& options() const { return options_; }

 private:
  LrSchedule(const LrScheduleOptions& options, double optimizer_lr);
  double warmup_fraction(int64_t iteration) const;  // 0 -> 1 over the warm-up

  LrScheduleOptions options_;
  double optimizer_lr_ = 0.0;
  double min_lr_ = 0.0;
  double max_lr_ = 0.0;
  int64_t warmup_steps_ = 2;  // max(2, warmup_num_steps)
};

}  // namespace strata
