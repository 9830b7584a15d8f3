// strata: train transformer models larger than GPU memory.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "comm/comm.h"
#include "kernels/backend.h"

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
  CLI11_PARSE(app, argc, argv);
  if (version || app.get_subcommands().empty()) {
    print_version();
    return 0;
  }
  return 0;
}
