// The DeepSpeed-compatible configuration: every supported key's default, a
// valid value that changes it, and a bad value that is refused naming the key.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <unistd.h>

#include "core/config/config.h"

namespace strata {
namespace {

using nlohmann::json;

// Sets `value` at the dotted `path` inside `doc`, creating objects on the way.
void set_path(json& doc, const std::string& path, const json& value) {
  json* node = &doc;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (dot == std::string::npos) {
      (*node)[key] = value;
      return;
    }
    node = &(*node)[key];
    start = dot + 1;
  }
}

json get_path(const nlohmann::ordered_json& doc, const std::string& path) {
  json plain = json::parse(doc.dump());
  return plain.at(json::json_pointer("/" + std::regex_replace(path, std::regex("\\."), "/")));
}

ConfigOverrides with_overrides(const std::function<void(ConfigOverrides&)>& set) {
  ConfigOverrides overrides;
  set(overrides);
  return overrides;
}

Result<TrainConfig> parse(const json& doc, const ConfigOverrides& overrides = {}) {
  return train_config_from_json(doc, "test.json", overrides);
}

struct KeyCase {
  std::string path;     // key path in the file (and in the effective config unless `shown_as`)
  json expected_default;
  json valid;           // a value different from the default
  json invalid;         // a value that must be refused
  std::string shown_as = "";  // key path in the effective config when it differs
  json context = nullptr;     // extra keys the valid value needs (merged into the document)
};

std::vector<KeyCase> key_cases() {
  json zero3 = {{"zero_optimization", {{"stage", 3}}}};
  json warmup = {{"scheduler", {{"type", "WarmupLR"}}}};
  json decay = {{"scheduler", {{"type", "WarmupDecayLR"}}}};
  json cosine = {{"scheduler", {{"type", "WarmupCosineLR"}}}};
  json fp16 = {{"fp16", {{"enabled", true}}}};
  json shuffled = {{"strata", {{"shuffle", true}}}};
  return {
      {"train_batch_size", 1, 8, 0, "", {{"train_micro_batch_size_per_gpu", 8}}},
      {"train_micro_batch_size_per_gpu", 1, 4, -2},
      {"gradient_accumulation_steps", 1, 3, "three"},
      {"steps_per_print", 10, 100, 0},
      {"gradient_clipping", 0.0, 1.0, -1.0},
      {"fp16.enabled", false, true, "yes"},
      {"fp16.loss_scale", 0.0, 128.0, -1},
      {"fp16.initial_scale_power", 16, 12, 64},
      {"fp16.loss_scale_window", 1000, 500, 0},
      {"fp16.hysteresis", 2, 4, 0},
      {"fp16.consecutive_hysteresis", false, true, 1},
      {"fp16.min_loss_scale", 1.0, 0.5, "small"},
      {"bf16.enabled", false, true, "on"},
      {"optimizer.type", "AdamW", "Adam", "Lamb"},
      {"optimizer.params.lr", 1e-3, 3e-4, -0.1},
      {"optimizer.params.betas", json::array({0.9, 0.999}), json::array({0.8, 0.95}), json::array({0.9})},
      {"optimizer.params.eps", 1e-8, 1e-6, "tiny"},
      {"optimizer.params.weight_decay", 0.0, 0.1, -0.1},
      {"optimizer.params.adam_w_mode", true, false, "no", "", {{"optimizer", {{"type", "Adam"}}}}},
      {"optimizer.params.bias_correction", true, false, 0},
      {"scheduler.type", nullptr, "WarmupLR", "OneCycle", "scheduler"},
      {"scheduler.params.warmup_min_lr", 0.0, 1e-5, -1, "", warmup},
      {"scheduler.params.warmup_max_lr", 1e-3, 5e-4, "high", "", warmup},
      {"scheduler.params.warmup_num_steps", 1000, 50, -5, "", warmup},
      {"scheduler.params.warmup_type", "log", "linear", "cubic", "", warmup},
      {"scheduler.params.total_num_steps", 0, 2000, 0, "", decay},
      {"scheduler.params.warmup_min_ratio", 0.0, 0.1, 2.0, "", cosine},
      {"scheduler.params.cos_min_ratio", 1e-4, 0.01, -0.5, "", cosine},
      {"zero_optimization.stage", 0, 2, 4},
      {"zero_optimization.overlap_comm", false, true, "x"},
      {"zero_optimization.contiguous_gradients", true, false, 3},
      {"zero_optimization.reduce_scatter", true, false, "x"},
      {"zero_optimization.reduce_bucket_size", 500000000, 200000000, -1},
      {"zero_optimization.allgather_bucket_size", 500000000, 200000000, 1.5},
      {"zero_optimization.stage3_prefetch_bucket_size", 50000000, 1000000, "big"},
      {"zero_optimization.stage3_max_live_parameters", 1000000000, 0, -1},
      {"zero_optimization.stage3_max_reuse_distance", 1000000000, 0, -1},
      {"zero_optimization.stage3_param_persistence_threshold", 100000, 1000, -1},
      {"zero_optimization.sub_group_size", 1000000000, 100000000, -1},
      {"zero_optimization.offload_param.device", "none", "cpu", "gpu", "", zero3},
      {"zero_optimization.offload_param.nvme_path", nullptr, "/tmp", 7},
      {"zero_optimization.offload_param.pin_memory", false, true, "x"},
      {"zero_optimization.offload_param.buffer_count", 5, 8, 0},
      {"zero_optimization.offload_param.buffer_size", 100000000, 50000000, 0},
      {"zero_optimization.offload_param.max_in_cpu", 1000000000, 0, -1},
      {"zero_optimization.offload_optimizer.device", "none", "cpu", "disk"},
      {"zero_optimization.offload_optimizer.nvme_path", nullptr, "/tmp", false},
      {"zero_optimization.offload_optimizer.pin_memory", false, true, 2},
      {"zero_optimization.offload_optimizer.buffer_count", 4, 6, -1},
      {"aio.block_size", 1048576, 4194304, 1000},
      {"aio.queue_depth", 8, 32, 0},
      {"aio.intra_op_parallelism", 1, 4, 0},
      {"aio.thread_count", 1, 2, 0, "aio.intra_op_parallelism"},
      {"aio.single_submit", false, true, "x"},
      {"aio.overlap_events", true, false, "x"},
      {"activation_checkpointing.partition_activations", false, true, 1},
      {"activation_checkpointing.cpu_checkpointing", false, true, 1},
      {"activation_checkpointing.contiguous_memory_optimization", false, true, 1},
      {"activation_checkpointing.number_checkpoints", nullptr, 4, -1},
      {"activation_checkpointing.synchronize_checkpoint_boundary", false, true, 1},
      {"activation_checkpointing.profile", false, true, 1},
      {"tensorboard.enabled", false, true, "yes"},
      {"tensorboard.output_path", "", "runs/tb", 7},
      {"tensorboard.job_name", "DeepSpeedJobName", "run-1", false},
      {"csv_monitor.enabled", false, true, 1},
      {"csv_monitor.output_path", "", "runs/csv", json::array()},
      {"csv_monitor.job_name", "DeepSpeedJobName", "run-1", 3},
      {"strata.device_mem_limit", nullptr, "80G", "lots"},
      {"strata.host_mem_limit", nullptr, 1073741824, true},
      {"strata.nvme_paths", json::array(), json::array({"/a", "/b"}), json::array({1})},
      {"strata.gradient_reduce_dtype", "fp32", "bf16", "fp8"},
      {"strata.optimizer_state_dtype", "fp32", "int8", "fp8"},
      {"strata.gradient_home", "auto", "nvme", "disk"},
      {"strata.activation_home", "auto", "nvme", "disk"},
      {"strata.seq_len", nullptr, 512, 0},
      {"strata.world_size", 1, 2, 0},
      {"strata.precision", "fp32", "bf16", "fp64"},
      {"strata.shuffle", false, true, "yes"},
      {"strata.shuffle_seed", nullptr, 18446744073709551615ull, -1, "", shuffled},
  };
}

TEST(Config, EveryKeyHasItsDeepSpeedDefault) {
  Result<TrainConfig> config = parse(json::object());
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  nlohmann::ordered_json effective = train_config_to_json(*config);
  for (const KeyCase& c : key_cases()) {
    if (c.path == "scheduler.type") {
      EXPECT_TRUE(effective["scheduler"].is_null());
      continue;
    }
    if (!c.context.is_null()) continue;  // needs another key; checked below
    std::string shown = c.shown_as.empty() ? c.path : c.shown_as;
    EXPECT_EQ(get_path(effective, shown), c.expected_default) << c.path;
  }
}

TEST(Config, DefaultsThatNeedAnotherKeyToShow) {
  for (const KeyCase& c : key_cases()) {
    if (c.context.is_null()) continue;
    Result<TrainConfig> config = parse(c.context);
    ASSERT_TRUE(config.is_ok()) << c.path << ": " << config.status().message();
    std::string shown = c.shown_as.empty() ? c.path : c.shown_as;
    if (c.path == "train_batch_size") continue;  // derived from the micro batch; see batch tests
    EXPECT_EQ(get_path(train_config_to_json(*config), shown), c.expected_default) << c.path;
  }
}

TEST(Config, EveryKeyTakesAValidValue) {
  for (const KeyCase& c : key_cases()) {
    json doc = c.context.is_null() ? json::object() : c.context;
    set_path(doc, c.path, c.valid);
    Result<TrainConfig> config = parse(doc);
    ASSERT_TRUE(config.is_ok()) << c.path << ": " << config.status().message();
    EXPECT_TRUE(config->warnings.empty()) << c.path << ": " << config->warnings.front();
    std::string shown = c.shown_as.empty() ? c.path : c.shown_as;
    json expected = c.valid;
    if (c.path == "strata.device_mem_limit") expected = 80ull << 30;
    if (c.path == "scheduler.type") {
      EXPECT_EQ(get_path(train_config_to_json(*config), "scheduler.type"), "WarmupLR");
      continue;
    }
    EXPECT_EQ(get_path(train_config_to_json(*config), shown), expected) << c.path;
  }
}

TEST(Config, EveryKeyRefusesABadValueNamingFileAndKey) {
  for (const KeyCase& c : key_cases()) {
    json doc = c.context.is_null() ? json::object() : c.context;
    set_path(doc, c.path == "scheduler.type" ? "scheduler.type" : c.path, c.invalid);
    Result<TrainConfig> config = parse(doc);
    ASSERT_FALSE(config.is_ok()) << c.path << " accepted " << c.invalid.dump();
    const std::string& message = config.status().message();
    EXPECT_NE(message.find("test.json"), std::string::npos) << message;
    // Errors about a key name its path (the batch triple names its equation instead).
    if (c.path != "train_batch_size") {
      std::string leaf = c.path.substr(c.path.rfind('.') + 1);
      EXPECT_NE(message.find(leaf), std::string::npos) << c.path << ": " << message;
    }
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

TEST(Config, AutoValuesCountAsNotGiven) {
  json doc = json::parse(R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
      "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
      "weight_decay": "auto"}}})");
  Result<TrainConfig> config = parse(doc);
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  EXPECT_EQ(config->train_micro_batch_size_per_gpu, 1);
  EXPECT_DOUBLE_EQ(config->optimizer.lr, 1e-3);
  EXPECT_FALSE(config->bf16_enabled);
  EXPECT_TRUE(config->warnings.empty());
}

