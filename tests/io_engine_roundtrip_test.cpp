// IoEngine: what is written comes back byte for byte, for any length, any
// aligned offset, striped over one, two or three paths, with either backend.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "io/aligned_buffer.h"
#include "io/io_engine.h"
#include "io_test_support.h"

namespace strata::io {
namespace {

using testing::fill_random;
using testing::TemporaryDirectory;

std::unique_ptr<IoEngine> open_engine(IoOptions options) {
  options.notice = [](const std::string&) {};
  Result<std::unique_ptr<IoEngine>> engine = IoEngine::open(std::move(options));
  EXPECT_TRUE(engine.is_ok()) << engine.status().message();
  return engine ? std::move(engine).value() : nullptr;
}

// Writes random transfers at random aligned offsets with random lengths (most
// not a multiple of the alignment), then reads each back and compares; also
// checks that bytes around each range were left alone.
void check_random_round_trips(IoEngine& engine, uint64_t seed, int transfers) {
  const uint64_t alignment = engine.alignment();
  const uint64_t capacity = 24 * engine.options().block_size + 3 * alignment;
  Result<FileId> file = engine.create_file("roundtrip.swap", capacity);
  ASSERT_TRUE(file.is_ok()) << file.status().message();

  // A reference image of the whole file, kept in step with every write.
  AlignedBuffer image(capacity, alignment);
  fill_random(image.data(), capacity, seed);
  ASSERT_TRUE(engine.write(*file, 0, image.data(), capacity).wait().is_ok());

  std::mt19937_64 random(seed);
  AlignedBuffer data(capacity, alignment);
  AlignedBuffer back(capacity, alignment);
  for (int i = 0; i < transfers; ++i) {
    const uint64_t offset = random() % (capacity / alignment) * alignment;
    uint64_t length = random() % (capacity - offset) + 1;
    if (i % 4 == 0)
      length = std::min<uint64_t>(length, random() % alignment + 1);  // shorter than a block
    fill_random(data.data(), length, seed + i + 1);
    Status written = engine.write(*file, offset, data.data(), length).wait();
    ASSERT_TRUE(written.is_ok()) << written.message();
    std::memcpy(image.data() + offset, data.data(), length);

    std::memset(back.data(), 0xEE, capacity);
    Status read = engine.read(*file, offset, back.data(), length).wait();
    ASSERT_TRUE(read.is_ok()) << read.message();
    ASSERT_EQ(std::memcmp(back.data(), data.data(), length), 0)
        << "transfer " << i << ": offset " << offset << ", length " << length;
    ASSERT_EQ(back.data()[length], std::byte{0xEE}) << "a read wrote past its length";
  }
  ASSERT_TRUE(engine.read(*file, 0, back.data(), capacity).wait().is_ok());
  EXPECT_EQ(std::memcmp(back.data(), image.data(), capacity), 0) << "bytes outside a write changed";
  EXPECT_TRUE(engine.remove_file(*file).is_ok());
}

TEST(IoEngineRoundTrip, RandomSizesAndOffsetsOnOnePath) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto engine =
      open_engine({.paths = {directory.path()}, .block_size = 64 << 10, .queue_depth = 8});
  ASSERT_NE(engine, nullptr);
  check_random_round_trips(*engine, 1, 40);
}

TEST(IoEngineRoundTrip, StripedOverTwoPaths) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto engine =
      open_engine({.paths = {directory.subdirectory("nvme0"), directory.subdirectory("nvme1")},
                   .block_size = 64 << 10,
                   .queue_depth = 4});
  ASSERT_NE(engine, nullptr);
  check_random_round_trips(*engine, 2, 30);
}

TEST(IoEngineRoundTrip, StripedOverThreePathsWithTwoThreadsEach) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto engine = open_engine({.paths = {directory.subdirectory("a"), directory.subdirectory("b"),
                                       directory.subdirectory("c")},
                             .block_size = 32 << 10,
                             .queue_depth = 4,
                             .threads_per_path = 2});
  ASSERT_NE(engine, nullptr);
  check_random_round_trips(*engine, 3, 30);
}

