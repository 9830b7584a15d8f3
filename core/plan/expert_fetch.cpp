// Routed expert fetch: which units read their experts as routed, the ranges
// they read, and what a step reads for a routing (core/plan/expert_fetch.h).
#include "core/plan/expert_fetch.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>

#include "io/base/sizes.h"

namespace strata {
namespace {

using tiers::ByteRange;

// The compute op's gather: the one of its dependencies that gathers its unit.
int gather_of(const TrainingPlan& plan, const PlanOp& op) {
  for (int d : op.deps)
    if (plan.ops[size_t(d)].kind == OpKind::gather && plan.ops[size_t(d)].unit == op.unit) return d;
  return -1;
}

}  // namespace

bool plan_routes_expert_reads(const PlanInput& in, const StateHomes& homes, std::string& why) {
  why.clear();
  if (!in.model.is_moe()) return false;
  const char* off = nullptr;
  if (in.expert_fetch_all)
    off = "strata.expert_fetch all";
  else if (in.stage != 3)
    off = "it needs stage 3, where a unit is gathered from its shards";
  else if (homes.param != tiers::Tier::nvme)
    off = "the parameters are not on NVMe";
  else if (in.model.layer_pieces != 2)
    off =
        "the routing is known before the experts are read only when the MLP is a unit of its "
        "own (--layer-pieces 2)";
  if (off != nullptr) {
    why = std::string("all: every expert moves with its unit (") + off + ")";
    return false;
  }
  why = in.world_size > 1
            ? "routed: a sparse layer's experts are read from NVMe only when some rank's "
              "micro-batch tokens reach them, the ranks joining their routings first (worst case "
              "counted)"
            : "routed: a sparse layer's experts are read from NVMe only when its micro-batches' "
              "tokens reach them (worst case counted)";
  return true;
}

bool routes_expert_reads(const TrainingPlan& plan, int unit) {
  // (operations of no unit, the exchange and the decision, have unit -1)
  return plan.routed_expert_fetch && unit >= 0 && unit < int(plan.layout.units.size()) &&
         expert_blocks(plan.layout, unit).count > 0;
}

bool shares_routing(const TrainingPlan& plan, int unit) {
  return plan.input.world_size > 1 && routes_expert_reads(plan, unit);
}

std::vector<ByteRange> rank_ranges(const TrainingPlan& plan, int unit,
                                   const std::vector<ByteRange>& ranges, int rank) {
  const uint64_t shard = uint64_t(plan.units[size_t(unit)].shard_numel * plan.compute_bytes);
  const uint64_t begin = uint64_t(rank) * shard, end = begin + shard;
  std::vector<ByteRange> out;
  for (const ByteRange& r : ranges) {
    const uint64_t from = std::max(r.offset, begin), to = std::min(r.offset + r.bytes, end);
    if (from < to) out.push_back({from - begin, to - from});
  }
  return out;
}

int64_t rank_bytes(const TrainingPlan& plan, int unit, const std::vector<ByteRange>& ranges,
                   int rank) {
  int64_t sum = 0;
  for (const ByteRange& range : rank_ranges(plan, unit, ranges, rank)) sum += int64_t(range.bytes);
  return sum;
}

RankSpan counted_ranks(const TrainingPlan& plan, int rank) {
  return rank < 0 ? RankSpan{0, plan.input.world_size} : RankSpan{rank, rank + 1};
}

std::vector<ElementRange> fetched_elements(const TrainingPlan& plan, int unit) {
  const ExpertBlocks experts = expert_blocks(plan.layout, unit);
  const int64_t end = experts.offset + experts.count * experts.numel;
  std::vector<ElementRange> ranges;
  if (experts.offset > 0) ranges.push_back({0, experts.offset});
  if (end < plan.units[size_t(unit)].padded_numel)
    ranges.push_back({end, plan.units[size_t(unit)].padded_numel});
  return ranges;
}

std::vector<ElementRange> expert_elements(const TrainingPlan& plan, int unit,
                                          const std::vector<uint8_t>& needed,
                                          std::vector<uint8_t>& loaded) {
  const ExpertBlocks experts = expert_blocks(plan.layout, unit);
  std::vector<ElementRange> ranges;
  for (int64_t e = 0; e < experts.count; ++e) {
    const size_t expert = size_t(experts.first + e);  // the layer's index
    if (!needed[expert] || loaded[expert]) continue;
    loaded[expert] = 1;
    const int64_t begin = experts.offset + e * experts.numel, end = begin + experts.numel;
    if (!ranges.empty() && ranges.back().end == begin)
      ranges.back().end = end;
    else
      ranges.push_back({begin, end});
  }
  return ranges;
}

bool sums_routed_gradients(const TrainingPlan& plan, int unit) {
  const PlanInput& in = plan.input;
  const bool host_memory = !in.gpu || plan.homes.grad != tiers::Tier::device;
  return routes_expert_reads(plan, unit) && in.world_size == 1 && !in.reduce_in_bf16 &&
         host_memory && !plan.homes.grad_bf16 && plan.homes.grad != tiers::Tier::nvme;
}

std::vector<ByteRange> fetched_ahead(const TrainingPlan& plan, int unit, uint64_t alignment) {
  const ExpertBlocks experts = expert_blocks(plan.layout, unit);
  const uint64_t cb = uint64_t(plan.compute_bytes);
  const uint64_t begin = round_up(uint64_t(experts.offset) * cb, alignment);
  const uint64_t end =
      uint64_t(experts.offset + experts.count * experts.numel) * cb / alignment * alignment;
  const uint64_t size = round_up(uint64_t(plan.units[size_t(unit)].padded_numel) * cb, alignment);
  std::vector<ByteRange> ranges;
  if (begin > 0) ranges.push_back({0, begin});
  if (end < size) ranges.push_back({end, size - end});
  return ranges;
}

std::vector<int> micros_read_ahead(const TrainingPlan& plan, int fetch) {
  const PlanOp& op = plan.ops[size_t(fetch)];
  std::vector<int> micros;
  if (op.kind != OpKind::fetch || !routes_expert_reads(plan, op.unit)) return micros;
  for (int d : op.deps) {
    const PlanOp& dep = plan.ops[size_t(d)];
    if (dep.kind == OpKind::forward && dep.unit == op.unit) micros.push_back(dep.micro);
  }
  return micros;
}

std::vector<uint8_t> experts_read_ahead(const TrainingPlan& plan, int fetch,
                                        const StepRouting* routing) {
  const int u = plan.ops[size_t(fetch)].unit;
  std::vector<uint8_t> experts(size_t(std::max<int64_t>(plan.layout.config.num_experts, 0)), 0);
  for (int m : micros_read_ahead(plan, fetch))
    for (size_t e = 0; e < experts.size(); ++e)
      experts[e] |= routing == nullptr || (*routing)[size_t(u)][size_t(m)][e] != 0;
  return experts;
}

std::vector<ByteRange> fetch_ranges(const TrainingPlan& plan, int unit,
                                    const std::vector<uint8_t>& experts, uint64_t alignment,
                                    bool apart) {
  std::vector<ByteRange> ranges = fetched_ahead(plan, unit, alignment);
  std::vector<uint8_t> loaded(experts.size(), 0);
  for (const ByteRange& r : expert_reads(plan, unit, experts, loaded, alignment, apart))
    ranges.push_back(r);
  if (apart) return ranges;
  std::sort(ranges.begin(), ranges.end(),
            [](const ByteRange& a, const ByteRange& b) { return a.offset < b.offset; });
  std::vector<ByteRange> merged;
  for (const ByteRange& r : ranges) {
    if (!merged.empty() && merged.back().offset + merged.back().bytes >= r.offset)
      merged.back().bytes =
          std::max(merged.back().offset + merged.back().bytes, r.offset + r.bytes) -
          merged.back().offset;
    else
      merged.push_back(r);
  }
  return merged;
}

std::vector<ByteRange> expert_reads(const TrainingPlan& plan, int unit,
                                    const std::vector<uint8_t>& needed,
                                    std::vector<uint8_t>& loaded, uint64_t alignment, bool apart) {
  const ExpertBlocks experts = expert_blocks(plan.layout, unit);
  const uint64_t cb = uint64_t(plan.compute_bytes);
  std::vector<ByteRange> ranges;
  for (int64_t e = 0; e < experts.count; ++e) {
    const size_t expert = size_t(experts.first + e);  // the layer's index
    if (!needed[expert] || loaded[expert]) continue;
    loaded[expert] = 1;
    const uint64_t first = uint64_t(experts.offset + e * experts.numel) * cb;
    const uint64_t begin = first / alignment * alignment;
    const uint64_t end = round_up(first + uint64_t(experts.numel) * cb, alignment);
    if (!apart && !ranges.empty() && ranges.back().offset + ranges.back().bytes >= begin)
      ranges.back().bytes = end - ranges.back().offset;
    else
      ranges.push_back({begin, end - begin});
  }
  return ranges;
}

namespace {

// Per operation, the byte ranges of its unit that a routed read moves (the
// same at every rank: each rank reads its shard's part, rank_bytes), and
// what the operation counts already (a fetch's fewest bytes of fetched_ahead).
struct OpReads {
  std::vector<std::vector<ByteRange>> ranges;
  std::vector<uint8_t> reads;
};

OpReads routed_reads(const TrainingPlan& plan, const StepRouting* routing) {
  OpReads out;
  out.ranges.resize(plan.ops.size());
  out.reads.assign(plan.ops.size(), 0);
  const uint64_t alignment = plan.input.nvme_alignment;
  const bool one_rank = plan.input.world_size == 1;
  const bool apart = routing == nullptr;  // the worst case: each expert's blocks apart
  const size_t E = size_t(plan.layout.config.num_experts);
  const std::vector<uint8_t> every(E, 1);
  std::vector<std::vector<uint8_t>> loaded(plan.ops.size());  // by gather op
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    if (op.unit < 0 || !routes_expert_reads(plan, op.unit)) continue;
    if (op.kind == OpKind::gather) {
      // What its fetch read ahead is loaded (gather marks it; Engine::gather).
      for (int d : op.deps)
        if (plan.ops[size_t(d)].kind == OpKind::fetch && plan.ops[size_t(d)].unit == op.unit)
          loaded[i] = experts_read_ahead(plan, d, routing);
    }
    if (op.kind == OpKind::fetch) {
      out.ranges[i] =
          fetch_ranges(plan, op.unit, experts_read_ahead(plan, int(i), routing), alignment, apart);
      out.reads[i] = 1;
    }
    // One rank's computations read their experts; several ranks' shares do.
    const bool reads = one_rank ? op.kind == OpKind::forward || op.kind == OpKind::backward
                                : op.kind == OpKind::share;
    if (!reads) continue;
    const int gather = gather_of(plan, op);
    if (gather < 0) continue;
    std::vector<uint8_t>& have = loaded[size_t(gather)];
    if (have.empty()) have.assign(E, 0);
    const std::vector<uint8_t>& needed =
        routing != nullptr ? (*routing)[size_t(op.unit)][size_t(op.micro)] : every;
    out.ranges[i] = expert_reads(plan, op.unit, needed, have, alignment, apart);
    out.reads[i] = 1;
  }
  return out;
}

// `reads`' bytes per operation at `rank` (-1: at each operation the most of any rank's).
std::vector<int64_t> reads_per_op(const TrainingPlan& plan, const OpReads& reads, int rank) {
  std::vector<int64_t> bytes(plan.ops.size(), 0);
  const RankSpan ranks = counted_ranks(plan, rank);
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    if (!reads.reads[i]) continue;
    const PlanOp& op = plan.ops[i];
    // fetched_ahead's fewest bytes are counted by the fetch itself
    const int64_t counted = op.kind == OpKind::fetch ? op.bytes : 0;
    for (int r = ranks.first; r < ranks.end; ++r)
      bytes[i] = std::max(bytes[i], rank_bytes(plan, op.unit, reads.ranges[i], r) - counted);
  }
  return bytes;
}

