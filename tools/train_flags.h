// The flags of `strata train` (tools/train_command.cpp): their values, and
// their definitions with the sections of --help they are listed in. The
// flags shared with `strata plan` (tools/config_flags.h) become the config's
// overrides; the rest say what to read, how long to train and what to write.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>

#include "tools/config_flags.h"

namespace strata::tools {

struct TrainFlags {
  std::string model;   // --model: preset, config.json or directory
  ConfigFlags config;  // the flags shared with `strata plan`, and --config
  std::string backend = "auto";
  std::string gemm = "auto";
  std::string data_path;
  std::string data_format = "auto";
  std::string loss_mask_path;
  std::string eval_path;
  int64_t eval_every = 0;
  int64_t eval_batches = 8;
  std::string init_path;
  uint64_t seed = 1234;
  int64_t steps = 100;
  std::string metrics_path;
  std::string trace_path;
  std::string export_path;
  std::string export_dtype = "fp32";
  std::string save_dir;
  int64_t save_every = 0;
  int keep = 0;
  std::string resume;
  bool print_config = false;
  bool print_plan = false;
  std::string hardware =
      "auto";  // --hardware: auto (this machine's probe), none, a preset or a file
};

// Defines every flag of `strata train` on `cmd`, storing into `flags`, which
// must outlive the parse.
void add_train_flags(CLI::App& cmd, TrainFlags& flags);

}  // namespace strata::tools
