#include "core/plan/step_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/plan/gpu_launches.h"
#include "io/base/sizes.h"

namespace strata {

const char* resource_name(int index) {
  static const char* const kNames[kResourceCount] = {
      "device", "cores", "nvme", "intra-node link", "pcie h2d", "pcie d2h", "inter-node link"};
  return index >= 0 && index < kResourceCount ? kNames[index] : "?";
}

double OpCost::busy_seconds(int index) const {
  const uint32_t bit = 1u << index;
  if (bit == uint32_t(Resource::cores) && cores_seconds >= 0) return cores_seconds;
  if (!(resources & bit)) return 0;
  if (bit == uint32_t(Resource::intra_node)) return intra_node_seconds;
  if (bit == uint32_t(Resource::inter_node)) return inter_node_seconds;
  return seconds;
}

// ------------------------------------------------------------------ simulator

Simulation simulate_steps(const std::vector<SimOp>& ops, int lanes, int release_op, int steps) {
  Simulation sim;
  const size_t n = ops.size();
  // Each lane's operations in plan order; lane l runs lane_ops[l], step after step.
  std::vector<std::vector<int>> lane_ops(static_cast<size_t>(lanes));
  for (size_t i = 0; i < n; ++i) lane_ops[size_t(ops[i].lane)].push_back(int(i));
  constexpr double kNotYet = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> done(size_t(steps), std::vector<double>(n, kNotYet));
  std::vector<size_t> remaining(size_t(steps), n);
  std::vector<double> step_end(size_t(steps), kNotYet);
  sim.step_start.assign(size_t(steps) + 1, kNotYet);
  sim.step_start[0] = 0;
  std::vector<double> lane_free(size_t(lanes), 0.0);
  std::vector<int> lane_step(size_t(lanes), 0);
  std::vector<size_t> lane_next(size_t(lanes), 0);
  double resource_free[kResourceCount] = {};
  // Step s + 1 is handed out once step s's release operation is done and step
  // s - 1 is complete (the engine's step() returns then).
  auto release_ready = [&] {
    for (int s = 0; s < steps; ++s) {
      if (sim.step_start[size_t(s) + 1] != kNotYet) continue;
      const double own = done[size_t(s)][size_t(release_op)];
      const double before = s > 0 ? step_end[size_t(s) - 1] : 0.0;
      if (own != kNotYet && before != kNotYet)
        sim.step_start[size_t(s) + 1] = std::max(own, before);
    }
  };
  for (size_t scheduled = 0; scheduled < size_t(steps) * n; ++scheduled) {
    int best_lane = -1;
    double best_start = kNotYet, best_ready = 0;
    for (int l = 0; l < lanes; ++l) {
      const int s = lane_step[size_t(l)];
      if (s >= steps || lane_ops[size_t(l)].empty()) continue;
      const double released = sim.step_start[size_t(s)];
      if (released == kNotYet) continue;
      const int i = lane_ops[size_t(l)][lane_next[size_t(l)]];
      const SimOp& op = ops[size_t(i)];
      const double ready = std::max(lane_free[size_t(l)], released);
      double start = ready;
      for (int d : op.deps) start = std::max(start, done[size_t(s)][size_t(d)]);
      if (op.previous_step_dep >= 0 && s > 0)
        start = std::max(start, done[size_t(s) - 1][size_t(op.previous_step_dep)]);
      if (start == kNotYet) continue;
      for (int r = 0; r < kResourceCount; ++r)
        if (op.resources & (1u << r)) start = std::max(start, resource_free[r]);
      if (start < best_start) {
        best_start = start;
        best_lane = l;
        best_ready = ready;
      }
    }
    if (best_lane < 0) break;  // nothing can start: a cycle (a plan never has one)
    const int s = lane_step[size_t(best_lane)];
    const int i = lane_ops[size_t(best_lane)][lane_next[size_t(best_lane)]];
    const SimOp& op = ops[size_t(i)];
    const double end = best_start + op.seconds;
    done[size_t(s)][size_t(i)] = end;
    lane_free[size_t(best_lane)] = end;
    for (int r = 0; r < kResourceCount; ++r)
      if (op.resources & (1u << r)) resource_free[r] = end;
    sim.ops.push_back({s, i, best_start, end, best_start - best_ready});
    if (++lane_next[size_t(best_lane)] == lane_ops[size_t(best_lane)].size()) {
      lane_next[size_t(best_lane)] = 0;
      lane_step[size_t(best_lane)] = s + 1;
    }
    if (--remaining[size_t(s)] == 0) {
      double last = 0;
      for (double t : done[size_t(s)]) last = std::max(last, t);
      step_end[size_t(s)] = last;
    }
    release_ready();
  }
  return sim;
}

// ----------------------------------------------------------------------- cost

namespace {

// A link the profile does not know (0 GB/s) costs nothing; the prediction says so.
double seconds_for(double bytes, double gbps, double latency_us) {
  if (bytes <= 0 || gbps <= 0) return 0;
  return bytes / (gbps * 1e9) + latency_us * 1e-6;
}

// A collective's two levels (StepTraffic): a ring over the node's g ranks
// sends its intra-node bytes in g - 1 hops, then one over the n nodes its
// inter-node bytes in n - 1; each level on its link, one after the other.
void cost_collective(const TrainingPlan& plan, const HardwareProfile& hw, const StepTraffic& t,
                     OpCost& c) {
  const PlanInput& in = plan.input;
  const int g = in.budgets.node_ranks(in.world_size), n = in.budgets.nodes(in.world_size);
  if (t.intra_node > 0) {
    c.intra_node_seconds = seconds_for(double(t.intra_node), hw.intra_node_gbps, 0) +
                           (g - 1) * hw.intra_node_latency_us * 1e-6;
    c.resources |= uint32_t(Resource::intra_node);
  }
  if (t.inter_node > 0) {
    c.inter_node_seconds = seconds_for(double(t.inter_node), hw.inter_node_gbps, 0) +
                           (n - 1) * hw.inter_node_latency_us * 1e-6;
    c.resources |= uint32_t(Resource::inter_node);
  }
  c.seconds += c.intra_node_seconds + c.inter_node_seconds;
}

// The node's NVMe drives as one rank sees them: `share` of their bandwidth
// each way and both at once, and a latency per transfer.
struct DriveTimes {
  DriveTimes(const HardwareProfile& hw, double share)
      : read_gbps(hw.nvme_read_gbps() * share),
        write_gbps(hw.nvme_write_gbps() * share),
        mixed_gbps(hw.nvme_mixed_gbps() * share),
        latency_us(hw.nvme.empty() ? 100 : hw.nvme.front().latency_us) {}
  // The reads, then the writes.
  double in_turn(const StepTraffic& t) const {
    return seconds_for(double(t.nvme_read), read_gbps, latency_us) +
           seconds_for(double(t.nvme_written), write_gbps, latency_us);
  }
  // Reads and writes in flight at once (the streamed optimizer's chunks): at
  // the mixed rate, never faster than either way alone; in turn without one.
  double at_once(const StepTraffic& t) const {
    if (mixed_gbps <= 0 || t.nvme_read == 0 || t.nvme_written == 0) return in_turn(t);
    return std::max({seconds_for(double(t.nvme_read), read_gbps, 0),
                     seconds_for(double(t.nvme_written), write_gbps, 0),
                     seconds_for(double(t.nvme_read + t.nvme_written), mixed_gbps, 0)}) +
           2 * latency_us * 1e-6;
  }
  double read_gbps, write_gbps, mixed_gbps, latency_us;
};

// `cores` seconds of work on the cores in an operation that waits `waited`
// on NVMe beside it: shorter, it shares the cores (OpCost::cores_seconds);
// else it holds them.
void work_cores(OpCost& c, double cores, double waited) {
  if (cores <= 0) return;
  if (cores < waited)
    c.cores_seconds = cores;
  else
    c.resources |= uint32_t(Resource::cores);
}

// The exchange: a few numbers, all-reduced: twice the hops of each level, latency alone.
void cost_exchange(const TrainingPlan& plan, const HardwareProfile& hw, OpCost& c) {
  const PlanInput& in = plan.input;
  const int g = in.budgets.node_ranks(in.world_size), n = in.budgets.nodes(in.world_size);
  c.intra_node_seconds = 2.0 * (g - 1) * hw.intra_node_latency_us * 1e-6;
  c.inter_node_seconds = 2.0 * (n - 1) * hw.inter_node_latency_us * 1e-6;
  c.seconds = c.intra_node_seconds + c.inter_node_seconds;
  c.resources =
      (g > 1 ? uint32_t(Resource::intra_node) : 0u) | (n > 1 ? uint32_t(Resource::inter_node) : 0u);
}

}  // namespace

double layer_forward_flops(const ModelConfig& m, int64_t B, int64_t T, int64_t layer,
                           LayerPiece piece) {
  const double N = double(B) * double(T);
  const double D = double(m.head_dim > 0 ? m.head_dim : m.hidden_size / m.num_attention_heads);
  // A query sees the keys before it (all, or the sliding window's): QK^T and PV.
  const double t = double(T);
  const double seen =
      m.sliding_window > 0 && double(m.sliding_window) < t ? double(m.sliding_window) : (t + 1) / 2;
  const double attention = 2 * 2 * N * seen * double(m.num_attention_heads) * D;
  // A token's products read the layer's active parameters: a sparse layer's
  // router and k experts (without a layer, the mean over the layers).
  double active = 0;
  if (layer >= 0) {
    active = double(m.layer_active_parameter_count(layer));
  } else {
    for (int64_t i = 0; i < m.num_hidden_layers; ++i)
      active += double(m.layer_active_parameter_count(i));
    active /= double(std::max<int64_t>(1, m.num_hidden_layers));
  }
  const double attention_params = double(m.attention_parameter_count());
  if (piece == LayerPiece::attention) return 2 * N * attention_params + attention;
  if (piece == LayerPiece::mlp) return 2 * N * (active - attention_params);
  // Cut into expert groups: the router piece's product, and a group's share
  // of the k experts a token reads (its experts over the layer's, taken as
  // equal groups).
  const double router_params = double(m.num_experts * m.hidden_size + m.hidden_size);
  if (piece == LayerPiece::router) return 2 * N * router_params;
  if (piece == LayerPiece::experts)
    return 2 * N * (active - attention_params - router_params) /
           double(std::max<int64_t>(1, m.expert_groups));
  // A dense MLP's part: its share of the MLP's products (equal parts).
  if (piece == LayerPiece::mlp_part)
    return 2 * N * double(3 * m.hidden_size * m.intermediate_size) /
           double(std::max<int64_t>(1, m.mlp_parts));
  return 2 * N * active + attention;
}

double layer_backward_flops(const ModelConfig& m, int64_t B, int64_t T, bool recomputes,
                            int64_t layer, LayerPiece piece) {
  const double forward = layer_forward_flops(m, B, T, layer, piece);
  return (recomputes ? forward : 0) + 2 * forward;
}

double head_flops(const ModelConfig& m, int64_t B, int64_t T) {
  return 3 * 2 * double(B) * double(T) * double(m.hidden_size) * double(m.vocab_size);
}

double operation_flops(const TrainingPlan& plan, const PlanOp& op) {
  if (op.kind != OpKind::forward && op.kind != OpKind::backward) return 0;
  const ModelConfig& m = plan.layout.config;
  const int64_t T = plan.input.seq_len;
  const int64_t B = plan.tokens_per_micro / std::max<int64_t>(T, 1);
  const int head = int(plan.units.size()) - 1;
  const UnitShape& unit = plan.layout.units[size_t(op.unit)].unit;
  if (unit.kind == UnitKind::embedding) return 0;  // a lookup and its scatter-add
  if (unit.kind == UnitKind::head) {
    // A vocabulary chunk computes its rows' share: the last chunk's one pass
    // all three products, another chunk's forward one and its backward two.
    const double share =
        unit.chunk < 0
            ? 1.0
            : double(m.vocab_chunk_begin(unit.chunk + 1) - m.vocab_chunk_begin(unit.chunk)) /
                  double(m.vocab_size);
    const double thirds = op.unit == head ? 3 : op.kind == OpKind::forward ? 1 : 2;
    return head_flops(m, B, T) * share * thirds / 3;
  }
  const int64_t layer = unit.layer;
  if (op.kind == OpKind::forward) return layer_forward_flops(m, B, T, layer, unit.piece);
  // A router piece and a piece of experts recompute their forward always (moe_kernels.h).
  const bool recomputes = plan.recomputes(op.unit) || unit.piece == LayerPiece::router ||
                          unit.piece == LayerPiece::experts;
  return layer_backward_flops(m, B, T, recomputes, layer, unit.piece);
}

namespace {

// On a GPU, an operation of `seconds` on the device with its launches and
// waits (gpu_launches.h): the host launches ahead, so the launches cost
// nothing until the kernels are too small to cover them; each wait empties
// the stream.
double with_launches(const GpuLaunches& launches, const HardwareProfile& hw, double seconds) {
  return std::max(seconds, launches.kernels * hw.launch_us * 1e-6) +
         launches.waits * hw.host_wait_us * 1e-6;
}
double with_launches(const TrainingPlan& plan, const HardwareProfile& hw, const PlanOp& op,
                     double seconds) {
  return with_launches(gpu_launches(plan, op), hw, seconds);
}

// A forward's or backward's seconds for its FLOPs (on the CPU backend at
// the probe's measured rate for its kind of unit, the rank's share of the
// cores) and, for the embedding, its activations' traffic.
double compute_seconds(const TrainingPlan& plan, const HardwareProfile& hw, const PlanOp& op,
                       double unit_share) {
  const PlanInput& in = plan.input;
  const double flops = operation_flops(plan, op);
  double rate = hw.matmul_flops(in.gpu ? in.precision : Precision::fp32);
  if (!in.gpu) {
    const bool is_head = plan.layout.units[size_t(op.unit)].unit.kind == UnitKind::head;
    const double measured = is_head                      ? hw.head_gflops
                            : op.kind == OpKind::forward ? hw.layer_forward_gflops
                                                         : hw.layer_backward_gflops;
    if (measured > 0) rate = measured * 1e9;
    rate *= unit_share;
  }
  double seconds = rate > 0 ? flops / rate : 0;
  if (in.gpu) seconds = with_launches(plan, hw, op, seconds);
  // The embedding and the element-wise work move (B*T, C) activations a few times.
  const double activations = double(plan.tokens_per_micro) * double(in.model.hidden_size) * 4;
  return seconds + (plan.layout.units[size_t(op.unit)].unit.kind == UnitKind::embedding
                        ? seconds_for(3 * activations, hw.memory_gbps, 0)
                        : 0);
}

}  // namespace

// A share (expert_fetch.h) costs as a fetch, its NVMe reads this rank's part
// of the experts the ranks' routings reach (and, where expert updates are
// deferred, the replays of those that waited), then as a collective, each
// part sent by its owner; its `route`, a small product (the router's), as
// bookkeeping on the CPU and as its launches and wait on a GPU.
std::vector<OpCost> cost_operations(const TrainingPlan& plan, const HardwareProfile& hw,
                                    const RoutedStep* routed) {
  std::vector<StepTraffic> own;
  if (routed == nullptr) own = traffic_per_op(plan);
  const std::vector<StepTraffic>& traffic = routed != nullptr ? routed->traffic : own;
  // Elements AdamW steps where the routing decides them (-1: the plan's count).
  const std::vector<int64_t> worst_replays =
      routed == nullptr ? deferred_replay_elements_per_op(plan) : std::vector<int64_t>();
  auto adamw_elements = [&](size_t i) {
    return routed != nullptr ? routed->adamw_elements[i] : worst_replays[i];
  };
  // A replay of missed steps (expert_update.h): AdamW over the replayed elements.
  auto replay_seconds = [&](size_t i) {
    const double rate = hw.adamw_params_per_second(plan.input.optimizer_state);
    return adamw_elements(i) > 0 && rate > 0 ? double(adamw_elements(i)) / rate : 0.0;
  };
  const PlanInput& in = plan.input;
  const bool gpu = in.gpu;
  const uint32_t compute = uint32_t(gpu ? Resource::device : Resource::cores);
  // Every rank of the node streams through the node's drives at once (the
  // ranks run the same plan): each has its share of their bandwidth, on
  // either backend, as the planner's NVMe time counts it.
  const DriveTimes drives(hw, 1.0 / double(std::max(1, in.budgets.node_ranks(in.world_size))));
  auto nvme_seconds = [&](const StepTraffic& t) { return drives.in_turn(t); };
  auto pcie_seconds = [&](const StepTraffic& t) {
    return seconds_for(double(t.h2d), hw.pcie_h2d_gbps, hw.pcie_latency_us) +
           seconds_for(double(t.d2h), hw.pcie_d2h_gbps, hw.pcie_latency_us);
  };
  auto pcie_bits = [&](const StepTraffic& t) {
    return (t.h2d > 0 ? uint32_t(Resource::pcie_h2d) : 0u) |
           (t.d2h > 0 ? uint32_t(Resource::pcie_d2h) : 0u);
  };
  // On the CPU backend the node's ranks share the cores: each runs its units
  // at the rate the probe measured with that many ranks at once (rank_share),
  // its optimizer on its share of the cores, and copies on its share of the
  // host's bandwidth.
  const int node_ranks = gpu ? 1 : std::max(1, in.budgets.node_ranks(in.world_size));
  const double ranks = double(node_ranks);
  const double unit_share = gpu ? 1.0 : hw.rank_share(node_ranks);
  const double optimizer_share = gpu ? 1.0 : std::min(1.0, double(hw.cores) / ranks);
  const double memcpy_gbps = hw.memcpy_gbps / ranks;
  std::vector<OpCost> costs(plan.ops.size());
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    const StepTraffic& t = traffic[i];
    const UnitPlacement* p = op.unit >= 0 ? &plan.units[size_t(op.unit)] : nullptr;
    OpCost& c = costs[i];
    switch (op.kind) {
      case OpKind::forward:
      case OpKind::backward: {
        c.seconds = compute_seconds(plan, hw, op, unit_share) + pcie_seconds(t);
        c.resources = compute | pcie_bits(t);
        // A routed MLP piece reads its experts (core/plan/expert_fetch.h) and
        // replays the missed steps of those that waited (expert_update.h):
        // their windows through NVMe, AdamW over their elements once a step
        // missed, on the compute lane's cores.
        if (t.nvme_read > 0 || t.nvme_written > 0) {
          c.seconds += nvme_seconds(t);
          c.resources |= uint32_t(Resource::nvme);
        }
        c.seconds += replay_seconds(i);
        break;
      }
      case OpKind::fetch:
      case OpKind::writeback:
      case OpKind::share:
        c.seconds = nvme_seconds(t) + replay_seconds(i);
        c.resources = uint32_t(Resource::nvme);
        work_cores(c, replay_seconds(i), nvme_seconds(t));
        if (op.kind == OpKind::share) cost_collective(plan, hw, t, c);
        break;
      case OpKind::spill:
      case OpKind::restore: {
        const double bytes = double(op.bytes);
        c.seconds = plan.activation_home() == tiers::Tier::nvme
                        ? nvme_seconds(t)
                        : seconds_for(2 * bytes, memcpy_gbps, 0);
        c.seconds += pcie_seconds(t);
        c.resources = (plan.activation_home() == tiers::Tier::nvme ? uint32_t(Resource::nvme)
                                                                   : uint32_t(Resource::cores)) |
                      pcie_bits(t);
        break;
      }
      case OpKind::gather:
      case OpKind::sync: {
        // Into the gathered buffer (widened to fp32 on the CPU backend), and over the ring.
        const double local =
            double(p->padded_numel) * (gpu ? plan.compute_bytes : 4 + plan.compute_bytes);
        c.seconds = (op.kind == OpKind::gather && !gpu ? seconds_for(local, memcpy_gbps, 0) : 0) +
                    pcie_seconds(t);
        c.resources = (gpu ? 0u : uint32_t(Resource::cores)) | pcie_bits(t);
        cost_collective(plan, hw, t, c);
        break;
      }
      case OpKind::reduce: {
        // The micro-batch's gradient added into the accumulator: read both,
        // write one; a routed unit's only where its tokens went, the rest
        // set to zero on the first micro-batch (sums_routed_gradients).
        const int64_t summed = routed != nullptr ? routed->summed_elements[i] : -1;
        const double accumulate =
            summed < 0 ? 3.0 * double(p->grad_numel) * (plan.homes.grad_bf16 ? 2 : 4)
                       : 3.0 * double(summed) * 4 +
                             (op.micro == 0 ? double(p->grad_numel - summed) * 4 : 0);
        // Summed once per step, only the last micro-batch's reduce (of the
        // sum) reaches the accumulator; summed in host memory, every
        // micro-batch's gradient is first added to the sum (the whole unit).
        const bool into_home = !plan.grads_summed_per_step() || op.micro == in.grad_accum - 1;
        const bool on_host = into_home && (!gpu || plan.homes.grad != tiers::Tier::device);
        const double sum = plan.host_grads_summed() ? 3.0 * double(p->padded_numel) * 4 : 0;
        c.seconds = pcie_seconds(t) + nvme_seconds(t) +
                    (on_host ? seconds_for(accumulate, memcpy_gbps, 0) : 0) +
                    seconds_for(sum, memcpy_gbps, 0);
        c.resources = pcie_bits(t) |
                      (t.nvme_read + t.nvme_written > 0 ? uint32_t(Resource::nvme) : 0u) |
                      (on_host || sum > 0 ? uint32_t(Resource::cores) : 0u);
        cost_collective(plan, hw, t, c);
        break;
      }
      case OpKind::optimizer: {
        // A deferring unit steps only its updated ranges (expert_update.h).
        const double params =
            double(adamw_elements(i) >= 0 ? adamw_elements(i) : p->optimizer_numel);
        const bool on_gpu = gpu && plan.homes.optimizer == tiers::Tier::device;
        // On a GPU AdamW is memory-bound: master, m, v, gradient read, three written.
        const double update =
            on_gpu
                ? seconds_for(params * 28, hw.memory_gbps, 0)
                : (hw.adamw_params_per_second(in.optimizer_state) > 0
                       ? params / (hw.adamw_params_per_second(in.optimizer_state) * optimizer_share)
                       : 0);
        // The streamed optimizer reads its next chunk while it updates one
        // and writes the last back: its bytes both ways at the drives'
        // mixed rate where the profile has one (never faster than either
        // way alone). Bound by the drives, it shares the cores.
        const double io = drives.at_once(t);
        c.seconds = std::max(update, io) + pcie_seconds(t);
        c.resources = (on_gpu ? uint32_t(Resource::device) : 0u) | pcie_bits(t) |
                      (t.nvme_read + t.nvme_written > 0 ? uint32_t(Resource::nvme) : 0u);
        if (!on_gpu) work_cores(c, update, io);
        break;
      }
      case OpKind::exchange:
        cost_exchange(plan, hw, c);
        break;
      case OpKind::route:  // on the CPU a small product; on a GPU its launches and wait
        if (gpu) c = OpCost{with_launches(plan, hw, op, 0), uint32_t(Resource::device)};
        break;
      default:  // decide, release: bookkeeping
        break;
    }
  }
  return costs;
}

