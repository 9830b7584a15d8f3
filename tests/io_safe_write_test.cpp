// write_file_atomically and move_directory_into_place under injected faults
// and real refusals: whatever step fails, the target keeps its old contents
// byte for byte (or stays absent), no temporary is left behind, and the error
// is one line naming the step and the target.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "io/base/status.h"
#include "io/file_system.h"
#include "io/safe_write.h"
#include "io_test_support.h"

namespace strata::io {
namespace {

namespace fs = std::filesystem;
using testing::TemporaryDirectory;

uint64_t fresh_seed() {
  uint64_t seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  if (const char* given = std::getenv("STRATA_TEST_SEED")) seed = std::strtoull(given, nullptr, 10);
  std::printf("seed %llu (rerun with STRATA_TEST_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(seed));
  return seed;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

void write_plain_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
  ASSERT_EQ(read_file(path), bytes);
}

// Every name in `directory`, sorted, hidden ones included.
std::vector<std::string> names_in(const std::string& directory) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(directory))
    names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

void expect_one_line_error(const Status& status, const std::string& step, const std::string& path,
                           int error_number) {
  ASSERT_FALSE(status.is_ok());
  const std::string& message = status.message();
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  EXPECT_NE(message.find(step), std::string::npos) << "no step '" << step << "' in: " << message;
  EXPECT_NE(message.find(path), std::string::npos) << "no path in: " << message;
  EXPECT_NE(message.find(errno_text(error_number)), std::string::npos) << message;
}

class SafeWriteTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(directory_.path().empty());
    random_.seed(fresh_seed());
    target_ = directory_.path() + "/target.bin";
  }

  // 1 byte to 256 KiB of random bytes.
  std::string random_contents() {
    std::string bytes(std::uniform_int_distribution<size_t>(1, 256 << 10)(random_), '\0');
    for (char& byte : bytes) byte = char(random_());
    return bytes;
  }

  TemporaryDirectory directory_;
  std::mt19937_64 random_;
  std::string target_;
  FaultInjectingFileSystem faults_;
  SafeWriteOptions options_{.file_system = &faults_};
};

// --- every step of the helper, failed ---------------------------------------------------

struct StepFailure {
  const char* name;
  std::vector<FileFault> faults;
  const char* step;  // what the message must name
  int error_number;  // what the message must report
};

void PrintTo(const StepFailure& failure, std::ostream* out) {
  *out << failure.name;
}

const std::vector<StepFailure> kStepFailures = {
    {"CreateTemporary",
     {{.op = FileOp::kOpen, .error_number = EACCES}},
     "creating the temporary file",
     EACCES},
    {"Write", {{.op = FileOp::kWrite, .error_number = EIO}}, "writing", EIO},
    {"ShortWriteThenNoSpace",
     {{.op = FileOp::kWrite, .kind = FileFaultKind::kShortWrite},
      {.op = FileOp::kWrite, .nth_call = 2, .error_number = ENOSPC}},
     "writing",
     ENOSPC},
    {"SyncFile", {{.op = FileOp::kSync, .error_number = EIO}}, "flushing the temporary file", EIO},
    {"Close", {{.op = FileOp::kClose, .error_number = EIO}}, "closing the temporary file", EIO},
    {"Rename", {{.op = FileOp::kRename, .error_number = EACCES}}, "renaming", EACCES},
    {"SyncDirectory",
     {{.op = FileOp::kSyncDirectory, .error_number = EIO}},
     "flushing the directory",
     EIO},
};

class SafeWriteStepTest : public SafeWriteTest,
                          public ::testing::WithParamInterface<std::tuple<StepFailure, bool>> {};

