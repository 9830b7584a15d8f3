// The training configuration: a DeepSpeed JSON file read as-is, a "strata"
// block for strata's own settings, and command-line overrides on top.
//
// load_train_config() returns either a complete, validated TrainConfig (every
// default filled in, the batch triple resolved) or one error line naming the
// file, the key path and what was expected. Keys that nothing reads are
// returned as warnings (never silently dropped). Values written "auto" (as in
// Hugging Face Trainer configs) count as not given. Pure functions of their
// inputs; thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "io/base/status.h"

namespace strata {

enum class Precision { fp32, bf16, fp16 };
enum class OffloadDevice { none, cpu, nvme };
// The order of a step's computations with gradient accumulation
// (core/plan/training_plan.h): micro-batch after micro-batch through every
// unit, or unit after unit over every micro-batch; auto: the plan's choice.
enum class Schedule { auto_choice, micro_batch, layer };

// How Adam's m and v are stored (kernels/cpu/adamw.h): fp32 (exact), bf16
// (rounded to nearest even), int8 (blockwise codes with a per-block scale).
enum class OptimizerStateDtype { fp32, bf16, int8 };
// Where the gradient accumulator lives when the optimizer is offloaded:
// automatic (host fp32 when it fits the host budget, else NVMe fp32 with the
// optimizer on NVMe), host (fp32), host_bf16, nvme (fp32).
enum class GradientHome { automatic, host, host_bf16, nvme };
// Where the layer-major schedule keeps each micro-batch's activation
// checkpoints until its backward (core/plan/training_plan.h): automatic (the
// first of device, host, nvme whose plan fits the budgets), or one of them.
enum class ActivationHome { automatic, device, host, nvme };

const char* precision_name(Precision precision);
const char* offload_device_name(OffloadDevice device);
const char* schedule_name(Schedule schedule);  // "auto", "micro_batch", "layer"
std::optional<Schedule> parse_schedule(const std::string& name);
const char* optimizer_state_dtype_name(OptimizerStateDtype dtype);  // "fp32", "bf16", "int8"
const char* gradient_home_name(GradientHome home);  // "auto", "host", "host_bf16", "nvme"
const char* activation_home_name(ActivationHome home);  // "auto", "device", "host", "nvme"
std::optional<ActivationHome> parse_activation_home(const std::string& name);
// Bytes of one parameter in the compute precision (4, 2, 2).
int compute_bytes(Precision precision);

struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;  // 0 = dynamic
  int initial_scale_power = 16;
  int loss_scale_window = 1000;
  int hysteresis = 2;
  bool consecutive_hysteresis = false;
  double min_loss_scale = 1.0;
};

struct OptimizerConfig {
  std::string type = "AdamW";  // "AdamW" or "Adam" (as written, case kept)
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adam_w_mode = true;  // false only for type Adam with adam_w_mode false: L2 in the gradient
  bool bias_correction = true;
};

struct SchedulerConfig {
  std::string type;  // "" (constant lr), "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"
  double warmup_min_lr = 0.0;
  double warmup_max_lr = 1e-3;
  int64_t warmup_num_steps = 1000;
  std::string warmup_type = "log";  // "log" or "linear"
  int64_t total_num_steps = 0;      // 0: the run's --steps
  double warmup_min_ratio = 0.0;    // WarmupCosineLR
  double cos_min_ratio = 1e-4;      // WarmupCosineLR
};

struct OffloadConfig {
  OffloadDevice device = OffloadDevice::none;
  std::string nvme_path;
  bool pin_memory = false;
  int buffer_count = 0;
  int64_t buffer_size = 0;  // elements (offload_param only)
  int64_t max_in_cpu = 0;   // elements (offload_param only)
};

struct ZeroConfig {
  int stage = 0;
  bool overlap_comm = false;  // DeepSpeed: true for stage 3, false below
  bool contiguous_gradients = true;
  bool reduce_scatter = true;
  int64_t reduce_bucket_size = 500000000;
  int64_t allgather_bucket_size = 500000000;
  int64_t stage3_prefetch_bucket_size = 50000000;
  int64_t stage3_max_live_parameters = 1000000000;
  int64_t stage3_max_reuse_distance = 1000000000;
  int64_t stage3_param_persistence_threshold = 100000;
  int64_t sub_group_size = 1000000000;
  OffloadConfig offload_param{OffloadDevice::none, "", false, 5, 100000000, 1000000000};
  OffloadConfig offload_optimizer{OffloadDevice::none, "", false, 4, 0, 0};
};

