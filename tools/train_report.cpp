#include "tools/train_report.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/base/sizes.h"

namespace strata::tools {
namespace {

Result<std::FILE*> open_for_writing(const std::string& path, const char* flag) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr)
    return Status::from_errno(errno, fmt::format("{} {}: cannot open for writing", flag, path));
  return file;
}

Status write_text(std::FILE* file, const std::string& path, const std::string& text) {
  if (std::fwrite(text.data(), 1, text.size(), file) != text.size() || std::fflush(file) != 0)
    return Status::from_errno(errno, fmt::format("{}: write failed", path));
  return Status::ok();
}

// JSON numbers cannot be NaN or infinite; such values are written as null.
nlohmann::ordered_json number(double value) {
  if (!std::isfinite(value)) return nullptr;
  return value;
}

}  // namespace

// --- step values ---------------------------------------------------------------

double tokens_per_second(const StepReport& report) {
  const double seconds = report.result.seconds;
  return seconds > 0 ? double(report.tokens_processed) / seconds : 0.0;
}

double nvme_gb_per_second(const StepResult& r) {
  return r.seconds > 0 ? double(r.nvme_read_bytes + r.nvme_written_bytes) / r.seconds / 1e9 : 0.0;
}

std::vector<ScalarEvent> monitor_events(const StepReport& report) {
  const StepResult& r = report.result;
  const int64_t samples = r.sequence_offset;
  std::vector<ScalarEvent> events = {{"Train/Samples/train_loss", r.loss, samples}};
  if (report.eval_loss) events.push_back({"Train/Samples/eval_loss", *report.eval_loss, samples});
  events.push_back({"Train/Samples/lr", r.lr, samples});
  events.push_back({"Train/Samples/grad_norm", r.grad_norm, samples});
  if (report.fp16) events.push_back({"Train/Samples/loss_scale", r.loss_scale, samples});
  if (r.aux_loss) events.push_back({"Train/Samples/aux_loss", *r.aux_loss, samples});
  events.push_back({"Train/Samples/tokens_per_s", tokens_per_second(report), samples});
  events.push_back({"Train/Samples/step_time_s", r.seconds, samples});
  events.push_back({"Train/Samples/nvme_gb_per_s", nvme_gb_per_second(r), samples});
  return events;
}

// --- metrics ---------------------------------------------------------------------

Result<MetricsWriter> MetricsWriter::open(const std::string& path, const TrainingPlan& plan) {
  Result<std::FILE*> file = open_for_writing(path, "--metrics");
  if (!file) return file.status();
  MetricsWriter writer;
  writer.path_ = path;
  writer.file_ = *file;
  writer.plan_ = &plan;
  return writer;
}

MetricsWriter::MetricsWriter(MetricsWriter&& other) noexcept
    : path_(std::move(other.path_)),
      file_(std::exchange(other.file_, nullptr)),
      plan_(other.plan_) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& other) noexcept {
  if (this != &other) {
    if (file_ != nullptr) std::fclose(file_);
    path_ = std::move(other.path_);
    file_ = std::exchange(other.file_, nullptr);
    plan_ = other.plan_;
  }
  return *this;
}

MetricsWriter::~MetricsWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

Status MetricsWriter::write(const StepReport& report) {
  const StepResult& r = report.result;
  nlohmann::ordered_json j;
  j["step"] = r.step;
  j["loss"] = number(r.loss);
  j["lr"] = r.lr;
  j["grad_norm"] = number(r.grad_norm);
  j["tokens"] = report.tokens_processed;
  j["loss_tokens"] = r.tokens;
  j["tokens_per_s"] = tokens_per_second(report);
  j["step_time_s"] = r.seconds;
  j["nvme_read_bytes"] = r.nvme_read_bytes;
  j["nvme_written_bytes"] = r.nvme_written_bytes;
  j["network_bytes"] = r.network_bytes;
  if (r.aux_loss) j["aux_loss"] = number(*r.aux_loss);
  j["stall_s"] = r.stall_seconds;
  j["sequence_offset"] = r.sequence_offset;
  if (report.fp16) j["loss_scale"] = r.loss_scale;
  j["skipped"] = r.skipped;
  if (report.eval_loss) j["eval_loss"] = number(*report.eval_loss);
  if (report.predicted_seconds) {
    j["predicted_step_time_s"] = number(*report.predicted_seconds);
    j["predicted_by"] = report.predicted_by;
  }
  if (!r.routing.empty()) j["routing"] = routing_to_json(*plan_, r.routing);
  return write_text(file_, path_, j.dump() + "\n");
}

