#include "core/optimizer/streamed_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace strata {
namespace {

using tiers::ShardKind;
using tiers::StreamItem;
using tiers::StreamPiece;

// Where one chunk sits: unit index in the step's list, first element, count.
struct Chunk {
  size_t unit = 0;
  int64_t begin = 0;
  int64_t numel = 0;
};

const void* offset_elements(const void* base, int64_t elements, kernels::cpu::ElementType type) {
  return static_cast<const std::byte*>(base) + elements * int64_t(kernels::cpu::element_size(type));
}

}  // namespace

uint64_t StreamedOptimizer::host_buffer_bytes(const StreamedOptimizerOptions& options) {
  return uint64_t(options.buffer_count) * uint64_t(options.chunk_elements) * 12;
}

Result<std::unique_ptr<StreamedOptimizer>> StreamedOptimizer::create(
    tiers::TieredStore& store, StreamedOptimizerOptions options) {
  // Chunks start at multiples of chunk_elements * 4 bytes, which must be I/O-aligned.
  if (options.chunk_elements <= 0 || options.chunk_elements % 1024 != 0)
    return Status::error(
        fmt::format("streamed optimizer: chunk of {} elements; it must be a "
                    "positive multiple of 1024 (4 KiB of fp32); check sub_group_size",
                    options.chunk_elements));
  tiers::StreamedPassOptions pass_options;
  pass_options.buffer_count = options.buffer_count;
  pass_options.buffer_bytes = uint64_t(options.chunk_elements) * 12;
  Result<std::unique_ptr<tiers::StreamedPass>> pass =
      tiers::StreamedPass::create(store, pass_options);
  if (!pass) return pass.status().with_context("streamed optimizer");
  return std::unique_ptr<StreamedOptimizer>(new StreamedOptimizer(options, std::move(*pass)));
}

Status StreamedOptimizer::add_unit_state(tiers::TieredStore& store, int unit, int64_t numel,
                                         tiers::Tier home) {
  for (ShardKind kind : {ShardKind::master, ShardKind::m, ShardKind::v}) {
    if (Status status = store.add_shard({unit, kind}, uint64_t(numel) * 4, home); !status)
      return status;
  }
  return Status::ok();
}

Status StreamedOptimizer::step(const Optimizer& optimizer, const StepPlan& plan,
                               std::span<const StreamedOptimizerUnit> units) {
  if (!plan.apply) return Status::ok();
  std::vector<Chunk> chunks;
  std::vector<StreamItem> items;
  for (size_t u = 0; u < units.size(); ++u) {
    const StreamedOptimizerUnit& unit = units[u];
    if (unit.numel > 0 && unit.grad == nullptr)
      return Status::error(fmt::format("streamed optimizer: unit {} has no gradient", unit.unit));
    for (int64_t begin = 0; begin < unit.numel; begin += options_.chunk_elements) {
      const int64_t numel = std::min(options_.chunk_elements, unit.numel - begin);
      chunks.push_back({u, begin, numel});
      StreamItem item;
      for (ShardKind kind : {unit.master_kind, ShardKind::m, ShardKind::v})
        item.pieces.push_back(
            StreamPiece{{unit.unit, kind}, uint64_t(begin) * 4, uint64_t(numel) * 4});
      items.push_back(std::move(item));
    }
  }

  std::vector<ShardSegment> segments;
  auto update_chunk = [&](size_t index, std::span<std::byte* const> pieces) -> Status {
    const Chunk& chunk = chunks[index];
    const StreamedOptimizerUnit& unit = units[chunk.unit];
    const int64_t end = chunk.begin + chunk.numel;
    segments.clear();
    for (const ShardSegment& segment : unit.segments) {
      const int64_t begin = std::max(segment.begin, chunk.begin);
      const int64_t stop = std::min(segment.end, end);
      if (begin < stop)
        segments.push_back({begin - chunk.begin, stop - chunk.begin, segment.group});
    }
    OptimizerShard shard;
    shard.arrays.numel = chunk.numel;
    shard.arrays.master = reinterpret_cast<float*>(pieces[0]);
    shard.arrays.exp_avg = reinterpret_cast<float*>(pieces[1]);
    shard.arrays.exp_avg_sq = reinterpret_cast<float*>(pieces[2]);
    shard.arrays.grad = offset_elements(unit.grad, chunk.begin, unit.grad_type);
    shard.arrays.grad_type = unit.grad_type;
    // The kernel writes a bf16/fp16 copy in its pass; an fp32 copy is the new master itself.
    void* copy = unit.copy
                     ? const_cast<void*>(offset_elements(unit.copy, chunk.begin, unit.copy_type))
                     : nullptr;
    const bool narrow_copy = copy != nullptr && unit.copy_type != kernels::cpu::ElementType::f32;
    shard.arrays.copy = narrow_copy ? copy : nullptr;
    shard.arrays.copy_type = unit.copy_type;
    shard.segments = segments;
    Status status = optimizer.update_shard(plan, shard);
    if (status && copy != nullptr && !narrow_copy)
      std::memcpy(copy, pieces[0], size_t(chunk.numel) * 4);
    return status.with_context(
        fmt::format("unit {} elements [{}, {})", unit.unit, chunk.begin, end));
  };
  return pass_->run(items, update_chunk).with_context("streamed optimizer step");
}

}  // namespace strata
