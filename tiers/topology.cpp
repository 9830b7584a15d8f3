#include "tiers/topology.h"

#include <fmt/format.h>
#include <hwloc.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>

#include "io/base/sizes.h"
#include "io/base/status.h"
#include "io/swap_directory.h"

#ifdef STRATA_HAS_CUDA
#include <cuda_runtime_api.h>
#endif

namespace strata::tiers {
namespace {

// One loaded hwloc topology, destroyed with the object.
class Hwloc {
 public:
  Hwloc() {
    if (hwloc_topology_init(&topology_) != 0) return;
    hwloc_topology_set_io_types_filter(topology_, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    loaded_ = hwloc_topology_load(topology_) == 0;
  }
  ~Hwloc() { hwloc_topology_destroy(topology_); }
  Hwloc(const Hwloc&) = delete;
  Hwloc& operator=(const Hwloc&) = delete;
  bool loaded() const { return loaded_; }
  hwloc_topology_t get() const { return topology_; }

 private:
  hwloc_topology_t topology_ = nullptr;
  bool loaded_ = false;
};

std::string bitmap_list(hwloc_const_bitmap_t bitmap) {
  char* text = nullptr;
  hwloc_bitmap_list_asprintf(&text, bitmap);
  std::string result = text ? text : "";
  std::free(text);
  return result;
}

hwloc_obj_t numa_node_by_os_index(hwloc_topology_t topology, unsigned os_index) {
  const int count = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < count; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, unsigned(i));
    if (node->os_index == os_index) return node;
  }
  return count > 0 ? hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, 0) : nullptr;
}

// The NUMA node whose CPUs intersect `cpuset` first.
std::optional<unsigned> node_of_cpuset(hwloc_topology_t topology, hwloc_const_cpuset_t cpuset) {
  const int count = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < count; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, unsigned(i));
    if (node->cpuset && hwloc_bitmap_intersects(node->cpuset, cpuset)) return node->os_index;
  }
  return std::nullopt;
}

struct GpuPlacement {
  std::optional<unsigned> node;
  std::string description;
};

GpuPlacement locate_gpu(hwloc_topology_t topology, int gpu_index) {
  GpuPlacement placement;
#ifdef STRATA_HAS_CUDA
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || gpu_index >= devices) {
    cudaGetLastError();
    return placement;
  }
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, gpu_index) != cudaSuccess) return placement;
  placement.description =
      fmt::format("{} ({:04x}:{:02x}:{:02x}.0)", properties.name, properties.pciDomainID,
                  properties.pciBusID, properties.pciDeviceID);
  hwloc_obj_t pci =
      hwloc_get_pcidev_by_busid(topology, unsigned(properties.pciDomainID),
                                unsigned(properties.pciBusID), unsigned(properties.pciDeviceID), 0);
  if (pci) {
    hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(topology, pci);
    if (ancestor && ancestor->cpuset) placement.node = node_of_cpuset(topology, ancestor->cpuset);
  }
#else
  (void)topology;
  (void)gpu_index;
#endif
  return placement;
}

unsigned choose_node(hwloc_topology_t topology, const GpuPlacement& gpu) {
  if (gpu.node) return *gpu.node;
  hwloc_cpuset_t allowed = hwloc_bitmap_alloc();
  std::optional<unsigned> node;
  if (hwloc_get_cpubind(topology, allowed, HWLOC_CPUBIND_PROCESS) == 0) {
    const int first = hwloc_bitmap_first(allowed);
    if (first >= 0) {
      hwloc_bitmap_only(allowed, unsigned(first));
      node = node_of_cpuset(topology, allowed);
    }
  }
  hwloc_bitmap_free(allowed);
  if (node) return *node;
  hwloc_obj_t first_node = hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, 0);
  return first_node ? first_node->os_index : 0;
}

// The block device under `path` and the NUMA node of its controller, from sysfs.
void describe_block_device(const std::string& path, NvmePathInfo& info) {
  struct stat status {};
  if (stat(path.c_str(), &status) != 0) return;
  std::error_code error;
  std::filesystem::path device = std::filesystem::canonical(
      fmt::format("/sys/dev/block/{}:{}", major(status.st_dev), minor(status.st_dev)), error);
  if (error) return;
  info.block_device = device.filename().string();
  for (std::filesystem::path dir = device; dir.has_relative_path() && dir != "/sys";
       dir = dir.parent_path()) {
    std::ifstream numa(dir / "device" / "numa_node");
    int node = -1;
    if (numa >> node) {
      if (node >= 0) info.numa_node = unsigned(node);
      return;
    }
  }
}

}  // namespace

unsigned choose_host_node(int gpu_index) {
  Hwloc hwloc;
  if (!hwloc.loaded()) return 0;
  return choose_node(hwloc.get(), locate_gpu(hwloc.get(), gpu_index));
}