Result<std::vector<StepRouting>> read_recorded_routing(const TrainingPlan& plan,
                                                       const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return Status::not_found(fmt::format(
        "--routing {}: cannot open it ({}); pass the --metrics file of a strata train run", path,
        std::strerror(errno)));
  std::vector<StepRouting> steps;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string origin = fmt::format("--routing {} line {}", path, number);
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object())
      return Status::invalid_argument(fmt::format(
          "{}: not a JSON object; a metrics file has one per step (a line cut short by a "
          "stopped run can be deleted)",
          origin));
    if (!j.contains("routing")) continue;
    Result<StepRouting> routing = routing_from_json(plan, j["routing"], origin);
    if (!routing) return routing.status();
    steps.push_back(std::move(*routing));
  }
  if (steps.empty())
    return Status::invalid_argument(fmt::format(
        "--routing {}: no step records a routing; record one with strata train --metrics on a "
        "run that reads its experts as routed (expert fetch: routed)",
        path));
  return steps;
}

// --- trace -----------------------------------------------------------------------

std::string op_display_name(const TrainingPlan& plan, const PlanOp& op) {
  std::string out = op_kind_name(op.kind);
  if (op.unit >= 0 && op.unit < int(plan.layout.units.size()))
    out += "(" + plan.layout.units[size_t(op.unit)].unit.name + ")";
  if (op.micro >= 0) out += fmt::format(" mb {}", op.micro);
  return out;
}

Result<TraceWriter> TraceWriter::open(const std::string& path, const TrainingPlan& plan) {
  Result<std::FILE*> file = open_for_writing(path, "--trace");
  if (!file) return file.status();
  TraceWriter writer;
  writer.path_ = path;
  writer.file_ = *file;
  writer.plan_ = &plan;
  // Names for the processes (ranks) and threads (lanes), lanes in plan order.
  std::string head = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  for (int r = 0; r < plan.input.world_size; ++r) {
    nlohmann::ordered_json process = {{"name", "process_name"},
                                      {"ph", "M"},
                                      {"pid", r},
                                      {"tid", 0},
                                      {"args", {{"name", fmt::format("rank {}", r)}}}};
    head += (first ? "" : ",\n") + process.dump();
    first = false;
    for (int lane = 0; lane < kLaneCount; ++lane) {
      nlohmann::ordered_json thread = {{"name", "thread_name"},
                                       {"ph", "M"},
                                       {"pid", r},
                                       {"tid", lane},
                                       {"args", {{"name", lane_name(static_cast<Lane>(lane))}}}};
      nlohmann::ordered_json order = {{"name", "thread_sort_index"},
                                      {"ph", "M"},
                                      {"pid", r},
                                      {"tid", lane},
                                      {"args", {{"sort_index", lane}}}};
      head += ",\n" + thread.dump() + ",\n" + order.dump();
    }
  }
  if (Status s = write_text(writer.file_, path, head); !s) return s;
  return writer;
}

TraceWriter::TraceWriter(TraceWriter&& other) noexcept
    : path_(std::move(other.path_)),
      file_(std::exchange(other.file_, nullptr)),
      plan_(other.plan_) {}

TraceWriter& TraceWriter::operator=(TraceWriter&& other) noexcept {
  if (this != &other) {
    if (file_ != nullptr) std::fclose(file_);
    path_ = std::move(other.path_);
    file_ = std::exchange(other.file_, nullptr);
    plan_ = other.plan_;
  }
  return *this;
}

TraceWriter::~TraceWriter() {
  if (file_ != nullptr) (void)finish();
}

