// IoEngine under injected faults: every fault is either retried until the
// bytes are right, or reported with its errno, file, offset and length; a
// write that reported success is never lost.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "io/aligned_buffer.h"
#include "io/fault_injection.h"
#include "io/io_engine.h"
#include "io_test_support.h"

namespace strata::io {
namespace {

using testing::fill_random;
using testing::TemporaryDirectory;

constexpr uint64_t kBlock = 64 << 10;
constexpr uint64_t kFileSize = 16 * kBlock;  // 16 block requests per whole-file transfer

class FaultInjectionTest : public ::testing::TestWithParam<IoBackend> {
 protected:
  void SetUp() override {
    STRATA_SKIP_WITHOUT_DIRECT_IO(directory_);
    injector_ = std::make_shared<FaultInjector>();
    Result<std::unique_ptr<IoEngine>> engine = IoEngine::open({.paths = {directory_.path()},
                                                               .block_size = kBlock,
                                                               .queue_depth = 4,
                                                               .backend = GetParam(),
                                                               .max_retries = 8,
                                                               .notice = [](const std::string&) {},
                                                               .fault_injector = injector_});
    ASSERT_TRUE(engine.is_ok()) << engine.status().message();
    engine_ = std::move(engine).value();
    Result<FileId> file = engine_->create_file("faults.swap", kFileSize);
    ASSERT_TRUE(file.is_ok()) << file.status().message();
    file_ = *file;
    written_ = AlignedBuffer(kFileSize);
    fill_random(written_.data(), kFileSize, 11);
    ASSERT_TRUE(engine_->write(file_, 0, written_.data(), kFileSize).wait().is_ok());
  }
  void TearDown() override {
    if (engine_) {
      EXPECT_TRUE(engine_->remove_file(file_).is_ok());
    }
  }

  // The n-th call of `op` counted from now.
  uint64_t next_call(RingOp op, uint64_t n = 1) const { return injector_->calls(op) + n; }

  bool file_matches(const AlignedBuffer& expected) {
    AlignedBuffer back(kFileSize);
    Status read = engine_->read(file_, 0, back.data(), kFileSize).wait();
    EXPECT_TRUE(read.is_ok()) << read.message();
    return std::memcmp(back.data(), expected.data(), kFileSize) == 0;
  }