TEST(Config, UnknownKeysAreWarningsWithTheirPath) {
  json doc = json::parse(R"({"train_micro_batch_size_per_gpu": 2, "flops_profiler": {"enabled": true},
      "zero_optimization": {"stage": 2, "stage3_gather_16bit_weights_on_model_save": true},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "amsgrad": false}}})");
  Result<TrainConfig> config = parse(doc);
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  ASSERT_EQ(config->warnings.size(), 3u);
  std::string all;
  for (const auto& w : config->warnings) all += w + "\n";
  EXPECT_NE(all.find("test.json: unknown key 'flops_profiler' ignored"), std::string::npos) << all;
  EXPECT_NE(all.find("'zero_optimization.stage3_gather_16bit_weights_on_model_save'"), std::string::npos);
  EXPECT_NE(all.find("'optimizer.params.amsgrad'"), std::string::npos);
}

TEST(Config, MonitorBlocksWriteIntoOutputPathJoinedWithJobNameAsDeepSpeedDoes) {
  Result<TrainConfig> config = parse(json::parse(R"({
    "tensorboard": {"enabled": true, "output_path": "runs/tb", "job_name": "llama-1"},
    "csv_monitor": {"enabled": true}})"));
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  EXPECT_TRUE(config->warnings.empty()) << config->warnings.front();
  EXPECT_EQ(config->tensorboard.directory(), "runs/tb/llama-1");
  // DeepSpeed's default output_path is "": the job's directory under the current one.
  EXPECT_EQ(config->csv_monitor.directory(), "DeepSpeedJobName");
  MonitorConfig absolute{true, "runs", "/data/job"};
  EXPECT_EQ(absolute.directory(), "/data/job");  // os.path.join keeps an absolute job_name alone
  // Disabled blocks are read and write nothing; so is a block that is absent.
  Result<TrainConfig> off = parse(json::parse(R"({"tensorboard": {"enabled": false}})"));
  ASSERT_TRUE(off.is_ok()) << off.status().message();
  EXPECT_FALSE(off->tensorboard.enabled);
  EXPECT_FALSE(off->csv_monitor.enabled);
  EXPECT_TRUE(off->warnings.empty()) << off->warnings.front();
}

