#include "core/config/config.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <system_error>
#include <nlohmann/json.hpp>

#include "core/config/json_util.h"
#include "core/config/monitor_config.h"
#include "io/base/sizes.h"

namespace strata {
namespace {

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

bool parse_offload_device(const std::string& text, OffloadDevice& out) {
  if (text == "none") out = OffloadDevice::none;
  else if (text == "cpu") out = OffloadDevice::cpu;
  else if (text == "nvme") out = OffloadDevice::nvme;
  else return false;
  return true;
}

void read_offload(JsonReader in, OffloadConfig& out, bool is_param) {
  std::string device;
  if (in.optional_choice("device", device, {"none", "cpu", "nvme"})) {
    parse_offload_device(device, out.device);
  }
  in.optional_string("nvme_path", out.nvme_path);
  in.optional_bool("pin_memory", out.pin_memory);
  in.optional_int("buffer_count", out.buffer_count, 1);
  if (is_param) {
    in.optional_int("buffer_size", out.buffer_size, 1);
    in.optional_int("max_in_cpu", out.max_in_cpu, 0);
  } else {
    // DeepSpeed's pipelining knobs for the NVMe optimizer: strata's streamed
    // optimizer always reads ahead and writes behind, so these are decided by the plan.
    for (const char* key : {"pipeline", "pipeline_read", "pipeline_write", "fast_init"}) {
      in.accept(key);
    }
    double ratio = 1.0;
    if (in.optional_double("ratio", ratio, 0.0, 1.0) && ratio != 1.0) {
      in.fail("ratio", "partial optimizer offload is not supported by strata; remove ratio or set it to 1.0");
    }
  }
}

void read_scheduler(JsonReader in, SchedulerConfig& out) {
  if (!in.optional_choice("type", out.type, {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"})) {
    if (in.has("type")) return;  // error already recorded
  }
  JsonReader params = in.object("params");
  params.optional_int("warmup_num_steps", out.warmup_num_steps, 0);
  params.optional_choice("warmup_type", out.warmup_type, {"log", "linear"});
  if (out.type == "WarmupCosineLR") {
    params.optional_int("total_num_steps", out.total_num_steps, 1);
    params.optional_double("warmup_min_ratio", out.warmup_min_ratio, 0.0, 1.0);
    params.optional_double("cos_min_ratio", out.cos_min_ratio, 0.0, 1.0);
  } else {
    params.optional_double("warmup_min_lr", out.warmup_min_lr, 0.0);
    params.optional_double("warmup_max_lr", out.warmup_max_lr, 0.0);
    if (out.type == "WarmupDecayLR") params.optional_int("total_num_steps", out.total_num_steps, 1);
  }
  params.accept("last_batch_iteration");  // DeepSpeed's resume index: strata's checkpoints keep the step
}

// --lr-schedule, --warmup-steps, --warmup-type and --min-lr-ratio: the
// "scheduler" keys they name, over the file's. A schedule the flag brings in
// where the file has none (or another type) peaks at the optimizer's lr.
Status apply_lr_schedule_overrides(const ConfigOverrides& o, TrainConfig& config) {
  SchedulerConfig& s = config.scheduler;
  if (o.lr_schedule) {
    const std::string& name = *o.lr_schedule;
    std::string type;
    if (name == "warmup") {
      type = "WarmupLR";
    } else if (name == "linear") {
      type = "WarmupDecayLR";
    } else if (name == "cosine") {
      type = "WarmupCosineLR";
    } else if (name != "constant") {
      return Status::invalid_argument(fmt::format(
          "--lr-schedule: expected constant, warmup, linear or cosine, got '{}'", name));
    }
    if (type != s.type && !type.empty()) s.warmup_max_lr = config.optimizer.lr;
    s.type = type;
  }
  // The values first, then what each flag needs of the schedule (the flag above's or the file's).
  // LrSchedule refuses 0 (DeepSpeed warms up over max(2, N) steps whatever N is below 2).
  if (o.warmup_steps && *o.warmup_steps < 1) {
    return Status::invalid_argument(fmt::format(
        "--warmup-steps: expected a number of steps >= 1 (the warm-up lasts max(2, N) steps, as "
        "in DeepSpeed), got {}",
        *o.warmup_steps));
  }
  if (o.warmup_type && *o.warmup_type != "log" && *o.warmup_type != "linear") {
    return Status::invalid_argument(
        fmt::format("--warmup-type: expected log or linear, got '{}'", *o.warmup_type));
  }
  if (o.min_lr_ratio && !(*o.min_lr_ratio >= 0.0 && *o.min_lr_ratio <= 1.0)) {
    return Status::invalid_argument(fmt::format(
        "--min-lr-ratio: expected a fraction of the peak lr in [0, 1], got {}", *o.min_lr_ratio));
  }
  if ((o.warmup_steps || o.warmup_type) && s.type.empty()) {
    return Status::invalid_argument(fmt::format(
        "{}: the learning rate is constant, with no warm-up; add --lr-schedule warmup, linear or "
        "cosine",
        o.warmup_steps ? "--warmup-steps" : "--warmup-type"));
  }
  if (o.warmup_steps) s.warmup_num_steps = *o.warmup_steps;
  if (o.warmup_type) s.warmup_type = *o.warmup_type;
  if (o.min_lr_ratio) {
    const double r = *o.min_lr_ratio;
    if (s.type == "WarmupCosineLR") {
      s.cos_min_ratio = r;
    } else if (s.type == "WarmupDecayLR") {
      s.warmup_min_lr = r * s.warmup_max_lr;  // WarmupDecayLR warms up from it and decays to it
    } else {
      return Status::invalid_argument(fmt::format(
          "--min-lr-ratio: {} does not decay; use --lr-schedule linear or cosine",
          s.type.empty() ? "a constant learning rate" : "WarmupLR (--lr-schedule warmup)"));
    }
  }
  return Status::ok();
}

void read_optimizer(JsonReader in, OptimizerConfig& out) {
  std::string type;
  if (in.optional_string("type", type)) {
    std::string name = lower(type);
    if (name == "adamw") {
      out.type = "AdamW";
    } else if (name == "adam") {
      out.type = "Adam";
    } else {
      in.fail("type", fmt::format("strata implements Adam and AdamW; got '{}'", type));
    }
  }
  JsonReader params = in.object("params");
  params.optional_double("lr", out.lr, 0.0);
  params.optional_double_pair("betas", out.beta1, out.beta2);
  if (out.beta1 < 0 || out.beta1 >= 1 || out.beta2 < 0 || out.beta2 >= 1) {
    params.fail("betas", fmt::format("each beta must be in [0, 1); got [{}, {}]", out.beta1, out.beta2));
  }
  params.optional_double("eps", out.eps, 0.0);
  params.optional_double("weight_decay", out.weight_decay, 0.0);
  bool adam_w_mode = true;
  if (params.optional_bool("adam_w_mode", adam_w_mode)) {
    if (out.type == "AdamW" && !adam_w_mode) {
      params.fail("adam_w_mode", "AdamW is always decoupled; use type Adam for adam_w_mode false");
    }
    out.adam_w_mode = adam_w_mode;
  }
  params.optional_bool("bias_correction", out.bias_correction);
  params.accept("torch_adam");  // which implementation DeepSpeed picks; strata has one
}

void read_fp16(JsonReader in, Fp16Config& out) {
  in.optional_bool("enabled", out.enabled);
  in.optional_double("loss_scale", out.loss_scale, 0.0);
  in.optional_int("initial_scale_power", out.initial_scale_power, 0, 63);
  in.optional_int("loss_scale_window", out.loss_scale_window, 1);
  in.optional_int("hysteresis", out.hysteresis, 1);
  in.optional_bool("consecutive_hysteresis", out.consecutive_hysteresis);
  in.optional_double("min_loss_scale", out.min_loss_scale, 0.0);
  in.accept("auto_cast");  // strata casts inside its kernels
}

// Returns whether the file gave overlap_comm (else its default follows the stage).
bool read_zero(JsonReader in, ZeroConfig& out) {
  in.optional_int("stage", out.stage, 0, 3);
  out.overlap_comm = out.stage == 3;  // DeepSpeed's default depends on the stage
  const bool overlap_given = in.optional_bool("overlap_comm", out.overlap_comm);
  in.optional_bool("contiguous_gradients", out.contiguous_gradients);
  in.optional_bool("reduce_scatter", out.reduce_scatter);
  in.optional_int("reduce_bucket_size", out.reduce_bucket_size, 0);
  in.optional_int("allgather_bucket_size", out.allgather_bucket_size, 0);
  in.optional_int("stage3_prefetch_bucket_size", out.stage3_prefetch_bucket_size, 0);
  in.optional_int("stage3_max_live_parameters", out.stage3_max_live_parameters, 0);
  in.optional_int("stage3_max_reuse_distance", out.stage3_max_reuse_distance, 0);
  in.optional_int("stage3_param_persistence_threshold", out.stage3_param_persistence_threshold, 0);
  in.optional_int("sub_group_size", out.sub_group_size, 0);
  // Always true in strata: every collective is per unit and the gradients of a
  // unit live in one flat buffer.
  in.accept("allgather_partitions");
  read_offload(in.object("offload_param"), out.offload_param, true);
  read_offload(in.object("offload_optimizer"), out.offload_optimizer, false);
  // DeepSpeed's older spelling of offload_optimizer {device: cpu}.
  bool cpu_offload = false;
  if (in.optional_bool("cpu_offload", cpu_offload) && cpu_offload &&
      out.offload_optimizer.device == OffloadDevice::none) {
    out.offload_optimizer.device = OffloadDevice::cpu;
  }
  return overlap_given;
}

void read_aio(JsonReader in, AioConfig& out) {
  if (in.optional_int("block_size", out.block_size, 4096) && out.block_size % 4096 != 0) {
    in.fail("block_size", fmt::format("must be a multiple of 4096 (O_DIRECT); got {}", out.block_size));
  }
  in.optional_int("queue_depth", out.queue_depth, 1, 4096);
  if (!in.optional_int("intra_op_parallelism", out.intra_op_parallelism, 1, 256)) {
    in.optional_int("thread_count", out.intra_op_parallelism, 1, 256);  // DeepSpeed's older name
  } else {
    in.accept("thread_count");
  }
  in.optional_bool("single_submit", out.single_submit);
  in.optional_bool("overlap_events", out.overlap_events);
  bool use_gds = false;
  if (in.optional_bool("use_gds", use_gds) && use_gds) {
    in.fail("use_gds", "GPUDirect Storage is not supported by strata; set it to false");
  }
}

void read_activation_checkpointing(JsonReader in, ActivationCheckpointingConfig& out) {
  in.optional_bool("partition_activations", out.partition_activations);
  in.optional_bool("cpu_checkpointing", out.cpu_checkpointing);
  in.optional_bool("contiguous_memory_optimization", out.contiguous_memory_optimization);
  in.optional_int("number_checkpoints", out.number_checkpoints, 0);
  in.optional_bool("synchronize_checkpoint_boundary", out.synchronize_checkpoint_boundary);
  in.optional_bool("profile", out.profile);
}

bool parse_optimizer_state_dtype(const std::string& text, OptimizerStateDtype& out) {
  for (OptimizerStateDtype d :
       {OptimizerStateDtype::fp32, OptimizerStateDtype::bf16, OptimizerStateDtype::int8}) {
    if (text == optimizer_state_dtype_name(d)) {
      out = d;
      return true;
    }
  }
  return false;
}

bool parse_gradient_home(const std::string& text, GradientHome& out) {
  for (GradientHome h :
       {GradientHome::automatic, GradientHome::host, GradientHome::host_bf16, GradientHome::nvme}) {
    if (text == gradient_home_name(h)) {
      out = h;
      return true;
    }
  }
  return false;
}

void read_strata_block(JsonReader in, StrataConfig& out, const nlohmann::json& block) {
  for (const char* key : {"device_mem_limit", "host_mem_limit"}) {
    in.accept(key);
    if (!block.is_object() || !block.contains(key) || block[key].is_null()) continue;
    const nlohmann::json& value = block[key];
    std::optional<uint64_t>& target =
        std::string(key) == "device_mem_limit" ? out.device_mem_limit : out.host_mem_limit;
    if (value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() > 0)) {
      target = value.get<uint64_t>();
    } else if (value.is_string()) {
      Result<uint64_t> size = parse_size(value.get<std::string>());
      if (!size.is_ok()) {
        in.fail(key, size.status().message());
        continue;
      }
      target = *size;
    } else {
      in.fail(key, fmt::format("expected a size in bytes or a string such as \"80G\", got {}",
                               json_excerpt(value)));
    }
  }
  in.accept("nvme_paths");
  if (block.is_object() && block.contains("nvme_paths") && !block["nvme_paths"].is_null()) {
    const nlohmann::json& paths = block["nvme_paths"];
    bool ok = paths.is_array() && !paths.empty();
    if (ok) {
      for (const auto& path : paths) ok = ok && path.is_string() && !path.get<std::string>().empty();
    }
    if (!ok) {
      in.fail("nvme_paths", fmt::format("expected a non-empty list of directory names, got {}",
                                        json_excerpt(paths)));
    } else {
      for (const auto& path : paths) out.nvme_paths.push_back(path.get<std::string>());
    }
  }
  int64_t seq_len = 0;
  if (in.optional_int("seq_len", seq_len, 1)) out.seq_len = seq_len;
  in.optional_int("vocab_chunks", out.vocab_chunks, 1);  // "auto" counts as not given: 0
  in.optional_int("layer_pieces", out.layer_pieces, 1);  // likewise
  in.optional_int("expert_groups", out.expert_groups, 1);  // likewise
  in.optional_int("mlp_parts", out.mlp_parts, 1);          // likewise
  std::string expert_fetch;
  if (in.optional_choice("expert_fetch", expert_fetch, {"routed", "all"}))
    out.expert_fetch_all = expert_fetch == "all";
  std::string expert_update;
  if (in.optional_choice("expert_update", expert_update, {"eager", "deferred"}))
    out.expert_update_deferred = expert_update == "deferred";
  int world_size = 1;
  if (in.optional_int("world_size", world_size, 1)) out.world_size = world_size;
  std::string precision;
  if (in.optional_choice("precision", precision, {"fp32", "bf16", "fp16"})) {
    out.precision = precision == "fp32" ? Precision::fp32 : precision == "bf16" ? Precision::bf16 : Precision::fp16;
  }
  std::string reduce_dtype;
  if (in.optional_choice("gradient_reduce_dtype", reduce_dtype, {"fp32", "bf16"})) {
    out.gradient_reduce_dtype = reduce_dtype == "bf16" ? Precision::bf16 : Precision::fp32;
  }
  std::string state_dtype;
  if (in.optional_choice("optimizer_state_dtype", state_dtype, {"fp32", "bf16", "int8"}))
    parse_optimizer_state_dtype(state_dtype, out.optimizer_state_dtype);
  std::string gradient_home;
  if (in.optional_choice("gradient_home", gradient_home, {"auto", "host", "host_bf16", "nvme"}))
    parse_gradient_home(gradient_home, out.gradient_home);
  in.optional_bool("shuffle", out.shuffle);
  std::string schedule;
  if (in.optional_choice("schedule", schedule, {"auto", "micro_batch", "layer"}))
    out.schedule = *parse_schedule(schedule);
  std::string activation_home;
  if (in.optional_choice("activation_home", activation_home, {"auto", "device", "host", "nvme"}))
    out.activation_home = *parse_activation_home(activation_home);
  // A seed is any 64-bit unsigned integer, as --seed is; JsonReader's integers stop at 2^63.
  in.accept("shuffle_seed");
  if (block.is_object() && block.contains("shuffle_seed") && !block["shuffle_seed"].is_null()) {
    const nlohmann::json& seed = block["shuffle_seed"];
    if (seed.is_number_unsigned())
      out.shuffle_seed = seed.get<uint64_t>();
    else
      in.fail("shuffle_seed", fmt::format("expected an integer >= 0, got {}", json_excerpt(seed)));
  }
}

// Where a batch setting came from, for error messages.
struct BatchValue {
  std::optional<int64_t> value;
  std::string source;
};

Status resolve_batch(TrainConfig& config, BatchValue train, BatchValue micro, BatchValue accum,
                     const std::string& world_source) {
  const int64_t world = config.world_size;
  auto equation_error = [&](int64_t t, int64_t m, int64_t g) {
    return Status::invalid_argument(fmt::format(
        "train_batch_size must equal train_micro_batch_size_per_gpu * gradient_accumulation_steps "
        "* world_size, but {} != {} * {} * {} (train_batch_size from {}, micro batch from {}, "
        "gradient accumulation from {}, world size from {}); give any two and strata derives the third",
        t, m, g, world, train.source.empty() ? "derived" : train.source,
        micro.source.empty() ? "derived" : micro.source,
        accum.source.empty() ? "derived" : accum.source, world_source));
  };
  int64_t t = 0, m = 0, g = 0;
  if (train.value && micro.value && accum.value) {
    t = *train.value, m = *micro.value, g = *accum.value;
  } else if (train.value && micro.value) {
    t = *train.value, m = *micro.value;
    g = t / (m * world);
    if (g < 1 || t % (m * world) != 0) return equation_error(t, m, std::max<int64_t>(g, 1));
  } else if (train.value && accum.value) {
    t = *train.value, g = *accum.value;
    m = t / (g * world);
    if (m < 1 || t % (g * world) != 0) return equation_error(t, std::max<int64_t>(m, 1), g);
  } else if (micro.value && accum.value) {
    m = *micro.value, g = *accum.value;
    t = m * g * world;
  } else if (train.value) {
    t = *train.value, g = 1;
    m = t / world;
    if (m < 1 || t % world != 0) return equation_error(t, std::max<int64_t>(m, 1), g);
  } else if (micro.value) {
    m = *micro.value, g = 1;
    t = m * world;
  } else if (accum.value) {
    // DeepSpeed needs train_batch_size or the micro batch; strata defaults the micro batch to 1.
    g = *accum.value, m = 1;
    t = m * g * world;
  } else {
    m = 1, g = 1;
    t = world;
  }
  if (t != m * g * world) return equation_error(t, m, g);
  config.train_batch_size = t;
  config.train_micro_batch_size_per_gpu = m;
  config.gradient_accumulation_steps = g;
  return Status::ok();
}

Status validate(const TrainConfig& config, const std::string& origin) {
  const ZeroConfig& zero = config.zero;
  if (zero.offload_param.device != OffloadDevice::none && zero.stage < 3) {
    return Status::invalid_argument(fmt::format(
        "{}: zero_optimization.offload_param: offloading parameters needs ZeRO stage 3 (stage is {}); "
        "set zero_optimization.stage to 3 (--zero-stage 3) or remove offload_param (DeepSpeed refuses "
        "this too)", origin, zero.stage));
  }
  if (config.uses_nvme() && config.effective_nvme_paths().empty()) {
    const char* which = zero.offload_optimizer.device == OffloadDevice::nvme ? "offload_optimizer"
                                                                              : "offload_param";
    // not_found: the caller may supply a default directory (strata train does).
    return Status::not_found(fmt::format(
        "{}: zero_optimization.{}.device is nvme but no NVMe directory is given; set "
        "zero_optimization.{}.nvme_path, strata.nvme_paths, or pass --nvme-path DIR", origin, which,
        which));
  }
  if (config.fp16.enabled && config.bf16_enabled) {
    return Status::invalid_argument(fmt::format(
        "{}: fp16.enabled and bf16.enabled are both true; enable one (or pass --precision)", origin));
  }
  return Status::ok();
}

}  // namespace

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::fp32: return "fp32";
    case Precision::bf16: return "bf16";
    case Precision::fp16: return "fp16";
  }
  return "?";
}