  TemporaryDirectory directory_;
  std::shared_ptr<FaultInjector> injector_;
  std::unique_ptr<IoEngine> engine_;
  FileId file_ = -1;
  AlignedBuffer written_;
};

void expect_names_location(const Status& status, const std::string& errno_name,
                           const std::string& file, const std::string& operation) {
  EXPECT_FALSE(status.is_ok());
  const std::string& message = status.message();
  EXPECT_NE(message.find(errno_name), std::string::npos) << message;
  EXPECT_NE(message.find(file), std::string::npos) << message;
  EXPECT_NE(message.find(operation), std::string::npos) << message;
  EXPECT_NE(message.find("at offset"), std::string::npos) << message;
  EXPECT_NE(message.find("bytes"), std::string::npos) << message;
}

TEST_P(FaultInjectionTest, EioOnReadIsReportedWithErrnoFileOffsetAndLength) {
  injector_->add(
      {.op = RingOp::kRead, .nth_call = next_call(RingOp::kRead, 3), .error_number = EIO});
  AlignedBuffer back(kFileSize);
  Status read = engine_->read(file_, 0, back.data(), kFileSize).wait();
  expect_names_location(read, "EIO", "faults.swap", "read of");
  EXPECT_EQ(injector_->faults_injected(), 1u);
  EXPECT_TRUE(file_matches(written_)) << "the next read works again";
}

TEST_P(FaultInjectionTest, EnospcOnWriteIsReportedAndCompletedWritesAreKept) {
  AlignedBuffer update(kFileSize);
  fill_random(update.data(), kFileSize, 12);
  // Four separate transfers of four blocks; the 6th write call (in the second) fails.
  injector_->add(
      {.op = RingOp::kWrite, .nth_call = next_call(RingOp::kWrite, 6), .error_number = ENOSPC});
  std::vector<Status> results;
  for (uint64_t part = 0; part < 4; ++part) {
    const uint64_t offset = part * 4 * kBlock;
    results.push_back(engine_->write(file_, offset, update.data() + offset, 4 * kBlock).wait());
  }
  expect_names_location(results[1], "ENOSPC", "faults.swap", "write of");
  EXPECT_TRUE(results[0].is_ok() && results[2].is_ok() && results[3].is_ok());

  AlignedBuffer back(kFileSize);
  ASSERT_TRUE(engine_->read(file_, 0, back.data(), kFileSize).wait().is_ok());
  for (uint64_t part : {0, 2, 3}) {
    const uint64_t offset = part * 4 * kBlock;
    EXPECT_EQ(std::memcmp(back.data() + offset, update.data() + offset, 4 * kBlock), 0)
        << "completed write " << part << " was lost";
  }
}

TEST_P(FaultInjectionTest, ShortReadIsRetriedToTheExactBytes) {
  injector_->add({.op = RingOp::kRead,
                  .nth_call = next_call(RingOp::kRead, 2),
                  .kind = FaultKind::kShortTransfer});
  const uint64_t retries_before = engine_->counters().retries;
  EXPECT_TRUE(file_matches(written_));
  EXPECT_EQ(injector_->faults_injected(), 1u);
  EXPECT_GT(engine_->counters().retries, retries_before);
}

TEST_P(FaultInjectionTest, ShortWriteIsRetriedAndNothingIsLost) {
  AlignedBuffer update(kFileSize);
  fill_random(update.data(), kFileSize, 13);
  injector_->add({.op = RingOp::kWrite,
                  .nth_call = next_call(RingOp::kWrite, 1),
                  .kind = FaultKind::kShortTransfer,
                  .times = 3});
  Status written = engine_->write(file_, 0, update.data(), kFileSize, Durability::kSync).wait();
  ASSERT_TRUE(written.is_ok()) << written.message();
  EXPECT_EQ(injector_->faults_injected(), 3u);
  EXPECT_TRUE(file_matches(update));
}

TEST_P(FaultInjectionTest, EagainAndEintrAreRetried) {
  AlignedBuffer update(kFileSize);
  fill_random(update.data(), kFileSize, 14);
  injector_->add({.op = RingOp::kWrite,
                  .nth_call = next_call(RingOp::kWrite, 2),
                  .error_number = EAGAIN,
                  .times = 2});
  injector_->add(
      {.op = RingOp::kRead, .nth_call = next_call(RingOp::kRead, 1), .error_number = EINTR});
  injector_->add(
      {.op = RingOp::kRead, .nth_call = next_call(RingOp::kRead, 5), .error_number = EAGAIN});
  Status written = engine_->write(file_, 0, update.data(), kFileSize).wait();
  ASSERT_TRUE(written.is_ok()) << written.message();
  EXPECT_TRUE(file_matches(update));
  EXPECT_EQ(injector_->faults_injected(), 4u);
  EXPECT_GE(engine_->counters().retries, 4u);
}

TEST_P(FaultInjectionTest, EagainForeverGivesUpAfterMaxRetries) {
  injector_->add({.op = RingOp::kRead,
                  .nth_call = next_call(RingOp::kRead),
                  .error_number = EAGAIN,
                  .times = 1000});
  AlignedBuffer back(kBlock);
  Status read = engine_->read(file_, 3 * kBlock, back.data(), kBlock).wait();
  EXPECT_FALSE(read.is_ok());
  EXPECT_NE(read.message().find("no progress after 8 retries"), std::string::npos)
      << read.message();
  EXPECT_NE(read.message().find("at offset 196608"), std::string::npos) << read.message();
}

TEST_P(FaultInjectionTest, FailedFdatasyncFailsTheDurableWrite) {
  injector_->add({.op = RingOp::kSync, .nth_call = next_call(RingOp::kSync), .error_number = EIO});
  Status written = engine_->write(file_, 0, written_.data(), kBlock, Durability::kSync).wait();
  EXPECT_FALSE(written.is_ok());
  EXPECT_NE(written.message().find("fdatasync"), std::string::npos) << written.message();
  EXPECT_NE(written.message().find("EIO"), std::string::npos) << written.message();
}

TEST_P(FaultInjectionTest, DurableWriteSyncsOnlyAfterItsWritesComplete) {
  // The first write call stalls; the fdatasync must still come after it.
  injector_->add({.op = RingOp::kWrite,
                  .nth_call = next_call(RingOp::kWrite),
                  .kind = FaultKind::kStall,
                  .stall = std::chrono::milliseconds(50)});
  const uint64_t syncs_before = injector_->calls(RingOp::kSync);
  IoHandle handle = engine_->write(file_, 0, written_.data(), kFileSize, Durability::kSync);
  Status written = handle.wait();
  ASSERT_TRUE(written.is_ok()) << written.message();
  EXPECT_EQ(injector_->calls(RingOp::kSync), syncs_before + 1);
  EXPECT_EQ(engine_->counters().bytes_written, 2 * kFileSize);
  EXPECT_GE(handle.latency(), std::chrono::milliseconds(50));
}

TEST_P(FaultInjectionTest, ShortTailWriteKeepsNeighbouringBytes) {
  // A write of 1.5 blocks ends in a tail; its read-modify-write block is hit by EAGAIN.
  const uint64_t length = kBlock + kBlock / 2 + 100;
  AlignedBuffer update(length);
  fill_random(update.data(), length, 15);
  injector_->add(
      {.op = RingOp::kRead, .nth_call = next_call(RingOp::kRead), .error_number = EAGAIN});
  injector_->add({.op = RingOp::kWrite,
                  .nth_call = next_call(RingOp::kWrite),
                  .kind = FaultKind::kShortTransfer});
  ASSERT_TRUE(engine_->write(file_, kBlock, update.data(), length).wait().is_ok());
  std::memcpy(written_.data() + kBlock, update.data(), length);
  EXPECT_TRUE(file_matches(written_));
}

INSTANTIATE_TEST_SUITE_P(Backends, FaultInjectionTest,
                         ::testing::Values(IoBackend::kIoUring, IoBackend::kPosix),
                         [](const auto& info) {
                           return info.param == IoBackend::kIoUring ? "IoUring" : "PreadPwrite";
                         });

}  // namespace
}  // namespace strata::io
