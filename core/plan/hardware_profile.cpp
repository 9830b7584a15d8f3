#include "core/plan/hardware_profile.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/config/json_util.h"

namespace strata {

double HardwareProfile::nvme_read_gbps() const {
  double sum = 0;
  for (const NvmeDrive& d : nvme) sum += d.read_gbps;
  return sum;
}

double HardwareProfile::nvme_write_gbps() const {
  double sum = 0;
  for (const NvmeDrive& d : nvme) sum += d.write_gbps;
  return sum;
}

double HardwareProfile::nvme_mixed_gbps() const {
  double sum = 0;
  for (const NvmeDrive& d : nvme) {
    if (d.mixed_gbps <= 0) return 0;
    sum += d.mixed_gbps;
  }
  return sum;
}

double HardwareProfile::matmul_flops(Precision precision) const {
  const double peak = precision == Precision::bf16   ? matmul_tflops_bf16
                      : precision == Precision::fp16 ? matmul_tflops_fp16
                                                     : matmul_tflops_fp32;
  return peak * 1e12 * matmul_efficiency;
}

double HardwareProfile::rank_share(int ranks) const {
  ranks = std::max(1, ranks);
  if (rank_shares.empty()) return std::min(1.0, double(cores) / double(ranks));
  const size_t n = rank_shares.size();
  if (size_t(ranks) <= n) return rank_shares[size_t(ranks) - 1];
  return rank_shares.back() * double(n) / double(ranks);
}

double HardwareProfile::adamw_params_per_second(OptimizerStateDtype state) const {
  const double rate = state == OptimizerStateDtype::bf16   ? adamw_mparams_bf16
                      : state == OptimizerStateDtype::int8 ? adamw_mparams_int8
                                                           : adamw_mparams_fp32;
  return rate * 1e6;
}

namespace {

// A GPU's published figures (README.md, "Hardware profiles", names the sources).
struct GpuPreset {
  const char* name;
  double fp32_tflops, bf16_tflops, memory_gbps, memory_gib, pcie_gbps, intra_node_gbps,
      inter_node_gbps;
};
// Dense (no sparsity) tensor-core rates; fp32 is the plain (non-TF32) rate.
// intra-node: the GPUs' own interconnect inside a node (NVLink, or PCIe peer
// to peer). inter-node: each GPU's share of the node's network, as the
// usual servers for that GPU are built (README.md): one 400 Gb/s NIC per
// H100/H200 and one 200 Gb/s per A100 (DGX-class nodes), one 200 Gb/s NIC
// per two L40S, one 100 Gb/s NIC per four RTX 4090.
constexpr GpuPreset kGpus[] = {
    {"h100-sxm", 67, 989, 3350, 80, 64, 450, 50},
    {"h200", 67, 989, 4800, 141, 64, 450, 50},
    {"a100-80gb", 19.5, 312, 2039, 80, 32, 300, 25},
    {"rtx-4090", 82.6, 165.2, 1008, 24, 32, 25, 3.125},
    {"l40s", 91.6, 362, 864, 48, 32, 32, 12.5},
};
// A message's latency between nodes (RDMA through a switch) and within one.
constexpr double kInterNodeLatencyUs = 20;
constexpr double kIntraNodeLatencyUs = 10;
// PCIe x4 drives: a Gen4 one (Samsung 990 PRO 2 TB) and a Gen5 one (Crucial T705 2 TB).
constexpr NvmeDrive kGen4{7.45, 6.9, 60, 1200};
constexpr NvmeDrive kGen5{14.5, 12.7, 60, 1200};
// The share of the dense peak strata's units are assumed to reach on a GPU,
// until a GPU run measures it.
constexpr double kGpuMatmulEfficiency = 0.45;
// A launch and a host wait on a GPU (gpu_launches.h), until the GPU probe
// measures them: a few microseconds to issue a kernel or a cuBLASLt product,
// and a wait's wake-up, the rows' grouping and the next launch.
constexpr double kGpuLaunchUs = 4;
constexpr double kGpuHostWaitUs = 20;
// Effective PCIe bandwidth as a share of the link's rate (protocol overhead).
constexpr double kPcieEfficiency = 0.85;

}  // namespace

std::vector<std::string> hardware_preset_names() {
  std::vector<std::string> names;
  for (const GpuPreset& g : kGpus) names.push_back(g.name);
  return names;
}

Result<HardwareProfile> hardware_preset(const std::string& spec) {
  const size_t slash = spec.find('/');
  const std::string name = spec.substr(0, slash);
  const std::string drives = slash == std::string::npos ? "gen4x1" : spec.substr(slash + 1);
  const GpuPreset* gpu = nullptr;
  for (const GpuPreset& g : kGpus)
    if (name == g.name) gpu = &g;
  if (gpu == nullptr)
    return Status::invalid_argument(
        fmt::format("--hardware {}: no such preset (presets: {}; or give a profile file)", spec,
                    fmt::join(hardware_preset_names(), ", ")));
  int count = 0;
  char generation = 0;
  if (std::sscanf(drives.c_str(), "gen%cx%d", &generation, &count) != 2 ||
      (generation != '4' && generation != '5') || count < 1 || count > 16 ||
      drives != fmt::format("gen{}x{}", generation, count))
    return Status::invalid_argument(fmt::format(
        "--hardware {}: '{}' is not an NVMe set; write gen4xN or gen5xN (N drives, 1 to 16)", spec,
        drives));
  HardwareProfile p;
  p.name = fmt::format("{} with {} Gen{} NVMe drive{}", gpu->name, count, generation,
                       count > 1 ? "s" : "");
  p.gpu = true;
  p.matmul_tflops_fp32 = gpu->fp32_tflops;
  p.matmul_tflops_bf16 = p.matmul_tflops_fp16 = gpu->bf16_tflops;
  p.matmul_efficiency = kGpuMatmulEfficiency;
  p.launch_us = kGpuLaunchUs;
  p.host_wait_us = kGpuHostWaitUs;
  p.memory_gbps = gpu->memory_gbps;
  p.memory_gib = gpu->memory_gib;
  p.memcpy_gbps = 20;
  p.cores = 32;
  // The CPU optimizer on such a host: strata's AVX-512 AdamW reaches about a
  // memory-bound 16 bytes read and 12 written per fp32 parameter.
  p.adamw_mparams_fp32 = 2000;
  p.adamw_mparams_bf16 = 2600;
  p.adamw_mparams_int8 = 2400;
  p.pcie_h2d_gbps = p.pcie_d2h_gbps = gpu->pcie_gbps * kPcieEfficiency;
  p.nvme.assign(size_t(count), generation == '4' ? kGen4 : kGen5);
  p.intra_node_gbps = gpu->intra_node_gbps;
  p.intra_node_latency_us = kIntraNodeLatencyUs;
  p.inter_node_gbps = gpu->inter_node_gbps;
  p.inter_node_latency_us = kInterNodeLatencyUs;
  return p;
}

namespace {

// {"fp32": F, "bf16": F, <third>: F} under `key`.
void read_rates(JsonReader object, const char* key, const char* third, double& fp32, double& bf16,
                double& other) {
  JsonReader rates = object.object(key);
  rates.optional_double("fp32", fp32, 0);
  rates.optional_double("bf16", bf16, 0);
  rates.optional_double(third, other, 0);
}

}  // namespace

Result<HardwareProfile> parse_hardware_profile(const std::string& text, const std::string& origin) {
  Result<nlohmann::json> json = parse_json_text(text, origin);
  if (!json) return json.status();
  if (!json->is_object())
    return Status::invalid_argument(fmt::format("{}: a hardware profile is a JSON object", origin));
  HardwareProfile p;
  JsonReader in(*json, origin, "");
  in.optional_string("name", p.name);
  std::string kind = "cpu";
  in.optional_choice("kind", kind, {"cpu", "gpu"});
  p.gpu = kind == "gpu";
  {
    JsonReader compute = in.object("compute");
    read_rates(compute, "matmul_tflops", "fp16", p.matmul_tflops_fp32, p.matmul_tflops_bf16,
               p.matmul_tflops_fp16);
    compute.optional_double("matmul_efficiency", p.matmul_efficiency, 0.001, 1.0);
    compute.optional_double("attention_tflops", p.attention_tflops, 0);
    compute.optional_double("memory_gbps", p.memory_gbps, 0);
    compute.optional_double("memory_gib", p.memory_gib, 0);
    compute.optional_double("launch_us", p.launch_us, 0);
    compute.optional_double("host_wait_us", p.host_wait_us, 0);
  }
  {
    JsonReader units = in.object("cpu_units");
    units.optional_double("layer_forward_gflops", p.layer_forward_gflops, 0);
    units.optional_double("layer_backward_gflops", p.layer_backward_gflops, 0);
    units.optional_double("head_gflops", p.head_gflops, 0);
    units.optional_double_array("rank_shares", p.rank_shares, 0.0001, 1.0);
    units.optional_string("shapes", p.unit_shapes);
  }
  {
    JsonReader host = in.object("host");
    host.optional_double("memcpy_gbps", p.memcpy_gbps, 0.001);
    host.optional_int("cores", p.cores, 1, 4096);
    read_rates(host, "adamw_mparams_per_s", "int8", p.adamw_mparams_fp32, p.adamw_mparams_bf16,
               p.adamw_mparams_int8);
  }
  {
    JsonReader pcie = in.object("pcie");
    pcie.optional_double("h2d_gbps", p.pcie_h2d_gbps, 0);
    pcie.optional_double("d2h_gbps", p.pcie_d2h_gbps, 0);
    pcie.optional_double("latency_us", p.pcie_latency_us, 0);
  }
  if (json->contains("nvme")) {
    const nlohmann::json& drives = (*json)["nvme"];
    if (!drives.is_array())
      return Status::invalid_argument(
          fmt::format("{}: nvme: a list of drives, each "
                      "{{\"read_gbps\", \"write_gbps\", ...}}",
                      origin));
    in.accept("nvme");
    for (size_t i = 0; i < drives.size(); ++i) {
      JsonReader drive(drives[i], origin, fmt::format("nvme[{}]", i));
      NvmeDrive d;
      if (!drive.optional_double("read_gbps", d.read_gbps, 0.001) ||
          !drive.optional_double("write_gbps", d.write_gbps, 0.001))
        drive.fail("read_gbps", "each drive needs read_gbps and write_gbps above 0");
      drive.optional_double("mixed_gbps", d.mixed_gbps, 0.001);
      drive.optional_double("latency_us", d.latency_us, 0);
      double tbw = 0;
      if (drive.optional_double("rated_tbw", tbw, 0.001)) d.rated_tbw = tbw;
      if (!drive.status()) return drive.status();
      for (const std::string& key : drive.unread_keys())
        return Status::invalid_argument(
            fmt::format("{}: {}: not a key of a drive (read_gbps, write_gbps, mixed_gbps, "
                        "latency_us, rated_tbw)",
                        origin, key));
      p.nvme.push_back(d);
    }
  }
  {
    JsonReader network = in.object("network");
    network.optional_double("gbps", p.intra_node_gbps, 0);
    network.optional_double("latency_us", p.intra_node_latency_us, 0);
  }
  {
    JsonReader internode = in.object("internode");
    internode.optional_double("gbps", p.inter_node_gbps, 0);
    internode.optional_double("latency_us", p.inter_node_latency_us, 0);
  }
  if (!in.status()) return in.status();
  for (const std::string& key : in.unread_keys())
    return Status::invalid_argument(fmt::format(
        "{}: {}: not a key of a hardware profile (see core/plan/hardware_profile.h)", origin, key));
  if (p.matmul_tflops_fp32 <= 0 && p.layer_forward_gflops <= 0)
    return Status::invalid_argument(fmt::format(
        "{}: compute.matmul_tflops.fp32: missing; a profile needs the device's matmul rate",
        origin));
  return p;
}

Result<HardwareProfile> read_hardware_profile(const std::string& path) {
  Result<nlohmann::json> json = read_json_file(path);
  if (!json) return json.status();
  return parse_hardware_profile(json->dump(), path);
}

Result<HardwareProfile> load_hardware_profile(const std::string& preset_or_path) {
  const std::string name = preset_or_path.substr(0, preset_or_path.find('/'));
  const std::vector<std::string> presets = hardware_preset_names();
  if (std::find(presets.begin(), presets.end(), name) != presets.end())
    return hardware_preset(preset_or_path);
  std::error_code error;
  if (!std::filesystem::exists(preset_or_path, error))
    return Status::not_found(fmt::format(
        "{}: neither a preset ({}, each with /gen4xN or /gen5xN) nor a profile file (strata plan "
        "--probe writes one)",
        preset_or_path, fmt::join(presets, ", ")));
  return read_hardware_profile(preset_or_path);
}

std::string hardware_profile_json(const HardwareProfile& p) {
  nlohmann::ordered_json j;
  j["name"] = p.name;
  j["kind"] = p.gpu ? "gpu" : "cpu";
  j["compute"] = {{"matmul_tflops",
                   {{"fp32", p.matmul_tflops_fp32},
                    {"bf16", p.matmul_tflops_bf16},
                    {"fp16", p.matmul_tflops_fp16}}},
                  {"matmul_efficiency", p.matmul_efficiency},
                  {"attention_tflops", p.attention_tflops},
                  {"memory_gbps", p.memory_gbps},
                  {"memory_gib", p.memory_gib}};
  if (p.gpu) {
    j["compute"]["launch_us"] = p.launch_us;
    j["compute"]["host_wait_us"] = p.host_wait_us;
  }
  if (!p.gpu) {
    j["cpu_units"] = {{"layer_forward_gflops", p.layer_forward_gflops},
                      {"layer_backward_gflops", p.layer_backward_gflops},
                      {"head_gflops", p.head_gflops}};
    // Unmeasured (a profile written by hand): left out, as read (an even split).
    if (!p.rank_shares.empty()) j["cpu_units"]["rank_shares"] = p.rank_shares;
    j["cpu_units"]["shapes"] = p.unit_shapes;
  }
  j["host"] = {{"memcpy_gbps", p.memcpy_gbps},
               {"cores", p.cores},
               {"adamw_mparams_per_s",
                {{"fp32", p.adamw_mparams_fp32},
                 {"bf16", p.adamw_mparams_bf16},
                 {"int8", p.adamw_mparams_int8}}}};
  j["pcie"] = {{"h2d_gbps", p.pcie_h2d_gbps},
               {"d2h_gbps", p.pcie_d2h_gbps},
               {"latency_us", p.pcie_latency_us}};
  nlohmann::ordered_json drives = nlohmann::ordered_json::array();
  for (const NvmeDrive& d : p.nvme) {
    nlohmann::ordered_json drive = {{"read_gbps", d.read_gbps}, {"write_gbps", d.write_gbps}};
    if (d.mixed_gbps > 0) drive["mixed_gbps"] = d.mixed_gbps;
    drive["latency_us"] = d.latency_us;
    if (d.rated_tbw) drive["rated_tbw"] = *d.rated_tbw;
    drives.push_back(drive);
  }
  j["nvme"] = drives;
  j["network"] = {{"gbps", p.intra_node_gbps}, {"latency_us", p.intra_node_latency_us}};
  j["internode"] = {{"gbps", p.inter_node_gbps}, {"latency_us", p.inter_node_latency_us}};
  return j.dump(2) + "\n";
}

}  // namespace strata
