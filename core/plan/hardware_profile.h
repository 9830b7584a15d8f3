// A machine as the step-time model (core/plan/step_model.h) sees it: how fast
// it computes, updates, copies and moves bytes over each link. A profile is a
// JSON file (`strata plan --probe` writes one of this machine; README lists
// the presets' figures and their sources) or a preset by name.
//
// The JSON form (every figure in the units its name says; GB is 1e9 bytes):
//   {"name": "...", "kind": "gpu" | "cpu",
//    "compute": {"matmul_tflops": {"fp32": F, "bf16": F, "fp16": F},
//                "matmul_efficiency": E,     // share of the peak the units reach
//                "attention_tflops": F,      // cpu: the attention kernel's rate
//                "memory_gbps": F, "memory_gib": F,
//                "launch_us": F,             // gpu: one launch (core/plan/gpu_launches.h)
//                "host_wait_us": F},         // gpu: the host's wait for the stream, to launching
//                again
//    "cpu_units": {"layer_forward_gflops": F, "layer_backward_gflops": F,
//                  "head_gflops": F,         // cpu: the units' measured rates
//                  "rank_shares": [F, ...],  // per rank with 1, 2, ... ranks at once
//                  "shapes": "..."},         // the model shapes and batch they were measured at
//    "host": {"memcpy_gbps": F, "cores": N,
//             "adamw_mparams_per_s": {"fp32": F, "bf16": F, "int8": F}},
//    "pcie": {"h2d_gbps": F, "d2h_gbps": F, "latency_us": F},
//    "nvme": [{"read_gbps": F, "write_gbps": F, "mixed_gbps": F, "latency_us": F,
//              "rated_tbw": F}, ...],
//    "network": {"gbps": F, "latency_us": F},
//    "internode": {"gbps": F, "latency_us": F}}
// "network" is the link between the ranks of a node (NVLink, PCIe peer to
// peer; on the CPU backend shared memory), "internode" each rank's share of
// its node's network to other nodes (a GPU's own NIC where it has one). Both
// are per rank; a profile without "internode" (one node needs none) loads
// with it unknown, and a plan over several nodes then says so.
// Unknown keys and values of the wrong type or range are one-line errors
// naming the file and the key.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "core/config/config.h"
#include "io/base/status.h"

namespace strata {

struct NvmeDrive {
  double read_gbps = 0;
  double write_gbps = 0;
  double latency_us = 100;
  std::optional<double> rated_tbw;  // terabytes written over the drive's warranty
  // Reads and writes in flight at once, half each: the bytes both move per
  // second together (`strata plan --probe` measures it). 0: unknown, and
  // the model lets them take turns (read_gbps, then write_gbps).
  double mixed_gbps = 0;
};

struct HardwareProfile {
  std::string name;
  bool gpu = false;
  // The device that runs the units: a GPU's peak matmul rate per precision,
  // or the CPU backend's measured GEMM rate (fp32; the CPU backend computes in fp32).
  double matmul_tflops_fp32 = 0, matmul_tflops_bf16 = 0, matmul_tflops_fp16 = 0;
  double matmul_efficiency = 1.0;  // presets: an assumed share of the peak
  double attention_tflops = 0;     // 0: as the matmuls
  double memory_gbps = 0;          // the device's memory (a GPU's HBM; the host's for the CPU)
  double memory_gib = 0;
  // A GPU's cost of one launch (a kernel, a product, a copy on the stream:
  // the host's time to issue it or the device's least time to run it,
  // whichever is longer) and of a host wait for the stream (the device idle
  // until the host launches again). Presets assume them; the GPU probe
  // measures them. The CPU backend ignores them.
  double launch_us = 4, host_wait_us = 20;
  // The CPU backend's units, measured at the probed model's shapes (0: from the GEMM rate).
  double layer_forward_gflops = 0, layer_backward_gflops = 0, head_gflops = 0;
  // The units' rate per rank while 1, 2, ... ranks of one process compute at
  // once (they share the cores), as a share of one rank's alone: [0] is 1.
  // Empty: the cores split evenly.
  std::vector<double> rank_shares;
  // The shapes the units were measured at (tools/hardware_probe.h's
  // unit_shapes); a run at other shapes measures them again.
  std::string unit_shapes;
  // The units' rate per rank with `ranks` at once, as a share of one alone:
  // rank_shares, beyond its end the last entry's aggregate rate split
  // further, and without it min(1, cores / ranks).
  double rank_share(int ranks) const;
  // Host. memcpy_gbps counts the bytes a copy reads and writes, per second.
  double memcpy_gbps = 10;
  int cores = 1;
  double adamw_mparams_fp32 = 0, adamw_mparams_bf16 = 0, adamw_mparams_int8 = 0;
  // Links.
  double pcie_h2d_gbps = 0, pcie_d2h_gbps = 0, pcie_latency_us = 10;
  std::vector<NvmeDrive> nvme;
  double intra_node_gbps = 0, intra_node_latency_us = 10;  // "network"
  double inter_node_gbps = 0, inter_node_latency_us = 10;  // "internode"; 0 GB/s: unknown

  // The node's NVMe read and write bandwidth: the drives striped.
  double nvme_read_gbps() const;
  double nvme_write_gbps() const;
  // Reads and writes at once, the bytes of both per second: the drives'
  // mixed_gbps striped, 0 when a drive's is unknown.
  double nvme_mixed_gbps() const;
  // The matmul rate in FLOP/s of a precision, efficiency applied.
  double matmul_flops(Precision precision) const;
  // The CPU optimizer's parameters per second for a state format.
  double adamw_params_per_second(OptimizerStateDtype state) const;
};

// "h100-sxm", "h200", "a100-80gb", "rtx-4090", "l40s", each optionally with
// "/gen4xN" or "/gen5xN" for N NVMe drives of that generation (default
// gen4x1). The figures are the vendors' published ones (README.md).
Result<HardwareProfile> hardware_preset(const std::string& name);
std::vector<std::string> hardware_preset_names();

// A profile from its JSON text; `origin` names it in errors.
Result<HardwareProfile> parse_hardware_profile(const std::string& text, const std::string& origin);
Result<HardwareProfile> read_hardware_profile(const std::string& path);
// A preset name or a file.
Result<HardwareProfile> load_hardware_profile(const std::string& preset_or_path);
std::string hardware_profile_json(const HardwareProfile& profile);

}  // namespace strata