const char* optimizer_state_dtype_name(OptimizerStateDtype dtype) {
  switch (dtype) {
    case OptimizerStateDtype::fp32: return "fp32";
    case OptimizerStateDtype::bf16: return "bf16";
    case OptimizerStateDtype::int8: return "int8";
  }
  return "?";
}

const char* gradient_home_name(GradientHome home) {
  switch (home) {
    case GradientHome::automatic: return "auto";
    case GradientHome::host: return "host";
    case GradientHome::host_bf16: return "host_bf16";
    case GradientHome::nvme: return "nvme";
  }
  return "?";
}

const char* offload_device_name(OffloadDevice device) {
  switch (device) {
    case OffloadDevice::none: return "none";
    case OffloadDevice::cpu: return "cpu";
    case OffloadDevice::nvme: return "nvme";
  }
  return "?";
}

const char* schedule_name(Schedule schedule) {
  switch (schedule) {
    case Schedule::auto_choice: return "auto";
    case Schedule::micro_batch: return "micro_batch";
    case Schedule::layer: return "layer";
  }
  return "?";
}

std::optional<Schedule> parse_schedule(const std::string& name) {
  for (Schedule s : {Schedule::auto_choice, Schedule::micro_batch, Schedule::layer})
    if (name == schedule_name(s)) return s;
  return std::nullopt;
}

