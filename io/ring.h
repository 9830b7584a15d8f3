// Ring: the seam between the engine's I/O threads and the kernel.
//
// Contract. A Ring is created on, and used by, exactly one I/O thread (its
// owner), except wake(), which any thread may call. The owner prepares up to
// capacity() requests that have no completion yet, then submit_and_wait()
// hands them to the kernel and returns completions. Results follow the kernel's
// convention: bytes transferred (maybe fewer than asked), or -errno. Retrying is
// the caller's job; a Ring never retries. Implementations: io_uring
// (uring_ring.cpp), pread/pwrite (posix_ring.cpp), and a fault-injecting
// wrapper for tests (fault_injection.h), which is why this is an interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "io/base/status.h"

namespace strata::io {

enum class RingOp { kRead, kWrite, kSync };

struct RingRequest {
  uint64_t tag = 0;  // returned in the completion
  RingOp op = RingOp::kRead;
  int file_slot = -1;  // index in the registered-file table
  int fd = -1;         // the same file as a descriptor
  void* buffer = nullptr;
  int buffer_slot = -1;  // registered buffer holding [buffer, buffer + length), or -1
  uint64_t offset = 0;
  uint32_t length = 0;
};

struct RingCompletion {
  uint64_t tag = 0;
  int64_t result = 0;  // bytes, or -errno
};

class Ring {
 public:
  virtual ~Ring() = default;

  virtual std::string description() const = 0;
  virtual unsigned capacity() const = 0;

  virtual Status register_file(int slot, int fd) = 0;
  virtual Status unregister_file(int slot) = 0;
  virtual Status register_buffer(int slot, void* data, size_t size) = 0;
  virtual Status unregister_buffer(int slot) = 0;

  virtual void prepare(const RingRequest& request) = 0;
  // Submits what was prepared, then waits until at least `wait_for` completions
  // are available or wake() is called; appends every available completion.
  virtual Status submit_and_wait(unsigned wait_for, std::vector<RingCompletion>& completions) = 0;
  // Makes a blocked submit_and_wait return early. Thread-safe.
  virtual void wake() = 0;
};

struct RingLimits {
  unsigned queue_depth = 32;
  unsigned max_files = 64;
  unsigned max_buffers = 256;
};

// Returns an io_uring-backed ring, or an error whose message says why io_uring
// cannot be used (the caller then falls back to make_posix_ring).
Result<std::unique_ptr<Ring>> make_uring_ring(const RingLimits& limits);
std::unique_ptr<Ring> make_posix_ring(const RingLimits& limits);

}  // namespace strata::io
