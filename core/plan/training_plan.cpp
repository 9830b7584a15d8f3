#include "core/plan/training_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/model/cuda_units.h"
#include "core/plan/planner.h"
#include "io/base/sizes.h"

namespace strata {
namespace {

using tiers::Tier;

PlanOp make_op(OpKind kind, Lane lane, int unit = -1, int micro = -1, int slot = -1) {
  PlanOp op;
  op.kind = kind;
  op.lane = lane;
  op.unit = unit;
  op.micro = micro;
  op.slot = slot;
  return op;
}

std::string unit_label(const TrainingPlan& plan, int unit) {
  if (unit < 0) return "";
  return plan.layout.units[size_t(unit)].unit.name;
}

// Builds the op list by walking one step in a serial order that is also a
// valid order for every lane: gathers are emitted as early as their buffer
// allows, fetches as early as theirs, reductions right after their backward.
class PlanBuilder {
 public:
  explicit PlanBuilder(TrainingPlan& plan)
      : plan_(plan),
        in_(plan.input),
        units_(static_cast<int>(plan.layout.units.size())),
        head_(units_ - 1),
        tied_(plan.layout.config.tie_word_embeddings),
        stage3_(plan.input.stage == 3),
        early_(plan.input.optimizer_during_backward),
        writeback_(plan.homes.param == Tier::nvme && plan.homes.separate_master),
        comm_lane_(plan.input.overlap_comm ? Lane::comm : Lane::compute) {}

  void build() {
    list_compute_and_uses();
    if (early_) decide_index_ = add(make_op(OpKind::decide, Lane::optimizer));
    update_done_.assign(size_t(units_), -1);
    last_reduce_.assign(size_t(units_), -1);
    if (stage3_ && in_.offload_param == OffloadDevice::nvme) emit_fetches();
    for (size_t c = 0; c < compute_.size(); ++c) emit_compute(c);
    emit_exchange_and_updates();
    count_traffic();
  }

 private:
  // A compute operation of the step, and the gathered units it reads.
  struct ComputeUse {
    OpKind kind;
    int unit;
    int micro;
    std::vector<int> units;
  };
  // A gathered-buffer use: one unit over a run of consecutive compute
  // operations that read it (one gather serves them all); use i takes slot
  // i % gather_slots.
  struct Use {
    int unit;
    size_t first, last;  // compute operations
  };

  // The compute operations in schedule order. Micro-batch-major: per
  // micro-batch, forward of every unit (the head's forward and backward are
  // one pass), then backward of the layers and the embedding in reverse.
  // Layer-major: each unit's forward over every micro-batch, the head over
  // every micro-batch, then each unit's backward over every micro-batch in
  // reverse. Either way a unit's micro-batches reach it in order, so its
  // gradient sums in the same order.
  void list_compute() {
    const int G = int(in_.grad_accum);
    const std::vector<int> head_units =
        tied_ ? std::vector<int>{0, head_} : std::vector<int>{head_};
    if (plan_.layer_major()) {
      for (int u = 0; u < head_; ++u)
        for (int m = 0; m < G; ++m) compute_.push_back({OpKind::forward, u, m, {u}});
      for (int m = 0; m < G; ++m) compute_.push_back({OpKind::forward, head_, m, head_units});
      for (int u = head_ - 1; u >= 0; --u)
        for (int m = 0; m < G; ++m) compute_.push_back({OpKind::backward, u, m, {u}});
      return;
    }
    for (int m = 0; m < G; ++m) {
      for (int u = 0; u < head_; ++u) compute_.push_back({OpKind::forward, u, m, {u}});
      compute_.push_back({OpKind::forward, head_, m, head_units});
      for (int u = head_ - 1; u >= 0; --u) compute_.push_back({OpKind::backward, u, m, {u}});
    }
  }

  void list_compute_and_uses() {
    list_compute();
    // A unit read by consecutive compute operations is gathered once for all of them.
    std::vector<int> open(plan_.units.size(), -1);  // the unit's latest use
    compute_uses_.resize(compute_.size());
    for (size_t c = 0; c < compute_.size(); ++c) {
      for (int u : compute_[c].units) {
        int& latest = open[size_t(u)];
        if (latest >= 0 && uses_[size_t(latest)].last + 1 == c) {
          uses_[size_t(latest)].last = c;
        } else {
          uses_.push_back({u, c, c});
          latest = int(uses_.size()) - 1;
        }
        compute_uses_[c].push_back(size_t(latest));
      }
    }
    gather_op_.assign(uses_.size(), -1);
    fetch_op_.assign(uses_.size(), -1);
    release_op_.assign(uses_.size(), -1);
    compute_op_.assign(compute_.size(), -1);
    // The previous use of the same unit: its host copy must be gone before the
    // next fetch of that shard (a shard has one copy per tier).
    previous_use_.assign(uses_.size(), -1);
    std::vector<int> last(plan_.units.size(), -1);
    for (size_t i = 0; i < uses_.size(); ++i) {
      previous_use_[i] = last[size_t(uses_[i].unit)];
      last[size_t(uses_[i].unit)] = int(i);
    }
  }

  bool fetch_ready(size_t i) const {
    const int P = plan_.fetch_slots;
    if (int(i) >= P && gather_op_[i - size_t(P)] < 0) return false;  // its slot is still taken
    return previous_use_[i] < 0 || gather_op_[size_t(previous_use_[i])] >= 0;
  }

  // fetch(i) needs the host copy that gather(i - P) released.
  void emit_fetches() {
    const int P = plan_.fetch_slots;
    while (next_fetch_ < uses_.size() && fetch_ready(next_fetch_)) {
      const size_t i = next_fetch_++;
      PlanOp op = make_op(OpKind::fetch, Lane::io, uses_[i].unit, compute_[uses_[i].first].micro,
                          int(i % size_t(P)));
      if (int(i) >= P) op.deps.push_back(gather_op_[i - size_t(P)]);
      if (previous_use_[i] >= 0) op.deps.push_back(gather_op_[size_t(previous_use_[i])]);
      op.bytes = plan_.units[size_t(uses_[i].unit)].param_numel * plan_.compute_bytes;
      fetch_op_[i] = add(std::move(op));
    }
  }

  // gather(i) reuses the slot of use i - K, free once that use's last compute op released it.
  void emit_gathers_before(size_t c) {
    const int K = plan_.gather_slots;
    while (next_gather_ < uses_.size()) {
      const size_t i = next_gather_;
      if (int(i) >= K && uses_[i - size_t(K)].last >= c) break;
      PlanOp op = make_op(OpKind::gather, comm_lane_, uses_[i].unit, compute_[uses_[i].first].micro,
                          int(i % size_t(K)));
      if (int(i) >= K) op.deps.push_back(release_op_[i - size_t(K)]);
      if (fetch_op_[i] >= 0) op.deps.push_back(fetch_op_[i]);
      op.bytes = plan_.units[size_t(uses_[i].unit)].shard_numel * plan_.compute_bytes *
                 (in_.world_size - 1);
      gather_op_[i] = add(std::move(op));
      ++next_gather_;
      if (in_.offload_param == OffloadDevice::nvme) emit_fetches();
    }
  }

