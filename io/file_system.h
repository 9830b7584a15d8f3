// FileSystem: the seam between strata's file writers and the kernel.
//
// Contract. Every file strata writes (checkpoints, exports, demo data) is
// opened, written, flushed, renamed and removed through one of these, so that
// tests can swap in FaultInjectingFileSystem and make any call fail, the way
// the I/O engine's Ring can be wrapped (fault_injection.h). The calls are thin:
// results follow the kernel's convention (a descriptor or a byte count when
// >= 0, -errno on failure) and nothing is retried here; retrying short writes
// and EINTR is write_fully's job. FileSystem::real() is the kernel itself and
// lives as long as the process. Implementations are thread-safe.
#pragma once

#include <sys/types.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "io/base/status.h"

namespace strata::io {

enum class FileOp {
  kOpen,           // open(2)
  kAllocate,       // posix_fallocate(3)
  kWrite,          // pwrite(2)
  kSync,           // fsync(2) or fdatasync(2)
  kClose,          // close(2)
  kRename,         // rename(2), or renameat2(2) with RENAME_EXCHANGE
  kSyncDirectory,  // open(2) + fsync(2) of a directory
  kRemove,         // unlink(2), or a directory and everything in it
};
inline constexpr int kFileOpCount = 8;
const char* file_op_name(FileOp op);  // "open", "write", ...

enum class RenameMode {
  kReplace,   // `to` is replaced if it exists (a directory only if empty)
  kExchange,  // `from` and `to` swap names atomically; both must exist
};

class FileSystem {
 public:
  // The kernel's file system (POSIX calls). Never destroyed.
  static FileSystem& real();

  virtual ~FileSystem() = default;

  virtual int open(const std::string& path, int flags, mode_t mode) = 0;
  // Reserves [0, size) so that later writes there cannot fail for want of space.
  virtual int allocate(int fd, uint64_t size) = 0;
  // Bytes written (maybe fewer than `size`) or -errno.
  virtual int64_t write_at(int fd, const void* data, size_t size, uint64_t offset) = 0;
  // fdatasync when `data_only` (enough for a file whose size was reserved), else fsync.
  virtual int sync(int fd, bool data_only) = 0;
  virtual int close(int fd) = 0;
  virtual int rename(const std::string& from, const std::string& to, RenameMode mode) = 0;
  // Makes the directory's entries (files created, renamed or removed there) durable.
  virtual int sync_directory(const std::string& path) = 0;
  virtual int remove_file(const std::string& path) = 0;
  // Removes a directory and everything in it; a missing one is not an error.
  virtual int remove_tree(const std::string& path) = 0;
};

// Writes all `size` bytes at `offset`, retrying short writes and EINTR; any
// other failure is a one-line error naming `path`, the offset and what to do.
Status write_fully(FileSystem& file_system, int fd, const void* data, size_t size, uint64_t offset,
                   const std::string& path);

// "<path>: <step>: <errno text>; <what to do>" for a failed call; the advice
// depends on the errno (no space, no permission, read-only file system, ...)
// and is left out where there is nothing the user can do.
Status file_error(const std::string& path, const std::string& step, int error_number);

// The kind of failure a FileFault injects.
enum class FileFaultKind {
  kError,       // the call fails with error_number and does nothing (a close
                // still releases the descriptor, as Linux's close(2) does)
  kShortWrite,  // a write really writes half the request (at least one byte) and says so
};

struct FileFault {
  FileOp op = FileOp::kWrite;
  uint64_t nth_call = 1;  // counted from 1 over every call of `op` through this file system
  FileFaultKind kind = FileFaultKind::kError;
  int error_number = EIO;
  uint64_t times = 1;  // how many calls in a row, from nth_call, get this fault
};

// Passes every call to `inner` unless a fault is aimed at it, in the spirit of
// LevelDB's test Env. Thread-safe.
class FaultInjectingFileSystem final : public FileSystem {
 public:
  explicit FaultInjectingFileSystem(FileSystem& inner = FileSystem::real()) : inner_(inner) {}

  void add(const FileFault& fault);
  uint64_t calls(FileOp op) const;
  uint64_t faults_injected() const;

  int open(const std::string& path, int flags, mode_t mode) override;
  int allocate(int fd, uint64_t size) override;
  int64_t write_at(int fd, const void* data, size_t size, uint64_t offset) override;
  int sync(int fd, bool data_only) override;
  int close(int fd) override;
  int rename(const std::string& from, const std::string& to, RenameMode mode) override;
  int sync_directory(const std::string& path) override;
  int remove_file(const std::string& path) override;
  int remove_tree(const std::string& path) override;

 private:
  // Counts a call of `op` and returns the fault it gets, if any (a short write
  // only for a request of two bytes or more).
  std::optional<FileFault> on_call(FileOp op, size_t write_size = 0);

  FileSystem& inner_;
  mutable std::mutex mutex_;
  std::vector<FileFault> faults_;
  uint64_t calls_[kFileOpCount] = {};
  uint64_t injected_ = 0;
};

}  // namespace strata::io
