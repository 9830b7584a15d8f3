// Which compute backends this binary has and which devices it can see.
//
// A binary built with CUDA must still run where there is no GPU (or no driver):
// cuda_devices() then returns an empty list with the reason, and the caller
// (core/) falls back to the CPU backend with a one-line notice. All calls are
// thread-safe and cheap after the first (the CUDA runtime caches its answer).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace strata::kernels {

enum class BackendKind { cpu, cuda };

struct GpuInfo {
  int index = 0;
  std::string name;
  std::size_t total_bytes = 0;
  std::size_t free_bytes = 0;
  int multiprocessors = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

struct GpuQuery {
  std::vector<GpuInfo> devices;
  std::string why_none;  // set when devices is empty: "built without CUDA", driver error text, ...
};

// True when this binary was compiled with the CUDA backend.
bool built_with_cuda();

// The CUDA runtime version this binary was built against, as "13.0", or "" on CPU-only builds.
std::string cuda_runtime_version();

// The usable GPUs. Never throws; an absent driver or GPU gives an empty list and a reason.
GpuQuery query_gpus();

}  // namespace strata::kernels