struct AioConfig {
  int64_t block_size = 1048576;
  int queue_depth = 8;
  int intra_op_parallelism = 1;
  bool single_submit = false;
  bool overlap_events = true;
};

struct ActivationCheckpointingConfig {
  bool partition_activations = false;
  bool cpu_checkpointing = false;
  bool contiguous_memory_optimization = false;
  int64_t number_checkpoints = 0;  // 0: not given
  bool synchronize_checkpoint_boundary = false;
  bool profile = false;
};

// A DeepSpeed monitor that writes files: the "tensorboard" and "csv_monitor"
// blocks, whose keys and defaults are the same in DeepSpeed. The files go in
// directory(), created when missing (tools/tensorboard_writer.h,
// tools/csv_monitor_writer.h). DeepSpeed's network monitors ("wandb",
// "comet") are not written: enabled, they are a warning that names these.
struct MonitorConfig {
  bool enabled = false;
  std::string output_path;                    // "": the current directory
  std::string job_name = "DeepSpeedJobName";  // a directory inside output_path
  // output_path joined with job_name as DeepSpeed's os.path.join joins them
  // (an absolute job_name stands alone; an empty one adds nothing).
  std::string directory() const;
};

// strata's own settings: the "strata" block of the config file.
struct StrataConfig {
  std::optional<uint64_t> device_mem_limit;  // bytes per rank; unset: detected
  std::optional<uint64_t> host_mem_limit;    // bytes per node; unset: detected
  std::vector<std::string> nvme_paths;       // striped; unset: the offload blocks' nvme_path
  Precision gradient_reduce_dtype = Precision::fp32;  // fp32 or bf16
  OptimizerStateDtype optimizer_state_dtype = OptimizerStateDtype::fp32;  // m and v
  GradientHome gradient_home = GradientHome::automatic;
  std::optional<int64_t> seq_len;  // tokens per sequence; unset: min(2048, the model's maximum)
  std::optional<int> world_size;   // ranks, when not given by --world-size or the launcher
  std::optional<Precision> precision;  // another way to say fp16/bf16 enabled; must agree with them
  // The order sequences are read in (core/data/sequence_order.h): false, the
  // file's order; true, a seeded permutation of the sequences for each pass.
  bool shuffle = false;
  // The permutations' seed; unset: the run's seed (strata train --seed), which
  // the command fills in so that --print-config and checkpoints show it.
  std::optional<uint64_t> shuffle_seed;
  // The step's order with gradient accumulation; auto: the one whose plan
  // moves fewer bytes over the slowest link (strata plan says which and why).
  Schedule schedule = Schedule::auto_choice;
  // Where the layer-major order keeps its saved inputs; auto: the plan's choice.
  ActivationHome activation_home = ActivationHome::automatic;
  // The units the embedding and the head are cut into along the vocabulary
  // (ModelConfig::vocab_chunks): 1 keeps them whole; 0, auto (the default):
  // the plan's choice (PlanInput::vocab_chunks_auto).
  int64_t vocab_chunks = 0;
  // The units each decoder layer is cut into (ModelConfig::layer_pieces): 1
  // whole, 2 its attention and its MLP; 0, auto (the default): the plan's
  // choice (PlanInput::layer_pieces_auto).
  int64_t layer_pieces = 0;
  // Mixtures of experts in layer pieces: the pieces a sparse layer's MLP is
  // cut into (ModelConfig::expert_groups): 1, one MLP piece; G > 1, a router
  // piece and G pieces of experts; 0, auto (the default): the plan's choice
  // (PlanInput::expert_groups_auto).
  int64_t expert_groups = 0;
  // Layers in pieces: the parts a dense layer's MLP piece is cut into along
  // its intermediate dimension (ModelConfig::mlp_parts): 1, one MLP piece;
  // P > 1, P parts; 0, auto (the default): the plan's choice
  // (PlanInput::mlp_parts_auto).
  int64_t mlp_parts = 0;
  // Mixtures of experts: a sparse layer's experts read from NVMe only when the
  // micro-batches' tokens are routed to them (false, "routed", the default;
  // TrainingPlan::routed_expert_fetch says where it applies), or all of them
  // with their unit (true, "all").
  bool expert_fetch_all = false;
  // Mixtures of experts read as routed: an expert no token reached in a
  // step has its update deferred (with int8 moments its whole blocks,
  // core/plan/expert_update.h) and replayed exactly before its parameters
  // are next read (true, "deferred"; TrainingPlan::deferred_expert_updates
  // says where it applies), or every expert updated every step (false,
  // "eager", the default).
  bool expert_update_deferred = false;
};

