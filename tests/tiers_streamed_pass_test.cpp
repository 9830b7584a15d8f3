// StreamedPass: every item is visited once, in order, with its bytes read in;
// what the visitor changes lands in the homes; host memory used is the fixed
// buffers whatever the number of items; errors (the visitor's or the drive's)
// stop the pass, name the item, and leave items not reached untouched.
#include <gtest/gtest.h>

#include <cstring>

#include "tiers/streamed_pass.h"
#include "tiers_test_support.h"

namespace strata::tiers {
namespace {

using io::testing::TemporaryDirectory;
using testing::fresh_seed;
using testing::Notices;
using testing::open_test_store;
using testing::random_bytes;
using testing::StoreSizes;

constexpr uint64_t kAlign = 4096;

// Each item: pieces of shards (unit u, master), (u, m) and (u, grad); the
// visitor adds 1 to every byte of the first two and only reads the third.
struct Fixture {
  std::vector<StreamItem> items;
  std::map<ShardKey, std::vector<std::byte>> expected;
};

void add_one(std::byte* data, uint64_t length) {
  for (uint64_t i = 0; i < length; ++i) data[i] = std::byte(uint8_t(data[i]) + 1);
}

TEST(StreamedPassTest, VisitsEveryItemInOrderThroughFixedBuffers) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  const uint64_t seed = fresh_seed("VisitsEveryItemInOrderThroughFixedBuffers");
  std::mt19937_64 random(seed);
  for (unsigned buffer_count : {2u, 3u, 5u}) {
    Notices notices;
    auto opened = open_test_store(directory.path(), StoreSizes{0, 16 << 20, 128 << 20}, notices);
    ASSERT_TRUE(opened.is_ok()) << opened.status().message();
    TieredStore& store = **opened;
    std::map<ShardKey, std::vector<std::byte>> contents;
    std::vector<StreamItem> items;
    uint64_t largest = 0;
    const int units = 4 + int(random() % 4);
    for (int unit = 0; unit < units; ++unit) {
      // Shards of whole chunks plus a ragged tail, split into items of `chunk` bytes.
      const uint64_t chunk = (1 + random() % 16) * kAlign;
      const uint64_t size = chunk * (1 + random() % 5) + random() % (3 * kAlign);
      for (ShardKind kind : {ShardKind::master, ShardKind::m, ShardKind::grad}) {
        const Tier home = kind == ShardKind::grad && random() % 2 ? Tier::host : Tier::nvme;
        ASSERT_TRUE(store.add_shard({unit, kind}, size, home).is_ok());
        contents[{unit, kind}] = random_bytes(size, random);
        ASSERT_TRUE(store.write_shard({unit, kind}, contents[{unit, kind}]).is_ok());
      }
      for (uint64_t offset = 0; offset < size; offset += chunk) {
        const uint64_t length = std::min(chunk, size - offset);
        StreamItem item;
        item.pieces.push_back({{unit, ShardKind::master}, offset, length});
        item.pieces.push_back({{unit, ShardKind::m}, offset, length});
        item.pieces.push_back({{unit, ShardKind::grad}, offset, length, true, false});
        largest = std::max(largest, StreamedPass::buffer_bytes_for(item, kAlign));
        items.push_back(std::move(item));
      }
    }
    const uint64_t homes_on_host = store.usage(Tier::host).used;
    auto pass = StreamedPass::create(store, {buffer_count, largest});
    ASSERT_TRUE(pass.is_ok()) << pass.status().message();
    EXPECT_EQ(store.usage(Tier::host).used, homes_on_host + buffer_count * largest);

    size_t next_item = 0;
    Status ran = (*pass)->run(items, [&](size_t index, std::span<std::byte* const> pieces) {
      EXPECT_EQ(index, next_item++);
      const StreamItem& item = items[index];
      for (size_t p = 0; p < pieces.size(); ++p) {
        const StreamPiece& piece = item.pieces[p];
        const std::vector<std::byte>& want = contents[piece.shard];
        EXPECT_EQ(std::memcmp(pieces[p], want.data() + piece.offset, piece.length), 0)
            << "item " << index << " piece " << p << " was not read in";
      }
      add_one(pieces[0], item.pieces[0].length);
      add_one(pieces[1], item.pieces[1].length);
      return Status::ok();
    });
    ASSERT_TRUE(ran.is_ok()) << ran.message();
    EXPECT_EQ(next_item, items.size());
    EXPECT_EQ((*pass)->last_run().items, items.size());
    // Host memory never went past the homes plus the buffers.
    EXPECT_EQ(store.usage(Tier::host).peak, homes_on_host + buffer_count * largest);

    for (auto& [key, bytes] : contents) {
      if (key.kind != ShardKind::grad) add_one(bytes.data(), bytes.size());
      std::vector<std::byte> back(bytes.size());
      pass->reset();  // return the buffers so read_shard has room to stage
      ASSERT_TRUE(store.read_shard(key, back).is_ok());
      EXPECT_EQ(back, bytes) << shard_name(key) << " with " << buffer_count << " buffers";
    }
  }
}

// A prefetch of the pieces a run begins with, on its own or started by the
// run before, is taken by that run (the bytes it visits and writes back are
// the same as without it); a run that begins otherwise drops it and reads as
// usual; either way every run sees its bytes.
TEST(StreamedPassTest, APrefetchIsTakenByTheRunItFitsAndDroppedByAnother) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  const uint64_t seed = fresh_seed("APrefetchIsTakenByTheRunItFitsAndDroppedByAnother");
  std::mt19937_64 random(seed);
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{0, 16 << 20, 128 << 20}, notices);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  TieredStore& store = **opened;
  std::map<ShardKey, std::vector<std::byte>> contents;
  std::vector<std::vector<StreamItem>> per_unit;  // the items of each unit's run
  uint64_t largest = 0;
  const int units = 5;
  for (int unit = 0; unit < units; ++unit) {
    const uint64_t chunk = (1 + random() % 8) * kAlign;
    const uint64_t size = chunk * (1 + random() % 6) + random() % (3 * kAlign);
    for (ShardKind kind : {ShardKind::master, ShardKind::m, ShardKind::grad}) {
      ASSERT_TRUE(store.add_shard({unit, kind}, size, Tier::nvme).is_ok());
      contents[{unit, kind}] = random_bytes(size, random);
      ASSERT_TRUE(store.write_shard({unit, kind}, contents[{unit, kind}]).is_ok());
    }
    std::vector<StreamItem> items;
    for (uint64_t offset = 0; offset < size; offset += chunk) {
      const uint64_t length = std::min(chunk, size - offset);
      StreamItem item;
      item.pieces.push_back({{unit, ShardKind::master}, offset, length});
      item.pieces.push_back({{unit, ShardKind::m}, offset, length});
      item.pieces.push_back({{unit, ShardKind::grad}, offset, length, true, false});
      largest = std::max(largest, StreamedPass::buffer_bytes_for(item, kAlign));
      items.push_back(std::move(item));
    }
    per_unit.push_back(std::move(items));
  }
  const unsigned buffer_count = 3;
  auto pass = StreamedPass::create(store, {buffer_count, largest});
  ASSERT_TRUE(pass.is_ok()) << pass.status().message();
  // The prefetch of unit u: its first items' master and m (not the gradient).
  auto prefix = [&](int unit) {
    std::vector<StreamItem> items = per_unit[size_t(unit)];
    for (StreamItem& item : items) item.pieces.resize(2);
    return items;
  };
  auto run_unit = [&](int unit, std::vector<StreamItem> then = {}) {
    const std::vector<StreamItem>& items = per_unit[size_t(unit)];
    Status ran = (*pass)->run(items, [&](size_t index, std::span<std::byte* const> pieces) {
      const StreamItem& item = items[index];
      for (size_t p = 0; p < pieces.size(); ++p) {
        const StreamPiece& piece = item.pieces[p];
        EXPECT_EQ(std::memcmp(pieces[p], contents[piece.shard].data() + piece.offset,
                              piece.length),
                  0)
            << "unit " << unit << " item " << index << " piece " << p << " was not read in";
      }
      add_one(pieces[0], item.pieces[0].length);
      add_one(pieces[1], item.pieces[1].length);
      return Status::ok();
    }, then);
    EXPECT_TRUE(ran.is_ok()) << ran.message();
    EXPECT_EQ((*pass)->last_run().items, items.size());
    for (ShardKind kind : {ShardKind::master, ShardKind::m}) {
      std::vector<std::byte>& bytes = contents[{unit, kind}];
      add_one(bytes.data(), bytes.size());
    }
  };
  run_unit(0);
  ASSERT_TRUE((*pass)->prefetch(prefix(1)).is_ok());
  run_unit(1);  // takes the prefetch
  ASSERT_TRUE((*pass)->prefetch(prefix(3)).is_ok());
  run_unit(2);  // drops it
  run_unit(3);
  ASSERT_TRUE((*pass)->prefetch(prefix(4)).is_ok());
  run_unit(4);
  ASSERT_TRUE((*pass)->prefetch(prefix(0)).is_ok());
  run_unit(0, prefix(2));  // a second pass over unit 0 reads what the first wrote
  run_unit(2, prefix(3));  // prefetched while unit 0's write-backs drained
  run_unit(3, prefix(0));
  run_unit(4);             // drops unit 0's
  run_unit(0);
  ASSERT_TRUE((*pass)->prefetch(prefix(1)).is_ok());
  pass->reset();  // an unused prefetch is waited for before the buffers go
  for (auto& [key, bytes] : contents) {
    std::vector<std::byte> back(bytes.size());
    ASSERT_TRUE(store.read_shard(key, back).is_ok());
    EXPECT_EQ(back, bytes) << shard_name(key);
  }
}

