// The DeepSpeed monitor blocks of a config file ("tensorboard", "csv_monitor",
// "wandb", "comet"), read for core/config/config.cpp: the two that write files
// into MonitorConfig with DeepSpeed's defaults; the two that need a network as
// a warning when enabled (they are not written), and silently when not. A
// malformed value is the reader's one-line error naming the file and the key.
#pragma once

#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "core/config/json_util.h"

namespace strata {

// Reads the four blocks from the root object `in` into `config` (its
// tensorboard, csv_monitor and warnings).
void read_monitor_blocks(JsonReader& in, TrainConfig& config);

// --tensorboard DIR over the file's tensorboard block (an empty DIR is refused).
Status apply_monitor_overrides(const ConfigOverrides& overrides, TrainConfig& config);

// A monitor block as --print-config shows it: enabled, output_path, job_name.
nlohmann::ordered_json monitor_config_to_json(const MonitorConfig& monitor);

}  // namespace strata
