// The one input of a plan: what a configuration asks for, on which backend,
// within which budgets (core/README.md, "The route a configuration takes to
// the engine"). plan_input_from_config is the one conversion from a merged
// TrainConfig; `strata train`, `strata plan` and the engine's own plans go
// through it, and build_training_plan (core/plan/training_plan.h) and the
// planner (core/plan/planner.h) read nothing else. One set of names and
// defaults (the config keys' defaults where they are fixed: fp32, the
// buffer counts, the chunk; a bare PlanInput overlaps communication and
// updates after backward, where a config decides both from its stage,
// clipping and precision).
//
// Budgets say what they cover: the device's is one rank's, the host's and
// NVMe's the node's, and PlanBudgets::host_per_rank is the one place the
// node's host budget is divided among the ranks on it. The world is
// PlanBudgets::nodes nodes of ranks_per_node ranks each (`strata plan
// --nodes N --gpus-per-node G`; at run time the launcher's LOCAL_WORLD_SIZE),
// every node with the same budgets; a collective runs within each node over
// LinkBandwidths::intra_node, then across the nodes over ::inter_node
// (training_plan.h, StepTraffic).
//
// Pure functions; thread-safe.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>

#include "core/config/config.h"
#include "core/model/model_config.h"
#include "io/base/status.h"
#include "tiers/tier.h"

namespace strata {

// The streamed optimizer (state on NVMe) works through a unit's shard in chunks
// of at most this many elements (4 MiB per fp32 state, 12 MiB per chunk of
// master, m and v), so its pinned buffers stay small whatever the unit size
// and a unit's chunks pipeline (read the next while updating this one and
// writing the last); sub_group_size can lower it further.
inline constexpr int64_t kOptimizerChunkElements = int64_t{1} << 20;

// The streamed optimizer's chunk for a sub_group_size: at most
// kOptimizerChunkElements, a whole multiple of 1024 elements (its SIMD and
// O_DIRECT granule), at least 1024.
int64_t streamed_chunk_elements(int64_t sub_group_size);

// What the memory of a plan may take, each figure named for what it covers;
// unset: not known (nothing is refused for it).
struct PlanBudgets {
  std::optional<int64_t> device_per_rank;  // device memory (the CPU backend: host memory for it)
  std::optional<int64_t> host_per_node;    // host memory for every rank on the node
  std::optional<int64_t> nvme_per_node;    // free bytes under the NVMe directories
  int ranks_per_node = 0;                  // ranks sharing the node; 0: the whole world
  // Where each figure came from, as `strata plan` prints it ("given", ...).
  std::string device_source, host_source, nvme_source;

