// The machine as the tiers see it: NUMA nodes and their CPUs, the GPU's node
// (CUDA builds with a GPU), which node the pinned host pool lives on, how the
// CPUs of that node divide between I/O threads and the optimizer, and each
// NVMe path's filesystem and device. Read with hwloc; what `strata topo`
// prints and what a run prints in its first lines.
//
// Functions here are thread-safe (each loads its own hwloc topology).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "io/base/status.h"

namespace strata::tiers {

struct NumaNodeInfo {
  unsigned os_index = 0;
  std::string cpus;  // "0-15,32-47"
  unsigned cpu_count = 0;
  uint64_t memory_bytes = 0;
};

struct NvmePathInfo {
  std::string path;
  std::string filesystem;  // "ext4", "xfs", ... (io::inspect_swap_directory)
  bool direct_io = false;
  uint64_t free_bytes = 0;
  std::string block_device;           // "nvme0n1p1", or "" when unknown
  std::optional<unsigned> numa_node;  // the device's node, when the kernel says
  std::string error;                  // why the path cannot be used, or ""
};

struct TopologyReport {
  std::vector<NumaNodeInfo> nodes;
  unsigned host_node = 0;            // where the pinned host pool lives
  std::optional<unsigned> gpu_node;  // the GPU's node (CUDA build, GPU present)
  std::string gpu;                   // "NVIDIA H100 (0000:1b:00.0)", or "" without one
  std::string io_cpus;               // the host node's CPUs for I/O threads
  std::string optimizer_cpus;        // the rest of the node, for the optimizer's threads
  std::vector<NvmePathInfo> nvme;
};

// `io_threads`: how many I/O threads the run uses (paths x threads per path).
Result<TopologyReport> inspect_topology(const std::vector<std::string>& nvme_paths,
                                        unsigned io_threads, int gpu_index = 0);

// Several lines, one per node / GPU / path, for people.
std::string format_topology(const TopologyReport& report);

// The node the host pool should live on: the GPU's when there is one, else the
// node holding the first CPU this process may run on.
unsigned choose_host_node(int gpu_index = 0);

// Binds [data, data + size) to NUMA node `node` and touches every page from a
// thread bound to that node, so the pages are first-touched there. Without
// NUMA support (one node, or binding refused) the pages are touched where the
// caller runs and `notice` says so. Zeroes the range.
void first_touch_on_node(void* data, size_t size, unsigned node, std::string* notice);

}  // namespace strata::tiers
