// `strata train`: trains a model on a token file with the engine (core/engine/engine.h),
// and shows what it does: progress on the terminal, --metrics per step (the
// same values to the TensorBoard and CSV monitors), --trace of every plan
// operation, a summary at the end, --export of the final weights. This file
// is the run as its steps; the flags are tools/train_flags.h, the pieces a
// run builds tools/train_run.h, what it shows tools/train_report.h.
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
#include "comm/gloo_comm.h"
#include "comm/nccl_comm.h"
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
#include "tools/hardware_probe.h"
#include "tools/subcommand.h"
#include "tools/train_flags.h"
#include "tools/train_report.h"
#include "tools/train_run.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;

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

class TrainCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand("train", "Train a model on a token file");
    cmd->footer(
        "Flags override the --config file (DeepSpeed JSON); --print-config shows the merged "
        "result.\n"
        "Sizes: 512M, 16G (powers of 1024), 16GB (powers of 1000). Ctrl-C stops after the current "
        "step.");
    add_train_flags(*cmd, f_);
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
  // The run as its steps; the first failure ends it. Every input but the
  // --trace file (which needs the engine's plan) is checked before the engine
  // allocates anything, so a usage error costs nothing.
  std::optional<Failure> train() {
    TrainingRun run;
    if (std::optional<Failure> f = choose_cpu_kernels()) return f;
    if (std::optional<Failure> f = join_launched_processes(run)) return f;
    if (std::optional<Failure> f = load_config_and_model(run)) return f;
    if (f_.print_config) {
      print_effective_config(run);
      return std::nullopt;
    }
    if (std::optional<Failure> f = build_plan(run)) return f;
    if (f_.print_plan) {
      print_training_plan(run);
      return std::nullopt;
    }
    if (std::optional<Failure> f = open_data(run)) return f;
    if (std::optional<Failure> f = prepare_nvme_paths(run)) return f;
    if (std::optional<Failure> f = check_outputs(run)) return f;
    if (std::optional<Failure> f = choose_memory_budgets(run)) return f;
    if (std::optional<Failure> f = fill_engine_options(run)) return f;
    if (std::optional<Failure> f = connect_processes(run)) return f;
    // Before the ranks split the BLAS threads: the probe measures the whole machine.
    if (std::optional<Failure> f = predict_step_time(run)) return f;
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
    run.overrides = f_.config.overrides;
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
    Result<TrainConfig> loaded = load_train_config(f_.config.config_path, run.overrides);
    if (!loaded && loaded.status().is(StatusCode::not_found) && run.overrides.nvme_paths.empty()) {
      // NVMe offload without a directory: swap under the current directory.
      // Anything else not found (the --config file) is not found again, and
      // the first error is the one reported.
      ConfigOverrides with_default = run.overrides;
      with_default.nvme_paths = {kDefaultNvmePath};
      Result<TrainConfig> defaulted = load_train_config(f_.config.config_path, with_default);
      if (defaulted)
        fmt::print(stderr, "strata: no --nvme-path given; swapping to ./{}\n", kDefaultNvmePath);
      if (defaulted || !defaulted.status().is(StatusCode::not_found)) loaded = std::move(defaulted);
    }
    if (!loaded) return usage_error(loaded.status());
    run.config = *loaded;
    // The shuffle's seed defaults to the run's; written into the config, it
    // shows in --print-config and in the checkpoints' train.json.
    if (run.config.strata.shuffle && !run.config.strata.shuffle_seed)
      run.config.strata.shuffle_seed = f_.seed;
    print_config_warnings(run.config);
    if (!f_.model.empty()) {
      Result<ModelConfig> loaded_model = load_model_config(f_.model);
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
    const ConfigOverrides& o = f_.config.overrides;
    const SchedulerConfig& s = run.config.scheduler;
    if (!(o.lr_schedule || o.warmup_steps || o.min_lr_ratio) ||
        (s.type != "WarmupDecayLR" && s.type != "WarmupCosineLR"))
      return std::nullopt;
    const char* name = s.type == "WarmupDecayLR" ? "linear" : "cosine";
    if (s.total_num_steps > 0) return std::nullopt;  // the file says over how many steps
    if (f_.steps == 0)
      return Failure{2, fmt::format("--lr-schedule {} decays over --steps, and --steps 0 runs no "
                                    "step; give --steps N, or leave the schedule out to convert",
                                    name)};
    if (s.warmup_num_steps >= f_.steps)
      return Failure{
          2, fmt::format("--lr-schedule {}: the warm-up of {} steps{} leaves no step of "
                         "--steps {} to decay over; give --warmup-steps below {}",
                         name, s.warmup_num_steps, o.warmup_steps ? "" : " (DeepSpeed's default)",
                         f_.steps, f_.steps)};
    return std::nullopt;
  }

  // The plan of one step for the model, the config and the backend: built
  // here, once, and run by the engine.
  std::optional<Failure> build_plan(TrainingRun& run) {
    if (!run.model)
      return Failure{
          2, "--model PRESET|config.json|DIR is required (presets: tiny, small, llama3.2-1b, ...)"};
    if (f_.steps < 0) return Failure{2, fmt::format("--steps must be 0 or more, got {}", f_.steps)};
    if (std::optional<Failure> f = check_lr_schedule_steps(run)) return f;

    // The backend decides where the plan puts the compute buffers.
    Result<BackendChoice> backend = choose_backend(f_.backend);
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

  // The step-time model's prediction for this run: on --hardware's profile,
  // or (auto, the CPU backend) this machine's cached probe with the units
  // measured again at this run's shapes; the first run probes the machine and
  // caches it. One line says which, and the prediction.
  std::optional<Failure> predict_step_time(TrainingRun& run) {
    if (f_.hardware == "none" || !run.rank0) return std::nullopt;
    const bool gpu = run.backend.kind == kernels::BackendKind::cuda;
    std::optional<HardwareProfile> profile;
    std::string source;
    if (f_.hardware != "auto") {
      Result<HardwareProfile> loaded = load_hardware_profile(f_.hardware);
      if (!loaded) return usage_error(loaded.status().with_context("--hardware"));
      if (loaded->gpu != gpu)
        return Failure{2, fmt::format("--hardware {}: a {} profile for a run on the {} backend; "
                                      "give a {} one or --hardware none",
                                      f_.hardware, loaded->gpu ? "GPU" : "CPU",
                                      gpu ? "CUDA" : "CPU", gpu ? "GPU" : "CPU")};
      profile = std::move(*loaded);
      source = f_.hardware;
    } else if (run.launch) {
      return std::nullopt;  // launched ranks would probe at once
    } else if (gpu) {
      // A GPU is probed only when asked (strata plan --probe --backend cuda);
      // its cached probe, when there is one, predicts.
      const std::string path = cached_profile_path(true);
      if (!std::filesystem::exists(path)) return std::nullopt;
      Result<HardwareProfile> cached = read_hardware_profile(path);
      if (!cached || !cached->gpu) {
        fmt::print(stderr, "warning: step-time model: the cached GPU probe {} is unusable ({}); "
                           "no prediction (strata plan --probe --backend cuda measures again)\n",
                   path, cached ? "not a GPU profile" : cached.status().message());
        return std::nullopt;
      }
      profile = std::move(*cached);
      source = path;
    } else {
      // A probe never stops a run: when it fails, the run goes on unpredicted.
      auto skip = [](const Status& why) {
        fmt::print(stderr, "warning: step-time model: {}; no prediction for this run\n",
                   why.message());
        return std::nullopt;
      };
      const bool uses_nvme = run.plan->peak(tiers::Tier::nvme) > 0;
      ProbeOptions options;
      options.model = *run.model;
      options.micro_batch = run.plan->input.micro_batch;
      options.seq_len = run.plan->input.seq_len;
      if (uses_nvme) options.nvme_paths = run.nvme_paths;
      options.short_probe = true;
      // Half the run's own memory, so the probe does not set the run's peak.
      options.memory_bytes =
          (run.plan->peak(tiers::Tier::host) + run.plan->peak(tiers::Tier::device)) / 2;
      const std::string path = cached_profile_path();
      Result<HardwareProfile> cached = Status::not_found("no cached probe");
      if (std::filesystem::exists(path)) {
        cached = read_hardware_profile(path);
        // One an older strata wrote, or a damaged one, is measured again.
        if (!cached)
          fmt::print("step-time model: the cached probe is unusable ({}); probing again\n",
                     cached.status().message());
      }
      if (cached) {
        profile = std::move(*cached);
        source = path;
        bool changed = false;
        if (profile->unit_shapes != unit_shapes(options)) {  // measured at other shapes
          if (Status s = probe_units(options, *profile); !s) return skip(s);
          source += ", units measured now at this run's shapes";
          changed = true;
        }
        if (uses_nvme && profile->nvme.empty()) {  // the first run on NVMe measures it
          if (Status s = probe_nvme(options, *profile); !s) return skip(s);
          source += ", NVMe measured now";
          changed = true;
        }
        if (changed)
          if (Status s = write_profile(*profile, path); !s) return skip(s);
      } else {
        fmt::print("step-time model: probing this machine once (a few seconds), cached in {}\n",
                   path);
        Result<HardwareProfile> probed = probe_hardware(options);
        if (!probed) return skip(probed.status());
        if (Status s = write_profile(*probed, path); !s)
          fmt::print(stderr, "warning: {}; the probe is not kept\n", s.message());
        profile = std::move(*probed);
        source = path;
      }
    }
    // A mixture read as routed: an even routing's expected step, not the plan's worst case.
    run.prediction = predict_expected_step(*run.plan, *profile);
    run.profile = *profile;
    if (run.plan->routed_expert_fetch) source += ", an even routing's step";
    run.summary.predicted_seconds = run.prediction->steady_seconds;
    run.summary.predicted_first_seconds = run.prediction->cold_seconds;
    run.summary.predicted_by = profile->name;
    fmt::print(
        "step-time model ({}): predicted {:.1f} ms per step, {:.1f} ms the first; bound "
        "by the {} lane and the {}\n",
        source, 1e3 * run.prediction->steady_seconds, 1e3 * run.prediction->cold_seconds,
        lane_name(run.prediction->bound_lane), resource_name(run.prediction->bound_resource));
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
    if (f_.data_path.empty())
      return Failure{2,
                     "--data FILE is required: a token file (nanoGPT .bin, llm.c shard or uint32); "
                     "`strata demo-data --out DIR` writes one"};
    Result<TokenFormat> format = parse_token_format(f_.data_format);
    if (!format) return usage_error(format.status().with_context("--data-format"));
    run.data = std::make_shared<TrainData>();
    Result<TokenFile> file = TokenFile::open(f_.data_path, *format);
    if (!file) return usage_error(file.status().with_context("--data"));
    run.data->file = std::move(*file);
    run.data->vocab = run.model->vocab_size;
    run.data->order = SequenceOrder::from_config(run.config.strata, f_.seed);
    if (run.data->order.is_shuffled()) run.data->file.expect_random_access();
    if (run.data->file.sequence_count(T) < 1)
      return Failure{
          2, fmt::format("--data {}: {} tokens, fewer than one sequence of --seq-len {} plus one",
                         f_.data_path, run.data->file.size(), T)};
    // Without --loss-mask, the mask prepare-data writes next to the token file
    // (train.bin -> train.mask) is used when it is there; --loss-mask none turns that off.
    std::string mask_path = f_.loss_mask_path;
    if (mask_path.empty()) {
      std::error_code error;
      if (fs::is_regular_file(loss_mask_path(f_.data_path), error)) {
        mask_path = loss_mask_path(f_.data_path);
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
    if (f_.eval_path.empty()) {
      if (f_.eval_every > 0) return Failure{2, "--eval-every needs --eval-data FILE"};
      return std::nullopt;
    }
    const int64_t T = run.plan->input.seq_len;
    Result<TokenFile> file = TokenFile::open(f_.eval_path, format);
    if (!file) return usage_error(file.status().with_context("--eval-data"));
    if (file->sequence_count(T) < 1)
      return Failure{2,
                     fmt::format("--eval-data {}: fewer than one sequence of --seq-len {} plus one",
                                 f_.eval_path, T)};
    run.eval_file.emplace(std::move(*file));
    // The mask next to the eval file (val.bin -> val.mask), unless --loss-mask none.
    std::error_code error;
    if (f_.loss_mask_path != "none" && fs::is_regular_file(loss_mask_path(f_.eval_path), error)) {
      Result<std::vector<uint8_t>> mask =
          read_loss_mask(loss_mask_path(f_.eval_path), run.eval_file->size(), "--eval-data's mask");
      if (!mask) return usage_error(mask.status());
      run.eval_mask = std::move(*mask);
    }
    if (f_.eval_batches < 1) return Failure{2, "--eval-batches must be at least 1"};
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
                                      path, errno_text(errno))};
    }
    return std::nullopt;
  }

  // Output files, checked or opened before training so a bad path costs nothing.
  std::optional<Failure> check_outputs(TrainingRun& run) {
    if (!f_.export_path.empty()) {
      const fs::path parent = fs::absolute(f_.export_path).parent_path();
      if (!fs::is_directory(parent))
        return Failure{2, fmt::format("--export {}: the directory {} does not exist",
                                      f_.export_path, parent.string())};
    }
    Result<DType> export_dtype = parse_dtype(f_.export_dtype);
    if (!export_dtype) return usage_error(export_dtype.status().with_context("--export-dtype"));
    run.export_dtype = *export_dtype;
    if (!f_.metrics_path.empty() && run.rank0) {
      Result<MetricsWriter> opened = MetricsWriter::open(f_.metrics_path, *run.plan);
      if (!opened) return usage_error(opened.status());
      run.metrics.emplace(std::move(*opened));
    }
    return run.rank0 ? open_monitors(run) : std::nullopt;
  }

  // The config's monitors that write files (DeepSpeed's tensorboard and
  // csv_monitor blocks; --tensorboard), their directories made now.
  std::optional<Failure> open_monitors(TrainingRun& run) {
    const std::string& file = f_.config.config_path;
    if (run.config.tensorboard.enabled) {
      const std::string where =
          run.overrides.tensorboard_dir ? "--tensorboard" : file + ": tensorboard";
      Result<TensorBoardWriter> opened =
          TensorBoardWriter::open(run.config.tensorboard.directory(), wall_clock_seconds());
      if (!opened) return usage_error(opened.status().with_context(where));
      run.tensorboard.emplace(std::move(*opened));
    }
    if (run.config.csv_monitor.enabled) {
      Result<CsvMonitorWriter> opened = CsvMonitorWriter::open(run.config.csv_monitor.directory());
      if (!opened) return usage_error(opened.status().with_context(file + ": csv_monitor"));
      run.csv_monitor.emplace(std::move(*opened));
    }
    return std::nullopt;
  }

  // The step's values to the monitors.
  std::optional<Failure> write_monitors(TrainingRun& run, const StepReport& report) {
    if (!run.tensorboard && !run.csv_monitor) return std::nullopt;
    const std::vector<ScalarEvent> events = monitor_events(report);
    if (run.tensorboard)
      if (Status s = run.tensorboard->write(events, wall_clock_seconds()); !s) return run_error(s);
    if (run.csv_monitor)
      if (Status s = run.csv_monitor->write(events); !s) return run_error(s);
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
    options.total_steps = std::max<int64_t>(1, f_.steps);
    options.nvme_paths = run.nvme_paths;
    options.seed = f_.seed;
    options.init_checkpoint = f_.init_path;
    if (!f_.resume.empty()) {
      if (!f_.init_path.empty())
        return usage_error(
            Status::error("give --init or --resume, not both (a checkpoint holds the weights)"));
      Result<std::string> found = find_latest_checkpoint(f_.resume);
      if (!found) return usage_error(found.status().with_context("--resume"));
      if (found->empty())
        return usage_error(Status::error(fmt::format(
            "--resume {}: no checkpoint in this directory (no step-N with a manifest.json)",
            f_.resume)));
      options.resume_from = *found;
    }
    options.data = batch_reader(run.data);
    return std::nullopt;
  }

  // The backend, and when launched this rank's link to the others: NCCL on
  // GPUs (GPU LOCAL_RANK), Gloo on the CPU.
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
      Result<std::unique_ptr<comm::Communicator>> gloo = comm::make_gloo_comm(*run.launch);
      if (!gloo) return run_error(gloo.status());
      run.options.process_comm = std::move(*gloo);
    }
    return std::nullopt;
  }

  // --gemm, else STRATA_GEMM, before the first product loads OpenBLAS.
  std::optional<Failure> choose_cpu_kernels() {
    Status chosen =
        f_.gemm == "auto"
            ? kernels::cpu::select_gemm_kernel_from_environment()
            : kernels::cpu::select_gemm_kernel(*kernels::cpu::parse_gemm_kernel(f_.gemm));
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
        !f_.resume.empty()     ? "resuming " + run.options.resume_from
        : f_.init_path.empty() ? fmt::format("random init (seed {})", f_.seed)
                               : "from " + f_.init_path);
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
      fmt::print("eval loss mask: {} (found next to --eval-data)\n", loss_mask_path(f_.eval_path));
    if (plan.input.grad_accum > 1 || plan.activation_home() != tiers::Tier::device)
      fmt::print("schedule: {}\n", run.schedule_reason);
    if (plan.input.model.vocab_chunks > 1 || !plan.input.vocab_chunks_reason.empty())
      fmt::print("vocabulary chunks: {}\n", vocabulary_chunks_line(plan.input));
    if (plan.input.model.layer_pieces > 1 || !plan.input.layer_pieces_reason.empty())
      fmt::print("layer pieces: {}\n", layer_pieces_line(plan.input));
    if (plan.input.model.expert_groups > 1 || !plan.input.expert_groups_reason.empty())
      fmt::print("expert groups: {}\n", expert_groups_line(plan.input));
    if (plan.input.model.mlp_parts > 1 || !plan.input.mlp_parts_reason.empty())
      fmt::print("MLP parts: {}\n", mlp_parts_line(plan.input));
    if (!plan.expert_fetch_reason.empty())
      fmt::print("expert fetch: {}\n", plan.expert_fetch_reason);
    if (!plan.expert_update_reason.empty())
      fmt::print("expert update: {}\n", plan.expert_update_reason);
    fmt::print("budgets: {}\n", run.budgets.note);
    std::fflush(stdout);
  }

  // The engine, and the trace of its plan.
  std::optional<Failure> create_engine(TrainingRun& run) {
    run.options.plan = *run.plan;  // the plan built once, in build_plan
    Result<std::unique_ptr<Engine>> created = Engine::create(std::move(run.options));
    if (!created) return run_error(created.status());
    run.engine = std::move(*created);
    if (!f_.trace_path.empty() && run.rank0) {
      Result<TraceWriter> opened = TraceWriter::open(f_.trace_path, run.engine->plan());
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
    if (engine.steps_done() >= f_.steps)
      fmt::print("the checkpoint is at step {}, which reaches --steps {}; nothing to train\n",
                 engine.steps_done(), f_.steps);
    progress_.emplace(f_.steps, run.config.steps_per_print);
    run.summary.world = run.plan->input.world_size;
    const bool fp16 = run.config.precision == Precision::fp16;
    run.start = Clock::now();
    (void)engine.take_timings();  // initialisation is not part of the trace

    for (int64_t s = engine.steps_done() + 1; s <= f_.steps; ++s) {
      Result<StepResult> step = engine.step();
      if (!step) {
        (void)drain_timings(run);
        if (run.trace) (void)run.trace->finish();
        return run_error(step.status());
      }
      StepReport report = account_step(run.summary, s, *step, run.tokens_per_step, fp16);
      if (run.profile && run.plan->routed_expert_fetch) {
        // The last kKeptRoutings steps' (a long run's would fill memory).
        if (run.routings.size() == 2 * kKeptRoutings) {
          run.routings.erase(run.routings.begin(), run.routings.begin() + kKeptRoutings);
          run.routings_trimmed = true;
        }
        run.routings.push_back(step->routing);
      }
      // Every process stops after the same step (a signal may reach them at different times).
      Result<bool> stop = engine.any_rank(stop_requested.load());
      if (!stop) return run_error(stop.status());
      const bool last = s == f_.steps || *stop;
      progress_->step(report, seconds_since(run.start));
      if (run.eval_file && (last || (f_.eval_every > 0 && s % f_.eval_every == 0))) {
        const int64_t T = run.plan->input.seq_len, B = run.plan->input.micro_batch;
        Result<EvalResult> eval =
            evaluate(engine, *run.eval_file, run.eval_mask, f_.eval_batches, B, T);
        if (!eval) return run_error(eval.status());
        progress_->eval(s, eval->loss, eval->tokens);
        report.eval_loss = eval->loss;
      }
      if (run.metrics)
        if (Status w = run.metrics->write(report); !w) return run_error(w);
      if (std::optional<Failure> f = write_monitors(run, report)) return f;
      if (std::optional<Failure> f = drain_timings(run)) return f;
      if (f_.save_every > 0 && s % f_.save_every == 0)
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
    if (f_.save_dir.empty() || run.saved_at == step) return std::nullopt;
    Result<std::string> saved = run.engine->save_checkpoint(f_.save_dir, f_.keep);
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
    // The steps after the first, as measured; where the first were let go,
    // a few more, while the ledger of waiting experts fills again.
    const int warmup = run.routings_trimmed ? 8 : 1;
    if (int(run.routings.size()) > warmup)
      summary.predicted_with_run_routing =
          predict_routed_steps(*run.plan, *run.profile, run.routings, warmup).median.steady_seconds;
    progress_->end();
    if (stop_requested.load())
      fmt::print("stopped by {} after step {}{}\n", stop_name(), engine.steps_done(),
                 f_.save_dir.empty()
                     ? ""
                     : "; the checkpoint above resumes it with --resume " + f_.save_dir);
    fmt::print("{}", format_run_summary(summary));
    return std::nullopt;
  }

  // --export (rank 0 writes what every rank reads), then where the outputs are.
  std::optional<Failure> export_weights(TrainingRun& run) {
    if (!f_.export_path.empty()) {
      Result<HostModel> weights = run.engine->read_model();  // every rank takes part
      if (!weights) return run_error(weights.status());
      if (!run.rank0) return std::nullopt;
      if (Status s = export_model(*weights, f_.export_path, run.export_dtype); !s)
        return run_error(s.with_context("--export " + f_.export_path));
      fmt::print("exported the weights ({}) to {}\n", dtype_name(run.export_dtype), f_.export_path);
    }
    if (!f_.metrics_path.empty()) fmt::print("metrics: {}\n", f_.metrics_path);
    if (run.tensorboard)
      fmt::print("tensorboard: {} (`tensorboard --logdir {}`)\n", run.tensorboard->path(),
                 run.config.tensorboard.directory());
    if (run.csv_monitor) fmt::print("csv_monitor: {}\n", run.csv_monitor->directory());
    if (!f_.trace_path.empty())
      fmt::print("trace: {} (open in https://ui.perfetto.dev)\n", f_.trace_path);
    return std::nullopt;
  }

  TrainFlags f_;
  std::optional<ProgressPrinter> progress_;
};

SubcommandRegistration registration([] { return std::make_unique<TrainCommand>(); });

}  // namespace
}  // namespace strata::tools
