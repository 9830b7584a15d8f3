// The engine's inside, shared by the files that implement it (not a public
// header: tools and tests include core/engine/engine.h). The engine is cut
// along its seams:
//   engine.cpp             creation (the plan checked against the budgets, the
//                          ranks opened) and the accessors
//   engine_setup.cpp       one rank's store, shards and buffers, as the plan
//                          lists them; initial parameters
//   engine_checkpoints.cpp saving, resuming and reading the state back
//   step_executor.cpp      a step: the lanes (lane_executor.h) run the plan's
//                          operations in order, each when its dependencies
//                          are done
//   step_operations.cpp    one function per operation kind (gather, forward,
//                          backward, reduce, exchange, optimizer, sync)
//   rank_compute.h         what a rank computes with, the CPU or a GPU
//                          (cpu_rank_compute.cpp, gpu_rank_compute.cpp)
#pragma once

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <span>
#include <thread>
#include <utility>

#include "comm/communicator.h"
#include "comm/nccl_comm.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/safetensors.h"
#include "core/engine/engine.h"
#include "core/engine/gpu_rank.h"
#include "core/engine/lane_executor.h"
#include "core/engine/rank_buffers.h"
#include "core/engine/rank_compute.h"
#include "core/optimizer/streamed_optimizer.h"
#include "core/plan/planner.h"
#include "io/base/sizes.h"
#include "kernels/cpu/grad_norm.h"
#include "kernels/cpu/simd.h"
#include "tiers/streamed_pass.h"
#include "tiers/tiered_store.h"

namespace strata {

using Clock = std::chrono::steady_clock;
using kernels::cpu::ElementType;
using tiers::ShardKey;
using tiers::ShardKind;

inline double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Narrows (n) fp32 elements to the compute precision (round to nearest even).
inline void narrow(const float* source, ElementType type, std::byte* out, int64_t n) {
  if (type == ElementType::f32) {
    std::memcpy(out, source, size_t(n) * 4);
    return;
  }
  auto* bits = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i)
    bits[i] = type == ElementType::bf16 ? kernels::cpu::float_to_bf16(source[i])
                                        : kernels::cpu::float_to_f16(source[i]);
}

// One step of every rank this process holds: the executor's progress, and
// what the operations hand to step() (the exchange's results, the decision).
struct StepRun {
  int64_t index = 0;  // 0 for the first step
  std::shared_ptr<StepProgress> progress;
  std::mutex mutex;                 // guards the vectors below
  std::vector<StepDecision> decisions;  // per rank, set by the exchange
  std::vector<double> loss_sum;     // per rank, global loss sum after the exchange
  std::vector<double> aux_sum;      // per rank, global sum of the micro-batches' load-balancing losses
  std::vector<double> grad_norm;
  double total_tokens = 0;
};

