// SocketComm: the Communicator over TCP for several CPU processes, one rank per
// process (`strata launch -n N -- strata train ...` on the CPU backend).
//
// make_socket_comm(env) joins the rendezvous of `env` (comm/bootstrap.h): rank 0
// listens on MASTER_PORT and the others connect to it. Every collective is one
// or more all-gathers of messages through rank 0: each rank sends a small
// header (the collective, the element count, the dtype, the root) and its data;
// every rank receives every rank's message and computes its own result. So a
// call moves O(W x bytes) into each rank and O(W^2 x bytes) through rank 0: it is
// meant for CPU runs and tests, not for speed. A collective whose data is over
// options.exchange_bytes per rank is done in several exchanges, which bounds
// the memory a call needs.
//
// Results are bitwise LocalComm's for the same inputs: reductions add the
// ranks' contributions in rank order (0, 1, ..., W-1) in fp32, and bf16 sums are
// rounded to nearest even once (comm/reduction.h). Buffers are host memory.
// Data travels in the host's byte order, so every rank must run on machines
// of one byte order (every platform strata builds for is little-endian).
//
// Agreement. Every exchange carries the header, so ranks that disagree on the
// collective, count, dtype or root fail on every rank with the same one-line
// message; the communicator stays usable after such a refusal.
//
// Failures. Each exchange waits at most options.timeout for the other ranks
// (start-up included); a rank that exits or closes its connection is noticed at
// once. A failed exchange closes this rank's connections, so that the other
// ranks fail promptly instead of waiting out their timeout, and every later
// call fails at once with the first error: restart every rank. The default
// timeout is generous (30 minutes) because a peer may be busy for a long time
// between collectives, e.g. saving a checkpoint.
//
// One SocketComm belongs to one rank and is used by one thread at a time.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include "comm/bootstrap.h"
#include "comm/communicator.h"

namespace strata::comm {

struct SocketCommOptions {
  // Bounds the start-up (every rank's wait for the others to join) and each
  // exchange of a collective (a rank's wait for the slowest other rank).
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // The most data bytes one rank sends in one exchange; larger collectives are
  // split (and it is capped at 256 MiB / world size, within the rendezvous's
  // message limit). Every rank must use the same value.
  size_t exchange_bytes = size_t(16) << 20;
};

// Joins the rendezvous of `env` and returns this rank's SocketComm. Every rank
// of `env` must call it (with the same options); a world of one needs no
// socket.
Result<std::unique_ptr<Communicator>> make_socket_comm(const LaunchEnvironment& env,
                                                       SocketCommOptions options = {});

}  // namespace strata::comm
