#include "core/optimizer/streamed_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace strata {
namespace {

using tiers::ShardKind;
using tiers::StreamItem;
using tiers::StreamPiece;

void* offset_elements(const void* base, int64_t elements, kernels::cpu::ElementType type) {
  return const_cast<std::byte*>(static_cast<const std::byte*>(base)) +
         elements * int64_t(kernels::cpu::element_size(type));
}

int64_t moment_bytes(kernels::cpu::AdamWStateType type) {
  return type == kernels::cpu::AdamWStateType::f32    ? 4
         : type == kernels::cpu::AdamWStateType::bf16 ? 2
                                                      : 1;
}

// The int8 blocks of a unit before element `at` (a multiple of 256).
int64_t blocks_before(std::span<const ShardSegment> segments, int64_t at) {
  if (segments.empty()) return at / kernels::cpu::kAdamWInt8Block;
  std::vector<ShardSegment> before;
  for (const ShardSegment& segment : segments)
    if (segment.begin < at)
      before.push_back({segment.begin, std::min(segment.end, at), segment.group});
  return int8_block_count(before, at);
}

// `segments` cut to elements [begin, end), into `within`, relative to begin.
void segments_within(std::span<const ShardSegment> segments, int64_t begin, int64_t end,
                     std::vector<ShardSegment>& within) {
  within.clear();
  for (const ShardSegment& segment : segments) {
    const int64_t from = std::max(segment.begin, begin), stop = std::min(segment.end, end);
    if (from < stop) within.push_back({from - begin, stop - begin, segment.group});
  }
}

// Bytes of one element of an item: master, m, v, the stored gradient, the copy.
uint64_t element_bytes(const StreamedOptimizerOptions& options) {
  return uint64_t(4 + 2 * moment_bytes(options.state_type) + (options.grads_in_store ? 4 : 0) +
                  options.copy_bytes);
}

// A replay's gradient: zeros, as many elements as one update takes at a time
// (a default chunk). Zero-initialised and not const, so it lives in .bss, not
// in the binary: its pages are the system's zero page until written, and
// nothing writes them (the kernels read gradients only).
constexpr int64_t kZeroGradientElements = kOptimizerChunkElements;
float zero_gradients[kZeroGradientElements];

}  // namespace

uint64_t StreamedOptimizer::host_buffer_bytes(const StreamedOptimizerOptions& options) {
  return uint64_t(options.buffer_count) * uint64_t(options.chunk_elements) * element_bytes(options);
}

