// The pieces of a `strata train` run, which tools/train_command.cpp walks in
// order: what a run builds step by step (TrainingRun), the data it reads, the
// budgets it chooses from its plan, the validation loss and the export.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/bootstrap.h"
#include "core/checkpoint/checkpoint.h"
#include "core/config/backend_choice.h"
#include "core/config/config.h"
#include "core/data/sequence_order.h"
#include "core/data/token_data.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/model/model_config.h"
#include "core/plan/planner.h"
#include "core/plan/step_model.h"
#include "core/plan/training_plan.h"
#include "io/base/status.h"
#include "tools/csv_monitor_writer.h"
#include "tools/tensorboard_writer.h"
#include "tools/train_report.h"

namespace strata::tools {

using Clock = std::chrono::steady_clock;

// Two kinds of failure: the user's input (2) and the run itself (1).
struct Failure {
  int exit_code;
  std::string message;
};
Failure usage_error(const Status& status);
Failure run_error(const Status& status);

// The token file, its optional loss mask (one byte per token, 0: do not count
// that token as a target), and the order its sequences are read in.
struct TrainData {
  TokenFile file;
  std::vector<uint8_t> mask;           // (file.size()) or empty
  std::string mask_path, mask_source;  // where the mask came from, for the run header
  int64_t vocab = 0;
  SequenceOrder order;  // strata.shuffle; what the engine's checkpoints record
};

// A loss mask file: one byte per token of the data file. `what` names the
// mask in errors: "--loss-mask", or the file a mask was found next to.
Result<std::vector<uint8_t>> read_loss_mask(const std::string& path, int64_t tokens,
                                            const std::string& what = "--loss-mask");

// The engine's reader of micro-batches from the data, in its order, with the
// mask's dropped targets set to -1.
BatchReader batch_reader(std::shared_ptr<const TrainData> data);

struct EvalResult {
  double loss = 0;
  int64_t tokens = 0;
};

// The validation loss: the first `batches` micro-batches of (B, T) of the eval
// file in sequential order, forward only, on the weights as they are after the
// last update, over the targets its mask keeps (all when `mask` is empty). The
// engine has no forward-only entry yet, so this runs the CPU model on a
// one-rank copy of the weights (Engine::read_model).
Result<EvalResult> evaluate(Engine& engine, const TokenFile& file, const std::vector<uint8_t>& mask,
                            int64_t batches, int64_t B, int64_t T);

// --export: a .safetensors file, or else a Hugging Face directory (config.json +
// model.safetensors).
Status export_model(const HostModel& model, const std::string& path, DType dtype);

// The device budget per rank and the host budget for the node: as given, else
// the plan's peak plus a quarter and 64 MiB (the host tier maps and pins its
// whole budget up front, so a default of "most of the machine" would lock it).
struct ChosenBudgets {
  PlanBudgets budgets;
  std::string note;  // what was chosen and why, for the header
};

// `ranks_on_node`: the ranks on this machine, threads or processes;
// `local_ranks`: those this process holds (the world size, or 1 when launched).
ChosenBudgets choose_budgets(const TrainConfig& config, const TrainingPlan& plan, int ranks_on_node,
                             int local_ranks);

// What a run builds, step by step, in the order TrainCommand::train builds it;
// members are destroyed in reverse, so the trace and the engine go first.
inline constexpr size_t kKeptRoutings = 64;

struct TrainingRun {
  // Set when this process is one of several launched ones (strata launch,
  // torchrun, SLURM, Open MPI): it trains one rank, and the world size is the launcher's.
  std::optional<comm::LaunchEnvironment> launch;
  bool rank0 = true;          // writes the metrics, the monitors, the trace and the export
  ConfigOverrides overrides;  // the flags, with the launcher's world size
  TrainConfig config;         // the --config file merged with the flags
  std::optional<ModelConfig> model;
  BackendChoice backend;
  std::optional<TrainingPlan> plan;
  std::string schedule_reason;  // why the plan's schedule (choose_schedule)
  std::shared_ptr<TrainData> data;
  std::optional<TokenFile> eval_file;
  std::vector<uint8_t> eval_mask;  // the mask next to the eval file, or empty
  std::vector<std::string> nvme_paths;
  DType export_dtype = DType::f32;
  std::optional<MetricsWriter> metrics;
  std::optional<TensorBoardWriter> tensorboard;  // the tensorboard block, or --tensorboard
  std::optional<CsvMonitorWriter> csv_monitor;   // the csv_monitor block
  int local_ranks = 1;    // the ranks this process holds: the world size, or 1 when launched
  int ranks_on_node = 1;  // the ranks on this machine, threads or processes
  ChosenBudgets budgets;  // its note gains the NVMe line
  EngineOptions options;  // filled by the steps before create_engine, then the engine's
  std::unique_ptr<Engine> engine;
  std::optional<TraceWriter> trace;
  int64_t tokens_per_step = 0;
  std::optional<StepPrediction> prediction;  // the step-time model's, when a profile is known
  std::optional<HardwareProfile> profile;    // the profile it used
  // A mixture read as routed, predicted: each step's routing (the last
  // kKeptRoutings to 2 kKeptRoutings), for the summary's prediction with
  // the run's own routing.
  std::vector<StepRouting> routings;
  bool routings_trimmed = false;
  RunSummary summary;
  Clock::time_point start;  // of the first step
  int64_t saved_at = -1;    // the step of the last checkpoint written
};

double seconds_since(Clock::time_point start);

// Adds a finished step to the summary; returns its report for the progress
// line and the metrics.
StepReport account_step(RunSummary& summary, int64_t s, const StepResult& step,
                        int64_t tokens_per_step, bool fp16);

}  // namespace strata::tools