std::vector<SimOp> step_graph(const TrainingPlan& plan, const std::vector<OpCost>& costs) {
  const std::vector<int> publishers = parameter_publishers(plan);
  std::vector<SimOp> ops(plan.ops.size());
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    ops[i].lane = static_cast<int>(op.lane);
    ops[i].deps = op.deps;
    if (reads_parameters(plan, op) && op.unit >= 0)
      ops[i].previous_step_dep = publishers[size_t(op.unit)];
    ops[i].seconds = costs[i].seconds;
    ops[i].resources = costs[i].resources;
  }
  return ops;
}

// ---------------------------------------------------------------- prediction

StepPrediction predict_step(const TrainingPlan& plan, const HardwareProfile& hw,
                            const RoutedStep* routed) {
  constexpr int kSteps = 4;  // the cold step, then steady ones
  StepPrediction out;
  out.hardware = hw.name;
  const std::vector<OpCost> costs = cost_operations(plan, hw, routed);
  out.simulation = simulate_steps(step_graph(plan, costs), kLaneCount, exchange_op(plan), kSteps);
  const Simulation& sim = out.simulation;
  out.cold_seconds = sim.step_seconds(0);
  // Steady: the step handed out after the pipeline filled (its predecessor
  // overlapped it), measured from its hand-out to the next one's.
  const int steady = kSteps - 2;
  out.steady_seconds = sim.step_seconds(steady);
  for (const SimulatedOp& s : sim.ops) {
    if (s.step != steady) continue;
    const PlanOp& op = plan.ops[size_t(s.op)];
    const double seconds = s.end - s.start;
    out.lane_busy[static_cast<int>(op.lane)] += seconds;
    if (op.lane == Lane::compute) out.compute_stall += s.waited;
    for (int r = 0; r < kResourceCount; ++r)
      out.resource_busy[r] += costs[size_t(s.op)].busy_seconds(r);
  }
  for (int l = 0; l < kLaneCount; ++l)
    if (out.lane_busy[l] > out.lane_busy[static_cast<int>(out.bound_lane)])
      out.bound_lane = Lane(l);
  for (int r = 0; r < kResourceCount; ++r)
    if (out.resource_busy[r] > out.resource_busy[out.bound_resource]) out.bound_resource = r;
  out.tokens_per_step = plan.tokens_per_micro * plan.input.grad_accum * plan.input.world_size;
  if (out.steady_seconds > 0)
    out.tokens_per_second = double(out.tokens_per_step) / out.steady_seconds;
  if (hw.gpu && out.steady_seconds > 0) {
    // The model's FLOPs, recomputation left out: a forward and twice it
    // backward (the head's one pass already counts all three).
    const int head = int(plan.units.size()) - 1;
    double flops = 0;
    for (const PlanOp& op : plan.ops)
      if (op.kind == OpKind::forward)
        flops += (op.unit == head ? 1 : 3) * operation_flops(plan, op);
    const double peak = hw.matmul_flops(plan.input.precision) / hw.matmul_efficiency;
    out.mfu = flops / (peak * out.steady_seconds);
  }
  if (plan.input.gpu) {
    const double rate = hw.matmul_flops(plan.input.precision);
    for (const PlanOp& op : plan.ops) {
      const GpuLaunches launches = gpu_launches(plan, op);
      const double flops = rate > 0 ? operation_flops(plan, op) / rate : 0;
      out.gpu_launches += launches.kernels;
      out.gpu_host_waits += launches.waits;
      out.gpu_launch_seconds += with_launches(launches, hw, flops) - flops;
    }
  }
  out.traffic = routed != nullptr ? total_traffic(routed->traffic) : plan.traffic_per_step;
  out.nvme_unknown = hw.nvme.empty() && out.traffic.nvme_read + out.traffic.nvme_written > 0;
  out.inter_node_unknown = hw.inter_node_gbps <= 0 && out.traffic.inter_node > 0;
  double rated = 0;
  for (const NvmeDrive& d : hw.nvme) rated += d.rated_tbw.value_or(0);
  if (rated > 0 && out.traffic.nvme_written > 0 && out.steady_seconds > 0) {
    const double node_bytes_per_second = double(out.traffic.nvme_written) *
                                         plan.input.budgets.node_ranks(plan.input.world_size) /
                                         out.steady_seconds;
    out.drive_years = rated * 1e12 / node_bytes_per_second / (365.25 * 86400);
  }
  return out;
}

