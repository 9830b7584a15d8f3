#include "tools/train_run.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "core/checkpoint/safetensors.h"
#include "io/base/sizes.h"
#include "io/file_system.h"

namespace strata::tools {

namespace fs = std::filesystem;

Failure usage_error(const Status& status) {
  return {2, status.message()};
}
Failure run_error(const Status& status) {
  return {1, status.message()};
}

// `what` names the mask in errors: "--loss-mask", or the file a mask was found next to.
Result<std::vector<uint8_t>> read_loss_mask(const std::string& path, int64_t tokens,
                                            const std::string& what) {
  io::FileSystem& files = io::FileSystem::real();
  Result<int> fd = io::open_for_reading(files, path);
  if (!fd) return fd.status().with_context(what);
  const int64_t size = files.file_size(*fd);
  Status read = size < 0 ? io::file_error(path, "reading its size", int(-size))
                : size != tokens
                    ? Status::invalid_argument(fmt::format(
                          "{}: {} bytes, but the data file has {} tokens; the mask needs one "
                          "byte per token",
                          path, size, tokens))
                    : Status::ok();
  std::vector<uint8_t> mask;
  if (read) {
    mask.resize(size_t(size));
    read = io::read_fully(files, *fd, mask.data(), mask.size(), 0, path);
  }
  (void)files.close(*fd);
  if (!read) return read.with_context(what);
  return mask;
}

BatchReader batch_reader(std::shared_ptr<const TrainData> data) {
  return [data](int64_t offset, int64_t micro, int rank, int world, int64_t B, int64_t T,
                int32_t* inputs, int32_t* targets) -> Status {
    Status s = read_micro_batch(data->file, data->order, offset, micro, rank, world, B, T,
                                data->vocab, inputs, targets);
    if (!s || data->mask.empty()) return s;
    // Target t of sequence j is token j*T + t + 1; its mask byte decides whether it counts.
    const int64_t sequences = data->file.sequence_count(T);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t j = sequence_index(data->order, offset, micro, rank, world, B, b, sequences);
      const uint8_t* mask = data->mask.data() + j * T + 1;
      for (int64_t t = 0; t < T; ++t)
        if (mask[t] == 0) targets[b * T + t] = -1;
    }
    return Status::ok();
  };
}

// The validation loss: the first `batches` micro-batches of (B, T) of the eval
// file in sequential order, forward only, on the weights as they are after the
// last update, over the targets its mask keeps (all when `mask` is empty). The
// engine has no forward-only entry yet, so this runs the CPU model on a
// one-rank copy of the weights (Engine::read_model).
Result<EvalResult> evaluate(Engine& engine, const TokenFile& file, const std::vector<uint8_t>& mask,
                            int64_t batches, int64_t B, int64_t T) {
  Result<HostModel> model = engine.read_model();
  if (!model) return model.status();
  const ModelConfig& config = model->layout.config;
  UnitWorkspace workspace(config, B, T);
  std::vector<int32_t> inputs(size_t(B * T)), targets(size_t(B * T));
  double sum = 0;
  int64_t counted = 0;
  for (int64_t k = 0; k < batches; ++k) {
    if (Status s = read_micro_batch(file, 0, k, 0, 1, B, T, config.vocab_size, inputs.data(),
                                    targets.data());
        !s)
      return s.with_context("--eval-data");
    const int64_t sequences = file.sequence_count(T);
    for (int64_t b = 0; b < B && !mask.empty(); ++b) {
      const uint8_t* kept = mask.data() + sequence_index(0, k, 0, 1, B, b, sequences) * T + 1;
      for (int64_t t = 0; t < T; ++t)
        if (kept[t] == 0) targets[size_t(b * T + t)] = -1;
    }
    counted += std::count_if(targets.begin(), targets.end(), [](int32_t t) { return t >= 0; });
    UnitBatch batch;
    batch.tokens = inputs.data();
    batch.targets = targets.data();
    batch.B = B;
    batch.T = T;
    Result<double> loss = model_forward(*model, batch, workspace);
    if (!loss) return loss.status();
    sum += *loss;
  }
  if (counted == 0)
    return Status::error(
        fmt::format("--eval-data {}: its mask keeps no target in the first {} micro-batches; raise "
                    "--eval-batches or check the mask",
                    file.path(), batches));
  return EvalResult{sum / double(counted), counted};
}

