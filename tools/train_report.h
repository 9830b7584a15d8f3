// What `strata train` writes while it runs: the metrics file (one JSON object
// per step), the Chrome/Perfetto trace of every plan operation on its lane,
// the scalars of each step for the monitors (TensorBoard, CSV), the progress
// line, and the end-of-run summary.
//
// The writers only format; the command decides when to call them. Files are
// opened up front (so a bad path fails before training starts) and flushed
// after every step, so a run cut short leaves valid lines behind (the trace is
// closed by finish(); a trace left open is still readable by Perfetto).
// Not thread-safe: the training loop is the only caller.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "core/engine/engine.h"
#include "core/plan/expert_fetch.h"
#include "core/plan/training_plan.h"
#include "io/base/status.h"
#include "tools/monitors.h"

namespace strata::tools {

// One step as the metrics file and the progress line see it.
struct StepReport {
  StepResult result;
  int64_t tokens_processed = 0;  // B * T * G * W, masked targets included
  std::optional<double> eval_loss;
  bool fp16 = false;
  std::optional<double> predicted_seconds;  // the step-time model's steady step
  std::string predicted_by;                 // the hardware profile it used
};

// The step's throughput, as the metrics file, the monitors and the progress
// line show it: tokens processed per second of the step (0 for a step that
// took no time), and NVMe bytes read and written per second, in GB/s.
double tokens_per_second(const StepReport& report);
double nvme_gb_per_second(const StepResult& result);

// The step's values for the monitors, the metrics file's, named as DeepSpeed's
// engine names them where it logs the same value ("Train/Samples/train_loss",
// eval_loss, lr, loss_scale with fp16) and in its manner otherwise (grad_norm,
// tokens_per_s, step_time_s, nvme_gb_per_s), each at the samples (sequences)
// trained on so far: DeepSpeed's global_samples, the data's sequence offset.
std::vector<ScalarEvent> monitor_events(const StepReport& report);

// --metrics FILE.jsonl: one object per line; with routed expert reads each
// step's routing too ("routing", routing_to_json), which `strata plan
// --routing FILE` reads back (read_recorded_routing).
class MetricsWriter {
 public:
  static Result<MetricsWriter> open(const std::string& path, const TrainingPlan& plan);
  MetricsWriter(MetricsWriter&&) noexcept;
  MetricsWriter& operator=(MetricsWriter&&) noexcept;
  ~MetricsWriter();
  Status write(const StepReport& report);

 private:
  MetricsWriter() = default;
  std::string path_;
  std::FILE* file_ = nullptr;
  const TrainingPlan* plan_ = nullptr;  // names the routed units; outlives the writer
};

// The routings a metrics file recorded, one per step that has one, for
// `plan` (routing_from_json); an error names the file and line.
Result<std::vector<StepRouting>> read_recorded_routing(const TrainingPlan& plan,
                                                       const std::string& path);

// --trace FILE.json: Chrome trace event format, one complete ("X") event per
// operation run, pid = rank, tid = lane; readable by Perfetto and chrome://tracing.
class TraceWriter {
 public:
  static Result<TraceWriter> open(const std::string& path, const TrainingPlan& plan);
  TraceWriter(TraceWriter&&) noexcept;
  TraceWriter& operator=(TraceWriter&&) noexcept;
  ~TraceWriter();
  Status write(const std::vector<OpTiming>& timings);
  Status finish();

 private:
  TraceWriter() = default;
  std::string path_;
  std::FILE* file_ = nullptr;
  const TrainingPlan* plan_ = nullptr;
};

// The name an operation has in traces and summaries: "gather(layers.3) mb 1".
std::string op_display_name(const TrainingPlan& plan, const PlanOp& op);

// Busy seconds per lane (summed over the ranks) and per operation kind.
struct LaneTotals {
  double lane_seconds[kLaneCount] = {};
  std::vector<double> kind_seconds = std::vector<double>(kOpKindCount, 0.0);  // by OpKind
  void add(const TrainingPlan& plan, const std::vector<OpTiming>& timings);
};

// The progress line: on a terminal a line updated in place with a permanent
// line every `print_every` steps; otherwise plain lines every `print_every` steps.
class ProgressPrinter {
 public:
  ProgressPrinter(int64_t total_steps, int print_every);
  void step(const StepReport& report, double elapsed_seconds);
  void eval(int64_t step, double loss, int64_t tokens);
  void end();                          // ends an in-place line
  void line(const std::string& text);  // a permanent line, not overwritten

 private:
  int64_t total_steps_;
  int print_every_;
  bool terminal_;
  bool open_line_ = false;
  double recent_step_seconds_ = 0;  // exponential mean, for the ETA
};

struct RunSummary {
  int64_t steps = 0;
  int64_t tokens = 0;
  double seconds = 0;             // wall time of the steps, first to last, with finish()
  double first_step_seconds = 0;  // includes warm-up
  double stall_seconds = 0;       // summed over steps (mean over ranks)
  uint64_t nvme_read = 0, nvme_written = 0;
  std::optional<double> first_loss, last_loss;
  LaneTotals lanes;
  tiers::TierUsage usage[tiers::kTierCount];  // the rank with the largest peak
  uint64_t budget[tiers::kTierCount] = {0, 0,
                                        0};  // per rank: as given or chosen; nvme: the swap file
  int world = 1;
  std::vector<double> step_seconds;         // every step's, in order
  std::optional<double> predicted_seconds;  // the step-time model's steady step
  std::optional<double> predicted_first_seconds;
  std::string predicted_by;
  // A mixture read as routed: the prediction above is an even routing's; this
  // one the median step of the run's own routings after the first.
  std::optional<double> predicted_with_run_routing;
};

// Several lines: throughput, memory per tier, NVMe traffic, stall, time per lane.
std::string format_run_summary(const RunSummary& summary);

}  // namespace strata::tools