const char* activation_home_name(ActivationHome home) {
  switch (home) {
    case ActivationHome::automatic: return "auto";
    case ActivationHome::device: return "device";
    case ActivationHome::host: return "host";
    case ActivationHome::nvme: return "nvme";
  }
  return "?";
}

std::optional<ActivationHome> parse_activation_home(const std::string& name) {
  for (ActivationHome h : {ActivationHome::automatic, ActivationHome::device, ActivationHome::host,
                           ActivationHome::nvme})
    if (name == activation_home_name(h)) return h;
  return std::nullopt;
}

int compute_bytes(Precision precision) { return precision == Precision::fp32 ? 4 : 2; }

std::vector<std::string> TrainConfig::effective_nvme_paths() const {
  if (!strata.nvme_paths.empty()) return strata.nvme_paths;
  std::vector<std::string> paths;
  for (const OffloadConfig* offload : {&zero.offload_optimizer, &zero.offload_param}) {
    if (offload->device != OffloadDevice::nvme || offload->nvme_path.empty()) continue;
    if (std::find(paths.begin(), paths.end(), offload->nvme_path) == paths.end()) {
      paths.push_back(offload->nvme_path);
    }
  }
  return paths;
}

bool TrainConfig::uses_nvme() const {
  return zero.offload_optimizer.device == OffloadDevice::nvme ||
         zero.offload_param.device == OffloadDevice::nvme;
}

