// What each operation of a training plan moves over each link
// (core/plan/training_plan.h): the one account of a step's traffic, which
// TrainingPlan::traffic_per_step sums and the step-time model
// (core/plan/step_model.h) costs operation by operation. A collective's
// bytes go to the intra-node and inter-node links by the hierarchy
// StepTraffic describes.
#include <algorithm>

#include "core/plan/expert_fetch.h"
#include "core/plan/expert_update.h"
#include "core/plan/training_plan.h"
#include "io/base/sizes.h"

namespace strata {
namespace {

using tiers::Tier;

// On a GPU without the parameters in place, a run of consecutive compute
// operations reading a unit (one gather's use) uploads it once, at the first
// of them; a run that is only the embedding's backward reads nothing of it.
// A compute operation reads its own unit, and a tied head the embedding's.
// One pass over the operations (a plan of many units is costed often).
void add_gathered_uploads(const TrainingPlan& plan, std::vector<StepTraffic>& traffic) {
  const int head = int(plan.units.size()) - 1;
  const bool tied = plan.layout.config.tie_word_embeddings;
  struct Run {
    int unit = -1;
    size_t first = 0;  // the run's first operation
    bool reads = false;
  };
  auto close = [&](const Run& run) {
    if (run.reads)
      traffic[run.first].h2d += plan.units[size_t(run.unit)].padded_numel * plan.compute_bytes;
  };
  std::vector<Run> open;  // the runs the last compute operation continued (at most two)
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    if (op.kind != OpKind::forward && op.kind != OpKind::backward) continue;
    std::vector<Run> next;
    for (const int u : {op.unit, op.unit == head && tied ? 0 : -1}) {
      if (u < 0) continue;
      Run run{u, i, false};
      for (const Run& r : open)
        if (r.unit == u) run = r;
      run.reads = run.reads || !(op.kind == OpKind::backward && u == 0);
      next.push_back(run);
    }
    for (const Run& r : open)
      if (std::none_of(next.begin(), next.end(), [&](const Run& n) { return n.unit == r.unit; }))
        close(r);
    open = std::move(next);
  }
  for (const Run& r : open) close(r);
}

// A gradient on NVMe: written after each reduce, read back to add to from
// the second micro-batch on, and read by the streamed optimizer chunk by chunk.
void add_nvme_gradient_traffic(const TrainingPlan& plan, std::vector<StepTraffic>& traffic) {
  if (plan.homes.grad != Tier::nvme) return;
  const PlanInput& in = plan.input;
  const int64_t alignment = int64_t(in.nvme_alignment);
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    if (op.kind == OpKind::reduce) {
      // Layer-major: the sum over a unit's micro-batches is kept in host
      // memory (or on the GPU) and written once, after the last.
      if (plan.layer_major() && op.micro != in.grad_accum - 1) continue;
      const int64_t bytes = round_up(plan.units[size_t(op.unit)].grad_numel * 4, alignment);
      traffic[i].nvme_written += bytes;
      if (op.micro > 0 && !plan.layer_major()) traffic[i].nvme_read += bytes;
    }
    if (op.kind == OpKind::optimizer) {
      const int64_t n = plan.units[size_t(op.unit)].optimizer_numel;
      for (int64_t at = 0; at < n; at += plan.optimizer_chunk_elements)
        traffic[i].nvme_read +=
            round_up(std::min(plan.optimizer_chunk_elements, n - at) * 4, alignment);
    }
  }
}

}  // namespace

void add_collective_bytes(const PlanInput& in, int64_t bytes, StepTraffic& t) {
  const int64_t world = in.world_size;
  if (world <= 1 || bytes <= 0) return;
  const int64_t nodes = in.budgets.nodes(in.world_size);
  const int64_t node_ranks = in.budgets.node_ranks(in.world_size);
  // bytes = k (W - 1) s: k n (g - 1) s within the node, k (n - 1) s across nodes.
  const int64_t per_shard = bytes / (world - 1);
  t.intra_node += per_shard * nodes * (node_ranks - 1);
  t.inter_node += per_shard * (nodes - 1);
}

