// Deferred expert updates: where they apply, the ranges and windows a
// ranged update moves, the ledger of waiting experts and a step's bytes
// (core/plan/expert_update.h).
#include "core/plan/expert_update.h"

#include <algorithm>

#include "io/base/sizes.h"
#include "kernels/cpu/adamw_shard.h"

namespace strata {
namespace {

using tiers::Tier;

void join(std::vector<ElementRange>& ranges, ElementRange next) {
  if (next.begin >= next.end) return;
  if (!ranges.empty() && ranges.back().end >= next.begin)
    ranges.back().end = std::max(ranges.back().end, next.end);
  else
    ranges.push_back(next);
}

// The first replaying operation of each deferring unit in the step, by op index.
std::vector<uint8_t> first_replays(const TrainingPlan& plan) {
  std::vector<uint8_t> first(plan.ops.size(), 0);
  std::vector<uint8_t> seen(plan.units.size(), 0);
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    if (!replays_expert_updates(plan, op)) continue;
    if (seen[size_t(op.unit)]) continue;
    seen[size_t(op.unit)] = 1;
    first[i] = 1;
  }
  return first;
}

int64_t elements_in(const std::vector<ElementRange>& ranges) {
  int64_t sum = 0;
  for (const ElementRange& r : ranges) sum += r.end - r.begin;
  return sum;
}

std::vector<uint8_t> chosen_of(const std::vector<DeferredSteps>& due, size_t experts) {
  std::vector<uint8_t> chosen(experts, 0);
  for (const DeferredSteps& d : due) chosen[size_t(d.expert)] = 1;
  return chosen;
}

int64_t most(int64_t a, int64_t b) {
  return std::max(a, b);
}

// Window bytes: read and written each the most of either.
WindowBytes most(WindowBytes a, WindowBytes b) {
  return {std::max(a.read, b.read), std::max(a.written, b.written)};
}

// count(r) for `rank`; for -1 the most of any rank's (counted_ranks).
template <typename Count>
auto most_of_ranks(const TrainingPlan& plan, int rank, Count count) {
  const RankSpan ranks = counted_ranks(plan, rank);
  auto result = count(ranks.first);
  for (int r = ranks.first + 1; r < ranks.end; ++r) result = most(result, count(r));
  return result;
}

}  // namespace

bool plan_defers_expert_updates(const PlanInput& in, bool routed, std::string& why) {
  why.clear();
  if (!in.model.is_moe()) return false;
  const char* off = nullptr;
  if (!in.expert_update_deferred)
    off = "strata.expert_update eager";
  else if (!routed)
    off = "the experts are not read as routed (see expert fetch)";
  else if (in.gpu && in.offload_optimizer == OffloadDevice::none)
    off = "the optimizer state is on the GPU, whose update steps every element";
  if (off != nullptr) {
    why = std::string("eager: every expert takes its AdamW step every step (") + off + ")";
    return false;
  }
  why =
      "deferred: an expert no token reached is stepped when next read, its missed steps "
      "replayed exactly (worst case counted: every expert replayed and updated)";
  return true;
}

bool defers_expert_updates(const TrainingPlan& plan, int unit) {
  return plan.deferred_expert_updates && routes_expert_reads(plan, unit);
}

ElementRange waiting_range(const TrainingPlan& plan, int unit, int64_t expert, int rank) {
  const ExpertBlocks experts = expert_blocks(plan.layout, unit);
  const int64_t shard = plan.optimizer_offset(unit, rank);
  const int64_t numel = plan.units[size_t(unit)].optimizer_numel;
  // The expert's part of the shard, in the shard's elements.
  const int64_t in_unit = experts.offset + (expert - experts.first) * experts.numel;
  const int64_t begin = std::clamp(in_unit - shard, int64_t{0}, numel);
  const int64_t end = std::clamp(in_unit + experts.numel - shard, int64_t{0}, numel);
  if (begin == end || plan.input.optimizer_state != OptimizerStateDtype::int8) return {begin, end};
  // The shard's int8 blocks are its 256-element windows, cut where a
  // segment (a tensor) ends: every block between the expert's part's first
  // and last multiples of 256 lies wholly inside it, its scale the largest
  // of the expert's own elements.
  const int64_t block = kernels::cpu::kAdamWInt8Block;
  const int64_t first = round_up(begin, block), last = end / block * block;
  return first < last ? ElementRange{first, last} : ElementRange{first, first};
}

