// `strata topo`: the machine as the tiers see it — NUMA nodes and their CPUs,
// the node the pinned host pool goes on (the GPU's when there is one), the
// CPUs for I/O threads and for the optimizer, and each NVMe path's filesystem,
// device, node and free space. NVMe paths come from --nvme-path or the config
// file's offload blocks / strata.nvme_paths.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "core/config/config.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/simd.h"
#include "tiers/topology.h"
#include "tools/subcommand.h"

namespace strata::tools {
namespace {

class TopoCommand : public Subcommand {
 public:
  CLI::App* add_to(CLI::App& app) override {
    CLI::App* cmd = app.add_subcommand(
        "topo", "Show NUMA nodes, the GPU's node, CPUs for I/O and the optimizer, NVMe paths");
    cmd->add_option("--config", config_path_, "DeepSpeed JSON config (for its NVMe paths and aio)");
    cmd->add_option("--nvme-path", nvme_paths_, "NVMe directory; repeat for several");
    cmd->add_option("--io-threads", io_threads_,
                    "I/O threads per NVMe path (default: the config's aio.intra_op_parallelism)");
    cmd->add_flag("--json", json_, "Print one JSON object on stdout");
    return cmd;
  }

  int run() override {
    ConfigOverrides overrides;
    overrides.nvme_paths = nvme_paths_;
    Result<TrainConfig> config = load_train_config(config_path_, overrides);
    if (!config) {
      std::fprintf(stderr, "strata topo: %s\n", config.status().message().c_str());
      return 2;
    }
    const std::vector<std::string> paths = config->effective_nvme_paths();
    const unsigned per_path =
        io_threads_ > 0 ? io_threads_ : unsigned(std::max(1, config->aio.intra_op_parallelism));
    Result<tiers::TopologyReport> report =
        tiers::inspect_topology(paths, per_path * unsigned(std::max<size_t>(1, paths.size())));
    if (!report) {
      std::fprintf(stderr, "strata topo: %s\n", report.status().message().c_str());
      return 1;
    }
    if (!json_) {
      std::fputs(tiers::format_topology(*report).c_str(), stdout);
      std::printf("CPU kernels: %s\n", kernels::cpu::describe_cpu_kernels().c_str());
    } else {
      nlohmann::ordered_json json;
      json["numa_nodes"] = nlohmann::json::array();
      for (const tiers::NumaNodeInfo& node : report->nodes)
        json["numa_nodes"].push_back({{"node", node.os_index},
                                      {"cpus", node.cpus},
                                      {"cpu_count", node.cpu_count},
                                      {"memory_bytes", node.memory_bytes}});
      json["host_pool_node"] = report->host_node;
      json["gpu"] = report->gpu.empty() ? nlohmann::json(nullptr) : nlohmann::json(report->gpu);
      json["gpu_node"] =
          report->gpu_node ? nlohmann::json(*report->gpu_node) : nlohmann::json(nullptr);
      const kernels::cpu::GemmInfo gemm = kernels::cpu::gemm_info();
      json["cpu_kernels"] = {
          {"gemm", kernels::cpu::gemm_kernel_name(gemm.kernel)},
          {"gemm_library", gemm.library},
          {"gemm_library_core", gemm.library_core},
          {"gemm_chosen_by", gemm.chosen_by},
          {"gemm_threads", gemm.threads},
          {"adamw_simd", kernels::cpu::simd_level_name(kernels::cpu::active_simd_level())}};
      json["io_cpus"] = report->io_cpus;
      json["optimizer_cpus"] = report->optimizer_cpus;
      json["nvme_paths"] = nlohmann::json::array();
      for (const tiers::NvmePathInfo& path : report->nvme) {
        nlohmann::ordered_json entry = {{"path", path.path}};
        if (!path.error.empty()) {
          entry["error"] = path.error;
        } else {
          entry["filesystem"] = path.filesystem;
          entry["block_device"] = path.block_device;
          entry["numa_node"] =
              path.numa_node ? nlohmann::json(*path.numa_node) : nlohmann::json(nullptr);
          entry["free_bytes"] = path.free_bytes;
          entry["direct_io"] = path.direct_io;
        }
        json["nvme_paths"].push_back(entry);
      }
      std::printf("%s\n", json.dump(2).c_str());
    }
    // An unusable NVMe path is worth a non-zero exit: a run would refuse it.
    for (const tiers::NvmePathInfo& path : report->nvme)
      if (!path.error.empty()) return 1;
    return 0;
  }

 private:
  std::string config_path_;
  std::vector<std::string> nvme_paths_;
  unsigned io_threads_ = 0;
  bool json_ = false;
};

SubcommandRegistration registration([] { return std::make_unique<TopoCommand>(); });

}  // namespace
}  // namespace strata::tools