namespace {

// The batch shape as the file gives it, and what later steps need to know of it.
struct FileBatch {
  BatchValue train, micro, accum;
  std::string world_source = "the default (1)";
  bool overlap_comm_given = false;
};

// The config file's blocks, checked key by key; unknown keys become warnings.
Status read_config_blocks(const nlohmann::json& json, const std::string& origin,
                          TrainConfig& config, FileBatch& batch) {
  batch.train.source = batch.micro.source = batch.accum.source = origin;
  JsonReader in(json, origin, "");
  BatchValue &train = batch.train, &micro = batch.micro, &accum = batch.accum;
  int64_t number = 0;
  if (in.optional_int("train_batch_size", number, 1)) train.value = number;
  if (in.optional_int("train_micro_batch_size_per_gpu", number, 1)) micro.value = number;
  if (in.optional_int("gradient_accumulation_steps", number, 1)) accum.value = number;

  read_fp16(in.object("fp16"), config.fp16);
  {
    JsonReader bf16 = in.object("bf16");
    bf16.optional_bool("enabled", config.bf16_enabled);
    bf16.accept("immediate_grad_update");  // strata always accumulates gradients in fp32
  }
  in.optional_double("gradient_clipping", config.gradient_clipping, 0.0);
  in.optional_int("steps_per_print", config.steps_per_print, 1);
  in.accept("wall_clock_breakdown");  // strata's summary always shows where the time went
  in.accept("zero_allow_untested_optimizer");
  read_optimizer(in.object("optimizer"), config.optimizer);
  read_scheduler(in.object("scheduler"), config.scheduler);
  batch.overlap_comm_given = read_zero(in.object("zero_optimization"), config.zero);
  read_aio(in.object("aio"), config.aio);
  read_activation_checkpointing(in.object("activation_checkpointing"),
                                config.activation_checkpointing);
  read_monitor_blocks(in, config);
  const nlohmann::json empty = nlohmann::json::object();
  read_strata_block(in.object("strata"), config.strata,
                    json.contains("strata") ? json["strata"] : empty);
  if (!in.status().is_ok()) return in.status();

  for (const std::string& key : in.unread_keys()) {
    config.warnings.push_back(fmt::format("{}: unknown key '{}' ignored", origin, key));
  }

  if (config.strata.precision) {
    const Precision p = *config.strata.precision;
    const bool agrees = (p == Precision::fp16) == config.fp16.enabled && (p == Precision::bf16) == config.bf16_enabled;
    if (!agrees && (config.fp16.enabled || config.bf16_enabled)) {
      return Status::invalid_argument(fmt::format(
          "{}: strata.precision is {} but fp16.enabled is {} and bf16.enabled is {}; make them agree",
          origin, precision_name(p), config.fp16.enabled, config.bf16_enabled));
    }
    config.fp16.enabled = p == Precision::fp16;
    config.bf16_enabled = p == Precision::bf16;
  }

  return Status::ok();
}

// The flags that shape the run: world size, batch, stage, offload homes, NVMe
// directories, precision, learning rate.
Status apply_shape_overrides(const ConfigOverrides& overrides, const std::string& origin,
                             TrainConfig& config, FileBatch& batch) {
  std::string& world_source = batch.world_source;
  BatchValue &train = batch.train, &micro = batch.micro, &accum = batch.accum;
  if (config.strata.world_size) {
    config.world_size = *config.strata.world_size;
    world_source = origin;
  }
  if (overrides.world_size) {
    if (*overrides.world_size < 1) {
      return Status::invalid_argument(fmt::format("--world-size: expected an integer >= 1, got {}", *overrides.world_size));
    }
    config.world_size = *overrides.world_size;
    world_source = "--world-size";
  }
  auto override_batch = [](BatchValue& target, const std::optional<int64_t>& flag,
                           const char* name) -> Status {
    if (!flag) return Status::ok();
    if (*flag < 1) return Status::invalid_argument(fmt::format("{}: expected an integer >= 1, got {}", name, *flag));
    target.value = *flag;
    target.source = name;
    return Status::ok();
  };
  for (Status s : {override_batch(train, overrides.global_batch, "--global-batch"),
                   override_batch(micro, overrides.micro_batch, "--micro-batch"),
                   override_batch(accum, overrides.grad_accum, "--grad-accum")}) {
    if (!s.is_ok()) return s;
  }
  if (overrides.zero_stage) {
    if (*overrides.zero_stage < 0 || *overrides.zero_stage > 3) {
      return Status::invalid_argument(fmt::format("--zero-stage: expected 0, 1, 2 or 3, got {}", *overrides.zero_stage));
    }
    config.zero.stage = *overrides.zero_stage;
    if (!batch.overlap_comm_given) config.zero.overlap_comm = config.zero.stage == 3;
  }
  for (auto [flag, name, target] :
       {std::tuple{&overrides.offload_param, "--offload-param", &config.zero.offload_param},
        std::tuple{&overrides.offload_optimizer, "--offload-optimizer", &config.zero.offload_optimizer}}) {
    if (!*flag) continue;
    if (!parse_offload_device(**flag, target->device)) {
      return Status::invalid_argument(fmt::format("{}: expected none, cpu or nvme, got '{}'", name, **flag));
    }
  }
  if (!overrides.nvme_paths.empty()) {
    config.strata.nvme_paths = overrides.nvme_paths;
    for (OffloadConfig* offload : {&config.zero.offload_param, &config.zero.offload_optimizer}) {
      offload->nvme_path = overrides.nvme_paths.front();
    }
  }
  if (overrides.precision) {
    const std::string& p = *overrides.precision;
    if (p != "fp32" && p != "bf16" && p != "fp16") {
      return Status::invalid_argument(fmt::format("--precision: expected fp32, bf16 or fp16, got '{}'", p));
    }
    config.fp16.enabled = p == "fp16";
    config.bf16_enabled = p == "bf16";
  }
  if (overrides.lr) {
    if (!(*overrides.lr >= 0)) return Status::invalid_argument(fmt::format("--lr: expected a number >= 0, got {}", *overrides.lr));
    config.optimizer.lr = *overrides.lr;
    // A warmup schedule peaks at warmup_max_lr: keep the two in step, as --lr is what the user means.
    config.scheduler.warmup_max_lr = *overrides.lr;
  }
  return Status::ok();
}

// The flags for I/O, memory and strata's own settings.
// A flag of "auto" (0) or a count of at least 1 into `target`, when given.
Status auto_or_count(const std::optional<std::string>& flag, const char* name, int64_t& target) {
  if (!flag) return Status::ok();
  const std::string& given = *flag;
  int64_t count = 0;
  const auto [end, error] = std::from_chars(given.data(), given.data() + given.size(), count);
  if (given != "auto" && (error != std::errc() || end != given.data() + given.size() || count < 1))
    return Status::invalid_argument(
        fmt::format("{}: expected auto or an integer >= 1, got '{}'", name, given));
  target = given == "auto" ? 0 : count;
  return Status::ok();
}

Status apply_strata_overrides(const ConfigOverrides& overrides, const std::string& origin,
                              TrainConfig& config) {
  if (overrides.aio_block_size) {
    Result<uint64_t> size = parse_size(*overrides.aio_block_size);
    if (!size.is_ok()) return size.status().with_context("--aio-block-size");
    if (*size == 0 || *size % 4096 != 0) {
      return Status::invalid_argument(fmt::format("--aio-block-size: must be a positive multiple of 4 KiB (O_DIRECT), got {}", *size));
    }
    config.aio.block_size = static_cast<int64_t>(*size);
  }
  if (overrides.aio_queue_depth) {
    if (*overrides.aio_queue_depth < 1 || *overrides.aio_queue_depth > 4096) {
      return Status::invalid_argument(fmt::format("--aio-queue-depth: expected 1..4096, got {}", *overrides.aio_queue_depth));
    }
    config.aio.queue_depth = *overrides.aio_queue_depth;
  }
  if (overrides.aio_threads) {
    if (*overrides.aio_threads < 1 || *overrides.aio_threads > 256) {
      return Status::invalid_argument(fmt::format("--aio-threads: expected 1..256, got {}", *overrides.aio_threads));
    }
    config.aio.intra_op_parallelism = *overrides.aio_threads;
  }
  for (auto [flag, name, target] :
       {std::tuple{&overrides.device_mem_limit, "--device-mem-limit", &config.strata.device_mem_limit},
        std::tuple{&overrides.host_mem_limit, "--host-mem-limit", &config.strata.host_mem_limit}}) {
    if (!*flag) continue;
    Result<uint64_t> size = parse_size(**flag);
    if (!size.is_ok()) return size.status().with_context(name);
    *target = *size;
  }

  if (overrides.optimizer_state_dtype &&
      !parse_optimizer_state_dtype(*overrides.optimizer_state_dtype,
                                   config.strata.optimizer_state_dtype))
    return Status::invalid_argument(fmt::format("--optimizer-state-dtype: expected fp32, bf16 or int8, got '{}'",
                                     *overrides.optimizer_state_dtype));
  if (overrides.gradient_home &&
      !parse_gradient_home(*overrides.gradient_home, config.strata.gradient_home))
    return Status::invalid_argument(fmt::format(
        "--gradient-home: expected auto, host, host_bf16 or nvme, got '{}'", *overrides.gradient_home));
  if (overrides.shuffle) config.strata.shuffle = *overrides.shuffle;
  if (overrides.schedule) {
    std::optional<Schedule> schedule = parse_schedule(*overrides.schedule);
    if (!schedule)
      return Status::invalid_argument(fmt::format(
          "--schedule: expected auto, micro_batch or layer, got '{}'", *overrides.schedule));
    config.strata.schedule = *schedule;
  }
  if (overrides.activation_home) {
    std::optional<ActivationHome> home = parse_activation_home(*overrides.activation_home);
    if (!home)
      return Status::invalid_argument(fmt::format("--activation-home: expected auto, device, host or nvme, got '{}'",
                                       *overrides.activation_home));
    config.strata.activation_home = *home;
  }
  if (overrides.shuffle_seed) config.strata.shuffle_seed = *overrides.shuffle_seed;
  // A seed that orders nothing is worth a line, unless --no-shuffle turned a file's shuffle off.
  if (config.strata.shuffle_seed && !config.strata.shuffle && overrides.shuffle != false) {
    config.warnings.push_back(
        overrides.shuffle_seed
            ? fmt::format("--shuffle-seed {} has no effect: the data are read in order; pass "
                          "--shuffle too (or set strata.shuffle to true)",
                          *config.strata.shuffle_seed)
            : fmt::format("{}: strata.shuffle_seed {} has no effect: the data are read in order; "
                          "set strata.shuffle to true (or pass --shuffle)",
                          origin, *config.strata.shuffle_seed));
  }

  if (Status s =
          auto_or_count(overrides.vocab_chunks, "--vocab-chunks", config.strata.vocab_chunks);
      !s)
    return s;
  if (overrides.layer_pieces) {
    const std::string& given = *overrides.layer_pieces;
    if (given != "auto" && given != "1" && given != "2")
      return Status::invalid_argument(
          fmt::format("--layer-pieces: expected auto, 1 or 2, got '{}'", given));
    config.strata.layer_pieces = given == "auto" ? 0 : given == "1" ? 1 : 2;
  }
  if (Status s =
          auto_or_count(overrides.expert_groups, "--expert-groups", config.strata.expert_groups);
      !s)
    return s;
  if (Status s = auto_or_count(overrides.mlp_parts, "--mlp-parts", config.strata.mlp_parts); !s)
    return s;
  if (overrides.expert_fetch) {
    const std::string& given = *overrides.expert_fetch;
    if (given != "routed" && given != "all")
      return Status::invalid_argument(
          fmt::format("--expert-fetch: expected routed or all, got '{}'", given));
    config.strata.expert_fetch_all = given == "all";
  }
  if (overrides.expert_update) {
    const std::string& given = *overrides.expert_update;
    if (given != "eager" && given != "deferred")
      return Status::invalid_argument(
          fmt::format("--expert-update: expected eager or deferred, got '{}'", given));
    config.strata.expert_update_deferred = given == "deferred";
  }
  if (overrides.seq_len) {
    if (*overrides.seq_len < 1) return Status::invalid_argument(fmt::format("--seq-len: expected an integer >= 1, got {}", *overrides.seq_len));
    config.strata.seq_len = *overrides.seq_len;
  }
  return Status::ok();
}

}  // namespace

