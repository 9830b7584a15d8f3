// The Communicator room: collectives over flat buffers between ranks.
//
// LocalComm (ranks as threads, deterministic reduction order), GlooComm (one
// process per rank on the CPU backend, over Gloo's TCP transport, LocalComm's
// arithmetic) and
// NcclComm (one process per GPU) implement the same interface; see
// comm/README.md.
//   comm/communicator.h  the Communicator contract, and LocalComm
//   comm/gloo_comm.h     GlooComm (every build)
//   comm/nccl_comm.h     NcclComm (an error "built without CUDA" on CPU-only builds)
//   comm/bootstrap.h     the launcher's environment (RANK, WORLD_SIZE, ... / SLURM /
//                        Open MPI) and the TCP rendezvous GlooComm and NcclComm
//                        start with
//   comm/reduction.h     the rank-order sum LocalComm and GlooComm share (internal)
// This header holds what every build has and the rest do not need.
#pragma once

#include <string>

namespace strata::comm {

// The NCCL version this binary links, as "2.27.3", or "" when built without CUDA.
std::string nccl_version();

}  // namespace strata::comm
