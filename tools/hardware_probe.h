// `strata plan --probe`: this machine measured into a hardware profile
// (core/plan/hardware_profile.h) for the step-time model, with strata's own
// code: the CPU backend's units (a decoder layer's forward and backward, the
// head) at the model's shapes, or for the CUDA backend the first GPU's
// matmuls at the model's linear shapes, its memory and PCIe each way
// (gpu_probe.cpp); the AdamW kernel in each state format, host copies, and
// NVMe through strata's I/O engine at its block size and queue depth.
// Collectives between in-process ranks are host copies (device copies on a
// GPU). Within about a minute; a short probe (NVMe 256 MiB instead of 1 GiB)
// for `strata train`'s first run.
//
// A probe is kept per machine (cached_profile_path) and reused; the units
// depend on the shapes, so a run at other shapes than the cached ones
// measures them again (and keeps them).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/model/model_config.h"
#include "core/plan/hardware_profile.h"
#include "io/base/status.h"

namespace strata::tools {

struct ProbeOptions {
  ModelConfig model;  // the units are measured at its shapes (one layer and the head)
  int64_t micro_batch = 1;
  int64_t seq_len = 128;
  std::vector<std::string> nvme_paths;  // empty: the profile has no NVMe drive
  bool short_probe = false;
  // The units' parameters and gradients take at most this many bytes (0: 1
  // GiB): `strata train` gives its probe half the run's planned memory, so
  // that a first run peaks no higher than the runs after it.
  int64_t memory_bytes = 0;
  bool gpu = false;  // the CUDA backend: the first GPU instead of the CPU's units
  std::function<void(const std::string&)> progress;  // one line per measurement
};

Result<HardwareProfile> probe_hardware(const ProbeOptions& options);
// Measures only the units at these shapes into `profile` (the rest is kept).
Status probe_units(const ProbeOptions& options, HardwareProfile& profile);
// The shapes probe_units measures at, as the profile records them
// (HardwareProfile::unit_shapes): a profile whose units match needs no new probe.
std::string unit_shapes(const ProbeOptions& options);
// Measures only the first GPU into `profile` (gpu_probe.cpp): matmul rates
// per precision, memory bandwidth and size, PCIe each way and its latency.
Status probe_gpu(const ProbeOptions& options, HardwareProfile& profile);
// Measures only the NVMe under options.nvme_paths into `profile`.
Status probe_nvme(const ProbeOptions& options, HardwareProfile& profile);

// $XDG_CACHE_HOME/strata/hardware-HOST.json (the GPU's: hardware-HOST-gpu.json),
// or ~/.cache/strata/...
std::string cached_profile_path(bool gpu = false);
Status write_profile(const HardwareProfile& profile, const std::string& path);

}  // namespace strata::tools