std::vector<ElementRange> expert_update_ranges(const TrainingPlan& plan, int unit,
                                               const std::vector<uint8_t>& chosen, bool with_rest,
                                               int rank) {
  const ExpertBlocks experts = expert_blocks(plan.layout, unit);
  const int64_t numel = plan.units[size_t(unit)].optimizer_numel;
  std::vector<ElementRange> ranges;
  int64_t rest = 0;  // where the part that never waits resumes
  for (int64_t e = 0; e < experts.count; ++e) {
    const ElementRange waits = waiting_range(plan, unit, experts.first + e, rank);
    if (waits.begin == waits.end) continue;
    if (with_rest) join(ranges, {rest, waits.begin});
    if (chosen[size_t(experts.first + e)]) join(ranges, waits);
    rest = waits.end;
  }
  if (with_rest) join(ranges, {rest, numel});
  return ranges;
}

std::vector<ElementRange> update_windows(const TrainingPlan& plan, int unit,
                                         const std::vector<ElementRange>& ranges) {
  const int64_t block = int64_t(plan.input.nvme_alignment);
  const int64_t chunk = plan.optimizer_chunk_elements;
  const int64_t numel = plan.units[size_t(unit)].optimizer_numel;
  std::vector<ElementRange> widened;
  for (const ElementRange& r : ranges)
    join(widened, {r.begin / block * block, std::min(round_up(r.end, block), numel)});
  std::vector<ElementRange> windows;
  for (const ElementRange& w : widened) {
    for (int64_t at = w.begin; at < w.end;) {
      const int64_t stop = std::min(w.end, (at / chunk + 1) * chunk);
      windows.push_back({at, stop});
      at = stop;
    }
  }
  return windows;
}

WindowBytes window_bytes(const TrainingPlan& plan, const std::vector<ElementRange>& windows,
                         bool with_gradient) {
  const int64_t alignment = int64_t(plan.input.nvme_alignment);
  const int64_t copy = plan.homes.separate_master ? plan.compute_bytes : 0;
  const bool state_on_nvme = plan.homes.optimizer == Tier::nvme;
  WindowBytes bytes;
  for (const ElementRange& w : windows) {
    const int64_t n = w.end - w.begin;
    const int64_t copy_bytes = copy > 0 ? round_up(n * copy, alignment) : 0;
    if (!state_on_nvme) {  // stepped in host memory: the copy is written
      bytes.written += copy_bytes;
      continue;
    }
    const int64_t state =
        round_up(n * 4, alignment) + 2 * round_up(n * plan.moment_bytes(), alignment) + copy_bytes;
    bytes.read += state;
    bytes.written += state;
    if (with_gradient && plan.homes.grad == Tier::nvme) bytes.read += round_up(n * 4, alignment);
  }
  return bytes;
}

WindowBytes worst_update_bytes(const TrainingPlan& plan, int unit, int rank) {
  const std::vector<uint8_t> every(size_t(plan.layout.config.num_experts), 1);
  return most_of_ranks(plan, rank, [&](int r) {
    return window_bytes(
        plan, update_windows(plan, unit, expert_update_ranges(plan, unit, every, true, r)), false);
  });
}

bool moves_gradient_windows(const TrainingPlan& plan, int unit) {
  return plan.homes.grad == Tier::nvme && defers_expert_updates(plan, unit);
}

std::vector<tiers::ByteRange> byte_windows(const std::vector<ElementRange>& windows,
                                           int64_t element_bytes) {
  std::vector<tiers::ByteRange> ranges;
  for (const ElementRange& w : windows)
    ranges.push_back(
        {uint64_t(w.begin * element_bytes), uint64_t((w.end - w.begin) * element_bytes)});
  return ranges;
}

