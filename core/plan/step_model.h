// The step-time model: a training plan's operations (core/plan/training_plan.h)
// played out on a machine (core/plan/hardware_profile.h) before anything runs.
//
// Cost. Each operation takes the time of the work it does on the resources
// it holds: a unit's forward and backward their FLOPs (matmuls from the
// shapes, causal attention, the backward's recomputation) at the device's
// rate (the CPU backend's measured unit rates, a GPU's peak times its
// efficiency; on a GPU at least its launches' time, and a time per host
// wait, core/plan/gpu_launches.h) plus its PCIe uploads; a transfer its bytes (traffic_per_op,
// the plan's own account) over its link with a latency per transfer; a
// collective its two levels one after the other (StepTraffic: a ring within
// the node on the intra-node link, then one across the nodes on the
// inter-node link, each at its own bandwidth with a latency per hop); the optimizer its
// parameters at the state format's rate, its streamed state over NVMe alongside (reads
// and writes at once, at the drives' mixed rate where the profile has one).
//
// Simulation. The rules are the lane executor's (core/engine/lane_executor.h)
// and the engine's, from the same definitions: each lane runs its operations
// in plan order, step after step; an operation starts once its lane is free,
// its dependencies of the same step are done, the previous step's update of
// the parameters it reads is published (reads_parameters,
// parameter_publishers), and the resources it holds are free (one NVMe set,
// the intra-node and the inter-node link, PCIe each way, the device; on the CPU backend the cores,
// which compute, the optimizer and host copies share; an operation that works them for less
// time than it waits on NVMe shares them instead, OpCost::cores_seconds). A step is handed to
// the lanes when the previous one's step() returns: its exchange done and the step before it
// complete. The first (cold) step and the steady one come apart.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/plan/expert_update.h"
#include "core/plan/hardware_profile.h"
#include "core/plan/training_plan.h"