int64_t parameter_reads(const TrainingPlan& plan, const StepRouting* routing, int rank) {
  int64_t fetched = 0;
  for (const PlanOp& op : plan.ops)
    if (op.kind == OpKind::fetch) fetched += op.bytes;
  if (!plan.routed_expert_fetch) return fetched;
  const OpReads reads = routed_reads(plan, routing);
  int64_t most = 0;
  const RankSpan ranks = counted_ranks(plan, rank);
  for (int r = ranks.first; r < ranks.end; ++r) {
    int64_t total = fetched;
    for (int64_t b : reads_per_op(plan, reads, r)) total += b;
    most = std::max(most, total);
  }
  return most;
}

}  // namespace

std::vector<int64_t> routed_expert_reads_per_op(const TrainingPlan& plan,
                                                const StepRouting* routing, int rank) {
  if (!plan.routed_expert_fetch) return std::vector<int64_t>(plan.ops.size(), 0);
  return reads_per_op(plan, routed_reads(plan, routing), rank);
}

int64_t routed_parameter_reads(const TrainingPlan& plan, const StepRouting& routing, int rank) {
  return parameter_reads(plan, &routing, rank);
}

int64_t worst_parameter_reads(const TrainingPlan& plan, int rank) {
  return parameter_reads(plan, nullptr, rank);
}

