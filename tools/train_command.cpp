// `strata train`: trains a model on a token file with the engine (core/engine/engine.h),
// and shows what it does: progress on the terminal, --metrics per step,
// --trace of every plan operation, a summary at the end, --export of the
// final weights.
//
// Exit status: 0 after the last step, 1 when training fails or the plan does
// not fit the budgets, 2 for a usage error (bad flag, missing file, bad config),
// 130 when Ctrl-C stopped it early (after writing the summary and the export).
// Every error is one line on stderr.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "comm/bootstrap.h"
#include "comm/nccl_comm.h"
#include "comm/socket_comm.h"
#include "core/checkpoint/checkpoint.h"
#include "core/checkpoint/safetensors.h"
#include "core/config/backend_choice.h"
#include "core/config/config.h"
#include "core/data/token_data.h"
#include "core/engine/engine.h"
#include "core/model/model.h"
#include "core/model/model_config.h"
#include "core/plan/planner.h"
#include "core/plan/training_plan.h"
#include "io/base/sizes.h"
#include "kernels/cpu/gemm.h"
#include "tools/config_flags.h"
#include "tools/subcommand.h"
#include "tools/train_report.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// Where state homed on NVMe goes when no directory is configured.
constexpr const char* kDefaultNvmePath = "strata-swap";

// Ctrl-C stops after the step under way; the run then finishes as if it had
// reached --steps (summary, export).
std::atomic<bool> stop_requested{false};
std::atomic<int> stop_signal{0};
void request_stop(int signal) {
  stop_signal.store(signal);
  stop_requested.store(true);
}
const char* stop_name() {
  return stop_signal.load() == SIGTERM ? "SIGTERM" : "Ctrl-C";
}

// Two kinds of failure: the user's input (2) and the run itself (1).
struct Failure {
  int exit_code;
  std::string message;
};
Failure usage_error(const Status& status) {
  return {2, status.message()};
}
Failure run_error(const Status& status) {
  return {1, status.message()};
}

// The token file, its optional loss mask (one byte per token, 0: do not count
// that token as a target), and the order its sequences are read in.
struct TrainData {
  TokenFile file;
  std::vector<uint8_t> mask;           // (file.size()) or empty
  std::string mask_path, mask_source;  // where the mask came from, for the run header
  int64_t vocab = 0;
  SequenceOrder order;  // strata.shuffle; what the engine's checkpoints record
};

// `what` names the mask in errors: "--loss-mask", or the file a mask was found next to.
Result<std::vector<uint8_t>> read_loss_mask(const std::string& path, int64_t tokens,
                                            const std::string& what = "--loss-mask") {
  std::error_code error;
  const uintmax_t size = fs::file_size(path, error);
  if (error) return Status::error(fmt::format("{} {}: {}", what, path, error.message()));
  if (int64_t(size) != tokens)
    return Status::error(
        fmt::format("{} {}: {} bytes, but the data file has {} tokens; the mask needs one "
                    "byte per token",
                    what, path, size, tokens));
  std::vector<uint8_t> mask(static_cast<size_t>(size));
  std::ifstream in(path, std::ios::binary);
  if (!in.read(reinterpret_cast<char*>(mask.data()), std::streamsize(size)))
    return Status::error(fmt::format("{} {}: read failed", what, path));
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
  std::vector<NamedTensor> named = checkpoint_tensors(model.layout);
  std::vector<TensorSpec> specs;
  for (const NamedTensor& t : named) specs.push_back({t.slot->name, t.slot->shape});
  Result<SafetensorsWriter> writer = SafetensorsWriter::create(path, specs, dtype);
  if (!writer) return writer.status();
  for (const NamedTensor& t : named) {
    const float* data = model.params[size_t(t.unit)].data() + t.slot->offset;
    if (Status s = writer->write(t.slot->name, data); !s) return s;
  }
  return writer->finish();
}

// The device budget per rank and the host budget for the node: as given, else
// the plan's peak plus a quarter and 64 MiB (the host tier maps and pins its
// whole budget up front, so a default of "most of the machine" would lock it).
struct ChosenBudgets {
  PlanBudgets budgets;
  std::string note;  // what was chosen and why, for the header
};

// `ranks_on_node`: the ranks on this machine, threads or processes;
// `local_ranks`: those this process holds (the world size, or 1 when launched).
ChosenBudgets choose_budgets(const TrainConfig& config, const TrainingPlan& plan,
                             int ranks_on_node, int local_ranks) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  auto with_margin = [&](int64_t peak) {
    return int64_t(round_up(uint64_t(peak) + uint64_t(peak) / 4 + 64 * kMiB, uint64_t(kMiB)));
  };
  const int64_t device_peak = plan.peak(tiers::Tier::device);
  const int64_t host_peak = plan.peak(tiers::Tier::host);
  ChosenBudgets chosen;
  PlanBudgets& b = chosen.budgets;
  b.ranks_per_node = ranks_on_node;
  b.device_per_rank =
      config.strata.device_mem_limit ? int64_t(*config.strata.device_mem_limit) : with_margin(device_peak);
  b.host_per_node = config.strata.host_mem_limit ? int64_t(*config.strata.host_mem_limit)
                                                 : with_margin(host_peak) * ranks_on_node;
  b.device_source = "--device-mem-limit";
  b.host_source = "--host-mem-limit";
  chosen.note = config.strata.device_mem_limit
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
  const int64_t per_rank = *b.host_per_rank(plan.input.world_size) +
                           (plan.input.gpu ? 0 : *b.device_per_rank);
  const int64_t wanted = per_rank * local_ranks;
  if (available && wanted > *available)
    fmt::print(stderr, "warning: the budgets ({}) exceed the memory available now ({})\n",
               format_bytes(double(wanted)), format_bytes(double(*available)));
  return chosen;
}

