// FileSystem: the seam between strata's file readers and writers and the kernel.
//
// Contract. Every file strata writes (checkpoints, exports, demo data) is
// opened, written, flushed, renamed and removed through one of these, and
// every file it reads (checkpoints, safetensors, token files, tokenizer.json,
// JSON configs) is opened, sized, read or mapped through one, so that tests
// can swap in FaultInjectingFileSystem and make any call fail, the way the I/O
// engine's Ring can be wrapped (fault_injection.h). The calls are thin:
// results follow the kernel's convention (a descriptor or a byte count when
// >= 0, -errno on failure) and nothing is retried here; retrying short
// transfers and EINTR is write_fully's and read_fully's job. Looking at
// directories (listing, exists) stays with std::filesystem. FileSystem::real()
// is the kernel itself and lives as long as the process; any other must
// outlive what was opened through it. Implementations are thread-safe.
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
  kRead,           // pread(2) or read(2)
  kStat,           // fstat(2), for a file's size
  kMap,            // mmap(2) of a file, read-only (munmap is neither counted nor failed)
};
inline constexpr int kFileOpCount = 11;
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

  // Bytes read at `offset` (maybe fewer than `size`; 0 at the end of the file) or -errno.
  virtual int64_t read_at(int fd, void* data, size_t size, uint64_t offset) = 0;
  // The same from the descriptor's position, which it advances (pipes read too).
  virtual int64_t read_next(int fd, void* data, size_t size) = 0;
  // The file's size in bytes, or -errno.
  virtual int64_t file_size(int fd) = 0;
  // Maps [0, size) of `fd` read-only and private: 0 and *address, or -errno.
  virtual int map(int fd, size_t size, const void** address) = 0;
  // Unmaps what map() mapped.
  virtual void unmap(const void* address, size_t size) = 0;
};

// Whether a failed call was reading or writing, for the advice in its message.
enum class FileAccess { kRead, kWrite };

// Writes all `size` bytes at `offset`, retrying short writes and EINTR; any
// other failure is a one-line error naming `path`, the offset and what to do.
Status write_fully(FileSystem& file_system, int fd, const void* data, size_t size, uint64_t offset,
                   const std::string& path);

// Reads all `size` bytes at `offset`, retrying short reads and EINTR. A file
// that ends first is a corruption naming `path`, where it ends and that it is
// truncated; any other failure is file_error's line (an I/O error, ...).
Status read_fully(FileSystem& file_system, int fd, void* data, size_t size, uint64_t offset,
                  const std::string& path);

// Opens `path` read-only: the descriptor, or file_error's line (not found, ...).
Result<int> open_for_reading(FileSystem& file_system, const std::string& path);

// The whole of a small file (a JSON file, tokenizer.json, a template), read
// with read_next to its end, so that a pipe (`--config <(...)`) reads too.
Result<std::string> read_whole_file(FileSystem& file_system, const std::string& path);

// "<path>: <step>: <errno text>; <what to do>" for a failed call, with the
// code Status::from_errno gives the errno (not found, no space, permission
// denied, else I/O error); the advice depends on the errno and on `access`
// (no space, no permission, read-only file system, ...) and is left out
// where there is nothing the user can do.
Status file_error(const std::string& path, const std::string& step, int error_number,
                  FileAccess access = FileAccess::kWrite);

// The kind of failure a FileFault injects.
enum class FileFaultKind {
  kError,       // the call fails with error_number and does nothing (a close
                // still releases the descriptor, as Linux's close(2) does)
  kShortWrite,  // a write really writes half the request (at least one byte) and says so
  kShortRead,   // a read really reads half the request (at least one byte) and says so
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
  int64_t read_at(int fd, void* data, size_t size, uint64_t offset) override;
  int64_t read_next(int fd, void* data, size_t size) override;
  int64_t file_size(int fd) override;
  int map(int fd, size_t size, const void** address) override;
  void unmap(const void* address, size_t size) override;

 private:
  // Counts a call of `op` and returns the fault it gets, if any (a short
  // transfer only for a request of two bytes or more).
  std::optional<FileFault> on_call(FileOp op, size_t transfer_size = 0);

  FileSystem& inner_;
  mutable std::mutex mutex_;
  std::vector<FileFault> faults_;
  uint64_t calls_[kFileOpCount] = {};
  uint64_t injected_ = 0;
};

}  // namespace strata::io