std::vector<StepTraffic> traffic_per_op(const TrainingPlan& plan) {
  const PlanInput& in = plan.input;
  const bool gpu = in.gpu;
  const int64_t cb = plan.compute_bytes;
  const bool params_in_place = plan.gpu_params_in_place();
  const bool grads_in_place = plan.gpu_grads_in_place();
  const int head = int(plan.units.size()) - 1;
  std::vector<StepTraffic> traffic(plan.ops.size());
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    StepTraffic& t = traffic[i];
    const UnitPlacement* p = op.unit >= 0 ? &plan.units[size_t(op.unit)] : nullptr;
    switch (op.kind) {
      case OpKind::fetch:
        t.nvme_read += op.bytes;
        break;
      case OpKind::spill:
      case OpKind::restore: {
        // Through NVMe, and on a GPU over PCIe (the exact saved input).
        int64_t& nvme = op.kind == OpKind::spill ? t.nvme_written : t.nvme_read;
        if (plan.activation_home() == Tier::nvme) nvme += op.bytes;
        int64_t& pcie = op.kind == OpKind::spill ? t.d2h : t.h2d;
        if (gpu) pcie += plan.tokens_per_micro * in.model.hidden_size * cb;
        break;
      }
      case OpKind::writeback:
        t.nvme_written += op.bytes;
        break;
      case OpKind::optimizer:
        if (defers_expert_updates(plan, op.unit)) {
          const WindowBytes worst = worst_update_bytes(plan, op.unit);
          t.nvme_read += worst.read;
          t.nvme_written += worst.written;
        } else if (plan.streamed_optimizer) {
          t.nvme_read += op.bytes / 2;
          t.nvme_written += op.bytes / 2;
        }
        if (gpu && plan.new_params_staged() && plan.homes.param == Tier::device)
          t.h2d += p->optimizer_numel * cb;
        if (gpu && plan.homes.optimizer == Tier::device && plan.homes.param != Tier::device)
          t.d2h += p->optimizer_numel * cb;
        break;
      case OpKind::gather:
        add_collective_bytes(in, op.bytes, t);
        if (gpu && !params_in_place && plan.homes.param == Tier::device)
          t.d2h += p->shard_numel * cb;
        break;
      case OpKind::reduce:
        add_collective_bytes(in, op.bytes, t);
        if (gpu && !grads_in_place && plan.homes.grad == Tier::device)
          t.h2d += (in.stage >= 2 ? p->shard_numel : p->padded_numel) * 4;
        break;
      case OpKind::exchange:
      case OpKind::share:  // its NVMe reads are the routed experts' (below)
        add_collective_bytes(in, op.bytes, t);
        break;
      case OpKind::sync:
        add_collective_bytes(in, op.bytes, t);
        if (gpu && params_in_place && in.world_size > 1) {
          t.d2h += p->shard_numel * cb;
          t.h2d += p->padded_numel * cb;
        }
        break;
      case OpKind::forward:
      case OpKind::backward: {
        const bool fills_grad = op.kind == OpKind::backward || op.unit == head;
        // Each gradient goes down (a tied embedding's with the lm_head's part in it),
        // or once its micro-batches have added up on the device.
        const bool sends = !plan.gpu_grads_summed_on_device() || op.micro == in.grad_accum - 1;
        if (gpu && fills_grad && !grads_in_place && sends) t.d2h += p->padded_numel * 4;
        break;
      }
      default:
        break;
    }
  }
  add_nvme_gradient_traffic(plan, traffic);
  // The worst case, at each operation the rank that reads the most.
  const std::vector<int64_t> experts = routed_expert_reads_per_op(plan, nullptr);
  for (size_t i = 0; i < plan.ops.size(); ++i) traffic[i].nvme_read += experts[i];
  const std::vector<WindowBytes> replays = deferred_replay_bytes_per_op(plan);  // worst case
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    traffic[i].nvme_read += replays[i].read;
    traffic[i].nvme_written += replays[i].written;
  }
  if (gpu && !params_in_place) add_gathered_uploads(plan, traffic);
  return traffic;
}

StepTraffic total_traffic(const std::vector<StepTraffic>& per_op) {
  StepTraffic sum;
  for (const StepTraffic& t : per_op) {
    sum.nvme_read += t.nvme_read;
    sum.nvme_written += t.nvme_written;
    sum.intra_node += t.intra_node;
    sum.inter_node += t.inter_node;
    sum.h2d += t.h2d;
    sum.d2h += t.d2h;
  }
  return sum;
}

}  // namespace strata