  // optimizer(u) and, for NVMe parameter homes, writeback(u); returns the last.
  int emit_update(int u, std::vector<int> deps) {
    PlanOp optimizer = make_op(OpKind::optimizer, Lane::optimizer, u);
    optimizer.deps = std::move(deps);
    const int64_t n = plan_.units[size_t(u)].optimizer_numel;
    // Read and written: the fp32 master, m and v as stored, chunk by chunk,
    // each piece rounded to the I/O alignment (int8's last piece may be short).
    if (plan_.homes.optimizer == Tier::nvme) {
      const int64_t chunk = plan_.optimizer_chunk_elements;
      const int64_t alignment = int64_t(in_.nvme_alignment);
      for (int64_t at = 0; at < n; at += chunk) {
        const int64_t piece = std::min(chunk, n - at);
        optimizer.bytes += 2 * (round_up(piece * 4, alignment) +
                                2 * round_up(piece * plan_.moment_bytes(), alignment));
      }
    }
    int last = add(std::move(optimizer));
    if (writeback_) {
      PlanOp write = make_op(OpKind::writeback, Lane::optimizer, u);
      write.deps.push_back(last);
      write.bytes = plan_.units[size_t(u)].param_numel * plan_.compute_bytes;
      last = add(std::move(write));
    }
    return last;
  }

  // Compute operation c with its gathers before it, its release and its reduction after it.
  void emit_compute(size_t c) {
    const ComputeUse& cu = compute_[c];
    if (stage3_) emit_gathers_before(c);
    PlanOp op = make_op(cu.kind, Lane::compute, cu.unit, cu.micro);
    if (stage3_) {
      for (size_t i : compute_uses_[c]) op.deps.push_back(gather_op_[i]);
    }
    // Gradient buffers: the head and every backward fill one; a tied
    // embedding's lives from the head to the embedding's reduce.
    const bool fills_grad = cu.kind == OpKind::backward || cu.unit == head_;
    const bool uses_rotating_grad = fills_grad && !(tied_ && cu.unit == 0);
    if (uses_rotating_grad) {
      op.slot = grad_use_ % plan_.grad_slots;
      if (grad_use_ >= plan_.grad_slots)
        op.deps.push_back(reduce_of_grad_use_[size_t(grad_use_ - plan_.grad_slots)]);
    }
    // One tied embedding gradient buffer: the next micro-batch's head waits
    // for the embedding's reduce (layer-major keeps one per micro-batch).
    if (tied_ && cu.unit == head_ && cu.micro > 0 && !plan_.layer_major())
      op.deps.push_back(last_reduce_[0]);
    // Spilled checkpoints (TrainingPlan::activations_spilled): the forward of
    // unit u writes level u over level u - 2, which must be out first; a
    // backward reads level u - 1, which must be back.
    if (cu.kind == OpKind::forward && cu.unit < head_ && plan_.spills(cu.unit - 2))
      op.deps.push_back(spill_op_[level_index(cu.unit - 2, cu.micro)]);
    if (cu.kind == OpKind::backward && plan_.spills(cu.unit - 1))
      op.deps.push_back(restore_op_[level_index(cu.unit - 1, cu.micro)]);
    compute_op_[c] = add(std::move(op));
    emit_spill_or_restore(c);
    if (stage3_) {
      // The uses that end here give their slots back.
      int release_index = -1;
      for (size_t i : compute_uses_[c]) {
        if (uses_[i].last != c) continue;
        if (release_index < 0) {
          PlanOp release = make_op(OpKind::release, Lane::compute, cu.unit, cu.micro);
          release.deps.push_back(compute_op_[c]);
          release_index = add(std::move(release));
        }
        release_op_[i] = release_index;
      }
    }
    if (fills_grad) emit_reduce(c, uses_rotating_grad);
  }

  size_t level_index(int level, int micro) const {
    return size_t(level) * size_t(in_.grad_accum) + size_t(micro);
  }

  // After compute operation c: the spill of the level a forward produced,
  // or the restore of the level whose slot a backward (or the head) has
  // just read for the last time: level k + 2 shares level k's slot, and its
  // last reader is the backward of unit k + 3, or the head for the last level.
  void emit_spill_or_restore(size_t c) {
    if (plan_.spilled_levels() == 0) return;
    const ComputeUse& cu = compute_[c];
    const int64_t bytes = plan_.checkpoint_transfer_bytes();
    if (spill_op_.empty()) {
      spill_op_.assign(level_index(plan_.spilled_levels(), 0), -1);
      restore_op_.assign(spill_op_.size(), -1);
    }
    if (cu.kind == OpKind::forward && cu.unit < head_ && plan_.spills(cu.unit)) {
      PlanOp spill = make_op(OpKind::spill, Lane::activations, cu.unit, cu.micro,
                             plan_.checkpoint_place(cu.unit, cu.micro).copy);
      spill.deps.push_back(compute_op_[c]);
      spill.bytes = bytes;
      spill_op_[level_index(cu.unit, cu.micro)] = add(std::move(spill));
      return;
    }
    const int freed = cu.kind == OpKind::backward ? cu.unit - 3 : cu.unit == head_ ? head_ - 3 : -1;
    if (!plan_.spills(freed)) return;
    PlanOp restore = make_op(OpKind::restore, Lane::activations, freed, cu.micro,
                             plan_.checkpoint_place(freed, cu.micro).copy);
    restore.deps.push_back(compute_op_[c]);
    restore.deps.push_back(spill_op_[level_index(freed, cu.micro)]);
    restore.bytes = bytes;
    restore_op_[level_index(freed, cu.micro)] = add(std::move(restore));
  }

  void emit_reduce(size_t c, bool uses_rotating_grad) {
    const ComputeUse& cu = compute_[c];
    PlanOp reduce = make_op(OpKind::reduce, comm_lane_, cu.unit, cu.micro,
                            uses_rotating_grad ? grad_use_ % plan_.grad_slots : -1);
    reduce.deps.push_back(compute_op_[c]);
    if (last_reduce_[size_t(cu.unit)] >= 0) reduce.deps.push_back(last_reduce_[size_t(cu.unit)]);
    const UnitPlacement& p = plan_.units[size_t(cu.unit)];
    const bool scatter = in_.stage >= 2 && in_.reduce_scatter;
    // Ring collectives: reduce-scatter sends (W-1)/W of the unit, all-reduce twice that.
    reduce.bytes =
        p.shard_numel * (in_.reduce_in_bf16 ? 2 : 4) * (in_.world_size - 1) * (scatter ? 1 : 2);
    const int index = add(std::move(reduce));
    last_reduce_[size_t(cu.unit)] = index;
    if (uses_rotating_grad) {
      reduce_of_grad_use_.push_back(index);
      ++grad_use_;
    }
    if (early_ && cu.micro == in_.grad_accum - 1) {
      update_done_[size_t(cu.unit)] = emit_update(cu.unit, {decide_index_, index});
      update_order_.push_back(cu.unit);
    }
  }

  // The exchange of norms and losses, the updates (unless they ran during
  // backward) and, at stages 1-2, the all-gathers of the updated parameters.
  void emit_exchange_and_updates() {
    PlanOp exchange = make_op(OpKind::exchange, comm_lane_);
    for (int u = 0; u < units_; ++u) exchange.deps.push_back(last_reduce_[size_t(u)]);
    // With the updates during backward the step's decision (its learning
    // rate, whether it applies) came from `decide`: the step is over, and
    // its result read, once the exchange is, so the decision must be in by then.
    if (early_) exchange.deps.push_back(decide_index_);
    const int exchange_index = add(std::move(exchange));
    if (!early_) {
      for (int u = 0; u < units_; ++u) {
        update_done_[size_t(u)] = emit_update(u, {exchange_index});
        update_order_.push_back(u);
      }
    }
    if (in_.stage == 1 || in_.stage == 2) {
      for (int u : update_order_) {
        PlanOp sync = make_op(OpKind::sync, comm_lane_, u);
        sync.deps.push_back(update_done_[size_t(u)]);
        sync.bytes =
            plan_.units[size_t(u)].shard_numel * plan_.compute_bytes * (in_.world_size - 1);
        add(std::move(sync));
      }
    }
  }