TEST(StreamedPassTest, BuffersAreChargedToTheHostBudget) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{0, 4 << 20, 16 << 20}, notices);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  auto too_many = StreamedPass::create(**opened, {5, 1 << 20});
  ASSERT_FALSE(too_many.is_ok());
  EXPECT_NE(too_many.status().message().find("streamed pass buffer 4"), std::string::npos)
      << too_many.status().message();
  EXPECT_EQ((*opened)->usage(Tier::host).used, 0u);  // the four taken were given back
  auto one = StreamedPass::create(**opened, {1, 1 << 20});
  ASSERT_FALSE(one.is_ok());
  EXPECT_NE(one.status().message().find("at least 2"), std::string::npos);
}

// Items 0..n-1 over one NVMe shard, one aligned block each.
struct ChainOfItems {
  std::vector<StreamItem> items;
  std::vector<std::byte> bytes;
};

ChainOfItems make_chain(TieredStore& store, int count, std::mt19937_64& random) {
  ChainOfItems chain;
  const uint64_t size = count * 2 * kAlign;
  EXPECT_TRUE(store.add_shard({0, ShardKind::v}, size, Tier::nvme).is_ok());
  chain.bytes = random_bytes(size, random);
  EXPECT_TRUE(store.write_shard({0, ShardKind::v}, chain.bytes).is_ok());
  for (int i = 0; i < count; ++i)
    chain.items.push_back({{{{0, ShardKind::v}, uint64_t(i) * 2 * kAlign, 2 * kAlign}}});
  return chain;
}