std::vector<StepRouting> even_routings(const TrainingPlan& plan, int steps, uint64_t seed) {
  const ModelConfig& m = plan.layout.config;
  const int64_t E = m.num_experts, K = m.num_experts_per_tok;
  const int64_t tokens = plan.tokens_per_micro * plan.input.world_size;
  const size_t G = size_t(plan.input.grad_accum);
  std::mt19937_64 draw(seed);
  std::vector<StepRouting> out;
  std::vector<int64_t> order(size_t(std::max<int64_t>(E, 0)));
  for (int s = 0; s < steps; ++s) {
    StepRouting routing(plan.units.size());
    std::map<int64_t, std::vector<std::vector<uint8_t>>> layers;  // layer -> per micro-batch
    for (int u = 0; u < int(plan.units.size()); ++u) {
      if (!routes_expert_reads(plan, u)) continue;
      const int64_t layer = plan.layout.units[size_t(u)].unit.layer;
      auto [it, drawn] = layers.try_emplace(layer);
      if (drawn) {
        for (size_t g = 0; g < G; ++g) {
          std::vector<uint8_t> used(size_t(E), 0);
          int64_t reached = 0;
          // Each token's k distinct experts (a partial shuffle), until every expert is reached.
          for (int64_t n = 0; n < tokens && reached < E; ++n) {
            std::iota(order.begin(), order.end(), int64_t{0});
            for (int64_t k = 0; k < K; ++k) {
              const int64_t pick = k + int64_t(draw() % uint64_t(E - k));
              std::swap(order[size_t(k)], order[size_t(pick)]);
              reached += used[size_t(order[size_t(k)])] == 0;
              used[size_t(order[size_t(k)])] = 1;
            }
          }
          it->second.push_back(std::move(used));
        }
      }
      routing[size_t(u)] = it->second;
    }
    out.push_back(std::move(routing));
  }
  return out;
}

