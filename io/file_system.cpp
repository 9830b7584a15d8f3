#include "io/file_system.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include "io/base/status.h"

namespace strata::io {
namespace {

class RealFileSystem final : public FileSystem {
 public:
  int open(const std::string& path, int flags, mode_t mode) override {
    const int fd = ::open(path.c_str(), flags, mode);
    return fd >= 0 ? fd : -errno;
  }
  int allocate(int fd, uint64_t size) override {
    return -::posix_fallocate(fd, 0, off_t(size));  // returns the error number itself
  }
  int64_t write_at(int fd, const void* data, size_t size, uint64_t offset) override {
    const ssize_t written = ::pwrite(fd, data, size, off_t(offset));
    return written >= 0 ? int64_t(written) : -int64_t{errno};
  }
  int sync(int fd, bool data_only) override {
    return (data_only ? ::fdatasync(fd) : ::fsync(fd)) == 0 ? 0 : -errno;
  }
  int close(int fd) override { return ::close(fd) == 0 ? 0 : -errno; }
  int rename(const std::string& from, const std::string& to, RenameMode mode) override {
    const unsigned flags = mode == RenameMode::kExchange ? RENAME_EXCHANGE : 0;
    return ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), flags) == 0 ? 0 : -errno;
  }
  int sync_directory(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return -errno;
    const int result = ::fsync(fd) == 0 ? 0 : -errno;
    ::close(fd);
    return result;
  }
  int remove_file(const std::string& path) override {
    return ::unlink(path.c_str()) == 0 ? 0 : -errno;
  }
  int remove_tree(const std::string& path) override {
    std::error_code error;
    std::filesystem::remove_all(path, error);
    return error ? -error.value() : 0;
  }
};

// What the user can do about a failed call, or "" when nothing.
const char* what_to_do(int error_number) {
  switch (error_number) {
    case ENOSPC:
      return "free space on that file system or write elsewhere";
    case EDQUOT:
      return "free space within your quota or write elsewhere";
    case EACCES:
    case EPERM:
      return "make the directory writable for this user or write elsewhere";
    case EROFS:
      return "that file system is mounted read-only; write elsewhere";
    case ENOENT:
      return "check that the directory exists";
    case ENOTDIR:
      return "a part of the path is not a directory; check the path";
    case EISDIR:
      return "a directory has that name; choose another name";
    case EIO:
      return "the device reported an error; check it and the kernel log";
    default:
      return "";
  }
}

}  // namespace

const char* file_op_name(FileOp op) {
  switch (op) {
    case FileOp::kOpen:
      return "open";
    case FileOp::kAllocate:
      return "allocate";
    case FileOp::kWrite:
      return "write";
    case FileOp::kSync:
      return "sync";
    case FileOp::kClose:
      return "close";
    case FileOp::kRename:
      return "rename";
    case FileOp::kSyncDirectory:
      return "sync directory";
    case FileOp::kRemove:
      return "remove";
  }
  return "?";
}

FileSystem& FileSystem::real() {
  static RealFileSystem* file_system = new RealFileSystem();  // never destroyed: used until exit
  return *file_system;
}

Status file_error(const std::string& path, const std::string& step, int error_number) {
  const std::string advice = what_to_do(error_number);
  return Status::error(fmt::format("{}: {}: {}{}{}", path, step, errno_text(error_number),
                                   advice.empty() ? "" : "; ", advice));
}

Status write_fully(FileSystem& file_system, int fd, const void* data, size_t size, uint64_t offset,
                   const std::string& path) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const int64_t written = file_system.write_at(fd, bytes, size, offset);
    if (written == -EINTR) continue;
    // pwrite returns 0 only for an empty request; were it to, retrying would spin forever.
    if (written <= 0) {
      return file_error(path, fmt::format("writing {} bytes at offset {}", size, offset),
                        written == 0 ? EIO : int(-written));
    }
    bytes += written;
    size -= size_t(written);
    offset += uint64_t(written);
  }
  return Status::ok();
}

// --- fault injection -------------------------------------------------------------------

void FaultInjectingFileSystem::add(const FileFault& fault) {
  std::lock_guard lock(mutex_);
  faults_.push_back(fault);
}

uint64_t FaultInjectingFileSystem::calls(FileOp op) const {
  std::lock_guard lock(mutex_);
  return calls_[int(op)];
}

uint64_t FaultInjectingFileSystem::faults_injected() const {
  std::lock_guard lock(mutex_);
  return injected_;
}

std::optional<FileFault> FaultInjectingFileSystem::on_call(FileOp op, size_t write_size) {
  std::lock_guard lock(mutex_);
  const uint64_t call = ++calls_[int(op)];
  for (FileFault& fault : faults_) {
    if (fault.op != op || fault.times == 0 || call < fault.nth_call) continue;
    if (fault.kind == FileFaultKind::kShortWrite && write_size < 2) continue;
    --fault.times;
    ++injected_;
    return fault;
  }
  return std::nullopt;
}

int FaultInjectingFileSystem::open(const std::string& path, int flags, mode_t mode) {
  if (auto fault = on_call(FileOp::kOpen)) return -fault->error_number;
  return inner_.open(path, flags, mode);
}

int FaultInjectingFileSystem::allocate(int fd, uint64_t size) {
  if (auto fault = on_call(FileOp::kAllocate)) return -fault->error_number;
  return inner_.allocate(fd, size);
}

int64_t FaultInjectingFileSystem::write_at(int fd, const void* data, size_t size, uint64_t offset) {
  std::optional<FileFault> fault = on_call(FileOp::kWrite, size);
  if (!fault) return inner_.write_at(fd, data, size, offset);
  if (fault->kind == FileFaultKind::kShortWrite) return inner_.write_at(fd, data, size / 2, offset);
  return -int64_t{fault->error_number};
}

int FaultInjectingFileSystem::sync(int fd, bool data_only) {
  if (auto fault = on_call(FileOp::kSync)) return -fault->error_number;
  return inner_.sync(fd, data_only);
}

int FaultInjectingFileSystem::close(int fd) {
  if (auto fault = on_call(FileOp::kClose)) {
    inner_.close(fd);
    return -fault->error_number;
  }
  return inner_.close(fd);
}

int FaultInjectingFileSystem::rename(const std::string& from, const std::string& to,
                                     RenameMode mode) {
  if (auto fault = on_call(FileOp::kRename)) return -fault->error_number;
  return inner_.rename(from, to, mode);
}

int FaultInjectingFileSystem::sync_directory(const std::string& path) {
  if (auto fault = on_call(FileOp::kSyncDirectory)) return -fault->error_number;
  return inner_.sync_directory(path);
}

int FaultInjectingFileSystem::remove_file(const std::string& path) {
  if (auto fault = on_call(FileOp::kRemove)) return -fault->error_number;
  return inner_.remove_file(path);
}

int FaultInjectingFileSystem::remove_tree(const std::string& path) {
  if (auto fault = on_call(FileOp::kRemove)) return -fault->error_number;
  return inner_.remove_tree(path);
}

}  // namespace strata::io
