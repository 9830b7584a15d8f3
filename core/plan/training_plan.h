// The training plan: one step of one rank as a list of operations over units,
// with their lanes, their dependencies and the bytes every buffer takes in
// every tier, computed before the step runs (core/README.md, "plan").
//
// Buffers. `buffers` is the one list of what a rank holds: every kind of
// state and every working buffer, typed (role, owner, tier, element type,
// copies x elements, bytes). The ranks allocate by walking it
// (core/engine/rank_buffers.h) and `strata plan` prints it
// (core/plan/planner.h); nothing else derives a buffer's size.
//
// Placement. For every unit the plan says how many elements of each kind of
// state a rank keeps and where (the table in core/README.md):
//   param   compute precision; stage 3: the rank's shard, else the whole unit;
//           home offload_param (device when none)
//   master  fp32, only where it is not the parameters themselves (bf16/fp16, or
//           fp32 with the optimizer in another tier than the parameters);
//           stage 0: the whole unit, else the shard; home offload_optimizer
//   m, v    fp32, as master
//   grad    fp32 accumulator across micro-batches; stages 0-1: the whole unit,
//           2-3: the shard; on the device with the optimizer there, else
//           where strata.gradient_home says (gradient_home_reason): host
//           fp32, host bf16, or NVMe fp32 (with the optimizer on NVMe: written
//           after each reduce, read-modify-written from the second
//           micro-batch on, read by the streamed optimizer with its chunks)
// Elements [r * shard, (r + 1) * shard) of a unit's flat buffer are rank r's.
//
// Operations. In the micro-batch order (schedule micro_batch) a step is, per
// micro-batch, forward of every unit (the head's forward and backward are one
// pass) and backward of the layers and the embedding in reverse. In the
// layer-major order (schedule layer) each unit runs every micro-batch before
// the next unit: forward of unit 0 for micro-batches 0..G-1, then unit 1, ...,
// the head for 0..G-1, then backward of the last layer for 0..G-1, ... down to
// the embedding; every micro-batch's unit inputs, activation gradient (and a
// tied embedding's gradient) are kept to its backward, one copy per
// micro-batch (activation_copies). The unit inputs are in their home
// (activation_home) in either order: kept out of the device, they are
// spilled after their forward and restored ahead of their backward
// (activations_spilled).
// Either way a unit meets its micro-batches
// in order, and each micro-batch's gradient is reduced after its backward and
// added to the accumulator in that order: the same sums in the same order,
// so the two orders give the same bits. After the last micro-batch the
// gradient-norm partials and losses are exchanged, the optimizer driver
// decides the step, and the optimizer runs unit by unit in forward order,
// overlapping the next step's forward (forward of unit u waits only for
// optimizer(u), and at stages 1-2 for sync(u), the all-gather of the updated
// parameters); without clipping or loss scaling it runs during backward
// instead, unit by unit as gradients become final. At stage 3 a unit is
// gathered before each use, a run of consecutive computations that read it,
// into one of `gather_slots` buffers and released after; a fetch brings a
// parameter shard homed on NVMe into host memory ahead of its gather, at most
// `fetch_slots` at a time. Buffers are reused in a ring; the dependency on the
// operation that last used a buffer is what bounds the memory.
//
// Lanes: io (starts fetches), comm (every collective, in one order that every
// rank shares), compute, optimizer, activations (spills and restores of
// saved inputs kept out of the device: activations_spilled). Each lane runs
// its operations in plan order; an operation starts when its dependencies
// are done.
//
// Pure functions; thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "core/model/model.h"
#include "core/model/model_config.h"
#include "core/optimizer/optimizer.h"
#include "core/plan/plan_input.h"
#include "io/base/status.h"
#include "kernels/cpu/simd.h"
#include "tiers/tier.h"