TEST_P(SafeWriteStepTest, LeavesTheOldFileAndNoTemporary) {
  const auto& [failure, had_old_file] = GetParam();
  const std::string old_contents = random_contents();
  if (had_old_file) write_plain_file(target_, old_contents);
  for (const FileFault& fault : failure.faults) faults_.add(fault);

  const Status status = write_file_atomically(target_, random_contents(), options_);

  expect_one_line_error(status, failure.step, target_, failure.error_number);
  EXPECT_EQ(faults_.faults_injected(), failure.faults.size());
  if (had_old_file) {
    EXPECT_EQ(read_file(target_), old_contents);
    EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"target.bin"});
  } else {
    EXPECT_TRUE(names_in(directory_.path()).empty());
  }
}

INSTANTIATE_TEST_SUITE_P(EveryStep, SafeWriteStepTest,
                         ::testing::Combine(::testing::ValuesIn(kStepFailures), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) +
                                  (std::get<1>(info.param) ? "_OverAnOldFile" : "_AsANewFile");
                         });

// --- what succeeds --------------------------------------------------------------------

TEST_F(SafeWriteTest, ReplacesTheOldFileFlushingTheFileAndTheDirectory) {
  write_plain_file(target_, random_contents());
  const std::string contents = random_contents();
  ASSERT_TRUE(write_file_atomically(target_, contents, options_).is_ok());
  EXPECT_EQ(read_file(target_), contents);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"target.bin"});
  EXPECT_EQ(faults_.calls(FileOp::kSync), 1u);
  EXPECT_EQ(faults_.calls(FileOp::kSyncDirectory), 1u);
}

TEST_F(SafeWriteTest, ShortWritesAndInterruptedWritesAreRetried) {
  faults_.add({.op = FileOp::kWrite, .kind = FileFaultKind::kShortWrite, .times = 3});
  faults_.add({.op = FileOp::kWrite, .nth_call = 4, .error_number = EINTR});
  std::string contents = random_contents();
  contents.append(16, 'x');  // long enough to be cut three times
  ASSERT_TRUE(write_file_atomically(target_, contents, options_).is_ok());
  EXPECT_EQ(faults_.faults_injected(), 4u);
  EXPECT_EQ(read_file(target_), contents);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"target.bin"});
}

TEST_F(SafeWriteTest, WithoutAnExchangeAPlainRenameReplacesTheFile) {
  write_plain_file(target_, random_contents());
  faults_.add({.op = FileOp::kRename, .error_number = EINVAL});  // as NFS answers RENAME_EXCHANGE
  const std::string contents = random_contents();
  ASSERT_TRUE(write_file_atomically(target_, contents, options_).is_ok());
  EXPECT_EQ(read_file(target_), contents);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"target.bin"});
}

TEST_F(SafeWriteTest, WithoutAnExchangeAFailedDirectoryFlushSaysTheNewFileIsInPlace) {
  write_plain_file(target_, random_contents());
  faults_.add({.op = FileOp::kRename, .error_number = EINVAL});
  faults_.add({.op = FileOp::kSyncDirectory, .error_number = EIO});
  const std::string contents = random_contents();
  const Status status = write_file_atomically(target_, contents, options_);
  expect_one_line_error(status, "flushing the directory", target_, EIO);
  EXPECT_NE(status.message().find("may not survive a crash"), std::string::npos)
      << status.message();
  EXPECT_EQ(read_file(target_), contents);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"target.bin"});
}

TEST_F(SafeWriteTest, AnUncommittedWriterRemovesItsTemporary) {
  const std::string old_contents = random_contents();
  write_plain_file(target_, old_contents);
  {
    Result<AtomicFileWriter> writer = AtomicFileWriter::create(target_, options_);
    ASSERT_TRUE(writer.is_ok()) << writer.status().message();
    const std::string part = random_contents();
    ASSERT_TRUE(writer->append(part.data(), part.size()).is_ok());
    EXPECT_TRUE(fs::exists(writer->temporary_path()));
  }
  EXPECT_EQ(read_file(target_), old_contents);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"target.bin"});
}