Result<TrainConfig> train_config_from_json(const nlohmann::json& json, const std::string& origin,
                                           const ConfigOverrides& overrides) {
  if (!json.is_object()) {
    return Status::invalid_argument(fmt::format("{}: expected a JSON object at the top level, got {}", origin,
                                     json_excerpt(json)));
  }
  TrainConfig config;
  FileBatch batch;
  if (Status s = read_config_blocks(json, origin, config, batch); !s) return s;
  if (Status s = apply_shape_overrides(overrides, origin, config, batch); !s) return s;
  if (Status s = apply_strata_overrides(overrides, origin, config); !s) return s;
  if (Status s = apply_monitor_overrides(overrides, config); !s) return s;
  Status schedule = apply_lr_schedule_overrides(overrides, config);
  if (!schedule.is_ok()) return schedule;

  config.precision = config.fp16.enabled ? Precision::fp16
                     : config.bf16_enabled ? Precision::bf16
                                           : Precision::fp32;
  if (config.optimizer.type == "AdamW") config.optimizer.adam_w_mode = true;

  Status resolved = resolve_batch(config, batch.train, batch.micro, batch.accum, batch.world_source);
  if (!resolved.is_ok()) return resolved.with_context(origin);
  Status valid = validate(config, origin);
  if (!valid.is_ok()) return valid;
  return config;
}