struct Engine::Impl {
  uint64_t engine_serial = 0;  // names this engine's swap files
  struct Rank {
    int rank = 0;
    std::shared_ptr<comm::Communicator> comm;
    std::unique_ptr<tiers::TieredStore> store;
    std::unique_ptr<StreamedOptimizer> streamed;  // optimizer state on NVMe
    std::optional<Optimizer> optimizer;
    // What the rank computes with (the units, the state's arithmetic): the CPU or a GPU.
    std::unique_ptr<RankCompute> compute;
    std::vector<tiers::DeviceBlock> device_blocks;
    std::vector<tiers::HostBlock> host_blocks;
    RankBuffers buffers;  // the plan's buffers of owner `rank`; the views below point into them
    std::vector<std::byte*> gathered;   // [slot] (largest padded) compute precision
    std::vector<float*> grad_slots;     // [slot] (largest padded) fp32
    std::vector<float*> tied_grads;     // [activation copies] (embedding padded)
    float* reduce_out = nullptr;        // (largest shard)
    int32_t* tokens = nullptr;          // (G, B*T)
    int32_t* targets = nullptr;         // (G, B*T)
    std::byte* param_out = nullptr;     // (largest optimizer range) new parameters, staged
    std::byte* sync_staging = nullptr;  // (largest padded) the CUDA backend's parameter all-gather
    std::vector<std::vector<ShardSegment>> segments;       // per unit, over its optimizer range
    // int8 state: per unit, (int8_block_count of its segments) block scales of m and of v.
    std::vector<float*> m_scales, v_scales;
    float* grad_staging = nullptr;  // (largest gradient shard) an NVMe-homed gradient, read back
    float* grad_sum = nullptr;      // (largest padded) TrainingPlan::host_grads_summed
    // Spilled saved inputs (TrainingPlan::activations_spilled):
    // [TrainingPlan::spill_copy] in host memory, or the NVMe extent holding
    // them (copy k at k x the plan buffer's copy bytes); a GPU's staging copy.
    std::vector<std::byte*> spilled_inputs;
    std::optional<tiers::NvmeExtent> spill_extent;
    std::byte* spill_staging = nullptr;
    std::vector<double> micro_loss;                        // (G) this rank's token-loss sums
    // A mixture of experts: each micro-batch's router statistics (UnitBatch::router)
    // and load-balancing loss, taken when its head runs.
    std::vector<RouterStats> router_stats;  // (G)
    std::vector<double> micro_aux;          // (G)
    // Routed expert fetch (core/plan/expert_fetch.h): each routed unit's
    // experts per micro-batch (set by its forward, read by its backward) and
    // each gather slot's experts read so far (reset by its gather).
    StepRouting routing;
    std::vector<std::vector<uint8_t>> experts_loaded;      // [gather slot] (E)
    // Several ranks: the pieces a share put in a gathered copy that the
    // computation has not taken yet (its forward takes them, on the compute lane).
    std::vector<std::vector<ElementRange>> shared_pieces;  // [gather slot]
    // Deferred expert updates (core/plan/expert_update.h): the experts that
    // wait for their steps, and those steps' decisions by Adam's t. Guarded
    // by streamed_mutex, which also makes the compute lane's replays and the
    // optimizer lane's updates take turns with the streamed pass.
    ExpertUpdateLedger deferred;
    std::map<int64_t, StepDecision> deferred_decisions;
    std::mutex streamed_mutex;
    std::vector<kernels::cpu::GradNormPartial> partials;   // (units) over this rank's slice
    std::unique_ptr<std::atomic<int64_t>[]> params_ready;  // per unit: last step whose update is in
  };

  EngineOptions options;
  TrainingPlan plan;
  std::vector<bool> publishes;  // op publishes its unit's new parameters
  std::vector<std::unique_ptr<Rank>> ranks;
  // The lanes of every rank in `ranks` (the executor's rank i is ranks[i]);
  // started once the ranks are set up, ended before they go.
  std::unique_ptr<LaneExecutor> executor;
  int exchange_op = -1;  // the plan's exchange: step() returns once it is done
  int64_t steps_done = 0;
  int64_t sequence_offset = 0;
  std::shared_ptr<StepRun> last_run;
  bool poisoned = false;
  std::string poison_reason;
  Clock::time_point created = Clock::now();
  uint64_t last_read = 0, last_written = 0;
  std::mutex params_mutex;
  std::condition_variable params_changed;

  ElementType compute_type() const { return plan.compute_type(); }
  // One rank of several processes (EngineOptions::process_comm).
  bool process_mode() const { return options.process_comm != nullptr; }
  // The data bytes this process's ranks have sent to other ranks so far.
  uint64_t network_bytes_sent() const {
    uint64_t bytes = 0;
    for (const auto& rank : ranks) bytes += rank->comm ? rank->comm->bytes_sent() : 0;
    return bytes;
  }
  // True on every process when `flag` is true on any (process mode; else `flag`).
  Result<bool> any_rank(bool flag);
  // `mine`, or `others_failed` when it is ok but another process's was not.
  Status agree(Status mine, const std::string& others_failed);
  int local_count() const { return static_cast<int>(ranks.size()); }
  int world() const { return plan.input.world_size; }
  int units() const { return static_cast<int>(plan.units.size()); }

  // --- set-up ----------------------------------------------------------------------