std::vector<tiers::ByteRange> gradient_windows(const TrainingPlan& plan, int unit,
                                               const std::vector<uint8_t>& touched, int rank) {
  return byte_windows(
      update_windows(plan, unit, expert_update_ranges(plan, unit, touched, true, rank)), 4);
}

std::vector<uint8_t> touched_through(const StepRouting& routing, int unit, int micro) {
  const std::vector<std::vector<uint8_t>>& micros = routing[size_t(unit)];
  std::vector<uint8_t> touched(micros.empty() ? 0 : micros[0].size(), 0);
  for (int m = 0; m <= micro; ++m)
    for (size_t e = 0; e < touched.size(); ++e) touched[e] |= micros[size_t(m)][e];
  return touched;
}

ExpertUpdateLedger::ExpertUpdateLedger(const TrainingPlan& plan) {
  waiting_.resize(plan.units.size());
  experts_.resize(plan.units.size());
  for (int u = 0; u < int(plan.units.size()); ++u) {
    if (!defers_expert_updates(plan, u)) continue;
    waiting_[size_t(u)].assign(size_t(plan.layout.config.num_experts), DeferredSteps{});
    const ExpertBlocks experts = expert_blocks(plan.layout, u);
    experts_[size_t(u)] = {experts.first, experts.first + experts.count};
  }
}

std::vector<DeferredSteps> ExpertUpdateLedger::take_due(int unit,
                                                        const std::vector<uint8_t>& needed) {
  std::vector<DeferredSteps> due;
  std::vector<DeferredSteps>& experts = waiting_[size_t(unit)];
  for (size_t e = 0; e < experts.size(); ++e) {
    if (!needed[e] || experts[e].first == 0) continue;
    due.push_back({int(e), experts[e].first, experts[e].last});
    experts[e] = DeferredSteps{};
  }
  return due;
}

std::vector<DeferredSteps> ExpertUpdateLedger::take_all(int unit) {
  return take_due(unit, std::vector<uint8_t>(waiting_[size_t(unit)].size(), 1));
}

void ExpertUpdateLedger::defer_idle(int unit, const std::vector<uint8_t>& active, int64_t step) {
  std::vector<DeferredSteps>& experts = waiting_[size_t(unit)];
  const auto [first, end] = experts_[size_t(unit)];
  for (size_t e = size_t(first); e < size_t(end); ++e) {
    if (active[e]) continue;
    if (experts[e].first == 0) experts[e] = {int(e), step, step};
    experts[e].last = step;
  }
}

int64_t ExpertUpdateLedger::oldest_waited() const {
  int64_t oldest = 0;
  for (const auto& experts : waiting_)
    for (const DeferredSteps& d : experts)
      if (d.first != 0 && (oldest == 0 || d.first < oldest)) oldest = d.first;
  return oldest;
}

bool replays_expert_updates(const TrainingPlan& plan, const PlanOp& op) {
  if (op.unit < 0 || !defers_expert_updates(plan, op.unit)) return false;
  return op.kind == (shares_routing(plan, op.unit) ? OpKind::share : OpKind::forward);
}

namespace {

// The most one step's replays of unit u move at `rank`: every expert
// replayed (each at most once a step). With one micro-batch a step they are
// one operation's, their windows joined. With several, experts replayed at
// different micro-batches are widened to whole blocks apart (two neighbours
// that share a block, replayed at two micro-batches, move it twice): the
// bound is each expert's own windows, summed.
WindowBytes worst_replay_bytes(const TrainingPlan& plan, int u, int rank) {
  const ExpertBlocks experts = expert_blocks(plan.layout, u);
  if (plan.input.grad_accum == 1) {
    const std::vector<uint8_t> every(size_t(plan.layout.config.num_experts), 1);
    return window_bytes(
        plan, update_windows(plan, u, expert_update_ranges(plan, u, every, false, rank)), false);
  }
  std::vector<ElementRange> apart;
  for (int64_t e = 0; e < experts.count; ++e) {
    const ElementRange waits = waiting_range(plan, u, experts.first + e, rank);
    if (waits.begin == waits.end) continue;
    for (const ElementRange& w : update_windows(plan, u, {waits})) apart.push_back(w);
  }
  return window_bytes(plan, apart, false);
}

}  // namespace

