// The parts build_training_plan (core/plan/training_plan.cpp) is made of, each
// in a file of its own: the state and working buffers (plan_buffers.cpp) and
// the operations (plan_operations.cpp). Internal to core/plan.
#pragma once

#include <cstdint>

#include "core/plan/training_plan.h"

namespace strata {

// What a rank keeps of one unit, by ZeRO stage.
UnitPlacement place_unit(int64_t padded_numel, int64_t shard_numel, int stage);

// The model-state lines: one per kind of state, each unit's shard rounded to
// a page on its own (the store adds one shard per unit), the sum rounded to
// the tier's alignment.
void add_state_buffers(TrainingPlan& plan);

// Every working buffer of the backend's rank and of the host (staging, the
// streamed optimizer's, spills), sized by the largest unit, shard and
// optimizer range.
void add_working_buffers(TrainingPlan& plan, int64_t largest_padded, int64_t largest_shard,
                         int64_t largest_optimizer);

// The step's operations, their dependencies and bytes, and the traffic per link.
void build_plan_operations(TrainingPlan& plan);

}  // namespace strata
