// GlooComm: the Communicator for several CPU processes, one rank per process
// (`strata launch -n N -- strata train ...` on the CPU backend), over Gloo's
// TCP transport.
//
// make_gloo_comm(env) joins the rendezvous of `env` (comm/bootstrap.h), which
// exchanges the address of one Gloo pair per pair of ranks; from then on every
// rank talks to every other directly (a full mesh), and the rendezvous is
// closed. Each pair listens on the address of this rank's end of its
// rendezvous connection (Rendezvous::local_address), so on the interface
// that reaches MASTER_ADDR.
//
// Collectives. Before each, every rank sends a 32-byte header (the
// collective, count, dtype, root) to every other and checks all of them, so
// ranks that disagree fail on every rank with the same one-line message and
// the communicator stays usable after the refusal. Then:
//   reduce_scatter  every rank sends slice q of its buffer to rank q and sums
//                   the W slices it receives in rank order;
//   all_reduce      the same over W segments of the buffer (segment r owned by
//                   rank r), then each owner sends its summed segment to
//                   every rank;
//   all_gather, broadcast, barrier: Gloo's own algorithms (no arithmetic).
// Each rank sends and receives (W-1)/W of the buffer in a reduce_scatter and
// twice that in an all_reduce, the bytes of a ring, in one round instead of
// W-1. Data moves in pieces of at most options.exchange_bytes per peer, so a
// call's staging memory is bounded; the next piece is on the wire while this
// one is summed.
//
// Numbers. Gloo's own reductions add in an order that depends on the
// algorithm and the segment, so they are not used: sums start at 0.0f and add
// rank 0's element, then rank 1's, ..., in fp32, bf16 rounded once to nearest
// even (comm/reduction.h), so results are bitwise LocalComm's for the same
// inputs whatever the world size or the pieces. Buffers are host memory in
// the host's byte order (every platform strata builds for is little-endian).
//
// Failures. Every wait is bounded by options.timeout (start-up included); a
// rank that exits or closes its connections is noticed at once, a rank that
// stops answering after the timeout, and the error names the rank. A failed
// call closes this rank's connections, so the other ranks fail promptly
// instead of waiting out their timeout, and every later call fails at once
// with the first error: restart every rank. make_gloo_comm makes SIGPIPE
// ignored in the process (a write to a closed connection is then an error,
// not the end of the process).
//
// One GlooComm belongs to one rank and is used by one thread at a time. A
// world of one needs no socket: make_gloo_comm returns a LocalComm of one.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>

#include "comm/bootstrap.h"
#include "comm/communicator.h"

namespace strata::comm {

struct GlooCommOptions {
  // Bounds the start-up (every rank's wait for the others to join) and every
  // wait of a collective. Generous by default (30 minutes) because a peer may
  // be busy for long between collectives, e.g. saving a checkpoint.
  std::chrono::milliseconds timeout = std::chrono::minutes(30);
  // The most bytes one rank sends to one peer in one piece of a reduction
  // (at least one element). Every rank must use the same value.
  size_t exchange_bytes = size_t(8) << 20;
};

// Joins the rendezvous of `env`, connects every pair of ranks and returns this
// rank's GlooComm. Every rank of `env` must call it with the same options.
Result<std::unique_ptr<Communicator>> make_gloo_comm(const LaunchEnvironment& env,
                                                     GlooCommOptions options = {});

}  // namespace strata::comm
