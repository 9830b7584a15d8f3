// A shard update's runs: how both AdamW kernels cut a shard into kernel
// passes, and each run's view of the shard's arrays.
#include "kernels/cpu/adamw_shard.h"

#include <algorithm>
#include <string>

#include "kernels/cpu/adamw.h"

namespace strata::kernels::cpu {
namespace {

Status check_segments(std::span<const ShardSegment> segments, int64_t numel) {
  int64_t expected_begin = 0;
  for (const ShardSegment& segment : segments) {
    if (segment.begin != expected_begin || segment.end < segment.begin) {
      return Status::error("adamw_step: segments must be ordered and contiguous; got [" +
                           std::to_string(segment.begin) + ", " + std::to_string(segment.end) +
                           ") where " + std::to_string(expected_begin) + " was expected");
    }
    expected_begin = segment.end;
  }
  if (expected_begin != numel) {
    return Status::error("adamw_step: segments cover " + std::to_string(expected_begin) +
                         " elements of a shard of " + std::to_string(numel));
  }
  return Status::ok();
}

int64_t moment_bytes(AdamWStateType type) {
  return type == AdamWStateType::f32 ? 4 : type == AdamWStateType::bf16 ? 2 : 1;
}

const void* offset_elements(const void* base, int64_t elements, ElementType type) {
  return static_cast<const char*>(base) + elements * static_cast<int64_t>(element_size(type));
}

}  // namespace

int64_t int8_block_count(std::span<const ShardSegment> segments, int64_t numel) {
  const int64_t B = kAdamWInt8Block;
  if (segments.empty()) return (numel + B - 1) / B;
  int64_t blocks = 0;
  for (const ShardSegment& segment : segments)
    if (segment.end > segment.begin) blocks += (segment.end + B - 1) / B - segment.begin / B;
  return blocks;
}

Result<std::vector<CompactRun>> compact_runs(std::span<const ShardSegment> segments, int64_t numel,
                                             AdamWStateType type) {
  const ShardSegment all{0, numel, ParamGroup::decay};
  if (segments.empty()) segments = std::span<const ShardSegment>(&all, 1);
  if (Status s = check_segments(segments, numel); !s) return s;
  const bool int8 = type == AdamWStateType::int8;
  const int64_t B = kAdamWInt8Block;
  std::vector<CompactRun> runs;
  int64_t block = 0;
  for (const ShardSegment& segment : segments) {
    int64_t at = segment.begin;
    while (at < segment.end) {
      const int64_t stop =
          int8 && at % B != 0 ? std::min(segment.end, (at / B + 1) * B) : segment.end;
      runs.push_back({at, stop, segment.group, block});
      block += adamw_state_scale_count(type, stop - at);
      at = stop;
    }
  }
  return runs;
}

AdamWShard run_of(const AdamWShard& shard, const CompactRun& run) {
  const int64_t moment = moment_bytes(shard.state_type);
  AdamWShard part = shard;
  part.numel = run.end - run.begin;
  part.segments = {};
  if (shard.master != nullptr) part.master = shard.master + run.begin;
  if (shard.exp_avg != nullptr)
    part.exp_avg = static_cast<char*>(shard.exp_avg) + run.begin * moment;
  if (shard.exp_avg_sq != nullptr)
    part.exp_avg_sq = static_cast<char*>(shard.exp_avg_sq) + run.begin * moment;
  if (shard.exp_avg_scale != nullptr) part.exp_avg_scale = shard.exp_avg_scale + run.block;
  if (shard.exp_avg_sq_scale != nullptr) part.exp_avg_sq_scale = shard.exp_avg_sq_scale + run.block;
  if (shard.grad != nullptr) part.grad = offset_elements(shard.grad, run.begin, shard.grad_type);
  if (shard.copy != nullptr)
    part.copy = const_cast<void*>(offset_elements(shard.copy, run.begin, shard.copy_type));
  return part;
}

AdamWHyperparams group_hyperparams(const AdamWHyperparams& hyper, ParamGroup group) {
  AdamWHyperparams out = hyper;
  if (group == ParamGroup::no_decay) out.weight_decay = 0.0;
  return out;
}

}  // namespace strata::kernels::cpu