namespace strata {

// What an operation holds while it runs (a bit each).
enum class Resource : uint32_t {
  device = 1,       // the GPU's compute (CUDA backend)
  cores = 2,        // the host's cores (the CPU backend's compute, the CPU optimizer, host copies)
  nvme = 4,         // the node's NVMe set
  intra_node = 8,   // the collectives' link between the ranks of a node
  pcie_h2d = 16,    // host to GPU
  pcie_d2h = 32,    // GPU to host
  inter_node = 64,  // the collectives' link to other nodes (this rank's share)
};
inline constexpr int kResourceCount = 7;
const char* resource_name(int index);  // "device", "cores", ...

struct OpCost {
  double seconds = 0;
  uint32_t resources = 0;  // Resource bits
  // A collective's two levels, of `seconds`: it holds both links while it
  // runs (one lane runs every collective), each busy for its own level only.
  double intra_node_seconds = 0, inter_node_seconds = 0;
  // An operation that works the cores for less time than it waits on NVMe
  // (the streamed optimizer's AdamW between its chunks, a replay of missed
  // steps beside its reads) shares them: it neither waits for nor holds
  // the cores (no Resource::cores bit), and works them this long, counted
  // in their busy time. Negative: it holds them if its bits say so.
  double cores_seconds = -1;
  // The seconds resource `index` works during the operation.
  double busy_seconds(int index) const;
};

// One operation as the simulator sees it.
struct SimOp {
  int lane = 0;
  std::vector<int> deps;       // earlier operations of the same step
  int previous_step_dep = -1;  // an operation of the previous step it waits for (-1: none)
  double seconds = 0;
  uint32_t resources = 0;
};

struct SimulatedOp {
  int step = 0, op = 0;
  double start = 0, end = 0;
  double waited = 0;  // from when its lane and step were ready to its start
};

struct Simulation {
  // (steps + 1): when each step is handed out; the last, when a next one would be
  std::vector<double> step_start;
  std::vector<SimulatedOp> ops;  // every operation of every step, in the order started
  double step_seconds(int step) const {
    return step_start[size_t(step) + 1] - step_start[size_t(step)];
  }
};

// Plays `steps` steps of `ops` on `lanes` lanes. Step s + 1 is handed out when
// operation `release_op` of step s is done and step s - 1 is complete.
Simulation simulate_steps(const std::vector<SimOp>& ops, int lanes, int release_op, int steps);

// The cost of each of plan.ops on `hardware`.
// `routed`: a mixture's step for its recorded routing (routed_step,
// core/plan/expert_update.h): its bytes per operation and the elements its
// AdamW steps where the routing decides them; null: the plan's worst case
// (traffic_per_op: every expert read, replayed and updated).
std::vector<OpCost> cost_operations(const TrainingPlan& plan, const HardwareProfile& hardware,
                                    const RoutedStep* routed = nullptr);
// The plan's operations with their costs, lanes, dependencies and waits across steps.
std::vector<SimOp> step_graph(const TrainingPlan& plan, const std::vector<OpCost>& costs);
// FLOPs of one compute operation (forward or backward of a unit, one micro-batch).
double operation_flops(const TrainingPlan& plan, const PlanOp& op);
// The same of a model's units at (B, T): a decoder layer's forward (matmuls
// 2 N per token, causal or windowed attention) and backward (twice the
// forward, and the forward again when it recomputes), the head's one pass
// (forward and backward: 3 x 2 C V per token); the embedding's count 0. A
// layer's matmuls read its active parameters (a sparse layer's router and k
// experts); `layer` < 0: the mean over the model's layers. A piece of a
// layer (ModelConfig::layer_pieces) counts its own: the attention's
// projections and attention, or the MLP's products.
double layer_forward_flops(const ModelConfig& model, int64_t B, int64_t T, int64_t layer = -1,
                           LayerPiece piece = LayerPiece::whole);
double layer_backward_flops(const ModelConfig& model, int64_t B, int64_t T, bool recomputes,
                            int64_t layer = -1, LayerPiece piece = LayerPiece::whole);
double head_flops(const ModelConfig& model, int64_t B, int64_t T);

struct StepPrediction {
  std::string hardware;               // the profile's name
  double cold_seconds = 0;            // the first step
  double steady_seconds = 0;          // a step once the pipeline is full
  double lane_busy[kLaneCount] = {};  // seconds each lane works in a steady step
  double compute_stall = 0;           // seconds the compute lane's operations wait in a steady step
  double resource_busy[kResourceCount] = {};  // seconds each resource is held in a steady step
  Lane bound_lane = Lane::compute;            // the busiest lane
  int bound_resource = 0;                     // the busiest resource
  int64_t tokens_per_step = 0;                // over the ranks
  double tokens_per_second = 0;
  std::optional<double> mfu;          // on a GPU: model FLOPs / (peak x step time)
  StepTraffic traffic;                // per rank
  std::optional<double> drive_years;  // rated TBW / bytes written per year of steps, when rated
  bool nvme_unknown = false;          // the plan moves NVMe bytes the profile has no drive for
  bool inter_node_unknown = false;    // the plan crosses nodes and the profile has no such link
  // On a GPU, per step and rank (gpu_launches.h): the units' launches and
  // host waits, and the seconds they add to the compute operations beyond
  // their FLOPs' time.
  double gpu_launches = 0;
  int64_t gpu_host_waits = 0;
  double gpu_launch_seconds = 0;
  Simulation simulation;              // three steps, for a timeline
};

// `routed` as cost_operations takes it: each step of the simulation is that
// step; StepPrediction::traffic is then its sums.
StepPrediction predict_step(const TrainingPlan& plan, const HardwareProfile& hardware,
                            const RoutedStep* routed = nullptr);

// Steps of a mixture read as routed, one per routing in order (recorded,
// or drawn: even_routings), each costed as routed_step gives it with the
// ledger of waiting experts carried from step to step as a run carries it:
// the steady step's mean, least and most seconds, and the prediction of the
// step whose time is the median. The first `warmup` routings only advance
// the ledger.
struct RoutedPrediction {
  int64_t steps = 0;
  double mean = 0, least = 0, most = 0;
  StepPrediction median;
};
RoutedPrediction predict_routed_steps(const TrainingPlan& plan, const HardwareProfile& hardware,
                                      const std::vector<StepRouting>& routings, int warmup = 0);

// The step a run is expected to take: predict_step's, or for a mixture
// read as routed (whose plan counts the worst case: every expert read,
// replayed and updated) the median step of an even routing
// (kEvenRoutingSteps drawn, the first kEvenRoutingWarmup left out while
// the ledger fills).
inline constexpr int kEvenRoutingSteps = 10, kEvenRoutingWarmup = 2;
StepPrediction predict_expected_step(const TrainingPlan& plan, const HardwareProfile& hardware);

// Seconds as `strata plan` prints them: "1.2 min", "3.45 s", "297.3 ms", "80 us".
std::string seconds_text(double seconds);

// The lines `strata plan` prints, and its JSON.
std::string format_prediction(const StepPrediction& prediction);
nlohmann::ordered_json prediction_to_json(const StepPrediction& prediction);

}  // namespace strata
