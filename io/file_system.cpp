#include "io/file_system.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
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
  int64_t read_at(int fd, void* data, size_t size, uint64_t offset) override {
    const ssize_t got = ::pread(fd, data, size, off_t(offset));
    return got >= 0 ? int64_t(got) : -int64_t{errno};
  }
  int64_t read_next(int fd, void* data, size_t size) override {
    const ssize_t got = ::read(fd, data, size);
    return got >= 0 ? int64_t(got) : -int64_t{errno};
  }
  int64_t file_size(int fd) override {
    struct stat st {};
    return ::fstat(fd, &st) == 0 ? int64_t(st.st_size) : -int64_t{errno};
  }
  int map(int fd, size_t size, const void** address) override {
    void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (mapped == MAP_FAILED) return -errno;
    *address = mapped;
    return 0;
  }
  void unmap(const void* address, size_t size) override {
    ::munmap(const_cast<void*>(address), size);
  }
};

// What the user can do about a failed read, or "" when nothing.
const char* what_to_do_reading(int error_number) {
  switch (error_number) {
    case ENOENT:
      return "check the path";
    case ENOTDIR:
      return "a part of the path is not a directory; check the path";
    case EACCES:
    case EPERM:
      return "make the file readable for this user";
    case EISDIR:
      return "a directory has that name; give the file";
    case EIO:
      return "the device reported an error; check it and the kernel log";
    default:
      return "";
  }
}

// What the user can do about a failed write, or "" when nothing.
const char* what_to_do_writing(int error_number) {
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
    case FileOp::kRead:
      return "read";
    case FileOp::kStat:
      return "stat";
    case FileOp::kMap:
      return "map";
  }
  return "?";
}

FileSystem& FileSystem::real() {
  static RealFileSystem* file_system = new RealFileSystem();  // never destroyed: used until exit
  return *file_system;
}

Status file_error(const std::string& path, const std::string& step, int error_number,
                  FileAccess access) {
  return Status::from_errno(error_number, fmt::format("{}: {}", path, step),
                            access == FileAccess::kRead ? what_to_do_reading(error_number)
                                                        : what_to_do_writing(error_number));
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

Status read_fully(FileSystem& file_system, int fd, void* data, size_t size, uint64_t offset,
                  const std::string& path) {
  auto* bytes = static_cast<char*>(data);
  const uint64_t start = offset;
  const size_t wanted = size;
  while (size > 0) {
    const int64_t got = file_system.read_at(fd, bytes, size, offset);
    if (got == -EINTR) continue;
    if (got < 0)
      return file_error(path, fmt::format("reading {} bytes at offset {}", size, offset), int(-got),
                        FileAccess::kRead);
    if (got == 0)
      return Status::corruption(
          fmt::format("{}: ends at byte {}, short of the {} bytes read at offset {}; the file is "
                      "truncated",
                      path, offset, wanted, start));
    bytes += got;
    size -= size_t(got);
    offset += uint64_t(got);
  }
  return Status::ok();
}

Result<int> open_for_reading(FileSystem& file_system, const std::string& path) {
  const int fd = file_system.open(path, O_RDONLY | O_CLOEXEC, 0);
  if (fd < 0) return file_error(path, "opening", -fd, FileAccess::kRead);
  return fd;
}

Result<std::string> read_whole_file(FileSystem& file_system, const std::string& path) {
  Result<int> fd = open_for_reading(file_system, path);
  if (!fd) return fd.status();
  constexpr size_t kBlock = 64 << 10;
  std::string contents;
  size_t used = 0;
  Status status = Status::ok();
  for (;;) {
    contents.resize(used + kBlock);
    const int64_t got = file_system.read_next(*fd, contents.data() + used, kBlock);
    if (got == -EINTR) continue;
    if (got < 0) {
      status =
          file_error(path, fmt::format("reading at offset {}", used), int(-got), FileAccess::kRead);
      break;
    }
    if (got == 0) break;
    used += size_t(got);
  }
  file_system.close(*fd);  // read-only: nothing a failed close could lose
  if (!status) return status;
  contents.resize(used);
  return contents;
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

std::optional<FileFault> FaultInjectingFileSystem::on_call(FileOp op, size_t transfer_size) {
  std::lock_guard lock(mutex_);
  const uint64_t call = ++calls_[int(op)];
  for (FileFault& fault : faults_) {
    if (fault.op != op || fault.times == 0 || call < fault.nth_call) continue;
    if (fault.kind != FileFaultKind::kError && transfer_size < 2) continue;
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

int64_t FaultInjectingFileSystem::read_at(int fd, void* data, size_t size, uint64_t offset) {
  std::optional<FileFault> fault = on_call(FileOp::kRead, size);
  if (!fault) return inner_.read_at(fd, data, size, offset);
  if (fault->kind == FileFaultKind::kShortRead) return inner_.read_at(fd, data, size / 2, offset);
  return -int64_t{fault->error_number};
}

int64_t FaultInjectingFileSystem::read_next(int fd, void* data, size_t size) {
  std::optional<FileFault> fault = on_call(FileOp::kRead, size);
  if (!fault) return inner_.read_next(fd, data, size);
  if (fault->kind == FileFaultKind::kShortRead) return inner_.read_next(fd, data, size / 2);
  return -int64_t{fault->error_number};
}

int64_t FaultInjectingFileSystem::file_size(int fd) {
  if (auto fault = on_call(FileOp::kStat)) return -int64_t{fault->error_number};
  return inner_.file_size(fd);
}

int FaultInjectingFileSystem::map(int fd, size_t size, const void** address) {
  if (auto fault = on_call(FileOp::kMap)) return -fault->error_number;
  return inner_.map(fd, size, address);
}

void FaultInjectingFileSystem::unmap(const void* address, size_t size) {
  inner_.unmap(address, size);
}

}  // namespace strata::io