RoutedPrediction predict_routed_steps(const TrainingPlan& plan, const HardwareProfile& hw,
                                      const std::vector<StepRouting>& routings, int warmup) {
  RoutedPrediction out;
  // Each step's seconds, then the median step's prediction again (a
  // prediction holds its simulation: one is kept, not one per step).
  std::vector<std::pair<double, size_t>> seconds;
  {
    ExpertUpdateLedger ledger(plan);
    for (size_t s = 0; s < routings.size(); ++s) {
      const RoutedStep step = routed_step(plan, routings[s], ledger, int64_t(s) + 1);
      if (int(s) >= warmup) seconds.emplace_back(predict_step(plan, hw, &step).steady_seconds, s);
    }
  }
  if (seconds.empty()) return out;
  out.steps = int64_t(seconds.size());
  double sum = 0;
  for (const auto& [t, s] : seconds) sum += t;
  out.mean = sum / double(out.steps);
  std::stable_sort(seconds.begin(), seconds.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  out.least = seconds.front().first;
  out.most = seconds.back().first;
  const size_t median = seconds[seconds.size() / 2].second;
  ExpertUpdateLedger ledger(plan);
  for (size_t s = 0; s <= median; ++s) {
    const RoutedStep step = routed_step(plan, routings[s], ledger, int64_t(s) + 1);
    if (s == median) out.median = predict_step(plan, hw, &step);
  }
  return out;
}

StepPrediction predict_expected_step(const TrainingPlan& plan, const HardwareProfile& hw) {
  if (!plan.routed_expert_fetch) return predict_step(plan, hw);
  return predict_routed_steps(plan, hw, even_routings(plan, kEvenRoutingSteps), kEvenRoutingWarmup)
      .median;
}

std::string seconds_text(double s) {
  if (s >= 60) return fmt::format("{:.1f} min", s / 60);
  if (s >= 1) return fmt::format("{:.2f} s", s);
  if (s >= 1e-3) return fmt::format("{:.1f} ms", s * 1e3);
  return fmt::format("{:.0f} us", s * 1e6);
}

std::string format_prediction(const StepPrediction& p) {
  std::string out = fmt::format("predicted on {}: {} per step ({} the first), {:.0f} tokens/s",
                                p.hardware, seconds_text(p.steady_seconds),
                                seconds_text(p.cold_seconds), p.tokens_per_second);
  if (p.mfu) out += fmt::format(", MFU {:.1f}%", 100 * *p.mfu);
  out += "\n  lanes busy per step:";
  for (int l = 0; l < kLaneCount; ++l)
    if (p.lane_busy[l] > 0)
      out += fmt::format(" {} {}", lane_name(Lane(l)), seconds_text(p.lane_busy[l]));
  if (p.nvme_unknown)
    out +=
        "\n  (the profile has no NVMe drive: the NVMe transfers are not counted; --probe "
        "with --nvme-path measures them)";
  if (p.inter_node_unknown)
    out +=
        "\n  (the profile has no inter-node link: the bytes across nodes are not counted; "
        "--internode-bw gives its bandwidth)";
  if (p.gpu_launches > 0)
    out += fmt::format(
        "\n  GPU launches per step: {:.0f} kernels and {} host waits, {} beyond the FLOPs' time",
        p.gpu_launches, p.gpu_host_waits, seconds_text(p.gpu_launch_seconds));
  out += fmt::format("\n  bound by the {} lane and the {}; the compute lane waits {} per step",
                     lane_name(p.bound_lane), resource_name(p.bound_resource),
                     seconds_text(p.compute_stall));
  out += "\n  resources busy per step:";
  for (int r = 0; r < kResourceCount; ++r)
    if (p.resource_busy[r] > 0)
      out += fmt::format(" {} {}", resource_name(r), seconds_text(p.resource_busy[r]));
  const StepTraffic& t = p.traffic;
  out += fmt::format(
      "\n  bytes per step and rank: NVMe {} read, {} written; intra-node {}{}; PCIe {} up, {} "
      "down",
      format_bytes(t.nvme_read), format_bytes(t.nvme_written), format_bytes(t.intra_node),
      t.inter_node > 0 ? fmt::format("; inter-node {}", format_bytes(t.inter_node)) : "",
      format_bytes(t.h2d), format_bytes(t.d2h));
  if (t.nvme_written > 0 && p.steady_seconds > 0) {
    out += fmt::format("\n  SSD wear: {} written per step, {} per hour of steps",
                       format_bytes(t.nvme_written),
                       format_bytes(int64_t(double(t.nvme_written) * 3600 / p.steady_seconds)));
    if (p.drive_years)
      out += *p.drive_years >= 0.1
                 ? fmt::format("; the drives' rated TBW lasts {:.1f} years of training",
                               *p.drive_years)
                 : fmt::format("; the drives' rated TBW lasts {:.1f} days of training",
                               *p.drive_years * 365.25);
  }
  return out + "\n";
}

nlohmann::ordered_json prediction_to_json(const StepPrediction& p) {
  nlohmann::ordered_json j;
  j["hardware"] = p.hardware;
  j["step_seconds"] = p.steady_seconds;
  j["first_step_seconds"] = p.cold_seconds;
  j["tokens_per_second"] = p.tokens_per_second;
  if (p.mfu) j["mfu"] = *p.mfu;
  nlohmann::ordered_json lanes;
  for (int l = 0; l < kLaneCount; ++l) lanes[lane_name(Lane(l))] = p.lane_busy[l];
  j["lane_busy_seconds"] = lanes;
  nlohmann::ordered_json resources;
  for (int r = 0; r < kResourceCount; ++r) resources[resource_name(r)] = p.resource_busy[r];
  j["resource_busy_seconds"] = resources;
  j["bound_lane"] = lane_name(p.bound_lane);
  j["bound_resource"] = resource_name(p.bound_resource);
  j["compute_stall_seconds"] = p.compute_stall;
  j["nvme_written_per_step"] = p.traffic.nvme_written;
  if (p.nvme_unknown) j["nvme_unknown"] = true;
  if (p.inter_node_unknown) j["inter_node_unknown"] = true;
  if (p.drive_years) j["rated_tbw_years"] = *p.drive_years;
  if (p.gpu_launches > 0) {
    j["gpu_launches_per_step"] = p.gpu_launches;
    j["gpu_host_waits_per_step"] = p.gpu_host_waits;
    j["gpu_launch_seconds"] = p.gpu_launch_seconds;
  }
  return j;
}

}  // namespace strata
