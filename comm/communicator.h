// Communicator: collectives over flat buffers between the ranks of one run.
//
// Implementations: LocalComm (W ranks as threads of one process,
// make_local_group below; host buffers), GlooComm (one process per rank on
// the CPU backend, over Gloo's TCP transport, comm/gloo_comm.h; host buffers)
// and NcclComm (one
// process per GPU, comm/nccl_comm.h; device or host buffers).
//
// Contract. Every rank calls the same collectives in the same order with the
// same counts and dtype; each call returns when this rank's part is done and
// its buffers may be reused. Reductions are sums. LocalComm and GlooComm check
// the agreement: a collective whose ranks disagree (count, dtype, root) fails on
// every rank with the same message. NcclComm cannot check it (NCCL does not):
// there a disagreement may hang or corrupt, so it is the caller's to keep.
// One Communicator belongs to one rank and is used by one thread at a time.
//
// Layouts (count = elements per rank):
//   all_gather:     send (count) on every rank -> recv (world * count), rank r's at r * count
//   reduce_scatter: send (world * count) on every rank -> recv (count) = sum over ranks of
//                   send[r * count, (r + 1) * count) on rank r
//   all_reduce:     send (count) -> recv (count) = sum over ranks; send == recv is allowed
//   broadcast:      buffer (count) on root -> buffer (count) on every rank
//
// Reproducibility: LocalComm adds the ranks' contributions in rank order
// (0, 1, ..., W-1) in fp32, whatever the thread timing, so a run is bitwise
// repeatable. bf16 buffers are summed in fp32 and rounded to nearest-even once.
// GlooComm does the same arithmetic (comm/reduction.h), so its results are
// bitwise LocalComm's for the same inputs.
// NcclComm sums in NCCL's order (which depends on the world size and NCCL's
// algorithm choice) and, for bf16, rounds as NCCL does; it matches LocalComm
// to rounding, not bitwise.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "io/base/status.h"

namespace strata::comm {

enum class DataType { fp32, bf16 };

size_t dtype_bytes(DataType dtype);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  virtual Status all_gather(const void* send, void* recv, size_t count, DataType dtype) = 0;
  virtual Status reduce_scatter(const void* send, void* recv, size_t count, DataType dtype) = 0;
  virtual Status all_reduce(const void* send, void* recv, size_t count, DataType dtype) = 0;
  virtual Status broadcast(void* buffer, size_t count, DataType dtype, int root) = 0;
  virtual Status barrier() = 0;

  // The data bytes this rank has sent to other ranks so far: the collectives'
  // payload, without the agreement checks' headers (32 bytes to each peer per
  // call). GlooComm counts them at its transport; LocalComm and NcclComm add
  // up bytes_sent_by for each call (a ring, NCCL's, sends the same per rank
  // in the reductions and the all-gather).
  virtual uint64_t bytes_sent() const = 0;
};

enum class CollectiveKind { all_gather, reduce_scatter, all_reduce, broadcast };

// The data bytes rank `rank` of `world` sends to the others in one collective
// of `count` elements per rank (the root's, for a broadcast) when every rank
// sends straight to every other, as GlooComm does: an all-gather (W-1) x count
// elements; a reduce-scatter the W-1 slices of the others; an all-reduce the
// others' W-1 segments of the buffer and then its own to each of them (segment
// r is [count r / W, count (r+1) / W)); a broadcast (W-1) x count from the root.
uint64_t bytes_sent_by(CollectiveKind kind, size_t count, DataType dtype, int world, int rank,
                       int root = 0);

// W ranks as threads of one process. make_local_group(W) returns one
// Communicator per rank; hand communicators[r] to the thread that runs rank r.
// The communicators share state and must all outlive every call in flight.
std::vector<std::unique_ptr<Communicator>> make_local_group(int world_size);

}  // namespace strata::comm
