#include "core/config/monitor_config.h"

#include <fmt/format.h>

#include <filesystem>

namespace strata {
namespace {

void read_file_monitor(JsonReader in, MonitorConfig& out) {
  in.optional_bool("enabled", out.enabled);
  in.optional_string("output_path", out.output_path);
  in.optional_string("job_name", out.job_name);
  if (out.enabled && out.directory().empty())
    in.fail("job_name", "output_path and job_name are both empty; name the directory to write in");
}

// A monitor that sends its values over a network: its keys are DeepSpeed's
// and accepted; enabled, it is a warning, and training goes on without it.
void read_network_monitor(JsonReader in, const char* name, const std::vector<std::string>& keys,
                          std::vector<std::string>& warnings) {
  bool enabled = false;
  in.optional_bool("enabled", enabled);
  for (const std::string& key : keys) in.accept(key);
  if (!enabled) return;
  warnings.push_back(fmt::format(
      "{}: {}.enabled is true, but strata writes no monitor that needs a network: nothing goes to "
      "{}; use the tensorboard block (or strata train --tensorboard DIR) instead",
      in.origin(), name, name));
}

}  // namespace

std::string MonitorConfig::directory() const {
  if (job_name.empty()) return output_path;  // os.path.join adds only a '/'
  return (std::filesystem::path(output_path) / job_name).string();
}

void read_monitor_blocks(JsonReader& in, TrainConfig& config) {
  read_file_monitor(in.object("tensorboard"), config.tensorboard);
  read_file_monitor(in.object("csv_monitor"), config.csv_monitor);
  read_network_monitor(in.object("wandb"), "wandb", {"group", "team", "project"}, config.warnings);
  read_network_monitor(in.object("comet"), "comet",
                       {"samples_log_interval", "project", "workspace", "api_key",
                        "experiment_name", "experiment_key", "online", "mode"},
                       config.warnings);
}

Status apply_monitor_overrides(const ConfigOverrides& overrides, TrainConfig& config) {
  if (!overrides.tensorboard_dir) return Status::ok();
  if (overrides.tensorboard_dir->empty())
    return Status::invalid_argument("--tensorboard: expected the directory to write in, got ''");
  config.tensorboard.enabled = true;
  config.tensorboard.output_path = *overrides.tensorboard_dir;
  config.tensorboard.job_name.clear();
  return Status::ok();
}

nlohmann::ordered_json monitor_config_to_json(const MonitorConfig& monitor) {
  return {{"enabled", monitor.enabled},
          {"output_path", monitor.output_path},
          {"job_name", monitor.job_name}};
}

}  // namespace strata
