// `strata train`: reads the model and the configuration. Until the engine
// lands, it can print the merged configuration (--print-config) and refuses to
// train with a message saying so.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "core/backend_choice.h"
#include "core/config.h"
#include "core/model_config.h"
#include "tools/config_flags.h"
#include "tools/subcommand.h"

namespace strata::tools {
namespace {

class TrainCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand("train", "Train a model");
    cmd->add_option("--model", model_, "Preset, config.json or Hugging Face model directory");
    flags_.add_to(*cmd, /*with_plan_names=*/false);
    cmd->add_option("--backend", backend_, "cpu | cuda | auto (default: cuda when a GPU is present)")
        ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
    cmd->add_flag("--print-config", print_config_, "Print the merged effective configuration as JSON and exit");
    return cmd;
  }

  int run() override {
    Result<TrainConfig> config = load_train_config(flags_.config_path, flags_.overrides);
    if (!config.is_ok()) {
      fmt::print(stderr, "strata train: {}\n", config.status().message());
      return 2;
    }
    print_config_warnings(*config);
    nlohmann::ordered_json effective = train_config_to_json(*config);
    if (!model_.empty()) {
      Result<ModelConfig> model = load_model_config(model_);
      if (!model.is_ok()) {
        fmt::print(stderr, "strata train: {}\n", model.status().message());
        return 2;
      }
      effective["strata"]["model"] = model->name;
      effective["strata"]["parameters"] = model->parameter_count();
    }
    if (print_config_) {
      fmt::print("{}\n", effective.dump(2));
      return 0;
    }
    Result<BackendChoice> backend = choose_backend(backend_);
    if (!backend.is_ok()) {
      fmt::print(stderr, "strata train: {}\n", backend.status().message());
      return 2;
    }
    if (!backend->notice.empty()) fmt::print(stderr, "{}\n", backend->notice);
    fmt::print(stderr,
               "strata train: this build has no training engine yet; use --print-config to check a "
               "configuration, or `strata plan` to size a run\n");
    return 2;
  }

 private:
  std::string model_;
  ConfigFlags flags_;
  std::string backend_ = "auto";
  bool print_config_ = false;
};

SubcommandRegistration registration([] { return std::make_unique<TrainCommand>(); });

}  // namespace
}  // namespace strata::tools