nlohmann::ordered_json routing_to_json(const TrainingPlan& plan, const StepRouting& routing) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (size_t u = 0; u < routing.size(); ++u) {
    if (routing[u].empty()) continue;
    nlohmann::ordered_json micros = nlohmann::ordered_json::array();
    for (const std::vector<uint8_t>& used : routing[u]) {
      std::string mask(used.size(), '0');
      for (size_t e = 0; e < used.size(); ++e)
        if (used[e]) mask[e] = '1';
      micros.push_back(std::move(mask));
    }
    out[plan.layout.units[u].unit.name] = std::move(micros);
  }
  return out;
}

Result<StepRouting> routing_from_json(const TrainingPlan& plan, const nlohmann::json& record,
                                      const std::string& origin) {
  const size_t G = size_t(plan.input.grad_accum), E = size_t(plan.layout.config.num_experts);
  if (!record.is_object())
    return Status::invalid_argument(fmt::format("{}: \"routing\" is not an object", origin));
  StepRouting routing(plan.units.size());
  size_t found = 0;
  for (int u = 0; u < int(plan.units.size()); ++u) {
    if (!routes_expert_reads(plan, u)) continue;
    const std::string& name = plan.layout.units[size_t(u)].unit.name;
    const auto it = record.find(name);
    if (it == record.end()) {
      // A run whose sparse layers were cut into another count of groups of experts.
      bool other_groups = plan.layout.config.expert_groups > 1;
      for (const auto& [recorded, masks] : record.items())
        other_groups = other_groups || recorded.find(".experts.") != std::string::npos;
      if (other_groups)
        return Status::invalid_argument(fmt::format(
            "{}: no routing of {}; the record's sparse layers are cut into other groups of "
            "experts: plan with the --expert-groups of the run that recorded it",
            origin, name));
      return Status::invalid_argument(fmt::format(
          "{}: no routing of {}; record it with a run of this model with its layers in pieces "
          "(--layer-pieces 2)",
          origin, name));
    }
    if (!it->is_array() || it->size() != G)
      return Status::invalid_argument(fmt::format(
          "{}: {} has {} micro-batches, the plan {}; plan with --grad-accum {} or record a run "
          "with --grad-accum {}",
          origin, name, it->is_array() ? it->size() : 0, G, it->is_array() ? it->size() : 0, G));
    for (const nlohmann::json& mask : *it) {
      const std::string text = mask.is_string() ? mask.get<std::string>() : std::string();
      if (text.size() != E || text.find_first_not_of("01") != std::string::npos)
        return Status::invalid_argument(fmt::format(
            "{}: {}'s routing is not a string of {} '0' and '1' (one per expert), got {}", origin,
            name, E, mask.dump()));
      std::vector<uint8_t> used(E);
      for (size_t e = 0; e < E; ++e) used[e] = text[e] == '1';
      routing[size_t(u)].push_back(std::move(used));
    }
    ++found;
  }
  if (found != record.size())
    return Status::invalid_argument(
        fmt::format("{}: the record routes {} units, this plan {}; plan the model the run trained",
                    origin, record.size(), found));
  return routing;
}

RecordedReads recorded_parameter_reads(const TrainingPlan& plan,
                                       const std::vector<StepRouting>& steps) {
  RecordedReads out;
  out.worst = worst_parameter_reads(plan);
  int64_t sum = 0;
  for (const StepRouting& routing : steps) {
    const int64_t bytes = routed_parameter_reads(plan, routing);
    out.least = out.steps == 0 ? bytes : std::min(out.least, bytes);
    out.most = std::max(out.most, bytes);
    sum += bytes;
    ++out.steps;
  }
  out.mean = out.steps > 0 ? sum / out.steps : 0;
  return out;
}

}  // namespace strata