TEST(StreamedPassTest, AVisitorErrorStopsThePassAndLeavesLaterItemsUntouched) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  Notices notices;
  auto opened = open_test_store(directory.path(), StoreSizes{0, 4 << 20, 16 << 20}, notices);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  std::mt19937_64 random(5);
  ChainOfItems chain = make_chain(**opened, 12, random);
  auto pass = StreamedPass::create(**opened, {3, 2 * kAlign});
  ASSERT_TRUE(pass.is_ok()) << pass.status().message();
  Status ran = (*pass)->run(chain.items, [&](size_t index, std::span<std::byte* const> pieces) {
    if (index == 5) return Status::error("the work failed");
    add_one(pieces[0], 2 * kAlign);
    return Status::ok();
  });
  ASSERT_FALSE(ran.is_ok());
  EXPECT_EQ(ran.message(), "streamed pass: item 5: the work failed");
  add_one(chain.bytes.data(), 5 * 2 * kAlign);  // items 0-4 were updated and written back
  pass->reset();
  std::vector<std::byte> back(chain.bytes.size());
  ASSERT_TRUE((*opened)->read_shard({0, ShardKind::v}, back).is_ok());
  EXPECT_EQ(back, chain.bytes);
}

TEST(StreamedPassTest, AnInjectedReadFaultNamesTheItemAndCorruptsNothing) {
  TemporaryDirectory directory;
  STRATA_SKIP_WITHOUT_DIRECT_IO(directory);
  auto injector = std::make_shared<io::FaultInjector>();
  Notices notices;
  auto opened =
      open_test_store(directory.path(), StoreSizes{0, 4 << 20, 16 << 20}, notices, injector);
  ASSERT_TRUE(opened.is_ok()) << opened.status().message();
  std::mt19937_64 random(6);
  ChainOfItems chain = make_chain(**opened, 12, random);
  auto pass = StreamedPass::create(**opened, {4, 2 * kAlign});
  ASSERT_TRUE(pass.is_ok()) << pass.status().message();
  // Each item is one read request; the 8th read of the pass fails.
  injector->add({.op = io::RingOp::kRead,
                 .nth_call = injector->calls(io::RingOp::kRead) + 8,
                 .kind = io::FaultKind::kError,
                 .error_number = EIO});
  size_t visited = 0;
  Status ran = (*pass)->run(chain.items, [&](size_t, std::span<std::byte* const> pieces) {
    add_one(pieces[0], 2 * kAlign);
    ++visited;
    return Status::ok();
  });
  ASSERT_FALSE(ran.is_ok());
  EXPECT_NE(ran.message().find("streamed pass: item 7 piece (unit 0, v)"), std::string::npos)
      << ran.message();
  EXPECT_NE(ran.message().find("(read)"), std::string::npos) << ran.message();
  EXPECT_EQ(visited, 7u);
  add_one(chain.bytes.data(), 7 * 2 * kAlign);
  pass->reset();
  std::vector<std::byte> back(chain.bytes.size());
  ASSERT_TRUE((*opened)->read_shard({0, ShardKind::v}, back).is_ok());
  EXPECT_EQ(back, chain.bytes);
}

}  // namespace
}  // namespace strata::tiers
