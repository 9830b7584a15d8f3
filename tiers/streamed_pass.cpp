#include "tiers/streamed_pass.h"

#include <fmt/format.h>

#include <chrono>

#include "io/swap_directory.h"
#include "io/base/sizes.h"

namespace strata::tiers {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A transfer of one piece, with what to say if it fails.
struct PieceTransfer {
  io::IoHandle handle;
  size_t piece = 0;
};

// One buffer and what it is doing.
struct Slot {
  size_t item = SIZE_MAX;
  std::vector<PieceTransfer> reads;
  std::vector<PieceTransfer> writes;
  std::vector<std::byte*> pointers;  // per piece, for the visitor
  std::vector<ShardHome> homes;      // per piece
  std::vector<uint64_t> io_lengths;  // per piece (NVMe pieces)
};

bool all_done(const std::vector<PieceTransfer>& transfers) {
  for (const PieceTransfer& transfer : transfers)
    if (!transfer.handle.is_done()) return false;
  return true;
}

}  // namespace

uint64_t StreamedPass::buffer_bytes_for(const StreamItem& item, uint64_t alignment) {
  // Host-homed pieces need no buffer, but which pieces those are is the
  // store's business; sizing for all of them keeps this a function of the item.
  uint64_t bytes = 0;
  for (const StreamPiece& piece : item.pieces) bytes += round_up(piece.length, alignment);
  return bytes;
}

StreamedPass::StreamedPass(TieredStore& store, StreamedPassOptions options)
    : store_(store), options_(options) {}

Result<std::unique_ptr<StreamedPass>> StreamedPass::create(TieredStore& store,
                                                           StreamedPassOptions options) {
  if (options.buffer_count < 2)
    return Status::error(fmt::format(
        "streamed pass: {} buffer(s); it needs at least 2 (3 or more to read, work and write at "
        "once); raise offload_optimizer.buffer_count",
        options.buffer_count));
  std::unique_ptr<StreamedPass> pass(new StreamedPass(store, options));
  for (unsigned i = 0; i < options.buffer_count; ++i) {
    Result<HostBlock> block =
        store.host_tier().allocate(options.buffer_bytes, fmt::format("streamed pass buffer {}", i));
    if (!block) return block.status();  // the destructor returns the ones taken
    pass->buffers_.push_back(*block);
  }
  return pass;
}

StreamedPass::~StreamedPass() {
  for (const HostBlock& block : buffers_) store_.host_tier().free(block);
}