// --export: a .safetensors file, or else a Hugging Face directory (config.json +
// model.safetensors).
Status export_model(const HostModel& model, const std::string& path, DType dtype) {
  if (fs::path(path).extension() != ".safetensors") return save_host_model(model, path, dtype);
  const std::vector<CheckpointTensor> named = checkpoint_tensor_groups(model.layout);
  std::vector<TensorSpec> specs;
  for (const CheckpointTensor& t : named) specs.push_back({t.name, t.shape});
  Result<SafetensorsWriter> writer = SafetensorsWriter::create(path, specs, dtype);
  if (!writer) return writer.status();
  std::vector<float> scratch;
  for (const CheckpointTensor& t : named) {
    const float* data = whole_tensor(
        t, [&](int64_t u) { return model.params[size_t(u)].data(); }, scratch);
    if (Status s = writer->write(t.name, data); !s) return s;
  }
  return writer->finish();
}

// `ranks_on_node`: the ranks on this machine, threads or processes;
// `local_ranks`: those this process holds (the world size, or 1 when launched).
ChosenBudgets choose_budgets(const TrainConfig& config, const TrainingPlan& plan, int ranks_on_node,
                             int local_ranks) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  auto with_margin = [&](int64_t peak) {
    return int64_t(round_up(uint64_t(peak) + uint64_t(peak) / 4 + 64 * kMiB, uint64_t(kMiB)));
  };
  const int64_t device_peak = plan.peak(tiers::Tier::device);
  const int64_t host_peak = plan.peak(tiers::Tier::host);
  ChosenBudgets chosen;
  PlanBudgets& b = chosen.budgets;
  b.ranks_per_node = ranks_on_node;
  b.device_per_rank = config.strata.device_mem_limit ? int64_t(*config.strata.device_mem_limit)
                                                     : with_margin(device_peak);
  b.host_per_node = config.strata.host_mem_limit ? int64_t(*config.strata.host_mem_limit)
                                                 : with_margin(host_peak) * ranks_on_node;
  b.device_source = "--device-mem-limit";
  b.host_source = "--host-mem-limit";
  chosen.note =
      config.strata.device_mem_limit
          ? fmt::format("device {} per rank (given)", format_bytes(double(*b.device_per_rank)))
          : fmt::format("device {} per rank (plan peak {} + 25% + 64 MiB)",
                        format_bytes(double(*b.device_per_rank)),
                        format_bytes(double(device_peak)));
  chosen.note +=
      config.strata.host_mem_limit
          ? fmt::format(", host {} for the node (given)", format_bytes(double(*b.host_per_node)))
          : fmt::format(", host {} for the node (plan peak {} per rank + 25% + 64 MiB)",
                        format_bytes(double(*b.host_per_node)), format_bytes(double(host_peak)));
  // What this process takes; on the CPU backend the device budget is host memory too.
  const std::optional<int64_t> available = detect_host_available_bytes();
  const int64_t per_rank =
      *b.host_per_rank(plan.input.world_size) + (plan.input.gpu ? 0 : *b.device_per_rank);
  const int64_t wanted = per_rank * local_ranks;
  if (available && wanted > *available)
    fmt::print(stderr, "warning: the budgets ({}) exceed the memory available now ({})\n",
               format_bytes(double(wanted)), format_bytes(double(*available)));
  return chosen;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Adds a finished step to the summary; returns its report for the progress
// line and the metrics.
StepReport account_step(RunSummary& summary, int64_t s, const StepResult& step,
                        int64_t tokens_per_step, bool fp16) {
  StepReport report;
  report.result = step;
  report.tokens_processed = tokens_per_step;
  report.fp16 = fp16;
  summary.steps = s;
  summary.tokens += tokens_per_step;
  summary.stall_seconds += step.stall_seconds;
  summary.nvme_read += step.nvme_read_bytes;
  summary.nvme_written += step.nvme_written_bytes;
  summary.step_seconds.push_back(step.seconds);
  report.predicted_seconds = summary.predicted_seconds;
  report.predicted_by = summary.predicted_by;
  if (s == 1) {
    summary.first_loss = step.loss;
    summary.first_step_seconds = step.seconds;
  }
  summary.last_loss = step.loss;
  return report;
}

}  // namespace strata::tools
