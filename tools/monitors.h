// What the monitors share (TensorBoard, tools/tensorboard_writer.h; CSV,
// tools/csv_monitor_writer.h): the value they write, which DeepSpeed's
// monitors receive as a (log_name, value, step) tuple, and the directory they
// write in, made before training starts so that a bad one costs nothing.
#pragma once

#include <cstdint>
#include <string>

#include "io/base/status.h"

namespace strata::tools {

struct ScalarEvent {
  std::string tag;  // "Train/Samples/train_loss"
  double value = 0;
  int64_t step = 0;  // the x axis: the samples trained on so far, as in DeepSpeed
};

// Creates `directory` and its parents when missing; a directory that cannot
// be made, or that this process may not write in, is one line naming it.
Status create_monitor_directory(const std::string& directory);

}  // namespace strata::tools