Status TraceWriter::write(const std::vector<OpTiming>& timings) {
  if (file_ == nullptr || timings.empty()) return Status::ok();
  std::string text;
  for (const OpTiming& t : timings) {
    if (t.op < 0 || t.op >= int(plan_->ops.size())) continue;
    const PlanOp& op = plan_->ops[size_t(t.op)];
    nlohmann::ordered_json event;
    event["name"] = op_display_name(*plan_, op);
    event["cat"] = op_kind_name(op.kind);
    event["ph"] = "X";
    event["pid"] = t.rank;
    event["tid"] = static_cast<int>(op.lane);
    event["ts"] = t.start_seconds * 1e6;
    event["dur"] = std::max(0.0, t.end_seconds - t.start_seconds) * 1e6;
    nlohmann::ordered_json args;
    args["op"] = t.op;
    args["step"] = t.step;
    if (op.unit >= 0) args["unit"] = op.unit;
    if (op.micro >= 0) args["micro"] = op.micro;
    if (op.bytes > 0) args["bytes"] = op.bytes;
    event["args"] = args;
    text += ",\n" + event.dump();
  }
  return write_text(file_, path_, text);
}

Status TraceWriter::finish() {
  if (file_ == nullptr) return Status::ok();
  Status s = write_text(file_, path_, "\n]}\n");
  if (std::fclose(file_) != 0 && s)
    s = Status::from_errno(errno, fmt::format("{}: close failed", path_));
  file_ = nullptr;
  return s;
}

// --- lane totals -------------------------------------------------------------------

void LaneTotals::add(const TrainingPlan& plan, const std::vector<OpTiming>& timings) {
  for (const OpTiming& t : timings) {
    if (t.op < 0 || t.op >= int(plan.ops.size())) continue;
    const PlanOp& op = plan.ops[size_t(t.op)];
    const double seconds = std::max(0.0, t.end_seconds - t.start_seconds);
    lane_seconds[static_cast<int>(op.lane)] += seconds;
    const size_t kind = static_cast<size_t>(op.kind);
    if (kind < kind_seconds.size()) kind_seconds[kind] += seconds;
  }
}

// --- progress ----------------------------------------------------------------------

ProgressPrinter::ProgressPrinter(int64_t total_steps, int print_every)
    : total_steps_(total_steps),
      print_every_(std::max(1, print_every)),
      terminal_(isatty(STDOUT_FILENO) != 0) {}

void ProgressPrinter::step(const StepReport& report, double elapsed_seconds) {
  const StepResult& r = report.result;
  // The first step warms up; the ETA follows the recent steps.
  recent_step_seconds_ = r.step <= 2 ? r.seconds : 0.8 * recent_step_seconds_ + 0.2 * r.seconds;
  const double eta = recent_step_seconds_ * double(total_steps_ - r.step);
  std::string text = fmt::format(
      "step {:>{}}/{}  loss {:.4f}  lr {:.2e}  {:.0f} tok/s  nvme {:.2f} GB/s  {:.2f} s/step",
      r.step, fmt::formatted_size("{}", total_steps_), total_steps_, r.loss, r.lr,
      tokens_per_second(report), nvme_gb_per_second(r), r.seconds);
  if (report.fp16) text += fmt::format("  scale {:g}", r.loss_scale);
  if (r.aux_loss) text += fmt::format("  aux {:.4f}", *r.aux_loss);
  if (r.skipped) text += "  (skipped: overflow)";
  const bool permanent = r.step == 1 || r.step % print_every_ == 0 || r.step == total_steps_;
  text += fmt::format("  elapsed {}  eta {}", format_seconds(elapsed_seconds), format_seconds(eta));
  if (terminal_) {
    fmt::print("\r\033[K{}", text);
    if (permanent) fmt::print("\n");
    open_line_ = !permanent;
    std::fflush(stdout);
  } else if (permanent) {
    fmt::print("{}\n", text);
    std::fflush(stdout);
  }
}

void ProgressPrinter::eval(int64_t step, double loss, int64_t tokens) {
  line(fmt::format("eval at step {}: loss {:.4f} over {} tokens", step, loss, tokens));
}

void ProgressPrinter::line(const std::string& text) {
  end();
  fmt::print("{}\n", text);
  std::fflush(stdout);
}

void ProgressPrinter::end() {
  if (open_line_) fmt::print("\n");
  open_line_ = false;
  std::fflush(stdout);
}

// --- summary -----------------------------------------------------------------------