  // The bytes every link moves in one step: NVMe and the collectives from the
  // operations' bytes; on the CUDA backend, PCIe from the data paths of
  // core/engine/gpu_rank.h (a gathered unit goes up once per use, unless the
  // use is only the embedding's backward, which reads no parameters).
  void count_traffic() {
    StepTraffic& t = plan_.traffic_per_step;
    const bool gpu = in_.gpu;
    const int64_t cb = plan_.compute_bytes;
    const bool params_in_place = plan_.gpu_params_in_place();
    const bool grads_in_place = plan_.gpu_grads_in_place();
    for (const PlanOp& op : plan_.ops) {
      const UnitPlacement* p = op.unit >= 0 ? &plan_.units[size_t(op.unit)] : nullptr;
      switch (op.kind) {
        case OpKind::fetch:
          t.nvme_read += op.bytes;
          break;
        case OpKind::spill:
        case OpKind::restore: {
          // Through NVMe, and on a GPU over PCIe (the exact checkpoint).
          int64_t& nvme = op.kind == OpKind::spill ? t.nvme_written : t.nvme_read;
          if (in_.activation_home == Tier::nvme) nvme += op.bytes;
          int64_t& pcie = op.kind == OpKind::spill ? t.d2h : t.h2d;
          if (gpu) pcie += plan_.tokens_per_micro * in_.model.hidden_size * cb;
          break;
        }
        case OpKind::writeback:
          t.nvme_written += op.bytes;
          break;
        case OpKind::optimizer:
          if (plan_.streamed_optimizer) {
            t.nvme_read += op.bytes / 2;
            t.nvme_written += op.bytes / 2;
          }
          if (gpu && plan_.new_params_staged() && plan_.homes.param == Tier::device)
            t.h2d += p->optimizer_numel * cb;
          if (gpu && plan_.homes.optimizer == Tier::device && plan_.homes.param != Tier::device)
            t.d2h += p->optimizer_numel * cb;
          break;
        case OpKind::gather:
          t.collective += op.bytes;
          if (gpu && !params_in_place && plan_.homes.param == Tier::device)
            t.d2h += p->shard_numel * cb;
          break;
        case OpKind::reduce:
          t.collective += op.bytes;
          if (gpu && !grads_in_place && plan_.homes.grad == Tier::device)
            t.h2d += (in_.stage >= 2 ? p->shard_numel : p->padded_numel) * 4;
          break;
        case OpKind::sync:
          t.collective += op.bytes;
          if (gpu && params_in_place && in_.world_size > 1) {
            t.d2h += p->shard_numel * cb;
            t.h2d += p->padded_numel * cb;
          }
          break;
        case OpKind::forward:
        case OpKind::backward: {
          const bool fills_grad = op.kind == OpKind::backward || op.unit == head_;
          // Each gradient goes down (a tied embedding's with the lm_head's part in it),
          // or once its micro-batches have added up on the device.
          const bool sends = !plan_.gpu_grads_summed_on_device() || op.micro == in_.grad_accum - 1;
          if (gpu && fills_grad && !grads_in_place && sends) t.d2h += p->padded_numel * 4;
          break;
        }
        default:
          break;
      }
    }
    if (!gpu || params_in_place) return;
    for (const Use& use : uses_) {
      bool reads = false;
      for (size_t c = use.first; c <= use.last; ++c)
        reads = reads || !(compute_[c].kind == OpKind::backward && use.unit == 0);
      if (reads) t.h2d += plan_.units[size_t(use.unit)].padded_numel * cb;
    }
  }

  int add(PlanOp op) {
    plan_.ops.push_back(std::move(op));
    return static_cast<int>(plan_.ops.size()) - 1;
  }

  TrainingPlan& plan_;
  const TrainingPlanInput& in_;
  const int units_, head_;
  const bool tied_, stage3_, early_, writeback_;
  const Lane comm_lane_;
  std::vector<ComputeUse> compute_;
  std::vector<Use> uses_;
  std::vector<std::vector<size_t>> compute_uses_;                      // per compute op: its uses
  std::vector<int> gather_op_, fetch_op_, release_op_, previous_use_;  // per use
  std::vector<int> compute_op_;                                        // per compute op
  std::vector<int> spill_op_, restore_op_;  // per spilled level and micro-batch (level_index)
  size_t next_gather_ = 0, next_fetch_ = 0;
  int decide_index_ = -1;
  int grad_use_ = 0;
  std::vector<int> reduce_of_grad_use_, last_reduce_, update_done_, update_order_;
};

}  // namespace

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::fetch:
      return "fetch";
    case OpKind::gather:
      return "gather";
    case OpKind::forward:
      return "forward";
    case OpKind::release:
      return "release";
    case OpKind::backward:
      return "backward";
    case OpKind::reduce:
      return "reduce";
    case OpKind::exchange:
      return "exchange";
    case OpKind::decide:
      return "decide";
    case OpKind::optimizer:
      return "optimizer";
    case OpKind::writeback:
      return "writeback";
    case OpKind::sync:
      return "sync";
    case OpKind::spill:
      return "spill";
    case OpKind::restore:
      return "restore";
  }
  return "?";
}

const char* lane_name(Lane lane) {
  switch (lane) {
    case Lane::io:
      return "io";
    case Lane::comm:
      return "comm";
    case Lane::compute:
      return "compute";
    case Lane::optimizer:
      return "optimizer";
    case Lane::activations:
      return "activations";
  }
  return "?";
}

std::string PlanOp::text() const {
  std::string out = op_kind_name(kind);
  if (unit >= 0) out += fmt::format("(unit {})", unit);
  if (micro >= 0) out += fmt::format(" mb {}", micro);
  return out;
}

std::string op_label(const TrainingPlan& plan, const PlanOp& op) {
  std::string out = op_kind_name(op.kind);
  if (op.unit >= 0) out += "(" + unit_label(plan, op.unit) + ")";
  if (op.micro >= 0) out += fmt::format(" mb {}", op.micro);
  return out;
}

const char* buffer_role_name(BufferRole role) {
  switch (role) {
    case BufferRole::param_state:
      return "param_state";
    case BufferRole::grad_state:
      return "grad_state";
    case BufferRole::master_state:
      return "master_state";
    case BufferRole::m_state:
      return "m_state";
    case BufferRole::v_state:
      return "v_state";
    case BufferRole::int8_scales:
      return "int8_scales";
    case BufferRole::gathered_unit:
      return "gathered_unit";
    case BufferRole::gathered_unit_fp32:
      return "gathered_unit_fp32";
    case BufferRole::widened_params:
      return "widened_params";
    case BufferRole::unit_gradient:
      return "unit_gradient";
    case BufferRole::tied_gradient:
      return "tied_gradient";
    case BufferRole::reduce_scatter_output:
      return "reduce_scatter_output";
    case BufferRole::sync_staging:
      return "sync_staging";
    case BufferRole::tokens_and_targets:
      return "tokens_and_targets";
    case BufferRole::activation_checkpoints:
      return "activation_checkpoints";
    case BufferRole::activation_gradient:
      return "activation_gradient";
    case BufferRole::activation_spill:
      return "activation_spill";
    case BufferRole::activation_staging:
      return "activation_staging";
    case BufferRole::unit_working_set:
      return "unit_working_set";
    case BufferRole::new_parameters:
      return "new_parameters";
    case BufferRole::nccl_staging:
      return "nccl_staging";
    case BufferRole::gpu_param_slots:
      return "gpu_param_slots";
    case BufferRole::gpu_unit_gradients:
      return "gpu_unit_gradients";
    case BufferRole::gpu_tied_gradient:
      return "gpu_tied_gradient";
    case BufferRole::gpu_grad_norm_scratch:
      return "gpu_grad_norm_scratch";
    case BufferRole::gpu_reduced_gradient:
      return "gpu_reduced_gradient";
    case BufferRole::gpu_gradient_sum:
      return "gpu_gradient_sum";
    case BufferRole::gpu_new_parameters:
      return "gpu_new_parameters";
    case BufferRole::gpu_activation_checkpoints:
      return "gpu_activation_checkpoints";
    case BufferRole::gpu_activation_gradient:
      return "gpu_activation_gradient";
    case BufferRole::gpu_tokens_and_targets:
      return "gpu_tokens_and_targets";
    case BufferRole::gpu_token_losses:
      return "gpu_token_losses";
    case BufferRole::gpu_matmul_workspace:
      return "gpu_matmul_workspace";
    case BufferRole::gpu_unit_working_set:
      return "gpu_unit_working_set";
    case BufferRole::nvme_parameter_copies:
      return "nvme_parameter_copies";
    case BufferRole::optimizer_stream:
      return "optimizer_stream";
    case BufferRole::nvme_shard_staging:
      return "nvme_shard_staging";
    case BufferRole::gradient_staging:
      return "gradient_staging";
  }
  return "?";
}

