// Checks on a directory that will hold swap files, and the files themselves.
//
// Contract. Every function returns a Status whose message names the directory
// or file and says what the user can do; none of them leaves files behind
// except open_swap_file, whose file the caller owns (and closes / unlinks).
#pragma once

#include <cstdint>
#include <string>

#include "io/base/status.h"

namespace strata::io {

struct DirectoryInfo {
  bool direct_io = false;     // O_DIRECT opens, writes and reads there
  uint64_t alignment = 4096;  // statx(STATX_DIOALIGN) where reported, else 4096
  std::string filesystem;     // "ext4", "xfs", "tmpfs", ... or "unknown (0x...)"
};

// Exists, is a directory, is writable, and whether O_DIRECT works there
// (probed with a small file that is removed again).
Result<DirectoryInfo> inspect_swap_directory(const std::string& directory);

uint64_t free_bytes(const std::string& directory);

struct SwapFileHandle {
  int fd = -1;
  std::string path;
};

// Opens (creating if needed) `directory/name` for reading and writing, with
// O_DIRECT when `direct_io`, and preallocates `size` bytes with fallocate.
// Refuses when the free space (plus what the file already holds) is short.
Result<SwapFileHandle> open_swap_file(const std::string& directory, const std::string& name,
                                      uint64_t size, bool direct_io);


}  // namespace strata::io
