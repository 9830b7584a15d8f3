// Device discovery for the CUDA backend (the CPU-only build uses kernels/backend.cpp).
#include <cuda_runtime.h>

#include <string>

#include "kernels/backend.h"

namespace strata::kernels {

std::string cuda_runtime_version() {
  return std::to_string(CUDART_VERSION / 1000) + "." + std::to_string((CUDART_VERSION % 1000) / 10);
}

GpuQuery query_gpus() {
  GpuQuery query;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    query.why_none = std::string("no usable GPU (") + cudaGetErrorString(err) + ")";
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return query;
  }
  if (count == 0) {
    query.why_none = "no GPU found";
    return query;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    GpuInfo info;
    info.index = i;
    info.name = prop.name;
    info.total_bytes = prop.totalGlobalMem;
    info.multiprocessors = prop.multiProcessorCount;
    info.compute_major = prop.major;
    info.compute_minor = prop.minor;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaSetDevice(i) == cudaSuccess && cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      info.free_bytes = free_bytes;
    }
    query.devices.push_back(info);
  }
  if (query.devices.empty()) query.why_none = "no GPU could be queried";
  return query;
}

}  // namespace strata::kernels