int64_t buffer_element_bytes(BufferElement element) {
  switch (element) {
    case BufferElement::f32:
    case BufferElement::i32:
      return 4;
    case BufferElement::bf16:
    case BufferElement::f16:
      return 2;
    case BufferElement::byte:
      return 1;
  }
  return 1;
}

const char* buffer_element_name(BufferElement element) {
  switch (element) {
    case BufferElement::f32:
      return "f32";
    case BufferElement::bf16:
      return "bf16";
    case BufferElement::f16:
      return "f16";
    case BufferElement::i32:
      return "i32";
    case BufferElement::byte:
      return "byte";
  }
  return "?";
}

std::optional<tiers::ShardKind> state_shard_kind(BufferRole role) {
  switch (role) {
    case BufferRole::param_state:
      return tiers::ShardKind::param;
    case BufferRole::grad_state:
      return tiers::ShardKind::grad;
    case BufferRole::master_state:
      return tiers::ShardKind::master;
    case BufferRole::m_state:
      return tiers::ShardKind::m;
    case BufferRole::v_state:
      return tiers::ShardKind::v;
    default:
      return std::nullopt;
  }
}

int64_t TrainingPlan::state_numel(int u, BufferRole role) const {
  const UnitPlacement& p = units[size_t(u)];
  switch (role) {
    case BufferRole::param_state:
      return p.param_numel;
    case BufferRole::grad_state:
      return p.grad_numel;
    case BufferRole::master_state:
    case BufferRole::m_state:
    case BufferRole::v_state:
      return p.optimizer_numel;
    default:
      return 0;
  }
}

int64_t TrainingPlan::checkpoint_bytes() const {
  return tokens_per_micro * input.model.hidden_size * (input.gpu ? compute_bytes : 4);
}

int64_t TrainingPlan::checkpoint_transfer_bytes() const {
  return input.activation_home == Tier::nvme
             ? round_up(checkpoint_bytes(), int64_t(input.nvme_alignment))
             : checkpoint_bytes();
}

const PlanBuffer* TrainingPlan::buffer(BufferRole role) const {
  for (const PlanBuffer& b : buffers)
    if (b.role == role) return &b;
  return nullptr;
}

kernels::cpu::ElementType TrainingPlan::compute_type() const {
  switch (input.precision) {
    case Precision::fp32:
      return kernels::cpu::ElementType::f32;
    case Precision::bf16:
      return kernels::cpu::ElementType::bf16;
    case Precision::fp16:
      return kernels::cpu::ElementType::f16;
  }
  return kernels::cpu::ElementType::f32;
}

int64_t TrainingPlan::optimizer_offset(int u, int rank) const {
  return input.stage == 0 ? 0 : int64_t(rank) * units[size_t(u)].shard_numel;
}

kernels::cpu::AdamWStateType TrainingPlan::state_type() const {
  switch (input.optimizer_state) {
    case OptimizerStateDtype::fp32:
      return kernels::cpu::AdamWStateType::f32;
    case OptimizerStateDtype::bf16:
      return kernels::cpu::AdamWStateType::bf16;
    case OptimizerStateDtype::int8:
      return kernels::cpu::AdamWStateType::int8;
  }
  return kernels::cpu::AdamWStateType::f32;
}

int64_t TrainingPlan::moment_bytes() const {
  return input.optimizer_state == OptimizerStateDtype::fp32   ? 4
         : input.optimizer_state == OptimizerStateDtype::bf16 ? 2
                                                              : 1;
}

// Weight decay on 2-D tensors only; padding and gaps have none.
std::vector<ShardSegment> TrainingPlan::segments(int u, int rank) const {
  const int64_t begin = optimizer_offset(u, rank);
  const int64_t end = begin + units[size_t(u)].optimizer_numel;
  std::vector<ShardSegment> out;
  int64_t at = begin;
  for (const TensorSlot& slot : layout.units[size_t(u)].tensors) {
    const int64_t b = std::max(begin, slot.offset), e = std::min(end, slot.offset + slot.numel);
    if (b >= e) continue;
    if (b > at) out.push_back({at - begin, b - begin, ParamGroup::no_decay});
    out.push_back({b - begin, e - begin, param_group_for_shape(slot.shape)});
    at = e;
  }
  if (at < end) out.push_back({at - begin, end - begin, ParamGroup::no_decay});
  return out;
}