TEST(Config, AnEnabledMonitorWithoutADirectoryIsRefused) {
  Result<TrainConfig> config = parse(
      json::parse(R"({"csv_monitor": {"enabled": true, "output_path": "", "job_name": ""}})"));
  ASSERT_FALSE(config.is_ok());
  const std::string& message = config.status().message();
  EXPECT_NE(message.find("test.json: csv_monitor.job_name"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
}

TEST(Config, NetworkMonitorsAreAWarningNamingTensorBoardAndTrainingGoesOn) {
  Result<TrainConfig> config = parse(json::parse(R"({
    "wandb": {"enabled": true, "group": "g", "team": "t", "project": "p"},
    "comet": {"enabled": true, "project": "p", "workspace": "w", "api_key": "k",
              "samples_log_interval": 10, "experiment_name": "e", "online": false}})"));
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  ASSERT_EQ(config->warnings.size(), 2u);
  for (const std::string& warning : config->warnings) {
    EXPECT_EQ(warning.find('\n'), std::string::npos) << warning;
    EXPECT_NE(warning.find("tensorboard"), std::string::npos) << warning;
    EXPECT_NE(warning.find("--tensorboard"), std::string::npos) << warning;
  }
  EXPECT_EQ(config->warnings[0].rfind("test.json: wandb.enabled is true", 0), 0u)
      << config->warnings[0];
  EXPECT_EQ(config->warnings[1].rfind("test.json: comet.enabled is true", 0), 0u)
      << config->warnings[1];
  EXPECT_FALSE(config->tensorboard.enabled);  // nothing is written in their place

  // Disabled, they are accepted silently; their keys are DeepSpeed's, another is unknown.
  Result<TrainConfig> off = parse(json::parse(
      R"({"wandb": {"enabled": false, "project": "p"}, "comet": {"mode": "get", "colour": 1}})"));
  ASSERT_TRUE(off.is_ok()) << off.status().message();
  ASSERT_EQ(off->warnings.size(), 1u);
  EXPECT_EQ(off->warnings[0], "test.json: unknown key 'comet.colour' ignored");

  for (const char* bad : {R"({"wandb": {"enabled": "yes"}})", R"({"comet": true})"}) {
    Result<TrainConfig> refused = parse(json::parse(bad));
    ASSERT_FALSE(refused.is_ok()) << bad;
    const std::string& message = refused.status().message();
    EXPECT_EQ(message.rfind("test.json: ", 0), 0u) << message;
    EXPECT_TRUE(message.find("wandb.enabled") != std::string::npos ||
                message.find("comet") != std::string::npos)
        << message;
  }
}

TEST(Config, TheTensorboardFlagWritesIntoItsDirectoryOverTheFile) {
  const json doc = json::parse(R"({"tensorboard": {"enabled": false, "job_name": "j"}})");
  Result<TrainConfig> config =
      parse(doc, with_overrides([](ConfigOverrides& o) { o.tensorboard_dir = "runs/tb"; }));
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  EXPECT_TRUE(config->tensorboard.enabled);
  EXPECT_EQ(config->tensorboard.directory(), "runs/tb");
  // The effective config says so, and its block reads back to the same directory.
  const json block = get_path(train_config_to_json(*config), "tensorboard");
  EXPECT_EQ(block, json::parse(R"({"enabled": true, "output_path": "runs/tb", "job_name": ""})"));
  Result<TrainConfig> again = train_config_from_json({{"tensorboard", block}}, "effective", {});
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again->tensorboard.directory(), "runs/tb");

  Result<TrainConfig> empty =
      parse(doc, with_overrides([](ConfigOverrides& o) { o.tensorboard_dir = ""; }));
  ASSERT_FALSE(empty.is_ok());
  EXPECT_EQ(empty.status().message().rfind("--tensorboard: ", 0), 0u) << empty.status().message();
}

TEST(Config, AdamMeansDecoupledUnlessAdamWModeIsFalse) {
  Result<TrainConfig> adam = parse(json::parse(R"({"optimizer": {"type": "Adam"}})"));
  ASSERT_TRUE(adam.is_ok());
  EXPECT_TRUE(adam->optimizer.adam_w_mode);
  Result<TrainConfig> l2 = parse(json::parse(R"({"optimizer": {"type": "adam", "params": {"adam_w_mode": false}}})"));
  ASSERT_TRUE(l2.is_ok());
  EXPECT_FALSE(l2->optimizer.adam_w_mode);
  EXPECT_EQ(l2->optimizer.type, "Adam");
  Result<TrainConfig> bad = parse(json::parse(R"({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": false}}})"));
  EXPECT_FALSE(bad.is_ok());
}