TEST_F(SafeWriteTest, AfterAFailureTheWriterRefusesToCommit) {
  const std::string old_contents = random_contents();
  write_plain_file(target_, old_contents);
  faults_.add({.op = FileOp::kWrite, .error_number = ENOSPC});
  Result<AtomicFileWriter> writer = AtomicFileWriter::create(target_, options_);
  ASSERT_TRUE(writer.is_ok()) << writer.status().message();
  const std::string part = random_contents();
  EXPECT_FALSE(writer->append(part.data(), part.size()).is_ok());
  EXPECT_FALSE(fs::exists(writer->temporary_path()));
  const Status committed = writer->commit();
  EXPECT_FALSE(committed.is_ok());
  EXPECT_NE(committed.message().find(target_), std::string::npos) << committed.message();
  EXPECT_EQ(read_file(target_), old_contents);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"target.bin"});
}

// --- real refusals (nothing injected) ----------------------------------------------------

TEST_F(SafeWriteTest, AMissingDirectoryIsReportedAndNothingIsCreated) {
  const std::string path = directory_.path() + "/missing/target.bin";
  const Status status = write_file_atomically(path, random_contents());
  expect_one_line_error(status, "creating the temporary file", path, ENOENT);
  EXPECT_NE(status.message().find("check that the directory exists"), std::string::npos)
      << status.message();
  EXPECT_TRUE(names_in(directory_.path()).empty());
}

TEST_F(SafeWriteTest, APathThroughAFileIsReported) {
  write_plain_file(directory_.path() + "/plain", "x");
  const std::string path = directory_.path() + "/plain/target.bin";
  expect_one_line_error(write_file_atomically(path, random_contents()),
                        "creating the temporary file", path, ENOTDIR);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"plain"});
}

TEST_F(SafeWriteTest, ADirectoryUnderTheTargetNameIsRefusedAndKept) {
  const std::string inside = target_ + "/kept";
  fs::create_directories(target_);
  write_plain_file(inside, "kept");
  expect_one_line_error(write_file_atomically(target_, random_contents()), "replacing it", target_,
                        EISDIR);
  EXPECT_EQ(read_file(inside), "kept");
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"target.bin"});
}

// Makes `directory` refuse new entries: by its mode, or, for root (whom modes
// do not stop), with the immutable attribute. "" on success, else why not.
std::string make_read_only(const std::string& directory) {
  if (::geteuid() != 0) {
    return ::chmod(directory.c_str(), 0555) == 0 ? "" : errno_text(errno);
  }
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return errno_text(errno);
  int flags = 0;
  std::string why;
  if (::ioctl(fd, FS_IOC_GETFLAGS, &flags) != 0) {
    why = "no attributes here: " + errno_text(errno);
  } else {
    flags |= FS_IMMUTABLE_FL;
    if (::ioctl(fd, FS_IOC_SETFLAGS, &flags) != 0)
      why = "cannot set immutable: " + errno_text(errno);
  }
  ::close(fd);
  return why;
}

void make_writable(const std::string& directory) {
  ::chmod(directory.c_str(), 0755);
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY);
  int flags = 0;
  if (fd >= 0 && ::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0 && (flags & FS_IMMUTABLE_FL)) {
    flags &= ~FS_IMMUTABLE_FL;
    ::ioctl(fd, FS_IOC_SETFLAGS, &flags);
  }
  if (fd >= 0) ::close(fd);
}

TEST_F(SafeWriteTest, AReadOnlyDirectoryIsReportedAndTheOldFileKept) {
  const std::string directory = directory_.subdirectory("read-only");
  const std::string path = directory + "/target.bin";
  const std::string old_contents = random_contents();
  write_plain_file(path, old_contents);
  if (const std::string why = make_read_only(directory); !why.empty())
    GTEST_SKIP() << "cannot make a directory read-only here: " << why;
  const Status status = write_file_atomically(path, random_contents());
  make_writable(directory);
  ASSERT_FALSE(status.is_ok());
  EXPECT_EQ(status.message().find('\n'), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("creating the temporary file"), std::string::npos)
      << status.message();
  EXPECT_NE(status.message().find(path), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("write elsewhere"), std::string::npos) << status.message();
  EXPECT_EQ(read_file(path), old_contents);
  EXPECT_EQ(names_in(directory), std::vector<std::string>{"target.bin"});
}