  Status open_rank(Rank& rank);
  Status init_rank(Rank& rank, const std::vector<std::vector<float>>* loaded);
  Status initialize();
  Status init_unit(Rank& rank, int u, const float* full);
  // Compact m and v: the kernel's zero state, and the rank's int8 scale pointers.
  Status zero_moments(Rank& rank);
  // The NVMe I/O engines' counters, summed over the ranks (-1), or one rank's.
  io::IoCounters nvme_counters(int rank = -1) const;
  // m and v of unit u (padded, fp32 or bf16 as stored) into the rank's range.
  Status load_moments(Rank& rank, int u, const std::byte* m, const std::byte* v);
  // m.bin and v.bin: their size, and for int8 where each rank range's codes
  // start (its scales follow them), [unit][rank] (rank 0 alone at stage 0).
  struct MomentFiles {
    int64_t bytes = 0;
    std::vector<std::vector<int64_t>> int8_offset;
  };
  MomentFiles moment_files(int64_t total_numel) const;
  Status load_int8_moments(Rank& rank, int u, const CheckpointReader& checkpoint,
                           const MomentFiles& files);
  Status resume(const CheckpointReader& checkpoint);
  Status save_rank(Rank& rank, CheckpointWriter& writer, const std::vector<int64_t>& unit_offsets);
  // ready: this process's steps have finished (Engine::finish).
  Result<std::string> save_in_processes(Status ready, const std::string& root, int keep,
                                        const std::vector<int64_t>& unit_offsets, int64_t total,
                                        const nlohmann::ordered_json& units);
  // The JSON files and the manifest, then the rename (Engine::save_checkpoint's end).
  Result<std::string> finish_checkpoint(CheckpointWriter& writer, int keep,
                                        const nlohmann::ordered_json& units);

  // --- execution -------------------------------------------------------------------

  void start_lanes();
  // The executor's hooks: before an operation, the previous step's update of
  // the parameters it reads; after one, its unit's update is published.
  void before_op(Rank& rank, int64_t step_index, int op_index);
  void after_op(Rank& rank, int64_t step_index, int op_index);
  Status execute(Rank& rank, StepRun& run, int op_index);
  void wait_params(int64_t step_index, Rank& rank, int unit);
  void publish_params(Rank& rank, int unit, int64_t step_index);