TEST(Config, StageThreeDefaultsOverlapCommOn) {
  Result<TrainConfig> config = parse(json::parse(R"({"zero_optimization": {"stage": 3}})"));
  ASSERT_TRUE(config.is_ok());
  EXPECT_TRUE(config->zero.overlap_comm);
  Result<TrainConfig> flagged = parse(json::object(), with_overrides([](ConfigOverrides& o) { o.zero_stage = 3; }));
  ASSERT_TRUE(flagged.is_ok());
  EXPECT_TRUE(flagged->zero.overlap_comm);
  // A value the file gives stays, whatever stage the flag picks.
  ConfigOverrides to_stage3;
  to_stage3.zero_stage = 3;
  Result<TrainConfig> kept = parse(json::parse(R"({"zero_optimization": {"overlap_comm": false}})"), to_stage3);
  ASSERT_TRUE(kept.is_ok());
  EXPECT_FALSE(kept->zero.overlap_comm);
}

TEST(Config, OffloadParamBelowStageThreeIsRefusedWithTheReason) {
  Result<TrainConfig> config = parse(json::parse(
      R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})"));
  ASSERT_FALSE(config.is_ok());
  EXPECT_NE(config.status().message().find("needs ZeRO stage 3 (stage is 2)"), std::string::npos)
      << config.status().message();
}