namespace strata {

enum class OpKind {
  fetch,
  gather,
  forward,
  release,
  backward,
  reduce,
  exchange,
  decide,
  optimizer,
  writeback,
  sync,
  spill,    // a saved input leaves the device for its home (host or NVMe)
  restore,  // and comes back to its device slot ahead of its backward
  route,    // a routed unit's micro-batch takes its experts (several ranks; expert_fetch.h)
  share,    // the ranks' routings joined, the experts read and sent by their owners
};
inline constexpr int kOpKindCount = 15;
enum class Lane { io, comm, compute, optimizer, activations };
inline constexpr int kLaneCount = 5;
const char* op_kind_name(OpKind kind);
const char* lane_name(Lane lane);

struct PlanOp {
  OpKind kind = OpKind::forward;
  Lane lane = Lane::compute;
  int unit = -1;             // -1: not about one unit (exchange)
  int micro = -1;            // micro-batch, -1 for the optimizer's operations
  int slot = -1;             // gather / grad / fetch buffer used
  std::vector<int> deps;     // indices of operations of the same step that must be done first
  int64_t bytes = 0;         // bytes this operation moves (collective: sent by this rank)
  std::string text() const;  // "gather(layers.3) mb 1"
};

// Where each kind of state lives and how many elements a rank keeps per unit.
struct UnitPlacement {
  int64_t padded_numel = 0;
  int64_t shard_numel = 0;
  int64_t param_numel = 0;      // stored per rank
  int64_t grad_numel = 0;       // accumulator per rank
  int64_t optimizer_numel = 0;  // master / m / v per rank
  // int8 state: the int8 blocks of a rank's optimizer range (int8_block_count
  // of its parameter-group segments), the most of any rank; 0 otherwise.
  int64_t int8_blocks = 0;
};

struct StateHomes {
  tiers::Tier param = tiers::Tier::device;
  tiers::Tier optimizer = tiers::Tier::device;  // master, m, v
  tiers::Tier grad = tiers::Tier::device;
  bool grad_bf16 = false;  // the accumulator is bf16 (strata.gradient_home host_bf16)
  bool separate_master = false;
};

// The working set every rank keeps on the device on the CUDA backend, beyond
// what scales with the batch (listed with the other buffers below).
inline constexpr int kGpuParamSlots = 3;   // rotating device copies of a unit's parameters
inline constexpr int kGpuGradBuffers = 2;  // rotating device fp32 unit gradients
inline constexpr int64_t kGpuMatmulWorkspaceBytes = int64_t{32} << 20;  // cuBLASLt's

// What a buffer of the plan is for; the ranks find their buffers by role.
enum class BufferRole {
  // Model state: one shard per unit, added to the rank's TieredStore.
  param_state,
  grad_state,
  master_state,
  m_state,
  v_state,
  // int8 m and v: [2] (sum over units of int8_blocks) fp32 block scales, m's
  // then v's, beside the optimizer that updates them: in device memory for the
  // CUDA backend's optimizer on the GPU (optimizer home device), else in host
  // memory beside the CPU optimizer whatever tier holds the codes.
  int8_scales,
  // The engine rank's buffers (CPU backend: in host memory standing in for the device).
  gathered_unit,          // [gather_slots] (largest padded) compute precision
  gathered_unit_fp32,     // [gather_slots] (largest padded) the CPU backend's widened copy
  widened_params,         // [2] (largest padded) stages 0-2, CPU backend, below fp32
  unit_gradient,          // [grad_slots] (largest padded) fp32
  tied_gradient,          // [activation copies] (embedding padded) fp32
  reduce_scatter_output,  // (largest shard) fp32
  sync_staging,           // (largest padded) compute precision: the GPU's stage 1-2 all-gather
  tokens_and_targets,     // (2, G, B*T) int32: tokens, then targets
  saved_inputs,           // [saved_input_copies] (saved_input_levels, B*T, C) fp32, the CPU units'
                          // inputs
  activation_gradient,    // [activation copies] (B*T, C) fp32
  head_logits,            // [activation copies] (B*T, V) fp32: a vocabulary-cut head's logits
  expert_chain,           // [activation copies] (expert_chain_floats): expert groups' ExpertChain
  unit_working_set,       // bytes the CPU UnitWorkspace allocates itself, charged here
  new_parameters,         // (largest optimizer range) compute precision, staged
  nccl_staging,           // [2] (largest padded) fp32: send, receive
  // The GPU rank's device working set (core/engine/gpu_rank.h).
  gpu_param_slots,          // [kGpuParamSlots] (largest padded) compute precision
  gpu_unit_gradients,       // [kGpuGradBuffers] (largest padded) fp32
  gpu_tied_gradient,        // [activation copies] (embedding padded) fp32
  gpu_grad_norm_scratch,    // bytes: the result, then the reduction's scratch
  gpu_reduced_gradient,     // (largest padded) fp32
  gpu_gradient_sum,         // (largest padded) fp32: gpu_grads_summed_on_device
  gpu_new_parameters,       // (largest optimizer range) compute precision
  gpu_saved_inputs,         // [saved_input_copies] (saved_input_levels, B*T, C) compute precision
  gpu_activation_gradient,  // [activation copies] (B*T, C) compute precision
  gpu_tokens_and_targets,   // (2, G, B*T) int32
  gpu_token_losses,         // (B*T) fp32
  gpu_head_logits,       // [activation copies] (B*T, V) compute precision: a vocabulary-cut head's
  gpu_expert_chain,      // [activation copies] (expert_chain_floats) 4-byte words: the device's
                         // ExpertChain (its rows in compute precision)
  gpu_matmul_workspace,  // bytes, cuBLASLt's
  gpu_unit_working_set,  // bytes, CudaUnits' working set
  // Taken by the store and the streamed optimizer from the host budget.
  nvme_parameter_copies,  // [fetch_slots] (largest shard) compute precision
  optimizer_stream,       // [optimizer buffers] (chunk) fp32 master, then m and v as stored
  nvme_shard_staging,     // bytes: write_shard / read_shard's block
  gradient_staging,       // (largest gradient shard) fp32: an NVMe-homed gradient, read to add to
  gradient_sum,           // (largest padded) fp32: host_grads_summed, a unit's micro-batches' sum
  // Spilled saved inputs (TrainingPlan::activations_spilled), the engine rank's.
  activation_spill,  // [spilled_levels x G] (B*T, C) as the saved inputs: in host memory or on NVMe
  activation_staging,  // (B*T, C) compute precision: the GPU's saved input on its way to or from
                       // NVMe
};
const char* buffer_role_name(BufferRole role);
// The store's shard kind of a state role; nullopt for any other role.
std::optional<tiers::ShardKind> state_shard_kind(BufferRole role);

// Who allocates a buffer of the plan.
enum class BufferOwner {
  store,  // model state shards, and what the store or the streamed optimizer take themselves
  rank,   // the engine rank, walking the list (core/engine/engine_setup.cpp)
  gpu,    // the GPU rank, walking the list (core/engine/gpu_rank.cpp)
};

enum class BufferElement { f32, bf16, f16, i32, byte };
BufferElement compute_element(Precision precision);
int64_t buffer_element_bytes(BufferElement element);
const char* buffer_element_name(BufferElement element);

// One buffer (or kind of state) of one rank: every rank of the plan keeps the
// same list. `copies` x `elements` of `element`; each copy starts on a page
// (NVMe: on the I/O alignment), and `bytes` counts the rounded copies: what
// the tier's budget is charged. For state, `elements` is the rank's sum over
// units of its shard (each shard rounded on its own).
struct PlanBuffer {
  BufferRole role = BufferRole::gathered_unit;
  BufferOwner owner = BufferOwner::rank;
  std::string name;  // as `strata plan` and --print-plan print it
  tiers::Tier tier = tiers::Tier::device;
  BufferElement element = BufferElement::byte;
  int copies = 1;
  int64_t elements = 0;  // per copy
  int64_t bytes = 0;     // all copies, rounded
  int64_t copy_bytes() const { return bytes / copies; }
};

// What one step of one rank (or one of its operations) moves over each link.
// Collectives are hierarchical over the world's n nodes of g ranks
// (PlanBudgets::nodes, ::node_ranks): a reduce-scatter of a unit whose
// shard is s bytes (N = n g s in all) reduce-scatters within the node,
// sending (g - 1) / g of N = n (g - 1) s over the intra-node link, then
// across the nodes on the node's 1/g of it, sending (n - 1) / n of N / g =
// (n - 1) s over the inter-node link; an all-gather runs the same two levels
// in reverse, an all-reduce is both (twice the bytes). Together (W - 1) s, a
// flat ring's; with one node all of it is intra-node.
struct StepTraffic {
  int64_t nvme_read = 0;
  int64_t nvme_written = 0;
  int64_t intra_node = 0;  // sent by this rank to ranks of its node (collectives' first level)
  int64_t inter_node = 0;  // sent by this rank to other nodes (collectives' second level)
  int64_t h2d = 0;         // host to GPU (the CUDA backend; 0 on the CPU)
  int64_t d2h = 0;         // GPU to host
  int64_t collective() const { return intra_node + inter_node; }
};

struct TrainingPlan {
  PlanInput input;  // schedule and activation home resolved
  ModelLayout layout;
  StateHomes homes;
  std::vector<UnitPlacement> units;
  int64_t tokens_per_micro = 0;  // B * T
  int compute_bytes = 4;         // of the parameters as stored

