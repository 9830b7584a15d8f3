// A rank's buffers, as the training plan lists them (TrainingPlan::buffers):
// allocated by walking that list for one owner (the engine rank, or the GPU
// rank), found afterwards by role. The plan is the only place that says which
// buffers exist, how large they are and in which tier; a rank never
// re-derives those conditions.
//
// Each copy of a buffer is one allocation of PlanBuffer::copy_bytes() (a
// whole number of pages), so what a rank takes from a tier is exactly what
// the plan charged to it. Buffers on NVMe are not memory: their owner takes
// an extent of the NVMe tier for them itself (core/engine/engine_setup.cpp). The memory belongs to the tier that allocated it;
// RankBuffers only holds pointers. A value type; not thread-safe to mutate.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/plan/training_plan.h"
#include "io/base/status.h"

namespace strata {

class RankBuffers {
 public:
  // Takes `bytes` for `what` from `tier`; the error names the tier and the numbers.
  using Allocate =
      std::function<Result<std::byte*>(tiers::Tier tier, uint64_t bytes, const std::string& what)>;

  // Every copy of every buffer of `owner` in `plan` in memory (device or
  // host), in the plan's order.
  static Result<RankBuffers> allocate(const TrainingPlan& plan, BufferOwner owner,
                                      const Allocate& allocate);

  // Copy `copy` of the buffer of `role`; null when the plan has none.
  std::byte* at(BufferRole role, int copy = 0) const;
  template <typename T>
  T* as(BufferRole role, int copy = 0) const {
    return reinterpret_cast<T*>(at(role, copy));
  }
  // Every copy of `role`, as T* (empty when the plan has none).
  template <typename T>
  std::vector<T*> all_as(BufferRole role) const {
    std::vector<T*> out;
    auto found = copies_.find(role);
    if (found != copies_.end())
      for (std::byte* p : found->second) out.push_back(reinterpret_cast<T*>(p));
    return out;
  }

 private:
  std::map<BufferRole, std::vector<std::byte*>> copies_;
};

}  // namespace strata