TEST(Config, NvmeOffloadNeedsADirectory) {
  Result<TrainConfig> config = parse(json::parse(
      R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})"));
  ASSERT_FALSE(config.is_ok());
  EXPECT_NE(config.status().message().find("--nvme-path"), std::string::npos);
  ConfigOverrides with_path;
  with_path.nvme_paths = {"/mnt/a", "/mnt/b"};
  Result<TrainConfig> fixed = parse(json::parse(
      R"({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})"), with_path);
  ASSERT_TRUE(fixed.is_ok()) << fixed.status().message();
  EXPECT_EQ(fixed->effective_nvme_paths(), (std::vector<std::string>{"/mnt/a", "/mnt/b"}));
}

TEST(Config, PartialOptimizerOffloadIsRefused) {
  Result<TrainConfig> half = parse(json::parse(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})"));
  ASSERT_FALSE(half.is_ok());
  EXPECT_NE(half.status().message().find("offload_optimizer.ratio"), std::string::npos);
  Result<TrainConfig> whole = parse(json::parse(
      R"({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.0}}})"));
  ASSERT_TRUE(whole.is_ok()) << whole.status().message();
  EXPECT_TRUE(whole->warnings.empty());
}

TEST(Config, BothHalfPrecisionsAtOnceAreRefused) {
  Result<TrainConfig> config = parse(json::parse(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"));
  ASSERT_FALSE(config.is_ok());
  EXPECT_NE(config.status().message().find("both true"), std::string::npos);
}

TEST(Config, FlagsOverrideTheFile) {
  json doc = json::parse(R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
      "bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
      "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1}})");
  ConfigOverrides o;
  o.zero_stage = 3;
  o.offload_param = "nvme";
  o.offload_optimizer = "nvme";
  o.nvme_paths = {"/fast0", "/fast1"};
  o.micro_batch = 4;
  o.world_size = 2;
  o.precision = "fp16";
  o.lr = 3e-4;
  o.aio_block_size = "4M";
  o.aio_queue_depth = 32;
  o.aio_threads = 2;
  o.device_mem_limit = "80G";
  o.host_mem_limit = "512M";
  o.seq_len = 4096;
  Result<TrainConfig> config = parse(doc, o);
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  const TrainConfig& c = *config;
  EXPECT_EQ(c.zero.stage, 3);
  EXPECT_EQ(c.zero.offload_param.device, OffloadDevice::nvme);
  EXPECT_EQ(c.zero.offload_optimizer.device, OffloadDevice::nvme);
  EXPECT_EQ(c.zero.offload_param.nvme_path, "/fast0");
  EXPECT_EQ(c.effective_nvme_paths().size(), 2u);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu, 4);
  EXPECT_EQ(c.world_size, 2);
  EXPECT_EQ(c.train_batch_size, 16);  // 4 * 2 * 2
  EXPECT_EQ(c.precision, Precision::fp16);
  EXPECT_FALSE(c.bf16_enabled);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_EQ(c.aio.block_size, 4 << 20);
  EXPECT_EQ(c.aio.queue_depth, 32);
  EXPECT_EQ(c.aio.intra_op_parallelism, 2);
  EXPECT_EQ(*c.strata.device_mem_limit, 80ull << 30);
  EXPECT_EQ(*c.strata.host_mem_limit, 512ull << 20);
  EXPECT_EQ(*c.strata.seq_len, 4096);
}

TEST(Config, ShuffleFlagsOverrideTheFileAndASeedThatOrdersNothingIsAWarning) {
  const json doc = json::parse(R"({"strata": {"shuffle": true, "shuffle_seed": 3}})");
  Result<TrainConfig> file = parse(doc);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  EXPECT_TRUE(file->strata.shuffle);
  EXPECT_EQ(file->strata.shuffle_seed, 3u);
  EXPECT_TRUE(file->warnings.empty());
  Result<TrainConfig> seeded =
      parse(doc, with_overrides([](ConfigOverrides& o) { o.shuffle_seed = 8; }));
  ASSERT_TRUE(seeded.is_ok()) << seeded.status().message();
  EXPECT_EQ(seeded->strata.shuffle_seed, 8u);
  Result<TrainConfig> off =
      parse(doc, with_overrides([](ConfigOverrides& o) { o.shuffle = false; }));
  ASSERT_TRUE(off.is_ok()) << off.status().message();
  EXPECT_FALSE(off->strata.shuffle);
  EXPECT_TRUE(off->warnings.empty()) << "--no-shuffle is a choice: " << off->warnings.front();
  Result<TrainConfig> on =
      parse(json::object(), with_overrides([](ConfigOverrides& o) { o.shuffle = true; }));
  ASSERT_TRUE(on.is_ok()) << on.status().message();
  EXPECT_TRUE(on->strata.shuffle);
  EXPECT_FALSE(on->strata.shuffle_seed.has_value());  // strata train fills in --seed
  Result<TrainConfig> alone =
      parse(json::object(), with_overrides([](ConfigOverrides& o) { o.shuffle_seed = 8; }));
  ASSERT_TRUE(alone.is_ok()) << alone.status().message();
  ASSERT_EQ(alone->warnings.size(), 1u);
  EXPECT_NE(alone->warnings[0].find("--shuffle-seed 8 has no effect"), std::string::npos)
      << alone->warnings[0];
}

TEST(Config, BadFlagValuesNameTheFlag) {
  struct Case {
    ConfigOverrides overrides;
    std::string flag;
  };
  std::vector<Case> cases;
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.zero_stage = 5; }), "--zero-stage"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.offload_param = "disk"; }), "--offload-param"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.offload_optimizer = "gpu"; }), "--offload-optimizer"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.micro_batch = 0; }), "--micro-batch"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.grad_accum = -1; }), "--grad-accum"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.global_batch = 0; }), "--global-batch"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.world_size = 0; }), "--world-size"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.precision = "fp8"; }), "--precision"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.lr = -1.0; }), "--lr"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.aio_block_size = "1000"; }), "--aio-block-size"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.aio_block_size = "big"; }), "--aio-block-size"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.aio_queue_depth = 0; }), "--aio-queue-depth"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.aio_threads = 0; }), "--aio-threads"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.device_mem_limit = "80 apples"; }), "--device-mem-limit"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.host_mem_limit = "-3G"; }), "--host-mem-limit"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.seq_len = 0; }), "--seq-len"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.optimizer_state_dtype = "int4"; }),
                   "--optimizer-state-dtype"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.gradient_home = "disk"; }),
                   "--gradient-home"});
  cases.push_back({with_overrides([](ConfigOverrides& o) { o.activation_home = "disk"; }),
                   "--activation-home"});
  for (const Case& c : cases) {
    Result<TrainConfig> config = parse(json::object(), c.overrides);
    ASSERT_FALSE(config.is_ok()) << c.flag;
    EXPECT_NE(config.status().message().find(c.flag), std::string::npos) << config.status().message();
  }
}

