// IoEngine with many transfers in flight from several threads at once.
#include <gtest/gtest.h>

#include <cstring>
#include <thread>

#include "io/aligned_buffer.h"
#include "io/io_engine.h"
#include "io_test_support.h"

namespace strata::io {
namespace {

using testing::fill_random;
using testing::TemporaryDirectory;

TEST(IoEngineConcurrency, ManyTransfersFromSeveralThreadsRoundTrip) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Result<std::unique_ptr<IoEngine>> opened =
      IoEngine::open({.paths = {directory.subdirectory("a"), directory.subdirectory("b")},
                      .block_size = 32 << 10,
                      .queue_depth = 8,
                      .threads_per_path = 2,
                      .notice = [](const std::string&) {}});
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  IoEngine& engine = **opened;

  constexpr int kThreads = 4;
  constexpr int kTransfersPerThread = 24;
  constexpr uint64_t kRegion = 100
                               << 10;  // not a multiple of the block size; ends on a 4 KiB boundary
  constexpr uint64_t kTotal = kThreads * kTransfersPerThread * kRegion;
  Result<FileId> file = engine.create_file("concurrent.swap", kTotal);
  ASSERT_TRUE(file.is_ok()) << file.status().message();
  AlignedBuffer buffer(kTotal);
  ASSERT_TRUE(engine.register_buffer(buffer.data(), buffer.size()).is_ok());
  fill_random(buffer.data(), buffer.size(), 21);
  AlignedBuffer expected(buffer.size());
  std::memcpy(expected.data(), buffer.data(), buffer.size());

  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int thread = 0; thread < kThreads; ++thread) {
    threads.emplace_back([&, thread] {
      // Interleaved regions, so every ring serves every thread.
      std::vector<IoHandle> handles;
      for (int i = 0; i < kTransfersPerThread; ++i) {
        const uint64_t offset = uint64_t(i * kThreads + thread) * kRegion;
        handles.push_back(engine.write(*file, offset, buffer.data() + offset, kRegion));
      }
      for (IoHandle& handle : handles) failures[thread] += !handle.wait().is_ok();
      handles.clear();
      for (int i = 0; i < kTransfersPerThread; ++i) {
        const uint64_t offset = uint64_t(i * kThreads + thread) * kRegion;
        std::memset(buffer.data() + offset, 0, kRegion);
        handles.push_back(engine.read(*file, offset, buffer.data() + offset, kRegion));
      }
      // Poll rather than block, as a caller overlapping compute would.
      for (size_t done = 0; done < handles.size();) {
        done = 0;
        for (IoHandle& handle : handles) done += handle.is_done();
        std::this_thread::yield();
      }
      for (IoHandle& handle : handles) failures[thread] += !handle.wait().is_ok();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int thread = 0; thread < kThreads; ++thread)
    EXPECT_EQ(failures[thread], 0) << "thread " << thread;
  EXPECT_EQ(std::memcmp(buffer.data(), expected.data(), buffer.size()), 0);
  EXPECT_EQ(engine.counters().bytes_written, kTotal);
  EXPECT_EQ(engine.counters().bytes_read, kTotal);
  EXPECT_TRUE(engine.unregister_buffer(buffer.data()).is_ok());
  EXPECT_TRUE(engine.remove_file(*file).is_ok());
}

TEST(IoEngineConcurrency, DroppingAHandleWaitsForItsTransfer) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Result<std::unique_ptr<IoEngine>> opened = IoEngine::open(
      {.paths = {directory.path()}, .block_size = 64 << 10, .notice = [](const std::string&) {}});
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  IoEngine& engine = **opened;
  Result<FileId> file = engine.create_file("dropped.swap", 4 << 20);
  ASSERT_TRUE(file.is_ok());
  {
    AlignedBuffer data(4 << 20);
    fill_random(data.data(), data.size(), 5);
    IoHandle ignored = engine.write(*file, 0, data.data(), data.size());
  }  // the handle goes first, then the buffer; the write must be over by then
  EXPECT_EQ(engine.counters().bytes_written, uint64_t{4} << 20);
  EXPECT_TRUE(engine.remove_file(*file).is_ok());
}

TEST(IoEngineConcurrency, ClosingTheEngineWaitsForRunningTransfers) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Result<std::unique_ptr<IoEngine>> opened =
      IoEngine::open({.paths = {directory.subdirectory("a"), directory.subdirectory("b")},
                      .block_size = 64 << 10,
                      .notice = [](const std::string&) {}});
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  std::unique_ptr<IoEngine> engine = std::move(opened).value();
  Result<FileId> file = engine->create_file("closing.swap", 8 << 20);
  ASSERT_TRUE(file.is_ok());
  AlignedBuffer data(8 << 20);
  fill_random(data.data(), data.size(), 9);
  // A durable write queues its fdatasync on both paths after its last write.
  IoHandle handle = engine->write(*file, 0, data.data(), 8 << 20, Durability::kSync);
  engine.reset();
  EXPECT_TRUE(handle.is_done());
  EXPECT_TRUE(handle.wait().is_ok());
}

TEST(IoEngineConcurrency, SyncCoversEveryPath) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Result<std::unique_ptr<IoEngine>> opened =
      IoEngine::open({.paths = {directory.subdirectory("a"), directory.subdirectory("b"),
                                directory.subdirectory("c")},
                      .notice = [](const std::string&) {}});
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  IoEngine& engine = **opened;
  Result<FileId> file = engine.create_file("synced.swap", 8 << 20);
  ASSERT_TRUE(file.is_ok());
  EXPECT_TRUE(engine.sync(*file).wait().is_ok());
  EXPECT_EQ(engine.counters().syncs, 3u);
  EXPECT_TRUE(engine.remove_file(*file).is_ok());
}

}  // namespace
}  // namespace strata::io