  int gather_slots = 0;  // stage 3
  int grad_slots = 2;    // full-unit fp32 gradient buffers in rotation
  bool tied_grad_buffer =
      false;            // tied model: the embedding's gradient buffer lives through backward
  int fetch_slots = 0;  // NVMe parameter copies in host memory
  int64_t optimizer_chunk_elements = 0;
  bool streamed_optimizer = false;   // some optimizer state is on NVMe
  std::string gradient_home_reason;  // where the gradient lives and why, one line
  // A mixture's sparse MLP pieces read their experts from NVMe as routed
  // (core/plan/expert_fetch.h); why or why not, one line (empty: dense).
  bool routed_expert_fetch = false;
  std::string expert_fetch_reason;
  // Deferred expert updates (core/plan/expert_update.h): a routed unit's
  // idle experts wait for their AdamW steps until next read; why or why not,
  // one line (empty: dense).
  bool deferred_expert_updates = false;
  std::string expert_update_reason;

  std::vector<PlanOp> ops;          // one step of one rank, in an order every lane can follow
  std::vector<PlanBuffer> buffers;  // states and buffers, per rank
  int64_t peak_bytes[tiers::kTierCount] = {0, 0, 0};  // per rank
  StepTraffic traffic_per_step;                       // per rank

  int64_t peak(tiers::Tier tier) const { return peak_bytes[static_cast<int>(tier)]; }
  tiers::Tier activation_home() const {
    return input.activation_home.value_or(tiers::Tier::device);
  }
  bool layer_major() const { return input.schedule == Schedule::layer; }
  // What a micro-batch keeps from its forward to its backward (the units'
  // inputs, the activation gradient, a tied embedding's gradient) has one
  // copy per micro-batch in the layer-major schedule, else one in all;
  // micro-batch m uses copy activation_copy(m).
  int activation_copies() const { return layer_major() ? int(input.grad_accum) : 1; }
  int activation_copy(int micro) const { return layer_major() ? micro : 0; }
  // Saved inputs kept out of the device: with activation_home NVMe (either
  // backend) or host (the CUDA backend), in either schedule and at any
  // number of micro-batches. Then the device holds two levels of slots, one
  // per activation copy each: level k (unit k's output, unit k+1's input) of
  // micro-batch m sits in slot (k mod 2) x copies + activation_copy(m). The
  // forward of unit k+2 would overwrite it, so a `spill` writes it out first
  // (levels below units - 3; the last two levels stay), and a `restore`
  // brings it back once the slot's later level has been read by its
  // backward (or the head), a unit ahead of the backward that reads it (a
  // whole unit of micro-batches ahead in the layer-major order).
  bool activations_spilled() const {
    return activation_home() == tiers::Tier::nvme ||
           (input.gpu && activation_home() == tiers::Tier::host);
  }
  int spilled_levels() const {
    return activations_spilled() ? std::max(0, int(units.size()) - 3) : 0;
  }
  bool spills(int level) const { return level >= 0 && level < spilled_levels(); }
  // A spilled level whose bytes its input's spilled copy already holds.
  bool shares_spill(int level) const {
    return spills(level) && level > 0 &&
           level_storage[size_t(level)] == level_storage[size_t(level) - 1];
  }
  // The distinct spilled copies of one micro-batch's levels.
  int64_t spilled_places() const {
    return spilled_levels() > 0 ? level_storage[size_t(spilled_levels()) - 1] + 1 : 0;
  }
  // Where each level is kept: in a place of its own, except that a unit
  // passing its input on unchanged (unit_passes_input: the middle groups of
  // experts and MLP parts) keeps its output where its input is, so a
  // layer's pieces share one copy of the normed rows. Kept whole (not
  // activations_spilled), the place is in the saved-inputs buffer; spilled,
  // each level still takes its device slot, but a shared one is not spilled
  // again: its restore reads its input's spilled copy (spill_copy).
  std::vector<int64_t> level_storage;  // per level, from 0; filled with the units
  // The saved-inputs buffer: copies of levels of (B*T, C) each.
  int saved_input_copies() const {
    return activations_spilled() ? 2 * activation_copies() : activation_copies();
  }
  int64_t saved_input_levels() const {
    return activations_spilled() ? 1 : level_storage.back() + 1;
  }
  // Level `level` of micro-batch `micro`: its copy, and its place in levels.
  struct SavedInputPlace {
    int copy = 0;
    int64_t level = 0;
  };
  SavedInputPlace saved_input_place(int level, int micro) const {
    if (activations_spilled())
      return {(level % 2) * activation_copies() + activation_copy(micro), 0};
    return {activation_copy(micro), level_storage[size_t(level)]};
  }
  // Where level `level` of micro-batch `micro` goes when spilled: its copy
  // of the activation_spill buffer (one per spilled place and activation copy).
  int spill_copy(int level, int micro) const {
    return int(level_storage[size_t(level)]) * activation_copies() + activation_copy(micro);
  }
  // Bytes of one saved input, (B*T, C) in their element type (fp32
  // on the CPU backend, the compute precision on the GPU's), and of one spill
  // or restore: rounded up to the I/O alignment on NVMe, where each slot and
  // each spilled copy is that long.
  int64_t saved_input_bytes() const;
  int64_t saved_input_transfer_bytes() const;
  // Backward of the last layer before the head can reuse its forward's
  // activations only when nothing ran in between but the head of the same micro-batch.
  bool recomputes(int unit) const {
    const int head = int(units.size()) - 1;
    return !(unit == head - 1 && unit >= 1 && activation_copies() == 1);
  }
  // The buffer of `role`, or null when this plan has none.
  const PlanBuffer* buffer(BufferRole role) const;
  // Elements of unit u's shard of a state role (param_state ... v_state).
  int64_t state_numel(int u, BufferRole role) const;
  // Rank r's range of unit u's flat buffer that its optimizer state covers.
  int64_t optimizer_offset(int u, int rank) const;
  // The parameters' element type: the compute precision.
  kernels::cpu::ElementType compute_type() const;
  // How m and v are stored, and the bytes of one element of each (int8: the codes).
  kernels::cpu::AdamWStateType state_type() const;
  int64_t moment_bytes() const;
  // The doubles each rank sends to every other in the step's exchange: each
  // unit's norm partial and non-finite flag, each micro-batch's loss sum,
  // and a mixture's load-balancing loss of each micro-batch after those.
  int64_t exchange_values() const;
  // The parameter groups of rank r's optimizer range of unit u, over [0, optimizer_numel).
  std::vector<ShardSegment> segments(int u, int rank) const;