// --- the batch triple (DeepSpeed's rules: any two fix the third) ---

struct Batch {
  std::optional<int64_t> train, micro, accum;
  int world;
};

Result<TrainConfig> batch(const Batch& b) {
  json doc = json::object();
  if (b.train) doc["train_batch_size"] = *b.train;
  if (b.micro) doc["train_micro_batch_size_per_gpu"] = *b.micro;
  if (b.accum) doc["gradient_accumulation_steps"] = *b.accum;
  return parse(doc, with_overrides([&](ConfigOverrides& o) { o.world_size = b.world; }));
}

TEST(BatchTriple, AnyTwoFixTheThird) {
  struct Case {
    Batch in;
    int64_t train, micro, accum;
  };
  std::vector<Case> cases = {
      {{64, 4, 2, 8}, 64, 4, 2},              // all three, consistent
      {{64, 4, std::nullopt, 4}, 64, 4, 4},   // accum = 64 / (4 * 4)
      {{96, std::nullopt, 3, 4}, 96, 8, 3},   // micro = 96 / (3 * 4)
      {{std::nullopt, 5, 3, 2}, 30, 5, 3},    // train = 5 * 3 * 2
      {{48, std::nullopt, std::nullopt, 4}, 48, 12, 1},  // only the global batch: accum 1
      {{std::nullopt, 6, std::nullopt, 3}, 18, 6, 1},    // only the micro batch: accum 1
      {{std::nullopt, std::nullopt, std::nullopt, 2}, 2, 1, 1},  // strata's default micro batch 1
  };
  for (const Case& c : cases) {
    Result<TrainConfig> config = batch(c.in);
    ASSERT_TRUE(config.is_ok()) << config.status().message();
    EXPECT_EQ(config->train_batch_size, c.train);
    EXPECT_EQ(config->train_micro_batch_size_per_gpu, c.micro);
    EXPECT_EQ(config->gradient_accumulation_steps, c.accum);
  }
}

