// Shared by the io_* tests: a fresh temporary directory (removed at the end)
// and deterministic random bytes.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>

#include "io/base/status.h"
#include "io/swap_directory.h"

namespace strata::io::testing {

class TemporaryDirectory {
 public:
  TemporaryDirectory() {
    std::string pattern =
        (std::filesystem::temp_directory_path() / "strata-io-test-XXXXXX").string();
    if (mkdtemp(pattern.data()) != nullptr) path_ = pattern;
  }
  ~TemporaryDirectory() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;

  const std::string& path() const { return path_; }
  std::string subdirectory(const std::string& name) const {
    std::string sub = path_ + "/" + name;
    std::filesystem::create_directories(sub);
    return sub;
  }
  // Why tests cannot run here, or "" when O_DIRECT works in this directory.
  std::string why_unusable() const {
    if (path_.empty()) return "could not create a temporary directory";
    Result<DirectoryInfo> info = inspect_swap_directory(path_);
    if (!info) return info.status().message();
    if (!info->direct_io)
      return "the temporary directory's filesystem (" + info->filesystem + ") has no O_DIRECT";
    return "";
  }

 private:
  std::string path_;
};

inline void fill_random(std::byte* data, size_t size, uint64_t seed) {
  std::mt19937_64 generator(seed);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t word = generator();
    std::memcpy(data + i, &word, 8);
  }
  for (; i < size; ++i) data[i] = std::byte(generator());
}

// A failure of `code` in one line that says `fragment`.
inline void expect_one_line(const Status& status, StatusCode code, const std::string& fragment) {
  ASSERT_FALSE(status.is_ok()) << fragment;
  EXPECT_TRUE(status.is(code)) << status_code_name(status.code()) << ": " << status.message();
  EXPECT_EQ(status.message().find('\n'), std::string::npos) << status.message();
  EXPECT_NE(status.message().find(fragment), std::string::npos)
      << "no '" << fragment << "' in: " << status.message();
}

}  // namespace strata::io::testing

#define STRATA_SKIP_WITHOUT_DIRECT_IO(directory)                                          \
  do {                                                                                    \
    std::string why = (directory).why_unusable();                                         \
    if (!why.empty()) GTEST_SKIP() << "O_DIRECT tests need a suitable temp dir: " << why; \
  } while (0)
