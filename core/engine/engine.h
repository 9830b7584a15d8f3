// The engine: training steps of a Llama model, sharded over W ranks by ZeRO
// stage 0-3 with parameters and optimizer state homed on the device, in host
// memory or on NVMe, executed from a TrainingPlan (core/plan/training_plan.h).
//
// This is the library entry point that `strata train` and the tests share:
// Engine::create(options) checks the plan against the budgets (refusing, with
// the numbers and the planner's suggestion, a configuration that cannot fit),
// opens one TieredStore per rank, allocates every buffer the plan lists and
// initialises the model (from a seed, or from a safetensors checkpoint); then
// step() runs one optimizer step over G micro-batches on each of the W ranks.
//
// Ranks are threads of this process talking through LocalComm (comm/); each
// rank runs its plan on five lanes (io, comm, compute, optimizer,
// activations), threads that follow the plan's order and its dependencies. The optimizer of step s
// runs unit by unit while step s+1's forward goes on: step() returns once the
// loss and gradient norm of its step are known and its updates are under
// way; finish() waits for them. The CPU backend computes in fp32 whatever
// the storage precision (bf16/fp16 parameters are widened for compute; the
// fp32 master is what the optimizer updates). The CUDA backend (options.backend,
// core/engine/gpu_rank.h) computes the units on one GPU shared by the ranks, in the
// parameters' precision, at every stage and offload placement; what passes
// through pinned host memory is the plan's to say (TrainingPlan::gpu_*).
//
// Every buffer a rank holds is one of the plan's (TrainingPlan::buffers),
// allocated by walking that list; engine_impl.h says how the implementation
// is cut (creation, set-up, checkpoints, the step executor, the operations).
//
// Reproducibility: a step's result depends only on (model, seed, data,
// world size, precision, optimizer settings, backend); the ZeRO stage, the
// offload homes, overlap_comm and reduce_scatter change where bytes live and
// when they move, never the numbers (on the GPU: among the offloaded
// placements; state on the GPU accumulates gradients in another order).
//
// Errors: a failing operation (I/O, non-finite loss, ...) makes its step
// return the error naming the rank and operation; the engine then refuses
// further steps. Everything already written to the homes stays as it was.
// Not thread-safe: one caller drives an Engine.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/config/config.h"
#include "core/model/model.h"
#include "core/model/model_config.h"
#include "core/optimizer/optimizer.h"
#include "core/plan/expert_fetch.h"
#include "core/plan/planner.h"
#include "core/plan/training_plan.h"
#include "io/base/status.h"
#include "io/fault_injection.h"
#include "kernels/backend.h"
#include "tiers/tier.h"