TEST(IoEngineRoundTrip, StripesLandOnEveryPathInBlockUnits) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  const uint64_t block = 16 << 10;
  std::vector<std::string> paths = {directory.subdirectory("a"), directory.subdirectory("b"),
                                    directory.subdirectory("c")};
  auto engine = open_engine({.paths = paths, .block_size = block, .queue_depth = 4});
  ASSERT_NE(engine, nullptr);
  Result<FileId> file = engine->create_file("stripes.swap", 6 * block);
  ASSERT_TRUE(file.is_ok());
  AlignedBuffer data(6 * block);
  for (uint64_t unit = 0; unit < 6; ++unit)
    std::memset(data.data() + unit * block, int('A' + unit), block);
  ASSERT_TRUE(engine->write(*file, 0, data.data(), 6 * block, Durability::kSync).wait().is_ok());
  // Unit u is on path u % 3 at offset (u / 3) * block.
  for (uint64_t unit = 0; unit < 6; ++unit) {
    std::FILE* stream = std::fopen((paths[unit % 3] + "/stripes.swap").c_str(), "rb");
    ASSERT_NE(stream, nullptr);
    std::fseek(stream, long(unit / 3 * block), SEEK_SET);
    EXPECT_EQ(std::fgetc(stream), int('A' + unit)) << "unit " << unit;
    std::fclose(stream);
  }
  EXPECT_TRUE(engine->remove_file(*file).is_ok());
  for (const std::string& path : paths)
    EXPECT_FALSE(std::filesystem::exists(path + "/stripes.swap"));
}

TEST(IoEngineRoundTrip, RegisteredBuffersUseFixedCallsAndRoundTrip) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto engine =
      open_engine({.paths = {directory.path()}, .block_size = 128 << 10, .queue_depth = 8});
  ASSERT_NE(engine, nullptr);
  const uint64_t size = 3 << 20;
  AlignedBuffer out(size), in(size);
  ASSERT_TRUE(engine->register_buffer(out.data(), out.size()).is_ok());
  ASSERT_TRUE(engine->register_buffer(in.data(), in.size()).is_ok());
  EXPECT_FALSE(engine->register_buffer(in.data(), in.size()).is_ok()) << "registered twice";
  Result<FileId> file = engine->create_file("fixed.swap", size);
  ASSERT_TRUE(file.is_ok());
  fill_random(out.data(), size, 7);
  ASSERT_TRUE(engine->write(*file, 0, out.data(), size, Durability::kSync).wait().is_ok());
  ASSERT_TRUE(engine->read(*file, 0, in.data(), size).wait().is_ok());
  EXPECT_EQ(std::memcmp(in.data(), out.data(), size), 0);
  EXPECT_EQ(engine->counters().bytes_written, size);
  EXPECT_EQ(engine->counters().bytes_read, size);
  EXPECT_GE(engine->counters().syncs, 1u);
  EXPECT_TRUE(engine->unregister_buffer(out.data()).is_ok());
  EXPECT_TRUE(engine->unregister_buffer(in.data()).is_ok());
  EXPECT_TRUE(engine->remove_file(*file).is_ok());
}

TEST(IoEngineRoundTrip, PreadPwriteFallbackRoundTrips) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto engine = open_engine({.paths = {directory.subdirectory("a"), directory.subdirectory("b")},
                             .block_size = 64 << 10,
                             .queue_depth = 4,
                             .threads_per_path = 2,
                             .backend = IoBackend::kPosix});
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->backend_description(), "pread/pwrite");
  check_random_round_trips(*engine, 4, 20);
}

TEST(IoEngineRoundTrip, MisalignedOrOutOfRangeTransfersAreRefusedWithTheirLocation) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto engine = open_engine({.paths = {directory.path()}, .block_size = 64 << 10});
  ASSERT_NE(engine, nullptr);
  Result<FileId> file = engine->create_file("bounds.swap", 1 << 20);
  ASSERT_TRUE(file.is_ok());
  AlignedBuffer buffer(2 << 20);
  Status misaligned = engine->read(*file, 100, buffer.data(), 4096).wait();
  EXPECT_FALSE(misaligned.is_ok());
  EXPECT_NE(misaligned.message().find("offset 100"), std::string::npos) << misaligned.message();
  Status past_end = engine->write(*file, 0, buffer.data(), 2 << 20).wait();
  EXPECT_FALSE(past_end.is_ok());
  EXPECT_NE(past_end.message().find("capacity"), std::string::npos) << past_end.message();
  EXPECT_TRUE(engine->remove_file(*file).is_ok());
}

TEST(IoEngineRoundTrip, DescribesItsBackendAndAlignment) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto engine = open_engine({.paths = {directory.path()}});
  ASSERT_NE(engine, nullptr);
  EXPECT_GE(engine->alignment(), 512u);
  EXPECT_EQ(engine->alignment() & (engine->alignment() - 1), 0u) << "a power of two";
  EXPECT_FALSE(engine->backend_description().empty());
}

}  // namespace
}  // namespace strata::io