namespace {

// What a rank keeps of one unit, by ZeRO stage.
UnitPlacement place_unit(int64_t padded_numel, int64_t shard_numel, int stage) {
  UnitPlacement p;
  p.padded_numel = padded_numel;
  p.shard_numel = shard_numel;
  p.param_numel = stage == 3 ? shard_numel : padded_numel;
  p.grad_numel = stage >= 2 ? shard_numel : padded_numel;
  p.optimizer_numel = stage >= 1 ? shard_numel : padded_numel;
  return p;
}

// The model-state lines: one per kind of state, each unit's shard rounded to
// a page on its own (the store adds one shard per unit), the sum rounded to
// the tier's alignment.
void add_state_buffers(TrainingPlan& plan) {
  const TrainingPlanInput& in = plan.input;
  const int64_t page = 4096;
  auto add_state = [&](BufferRole role, std::string name, Tier tier, BufferElement element) {
    int64_t bytes = 0, elements = 0;
    for (int u = 0; u < int(plan.units.size()); ++u) {
      elements += plan.state_numel(u, role);
      bytes += round_up(plan.state_numel(u, role) * buffer_element_bytes(element), page);
    }
    if (bytes <= 0) return;
    const int64_t alignment = tier == Tier::nvme ? int64_t(in.nvme_alignment) : page;
    bytes = round_up(bytes, alignment);
    plan.buffers.push_back(
        {role, BufferOwner::store, std::move(name), tier, element, 1, elements, bytes});
    plan.peak_bytes[static_cast<int>(tier)] += bytes;
  };
  add_state(BufferRole::param_state, fmt::format("parameters ({})", precision_name(in.precision)),
            plan.homes.param, compute_element(in.precision));
  add_state(BufferRole::grad_state, plan.homes.grad_bf16 ? "gradients (bf16)" : "gradients (fp32)",
            plan.homes.grad, plan.homes.grad_bf16 ? BufferElement::bf16 : BufferElement::f32);
  if (plan.homes.separate_master)
    add_state(BufferRole::master_state, "fp32 master", plan.homes.optimizer, BufferElement::f32);
  // m and v as strata.optimizer_state_dtype stores them; int8's block scales
  // (one fp32 each per block) lie beside the optimizer that updates them: in
  // device memory for the CUDA backend's optimizer on the GPU, in host memory
  // beside the CPU optimizer otherwise (whatever tier holds the codes).
  const OptimizerStateDtype state = in.optimizer_state;
  const BufferElement moment = state == OptimizerStateDtype::fp32   ? BufferElement::f32
                               : state == OptimizerStateDtype::bf16 ? BufferElement::bf16
                                                                    : BufferElement::byte;
  const std::string suffix = state == OptimizerStateDtype::fp32
                                 ? ""
                                 : fmt::format(" ({})", optimizer_state_dtype_name(state));
  add_state(BufferRole::m_state, "Adam m" + suffix, plan.homes.optimizer, moment);
  add_state(BufferRole::v_state, "Adam v" + suffix, plan.homes.optimizer, moment);
  if (state == OptimizerStateDtype::int8) {
    int64_t blocks = 0;
    for (const UnitPlacement& p : plan.units) blocks += p.int8_blocks;
    if (blocks > 0) {
      const int64_t bytes = 2 * round_up(blocks * 4, page);
      const Tier tier = in.gpu && plan.homes.optimizer == Tier::device ? Tier::device : Tier::host;
      plan.buffers.push_back({BufferRole::int8_scales, BufferOwner::rank,
                              "Adam m and v int8 block scales (fp32)", tier, BufferElement::f32, 2,
                              blocks, bytes});
      plan.peak_bytes[static_cast<int>(tier)] += bytes;
    }
  }
}

// The plan's buffers besides the model state, in the order the ranks allocate them.
class BufferListing {
 public:
  BufferListing(TrainingPlan& plan, int64_t largest_padded, int64_t largest_shard,
                int64_t largest_optimizer)
      : plan(plan),
        in(plan.input),
        largest_padded(largest_padded),
        largest_shard(largest_shard),
        largest_optimizer(largest_optimizer),
        cb(plan.compute_bytes),
        compute(compute_element(plan.input.precision)),
        N(plan.tokens_per_micro),
        C(plan.input.model.hidden_size),
        units(static_cast<int>(plan.units.size())),
        embedding_padded(plan.units[0].padded_numel),
        copies(plan.activation_copies()),
        scatter_output(plan.input.stage >= 2 && plan.input.reduce_scatter &&
                       plan.input.world_size > 1) {}

  // The GPU computes the units (core/engine/gpu_rank.h); the collectives and the
  // CPU optimizer work on pinned host buffers. What passes through host
  // memory depends on where the state lives.
  void add_gpu_buffers() {
    const bool params_in_place = plan.gpu_params_in_place();
    const bool grads_in_place = plan.gpu_grads_in_place();
    if (!params_in_place)
      add(R::gathered_unit, O::rank,
          fmt::format("gathered units ({} x largest unit)", plan.gather_slots), Tier::host, compute,
          plan.gather_slots, largest_padded);
    if (!grads_in_place) {
      add(R::unit_gradient, O::rank,
          fmt::format("unit gradients ({} x largest unit, fp32)", plan.grad_slots), Tier::host, f32,
          plan.grad_slots, largest_padded);
      if (plan.tied_grad_buffer)
        add(R::tied_gradient, O::rank, copies_name("tied embedding gradient"), Tier::host, f32,
            copies, embedding_padded);
      if (scatter_output)
        add(R::reduce_scatter_output, O::rank, "reduce-scatter output", Tier::host, f32, 1,
            largest_shard);
    }
    if (plan.gpu_grads_summed_on_device())
      add(R::gpu_gradient_sum, O::gpu, "device gradient sum over the micro-batches", Tier::device,
          f32, 1, largest_padded);
    if ((in.stage == 1 || in.stage == 2) && in.world_size > 1)
      add(R::sync_staging, O::rank, "parameter all-gather staging (largest unit)", Tier::host,
          compute, 1, largest_padded);
    add(R::tokens_and_targets, O::rank, "tokens and targets", Tier::host, i32, 1,
        2 * N * in.grad_accum);
    if (!params_in_place)
      add(R::gpu_param_slots, O::gpu,
          fmt::format("device parameter slots ({} x largest unit)", kGpuParamSlots), Tier::device,
          compute, kGpuParamSlots, largest_padded);
    if (!grads_in_place) {
      add(R::gpu_unit_gradients, O::gpu,
          fmt::format("device unit gradients ({} x largest unit, fp32)", kGpuGradBuffers),
          Tier::device, f32, kGpuGradBuffers, largest_padded);
      if (plan.tied_grad_buffer)
        add(R::gpu_tied_gradient, O::gpu, copies_name("device tied embedding gradient"),
            Tier::device, f32, copies, embedding_padded);
    }
    if (plan.homes.grad == Tier::device) {
      add(R::gpu_grad_norm_scratch, O::gpu, "gradient norm scratch", Tier::device, byte, 1,
          cuda_grad_norm_scratch_bytes(largest_padded) + 4096);
      if (!grads_in_place)
        add(R::gpu_reduced_gradient, O::gpu, "device reduced gradient", Tier::device, f32, 1,
            largest_padded);
    }
    if (plan.homes.optimizer == Tier::device && plan.homes.param != Tier::device && cb != 4)
      add(R::gpu_new_parameters, O::gpu, "device new parameter shard", Tier::device, compute, 1,
          largest_optimizer);
    if (in.nccl_staging)
      add(R::nccl_staging, O::rank, "NCCL staging (2 x largest unit, fp32)", Tier::device, f32, 2,
          largest_padded);
    if (plan.activations_spilled())
      add(R::gpu_activation_checkpoints, O::gpu, slots_name(), Tier::device, compute,
          plan.checkpoint_copies(), slot_elements(cb));
    else
      add(R::gpu_activation_checkpoints, O::gpu,
          copies_name("activation checkpoints (unit inputs)"), Tier::device, compute, copies,
          (units - 1) * N * C);
    add(R::gpu_activation_gradient, O::gpu, copies_name("activation gradient"), Tier::device,
        compute, copies, N * C);
    add(R::gpu_tokens_and_targets, O::gpu, "device tokens and targets", Tier::device, i32, 1,
        2 * N * in.grad_accum);
    add(R::gpu_token_losses, O::gpu, "per-token losses", Tier::device, f32, 1, N);
    add(R::gpu_matmul_workspace, O::gpu, "cuBLASLt workspace", Tier::device, byte, 1,
        kGpuMatmulWorkspaceBytes);
    add_spill_buffers(compute, cb);
    add(R::gpu_unit_working_set, O::gpu, "GPU unit working set", Tier::device, byte, 1,
        cuda_unit_workspace_bytes(in.model, in.micro_batch, in.seq_len, int(cb)));
  }