namespace strata {

// Reads one micro-batch in the order SequenceOrder::from_config(config.strata, seed) states
// (core/data/sequence_order.h; checkpoints record it): inputs (B, T) and targets (B, T) of
// micro-batch `micro` on `rank`, from the running sequence offset.
using BatchReader =
    std::function<Status(int64_t sequence_offset, int64_t micro, int rank, int world, int64_t B,
                         int64_t T, int32_t* inputs, int32_t* targets)>;

// A gradient EngineOptions::gradient_observer sees.
struct GradientSeen {
  int rank = 0, unit = 0, micro = 0;
  bool reduced = false;
  const float* data = nullptr;
  int64_t count = 0;
};

struct EngineOptions {
  ModelConfig model;
  TrainConfig config;  // merged file and flags (stage, offload, batch, precision, optimizer, aio)
  int64_t total_steps = 0;     // scheduler.total_num_steps when the config leaves it 0
  // The memory the ranks may take: the device's per rank (host memory
  // standing in on the CPU backend), the host's for the node, shared evenly
  // by the ranks on it (PlanBudgets::host_per_rank, the one division); unset:
  // no limit. The engine refuses a plan that does not fit them.
  PlanBudgets budgets;
  // The plan to run, as `strata train` built it (core/plan/planner.h,
  // plan_training, from plan_input_from_config of `model` and `config`).
  // Unset: the engine builds it the same way, with `budgets`.
  std::optional<TrainingPlan> plan;
  std::vector<std::string> nvme_paths;  // swap directories (needed when anything is homed on NVMe)
  uint64_t seed = 1234;
  std::string init_checkpoint;  // safetensors file or Hugging Face directory; empty: random init
  BatchReader data;
  int64_t sequence_offset = 0;  // the data position to start from
  // A checkpoint directory (core/checkpoint/checkpoint.h) to start from instead of
  // init_checkpoint/seed: weights, optimizer state, step and data position.
  // Its world size, stage and offload may differ from this run's.
  std::string resume_from;
  bool pin_host = true;
  // cuda: the units compute on GPU `gpu_index` (core/engine/gpu_rank.h); every rank of
  // this process shares that GPU. State that is not offloaded lives in its memory.
  kernels::BackendKind backend = kernels::BackendKind::cpu;
  int gpu_index = 0;
  // Tests only: the CUDA backend's plan and data paths with host memory
  // standing in for the GPU and the CPU units computing
  // (GpuRank::create_emulated), for machines without a GPU.
  bool emulate_gpu = false;
  // Set when this process is one rank of several processes (strata launch):
  // the engine then holds that rank only, talking to the others through this
  // communicator (GlooComm on the CPU, NcclComm on GPUs), whose world size
  // must be the config's. Null: every rank is a thread of this process.
  // budgets.ranks_per_node then says how many processes share the node's host
  // budget (strata train sets it from the launcher). Collective calls below (save_checkpoint,
  // read_model, read_unit_parameters, any_rank) must be made by every process
  // in the same order.
  std::shared_ptr<comm::Communicator> process_comm;
  // One-line notices (fallbacks); default: stderr.
  std::function<void(const std::string&)> notice{};
  // Tests only: the NVMe rings of every rank fail on demand.
  std::shared_ptr<io::FaultInjector> fault_injector{};
  // Tests only: sees each gradient on its way through the reduction, on the
  // thread of the rank: `reduced` false, a micro-batch's gradient of the whole
  // unit as the backward left it, before anything is added to it; true, what
  // the collective returned (this rank's part at stages 2-3), before it is
  // added to the accumulator. Ranks of one process call it concurrently.
  std::function<void(const GradientSeen&)> gradient_observer{};
};

// What a step did, summed over the ranks unless said otherwise.
struct StepResult {
  int64_t step = 0;              // 1 for the first step
  // Mean token cross-entropy over the global batch (unscaled); for a mixture
  // of experts with output_router_logits, plus router_aux_loss_coef x aux_loss.
  double loss = 0;
  // A mixture of experts: the load-balancing loss (core/model/model.h), the
  // mean over the global batch's micro-batches, whether or not the loss has
  // it; none for a dense model.
  std::optional<double> aux_loss;
  double grad_norm = 0;          // global L2 norm of the gradients before clipping
  double lr = 0;                 // learning rate this step's update used
  double loss_scale = 1;         // fp16: the scale of this step's gradients
  bool skipped = false;          // fp16 overflow (or non-finite gradients): no update
  int64_t tokens = 0;            // target tokens counted in the loss
  int64_t sequence_offset = 0;   // data position after the step
  double seconds = 0;            // wall time of step()
  double stall_seconds = 0;      // compute lanes waiting on other lanes (mean over ranks)
  uint64_t nvme_read_bytes = 0;  // counted by the I/O engines since the previous step() returned
  uint64_t nvme_written_bytes = 0;
  // Data bytes this process's ranks sent to other ranks during step() (the
  // communicators' count, comm::Communicator::bytes_sent): in one process of
  // W ranks W times the plan's traffic_per_step.collective(), in each process
  // of a launched run once. Collectives of the previous step's updates that
  // are still running (stages 1-2) count where they fall.
  uint64_t network_bytes = 0;
  // Routed expert fetch (TrainingPlan::routed_expert_fetch): the experts each
  // micro-batch of the first rank here sent tokens to, per unit
  // (core/plan/expert_fetch.h); routed_parameter_reads counts what that
  // reads. Empty otherwise.
  StepRouting routing;
};

// One operation as it ran, for traces.
struct OpTiming {
  int rank = 0;
  int op = 0;  // index into plan().ops
  int64_t step = 0;
  double start_seconds = 0;  // since the engine was created
  double end_seconds = 0;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> create(EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Result<StepResult> step();
  // Waits until the last step's updates are in every home.
  Status finish();
  // NVMe bytes {read, written} by the I/O engines since the previous step()
  // returned (or this call): after finish(), what the last step's updates
  // moved after it returned, which no StepResult counts.
  std::pair<uint64_t, uint64_t> take_nvme_bytes();

  // Unit u's full fp32 parameters (the master where there is one): (padded_numel).
  // Calls finish() first.
  Status read_unit_parameters(int unit, float* flat);
  // Every tensor, in a one-rank HostModel.
  Result<HostModel> read_model();

  // Writes the training state as <root>/step-<steps done> (core/checkpoint/checkpoint.h),
  // straight from every rank's tiers, NVMe shards in chunks through the
  // streamed pass's buffers; keeps the newest `keep` (0: all). Calls finish() first.
  Result<std::string> save_checkpoint(const std::string& root, int keep = 0);
  int64_t steps_done() const;

  const TrainingPlan& plan() const;
  const ModelLayout& layout() const;
  // Over every rank's store: the largest `peak` and the sum of `used` / `capacity`.
  tiers::TierUsage usage(tiers::Tier tier) const;
  // The most one rank's store used in `tier` and that rank's budget; `rank`
  // counts the ranks this process holds (local_rank_count()).
  tiers::TierUsage rank_usage(int rank, tiers::Tier tier) const;
  // The ranks this process holds: the world size, or 1 with process_comm.
  int local_rank_count() const;
  // True on every process when `flag` is true on any (with process_comm; else `flag`).
  Result<bool> any_rank(bool flag);
  // NVMe bytes read and written by every rank's I/O engine since create() (initialisation
  // included); with `rank` (counting the ranks this process holds), that rank's alone.
  uint64_t nvme_bytes_read(int rank = -1) const;
  uint64_t nvme_bytes_written(int rank = -1) const;
  // Timings of every operation since the last call (needs finish() for the last step's optimizer).
  std::vector<OpTiming> take_timings();
  const OptimizerState& optimizer_state() const;
  int64_t sequence_offset() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The optimizer driver's options from a merged config (lr, betas, schedule,
// fp16 loss scaling, clipping); `total_steps` fills scheduler.total_num_steps when 0.
OptimizerOptions optimizer_options_from_config(const TrainConfig& config, int64_t total_steps);

}  // namespace strata