  int node_ranks(int world_size) const { return ranks_per_node > 0 ? ranks_per_node : world_size; }
  // Nodes in the world (validate_plan_input: a whole number of them).
  int nodes(int world_size) const {
    return std::max(1, world_size / std::max(1, node_ranks(world_size)));
  }
  // The node's host budget shared evenly by its ranks: the one division.
  std::optional<int64_t> host_per_rank(int world_size) const {
    if (!host_per_node) return std::nullopt;
    return *host_per_node / std::max(1, node_ranks(world_size));
  }
};

// Link bandwidths in bytes per second, for the traffic times. The two
// collective links are per rank: intra_node between the ranks of a node
// (NVLink or PCIe peer to peer; on the CPU backend shared memory), inter_node
// a rank's share of its node's network to the other nodes (with one NIC per
// GPU, as on DGX-class nodes, that NIC's rate; with one NIC for the node, its
// rate divided by the node's ranks).
struct LinkBandwidths {
  double intra_node = 25e9;
  double inter_node = 25e9;
  double pcie = 25e9;
  double nvme = 6e9;  // shared by the node
};

struct PlanInput {
  ModelConfig model;  // `strata plan --params N` plans model_of_size(N)
  int world_size = 1;
  int stage = 0;
  OffloadDevice offload_param = OffloadDevice::none;
  OffloadDevice offload_optimizer = OffloadDevice::none;
  Precision precision = Precision::fp32;
  int64_t micro_batch = 1;
  int64_t seq_len = 2048;  // effective_seq_len
  int64_t grad_accum = 1;
  bool overlap_comm = true;    // false: collectives run on the compute lane, between computations
  bool reduce_scatter = true;  // false (stages 2-3): all-reduce, keep the owned part
  // strata.gradient_reduce_dtype bf16: half the traffic, bf16 rounding.
  bool reduce_in_bf16 = false;
  // strata.optimizer_state_dtype: how m and v are stored (kernels/cpu/adamw.h).
  OptimizerStateDtype optimizer_state = OptimizerStateDtype::fp32;
  // strata.gradient_home; automatic takes host fp32 unless the plan then
  // needs more host memory than budgets.host_per_rank and the optimizer is
  // on NVMe, where it takes NVMe fp32.
  GradientHome gradient_home = GradientHome::automatic;
  // No clipping and no loss scaling: the update needs no global result, so
  // `decide` runs at the start and each unit's optimizer as soon as its
  // gradient is final, during backward.
  bool optimizer_during_backward = false;
  // Compute on a GPU (the CUDA backend, core/engine/gpu_rank.h): the state's
  // device homes are GPU memory; the collectives and the CPU optimizer work
  // on pinned host buffers, and the device holds the compute working set.
  bool gpu = false;
  // One process per GPU talking through NCCL (comm/nccl_comm.h): the
  // collectives' host buffers are staged through two device buffers of the
  // largest collective, taken from the device budget.
  bool nccl_staging = false;
  // The order of the computations (config.h): micro_batch, each micro-batch
  // through every unit; layer, each unit through every micro-batch, so a
  // unit's parameters are fetched once for the forward and once for the
  // backward, and every micro-batch's unit inputs are kept to the backward.
  // auto_choice: the planner's choose_schedule picks; a built plan's is resolved.
  Schedule schedule = Schedule::auto_choice;
  // Where either schedule keeps the saved inputs (each unit's input) until
  // their backward, the layer-major one every micro-batch's, the
  // micro-batch order one micro-batch's (TrainingPlan::activations_spilled):
  //  device  all of them in device memory;
  //  host    on the CPU backend all of them in host memory (the device tier is
  //          host memory too, so only the budget they count against changes);
  //          on the CUDA backend in pinned host memory, spilled and restored;
  //  nvme    spilled to NVMe through the tiers and restored (either backend).
  // Unset: the first of device, host, NVMe (with a path known) that fits
  // the budgets (DeepSpeed's cpu_checkpointing sets host); a built plan's
  // is set.
  std::optional<tiers::Tier> activation_home;
  // strata.vocab_chunks auto: the planner (resolve_unit_cuts, planner.h)
  // keeps model.vocab_chunks 1 unless the whole embedding and head keep the
  // plan from fitting its budgets and cutting them makes it fit; a resolved
  // input says what it chose and why in vocab_chunks_reason.
  bool vocab_chunks_auto = false;
  std::string vocab_chunks_reason;
  // strata.layer_pieces auto: likewise for model.layer_pieces, tried after
  // the vocabulary cut (it adds a saved input per layer); the choice and why
  // in layer_pieces_reason.
  bool layer_pieces_auto = false;
  std::string layer_pieces_reason;
  // strata.expert_groups auto (a mixture on the CPU backend): likewise for
  // model.expert_groups, tried last, with the layers in pieces: the fewest
  // groups that make the plan fit; the choice and why in expert_groups_reason.
  bool expert_groups_auto = false;
  std::string expert_groups_reason;
  // strata.mlp_parts auto (a model with dense layers on the CPU backend):
  // likewise for model.mlp_parts, tried after the groups: the fewest parts
  // that make the plan fit; the choice and why in mlp_parts_reason.
  bool mlp_parts_auto = false;
  std::string mlp_parts_reason;
  // strata.expert_fetch all: a sparse layer's experts move with their unit
  // even where the plan could read only the routed ones
  // (TrainingPlan::routed_expert_fetch).
  bool expert_fetch_all = false;
  // strata.expert_update deferred: where experts are read as routed and
  // their optimizer state streams from NVMe, an expert no token reached in a
  // step is not updated until its parameters are next read, then replayed
  // exactly (TrainingPlan::deferred_expert_updates, core/plan/expert_update.h).
  bool expert_update_deferred = false;
  int fetch_slots = 5;        // offload_param.buffer_count: NVMe parameter copies in host memory
  int optimizer_buffers = 4;  // offload_optimizer.buffer_count: the streamed optimizer's
  int64_t optimizer_chunk_elements = kOptimizerChunkElements;  // streamed_chunk_elements
  uint64_t nvme_alignment = 4096;
  bool nvme_path_known = false;  // an NVMe directory was given (for suggestions)
  PlanBudgets budgets;
  LinkBandwidths links;
};

// Which machine a configuration is planned for.
struct PlanTarget {
  bool gpu = false;           // the CUDA backend
  bool nccl_staging = false;  // one process per GPU through NCCL
  int ranks_per_node = 0;     // PlanBudgets::ranks_per_node
};

// Tokens per sequence: strata.seq_len, else min(2048, the model's maximum).
int64_t effective_seq_len(const TrainConfig& config, const ModelConfig& model);

// The plan input of a merged config for a model: stage, offload homes,
// precision, batch shape, buffers, schedule; the budgets strata.device_mem_limit
// and strata.host_mem_limit give (sources "given"); the default bandwidths.
PlanInput plan_input_from_config(const TrainConfig& config, const ModelConfig& model,
                                 PlanTarget target = {});

// A Llama-shaped model within 3% of `parameters` parameters (32000-token
// vocabulary, or a byte vocabulary below a few million; untied; the depth
// nearest 128 hidden features per layer), for a plan asked for by size alone
// (`strata plan --params N`).
ModelConfig model_of_size(int64_t parameters);

// The input's own rules, checked before anything is planned (stage range,
// offload_param below stage 3, batch shape, buffer counts, gradient home);
// build_training_plan and the planner both start here.
Status validate_plan_input(const PlanInput& input);

}  // namespace strata