Result<TopologyReport> inspect_topology(const std::vector<std::string>& nvme_paths,
                                        unsigned io_threads, int gpu_index) {
  Hwloc hwloc;
  if (!hwloc.loaded())
    return Status::error(
        "topology: hwloc could not read this machine's topology (is /sys mounted?)");
  hwloc_topology_t topology = hwloc.get();
  TopologyReport report;
  const int count = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < count; ++i) {
    hwloc_obj_t node = hwloc_get_obj_by_type(topology, HWLOC_OBJ_NUMANODE, unsigned(i));
    NumaNodeInfo info;
    info.os_index = node->os_index;
    info.cpus = node->cpuset ? bitmap_list(node->cpuset) : "";
    info.cpu_count = node->cpuset ? unsigned(std::max(0, hwloc_bitmap_weight(node->cpuset))) : 0;
    info.memory_bytes = node->attr ? node->attr->numanode.local_memory : 0;
    report.nodes.push_back(info);
  }
  GpuPlacement gpu = locate_gpu(topology, gpu_index);
  report.gpu_node = gpu.node;
  report.gpu = gpu.description;
  report.host_node = choose_node(topology, gpu);

  // I/O threads take the last CPUs of the host node, the optimizer the rest;
  // with too few CPUs to split, both share the node.
  if (hwloc_obj_t node = numa_node_by_os_index(topology, report.host_node); node && node->cpuset) {
    hwloc_bitmap_t io = hwloc_bitmap_alloc();
    hwloc_bitmap_t optimizer = hwloc_bitmap_dup(node->cpuset);
    const int cpus = hwloc_bitmap_weight(node->cpuset);
    if (io_threads > 0 && cpus > int(io_threads)) {
      for (unsigned taken = 0; taken < io_threads; ++taken) {
        const int last = hwloc_bitmap_last(optimizer);
        hwloc_bitmap_clr(optimizer, unsigned(last));
        hwloc_bitmap_set(io, unsigned(last));
      }
    } else {
      hwloc_bitmap_copy(io, node->cpuset);
    }
    report.io_cpus = bitmap_list(io);
    report.optimizer_cpus = bitmap_list(optimizer);
    hwloc_bitmap_free(io);
    hwloc_bitmap_free(optimizer);
  }

  for (const std::string& path : nvme_paths) {
    NvmePathInfo info;
    info.path = path;
    Result<io::DirectoryInfo> directory = io::inspect_swap_directory(path);
    if (directory) {
      info.filesystem = directory->filesystem;
      info.direct_io = directory->direct_io;
      info.free_bytes = io::free_bytes(path);
      describe_block_device(path, info);
    } else {
      info.error = directory.status().message();
    }
    report.nvme.push_back(info);
  }
  return report;
}

std::string format_topology(const TopologyReport& report) {
  std::string text;
  for (const NumaNodeInfo& node : report.nodes) {
    text += fmt::format("numa node {}: cpus {} ({}), memory {}{}\n", node.os_index, node.cpus,
                        node.cpu_count, format_bytes(node.memory_bytes),
                        node.os_index == report.host_node ? "  <- host pool" : "");
  }
  if (!report.gpu.empty()) {
    text += fmt::format("gpu: {}, numa node {}\n", report.gpu,
                        report.gpu_node ? std::to_string(*report.gpu_node) : "unknown");
  } else {
    text += "gpu: none found (device memory is host memory standing in)\n";
  }
  text += fmt::format("cpus for I/O threads: {}\n", report.io_cpus);
  text += fmt::format("cpus for the optimizer: {}\n", report.optimizer_cpus);
  for (const NvmePathInfo& path : report.nvme) {
    if (!path.error.empty()) {
      text += fmt::format("nvme path {}: unusable: {}\n", path.path, path.error);
      continue;
    }
    text += fmt::format("nvme path {}: {} on {}, numa node {}, {} free, O_DIRECT {}\n", path.path,
                        path.filesystem, path.block_device.empty() ? "?" : path.block_device,
                        path.numa_node ? std::to_string(*path.numa_node) : "unknown",
                        format_bytes(path.free_bytes), path.direct_io ? "yes" : "no");
  }
  if (report.nvme.empty()) text += "nvme paths: none given\n";
  return text;
}

void first_touch_on_node(void* data, size_t size, unsigned node_index, std::string* notice) {
  Hwloc hwloc;
  bool bound = false;
  hwloc_bitmap_t previous = hwloc_bitmap_alloc();
  if (hwloc.loaded()) {
    hwloc_topology_t topology = hwloc.get();
    hwloc_obj_t node = numa_node_by_os_index(topology, node_index);
    const bool several_nodes = hwloc_get_nbobjs_by_type(topology, HWLOC_OBJ_NUMANODE) > 1;
    if (node && several_nodes) {
      const bool memory = hwloc_set_area_membind(topology, data, size, node->nodeset,
                                                 HWLOC_MEMBIND_BIND, HWLOC_MEMBIND_BYNODESET) == 0;
      const bool cpus = hwloc_get_cpubind(topology, previous, HWLOC_CPUBIND_THREAD) == 0 &&
                        hwloc_set_cpubind(topology, node->cpuset, HWLOC_CPUBIND_THREAD) == 0;
      bound = cpus;
      if ((!memory || !cpus) && notice)
        *notice = fmt::format(
            "host tier: could not bind the pool to numa node {} ({}); its pages "
            "are first-touched where the process runs",
            node_index, errno_text(errno));
    }
  }
  std::memset(data, 0, size);
  if (bound) hwloc_set_cpubind(hwloc.get(), previous, HWLOC_CPUBIND_THREAD);
  hwloc_bitmap_free(previous);
}

}  // namespace strata::tiers
