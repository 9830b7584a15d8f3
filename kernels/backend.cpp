#include "kernels/backend.h"

namespace strata::kernels {

bool built_with_cuda() {
#ifdef STRATA_HAS_CUDA
  return true;
#else
  return false;
#endif
}

#ifndef STRATA_HAS_CUDA
// CPU-only build: the CUDA half (kernels/cuda/device.cu) is not compiled.
std::string cuda_runtime_version() { return ""; }

GpuQuery query_gpus() {
  GpuQuery query;
  query.why_none = "this strata was built without CUDA";
  return query;
}
#endif

}  // namespace strata::kernels