  Status gather(Rank& rank, const PlanOp& op);
  // Routed expert fetch (core/engine/routed_experts.cpp): at one rank reads
  // the experts op's micro-batch needs that its gather has not; at several
  // checks that its share or gather brought them.
  Status read_routed_experts(Rank& rank, const PlanOp& op, const ComputeParams& params);
  // A routed unit's shard must be whole NVMe blocks to be read in ranges.
  Status check_expert_alignment(Rank& rank, int unit) const;
  // Several ranks: this rank's routing of op's micro-batch (`route`); the
  // ranks' routings joined and the experts they reach read and sent (`share`).
  Status route(Rank& rank, StepRun& run, int op_index, const PlanOp& op);
  Status share(Rank& rank, const PlanOp& op);
  // Each of `pieces` (elements of the unit, the same on every rank) sent from
  // the rank whose shard holds it into its place in every rank's `gathered`
  // copy; the owner's bytes come from `own` (its shard) or are in place (null).
  Status broadcast_pieces(Rank& rank, int unit, std::byte* gathered, const std::byte* own,
                          const std::vector<ElementRange>& pieces);
  Status forward(Rank& rank, StepRun& run, int op_index, const PlanOp& op);
  Status backward(Rank& rank, StepRun& run, int op_index, const PlanOp& op);
  // The units compute straight from the parameters' home at stages 0-2, and on
  // the GPU wherever it holds whole units (TrainingPlan::gpu_params_in_place);
  // otherwise from the copy each use's gather brought.
  bool params_in_place() const { return plan.input.stage < 3 || plan.gpu_params_in_place(); }
  // Unit `unit`'s parameters for compute op `op_index`, after this step's update of them.
  ComputeParams unit_params(Rank& rank, StepRun& run, int op_index, int unit);
  // Where compute op `op`'s gradient goes (TrainingPlan::gpu_grads_in_place).
  GradTarget grad_target(Rank& rank, const PlanOp& op);
  // The host gradient slot of a computation or reduction: its rotating slot,
  // or for the tied embedding's buffer of micro-batch m, -1 - activation_copy(m).
  int grad_slot(const PlanOp& op) const {
    return op.slot >= 0 ? op.slot : -1 - plan.activation_copy(op.micro);
  }
  // The optimizer's state in GPU memory (the CUDA backend): checkpoints read
  // it through the store.
  bool optimizer_on_gpu() const {
    return plan.input.gpu && plan.homes.optimizer == tiers::Tier::device;
  }
  float* grad_home(Rank& rank, int unit) {
    return reinterpret_cast<float*>(home_data(rank, {unit, ShardKind::grad}));
  }
  Status reduce(Rank& rank, const PlanOp& op);
  // Reduces compute op `op`'s gradient over the ranks into its accumulator.
  Status reduce_and_accumulate(Rank& rank, const PlanOp& op);
  // Adds the reduced `count` fp32 elements of micro-batch `micro` into unit u's
  // gradient, in its home (strata.gradient_home); on NVMe the final sum's norm
  // partial is taken here, while it is in host memory.
  // `first`: the accumulator becomes `reduced` (its first sum of the step).
  Status accumulate_gradient(Rank& rank, int u, float* reduced, int64_t count, int micro,
                             bool first);
  Status exchange(Rank& rank, StepRun& run);
  Status optimize(Rank& rank, StepRun& run, const PlanOp& op);
  // AdamW of `update` over state homed on NVMe: the streamed optimizer's pass
  // brings master, m and v chunk by chunk (update's pointers to them are unused).
  // Then starts reading the state of this step's next update on the lane.
  Status update_streamed(Rank& rank, const UnitUpdate& update, const PlanOp& op,
                         ShardKind master_kind);
  // Deferred expert updates (core/plan/expert_update.h): a deferring unit's
  // update steps its router, norm and the experts its step's tokens reached;
  // the others wait (their gradients are zero). `update`'s master, m and v
  // point at the state where it lives in host memory.
  Status update_deferring(Rank& rank, const UnitUpdate& update, const PlanOp& op,
                          ShardKind master_kind);
  // The waiting experts `due` of `unit` take their missed steps (the caller
  // holds rank.streamed_mutex and took them from the ledger). With the state
  // in host memory the copy's windows are put together in `staging`
  // (NVMe-aligned, room for the unit's parameters at their offsets).
  Status replay_deferred(Rank& rank, int unit, const std::vector<DeferredSteps>& due,
                         std::byte* staging);
  // A ranged update of state in host memory: `updates` applied to `shard`
  // (master, m, v and gradient in place), then the copy's `windows` filled
  // in `staging` from the master rounded (the stepped elements by the
  // kernel) and written to the parameters' NVMe home.
  Status update_ranges_in_host(Rank& rank, int unit, kernels::cpu::AdamWShard shard,
                               const std::vector<ElementRange>& windows,
                               const std::vector<RangeUpdate>& updates, bool zero_gradient,
                               std::byte* staging);
  // Every waiting expert of every rank takes its missed steps (before the
  // state is checkpointed or read); the lanes are idle.
  Status apply_deferred_updates();
  Status sync(Rank& rank, const PlanOp& op);
  // A saved input to its home, and back to its device slot.
  Status spill(Rank& rank, const PlanOp& op);
  Status restore(Rank& rank, const PlanOp& op);
  uint64_t saved_input_copy_bytes() const {
    return uint64_t(plan.buffer(BufferRole::activation_spill)->copy_bytes());
  }

  UnitBatch batch_of(Rank& rank, StepRun& run, int micro) const {
    const int64_t N = plan.tokens_per_micro;
    UnitBatch batch;
    batch.tokens = rank.tokens + micro * N;
    batch.targets = rank.targets + micro * N;
    batch.B = plan.input.micro_batch;
    batch.T = plan.input.seq_len;
    const double scale = rank.optimizer ? rank.optimizer->loss_scale() : 1.0;
    batch.loss_scale = float(scale / run.total_tokens);
    const ModelConfig& model = plan.layout.config;
    if (model.is_moe()) {
      batch.router = &rank.router_stats[size_t(micro)];
      // The objective's load-balancing term is the coefficient times the mean
      // over the global batch's micro-batches, as data-parallel transformers averages it.
      if (model.output_router_logits)
        batch.aux_loss_scale =
            float(scale * model.router_aux_loss_coef / double(plan.input.grad_accum * world()));
    }
    return batch;
  }
  std::byte* home_data(Rank& rank, ShardKey key) {
    Result<tiers::ShardHome> home = rank.store->home(key);
    return home ? home->data : nullptr;
  }
};

}  // namespace strata
