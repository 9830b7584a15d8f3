#include "io/swap_directory.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "io/base/sizes.h"
#include "io/base/status.h"

namespace strata::io {
namespace {

std::string filesystem_name(long magic) {
  switch (static_cast<unsigned long>(magic)) {
    case 0xEF53:
      return "ext4";
    case 0x58465342:
      return "xfs";
    case 0x9123683E:
      return "btrfs";
    case 0x01021994:
      return "tmpfs";
    case 0x794C7630:
      return "overlayfs";
    case 0x6969:
      return "nfs";
    case 0x65735546:
      return "fuse";
    case 0x2FC12FC1:
      return "zfs";
    case 0xF2F52010:
      return "f2fs";
    default:
      return fmt::format("unknown (0x{:x})", static_cast<unsigned long>(magic));
  }
}

// Writes and reads one aligned block with O_DIRECT in `directory`.
Result<bool> probe_direct_io(const std::string& directory, uint64_t alignment) {
  std::string probe = fmt::format("{}/.strata-direct-probe-{}", directory, getpid());
  int fd = open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0 && errno == EINVAL) return false;
  if (fd < 0) {
    return Status::error(
        fmt::format("NVMe path '{}' is not writable ({}); choose a directory you can write to",
                    directory, errno_text(errno)));
  }
  unlink(probe.c_str());
  void* block = std::aligned_alloc(alignment, alignment);
  std::memset(block, 0x5A, alignment);
  bool works = pwrite(fd, block, alignment, 0) == ssize_t(alignment) &&
               pread(fd, block, alignment, 0) == ssize_t(alignment);
  int error_number = errno;
  std::free(block);
  close(fd);
  if (!works && error_number != EINVAL) {
    return Status::error(fmt::format("NVMe path '{}': direct I/O probe failed: {}", directory,
                                     errno_text(error_number)));
  }
  return works;
}

}  // namespace

Result<DirectoryInfo> inspect_swap_directory(const std::string& directory) {
  struct stat info {};
  if (stat(directory.c_str(), &info) != 0) {
    if (errno == ENOENT)
      return Status::error(fmt::format(
          "NVMe path '{}' does not exist; create it or name another directory", directory));
    return Status::error(fmt::format("NVMe path '{}': {}", directory, errno_text(errno)));
  }
  if (!S_ISDIR(info.st_mode))
    return Status::error(fmt::format(
        "NVMe path '{}' is not a directory; name a directory on the NVMe device", directory));
  if (access(directory.c_str(), W_OK | X_OK) != 0) {
    return Status::error(
        fmt::format("NVMe path '{}' is not writable ({}); choose a directory you can write to",
                    directory, errno_text(errno)));
  }

  DirectoryInfo result;
  struct statfs filesystem {};
  result.filesystem = statfs(directory.c_str(), &filesystem) == 0
                          ? filesystem_name(filesystem.f_type)
                          : std::string("unknown");
  // STATX_DIOALIGN is reported for regular files; ask about a fresh one.
  std::string probe = fmt::format("{}/.strata-align-probe-{}", directory, getpid());
  int fd = open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return Status::error(
        fmt::format("NVMe path '{}' is not writable ({}); choose a directory you can write to",
                    directory, errno_text(errno)));
  }
  unlink(probe.c_str());
  struct statx extended {};
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &extended) == 0 &&
      (extended.stx_mask & STATX_DIOALIGN) && extended.stx_dio_offset_align != 0) {
    result.alignment =
        std::max<uint64_t>(extended.stx_dio_offset_align, extended.stx_dio_mem_align);
  }
  close(fd);

  Result<bool> direct = probe_direct_io(directory, result.alignment);
  if (!direct) return direct.status();
  result.direct_io = *direct;
  return result;
}

uint64_t free_bytes(const std::string& directory) {
  struct statvfs space {};
  if (statvfs(directory.c_str(), &space) != 0) return 0;
  return uint64_t(space.f_bavail) * space.f_frsize;
}

Result<SwapFileHandle> open_swap_file(const std::string& directory, const std::string& name,
                                      uint64_t size, bool direct_io) {
  SwapFileHandle file{-1, directory + "/" + name};
  uint64_t already_allocated = 0;
  struct stat existing {};
  if (stat(file.path.c_str(), &existing) == 0)
    already_allocated = uint64_t(existing.st_blocks) * 512;
  uint64_t available = free_bytes(directory) + already_allocated;
  if (size > available) {
    return Status::error(
        fmt::format("not enough free space in '{}' for {} of swap file: {} available; free some "
                    "space or ask for less",
                    directory, format_bytes(size), format_bytes(available)));
  }
  int flags = O_RDWR | O_CREAT | O_CLOEXEC | (direct_io ? O_DIRECT : 0);
  file.fd = open(file.path.c_str(), flags, 0600);
  if (file.fd < 0) return Status::error(fmt::format("open {}: {}", file.path, errno_text(errno)));
  if (size > 0 && fallocate(file.fd, 0, 0, off_t(size)) != 0) {
    int error_number = errno;
    if (error_number == EOPNOTSUPP && ftruncate(file.fd, off_t(size)) == 0) return file;
    close(file.fd);
    return Status::error(
        fmt::format("fallocate {} bytes for {}: {}", size, file.path, errno_text(error_number)));
  }
  return file;
}

}  // namespace strata::io
