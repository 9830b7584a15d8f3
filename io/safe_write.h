// Files and directories written so that an error or a crash at any moment
// leaves, under the final name, either everything that was there before or
// everything new, never a mixture.
//
// Contract. AtomicFileWriter writes into a temporary file beside its target
// (same directory, hence same file system; named "<target>.tmp-<pid>-<n>"),
// then commit() flushes the file, renames it over the target and flushes the
// directory. On any failure, and when a writer is destroyed uncommitted, the
// temporary file is removed and the target keeps its old contents (or stays
// absent); the Status is one line naming the target, the step that failed and
// what the user can do. Callers add their own context (which flag named the
// path) with Status::with_context. After a failure the writer is closed: later
// calls fail and do nothing.
//
// Replacing goes through renameat2(RENAME_EXCHANGE) where the file system has
// it (ext4, xfs, btrfs, tmpfs, ...): the old file keeps the temporary name
// until the directory is flushed, so a failed directory flush can still put it
// back. Where there is no exchange, a plain rename replaces the target and a
// failed directory flush says that the new contents are in place but may not
// survive a crash. Once everything is durable the old file is removed; should
// that removal fail, it stays under the temporary name (a file no reader opens).
//
// Every call goes through a FileSystem (file_system.h), so tests can fail any
// step. A writer is not thread-safe; separate writers are independent.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "io/base/status.h"
#include "io/file_system.h"

namespace strata::io {

struct SafeWriteOptions {
  FileSystem* file_system = &FileSystem::real();
  mode_t permissions = 0644;  // of the new file, before the umask
};

class AtomicFileWriter {
 public:
  // Creates the temporary file. Refuses a target that is a directory.
  static Result<AtomicFileWriter> create(const std::string& path,
                                         const SafeWriteOptions& options = {});
  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  ~AtomicFileWriter();  // uncommitted: closes and removes the temporary file

  // Appends `size` bytes (short writes and EINTR are retried).
  Status append(const void* data, size_t size);
  // Flushes the file, renames it over the target and flushes the directory.
  Status commit();

  const std::string& path() const { return path_; }
  const std::string& temporary_path() const { return temporary_path_; }

 private:
  AtomicFileWriter() = default;
  // Closes and removes the temporary file (best effort: the error being
  // reported is the one that matters), then returns `error`.
  Status abandon(Status error);

  FileSystem* file_system_ = nullptr;
  std::string path_;
  std::string temporary_path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  bool pending_ = false;  // the temporary file exists and is this writer's to commit or remove
};

// `contents` into `path` through an AtomicFileWriter.
Status write_file_atomically(const std::string& path, std::string_view contents,
                             const SafeWriteOptions& options = {});

// Publishes a directory whose files are complete and flushed: flushes its
// entries, renames it to `destination` (swapping with an existing directory
// there where the file system can, else removing that one first), flushes the
// parent of `destination`, then removes the replaced directory. On failure
// `destination` keeps what it held (except where a plain rename had to remove
// it first), and `directory`, wherever it still exists, is the caller's to remove.
Status move_directory_into_place(const std::string& directory, const std::string& destination,
                                 FileSystem& file_system = FileSystem::real());

}  // namespace strata::io
