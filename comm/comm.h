// The Communicator room: collectives over flat buffers between ranks.
//
// LocalComm (ranks as threads, deterministic reduction order) and NcclComm
// (one process per GPU) implement the same interface; see DESIGN.md section 4.
// This header holds what every build has; the collectives arrive with the
// engine.
#pragma once

#include <string>

namespace strata::comm {

// The NCCL version this binary links, as "2.27.3", or "" when built without CUDA.
std::string nccl_version();

}  // namespace strata::comm