  // The CPU backend computes in fp32, so compute-precision parameters are
  // widened into an fp32 twin; host memory stands in for the device.
  void add_cpu_buffers() {
    if (in.stage == 3) {
      add(R::gathered_unit, O::rank,
          fmt::format("gathered units ({} x largest unit)", plan.gather_slots), Tier::device,
          compute, plan.gather_slots, largest_padded);
      if (cb != 4)
        add(R::gathered_unit_fp32, O::rank, "gathered units widened to fp32", Tier::device, f32,
            plan.gather_slots, largest_padded);
    } else if (cb != 4) {
      add(R::widened_params, O::rank, "parameters widened to fp32 (2 units)", Tier::device, f32, 2,
          largest_padded);
    }
    add(R::unit_gradient, O::rank,
        fmt::format("unit gradients ({} x largest unit, fp32)", plan.grad_slots), Tier::device, f32,
        plan.grad_slots, largest_padded);
    if (plan.tied_grad_buffer)
      add(R::tied_gradient, O::rank, copies_name("tied embedding gradient"), Tier::device, f32,
          copies, embedding_padded);
    if (scatter_output)
      add(R::reduce_scatter_output, O::rank, "reduce-scatter output", Tier::device, f32, 1,
          largest_shard);
    // Host memory is the device tier here: a host home only moves the budget they count against.
    const Tier kept = in.activation_home == Tier::host ? Tier::host : Tier::device;
    if (plan.activations_spilled())
      add(R::activation_checkpoints, O::rank, slots_name(), Tier::device, f32,
          plan.checkpoint_copies(), slot_elements(4));
    else
      add(R::activation_checkpoints, O::rank,
          copies_name("activation checkpoints (unit inputs, fp32)"), kept, f32, copies,
          (units - 1) * N * C);
    add(R::activation_gradient, O::rank, copies_name("activation gradient"), kept, f32, copies,
        N * C);
    add_spill_buffers(f32, 4);
    add(R::tokens_and_targets, O::rank, "tokens and targets", Tier::device, i32, 1,
        2 * N * in.grad_accum);
    add(R::unit_working_set, O::rank, "unit working set", Tier::device, byte, 1,
        UnitWorkspace::bytes_for(in.model, in.micro_batch, in.seq_len));
  }

  // Pinned host buffers of the store, the streamed optimizer and the new parameters.
  void add_host_buffers() {
    add(R::nvme_parameter_copies, O::store,
        fmt::format("NVMe parameter copies ({} x largest shard)", plan.fetch_slots), Tier::host,
        compute, plan.fetch_slots, largest_shard);
    // Per element: master, m, v (and the gradient, read from NVMe).
    const int64_t chunk_bytes =
        4 + 2 * plan.moment_bytes() + (plan.homes.grad == Tier::nvme ? 4 : 0);
    if (plan.streamed_optimizer && chunk_bytes == 12)
      add(R::optimizer_stream, O::store,
          fmt::format("streamed optimizer buffers ({} x {} elements x 12 B)", in.optimizer_buffers,
                      plan.optimizer_chunk_elements),
          Tier::host, f32, in.optimizer_buffers, plan.optimizer_chunk_elements * 3);
    else if (plan.streamed_optimizer)
      add(R::optimizer_stream, O::store,
          fmt::format("streamed optimizer buffers ({} x {} elements x {} B)", in.optimizer_buffers,
                      plan.optimizer_chunk_elements, chunk_bytes),
          Tier::host, byte, in.optimizer_buffers, plan.optimizer_chunk_elements * chunk_bytes);
    if (plan.new_params_staged())
      add(R::new_parameters, O::rank,
          plan.homes.param == Tier::nvme ? "new parameter shard on its way to NVMe"
                                         : "new parameters on their way to the GPU",
          Tier::host, compute, 1, largest_optimizer);
    // write_shard / read_shard stage NVMe homes through one block (tiers/tiered_store.h).
    int64_t largest_nvme_shard = 0;
    if (plan.homes.param == Tier::nvme)
      largest_nvme_shard = std::max(largest_nvme_shard, largest_shard * cb);
    if (plan.homes.optimizer == Tier::nvme)
      largest_nvme_shard = std::max(largest_nvme_shard, largest_optimizer * 4);
    int64_t largest_grad = 0;
    for (const UnitPlacement& p : plan.units) largest_grad = std::max(largest_grad, p.grad_numel);
    if (plan.homes.grad == Tier::nvme) {
      largest_nvme_shard = std::max(largest_nvme_shard, largest_grad * 4);
      // From the second micro-batch on, the stored sum is read to add to; in
      // the layer-major order a unit's micro-batches come one after another,
      // so the sum stays here and goes to NVMe once.
      if (in.grad_accum > 1)
        add(R::gradient_staging, O::rank,
            plan.layer_major() ? "gradient sum on its way to NVMe (largest shard, fp32)"
                               : "gradient read back from NVMe (largest shard, fp32)",
            Tier::host, f32, 1, largest_grad);
    }
    // One block per lane that stages at once: the optimizer's writebacks, and
    // the reductions writing gradients homed on NVMe.
    add(R::nvme_shard_staging, O::store, "NVMe shard staging", Tier::host, byte,
        plan.homes.grad == Tier::nvme ? 2 : 1,
        std::min<int64_t>(int64_t(tiers::kShardStagingBytes), largest_nvme_shard));
  }

 private:
  using R = BufferRole;
  using O = BufferOwner;
  static constexpr BufferElement f32 = BufferElement::f32, i32 = BufferElement::i32,
                                 byte = BufferElement::byte;
  static constexpr int64_t page = 4096;

  void add(BufferRole role, BufferOwner owner, std::string name, Tier tier, BufferElement element,
           int copies, int64_t elements) {
    if (copies <= 0 || elements <= 0) return;
    const int64_t alignment = tier == Tier::nvme ? int64_t(in.nvme_alignment) : page;
    const int64_t bytes = copies * round_up(elements * buffer_element_bytes(element), alignment);
    plan.buffers.push_back({role, owner, std::move(name), tier, element, copies, elements, bytes});
    plan.peak_bytes[static_cast<int>(tier)] += bytes;
  }

  TrainingPlan& plan;
  const TrainingPlanInput& in;
  const int64_t largest_padded, largest_shard, largest_optimizer, cb;
  const BufferElement compute;
  const int64_t N, C;
  const int units;
  const int64_t embedding_padded;
  const int copies;  // of what a micro-batch keeps to its backward
  const bool scatter_output;

  // Spilled checkpoints: the levels below the last two, one copy per
  // micro-batch each, in their home (host memory or NVMe; the engine rank
  // moves them), and on a GPU with NVMe one host staging copy between the two.
  void add_spill_buffers(BufferElement element, int64_t element_bytes) {
    const int levels = plan.spilled_levels();
    if (levels == 0) return;
    const int G = int(in.grad_accum);
    add(R::activation_spill, O::rank,
        fmt::format("activation checkpoints spilled ({} levels x {} micro-batches)", levels, G),
        in.activation_home, element, levels * G, slot_elements(element_bytes));
    if (in.gpu && in.activation_home == Tier::nvme)
      add(R::activation_staging, O::rank, "activation checkpoint on its way to or from NVMe",
          Tier::host, element, 1, slot_elements(element_bytes));
  }
  // One spilled checkpoint's elements, as long as a transfer (the I/O alignment on NVMe).
  int64_t slot_elements(int64_t element_bytes) const {
    return plan.checkpoint_transfer_bytes() / element_bytes;
  }
  std::string slots_name() const {
    return fmt::format("activation checkpoint slots (2 levels x {} micro-batches)", in.grad_accum);
  }

  // "activation gradient (8 micro-batches)" in the layer-major schedule.
  std::string copies_name(const char* what) const {
    return copies == 1 ? std::string(what) : fmt::format("{} ({} micro-batches)", what, copies);
  }
};

}  // namespace

Tier home_of(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::none:
      return Tier::device;
    case OffloadDevice::cpu:
      return Tier::host;
    case OffloadDevice::nvme:
      return Tier::nvme;
  }
  return Tier::device;
}

// Where each kind of state lives (the table in core/README.md).
StateHomes state_homes(const TrainingPlanInput& in) {
  StateHomes homes;
  homes.param = home_of(in.offload_param);
  homes.optimizer = home_of(in.offload_optimizer);
  homes.grad = in.offload_optimizer == OffloadDevice::none ? Tier::device : Tier::host;
  if (homes.grad == Tier::host) {
    homes.grad_bf16 = in.gradient_home == GradientHome::host_bf16;
    if (in.gradient_home == GradientHome::nvme) homes.grad = Tier::nvme;
  }
  homes.separate_master = in.precision != Precision::fp32 || homes.param != homes.optimizer;
  return homes;
}