TEST(BatchTriple, InconsistentValuesShowTheEquationWithTheNumbers) {
  Result<TrainConfig> config = batch({64, 4, 2, 4});
  ASSERT_FALSE(config.is_ok());
  EXPECT_NE(config.status().message().find("64 != 4 * 2 * 4"), std::string::npos)
      << config.status().message();
  Result<TrainConfig> indivisible = batch({30, 4, std::nullopt, 2});
  ASSERT_FALSE(indivisible.is_ok());
  EXPECT_NE(indivisible.status().message().find("30 != 4 *"), std::string::npos)
      << indivisible.status().message();
}

TEST(BatchTriple, AFlagThatBreaksTheFileSaysWhereEachNumberCameFrom) {
  json doc = json::parse(R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2})");
  Result<TrainConfig> config = parse(doc, with_overrides([](ConfigOverrides& o) { o.world_size = 4; }));
  ASSERT_FALSE(config.is_ok());
  const std::string& message = config.status().message();
  EXPECT_NE(message.find("64 != 4 * 2 * 4"), std::string::npos) << message;
  EXPECT_NE(message.find("world size from --world-size"), std::string::npos) << message;
  // Replacing the global batch on the command line resolves it.
  Result<TrainConfig> fixed = parse(doc, with_overrides([](ConfigOverrides& o) { o.global_batch = 32; o.world_size = 4; }));
  ASSERT_TRUE(fixed.is_ok()) << fixed.status().message();
  EXPECT_EQ(fixed->train_batch_size, 32);
}

