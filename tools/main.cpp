// strata: train transformer models larger than GPU memory.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>

#include "comm/comm.h"
#include "kernels/backend.h"
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
  strata::kernels::GpuQuery gpus = strata::kernels::query_gpus();
  if (gpus.devices.empty()) fmt::print("  GPUs: none ({})\n", gpus.why_none);
  for (const auto& gpu : gpus.devices) {
    fmt::print("  GPU {}: {} ({:.1f} GiB, sm_{}{})\n", gpu.index, gpu.name,
               gpu.total_bytes / double(1ull << 30), gpu.compute_major, gpu.compute_minor);
  }
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

  CLI11_PARSE(app, argc, argv);
  for (size_t i = 0; i < apps.size(); ++i) {
    if (apps[i]->parsed()) return subcommands[i]->run();
  }
  if (!version) fmt::print("{}\n", app.help());
  print_version();
  return 0;
}