Status StreamedPass::run(std::span<const StreamItem> items, const StreamVisitor& visit) {
  stats_ = StreamedPassStats{};
  const Clock::time_point run_start = Clock::now();
  NvmeTier* nvme = store_.nvme_tier();
  const uint64_t alignment = nvme ? nvme->alignment() : 4096;
  const size_t buffer_count = buffers_.size();
  std::vector<Slot> slots(buffer_count);
  Status failure;
  auto fail = [&](Status status) {
    if (failure && !status) failure = std::move(status);
  };
  auto piece_text = [&](size_t item, const StreamPiece& piece) {
    return fmt::format("streamed pass: item {} piece {} bytes [{}, {})", item,
                       shard_name(piece.shard), piece.offset, piece.offset + piece.length);
  };

  // Waits for a list of transfers; the first failure names its piece.
  auto wait_all = [&](std::vector<PieceTransfer>& transfers, size_t item, const char* what) {
    for (PieceTransfer& transfer : transfers) {
      Status status = transfer.handle.wait();
      if (!status)
        fail(status.with_context(
            fmt::format("{} ({})", piece_text(item, items[item].pieces[transfer.piece]), what)));
    }
    transfers.clear();
  };

  // Locates item j's pieces and starts its reads into its buffer.
  auto start_item = [&](size_t j) -> Status {
    Slot& slot = slots[j % buffer_count];
    if (!slot.writes.empty()) {
      const Clock::time_point start = Clock::now();
      wait_all(slot.writes, slot.item, "write-back");
      stats_.write_wait_seconds += seconds_since(start);
      if (!failure) return failure;
    }
    slot.item = j;
    const StreamItem& item = items[j];
    slot.pointers.assign(item.pieces.size(), nullptr);
    slot.homes.assign(item.pieces.size(), ShardHome{});
    slot.io_lengths.assign(item.pieces.size(), 0);
    std::byte* buffer = buffers_[j % buffer_count].data;
    uint64_t used = 0;
    for (size_t p = 0; p < item.pieces.size(); ++p) {
      const StreamPiece& piece = item.pieces[p];
      Result<ShardHome> home = store_.home(piece.shard);
      if (!home) return home.status().with_context(piece_text(j, piece));
      if (piece.offset + piece.length > home->bytes)
        return Status::error(
            fmt::format("{}: past the shard's end ({} bytes)", piece_text(j, piece), home->bytes));
      slot.homes[p] = *home;
      if (home->tier == Tier::host) {
        slot.pointers[p] = home->data + piece.offset;
        continue;
      }
      if (home->tier != Tier::nvme)
        return Status::error(
            fmt::format("{}: its home is the device; a streamed pass visits NVMe "
                        "or host homes",
                        piece_text(j, piece)));
      if (piece.offset % alignment != 0)
        return Status::error(fmt::format("{}: offset is not a multiple of the I/O alignment ({})",
                                         piece_text(j, piece), alignment));
      // A piece that ends the shard may run on to the extent's aligned end (no
      // read-modify-write); one inside the shard must stop where it ends.
      const bool ends_shard = piece.offset + piece.length == home->bytes;
      slot.io_lengths[p] = ends_shard ? round_up(piece.length, alignment) : piece.length;
      if (used + round_up(piece.length, alignment) > options_.buffer_bytes)
        return Status::error(fmt::format(
            "streamed pass: item {} needs more than the {} buffers hold; create the pass with "
            "buffer_bytes of at least buffer_bytes_for(item)",
            j, format_bytes(options_.buffer_bytes)));
      slot.pointers[p] = buffer + used;
      used += round_up(piece.length, alignment);
      if (piece.read) {
        slot.reads.push_back(
            {nvme->read(home->extent, piece.offset, slot.pointers[p], slot.io_lengths[p]), p});
        stats_.bytes_read += slot.io_lengths[p];
      }
    }
    return Status::ok();
  };

  size_t next = 0;  // the next item whose reads are not started
  auto read_ahead = [&](size_t current) {
    while (failure && next < items.size() && next < current + buffer_count &&
           all_done(slots[next % buffer_count].writes)) {
      fail(start_item(next));
      ++next;
    }
  };

  for (size_t i = 0; i < items.size() && failure; ++i) {
    if (next <= i) {
      fail(start_item(i));
      next = i + 1;
      if (!failure) break;
    }
    read_ahead(i);
    Slot& slot = slots[i % buffer_count];
    const Clock::time_point read_start = Clock::now();
    wait_all(slot.reads, i, "read");
    stats_.read_wait_seconds += seconds_since(read_start);
    if (!failure) break;

    const Clock::time_point visit_start = Clock::now();
    Status visited = visit(i, slot.pointers);
    stats_.visit_seconds += seconds_since(visit_start);
    if (!visited) {
      fail(visited.with_context(fmt::format("streamed pass: item {}", i)));
      break;
    }
    const StreamItem& item = items[i];
    for (size_t p = 0; p < item.pieces.size(); ++p) {
      const StreamPiece& piece = item.pieces[p];
      if (slot.homes[p].tier != Tier::nvme || !piece.write) continue;
      slot.writes.push_back(
          {nvme->write(slot.homes[p].extent, piece.offset, slot.pointers[p], slot.io_lengths[p]),
           p});
      stats_.bytes_written += slot.io_lengths[p];
    }
    ++stats_.items;
    read_ahead(i + 1);
  }

  // Drain: nothing may still use a buffer when run() returns.
  for (Slot& slot : slots) {
    if (!slot.reads.empty()) wait_all(slot.reads, slot.item, "read");
    if (!slot.writes.empty()) {
      const Clock::time_point start = Clock::now();
      wait_all(slot.writes, slot.item, "write-back");
      stats_.write_wait_seconds += seconds_since(start);
    }
  }
  stats_.seconds = seconds_since(run_start);
  return failure;
}

}  // namespace strata::tiers