std::string format_run_summary(const RunSummary& s) {
  std::string out;
  const double later_seconds = s.seconds - s.first_step_seconds;
  const double tokens_per_step = s.steps > 0 ? double(s.tokens) / double(s.steps) : 0.0;
  out += fmt::format("trained {} steps, {} tokens in {}: {:.0f} tokens/s", s.steps,
                     format_count(double(s.tokens)), format_seconds(s.seconds),
                     s.seconds > 0 ? double(s.tokens) / s.seconds : 0.0);
  if (s.steps > 1 && later_seconds > 0)
    out += fmt::format(" ({:.0f} tokens/s after the first step)",
                       tokens_per_step * double(s.steps - 1) / later_seconds);
  out += "\n";
  if (s.first_loss && s.last_loss)
    out += fmt::format("loss {:.4f} -> {:.4f}\n", *s.first_loss, *s.last_loss);
  if (s.predicted_seconds && s.step_seconds.size() > 1) {
    // The steps after the first against the model's steady step.
    std::vector<double> later(s.step_seconds.begin() + 1, s.step_seconds.end());
    std::nth_element(later.begin(), later.begin() + ptrdiff_t(later.size() / 2), later.end());
    const double measured = later[later.size() / 2];
    out += fmt::format(
        "step time: measured {} (median after the first), predicted {} on {}: {:+.1f}%; first "
        "step measured {}, predicted {}\n",
        format_seconds(measured), format_seconds(*s.predicted_seconds), s.predicted_by,
        100.0 * (*s.predicted_seconds - measured) / measured, format_seconds(s.step_seconds[0]),
        format_seconds(s.predicted_first_seconds.value_or(0)));
    if (s.predicted_with_run_routing)
      out += fmt::format(
          "  (that prediction is an even routing's; with this run's routing, step by step: {}, "
          "{:+.1f}%)\n",
          format_seconds(*s.predicted_with_run_routing),
          100.0 * (*s.predicted_with_run_routing - measured) / measured);
  }
  out += "peak memory per rank:";
  for (int t = 0; t < tiers::kTierCount; ++t) {
    const tiers::TierUsage& u = s.usage[t];
    out += fmt::format("  {} {} (budget {})", tiers::tier_name(static_cast<tiers::Tier>(t)),
                       format_bytes(double(u.peak)), format_bytes(double(s.budget[t])));
  }
  out += "\n";
  if (s.nvme_read + s.nvme_written > 0)
    out +=
        fmt::format("nvme: read {}, written {} ({:.2f} GB/s over the run)\n",
                    format_bytes(double(s.nvme_read)), format_bytes(double(s.nvme_written)),
                    s.seconds > 0 ? double(s.nvme_read + s.nvme_written) / s.seconds / 1e9 : 0.0);
  out += fmt::format(
      "stalled (compute waiting on other lanes, mean over ranks): {} ({:.1f}% of the run)\n",
      format_seconds(s.stall_seconds), s.seconds > 0 ? 100.0 * s.stall_seconds / s.seconds : 0.0);
  out += "where the time went (busy time per lane, mean over ranks, % of the run):";
  for (int lane = 0; lane < kLaneCount; ++lane) {
    const double busy = s.lanes.lane_seconds[lane] / std::max(1, s.world);
    // The activations lane works only where checkpoints are spilled.
    if (static_cast<Lane>(lane) == Lane::activations && busy == 0) continue;
    out += fmt::format("  {} {} ({:.0f}%)", lane_name(static_cast<Lane>(lane)),
                       format_seconds(busy), s.seconds > 0 ? 100.0 * busy / s.seconds : 0.0);
  }
  out += "\nby operation:";
  static constexpr OpKind kinds[] = {
      OpKind::fetch,  OpKind::gather,   OpKind::forward, OpKind::release,   OpKind::backward,
      OpKind::reduce, OpKind::exchange, OpKind::decide,  OpKind::optimizer, OpKind::writeback,
      OpKind::sync,   OpKind::spill,    OpKind::restore, OpKind::route,     OpKind::share};
  for (OpKind kind : kinds) {
    const double seconds = s.lanes.kind_seconds[static_cast<size_t>(kind)] / std::max(1, s.world);
    if (seconds <= 0) continue;
    out += fmt::format("  {} {}", op_kind_name(kind), format_seconds(seconds));
  }
  out += "\n";
  return out;
}

}  // namespace strata::tools