Result<std::unique_ptr<StreamedOptimizer>> StreamedOptimizer::create(
    tiers::TieredStore& store, StreamedOptimizerOptions options) {
  // Chunks start at multiples of chunk_elements * 4 bytes, which must be I/O-aligned.
  const bool compact = options.state_type != kernels::cpu::AdamWStateType::f32;
  const int64_t granule = compact ? 4096 : 1024;
  if (options.chunk_elements <= 0 || options.chunk_elements % granule != 0)
    return Status::error(fmt::format(
        "streamed optimizer: chunk of {} elements; it must be a positive multiple of {} (4 KiB "
        "of {}); check sub_group_size",
        options.chunk_elements, granule, compact ? "the compact moments" : "fp32"));
  tiers::StreamedPassOptions pass_options;
  pass_options.buffer_count = options.buffer_count;
  pass_options.buffer_bytes = uint64_t(options.chunk_elements) * element_bytes(options);
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

void StreamedOptimizer::chunk_items(std::span<const StreamedOptimizerUnit> units, bool grads,
                                    std::vector<Chunk>* chunks,
                                    std::vector<tiers::StreamItem>* items,
                                    size_t max_items) const {
  const uint64_t mb = uint64_t(moment_bytes(options_.state_type));
  for (size_t u = 0; u < units.size(); ++u) {
    const StreamedOptimizerUnit& unit = units[u];
    const int64_t unit_numel = unit.shard.numel;
    for (int64_t begin = 0; begin < unit_numel; begin += options_.chunk_elements) {
      const int64_t numel = std::min(options_.chunk_elements, unit_numel - begin);
      if (chunks != nullptr) chunks->push_back({u, begin, numel});
      StreamItem item;
      item.pieces.push_back(
          StreamPiece{{unit.unit, unit.master_kind}, uint64_t(begin) * 4, uint64_t(numel) * 4});
      for (ShardKind kind : {ShardKind::m, ShardKind::v})
        item.pieces.push_back(
            StreamPiece{{unit.unit, kind}, uint64_t(begin) * mb, uint64_t(numel) * mb});
      if (grads && options_.grads_in_store) {
        StreamPiece grad{{unit.unit, ShardKind::grad},
                         uint64_t(unit.grad_offset + begin) * 4,
                         uint64_t(numel) * 4};
        grad.write = false;
        item.pieces.push_back(grad);
      }
      items->push_back(std::move(item));
      if (items->size() >= max_items) return;
    }
  }
}

Status StreamedOptimizer::step(const Optimizer& optimizer, const StepDecision& decision,
                               std::span<const StreamedOptimizerUnit> units,
                               std::span<const StreamedOptimizerUnit> next) {
  if (!decision.apply) return Status::ok();
  const kernels::cpu::AdamWStateType state_type = options_.state_type;
  const bool int8 = state_type == kernels::cpu::AdamWStateType::int8;
  for (const StreamedOptimizerUnit& unit : units) {
    const kernels::cpu::AdamWShard& shard = unit.shard;
    if (shard.state_type != state_type)
      return Status::error(
          fmt::format("streamed optimizer: unit {} has {} state in a pass over {} state", unit.unit,
                      kernels::cpu::adamw_state_type_name(shard.state_type),
                      kernels::cpu::adamw_state_type_name(state_type)));
    if (shard.numel > 0 && shard.grad == nullptr && !options_.grads_in_store)
      return Status::error(fmt::format("streamed optimizer: unit {} has no gradient", unit.unit));
    if (shard.numel > 0 && int8 &&
        (shard.exp_avg_scale == nullptr || shard.exp_avg_sq_scale == nullptr))
      return Status::error(
          fmt::format("streamed optimizer: unit {} has int8 state but no scales", unit.unit));
  }
  std::vector<Chunk> chunks;
  std::vector<StreamItem> items;
  chunk_items(units, true, &chunks, &items, SIZE_MAX);

  std::vector<ShardSegment> segments;
  auto update_chunk = [&](size_t index, std::span<std::byte* const> pieces) -> Status {
    const Chunk& chunk = chunks[index];
    const StreamedOptimizerUnit& unit = units[chunk.unit];
    const kernels::cpu::AdamWShard& whole = unit.shard;
    const int64_t end = chunk.begin + chunk.numel;
    segments_within(whole.segments, chunk.begin, end, segments);
    // The chunk as a shard of its own: its state in the pass's buffers, its
    // part of the gradient (or the store's, a fourth piece), copy and scales.
    kernels::cpu::AdamWShard part = whole;
    part.numel = chunk.numel;
    part.master = reinterpret_cast<float*>(pieces[0]);
    part.exp_avg = pieces[1];
    part.exp_avg_sq = pieces[2];
    if (int8) {
      const int64_t first = blocks_before(whole.segments, chunk.begin);
      part.exp_avg_scale = whole.exp_avg_scale + first;
      part.exp_avg_sq_scale = whole.exp_avg_sq_scale + first;
    }
    if (options_.grads_in_store) {
      part.grad = pieces[3];
      part.grad_type = kernels::cpu::ElementType::f32;
    } else {
      part.grad = offset_elements(whole.grad, chunk.begin, whole.grad_type);
    }
    if (whole.copy != nullptr)
      part.copy = offset_elements(whole.copy, chunk.begin, whole.copy_type);
    part.segments = segments;
    return optimizer.update_shard(decision, part)
        .with_context(fmt::format("unit {} elements [{}, {})", unit.unit, chunk.begin, end));
  };
  std::vector<StreamItem> next_items;
  chunk_items(next, false, nullptr, &next_items, options_.buffer_count);
  return pass_->run(items, update_chunk, next_items).with_context("streamed optimizer step");
}

Status StreamedOptimizer::step_ranges(const Optimizer& optimizer, const StreamedOptimizerUnit& unit,
                                      std::span<const ElementRange> windows,
                                      std::span<const RangeUpdate> ranges, bool zero_gradient) {
  const kernels::cpu::AdamWShard& whole = unit.shard;
  if (whole.state_type != options_.state_type)
    return Status::error(
        fmt::format("streamed optimizer: a ranged update of unit {} over {} state in a pass over "
                    "{} state",
                    unit.unit, kernels::cpu::adamw_state_type_name(whole.state_type),
                    kernels::cpu::adamw_state_type_name(options_.state_type)));
  const bool int8 = options_.state_type == kernels::cpu::AdamWStateType::int8;
  for (const ElementRange& w : windows)
    if (int8 && w.begin % kernels::cpu::kAdamWInt8Block != 0)
      return Status::error(fmt::format(
          "streamed optimizer: a ranged update of unit {}'s int8 moments in a window from "
          "element {}, not a whole block (plan error)",
          unit.unit, w.begin));
  const bool grads = !zero_gradient && options_.grads_in_store;
  if (!zero_gradient && !grads && whole.grad == nullptr)
    return Status::error(fmt::format("streamed optimizer: unit {} has no gradient", unit.unit));
  const uint64_t mb = uint64_t(moment_bytes(options_.state_type));
  const uint64_t cb = uint64_t(options_.copy_bytes);
  std::vector<StreamItem> items;
  for (const ElementRange& w : windows) {
    const uint64_t begin = uint64_t(w.begin), n = uint64_t(w.end - w.begin);
    StreamItem item;
    item.pieces.push_back(StreamPiece{{unit.unit, unit.master_kind}, begin * 4, n * 4});
    for (ShardKind kind : {ShardKind::m, ShardKind::v})
      item.pieces.push_back(StreamPiece{{unit.unit, kind}, begin * mb, n * mb});
    if (grads) {
      StreamPiece grad{
          {unit.unit, ShardKind::grad}, uint64_t(unit.grad_offset) * 4 + begin * 4, n * 4};
      grad.write = false;
      item.pieces.push_back(grad);
    }
    if (cb > 0)
      item.pieces.push_back(StreamPiece{{unit.unit, ShardKind::param}, begin * cb, n * cb});
    items.push_back(std::move(item));
  }
  std::vector<ShardSegment> segments;
  auto visit = [&](size_t index, std::span<std::byte* const> pieces) -> Status {
    // The window as a shard of its own, its state in the pass's pieces.
    const ElementRange& w = windows[index];
    kernels::cpu::AdamWShard window = whole;
    window.numel = w.end - w.begin;
    window.master = reinterpret_cast<float*>(pieces[0]);
    window.exp_avg = pieces[1];
    window.exp_avg_sq = pieces[2];
    if (int8) {  // the window starts on a block: its scales are a run of the unit's
      const int64_t first = blocks_before(whole.segments, w.begin);
      window.exp_avg_scale = whole.exp_avg_scale + first;
      window.exp_avg_sq_scale = whole.exp_avg_sq_scale + first;
    }
    if (grads) {
      window.grad = pieces[3];
      window.grad_type = kernels::cpu::ElementType::f32;
    } else if (!zero_gradient) {
      window.grad = offset_elements(whole.grad, w.begin, whole.grad_type);
    }
    if (cb > 0)
      window.copy = pieces[grads ? 4 : 3];
    else if (whole.copy != nullptr)
      window.copy = offset_elements(whole.copy, w.begin, whole.copy_type);
    segments_within(whole.segments, w.begin, w.end, segments);
    window.segments = segments;
    for (const RangeUpdate& range : ranges) {
      const int64_t begin = std::max(range.elements.begin, w.begin);
      const int64_t end = std::min(range.elements.end, w.end);
      if (begin >= end) continue;
      if (Status s = update_elements(optimizer, window, begin - w.begin, end - w.begin,
                                     range.decisions, zero_gradient);
          !s)
        return s.with_context(fmt::format("unit {} elements [{}, {})", unit.unit, begin, end));
    }
    return Status::ok();
  };
  return pass_->run(items, visit).with_context("streamed optimizer ranged update");
}

Status update_elements(const Optimizer& optimizer, const kernels::cpu::AdamWShard& shard,
                       int64_t begin, int64_t end, std::span<const StepDecision> decisions,
                       bool zero_gradient) {
  const bool int8 = shard.state_type == kernels::cpu::AdamWStateType::int8;
  const int64_t block = kernels::cpu::kAdamWInt8Block;
  if (int8 && (begin % block != 0 || (end % block != 0 && end != shard.numel)))
    return Status::error(fmt::format(
        "a ranged update of int8 moments over elements [{}, {}), not whole {}-element blocks "
        "(plan error)",
        begin, end, block));
  if (int8 && (shard.exp_avg_scale == nullptr || shard.exp_avg_sq_scale == nullptr))
    return Status::error("a ranged update of int8 moments without their scales");
  if (!zero_gradient && shard.grad == nullptr)
    return Status::error("a ranged update without a gradient");
  const int64_t mb = moment_bytes(shard.state_type);
  std::vector<ShardSegment> segments;
  // A zero gradient is read in pieces of the zeros there are; the kernel works
  // element by element, so the pieces give the bits of one pass.
  const int64_t piece = zero_gradient ? kZeroGradientElements : end - begin;
  for (int64_t at = begin; at < end; at += piece) {
    const int64_t stop = std::min(end, at + piece);
    segments_within(shard.segments, at, stop, segments);
    kernels::cpu::AdamWShard part = shard;
    part.numel = stop - at;
    part.master = shard.master + at;
    part.exp_avg = static_cast<std::byte*>(shard.exp_avg) + at * mb;
    part.exp_avg_sq = static_cast<std::byte*>(shard.exp_avg_sq) + at * mb;
    // Both ends on block boundaries and `at` a multiple of 256: the part's
    // blocks are the shard's, and its scales a run of the shard's.
    if (int8) {
      const int64_t first = blocks_before(shard.segments, at);
      part.exp_avg_scale = shard.exp_avg_scale + first;
      part.exp_avg_sq_scale = shard.exp_avg_sq_scale + first;
    }
    if (zero_gradient) {
      part.grad = zero_gradients;
      part.grad_type = kernels::cpu::ElementType::f32;
    } else {
      part.grad = offset_elements(shard.grad, at, shard.grad_type);
    }
    if (shard.copy != nullptr) part.copy = offset_elements(shard.copy, at, shard.copy_type);
    part.segments = segments;
    for (const StepDecision& decision : decisions) {
      if (!decision.apply) continue;
      if (Status s = optimizer.update_shard(decision, part); !s)
        return s.with_context(fmt::format("step {}", decision.step));
    }
  }
  return Status::ok();
}

}  // namespace strata