  // The CUDA backend's data paths (core/engine/gpu_rank.h). The units compute
  // straight from the parameters' device home when each rank holds whole
  // units there (stages 0-2, or one rank); otherwise they upload a gathered
  // copy from pinned host memory.
  bool gpu_params_in_place() const {
    return input.gpu && homes.param == tiers::Tier::device &&
           (input.stage < 3 || input.world_size == 1);
  }
  // Gradients accumulate straight into their device home when there is
  // nothing to reduce (one rank; a bf16 reduction rounds even then, as on
  // the CPU backend) and the optimizer is on the GPU; otherwise each unit's
  // gradient goes to a pinned host buffer for the collectives.
  bool gpu_grads_in_place() const {
    return input.gpu && homes.grad == tiers::Tier::device && input.world_size == 1 &&
           !input.reduce_in_bf16;
  }
  // Layer-major with gradients leaving the GPU: a unit's micro-batches run
  // back to back, so their gradients add up on the device (each computed
  // fresh, added in micro-batch order, as the host would) and go down once
  // per step, after the last (a bf16 reduction sums on the host instead).
  bool gpu_grads_summed_on_device() const {
    return input.gpu && layer_major() && input.grad_accum > 1 && !input.reduce_in_bf16 &&
           !gpu_grads_in_place();
  }
  // Layer-major with gradients to reduce or to send down: a unit's
  // micro-batch gradients add up on the rank, in micro-batch order, and are
  // reduced (and go down) once per step, after the last micro-batch, so they
  // cross the network once per step. At more than one rank this sums in
  // another order than the micro-batch schedule (core/README.md, "Numbers").
  bool grads_summed_per_step() const {
    return layer_major() && input.grad_accum > 1 &&
           (input.world_size > 1 || gpu_grads_summed_on_device());
  }
  // ... in host memory (gradient_sum): where the sum is not the GPU's.
  bool host_grads_summed() const {
    return grads_summed_per_step() && !gpu_grads_summed_on_device();
  }
  // New compute-precision parameters pass through a pinned host buffer: on
  // their way to NVMe, or from the CPU optimizer to their device home.
  bool new_params_staged() const {
    return (homes.param == tiers::Tier::nvme && homes.separate_master) ||
           (input.gpu && homes.param == tiers::Tier::device &&
            homes.optimizer != tiers::Tier::device);
  }
};

// The plan of an input whose schedule is resolved (micro_batch or layer) and,
// for the layer-major order, whose activation home is set; the planner's
// plan_training resolves them. Checks validate_plan_input first.
Result<TrainingPlan> build_training_plan(const PlanInput& input);

// Where each kind of state lives: parameters and optimizer state where
// offloaded, gradients where the optimizer reads them; in fp32 the parameters
// are the master unless the optimizer keeps its state in another tier.
StateHomes state_homes(const PlanInput& input);
// The tier of an offload setting (none: the device).
tiers::Tier home_of(OffloadDevice device);

// The waits across steps, which the plan's dependency lists (one step's) do
// not hold; the engine's executor (core/engine/step_executor.cpp) and the
// step-time model (core/plan/step_model.h) both follow these:
//  - an operation that reads a unit's parameters (a fetch or gather; at
//    stages 0-2 the forward and backward themselves) waits for the previous
//    step's update of that unit to be published;
//  - the update is published by the last optimizer, writeback or sync of
//    the unit (parameter_publishers: one operation per unit, -1 for none).
bool reads_parameters(const TrainingPlan& plan, const PlanOp& op);
std::vector<int> parameter_publishers(const TrainingPlan& plan);
// The step's exchange, every plan's one: once it is done and the step
// before is complete, the engine's step() returns and the next is handed out.
int exchange_op(const TrainingPlan& plan);

// What each of plan.ops moves over each link (core/plan/plan_traffic.cpp):
// the one account, which traffic_per_step sums and the step-time model costs.
std::vector<StepTraffic> traffic_per_op(const TrainingPlan& plan);
// A collective's `bytes` sent by one rank (PlanOp::bytes: (W - 1) x a shard,
// twice for an all-reduce) split between its two levels (StepTraffic).
void add_collective_bytes(const PlanInput& input, int64_t bytes, StepTraffic& traffic);
StepTraffic total_traffic(const std::vector<StepTraffic>& per_op);

// "gather(layers.3) mb 1", "optimizer(embedding)", "exchange".
std::string op_label(const TrainingPlan& plan, const PlanOp& op);

// Extra bytes a NVMe swap file needs beyond the sum of its extents' sizes.
int64_t nvme_bytes_needed(const TrainingPlan& plan);

// "  12 gather(layers.0)  comm  <- 3, 11" lines of one step, then the memory table.
std::string format_training_plan(const TrainingPlan& plan);
nlohmann::ordered_json training_plan_to_json(const TrainingPlan& plan);

}  // namespace strata