// --- files ---

class ConfigFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("strata_config_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    std::filesystem::path path = dir_ / name;
    std::ofstream(path) << text;
    return path.string();
  }
  std::filesystem::path dir_;
};

TEST_F(ConfigFile, MalformedJsonGivesLineAndColumn) {
  std::string path = write("bad.json", "{\n  \"train_batch_size\": 8,\n  \"fp16\": {\"enabled\": tru}\n}\n");
  Result<TrainConfig> config = load_train_config(path, {});
  ASSERT_FALSE(config.is_ok());
  EXPECT_NE(config.status().message().find(path + ":3:"), std::string::npos) << config.status().message();
  EXPECT_NE(config.status().message().find("malformed JSON"), std::string::npos);
  EXPECT_TRUE(config.status().is(StatusCode::invalid_argument)) << config.status().message();
}

TEST_F(ConfigFile, MissingFileSaysWhatToCheck) {
  Result<TrainConfig> config = load_train_config((dir_ / "absent.json").string(), {});
  ASSERT_FALSE(config.is_ok());
  EXPECT_NE(config.status().message().find("absent.json"), std::string::npos);
  EXPECT_NE(config.status().message().find("No such file"), std::string::npos);
  EXPECT_NE(config.status().message().find("check the path"), std::string::npos);
  EXPECT_TRUE(config.status().is(StatusCode::not_found)) << config.status().message();
}

TEST_F(ConfigFile, ARealDeepSpeedZeroInfinityConfigReadsAsIs) {
  std::string path = write("ds_zero3_nvme.json", R"({
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8,
    "steps_per_print": 50, "wall_clock_breakdown": false, "gradient_clipping": 1.0,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5,
                  "warmup_num_steps": 100, "total_num_steps": 1000}},
    "zero_optimization": {"stage": 3, "contiguous_gradients": true, "overlap_comm": true,
      "reduce_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
      "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9, "sub_group_size": 1e8,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true, "buffer_count": 4},
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": true,
                        "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9}},
    "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": false, "overlap_events": true},
    "activation_checkpointing": {"partition_activations": false, "cpu_checkpointing": false}
  })");
  Result<TrainConfig> config = load_train_config(path, {});
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  EXPECT_TRUE(config->warnings.empty()) << config->warnings.front();
  EXPECT_EQ(config->precision, Precision::bf16);
  EXPECT_EQ(config->zero.sub_group_size, 100000000);
  EXPECT_EQ(config->scheduler.type, "WarmupDecayLR");
  EXPECT_EQ(config->scheduler.total_num_steps, 1000);
  EXPECT_DOUBLE_EQ(config->optimizer.beta2, 0.95);
  EXPECT_EQ(config->effective_nvme_paths(), std::vector<std::string>{"/local_nvme"});
  // The effective config reads back to the same configuration.
  Result<TrainConfig> again = train_config_from_json(json::parse(train_config_to_json(*config).dump()),
                                                     "effective", {});
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_TRUE(again->warnings.empty()) << again->warnings.front();
  EXPECT_EQ(train_config_to_json(*again).dump(), train_config_to_json(*config).dump());
}

}  // namespace
}  // namespace strata