struct TrainConfig {
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  int64_t gradient_accumulation_steps = 0;
  int world_size = 1;
  Precision precision = Precision::fp32;
  Fp16Config fp16;
  bool bf16_enabled = false;
  double gradient_clipping = 0.0;  // 0 = off (DeepSpeed's behaviour)
  int steps_per_print = 10;
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  ZeroConfig zero;
  AioConfig aio;
  ActivationCheckpointingConfig activation_checkpointing;
  MonitorConfig tensorboard;
  MonitorConfig csv_monitor;
  StrataConfig strata;

  // Unknown or unused keys, one line each ("config.json: unknown key 'x' ignored").
  std::vector<std::string> warnings;

  // The NVMe directories to stripe over: strata.nvme_paths, else the offload blocks' paths.
  std::vector<std::string> effective_nvme_paths() const;
  bool uses_nvme() const;
};

// Command-line flags; each set field replaces what the file says.
struct ConfigOverrides {
  std::optional<int> zero_stage;
  std::optional<std::string> offload_param;      // none | cpu | nvme
  std::optional<std::string> offload_optimizer;  // none | cpu | nvme
  std::vector<std::string> nvme_paths;
  std::optional<int64_t> micro_batch;
  std::optional<int64_t> grad_accum;
  std::optional<int64_t> global_batch;
  std::optional<int> world_size;
  std::optional<std::string> precision;  // fp32 | bf16 | fp16
  std::optional<double> lr;
  std::optional<std::string> aio_block_size;  // a size: "1M"
  std::optional<int> aio_queue_depth;
  std::optional<int> aio_threads;
  std::optional<std::string> device_mem_limit;  // a size: "80G"
  std::optional<std::string> host_mem_limit;
  std::optional<int64_t> seq_len;
  std::optional<bool> shuffle;
  std::optional<uint64_t> shuffle_seed;
  std::optional<std::string> schedule;  // auto | micro_batch | layer
  std::optional<std::string> activation_home;  // auto | device | host | nvme
  std::optional<std::string> vocab_chunks;     // strata.vocab_chunks: auto | an integer >= 1
  std::optional<std::string> layer_pieces;     // strata.layer_pieces: auto | 1 | 2
  std::optional<std::string> expert_groups;    // strata.expert_groups: auto | an integer >= 1
  std::optional<std::string> mlp_parts;        // strata.mlp_parts: auto | an integer >= 1
  std::optional<std::string> expert_fetch;     // strata.expert_fetch: routed | all
  std::optional<std::string> expert_update;    // strata.expert_update: eager | deferred
  std::optional<std::string> optimizer_state_dtype;  // fp32 | bf16 | int8
  std::optional<std::string> gradient_home;          // auto | host | host_bf16 | nvme
  // The learning-rate schedule ("scheduler"): --lr-schedule constant | warmup | linear |
  // cosine names WarmupLR, WarmupDecayLR, WarmupCosineLR; the others set their params.
  std::optional<std::string> lr_schedule;
  std::optional<int64_t> warmup_steps;     // warmup_num_steps
  std::optional<std::string> warmup_type;  // log | linear
  std::optional<double> min_lr_ratio;      // cos_min_ratio; warmup_min_lr / warmup_max_lr (linear)
  // strata train --tensorboard DIR: the event files go in DIR itself (the
  // tensorboard block enabled, output_path DIR, job_name empty).
  std::optional<std::string> tensorboard_dir;
};

// Reads `config_path` (empty: no file, all defaults) and applies `overrides`.
Result<TrainConfig> load_train_config(const std::string& config_path, const ConfigOverrides& overrides);

// The same from a parsed document; `origin` names it in errors.
Result<TrainConfig> train_config_from_json(const nlohmann::json& json, const std::string& origin,
                                           const ConfigOverrides& overrides);

// The merged, effective configuration as a DeepSpeed-shaped JSON object with
// every default filled in and strata's block ("strata") at the end.
nlohmann::ordered_json train_config_to_json(const TrainConfig& config);

}  // namespace strata