std::vector<PlanBuffer> state_buffers_for(const TrainingPlanInput& input,
                                          const std::vector<int64_t>& unit_numels) {
  TrainingPlan plan;
  plan.input = input;
  plan.homes = state_homes(input);
  for (int64_t numel : unit_numels) {
    const int64_t shard = padded_shard_elements(numel, input.world_size);
    plan.units.push_back(place_unit(shard * input.world_size, shard, input.stage));
    // One parameter group: the range's blocks of 256.
    if (input.optimizer_state == OptimizerStateDtype::int8)
      plan.units.back().int8_blocks = kernels::cpu::adamw_state_scale_count(
          kernels::cpu::AdamWStateType::int8, plan.units.back().optimizer_numel);
  }
  add_state_buffers(plan);
  return plan.buffers;
}

BufferElement compute_element(Precision precision) {
  switch (precision) {
    case Precision::fp32:
      return BufferElement::f32;
    case Precision::bf16:
      return BufferElement::bf16;
    case Precision::fp16:
      return BufferElement::f16;
  }
  return BufferElement::f32;
}

Status check_gradient_home(const TrainingPlanInput& in) {
  if (in.offload_optimizer == OffloadDevice::none && in.gradient_home != GradientHome::automatic)
    return Status::error(fmt::format(
        "strata.gradient_home {}: with the optimizer on the device the gradients stay there; "
        "offload the optimizer (--offload-optimizer cpu or nvme) or leave it auto",
        gradient_home_name(in.gradient_home)));
  if (in.gradient_home == GradientHome::nvme && in.offload_optimizer != OffloadDevice::nvme)
    return Status::error(
        "strata.gradient_home nvme: the streamed optimizer reads gradients from NVMe with its "
        "state, so it needs --offload-optimizer nvme; use host or host_bf16 otherwise");
  return Status::ok();
}

Result<TrainingPlan> build_training_plan(const TrainingPlanInput& in) {
  // The gradient's home: an exact one (fp32) unless another is asked for.
  if (Status s = check_gradient_home(in); !s) return s;
  if (in.gradient_home == GradientHome::automatic && in.offload_optimizer != OffloadDevice::none) {
    TrainingPlanInput host = in;
    host.gradient_home = GradientHome::host;
    Result<TrainingPlan> plan = build_training_plan(host);
    if (!plan) return plan;
    const int64_t need = plan->peak(Tier::host);
    const bool over = in.host_budget > 0 && need > in.host_budget;
    if (over && in.offload_optimizer == OffloadDevice::nvme) {
      TrainingPlanInput nvme = in;
      nvme.gradient_home = GradientHome::nvme;
      Result<TrainingPlan> on_nvme = build_training_plan(nvme);
      if (!on_nvme) return on_nvme;
      on_nvme->input.gradient_home = GradientHome::automatic;
      on_nvme->gradient_home_reason = fmt::format(
          "gradients on NVMe, fp32 (auto: in host memory the plan needs {} of host per rank, "
          "over the budget of {})",
          format_bytes(double(need)), format_bytes(double(in.host_budget)));
      return on_nvme;
    }
    plan->input.gradient_home = GradientHome::automatic;
    plan->gradient_home_reason =
        in.host_budget > 0 && !over
            ? fmt::format(
                  "gradients in host memory, fp32 (auto: the plan's {} of host per rank "
                  "fits the budget of {})",
                  format_bytes(double(need)), format_bytes(double(in.host_budget)))
            : std::string("gradients in host memory, fp32 (auto") +
                  (over ? ": over the host budget, but only an optimizer on NVMe reads them there)"
                        : ": no host budget given)");
    return plan;
  }
  if (in.world_size < 1) return Status::error("world size must be at least 1");
  if (in.stage < 0 || in.stage > 3)
    return Status::error(
        fmt::format("zero_optimization.stage must be 0, 1, 2 or 3, got {}", in.stage));
  if (in.offload_param != OffloadDevice::none && in.stage != 3)
    return Status::error(fmt::format(
        "zero_optimization.offload_param.device {} needs stage 3 (stage is {}); use --zero-stage 3 "
        "or --offload-param none",
        offload_device_name(in.offload_param), in.stage));
  if (in.micro_batch < 1 || in.seq_len < 1 || in.grad_accum < 1)
    return Status::error(
        "micro batch, sequence length and gradient accumulation must be at least 1");
  if (in.fetch_slots < 1)
    return Status::error("zero_optimization.offload_param.buffer_count must be at least 1");
  if (in.optimizer_buffers < 2)
    return Status::error("zero_optimization.offload_optimizer.buffer_count must be at least 2");
  if (in.schedule == Schedule::auto_choice)
    return Status::error("the training plan needs a schedule (micro_batch or layer), not auto");

  TrainingPlan plan;
  plan.input = in;
  plan.layout = model_layout(in.model, in.world_size);
  plan.compute_bytes = compute_bytes(in.precision);
  plan.tokens_per_micro = in.micro_batch * in.seq_len;
  plan.homes = state_homes(in);
  plan.gather_slots = in.stage == 3 ? 2 : 0;
  plan.tied_grad_buffer = in.model.tie_word_embeddings;
  plan.fetch_slots = in.stage == 3 && in.offload_param == OffloadDevice::nvme ? in.fetch_slots : 0;
  plan.streamed_optimizer = plan.homes.optimizer == Tier::nvme;
  // In place the head adds the lm_head's gradient straight into the tied
  // embedding's home; layer-major would add every micro-batch's before the
  // embedding's own, another order of the same sum.
  if (plan.layer_major() && in.grad_accum > 1 && in.model.tie_word_embeddings &&
      plan.gpu_grads_in_place())
    return Status::error(
        "the layer-major schedule is not built for a tied embedding whose gradient accumulates in "
        "GPU memory (one rank, optimizer on the GPU): it would sum in another order; use "
        "--schedule micro_batch or offload the optimizer");

  int64_t largest_padded = 0, largest_shard = 0, largest_optimizer = 0;
  for (const UnitLayout& unit : plan.layout.units) {
    const UnitPlacement p = place_unit(unit.padded_numel, unit.shard_numel, in.stage);
    plan.units.push_back(p);
    largest_padded = std::max(largest_padded, p.padded_numel);
    largest_shard = std::max(largest_shard, p.shard_numel);
    largest_optimizer = std::max(largest_optimizer, p.optimizer_numel);
  }
  if (in.optimizer_chunk_elements <= 0 || in.optimizer_chunk_elements % 1024 != 0)
    return Status::error(
        fmt::format("optimizer chunk of {} elements: it must be a positive multiple of 1024; check "
                    "zero_optimization.sub_group_size",
                    in.optimizer_chunk_elements));
  plan.optimizer_chunk_elements = std::min(in.optimizer_chunk_elements, largest_optimizer);
  // Compact m and v: chunks start at multiples of 4096 elements, so their
  // pieces of bf16 or int8 stay on the I/O alignment (and int8 blocks whole).
  if (in.optimizer_state != OptimizerStateDtype::fp32)
    plan.optimizer_chunk_elements = round_up(plan.optimizer_chunk_elements, int64_t{4096});
  if (in.optimizer_state == OptimizerStateDtype::int8) {
    for (int u = 0; u < int(plan.units.size()); ++u)
      for (int r = 0; r < (in.stage == 0 ? 1 : in.world_size); ++r)
        plan.units[size_t(u)].int8_blocks =
            std::max(plan.units[size_t(u)].int8_blocks,
                     int8_block_count(plan.segments(u, r), plan.units[size_t(u)].optimizer_numel));
  }

  // --- memory, per rank: every buffer, typed, in the order the ranks allocate --------
  add_state_buffers(plan);
  BufferListing listing(plan, largest_padded, largest_shard, largest_optimizer);
  if (in.gpu)
    listing.add_gpu_buffers();
  else
    listing.add_cpu_buffers();
  listing.add_host_buffers();

  PlanBuilder(plan).build();

  // A gradient on NVMe: written after each reduce, read back to add to from
  // the second micro-batch on, and read by the streamed optimizer chunk by chunk.
  if (plan.homes.grad == Tier::nvme) {
    const int64_t alignment = int64_t(in.nvme_alignment);
    for (const PlanOp& op : plan.ops) {
      if (op.kind == OpKind::reduce) {
        // Layer-major: the sum over a unit's micro-batches is kept in host
        // memory (or on the GPU) and written once, after the last.
        if (plan.layer_major() && op.micro != in.grad_accum - 1) continue;
        const int64_t bytes = round_up(plan.units[size_t(op.unit)].grad_numel * 4, alignment);
        plan.traffic_per_step.nvme_written += bytes;
        if (op.micro > 0 && !plan.layer_major()) plan.traffic_per_step.nvme_read += bytes;
      }
      if (op.kind == OpKind::optimizer) {
        const int64_t n = plan.units[size_t(op.unit)].optimizer_numel;
        for (int64_t at = 0; at < n; at += plan.optimizer_chunk_elements)
          plan.traffic_per_step.nvme_read +=
              round_up(std::min(plan.optimizer_chunk_elements, n - at) * 4, alignment);
      }
    }
  }
  if (plan.gradient_home_reason.empty())
    plan.gradient_home_reason =
        plan.homes.grad == Tier::device
            ? "gradients on the device, fp32 (with the optimizer)"
            : fmt::format("gradients {}, {} (strata.gradient_home {})",
                          plan.homes.grad == Tier::nvme ? "on NVMe" : "in host memory",
                          plan.homes.grad_bf16 ? "bf16" : "fp32",
                          gradient_home_name(in.gradient_home));
  return plan;
}

