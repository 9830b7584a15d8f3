// IoEngine: striped O_DIRECT swap files driven by io_uring.
//
// Contract. An IoEngine owns a set of I/O threads (`threads_per_path` for each
// directory in `paths`); each thread owns one io_uring and is the only thread
// that ever submits to it. Callers on any thread hand transfers to the engine;
// a transfer of any length is cut into `block_size` requests, striped over the
// paths in `block_size` units (RAID-0), and at most `queue_depth` requests are
// in flight per ring. Short transfers, -EAGAIN and -EINTR are retried; any
// other failure ends the transfer with a Status naming the operation, errno,
// file, offset and length.
//
// Ownership. The engine owns its files (created by create_file, closed by
// remove_file or the destructor). The caller owns every data buffer: a buffer
// must start at a multiple of alignment(), stay valid and untouched (writes) or
// unread (reads) until its handle reports done. Buffers passed to
// register_buffer are pinned and used through the fixed-buffer calls; they
// must stay valid until unregister_buffer or the engine's destruction.
// Offsets must be multiples of alignment(); lengths may be anything (a tail
// that is not a multiple goes through a bounce block, read-modify-write for
// writes, so bytes outside [offset, offset + length) are never changed, as
// long as no other transfer writes the same alignment block at the same time).
//
// Thread safety. All methods of IoEngine are thread-safe. An IoHandle is a value
// for one thread at a time. A completed (ok) read has its bytes in the buffer;
// a completed write is in the files (in the page cache of the device, not yet
// durable) unless it was submitted with Durability::kSync or followed by a
// completed sync(), in which case fdatasync has returned for every file it
// touched. A transfer that fails may have written part of its range.
//
// Where io_uring is unavailable (old kernel, seccomp), the same threads use
// pread/pwrite on the same O_DIRECT files and the engine says so once through
// `notice`. Buffered I/O is only used when `allow_buffered_io` is set.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "io/base/status.h"

namespace strata::io {

class FaultInjector;
class IoEngineImpl;
struct TransferState;

enum class IoBackend { kAuto, kIoUring, kPosix };

struct IoOptions {
  // One directory per NVMe device; together they form one striped address space.
  std::vector<std::string> paths;
  uint64_t block_size = 1 << 20;  // request size and stripe unit; multiple of alignment()
  unsigned queue_depth = 32;      // requests in flight per ring
  unsigned threads_per_path = 1;  // I/O threads (rings) per path
  IoBackend backend = IoBackend::kAuto;
  // Without O_DIRECT support the engine refuses a path unless this is set.
  bool allow_buffered_io = false;
  unsigned max_files = 64;  // slots in each ring's registered-file table
  // Retries of one request that make no progress before it is reported failed.
  unsigned max_retries = 64;
  // Receives one-line notices (fallbacks). Default: printed on stderr.
  std::function<void(const std::string&)> notice{};
  // Tests only: every ring is wrapped so that chosen calls fail (fault_injection.h).
  std::shared_ptr<FaultInjector> fault_injector{};
};

enum class Durability { kPageCache, kSync };

using FileId = int;

// The result of a submitted transfer; poll with is_done() or block in wait().
// Destroying a handle whose transfer is still running waits for it, so a buffer
// is never written to after its handle is gone.
class IoHandle {
 public:
  IoHandle() = default;
  explicit IoHandle(std::shared_ptr<TransferState> state);
  IoHandle(IoHandle&&) noexcept = default;
  IoHandle& operator=(IoHandle&& other) noexcept;
  ~IoHandle();

  bool valid() const { return state_ != nullptr; }
  bool is_done() const;
  // Blocks until the transfer (and its fdatasync, if durable) has finished.
  Status wait();
  // Submission to completion; meaningful once done.
  std::chrono::nanoseconds latency() const;

 private:
  std::shared_ptr<TransferState> state_;
};

struct IoCounters {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t requests = 0;  // requests completed by the rings (retries included)
  uint64_t retries = 0;   // short transfers, -EAGAIN and -EINTR resubmitted
  uint64_t syncs = 0;     // fdatasync calls
};

class IoEngine {
 public:
  // Checks the paths (exist, directories, writable, O_DIRECT) and starts the
  // I/O threads, each creating its ring.
  static Result<std::unique_ptr<IoEngine>> open(IoOptions options);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Creates (or reuses) `name` in every path, preallocated with fallocate so
  // that `capacity` bytes of the striped address space exist, and registers it.
  Result<FileId> create_file(const std::string& name, uint64_t capacity);
  // Closes the file and unlinks it from every path. No transfer on it may be running.
  Status remove_file(FileId file);
  uint64_t capacity(FileId file) const;

  // Pins [data, data + size) and registers it with every ring (fixed buffers).
  // Unregistered buffers work too, through the plain read/write calls.
  Status register_buffer(void* data, size_t size);
  Status unregister_buffer(void* data);

  IoHandle read(FileId file, uint64_t offset, void* buffer, uint64_t length);
  IoHandle write(FileId file, uint64_t offset, const void* buffer, uint64_t length,
                 Durability durability = Durability::kPageCache);
  // fdatasync on every path of `file`, issued after it is taken from the queue;
  // to cover a write, wait for the write first.
  IoHandle sync(FileId file);

  // O_DIRECT alignment for offsets, buffer addresses and block_size: the
  // largest statx(STATX_DIOALIGN) value over the paths, else 4096.
  uint64_t alignment() const;
  const IoOptions& options() const;
  // "io_uring (single issuer, deferred task run, ...)" or "pread/pwrite".
  std::string backend_description() const;
  IoCounters counters() const;
  // Per-request latencies (submission to completion, in microseconds) since
  // the last call, in no particular order.
  std::vector<float> take_request_latencies_us();

 private:
  explicit IoEngine(std::unique_ptr<IoEngineImpl> impl);
  std::unique_ptr<IoEngineImpl> impl_;
};

}  // namespace strata::io