Result<TrainConfig> load_train_config(const std::string& config_path, const ConfigOverrides& overrides) {
  if (config_path.empty()) {
    return train_config_from_json(nlohmann::json::object(), "defaults", overrides);
  }
  Result<nlohmann::json> json = read_json_file(config_path);
  if (!json.is_ok()) return json.status();
  return train_config_from_json(*json, config_path, overrides);
}

nlohmann::ordered_json train_config_to_json(const TrainConfig& c) {
  using json = nlohmann::ordered_json;
  auto offload = [](const OffloadConfig& o, bool is_param) {
    json j = {{"device", offload_device_name(o.device)},
              {"nvme_path", o.nvme_path.empty() ? json(nullptr) : json(o.nvme_path)},
              {"pin_memory", o.pin_memory},
              {"buffer_count", o.buffer_count}};
    if (is_param) {
      j["buffer_size"] = o.buffer_size;
      j["max_in_cpu"] = o.max_in_cpu;
    }
    return j;
  };
  json scheduler = nullptr;
  if (!c.scheduler.type.empty()) {
    json params = {{"warmup_num_steps", c.scheduler.warmup_num_steps},
                   {"warmup_type", c.scheduler.warmup_type}};
    if (c.scheduler.type == "WarmupCosineLR") {
      params["total_num_steps"] = c.scheduler.total_num_steps;
      params["warmup_min_ratio"] = c.scheduler.warmup_min_ratio;
      params["cos_min_ratio"] = c.scheduler.cos_min_ratio;
    } else {
      params["warmup_min_lr"] = c.scheduler.warmup_min_lr;
      params["warmup_max_lr"] = c.scheduler.warmup_max_lr;
      if (c.scheduler.type == "WarmupDecayLR") params["total_num_steps"] = c.scheduler.total_num_steps;
    }
    scheduler = {{"type", c.scheduler.type}, {"params", params}};
  }
  json strata = {
      {"world_size", c.world_size},
      {"precision", precision_name(c.precision)},
      {"device_mem_limit",
       c.strata.device_mem_limit ? json(*c.strata.device_mem_limit) : json(nullptr)},
      {"host_mem_limit", c.strata.host_mem_limit ? json(*c.strata.host_mem_limit) : json(nullptr)},
      {"nvme_paths", c.effective_nvme_paths()},
      {"gradient_reduce_dtype", precision_name(c.strata.gradient_reduce_dtype)},
      {"optimizer_state_dtype", optimizer_state_dtype_name(c.strata.optimizer_state_dtype)},
      {"gradient_home", gradient_home_name(c.strata.gradient_home)},
      {"seq_len", c.strata.seq_len ? json(*c.strata.seq_len) : json(nullptr)},
      {"shuffle", c.strata.shuffle},
      {"shuffle_seed", c.strata.shuffle_seed ? json(*c.strata.shuffle_seed) : json(nullptr)},
      {"schedule", schedule_name(c.strata.schedule)},
      {"activation_home", activation_home_name(c.strata.activation_home)},
      {"vocab_chunks", c.strata.vocab_chunks == 0 ? json("auto") : json(c.strata.vocab_chunks)},
      {"layer_pieces", c.strata.layer_pieces == 0 ? json("auto") : json(c.strata.layer_pieces)},
      {"expert_groups", c.strata.expert_groups == 0 ? json("auto") : json(c.strata.expert_groups)},
      {"mlp_parts", c.strata.mlp_parts == 0 ? json("auto") : json(c.strata.mlp_parts)},
      {"expert_fetch", c.strata.expert_fetch_all ? "all" : "routed"},
      {"expert_update", c.strata.expert_update_deferred ? "deferred" : "eager"},
  };
  json out = json::object();
  out["train_batch_size"] = c.train_batch_size;
  out["train_micro_batch_size_per_gpu"] = c.train_micro_batch_size_per_gpu;
  out["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  out["steps_per_print"] = c.steps_per_print;
  out["gradient_clipping"] = c.gradient_clipping;
  out["fp16"] = {{"enabled", c.fp16.enabled},
                 {"loss_scale", c.fp16.loss_scale},
                 {"initial_scale_power", c.fp16.initial_scale_power},
                 {"loss_scale_window", c.fp16.loss_scale_window},
                 {"hysteresis", c.fp16.hysteresis},
                 {"consecutive_hysteresis", c.fp16.consecutive_hysteresis},
                 {"min_loss_scale", c.fp16.min_loss_scale}};
  out["bf16"] = {{"enabled", c.bf16_enabled}};
  out["optimizer"] = {{"type", c.optimizer.type},
                      {"params",
                       {{"lr", c.optimizer.lr},
                        {"betas", {c.optimizer.beta1, c.optimizer.beta2}},
                        {"eps", c.optimizer.eps},
                        {"weight_decay", c.optimizer.weight_decay},
                        {"adam_w_mode", c.optimizer.adam_w_mode},
                        {"bias_correction", c.optimizer.bias_correction}}}};
  out["scheduler"] = scheduler;
  const ZeroConfig& z = c.zero;
  out["zero_optimization"] = {
      {"stage", z.stage},
      {"overlap_comm", z.overlap_comm},
      {"contiguous_gradients", z.contiguous_gradients},
      {"reduce_scatter", z.reduce_scatter},
      {"reduce_bucket_size", z.reduce_bucket_size},
      {"allgather_bucket_size", z.allgather_bucket_size},
      {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size},
      {"stage3_max_live_parameters", z.stage3_max_live_parameters},
      {"stage3_max_reuse_distance", z.stage3_max_reuse_distance},
      {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold},
      {"sub_group_size", z.sub_group_size},
      {"offload_param", offload(z.offload_param, true)},
      {"offload_optimizer", offload(z.offload_optimizer, false)},
  };
  out["aio"] = {{"block_size", c.aio.block_size},
                {"queue_depth", c.aio.queue_depth},
                {"intra_op_parallelism", c.aio.intra_op_parallelism},
                {"single_submit", c.aio.single_submit},
                {"overlap_events", c.aio.overlap_events}};
  const ActivationCheckpointingConfig& a = c.activation_checkpointing;
  out["activation_checkpointing"] = {
      {"partition_activations", a.partition_activations},
      {"cpu_checkpointing", a.cpu_checkpointing},
      {"contiguous_memory_optimization", a.contiguous_memory_optimization},
      {"number_checkpoints", a.number_checkpoints == 0 ? json(nullptr) : json(a.number_checkpoints)},
      {"synchronize_checkpoint_boundary", a.synchronize_checkpoint_boundary},
      {"profile", a.profile}};
  out["tensorboard"] = monitor_config_to_json(c.tensorboard);
  out["csv_monitor"] = monitor_config_to_json(c.csv_monitor);
  out["strata"] = strata;
  return out;
}

}  // namespace strata