// What a run builds, step by step, in the order TrainCommand::train builds it;
// members are destroyed in reverse, so the trace and the engine go first.
struct TrainingRun {
  // Set when this process is one of several launched ones (strata launch,
  // torchrun, SLURM, Open MPI): it trains one rank, and the world size is the launcher's.
  std::optional<comm::LaunchEnvironment> launch;
  bool rank0 = true;          // writes the metrics, the trace and the export
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
  int local_ranks = 1;       // the ranks this process holds: the world size, or 1 when launched
  int ranks_on_node = 1;     // the ranks on this machine, threads or processes
  ChosenBudgets budgets;     // its note gains the NVMe line
  EngineOptions options;     // filled by the steps before create_engine, then the engine's
  std::unique_ptr<Engine> engine;
  std::optional<TraceWriter> trace;
  int64_t tokens_per_step = 0;
  RunSummary summary;
  Clock::time_point start;  // of the first step
  int64_t saved_at = -1;    // the step of the last checkpoint written
};

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
  if (s == 1) {
    summary.first_loss = step.loss;
    summary.first_step_seconds = step.seconds;
  }
  summary.last_loss = step.loss;
  return report;
}

// The sections of `strata train --help`, in the order they are listed.
constexpr const char* kDataGroup = "Model and data";
constexpr const char* kBatchGroup = "Batch, precision and optimizer";
constexpr const char* kZeroGroup = "ZeRO and offload";
constexpr const char* kIoGroup = "NVMe I/O";
constexpr const char* kMemoryGroup = "Memory budgets";
constexpr const char* kOutputGroup = "Output";
constexpr const char* kCheckpointGroup = "Checkpoints";

class TrainCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand("train", "Train a model on a token file");
    cmd->footer(
        "Flags override the --config file (DeepSpeed JSON); --print-config shows the merged "
        "result.\n"
        "Sizes: 512M, 16G (powers of 1024), 16GB (powers of 1000). Ctrl-C stops after the current "
        "step.");
    add_model_and_data_options(*cmd);
    add_steps_and_shared_flags(*cmd);
    add_output_and_checkpoint_options(*cmd);
    return cmd;
  }

  int run() override {
    std::optional<Failure> failure = train();
    if (failure) {
      if (progress_) progress_->end();
      fmt::print(stderr, "strata train: {}\n", failure->message);
      return failure->exit_code;
    }
    // Stopped by Ctrl-C: the summary and export are written, but the run is not the one asked for.
    if (!stop_requested.load()) return 0;
    return stop_signal.load() == SIGTERM ? 143 : 130;
  }

 private:
  void add_model_and_data_options(CLI::App& cmd) {
    cmd.add_option("--model", model_,
                   "Preset (tiny, small, llama3.2-1b, ...), config.json or Hugging Face directory")
        ->group(kDataGroup);
    cmd.add_option("--data", data_path_,
                   "Token file to train on: nanoGPT .bin (uint16), llm.c shard, or uint32 (see "
                   "--data-format); "
                   "`strata demo-data` writes one")
        ->group(kDataGroup);
    cmd.add_option("--data-format", data_format_, "auto | nanogpt | llmc | uint32 (default auto)")
        ->check(CLI::IsMember({"auto", "nanogpt", "llmc", "uint32"}))
        ->group(kDataGroup);
    cmd.add_option(
           "--loss-mask", loss_mask_path_,
           "One byte per token of --data; 0: that token is not a target (prompts in fine-tuning). "
           "Default: the .mask file next to --data when there is one (train.bin -> train.mask); "
           "none: no mask")
        ->group(kDataGroup);
    cmd.add_option("--eval-data", eval_path_,
                   "Token file for a validation loss (same format as --data)")
        ->group(kDataGroup);
    cmd.add_option("--eval-every", eval_every_,
                   "Validation every N steps, and after the last (default: only after the last)")
        ->group(kDataGroup);
    cmd.add_option("--eval-batches", eval_batches_,
                   "Micro-batches of the eval file per validation (default 8)")
        ->group(kDataGroup);
    cmd.add_option("--init", init_path_,
                   "Start from these weights: .safetensors file or Hugging Face directory "
                   "(default: random from --seed)")
        ->group(kDataGroup);
    cmd.add_option("--seed", seed_, "Seed of the random initialisation (default 1234)")
        ->group(kDataGroup);
    // --no-shuffle counts -1: it undoes a config file's strata.shuffle.
    cmd.add_flag_function(
           "--shuffle,!--no-shuffle",
           [this](int64_t count) { flags_.overrides.shuffle = count > 0; },
           "Read the sequences in a new seeded order every pass over the data (strata.shuffle; "
           "default: the file's order)")
        ->group(kDataGroup);
    cmd.add_option("--shuffle-seed", flags_.overrides.shuffle_seed,
                   "Seed of the --shuffle order (strata.shuffle_seed; default: --seed)")
        ->group(kDataGroup);
    cmd.add_option("--backend", backend_,
                   "cpu | cuda | auto (default auto: cuda when a GPU is present)")
        ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
        ->group(kDataGroup);
    cmd.add_option("--gemm", gemm_,
                   "CPU backend's matrix products: auto (default: the best class the CPU's "
                   "features allow) | avx512 | avx2 | avx | baseline | reference (the same bits "
                   "on every x86-64, slower); also STRATA_GEMM")
        ->check(CLI::IsMember({"auto", "avx512", "avx2", "avx", "baseline", "reference"}))
        ->group(kDataGroup);
  }

  void add_steps_and_shared_flags(CLI::App& cmd) {
    cmd.add_option("--steps", steps_,
                   "Optimizer steps to run (default 100; scheduler.params.total_num_steps "
                   "when the config leaves it 0); 0 with --init and --export converts")
        ->group(kBatchGroup);

    flags_.add_to(cmd, /*with_plan_names=*/false);
    // The shared flags, grouped, each with its default and the DeepSpeed key it overrides.
    struct Placement {
      const char* name;
      const char* group;
      const char* description;
    };
    const Placement placements[] = {
        {"--config", kDataGroup,
         "DeepSpeed JSON config; a \"strata\" block holds strata's own keys (default: none)"},
        {"--micro-batch", kBatchGroup,
         "Sequences per micro-batch per rank (train_micro_batch_size_per_gpu; default 1)"},
        {"--grad-accum", kBatchGroup,
         "Micro-batches per step (gradient_accumulation_steps; default: derived, else 1)"},
        {"--global-batch", kBatchGroup,
         "Sequences per step over all ranks (train_batch_size; default: derived)"},
        {"--world-size", kBatchGroup,
         "Ranks, as threads of this process (sharing one GPU on the CUDA backend; "
         "strata.world_size; default 1)"},
        {"--seq-len", kBatchGroup,
         "Tokens per sequence (strata.seq_len; default min(2048, model maximum))"},
        {"--precision", kBatchGroup,
         "fp32 | bf16 | fp16 (bf16.enabled / fp16.enabled; default fp32)"},
        {"--lr", kBatchGroup,
         "Learning rate (optimizer.params.lr and scheduler.params.warmup_max_lr; default 1e-3)"},
        {"--lr-schedule", kBatchGroup,
         "constant | warmup | linear | cosine: DeepSpeed's WarmupLR, WarmupDecayLR or "
         "WarmupCosineLR, peaking at --lr, decaying over --steps (scheduler.type; default "
         "constant)"},
        {"--warmup-steps", kBatchGroup,
         "Warm-up steps, >= 1; it lasts max(2, N) (scheduler.params.warmup_num_steps; default "
         "1000)"},
        {"--warmup-type", kBatchGroup,
         "log | linear rise of the warm-up (scheduler.params.warmup_type; default log)"},
        {"--min-lr-ratio", kBatchGroup,
         "Where linear or cosine decay ends, as a fraction of --lr in [0, 1]; linear also warms "
         "up from it (cos_min_ratio, or warmup_min_lr / warmup_max_lr; default 1e-4 cosine, 0 "
         "linear)"},
        {"--zero-stage", kZeroGroup, "ZeRO stage 0-3 (zero_optimization.stage; default 0)"},
        {"--offload-param", kZeroGroup,
         "Home of the parameters: none | cpu | nvme, stage 3 only "
         "(zero_optimization.offload_param.device; default none)"},
        {"--offload-optimizer", kZeroGroup,
         "Home of fp32 master, Adam m and v: none | cpu | nvme "
         "(zero_optimization.offload_optimizer.device; default none)"},
        {"--nvme-path", kZeroGroup,
         "Swap directory, created if missing; repeat to stripe (strata.nvme_paths, "
         "offload_*.nvme_path; default ./strata-swap when something is on NVMe)"},
        {"--optimizer-state-dtype", kZeroGroup,
         "Adam m and v: fp32 (exact) | bf16 | int8 (strata.optimizer_state_dtype; default fp32)"},
        {"--gradient-home", kZeroGroup,
         "Gradient accumulator with the optimizer offloaded: auto | host | host_bf16 | nvme "
         "(strata.gradient_home; default auto: host fp32 if it fits, else NVMe fp32)"},
        {"--schedule", kZeroGroup,
         "Order of a step with --grad-accum: auto | micro_batch | layer (strata.schedule; "
         "default auto: the one moving fewer bytes over the slowest link)"},
        {"--activation-home", kZeroGroup,
         "Where the layer-major order keeps activation checkpoints: auto | device | host | nvme "
         "(strata.activation_home; default auto: the first that fits)"},
        {"--aio-block-size", kIoGroup,
         "Bytes per NVMe request, e.g. 1M (aio.block_size; default 1M)"},
        {"--aio-queue-depth", kIoGroup,
         "Requests in flight per I/O thread (aio.queue_depth; default 8)"},
        {"--aio-threads", kIoGroup, "I/O threads per path (aio.intra_op_parallelism; default 1)"},
        {"--device-mem-limit", kMemoryGroup,
         "Device memory per rank, e.g. 24G; host memory stands in on the CPU backend "
         "(strata.device_mem_limit; default: the plan's peak + 25% + 64M)"},
        {"--host-mem-limit", kMemoryGroup,
         "Pinned host memory for the node, e.g. 64G (strata.host_mem_limit; default: the plan's "
         "peak + 25% + 64M per rank)"},
    };
    for (const Placement& p : placements) {
      CLI::Option* option = cmd.get_option_no_throw(p.name);
      if (option == nullptr) continue;
      option->group(p.group);
      option->description(p.description);
    }
  }

  void add_output_and_checkpoint_options(CLI::App& cmd) {
    cmd.add_option("--metrics", metrics_path_, "Write one JSON object per step to this .jsonl file")
        ->group(kOutputGroup);
    cmd.add_option("--trace", trace_path_,
                   "Write a Chrome/Perfetto trace of every plan operation on its lane (open in "
                   "ui.perfetto.dev)")
        ->group(kOutputGroup);
    cmd.add_option(
           "--export", export_path_,
           "Write the final weights with Hugging Face names: FILE.safetensors, or a directory "
           "(config.json + model.safetensors)")
        ->group(kOutputGroup);
    cmd.add_option("--export-dtype", export_dtype_, "fp32 | bf16 | fp16 (default fp32)")
        ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
        ->group(kOutputGroup);
    cmd.add_option("--save", save_dir_,
                   "Write checkpoints into this directory (step-N, atomically; also at the end and "
                   "on Ctrl-C / SIGTERM)")
        ->group(kCheckpointGroup);
    cmd.add_option("--save-every", save_every_, "Save every N steps (default 0: only at the end)")
        ->group(kCheckpointGroup);
    cmd.add_option("--keep", keep_, "Keep the newest N checkpoints (default 0: all)")
        ->group(kCheckpointGroup);
    cmd.add_option(
           "--resume", resume_,
           "Resume from a checkpoint directory, or the newest one under a --save directory; "
           "--steps is then the step to reach. World size, stage and offload may differ")
        ->group(kCheckpointGroup);
    cmd.add_flag("--print-config", print_config_,
                 "Print the merged effective configuration as JSON and exit")
        ->group(kOutputGroup);
    cmd.add_flag("--print-plan", print_plan_,
                 "Print the training plan (operations, lanes, buffers per tier) and exit")
        ->group(kOutputGroup);
  }

  // The run as its steps; the first failure ends it. Every input but the
  // --trace file (which needs the engine's plan) is checked before the engine
  // allocates anything, so a usage error costs nothing.
  std::optional<Failure> train() {
    TrainingRun run;
    if (std::optional<Failure> f = choose_cpu_kernels()) return f;
    if (std::optional<Failure> f = join_launched_processes(run)) return f;
    if (std::optional<Failure> f = load_config_and_model(run)) return f;
    if (print_config_) {
      print_effective_config(run);
      return std::nullopt;
    }
    if (std::optional<Failure> f = build_plan(run)) return f;
    if (print_plan_) {
      print_training_plan(run);
      return std::nullopt;
    }
    if (std::optional<Failure> f = open_data(run)) return f;
    if (std::optional<Failure> f = prepare_nvme_paths(run)) return f;
    if (std::optional<Failure> f = check_outputs(run)) return f;
    if (std::optional<Failure> f = choose_memory_budgets(run)) return f;
    if (std::optional<Failure> f = fill_engine_options(run)) return f;
    if (std::optional<Failure> f = connect_processes(run)) return f;
    split_blas_threads(run);
    print_run_header(run);
    if (std::optional<Failure> f = create_engine(run)) return f;
    if (std::optional<Failure> f = train_steps(run)) return f;
    if (std::optional<Failure> f = finish_run(run)) return f;
    return export_weights(run);
  }

  // One of several launched processes: the world size is the launcher's, and
  // only rank 0 prints.
  std::optional<Failure> join_launched_processes(TrainingRun& run) {
    run.overrides = flags_.overrides;
    if (Result<comm::LaunchEnvironment> env = comm::launch_environment();
        env && env->world_size > 1) {
      run.launch = *env;
      if (run.overrides.world_size && *run.overrides.world_size != run.launch->world_size)
        return Failure{
            2, fmt::format("--world-size {} but launched as {} processes ({}); give the "
                           "same number or leave --world-size out",
                           *run.overrides.world_size, run.launch->world_size, run.launch->source)};
      run.overrides.world_size = run.launch->world_size;
      // The others' output would repeat rank 0's: they keep stderr only.
      if (run.launch->rank != 0 && std::freopen("/dev/null", "w", stdout) == nullptr)
        return Failure{1, "cannot silence the output of a rank other than 0"};
    } else if (!env && std::getenv("WORLD_SIZE") != nullptr) {
      return usage_error(env.status());
    }
    run.rank0 = !run.launch || run.launch->rank == 0;
    return std::nullopt;
  }

  // The --config file merged with the flags, and the --model when given.
  std::optional<Failure> load_config_and_model(TrainingRun& run) {
    Result<TrainConfig> loaded = load_train_config(flags_.config_path, run.overrides);
    if (!loaded && loaded.status().is(StatusCode::not_found) && run.overrides.nvme_paths.empty()) {
      // NVMe offload without a directory: swap under the current directory.
      // Anything else not found (the --config file) is not found again, and
      // the first error is the one reported.
      ConfigOverrides with_default = run.overrides;
      with_default.nvme_paths = {kDefaultNvmePath};
      Result<TrainConfig> defaulted = load_train_config(flags_.config_path, with_default);
      if (defaulted)
        fmt::print(stderr, "strata: no --nvme-path given; swapping to ./{}\n", kDefaultNvmePath);
      if (defaulted || !defaulted.status().is(StatusCode::not_found)) loaded = std::move(defaulted);
    }
    if (!loaded) return usage_error(loaded.status());
    run.config = *loaded;
    // The shuffle's seed defaults to the run's; written into the config, it
    // shows in --print-config and in the checkpoints' train.json.
    if (run.config.strata.shuffle && !run.config.strata.shuffle_seed)
      run.config.strata.shuffle_seed = seed_;
    print_config_warnings(run.config);
    if (!model_.empty()) {
      Result<ModelConfig> loaded_model = load_model_config(model_);
      if (!loaded_model) return usage_error(loaded_model.status());
      run.model = *loaded_model;
    }
    return std::nullopt;
  }

  void print_effective_config(const TrainingRun& run) {
    nlohmann::ordered_json effective = train_config_to_json(run.config);
    if (run.model) {
      effective["strata"]["model"] = run.model->name;
      effective["strata"]["parameters"] = run.model->parameter_count();
    }
    fmt::print("{}\n", effective.dump(2));
  }

  // A decaying schedule chosen on the command line runs over --steps: there
  // must be steps, and more of them than the warm-up takes.
  std::optional<Failure> check_lr_schedule_steps(const TrainingRun& run) const {
    const ConfigOverrides& o = flags_.overrides;
    const SchedulerConfig& s = run.config.scheduler;
    if (!(o.lr_schedule || o.warmup_steps || o.min_lr_ratio) ||
        (s.type != "WarmupDecayLR" && s.type != "WarmupCosineLR"))
      return std::nullopt;
    const char* name = s.type == "WarmupDecayLR" ? "linear" : "cosine";
    if (s.total_num_steps > 0) return std::nullopt;  // the file says over how many steps
    if (steps_ == 0)
      return Failure{2, fmt::format("--lr-schedule {} decays over --steps, and --steps 0 runs no "
                                    "step; give --steps N, or leave the schedule out to convert",
                                    name)};
    if (s.warmup_num_steps >= steps_)
      return Failure{
          2, fmt::format("--lr-schedule {}: the warm-up of {} steps{} leaves no step of "
                         "--steps {} to decay over; give --warmup-steps below {}",
                         name, s.warmup_num_steps, o.warmup_steps ? "" : " (DeepSpeed's default)",
                         steps_, steps_)};
    return std::nullopt;
  }

  // The plan of one step for the model, the config and the backend: built
  // here, once, and run by the engine.
  std::optional<Failure> build_plan(TrainingRun& run) {
    if (!run.model)
      return Failure{
          2, "--model PRESET|config.json|DIR is required (presets: tiny, small, llama3.2-1b, ...)"};
    if (steps_ < 0) return Failure{2, fmt::format("--steps must be 0 or more, got {}", steps_)};
    if (std::optional<Failure> f = check_lr_schedule_steps(run)) return f;

    // The backend decides where the plan puts the compute buffers.
    Result<BackendChoice> backend = choose_backend(backend_);
    if (!backend) return usage_error(backend.status());
    run.backend = *backend;
    const bool gpu = run.backend.kind == kernels::BackendKind::cuda;
    const int W = run.config.world_size;
    // Launched processes hold one rank each and share the node's host budget.
    run.local_ranks = run.launch ? 1 : W;
    run.ranks_on_node = run.launch ? run.launch->local_world_size.value_or(W) : W;
    // Launched on GPUs, each process talks to the others through NCCL (connect_processes).
    const PlanInput input =
        plan_input_from_config(run.config, *run.model, {gpu, gpu && run.launch, run.ranks_on_node});
    Result<TrainingPlan> plan = plan_training(input, &run.schedule_reason);
    if (!plan) return usage_error(plan.status());
    run.plan = std::move(*plan);
    return std::nullopt;
  }

  void print_training_plan(const TrainingRun& run) {
    std::string text = format_training_plan(*run.plan);
    if (!text.empty() && text.back() != '\n') text += '\n';
    fmt::print("{}", text);
  }

  // The token file, its loss mask and the eval file, before anything is allocated.
  std::optional<Failure> open_data(TrainingRun& run) {
    const int64_t T = run.plan->input.seq_len;
    if (data_path_.empty())
      return Failure{2,
                     "--data FILE is required: a token file (nanoGPT .bin, llm.c shard or uint32); "
                     "`strata demo-data --out DIR` writes one"};
    Result<TokenFormat> format = parse_token_format(data_format_);
    if (!format) return usage_error(format.status().with_context("--data-format"));
    run.data = std::make_shared<TrainData>();
    Result<TokenFile> file = TokenFile::open(data_path_, *format);
    if (!file) return usage_error(file.status().with_context("--data"));
    run.data->file = std::move(*file);
    run.data->vocab = run.model->vocab_size;
    run.data->order = SequenceOrder::from_config(run.config.strata, seed_);
    if (run.data->order.is_shuffled()) run.data->file.expect_random_access();
    if (run.data->file.sequence_count(T) < 1)
      return Failure{
          2, fmt::format("--data {}: {} tokens, fewer than one sequence of --seq-len {} plus one",
                         data_path_, run.data->file.size(), T)};
    // Without --loss-mask, the mask prepare-data writes next to the token file
    // (train.bin -> train.mask) is used when it is there; --loss-mask none turns that off.
    std::string mask_path = loss_mask_path_;
    if (mask_path.empty()) {
      std::error_code error;
      if (fs::is_regular_file(loss_mask_path(data_path_), error)) {
        mask_path = loss_mask_path(data_path_);
        run.data->mask_source = "found next to --data";
      }
    } else if (mask_path == "none") {
      mask_path.clear();
    } else {
      run.data->mask_source = "--loss-mask";
    }
    if (!mask_path.empty()) {
      Result<std::vector<uint8_t>> mask = read_loss_mask(mask_path, run.data->file.size());
      if (!mask) return usage_error(mask.status());
      run.data->mask = std::move(*mask);
      run.data->mask_path = mask_path;
    }
    return open_eval_data(run, *format);
  }

  std::optional<Failure> open_eval_data(TrainingRun& run, TokenFormat format) {
    if (eval_path_.empty()) {
      if (eval_every_ > 0) return Failure{2, "--eval-every needs --eval-data FILE"};
      return std::nullopt;
    }
    const int64_t T = run.plan->input.seq_len;
    Result<TokenFile> file = TokenFile::open(eval_path_, format);
    if (!file) return usage_error(file.status().with_context("--eval-data"));
    if (file->sequence_count(T) < 1)
      return Failure{2,
                     fmt::format("--eval-data {}: fewer than one sequence of --seq-len {} plus one",
                                 eval_path_, T)};
    run.eval_file.emplace(std::move(*file));
    // The mask next to the eval file (val.bin -> val.mask), unless --loss-mask none.
    std::error_code error;
    if (loss_mask_path_ != "none" && fs::is_regular_file(loss_mask_path(eval_path_), error)) {
      Result<std::vector<uint8_t>> mask =
          read_loss_mask(loss_mask_path(eval_path_), run.eval_file->size(), "--eval-data's mask");
      if (!mask) return usage_error(mask.status());
      run.eval_mask = std::move(*mask);
    }
    if (eval_batches_ < 1) return Failure{2, "--eval-batches must be at least 1"};
    return std::nullopt;
  }

  // NVMe: the configured directories, else ./strata-swap; created if missing.
  std::optional<Failure> prepare_nvme_paths(TrainingRun& run) {
    run.nvme_paths = run.config.effective_nvme_paths();
    if (run.plan->peak(tiers::Tier::nvme) <= 0) return std::nullopt;
    if (run.nvme_paths.empty()) run.nvme_paths = {kDefaultNvmePath};
    for (const std::string& path : run.nvme_paths) {
      std::error_code error;
      fs::create_directories(path, error);
      if (error || !fs::is_directory(path, error))
        return Failure{
            2, fmt::format(
                   "--nvme-path {}: cannot create the directory: {}; give a writable directory",
                   path, error ? error.message() : std::string("not a directory"))};
      if (access(path.c_str(), W_OK | X_OK) != 0)
        return Failure{2, fmt::format("--nvme-path {}: not writable: {}; give a writable directory",
                                      path, std::strerror(errno))};
    }
    return std::nullopt;
  }

  // Output files, checked or opened before training so a bad path costs nothing.
  std::optional<Failure> check_outputs(TrainingRun& run) {
    if (!export_path_.empty()) {
      const fs::path parent = fs::absolute(export_path_).parent_path();
      if (!fs::is_directory(parent))
        return Failure{2, fmt::format("--export {}: the directory {} does not exist", export_path_,
                                      parent.string())};
    }
    Result<DType> export_dtype = parse_dtype(export_dtype_);
    if (!export_dtype) return usage_error(export_dtype.status().with_context("--export-dtype"));
    run.export_dtype = *export_dtype;
    if (!metrics_path_.empty() && run.rank0) {
      Result<MetricsWriter> opened = MetricsWriter::open(metrics_path_);
      if (!opened) return usage_error(opened.status());
      run.metrics.emplace(std::move(*opened));
    }
    return std::nullopt;
  }

  // The device and host budgets, and a refusal when ranks that are threads
  // would need more of their shared GPU than it has.
  std::optional<Failure> choose_memory_budgets(TrainingRun& run) {
    run.budgets = choose_budgets(run.config, *run.plan, run.ranks_on_node, run.local_ranks);
    run.options.budgets = run.budgets.budgets;
    const int64_t device = *run.budgets.budgets.device_per_rank;
    if (run.backend.kind == kernels::BackendKind::cuda && run.local_ranks > 1) {
      // Ranks that are threads of this process share its GPU.
      const kernels::GpuQuery gpus = kernels::query_gpus();
      if (!gpus.devices.empty() &&
          uint64_t(run.local_ranks) * uint64_t(device) > gpus.devices[0].total_bytes)
        return usage_error(Status::error(fmt::format(
            "{} ranks as threads share GPU 0 and need {} x {} of its {}; launch one process per "
            "GPU (`strata launch -n {} -- strata train ...`) or lower --device-mem-limit",
            run.local_ranks, run.local_ranks, format_bytes(double(device)),
            format_bytes(double(gpus.devices[0].total_bytes)), run.local_ranks)));
    }
    if (run.plan->peak(tiers::Tier::nvme) > 0)
      run.budgets.note += fmt::format(", nvme {} per rank under {}",
                                      format_bytes(double(run.plan->peak(tiers::Tier::nvme))),
                                      fmt::join(run.nvme_paths, ", "));
    return std::nullopt;
  }

  // What the engine starts from (--resume, --init or --seed) and what it reads.
  std::optional<Failure> fill_engine_options(TrainingRun& run) {
    EngineOptions& options = run.options;
    options.model = *run.model;
    options.config = run.config;
    options.total_steps = std::max<int64_t>(1, steps_);
    options.nvme_paths = run.nvme_paths;
    options.seed = seed_;
    options.init_checkpoint = init_path_;
    if (!resume_.empty()) {
      if (!init_path_.empty())
        return usage_error(
            Status::error("give --init or --resume, not both (a checkpoint holds the weights)"));
      Result<std::string> found = find_latest_checkpoint(resume_);
      if (!found) return usage_error(found.status().with_context("--resume"));
      if (found->empty())
        return usage_error(Status::error(fmt::format(
            "--resume {}: no checkpoint in this directory (no step-N with a manifest.json)",
            resume_)));
      options.resume_from = *found;
    }
    options.data = batch_reader(run.data);
    return std::nullopt;
  }

  // The backend, and when launched this rank's link to the others: NCCL on
  // GPUs (GPU LOCAL_RANK), sockets on the CPU.
  std::optional<Failure> connect_processes(TrainingRun& run) {
    run.options.backend = run.backend.kind;
    if (!run.launch) return std::nullopt;
    if (run.backend.kind == kernels::BackendKind::cuda) {
      run.options.gpu_index = run.launch->local_rank;
      Result<std::unique_ptr<comm::NcclComm>> nccl =
          comm::make_nccl_comm(*run.launch, run.launch->local_rank);
      if (!nccl) return run_error(nccl.status());
      run.options.process_comm = std::move(*nccl);
    } else {
      Result<std::unique_ptr<comm::Communicator>> sockets = comm::make_socket_comm(*run.launch);
      if (!sockets) return run_error(sockets.status());
      run.options.process_comm = std::move(*sockets);
    }
    return std::nullopt;
  }

  // --gemm, else STRATA_GEMM, before the first product loads OpenBLAS.
  std::optional<Failure> choose_cpu_kernels() {
    Status chosen = gemm_ == "auto"
                        ? kernels::cpu::select_gemm_kernel_from_environment()
                        : kernels::cpu::select_gemm_kernel(*kernels::cpu::parse_gemm_kernel(gemm_));
    if (!chosen.is_ok()) return usage_error(chosen);
    return std::nullopt;
  }

  // Ranks are threads that each call OpenBLAS: split the cores between them
  // rather than letting every rank's BLAS use them all.
  void split_blas_threads(const TrainingRun& run) {
    if (run.ranks_on_node <= 1) return;
    const int cores = std::max(1, int(std::thread::hardware_concurrency()));
    kernels::cpu::set_blas_threads(std::max(1, cores / run.ranks_on_node));
  }

  // The backend's notice, then what will run: model, batch, budgets.
  void print_run_header(TrainingRun& run) {
    // The notice only now, so that the input errors before stay one line without it.
    if (!run.backend.notice.empty()) fmt::print(stderr, "{}\n", run.backend.notice);
    const TrainingPlan& plan = *run.plan;
    const ModelConfig& model = *run.model;
    const int W = plan.input.world_size;
    const int64_t T = plan.input.seq_len, B = plan.input.micro_batch;
    run.tokens_per_step = B * T * plan.input.grad_accum * W;
    fmt::print(
        "{}: {} parameters, {} units; stage {}, params on {}, optimizer on {}; {} rank{} on the "
        "{}\n",
        model.name, format_count(double(model.parameter_count())), plan.layout.units.size(),
        plan.input.stage, tiers::tier_name(plan.homes.param),
        tiers::tier_name(plan.homes.optimizer), W, W == 1 ? "" : "s",
        std::string(plan.input.gpu ? "GPU" : "CPU") +
            (run.launch ? fmt::format(", one process each ({})", run.launch->source) : ""));
    if (!plan.input.gpu) fmt::print("cpu kernels: {}\n", kernels::cpu::describe_cpu_kernels());
    fmt::print(
        "batch: {} x {} sequences of {} tokens x {} micro-batches = {} tokens per step; {} {}\n", W,
        B, T, plan.input.grad_accum, run.tokens_per_step, precision_name(run.config.precision),
        !resume_.empty()     ? "resuming " + run.options.resume_from
        : init_path_.empty() ? fmt::format("random init (seed {})", seed_)
                             : "from " + init_path_);
    if (run.data->order.is_shuffled())
      fmt::print("data: {} sequences, {}, a new order every pass\n",
                 run.data->file.sequence_count(T), run.data->order.describe());
    if (!run.data->mask.empty()) {
      const auto kept = std::count_if(run.data->mask.begin(), run.data->mask.end(),
                                      [](uint8_t byte) { return byte != 0; });
      fmt::print("loss mask: {} ({}): {:.1f}% of the tokens are targets; the others do not count\n",
                 run.data->mask_path, run.data->mask_source,
                 100.0 * double(kept) / double(run.data->mask.size()));
    }
    if (!run.eval_mask.empty())
      fmt::print("eval loss mask: {} (found next to --eval-data)\n", loss_mask_path(eval_path_));
    if (plan.input.grad_accum > 1) fmt::print("schedule: {}\n", run.schedule_reason);
    fmt::print("budgets: {}\n", run.budgets.note);
    std::fflush(stdout);
  }

  // The engine, and the trace of its plan.
  std::optional<Failure> create_engine(TrainingRun& run) {
    run.options.plan = *run.plan;  // the plan built once, in build_plan
    Result<std::unique_ptr<Engine>> created = Engine::create(std::move(run.options));
    if (!created) return run_error(created.status());
    run.engine = std::move(*created);
    if (!trace_path_.empty() && run.rank0) {
      Result<TraceWriter> opened = TraceWriter::open(trace_path_, run.engine->plan());
      if (!opened) return usage_error(opened.status());
      run.trace.emplace(std::move(*opened));
    }
    return std::nullopt;
  }

  // The steps up to --steps, each reported, evaluated and saved as asked;
  // Ctrl-C or SIGTERM ends the loop after the step under way.
  std::optional<Failure> train_steps(TrainingRun& run) {
    Engine& engine = *run.engine;
    stop_requested.store(false);
    std::signal(SIGINT, request_stop);
    std::signal(SIGTERM, request_stop);
    if (engine.steps_done() >= steps_)
      fmt::print("the checkpoint is at step {}, which reaches --steps {}; nothing to train\n",
                 engine.steps_done(), steps_);
    progress_.emplace(steps_, run.config.steps_per_print);
    run.summary.world = run.plan->input.world_size;
    const bool fp16 = run.config.precision == Precision::fp16;
    run.start = Clock::now();
    (void)engine.take_timings();  // initialisation is not part of the trace

    for (int64_t s = engine.steps_done() + 1; s <= steps_; ++s) {
      Result<StepResult> step = engine.step();
      if (!step) {
        (void)drain_timings(run);
        if (run.trace) (void)run.trace->finish();
        return run_error(step.status());
      }
      StepReport report = account_step(run.summary, s, *step, run.tokens_per_step, fp16);
      // Every process stops after the same step (a signal may reach them at different times).
      Result<bool> stop = engine.any_rank(stop_requested.load());
      if (!stop) return run_error(stop.status());
      const bool last = s == steps_ || *stop;
      progress_->step(report, seconds_since(run.start));
      if (run.eval_file && (last || (eval_every_ > 0 && s % eval_every_ == 0))) {
        const int64_t T = run.plan->input.seq_len, B = run.plan->input.micro_batch;
        Result<EvalResult> eval =
            evaluate(engine, *run.eval_file, run.eval_mask, eval_batches_, B, T);
        if (!eval) return run_error(eval.status());
        progress_->eval(s, eval->loss, eval->tokens);
        report.eval_loss = eval->loss;
      }
      if (run.metrics)
        if (Status w = run.metrics->write(report); !w) return run_error(w);
      if (std::optional<Failure> f = drain_timings(run)) return f;
      if (save_every_ > 0 && s % save_every_ == 0)
        if (std::optional<Failure> f = save_checkpoint(run, s)) return f;
      if (last) break;
    }
    return std::nullopt;
  }

  // The operations' timings since the last call, into the summary and the trace.
  std::optional<Failure> drain_timings(TrainingRun& run) {
    std::vector<OpTiming> timings = run.engine->take_timings();
    run.summary.lanes.add(run.engine->plan(), timings);
    if (run.trace)
      if (Status s = run.trace->write(timings); !s) return run_error(s);
    return std::nullopt;
  }

  // With --save, a checkpoint of `step` unless one was written at it already.
  std::optional<Failure> save_checkpoint(TrainingRun& run, int64_t step) {
    if (save_dir_.empty() || run.saved_at == step) return std::nullopt;
    Result<std::string> saved = run.engine->save_checkpoint(save_dir_, keep_);
    if (!saved) return run_error(saved.status());
    run.saved_at = step;
    if (progress_) progress_->line(fmt::format("saved checkpoint {}", *saved));
    return std::nullopt;
  }

  // After the last step, or the one a signal stopped at: the engine's end,
  // the final checkpoint, the end of the trace, and the summary.
  std::optional<Failure> finish_run(TrainingRun& run) {
    Engine& engine = *run.engine;
    if (Status s = engine.finish(); !s) return run_error(s);
    // The last step's updates ran on after it returned: their bytes count too
    // (taken before the checkpoint reads the state back).
    const auto [read, written] = engine.take_nvme_bytes();
    run.summary.nvme_read += read;
    run.summary.nvme_written += written;
    if (std::optional<Failure> f = save_checkpoint(run, engine.steps_done())) return f;
    run.summary.seconds = seconds_since(run.start);
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    if (std::optional<Failure> f = drain_timings(run)) return f;
    if (run.trace)
      if (Status s = run.trace->finish(); !s) return run_error(s);
    RunSummary& summary = run.summary;
    for (int t = 0; t < tiers::kTierCount; ++t)
      for (int r = 0; r < engine.local_rank_count(); ++r) {
        const tiers::TierUsage u = engine.rank_usage(r, static_cast<tiers::Tier>(t));
        if (r == 0 || u.peak > summary.usage[t].peak) summary.usage[t] = u;
      }
    const PlanBudgets& budgets = run.budgets.budgets;
    summary.budget[int(tiers::Tier::device)] = uint64_t(*budgets.device_per_rank);
    summary.budget[int(tiers::Tier::host)] =
        uint64_t(*budgets.host_per_rank(run.plan->input.world_size));
    summary.budget[int(tiers::Tier::nvme)] = summary.usage[int(tiers::Tier::nvme)].capacity;
    progress_->end();
    if (stop_requested.load())
      fmt::print(
          "stopped by {} after step {}{}\n", stop_name(), engine.steps_done(),
          save_dir_.empty() ? "" : "; the checkpoint above resumes it with --resume " + save_dir_);
    fmt::print("{}", format_run_summary(summary));
    return std::nullopt;
  }

  // --export (rank 0 writes what every rank reads), then where the outputs are.
  std::optional<Failure> export_weights(TrainingRun& run) {
    if (!export_path_.empty()) {
      Result<HostModel> weights = run.engine->read_model();  // every rank takes part
      if (!weights) return run_error(weights.status());
      if (!run.rank0) return std::nullopt;
      if (Status s = export_model(*weights, export_path_, run.export_dtype); !s)
        return run_error(s.with_context("--export " + export_path_));
      fmt::print("exported the weights ({}) to {}\n", dtype_name(run.export_dtype), export_path_);
    }
    if (!metrics_path_.empty()) fmt::print("metrics: {}\n", metrics_path_);
    if (!trace_path_.empty())
      fmt::print("trace: {} (open in https://ui.perfetto.dev)\n", trace_path_);
    return std::nullopt;
  }

  std::string model_;
  ConfigFlags flags_;
  std::string backend_ = "auto";
  std::string gemm_ = "auto";
  std::string data_path_;
  std::string data_format_ = "auto";
  std::string loss_mask_path_;
  std::string eval_path_;
  int64_t eval_every_ = 0;
  int64_t eval_batches_ = 8;
  std::string init_path_;
  uint64_t seed_ = 1234;
  int64_t steps_ = 100;
  std::string metrics_path_;
  std::string trace_path_;
  std::string export_path_;
  std::string export_dtype_ = "fp32";
  std::string save_dir_;
  int64_t save_every_ = 0;
  int keep_ = 0;
  std::string resume_;
  bool print_config_ = false;
  bool print_plan_ = false;
  std::optional<ProgressPrinter> progress_;
};

SubcommandRegistration registration([] { return std::make_unique<TrainCommand>(); });

}  // namespace
}  // namespace strata::tools
