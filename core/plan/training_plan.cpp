#include "core/plan/training_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/plan/expert_fetch.h"
#include "core/plan/expert_update.h"
#include "core/plan/training_plan_parts.h"
#include "io/base/sizes.h"

namespace strata {

using tiers::Tier;

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
    case OpKind::route:
      return "route";
    case OpKind::share:
      return "share";
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

namespace {

std::string unit_label(const TrainingPlan& plan, int unit) {
  if (unit < 0) return "";
  return plan.layout.units[size_t(unit)].unit.name;
}

}  // namespace

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
    case BufferRole::saved_inputs:
      return "saved_inputs";
    case BufferRole::activation_gradient:
      return "activation_gradient";
    case BufferRole::head_logits:
      return "head_logits";
    case BufferRole::expert_chain:
      return "expert_chain";
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
    case BufferRole::gpu_saved_inputs:
      return "gpu_saved_inputs";
    case BufferRole::gpu_activation_gradient:
      return "gpu_activation_gradient";
    case BufferRole::gpu_tokens_and_targets:
      return "gpu_tokens_and_targets";
    case BufferRole::gpu_token_losses:
      return "gpu_token_losses";
    case BufferRole::gpu_head_logits:
      return "gpu_head_logits";
    case BufferRole::gpu_expert_chain:
      return "gpu_expert_chain";
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
    case BufferRole::gradient_sum:
      return "gradient_sum";
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

int64_t TrainingPlan::saved_input_bytes() const {
  return tokens_per_micro * input.model.hidden_size * (input.gpu ? compute_bytes : 4);
}

int64_t TrainingPlan::saved_input_transfer_bytes() const {
  return activation_home() == Tier::nvme
             ? round_up(saved_input_bytes(), int64_t(input.nvme_alignment))
             : saved_input_bytes();
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

int64_t TrainingPlan::exchange_values() const {
  const int64_t per_micro = layout.config.is_moe() ? 2 : 1;
  return 2 * int64_t(layout.units.size()) + per_micro * input.grad_accum;
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
StateHomes state_homes(const PlanInput& in) {
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

namespace {

// strata.gradient_home auto with the optimizer offloaded: host fp32, unless
// the plan then needs more host memory than a rank's share of the node's
// budget and the optimizer is on NVMe, which reads gradients from there too.
Result<TrainingPlan> build_with_automatic_gradient_home(const PlanInput& in) {
  PlanInput host = in;
  host.gradient_home = GradientHome::host;
  Result<TrainingPlan> plan = build_training_plan(host);
  if (!plan) return plan;
  const int64_t need = plan->peak(Tier::host);
  const std::optional<int64_t> budget = in.budgets.host_per_rank(in.world_size);
  const bool over = budget && need > *budget;
  if (over && in.offload_optimizer == OffloadDevice::nvme) {
    PlanInput nvme = in;
    nvme.gradient_home = GradientHome::nvme;
    Result<TrainingPlan> on_nvme = build_training_plan(nvme);
    if (!on_nvme) return on_nvme;
    on_nvme->input.gradient_home = GradientHome::automatic;
    on_nvme->gradient_home_reason = fmt::format(
        "gradients on NVMe, fp32 (auto: in host memory the plan needs {} of host per rank, "
        "over the budget of {})",
        format_bytes(double(need)), format_bytes(double(*budget)));
    return on_nvme;
  }
  plan->input.gradient_home = GradientHome::automatic;
  plan->gradient_home_reason =
      budget && !over
          ? fmt::format(
                "gradients in host memory, fp32 (auto: the plan's {} of host per rank "
                "fits the budget of {})",
                format_bytes(double(need)), format_bytes(double(*budget)))
          : std::string("gradients in host memory, fp32 (auto") +
                (over ? ": over the host budget, but only an optimizer on NVMe reads them there)"
                      : ": no host budget given)");
  return plan;
}

}  // namespace

Result<TrainingPlan> build_training_plan(const PlanInput& in) {
  if (Status s = validate_plan_input(in); !s) return s;
  if (in.schedule == Schedule::auto_choice)
    return Status::invalid_argument(
        "the training plan needs a schedule (micro_batch or layer), not auto: plan_training "
        "chooses one");
  if (in.gradient_home == GradientHome::automatic && in.offload_optimizer != OffloadDevice::none)
    return build_with_automatic_gradient_home(in);

  TrainingPlan plan;
  plan.input = in;
  plan.input.activation_home = plan.activation_home();
  plan.layout = model_layout(in.model, in.world_size);
  plan.compute_bytes = compute_bytes(in.precision);
  plan.tokens_per_micro = in.micro_batch * in.seq_len;
  plan.homes = state_homes(in);
  plan.gather_slots = in.stage == 3 ? 2 : 0;
  plan.tied_grad_buffer = in.model.tie_word_embeddings;
  plan.fetch_slots = in.stage == 3 && in.offload_param == OffloadDevice::nvme ? in.fetch_slots : 0;
  plan.streamed_optimizer = plan.homes.optimizer == Tier::nvme;
  plan.routed_expert_fetch = plan_routes_expert_reads(in, plan.homes, plan.expert_fetch_reason);
  plan.deferred_expert_updates =
      plan_defers_expert_updates(in, plan.routed_expert_fetch, plan.expert_update_reason);
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
  for (size_t level = 0; level + 1 < plan.layout.units.size(); ++level) {
    const bool shared = level > 0 && unit_passes_input(in.model, plan.layout.units[level].unit);
    plan.level_storage.push_back(level == 0 ? 0 : plan.level_storage.back() + (shared ? 0 : 1));
  }
  plan.optimizer_chunk_elements = std::min(in.optimizer_chunk_elements, largest_optimizer);
  // Compact m and v: chunks start at multiples of 4096 elements, so their
  // pieces of bf16 or int8 stay on the I/O alignment (and int8 blocks whole).
  if (in.optimizer_state != OptimizerStateDtype::fp32)
    plan.optimizer_chunk_elements = round_up(plan.optimizer_chunk_elements, int64_t{4096});
  // Deferred expert updates: windows of whole nvme_alignment-element blocks, within a chunk.
  if (plan.deferred_expert_updates)
    plan.optimizer_chunk_elements =
        round_up(plan.optimizer_chunk_elements, int64_t(in.nvme_alignment));
  if (in.optimizer_state == OptimizerStateDtype::int8) {
    for (int u = 0; u < int(plan.units.size()); ++u)
      for (int r = 0; r < (in.stage == 0 ? 1 : in.world_size); ++r)
        plan.units[size_t(u)].int8_blocks =
            std::max(plan.units[size_t(u)].int8_blocks,
                     int8_block_count(plan.segments(u, r), plan.units[size_t(u)].optimizer_numel));
  }

  // --- memory, per rank: every buffer, typed, in the order the ranks allocate --------
  add_state_buffers(plan);
  add_working_buffers(plan, largest_padded, largest_shard, largest_optimizer);

  build_plan_operations(plan);

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
  const PlanInput& in = plan.input;
  out += fmt::format(
      "One step of one rank: stage {}, {} rank(s), {} micro-batch(es) of {} x {} tokens, params "
      "{}, "
      "optimizer {}, {}{}\n",
      in.stage, in.world_size, in.grad_accum, in.micro_batch, in.seq_len,
      offload_device_name(in.offload_param), offload_device_name(in.offload_optimizer),
      precision_name(in.precision), in.overlap_comm ? "" : ", collectives on the compute lane");
  out += fmt::format("schedule {}", schedule_name(in.schedule));
  const std::string kept_of =
      plan.activation_copies() > 1
          ? fmt::format("activations of {} micro-batches", plan.activation_copies())
          : std::string("activations");
  if (plan.spilled_levels() > 0) {
    const int64_t shared = plan.spilled_levels() - plan.spilled_places();
    out += fmt::format(
        ": {} in device slots of 2 levels, {} level{} spilled to {} and restored a unit ahead of "
        "their backward",
        kept_of, plan.spilled_places(), plan.spilled_places() == 1 ? "" : "s",
        tiers::tier_name(plan.activation_home()));
    if (shared > 0)
      out += fmt::format(" ({} more restored from the copy of the input they pass on)", shared);
  } else if (plan.activations_spilled())
    out += fmt::format(": {} in device slots of 2 levels (all of them)", kept_of);
  else if (plan.activation_copies() > 1)
    out +=
        fmt::format(": activations of {} micro-batches kept in {} memory", plan.activation_copies(),
                    tiers::tier_name(in.gpu || plan.activation_home() != Tier::host ? Tier::device
                                                                                    : Tier::host));
  out += "\n";
  out += "units:";
  for (size_t u = 0; u < plan.layout.units.size(); ++u)
    out += fmt::format(" {}={}", u, plan.layout.units[u].unit.name);
  // The operation column as wide as its longest label (a piece's name is long).
  size_t width = 26;
  for (const PlanOp& op : plan.ops) width = std::max(width, op_label(plan, op).size());
  out += fmt::format("\n\n   #  {:<{}} lane           bytes  after\n", "operation", width);
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const PlanOp& op = plan.ops[i];
    std::string deps;
    for (int d : op.deps) deps += (deps.empty() ? "" : ", ") + std::to_string(d);
    out +=
        fmt::format("{:>4}  {:<{}} {:<9} {:>10}  {}\n", i, op_label(plan, op), width,
                    lane_name(op.lane), op.bytes > 0 ? format_bytes(uint64_t(op.bytes)) : "", deps);
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
  out += fmt::format("Collectives: {} sent per step and rank\n",
                     format_bytes(uint64_t(t.collective())));
  if (in.budgets.nodes(in.world_size) > 1)
    out += fmt::format("  within the node {}, across the {} nodes {}\n",
                       format_bytes(uint64_t(t.intra_node)), in.budgets.nodes(in.world_size),
                       format_bytes(uint64_t(t.inter_node)));
  if (in.gpu)
    out += fmt::format("PCIe per step and rank: {} host to device, {} device to host\n",
                       format_bytes(uint64_t(t.h2d)), format_bytes(uint64_t(t.d2h)));
  return out;
}

nlohmann::ordered_json training_plan_to_json(const TrainingPlan& plan) {
  nlohmann::ordered_json j;
  j["stage"] = plan.input.stage;
  j["world_size"] = plan.input.world_size;
  j["nodes"] = plan.input.budgets.nodes(plan.input.world_size);
  j["ranks_per_node"] = plan.input.budgets.node_ranks(plan.input.world_size);
  j["schedule"] = schedule_name(plan.input.schedule);
  j["activation_home"] = tiers::tier_name(plan.activation_home());
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
  j["link_bytes_per_step"] = {{"collectives", plan.traffic_per_step.collective()},
                              {"intra_node", plan.traffic_per_step.intra_node},
                              {"inter_node", plan.traffic_per_step.inter_node},
                              {"pcie_h2d", plan.traffic_per_step.h2d},
                              {"pcie_d2h", plan.traffic_per_step.d2h}};
  return j;
}

bool reads_parameters(const TrainingPlan& plan, const PlanOp& op) {
  return op.kind == OpKind::fetch || op.kind == OpKind::gather ||
         (plan.input.stage < 3 && (op.kind == OpKind::forward || op.kind == OpKind::backward));
}

int exchange_op(const TrainingPlan& plan) {
  for (size_t i = 0; i < plan.ops.size(); ++i)
    if (plan.ops[i].kind == OpKind::exchange) return int(i);
  return int(plan.ops.size()) - 1;  // unreachable: build_plan_operations adds one
}

std::vector<int> parameter_publishers(const TrainingPlan& plan) {
  std::vector<int> last(plan.units.size(), -1);
  for (size_t i = 0; i < plan.ops.size(); ++i) {
    const OpKind k = plan.ops[i].kind;
    if (k == OpKind::optimizer || k == OpKind::writeback || k == OpKind::sync)
      last[size_t(plan.ops[i].unit)] = int(i);
  }
  return last;
}

}  // namespace strata
