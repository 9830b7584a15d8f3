#include "io/safe_write.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <utility>

namespace strata::io {
namespace {

enum class EntryKind { kFile, kDirectory };

std::string parent_directory(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  return parent.empty() ? "." : parent;
}

// renameat2's answers when the file system (NFS, some FUSE ones) cannot exchange names.
bool lacks_exchange(int result) {
  return result == -EINVAL || result == -ENOSYS || result == -EOPNOTSUPP;
}

// Renames `from` over `to`, flushes the directory holding `to`, then removes
// what `to` held before (see the header's contract). On failure, `from`,
// wherever it still exists, is the caller's to remove.
Status move_into_place(FileSystem& file_system, const std::string& from, const std::string& to,
                       EntryKind kind) {
  // How to take the rename back should the directory fail to flush.
  enum class Undo { kSwapBack, kMoveBack, kImpossible };
  Undo undo = Undo::kSwapBack;
  int result = file_system.rename(from, to, RenameMode::kExchange);
  if (result == -ENOENT) {  // nothing under `to` yet
    undo = Undo::kMoveBack;
    result = file_system.rename(from, to, RenameMode::kReplace);
  } else if (lacks_exchange(result)) {
    undo = Undo::kImpossible;
    result = file_system.rename(from, to, RenameMode::kReplace);
    if (kind == EntryKind::kDirectory && (result == -ENOTEMPTY || result == -EEXIST)) {
      // No directory can be renamed over a non-empty one, so the old one goes
      // first: a crash in between leaves neither (only where there is no exchange).
      result = file_system.remove_tree(to);
      if (result == 0) result = file_system.rename(from, to, RenameMode::kReplace);
    }
  }
  if (result != 0) return file_error(to, fmt::format("renaming {} into place", from), -result);

  const std::string parent = parent_directory(to);
  if (const int synced = file_system.sync_directory(parent); synced != 0) {
    const Status error = file_error(to, fmt::format("flushing the directory {}", parent), -synced);
    bool restored = false;
    if (undo == Undo::kSwapBack)
      restored = file_system.rename(from, to, RenameMode::kExchange) == 0;
    else if (undo == Undo::kMoveBack)
      restored = file_system.rename(to, from, RenameMode::kReplace) == 0;
    if (restored) return error;
    return Status::error(error.message() +
                         "; the new contents are in place but may not survive a crash");
  }
  if (undo == Undo::kSwapBack) {  // the replaced entry now has the name `from`
    if (kind == EntryKind::kFile)
      file_system.remove_file(from);
    else
      file_system.remove_tree(from);
  }
  return Status::ok();
}

}  // namespace

Result<AtomicFileWriter> AtomicFileWriter::create(const std::string& path,
                                                  const SafeWriteOptions& options) {
  // An exchange would happily swap a file with a directory, so refuse one here.
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored))
    return file_error(path, "replacing it with a file", EISDIR);
  static std::atomic<uint64_t> next_number{0};
  AtomicFileWriter writer;
  writer.file_system_ = options.file_system;
  writer.path_ = path;
  // A name left by a killed process that had the same id is skipped, not reused.
  constexpr int kAttempts = 16;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    writer.temporary_path_ = fmt::format("{}.tmp-{}-{}", path, ::getpid(), next_number++);
    writer.fd_ = writer.file_system_->open(
        writer.temporary_path_, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, options.permissions);
    if (writer.fd_ != -EEXIST) break;
  }
  if (writer.fd_ < 0) {
    const int error_number = -std::exchange(writer.fd_, -1);
    return file_error(path, fmt::format("creating the temporary file {}", writer.temporary_path_),
                      error_number);
  }
  writer.pending_ = true;
  return writer;
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept {
  *this = std::move(other);
}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  std::swap(file_system_, other.file_system_);
  std::swap(path_, other.path_);
  std::swap(temporary_path_, other.temporary_path_);
  std::swap(fd_, other.fd_);
  std::swap(size_, other.size_);
  std::swap(pending_, other.pending_);
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() {
  if (pending_) (void)abandon(Status::ok());
}

Status AtomicFileWriter::append(const void* data, size_t size) {
  if (!pending_ || fd_ < 0)
    return Status::error(fmt::format(
        "{}: no longer open for writing (committed, or abandoned after an error)", path_));
  if (Status written = write_fully(*file_system_, fd_, data, size, size_, path_); !written)
    return abandon(written);
  size_ += size;
  return Status::ok();
}

Status AtomicFileWriter::commit() {
  if (!pending_ || fd_ < 0)
    return Status::error(fmt::format(
        "{}: no longer open for writing (committed, or abandoned after an error)", path_));
  if (const int synced = file_system_->sync(fd_, /*data_only=*/false); synced != 0)
    return abandon(
        file_error(path_, fmt::format("flushing the temporary file {}", temporary_path_), -synced));
  if (const int closed = file_system_->close(std::exchange(fd_, -1)); closed != 0)
    return abandon(
        file_error(path_, fmt::format("closing the temporary file {}", temporary_path_), -closed));
  if (Status moved = move_into_place(*file_system_, temporary_path_, path_, EntryKind::kFile);
      !moved)
    return abandon(moved);
  pending_ = false;
  return Status::ok();
}

Status AtomicFileWriter::abandon(Status error) {
  if (fd_ >= 0) file_system_->close(std::exchange(fd_, -1));
  if (pending_) file_system_->remove_file(temporary_path_);
  pending_ = false;
  return error;
}

Status write_file_atomically(const std::string& path, std::string_view contents,
                             const SafeWriteOptions& options) {
  Result<AtomicFileWriter> writer = AtomicFileWriter::create(path, options);
  if (!writer) return writer.status();
  if (Status appended = writer->append(contents.data(), contents.size()); !appended)
    return appended;
  return writer->commit();
}

Status move_directory_into_place(const std::string& directory, const std::string& destination,
                                 FileSystem& file_system) {
  if (const int synced = file_system.sync_directory(directory); synced != 0)
    return file_error(destination, fmt::format("flushing the directory {}", directory), -synced);
  return move_into_place(file_system, directory, destination, EntryKind::kDirectory);
}

}  // namespace strata::io