std::vector<WindowBytes> deferred_replay_bytes_per_op(const TrainingPlan& plan, int rank) {
  std::vector<WindowBytes> bytes(plan.ops.size());
  if (!plan.deferred_expert_updates) return bytes;
  const std::vector<uint8_t> first = first_replays(plan);
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    if (!first[i]) continue;
    const int u = plan.ops[i].unit;
    bytes[i] = most_of_ranks(plan, rank, [&](int r) { return worst_replay_bytes(plan, u, r); });
  }
  return bytes;
}

RoutedStep routed_step(const TrainingPlan& plan, const StepRouting& routing,
                       ExpertUpdateLedger& ledger, int64_t step, int rank) {
  RoutedStep out;
  out.traffic = traffic_per_op(plan);
  out.adamw_elements.assign(plan.ops.size(), -1);
  out.summed_elements.assign(plan.ops.size(), -1);
  std::vector<StepTraffic>& traffic = out.traffic;
  if (!plan.routed_expert_fetch) return out;
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    // (one rank only: its shard is the unit)
    if (op.kind != OpKind::reduce || !sums_routed_gradients(plan, op.unit)) continue;
    const std::vector<uint8_t> reached = plan.gpu_grads_summed_on_device()
                                             ? touched_through(routing, op.unit, op.micro)
                                             : routing[size_t(op.unit)][size_t(op.micro)];
    out.summed_elements[i] = elements_in(expert_update_ranges(plan, op.unit, reached, true, 0));
  }
  // The routed computations' expert reads of this routing instead of the
  // worst case's (traffic_per_op's: at each operation the most of any rank).
  const std::vector<int64_t> worst = routed_expert_reads_per_op(plan, nullptr);
  const std::vector<int64_t> routed = routed_expert_reads_per_op(plan, &routing, rank);
  for (size_t i = 0; i < plan.ops.size(); ++i) traffic[i].nvme_read += routed[i] - worst[i];
  if (!plan.deferred_expert_updates) return out;
  // Likewise below: the worst case traffic_per_op counted out, this
  // routing's at `rank` counted in.
  const std::vector<WindowBytes> replays = deferred_replay_bytes_per_op(plan);
  const size_t E = size_t(plan.layout.config.num_experts);
  const std::vector<uint8_t> every(E, 1);
  auto windows_of = [&](int u, const std::vector<uint8_t>& chosen, bool with_rest,
                        bool with_gradient) {
    return most_of_ranks(plan, rank, [&](int r) {
      return window_bytes(
          plan, update_windows(plan, u, expert_update_ranges(plan, u, chosen, with_rest, r)),
          with_gradient);
    });
  };
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    if (!defers_expert_updates(plan, op.unit)) continue;
    const int u = op.unit;
    StepTraffic& t = traffic[i];
    if (op.kind == OpKind::reduce && moves_gradient_windows(plan, u)) {
      // The worst case wrote (and from the second micro-batch on, in the
      // micro-batch order, read back) the whole gradient.
      const PlanInput& in = plan.input;
      const bool last = op.micro == in.grad_accum - 1;
      if (plan.layer_major() && !last) continue;
      const int64_t whole =
          round_up(plan.units[size_t(u)].grad_numel * 4, int64_t(in.nvme_alignment));
      auto bytes = [&](int micro) {
        const std::vector<uint8_t> touched = touched_through(routing, u, micro);
        return most_of_ranks(plan, rank, [&](int r) {
          int64_t sum = 0;
          for (const tiers::ByteRange& w : gradient_windows(plan, u, touched, r))
            sum += int64_t(w.bytes);
          return sum;
        });
      };
      t.nvme_written += bytes(op.micro) - whole;
      if (op.micro > 0 && !plan.layer_major()) t.nvme_read += bytes(op.micro - 1) - whole;
    } else if (replays_expert_updates(plan, op)) {
      t.nvme_read -= replays[i].read;
      t.nvme_written -= replays[i].written;
      const std::vector<DeferredSteps> due =
          ledger.take_due(u, routing[size_t(u)][size_t(op.micro)]);
      if (due.empty()) continue;
      const WindowBytes replayed = windows_of(u, chosen_of(due, E), false, false);
      t.nvme_read += replayed.read;
      t.nvme_written += replayed.written;
      out.adamw_elements[i] = most_of_ranks(plan, rank, [&](int r) {
        int64_t elements = 0;
        for (const DeferredSteps& d : due) {
          const ElementRange w = waiting_range(plan, u, d.expert, r);
          elements += (w.end - w.begin) * (d.last - d.first + 1);
        }
        return elements;
      });
    } else if (op.kind == OpKind::optimizer) {
      const std::vector<uint8_t> active =
          touched_through(routing, u, int(plan.input.grad_accum) - 1);
      const WindowBytes all = windows_of(u, every, true, true);
      const WindowBytes updated = windows_of(u, active, true, true);
      t.nvme_read += updated.read - all.read;
      t.nvme_written += updated.written - all.written;
      out.adamw_elements[i] = most_of_ranks(plan, rank, [&](int r) {
        return elements_in(expert_update_ranges(plan, u, active, true, r));
      });
      ledger.defer_idle(u, active, step);
    }
  }
  return out;
}

