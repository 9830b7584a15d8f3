// Reading through the FileSystem seam: read_fully and read_whole_file get
// every byte back through short and interrupted reads, a file that ends early
// is a corruption naming the file, where it ends and that it is truncated, a
// failed read is one line with an I/O error's code, and file_error gives each
// errno its code.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "io/base/status.h"
#include "io/file_system.h"
#include "tiers_test_support.h"

namespace strata::io {
namespace {

using testing::TemporaryDirectory;

class FileSystemReads : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(directory_.path().empty());
    random_.seed(tiers::testing::fresh_seed("io_file_system"));
    path_ = directory_.path() + "/data.bin";
    contents_ = random_bytes(std::uniform_int_distribution<size_t>(64, 256 << 10)(random_));
    std::ofstream(path_, std::ios::binary) << contents_;
  }
  void TearDown() override {
    if (fd_ >= 0) FileSystem::real().close(fd_);
  }

  std::string random_bytes(size_t size) {
    std::string bytes(size, '\0');
    for (char& byte : bytes) byte = char(random_());
    return bytes;
  }
  int open_data() {
    Result<int> fd = open_for_reading(faults_, path_);
    EXPECT_TRUE(fd.is_ok()) << fd.status().message();
    fd_ = fd ? *fd : -1;
    return fd_;
  }
  // A random range [offset, offset + size) inside the file, at least 16 bytes
  // long (halved three times, it still leaves bytes to read).
  std::pair<uint64_t, size_t> random_range() {
    const uint64_t offset =
        std::uniform_int_distribution<uint64_t>(0, contents_.size() - 16)(random_);
    const size_t size =
        std::uniform_int_distribution<size_t>(16, contents_.size() - size_t(offset))(random_);
    return {offset, size};
  }

  TemporaryDirectory directory_;
  std::mt19937_64 random_;
  std::string path_;
  std::string contents_;
  FaultInjectingFileSystem faults_;
  int fd_ = -1;
};

using strata::io::testing::expect_one_line;

TEST_F(FileSystemReads, ReadFullyRetriesShortAndInterruptedReads) {
  const auto [offset, size] = random_range();
  faults_.add({.op = FileOp::kRead, .kind = FileFaultKind::kShortRead, .times = 3});
  faults_.add({.op = FileOp::kRead, .nth_call = 4, .error_number = EINTR});
  const int fd = open_data();
  std::string back(size, '\0');
  ASSERT_TRUE(read_fully(faults_, fd, back.data(), size, offset, path_).is_ok());
  EXPECT_EQ(back, contents_.substr(size_t(offset), size));
  EXPECT_EQ(faults_.faults_injected(), 4u);
  EXPECT_EQ(faults_.calls(FileOp::kRead), 5u);
}

TEST_F(FileSystemReads, ReadFullyPastTheEndIsACorruptionNamingTheFileAndWhereItEnds) {
  const uint64_t offset = contents_.size() / 2;
  const size_t size = contents_.size() - size_t(offset) + 1 + random_() % 100;
  const int fd = open_data();
  std::string back(size, '\0');
  const Status status = read_fully(faults_, fd, back.data(), size, offset, path_);
  expect_one_line(status, StatusCode::corruption, path_);
  EXPECT_NE(status.message().find("ends at byte " + std::to_string(contents_.size())),
            std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("at offset " + std::to_string(offset)), std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find("truncated"), std::string::npos) << status.message();
}

TEST_F(FileSystemReads, AFailedReadIsAnIoErrorNamingTheFileAndTheOffset) {
  const auto [offset, size] = random_range();
  faults_.add({.op = FileOp::kRead, .error_number = EIO});
  const int fd = open_data();
  std::string back(size, '\0');
  const Status status = read_fully(faults_, fd, back.data(), size, offset, path_);
  expect_one_line(status, StatusCode::io_error, path_);
  EXPECT_NE(status.message().find(errno_text(EIO)), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("at offset " + std::to_string(offset)), std::string::npos)
      << status.message();
}

TEST_F(FileSystemReads, ReadWholeFileGetsEveryByteThroughShortReads) {
  faults_.add({.op = FileOp::kRead, .kind = FileFaultKind::kShortRead, .times = 5});
  faults_.add({.op = FileOp::kRead, .nth_call = 6, .error_number = EINTR});
  Result<std::string> read = read_whole_file(faults_, path_);
  ASSERT_TRUE(read.is_ok()) << read.status().message();
  EXPECT_EQ(*read, contents_);
  EXPECT_GE(faults_.faults_injected(), 2u);  // the last read, at the end, may come early
  EXPECT_EQ(faults_.calls(FileOp::kClose), 1u);
}

TEST_F(FileSystemReads, ReadWholeFileReadsAPipe) {
  const std::string fifo = directory_.path() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << errno_text(errno);
  std::thread writer([&] { std::ofstream(fifo, std::ios::binary) << contents_; });
  Result<std::string> read = read_whole_file(faults_, fifo);
  writer.join();
  ASSERT_TRUE(read.is_ok()) << read.status().message();
  EXPECT_EQ(*read, contents_);
}

TEST_F(FileSystemReads, AMissingFileIsNotFoundAndAFailedReadAnIoError) {
  const std::string missing = directory_.path() + "/absent.json";
  const Status absent = read_whole_file(faults_, missing).status();
  expect_one_line(absent, StatusCode::not_found, missing);
  EXPECT_NE(absent.message().find("check the path"), std::string::npos) << absent.message();

  faults_.add({.op = FileOp::kRead, .nth_call = 1, .error_number = EIO});
  const Status failed = read_whole_file(faults_, path_).status();
  expect_one_line(failed, StatusCode::io_error, path_);
  EXPECT_EQ(faults_.calls(FileOp::kClose), 1u);  // the descriptor is not left open
}

TEST(FileError, GivesEachErrnoItsCodeAndKeepsTheMessage) {
  struct Case {
    int error_number;
    StatusCode code;
  };
  for (const Case& c :
       {Case{ENOENT, StatusCode::not_found}, Case{ENOTDIR, StatusCode::not_found},
        Case{ENOSPC, StatusCode::no_space}, Case{EDQUOT, StatusCode::no_space},
        Case{EACCES, StatusCode::permission_denied}, Case{EROFS, StatusCode::permission_denied},
        Case{EIO, StatusCode::io_error}, Case{EBADF, StatusCode::io_error}}) {
    const Status status = file_error("/some/file", "writing 8 bytes at offset 0", c.error_number);
    EXPECT_TRUE(status.is(c.code)) << status.message();
    EXPECT_EQ(status.message().rfind(
                  "/some/file: writing 8 bytes at offset 0: " + errno_text(c.error_number), 0),
              0u)
        << status.message();
  }
  EXPECT_EQ(file_error("/f", "creating", ENOSPC).message(),
            "/f: creating: " + errno_text(ENOSPC) +
                "; free space on that file system or write elsewhere");
  EXPECT_EQ(file_error("/f", "opening", EACCES, FileAccess::kRead).message(),
            "/f: opening: " + errno_text(EACCES) + "; make the file readable for this user");
  EXPECT_EQ(file_error("/f", "opening", EBADF, FileAccess::kRead).message(),
            "/f: opening: " + errno_text(EBADF));
}

}  // namespace
}  // namespace strata::io
