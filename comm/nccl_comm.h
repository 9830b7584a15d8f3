// NcclComm: the Communicator over NCCL, one process per GPU.
//
// make_nccl_comm(env, gpu_index) joins the rendezvous of `env` (comm/bootstrap.h),
// checks that every rank has a GPU and that no two ranks share one (NCCL would
// hang in ncclCommInitRank), has rank 0 create the ncclUniqueId and send it to
// the others, and calls ncclCommInitRank on GPU `gpu_index` (usually
// env.local_rank). A rank that cannot start makes every rank fail with its
// reason instead of leaving the others waiting. Errors are one line naming the
// collective, the element count and the dtype (or the step of the start-up).
//
// Buffers. A pointer to device memory of this communicator's GPU (cudaMalloc,
// or managed memory) is used as it is. Any other pointer is host memory: it is
// staged through device buffers that the communicator owns and grows to the
// largest call so far (pageable or pinned host memory both work; pinned is
// faster). Each pointer is classified on its own (cudaPointerGetAttributes), so
// send may be on the host and recv on the device. A device pointer of another
// GPU is an error.
//
// Completion. The Communicator calls run on the communicator's own CUDA stream
// (stream()) and synchronise it before they return, so their buffers may be
// reused at once; they wait for nothing else on the device, so device buffers
// written by other streams must be complete before the call. The *_async calls
// (device buffers only) enqueue the collective on a stream the caller names and
// return at once; the caller orders the buffers' use with that stream. When
// NCCL reports an asynchronous error while a call waits (a rank failed or
// left), the call aborts the communicator and returns the error; every later
// call then fails at once.
//
// Reductions are sums (ncclSum); bf16 is ncclBfloat16, summed by NCCL in its
// own order, so unlike LocalComm the result is not bitwise independent of the
// world size. NCCL does not check that ranks agree on counts and dtypes: a
// mismatch may hang or corrupt, so callers must keep the Communicator contract.
// One NcclComm belongs to one rank and is used by one thread at a time; it sets
// its GPU as the current device during each call and restores the previous one.
//
// Builds without CUDA compile this header; make_nccl_comm then returns the error
// "built without CUDA". Without a usable GPU at run time it returns a one-line
// error (never a crash).
#pragma once

#include <chrono>
#include <memory>

#include "comm/bootstrap.h"
#include "comm/communicator.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*; spelt so that no CUDA header is needed here

namespace strata::comm {

struct NcclCommOptions {
  // Bounds the rendezvous (each rank's wait for the others) at start-up.
  std::chrono::milliseconds rendezvous_timeout = kDefaultRendezvousTimeout;
};

class NcclComm : public Communicator {
 public:
  // The GPU (CUDA device index, as this process sees it) the communicator uses.
  virtual int gpu_index() const = 0;
  // The communicator's own stream, on which the synchronous calls run.
  virtual CUstream_st* stream() const = 0;
  // Host buffers are staged through device memory of this communicator's
  // own, allocated at the first call that needs it (and grown). This hands
  // it two buffers of `bytes` on its GPU instead (a caller's pool), used for
  // every call that fits; they must outlive the communicator's calls.
  virtual void use_staging(void* send, void* recv, size_t bytes) = 0;

  // Enqueue on `stream` (nullptr: the legacy default stream) and return without
  // waiting. Device buffers of this GPU only; host pointers are refused.
  virtual Status all_gather_async(const void* send, void* recv, size_t count, DataType dtype,
                                  CUstream_st* stream) = 0;
  virtual Status reduce_scatter_async(const void* send, void* recv, size_t count, DataType dtype,
                                      CUstream_st* stream) = 0;
  virtual Status all_reduce_async(const void* send, void* recv, size_t count, DataType dtype,
                                  CUstream_st* stream) = 0;
  virtual Status broadcast_async(void* buffer, size_t count, DataType dtype, int root,
                                 CUstream_st* stream) = 0;
};

// Starts this rank's NcclComm on GPU `gpu_index`. Every rank of `env` must call
// it; it returns once all have (or with the same kind of error on each).
Result<std::unique_ptr<NcclComm>> make_nccl_comm(const LaunchEnvironment& env, int gpu_index,
                                                 const NcclCommOptions& options = {});

}  // namespace strata::comm
