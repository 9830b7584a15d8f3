// The command-line flags that override the config file, shared by `strata
// train` and `strata plan` so both read a configuration the same way.
#pragma once

#include <string>

#include "core/config/config.h"

namespace CLI {
class App;
}

namespace strata::tools {

struct ConfigFlags {
  std::string config_path;
  ConfigOverrides overrides;
  // Both commands accept --stage and --zero-stage; `with_plan_names` makes --stage the one shown.
  void add_to(CLI::App& app, bool with_plan_names);
};

// Prints each warning on stderr as one line.
void print_config_warnings(const TrainConfig& config);

}  // namespace strata::tools