// --- directories ------------------------------------------------------------------------

class MoveDirectoryTest : public SafeWriteTest {
 protected:
  void SetUp() override {
    SafeWriteTest::SetUp();
    finished_ = directory_.path() + "/.finished";
    destination_ = directory_.path() + "/published";
  }

  // A directory holding two files of fresh random contents; returns them.
  std::vector<std::string> fill(const std::string& directory) {
    fs::create_directories(directory);
    std::vector<std::string> contents = {random_contents(), random_contents()};
    write_plain_file(directory + "/a.bin", contents[0]);
    write_plain_file(directory + "/b.bin", contents[1]);
    return contents;
  }

  std::vector<std::string> contents_of(const std::string& directory) {
    EXPECT_EQ(names_in(directory), (std::vector<std::string>{"a.bin", "b.bin"}));
    return {read_file(directory + "/a.bin"), read_file(directory + "/b.bin")};
  }

  std::string finished_, destination_;
};

TEST_F(MoveDirectoryTest, ReplacesAnOldDirectoryAndRemovesIt) {
  fill(destination_);
  const std::vector<std::string> contents = fill(finished_);
  ASSERT_TRUE(move_directory_into_place(finished_, destination_, faults_).is_ok());
  EXPECT_EQ(contents_of(destination_), contents);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"published"});
  EXPECT_EQ(faults_.calls(FileOp::kSyncDirectory), 2u);  // its entries, then its parent's
}

TEST_F(MoveDirectoryTest, WithoutAnExchangeTheOldDirectoryIsRemovedFirst) {
  fill(destination_);
  const std::vector<std::string> contents = fill(finished_);
  faults_.add({.op = FileOp::kRename, .error_number = EINVAL});
  ASSERT_TRUE(move_directory_into_place(finished_, destination_, faults_).is_ok());
  EXPECT_EQ(contents_of(destination_), contents);
  EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{"published"});
}

class MoveDirectoryStepTest : public MoveDirectoryTest,
                              public ::testing::WithParamInterface<std::tuple<StepFailure, bool>> {
};

TEST_P(MoveDirectoryStepTest, LeavesTheOldDirectoryAndTheNewOneForTheCaller) {
  const auto& [failure, had_old_directory] = GetParam();
  std::vector<std::string> old_contents;
  if (had_old_directory) old_contents = fill(destination_);
  const std::vector<std::string> contents = fill(finished_);
  for (const FileFault& fault : failure.faults) faults_.add(fault);

  const Status status = move_directory_into_place(finished_, destination_, faults_);

  expect_one_line_error(status, failure.step, destination_, failure.error_number);
  EXPECT_EQ(contents_of(finished_), contents);
  if (had_old_directory) {
    EXPECT_EQ(contents_of(destination_), old_contents);
    EXPECT_EQ(names_in(directory_.path()), (std::vector<std::string>{".finished", "published"}));
  } else {
    EXPECT_EQ(names_in(directory_.path()), std::vector<std::string>{".finished"});
  }
}

const std::vector<StepFailure> kDirectoryStepFailures = {
    {"SyncItsEntries",
     {{.op = FileOp::kSyncDirectory, .error_number = EIO}},
     "flushing the directory",
     EIO},
    {"Rename", {{.op = FileOp::kRename, .error_number = EACCES}}, "renaming", EACCES},
    {"SyncTheParent",
     {{.op = FileOp::kSyncDirectory, .nth_call = 2, .error_number = EIO}},
     "flushing the directory",
     EIO},
};

INSTANTIATE_TEST_SUITE_P(EveryStep, MoveDirectoryStepTest,
                         ::testing::Combine(::testing::ValuesIn(kDirectoryStepFailures),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) +
                                  (std::get<1>(info.param) ? "_OverAnOldDirectory"
                                                           : "_AsANewDirectory");
                         });

}  // namespace
}  // namespace strata::io