int64_t nvme_bytes_needed(const TrainingPlan& plan) {
  return plan.peak(Tier::nvme);
}

std::string format_training_plan(const TrainingPlan& plan) {
  std::string out;
  const TrainingPlanInput& in = plan.input;
  out += fmt::format(
      "One step of one rank: stage {}, {} rank(s), {} micro-batch(es) of {} x {} tokens, params "
      "{}, "
      "optimizer {}, {}{}\n",
      in.stage, in.world_size, in.grad_accum, in.micro_batch, in.seq_len,
      offload_device_name(in.offload_param), offload_device_name(in.offload_optimizer),
      precision_name(in.precision), in.overlap_comm ? "" : ", collectives on the compute lane");
  out += fmt::format("schedule {}", schedule_name(in.schedule));
  if (plan.spilled_levels() > 0)
    out += fmt::format(
        ": activations of {} micro-batches in device slots of 2 levels, {} levels spilled to {} "
        "and restored a unit ahead of their backward",
        plan.activation_copies(), plan.spilled_levels(), tiers::tier_name(in.activation_home));
  else if (plan.activations_spilled())
    out +=
        fmt::format(": activations of {} micro-batches in device slots of 2 levels (all of them)",
                    plan.activation_copies());
  else if (plan.activation_copies() > 1)
    out += fmt::format(
        ": activations of {} micro-batches kept in {} memory", plan.activation_copies(),
        tiers::tier_name(in.gpu || in.activation_home != Tier::host ? Tier::device : Tier::host));
  out += "\n";
  out += "units:";
  for (size_t u = 0; u < plan.layout.units.size(); ++u)
    out += fmt::format(" {}={}", u, plan.layout.units[u].unit.name);
  out += "\n\n   #  operation                  lane           bytes  after\n";
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    std::string deps;
    for (int d : op.deps) deps += (deps.empty() ? "" : ", ") + std::to_string(d);
    out +=
        fmt::format("{:>4}  {:<26} {:<9} {:>10}  {}\n", i, op_label(plan, op), lane_name(op.lane),
                    op.bytes > 0 ? format_bytes(uint64_t(op.bytes)) : "", deps);
  }
  out += "\nMemory per rank (peak, every buffer allocated before the first step):\n";
  for (const PlanBuffer& b : plan.buffers)
    out += fmt::format("  {:<7} {:>12}  {}\n", tiers::tier_name(b.tier),
                       format_bytes(uint64_t(b.bytes)), b.name);
  for (int t = 0; t < tiers::kTierCount; ++t)
    out += fmt::format("  {:<7} {:>12}  total\n", tiers::tier_name(static_cast<Tier>(t)),
                       format_bytes(uint64_t(plan.peak_bytes[t])));
  const StepTraffic& t = plan.traffic_per_step;
  out += fmt::format("NVMe traffic per step and rank: {} read, {} written\n",
                     format_bytes(uint64_t(t.nvme_read)), format_bytes(uint64_t(t.nvme_written)));
  out +=
      fmt::format("Collectives: {} sent per step and rank\n", format_bytes(uint64_t(t.collective)));
  if (in.gpu)
    out += fmt::format("PCIe per step and rank: {} host to device, {} device to host\n",
                       format_bytes(uint64_t(t.h2d)), format_bytes(uint64_t(t.d2h)));
  return out;
}

nlohmann::ordered_json training_plan_to_json(const TrainingPlan& plan) {
  nlohmann::ordered_json j;
  j["stage"] = plan.input.stage;
  j["world_size"] = plan.input.world_size;
  j["schedule"] = schedule_name(plan.input.schedule);
  j["activation_home"] = tiers::tier_name(plan.input.activation_home);
  nlohmann::ordered_json units = nlohmann::ordered_json::array();
  for (const UnitLayout& u : plan.layout.units) units.push_back(u.unit.name);
  j["units"] = units;
  nlohmann::ordered_json ops = nlohmann::ordered_json::array();
  for (const PlanOp& op : plan.ops) {
    nlohmann::ordered_json o;
    o["op"] = op_kind_name(op.kind);
    o["lane"] = lane_name(op.lane);
    if (op.unit >= 0) o["unit"] = op.unit;
    if (op.micro >= 0) o["micro"] = op.micro;
    if (op.slot >= 0) o["slot"] = op.slot;
    o["bytes"] = op.bytes;
    o["after"] = op.deps;
    ops.push_back(o);
  }
  j["ops"] = ops;
  nlohmann::ordered_json buffers = nlohmann::ordered_json::array();
  for (const PlanBuffer& b : plan.buffers)
    buffers.push_back({{"name", b.name},
                       {"role", buffer_role_name(b.role)},
                       {"tier", tiers::tier_name(b.tier)},
                       {"element", buffer_element_name(b.element)},
                       {"copies", b.copies},
                       {"elements", b.elements},
                       {"bytes", b.bytes}});
  j["buffers"] = buffers;
  j["peak_bytes"] = {{"device", plan.peak(Tier::device)},
                     {"host", plan.peak(Tier::host)},
                     {"nvme", plan.peak(Tier::nvme)}};
  j["nvme_bytes_per_step"] = {{"read", plan.traffic_per_step.nvme_read},
                              {"written", plan.traffic_per_step.nvme_written}};
  j["link_bytes_per_step"] = {{"collectives", plan.traffic_per_step.collective},
                              {"pcie_h2d", plan.traffic_per_step.h2d},
                              {"pcie_d2h", plan.traffic_per_step.d2h}};
  return j;
}

}  // namespace strata