std::vector<int64_t> deferred_replay_elements_per_op(const TrainingPlan& plan, int rank) {
  std::vector<int64_t> elements(plan.ops.size(), -1);
  if (!plan.deferred_expert_updates) return elements;
  const std::vector<uint8_t> first = first_replays(plan);
  const std::vector<uint8_t> every(size_t(plan.layout.config.num_experts), 1);
  for (size_t i = 0; i < plan.ops.size(); ++i)
    if (first[i])
      elements[i] = most_of_ranks(plan, rank, [&](int r) {
        return elements_in(expert_update_ranges(plan, plan.ops[i].unit, every, false, r));
      });
  return elements;
}

WindowBytes deferred_step_nvme_bytes(const TrainingPlan& plan, const StepRouting& routing,
                                     ExpertUpdateLedger& ledger, int rank) {
  // The bytes need only whether an expert waits: each step is marked as step 1.
  const StepTraffic step = total_traffic(routed_step(plan, routing, ledger, 1, rank).traffic);
  return {step.nvme_read, step.nvme_written};
}

RecordedStepBytes recorded_step_bytes(const TrainingPlan& plan,
                                      const std::vector<StepRouting>& steps) {
  RecordedStepBytes out;
  out.worst_read = plan.traffic_per_step.nvme_read;
  out.worst_written = plan.traffic_per_step.nvme_written;
  ExpertUpdateLedger ledger(plan);
  int64_t read = 0, written = 0;
  for (const StepRouting& routing : steps) {
    WindowBytes step{
        out.worst_read - worst_parameter_reads(plan) + routed_parameter_reads(plan, routing),
        out.worst_written};
    if (plan.deferred_expert_updates) {
      // Every rank's ledger is the same (the ranks join their routings):
      // each rank's step from one copy of it, the most of any rank's.
      ExpertUpdateLedger before = ledger;
      step = deferred_step_nvme_bytes(plan, routing, ledger, 0);
      for (int r = 1; r < plan.input.world_size; ++r) {
        ExpertUpdateLedger of_rank = before;
        step = most(step, deferred_step_nvme_bytes(plan, routing, of_rank, r));
      }
    }
    read += step.read;
    written += step.written;
    out.read_most = std::max(out.read_most, step.read);
    out.written_most = std::max(out.written_most, step.written);
    ++out.steps;
  }
  if (out.steps > 0) {
    out.read_mean = read / out.steps;
    out.written_mean = written / out.steps;
  }
  return out;
}

}  // namespace strata
