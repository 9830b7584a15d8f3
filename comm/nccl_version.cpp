#include "comm/comm.h"

#ifdef STRATA_HAS_CUDA
#include <nccl.h>
#endif

#include <fmt/format.h>

namespace strata::comm {

std::string nccl_version() {
#ifdef STRATA_HAS_CUDA
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return "unknown";
  // NCCL encodes major*10000 + minor*100 + patch since 2.9.
  return fmt::format("{}.{}.{}", version / 10000, (version % 10000) / 100, version % 100);
#else
  return "";
#endif
}

}  // namespace strata::comm
