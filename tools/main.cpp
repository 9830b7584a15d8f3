// strata: train transformer models larger than GPU memory.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <string>

#include "comm/comm.h"
#include "kernels/backend.h"
#include "kernels/cpu/gemm.h"
#include "tools/subcommand.h"

namespace strata::tools {

std::vector<SubcommandFactory>& subcommand_factories() {
  static std::vector<SubcommandFactory> factories;
  return factories;
}

}  // namespace strata::tools

namespace {

void print_version() {
  fmt::print("strata {}\n", STRATA_VERSION);
  if (strata::kernels::built_with_cuda()) {
    fmt::print("  CUDA backend: built (CUDA runtime {}, NCCL {})\n",
               strata::kernels::cuda_runtime_version(), strata::comm::nccl_version());
  } else {
    fmt::print("  CUDA backend: not built (CPU-only)\n");
  }
  fmt::print("  CPU kernels: {}\n", strata::kernels::cpu::describe_cpu_kernels());
  strata::kernels::GpuQuery gpus = strata::kernels::query_gpus();
  if (gpus.devices.empty()) fmt::print("  GPUs: none ({})\n", gpus.why_none);
  for (const auto& gpu : gpus.devices) {
    fmt::print("  GPU {}: {} ({:.1f} GiB, sm_{}{})\n", gpu.index, gpu.name,
               gpu.total_bytes / double(1ull << 30), gpu.compute_major, gpu.compute_minor);
  }
}

// A command line CLI11 cannot read is a usage error like any other: one line
// on stderr, `strata <command>: <what is wrong>; <where to look>`, and exit
// status 2. Requests for help are not errors: CLI11 prints the help, exit 0.
int report_parse_error(const CLI::App& app, const CLI::ParseError& error) {
  constexpr int kUsageErrorStatus = 2;
  if (dynamic_cast<const CLI::Success*>(&error) != nullptr) return app.exit(error);

  // The subcommand being read when the error came, if any (none are nested).
  const std::vector<CLI::App*> named = app.get_subcommands();
  const std::string command = named.empty() ? "strata" : "strata " + named.front()->get_name();

  std::string what = error.what();
  if (dynamic_cast<const CLI::ExtrasError*>(&error) != nullptr) {
    // CLI11 lists the left-over arguments in reverse; name them in command-line order.
    const std::vector<std::string> left_over =
        named.empty() ? app.remaining() : named.front()->remaining();
    if (named.empty() && !left_over.empty() && !left_over.front().starts_with('-')) {
      std::vector<std::string> commands;
      for (const CLI::App* subcommand : app.get_subcommands(/*filter=*/{})) {
        commands.push_back(subcommand->get_name());
      }
      std::sort(commands.begin(), commands.end());
      what = fmt::format("'{}' is not a command; the commands are {}", left_over.front(),
                         fmt::join(commands, ", "));
    } else if (!left_over.empty()) {
      what = fmt::format("unexpected argument{} {}", left_over.size() == 1 ? "" : "s",
                         fmt::join(left_over, " "));
    }
  }
  if (!what.empty()) what[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(what[0])));
  std::replace(what.begin(), what.end(), '\n', ' ');
  fmt::print(stderr, "{}: {}; see `{} --help`\n", command, what, command);
  return kUsageErrorStatus;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata: train transformer models larger than GPU memory"};
  app.require_subcommand(0, 1);
  bool version = false;
  app.add_flag("--version", version, "Print the version, the backends built in and the GPUs seen");

  std::vector<std::unique_ptr<strata::tools::Subcommand>> subcommands;
  std::vector<CLI::App*> apps;
  for (auto& factory : strata::tools::subcommand_factories()) {
    subcommands.push_back(factory());
    apps.push_back(subcommands.back()->add_to(app));
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return report_parse_error(app, error);
  }
  for (size_t i = 0; i < apps.size(); ++i) {
    if (apps[i]->parsed()) return subcommands[i]->run();
  }
  if (!version) fmt::print("{}\n", app.help());
  print_version();
  return 0;
}
