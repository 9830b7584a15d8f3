// The buffers of a training plan: every kind of state and every working
// buffer of one rank, typed, in the order the ranks allocate them
// (core/plan/training_plan.h).
#include <fmt/format.h>

#include <algorithm>

#include "core/model/cuda_units.h"
#include "core/plan/training_plan_parts.h"
#include "io/base/sizes.h"

namespace strata {

using tiers::Tier;

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
  const PlanInput& in = plan.input;
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

namespace {

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
      add_gradient_buffers(Tier::host, scatter_output);
    }
    if (plan.host_grads_summed())
      add(R::gradient_sum, O::rank, "gradient sum over the micro-batches (largest unit, fp32)",
          Tier::host, f32, 1, largest_padded);
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
      add(R::gpu_saved_inputs, O::gpu, slots_name(), Tier::device, compute,
          plan.saved_input_copies(), slot_elements(cb));
    else
      add(R::gpu_saved_inputs, O::gpu, copies_name("saved unit inputs"), Tier::device, compute,
          copies, plan.saved_input_levels() * N * C);
    add(R::gpu_activation_gradient, O::gpu, copies_name("activation gradient"), Tier::device,
        compute, copies, N * C);
    add(R::gpu_tokens_and_targets, O::gpu, "device tokens and targets", Tier::device, i32, 1,
        2 * N * in.grad_accum);
    add(R::gpu_token_losses, O::gpu, "per-token losses", Tier::device, f32, 1, N);
    // A vocabulary-cut head's logits live from its chunks' forwards to their backwards.
    if (in.model.vocab_chunks > 1)
      add(R::gpu_head_logits, O::gpu, copies_name("logits of the vocabulary-cut head"),
          Tier::device, compute, copies, N * in.model.vocab_size);
    // A sparse layer's expert groups, or a dense MLP's parts, hand on their
    // chain (ExpertChain) from a micro-batch's forwards to its backwards.
    if (uses_expert_chain(in.model))
      add(R::gpu_expert_chain, O::gpu, chain_name(), Tier::device, f32, copies,
          expert_chain_floats(in.model, N));
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
    add_gradient_buffers(Tier::device, scatter_output);
    if (plan.host_grads_summed())
      add(R::gradient_sum, O::rank, "gradient sum over the micro-batches (largest unit, fp32)",
          Tier::device, f32, 1, largest_padded);
    // Host memory is the device tier here: a host home only moves the budget they count against.
    const Tier kept = plan.activation_home() == Tier::host ? Tier::host : Tier::device;
    if (plan.activations_spilled())
      add(R::saved_inputs, O::rank, slots_name(), Tier::device, f32, plan.saved_input_copies(),
          slot_elements(4));
    else
      add(R::saved_inputs, O::rank, copies_name("saved unit inputs (fp32)"), kept, f32, copies,
          plan.saved_input_levels() * N * C);
    add(R::activation_gradient, O::rank, copies_name("activation gradient"), kept, f32, copies,
        N * C);
    // A vocabulary-cut head's logits live from its chunks' forwards to their backwards.
    if (in.model.vocab_chunks > 1)
      add(R::head_logits, O::rank, copies_name("logits of the vocabulary-cut head"), kept, f32,
          copies, N * in.model.vocab_size);
    // What a sparse layer's pieces hand on (ExpertChain): its residual, the
    // experts' sum and weights' gradients, and every sparse layer's routing,
    // from a micro-batch's forwards to its backwards; a dense layer's MLP
    // parts, the residual and the sum.
    if (uses_expert_chain(in.model))
      add(R::expert_chain, O::rank, chain_name(), kept, f32, copies,
          expert_chain_floats(in.model, N));
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
    // Per element: master, m, v (and the gradient, read from NVMe; and the
    // separate compute copy where expert updates are deferred, expert_update.h).
    const int64_t chunk_bytes =
        4 + 2 * plan.moment_bytes() + (plan.homes.grad == Tier::nvme ? 4 : 0) +
        (plan.deferred_expert_updates && plan.homes.separate_master ? cb : 0);
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
    // write_shard / read_shard stage NVMe homes through blocks the store
    // reserves (tiers/tiered_store.h), each on the I/O alignment.
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
      // Summed once per step before the reduction, it arrives once: no staging.
      if (in.grad_accum > 1 && !(plan.grads_summed_per_step() && in.world_size > 1))
        add(R::gradient_staging, O::rank,
            plan.layer_major() ? "gradient sum on its way to NVMe (largest shard, fp32)"
                               : "gradient read back from NVMe (largest shard, fp32)",
            Tier::host, f32, 1, largest_grad);
    }
    // One block per lane that stages at once: the optimizer's writebacks, and
    // the reductions writing gradients homed on NVMe.
    add(R::nvme_shard_staging, O::store, "NVMe shard staging", Tier::host, byte,
        plan.homes.grad == Tier::nvme ? 2 : 1,
        round_up(std::min<int64_t>(int64_t(tiers::kShardStagingBytes), largest_nvme_shard),
                 int64_t(in.nvme_alignment)));
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
  const PlanInput& in;
  const int64_t largest_padded, largest_shard, largest_optimizer, cb;
  const BufferElement compute;
  const int64_t N, C;
  const int64_t embedding_padded;
  const int copies;  // of what a micro-batch keeps to its backward
  const bool scatter_output;

  // Spilled inputs: the levels below the last two, one copy per place
  // (levels passed on unchanged share their input's) and activation copy
  // (TrainingPlan::spill_copy), in their home (host
  // memory or NVMe; the engine rank moves them), and on a GPU with NVMe one
  // host staging copy between the two.
  void add_spill_buffers(BufferElement element, int64_t element_bytes) {
    const int levels = int(plan.spilled_places());
    if (levels == 0) return;
    const int copies = plan.activation_copies();
    add(R::activation_spill, O::rank,
        fmt::format("saved inputs spilled ({} level{}{})", levels, levels == 1 ? "" : "s",
                    copies > 1 ? fmt::format(" x {} micro-batches", copies) : ""),
        plan.activation_home(), element, levels * copies, slot_elements(element_bytes));
    if (in.gpu && plan.activation_home() == Tier::nvme)
      add(R::activation_staging, O::rank, "saved input on its way to or from NVMe", Tier::host,
          element, 1, slot_elements(element_bytes));
  }
  // The engine rank's unit gradients, a tied embedding's and the
  // reduce-scatter output, in `tier`.
  void add_gradient_buffers(Tier tier, bool scatter_output) {
    add(R::unit_gradient, O::rank,
        fmt::format("unit gradients ({} x largest unit, fp32)", plan.grad_slots), tier, f32,
        plan.grad_slots, largest_padded);
    if (plan.tied_grad_buffer)
      add(R::tied_gradient, O::rank, copies_name("tied embedding gradient"), tier, f32, copies,
          embedding_padded);
    if (scatter_output)
      add(R::reduce_scatter_output, O::rank, "reduce-scatter output", tier, f32, 1, largest_shard);
  }

  // One spilled input's elements, as long as a transfer (the I/O alignment on NVMe).
  int64_t slot_elements(int64_t element_bytes) const {
    return plan.saved_input_transfer_bytes() / element_bytes;
  }
  std::string slots_name() const {
    return copies == 1 ? std::string("saved-input slots (2 levels)")
                       : fmt::format("saved-input slots (2 levels x {} micro-batches)", copies);
  }

  // "activation gradient (8 micro-batches)" in the layer-major schedule.
  std::string copies_name(const char* what) const {
    return copies == 1 ? std::string(what) : fmt::format("{} ({} micro-batches)", what, copies);
  }
  // The chain a sparse layer's pieces, or a dense MLP's parts, hand on (ExpertChain).
  std::string chain_name() const {
    return copies_name(in.model.expert_groups > 1 ? "expert groups' chain and routing"
                                                  : "MLP parts' residual and sum");
  }
};

}  // namespace

void add_working_buffers(TrainingPlan& plan, int64_t largest_padded, int64_t largest_shard,
                         int64_t largest_optimizer) {
  BufferListing listing(plan, largest_padded, largest_shard, largest_optimizer);
  if (plan.input.gpu)
    listing.add_gpu_buffers();
  else
    listing.add_cpu_buffers();
  listing.add_host_buffers();
}

}  // namespace strata
