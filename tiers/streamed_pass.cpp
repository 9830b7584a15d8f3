#include "tiers/streamed_pass.h"

#include <fmt/format.h>

#include <algorithm>
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
  drop_prefetch();  // no read may land in a buffer once it is freed
  for (const HostBlock& block : buffers_) store_.host_tier().free(block);
}

void StreamedPass::drop_prefetch() {
  for (Prefetched& p : prefetched_)
    for (PrefetchedRead& read : p.reads) (void)read.handle.wait();
  prefetched_.clear();
}

Status StreamedPass::prefetch(std::span<const StreamItem> items) {
  drop_prefetch();
  return prefetch_into(items, slot_base_);
}

Status StreamedPass::prefetch_into(std::span<const StreamItem> items, size_t base) {
  slot_base_ = base;
  NvmeTier* nvme = store_.nvme_tier();
  const uint64_t alignment = nvme ? nvme->alignment() : 4096;
  const size_t count = std::min(items.size(), buffers_.size());
  for (size_t j = 0; j < count; ++j) {
    Prefetched p;
    p.item = items[j];
    const size_t n = p.item.pieces.size();
    p.pointers.assign(n, nullptr);
    p.homes.assign(n, ShardHome{});
    p.io_lengths.assign(n, 0);
    for (size_t k = 0; k < n; ++k) {
      const StreamPiece& piece = p.item.pieces[k];
      Result<ShardHome> home = store_.home(piece.shard);
      if (!home) {
        prefetched_.push_back(std::move(p));
        drop_prefetch();
        return home.status();
      }
      const bool fits = piece.read && piece.offset + piece.length <= home->bytes &&
                        (home->tier == Tier::host ||
                         (home->tier == Tier::nvme && piece.offset % alignment == 0 &&
                          p.used + round_up(piece.length, alignment) <= options_.buffer_bytes));
      if (!fits) {
        // Not something run() would read the same way: prefetch nothing more.
        p.item.pieces.resize(k);
        break;
      }
      p.homes[k] = *home;
      if (home->tier == Tier::host) {
        p.pointers[k] = home->data + piece.offset;
        continue;
      }
      const bool ends_shard = piece.offset + piece.length == home->bytes;
      p.io_lengths[k] = ends_shard ? round_up(piece.length, alignment) : piece.length;
      p.pointers[k] = buffers_[(base + j) % buffers_.size()].data + p.used;
      p.used += round_up(piece.length, alignment);
      p.reads.push_back({k, nvme->read(home->extent, piece.offset, p.pointers[k], p.io_lengths[k])});
      p.bytes_read += p.io_lengths[k];
    }
    const size_t kept = p.item.pieces.size();
    p.pointers.resize(kept);
    p.homes.resize(kept);
    p.io_lengths.resize(kept);
    prefetched_.push_back(std::move(p));
    if (kept < n) break;
  }
  return Status::ok();
}

std::vector<StreamedPass::Prefetched> StreamedPass::adopt_prefetched(
    std::span<const StreamItem> items) {
  // Prefetched items are taken when this run begins with them, else dropped.
  bool adopt = !prefetched_.empty() && prefetched_.size() <= items.size();
  for (size_t j = 0; adopt && j < prefetched_.size(); ++j) {
    const std::vector<StreamPiece>& mine = prefetched_[j].item.pieces;
    const std::vector<StreamPiece>& theirs = items[j].pieces;
    if (mine.size() > theirs.size()) adopt = false;
    for (size_t k = 0; adopt && k < mine.size(); ++k)
      adopt = mine[k].shard == theirs[k].shard && mine[k].offset == theirs[k].offset &&
              mine[k].length == theirs[k].length && theirs[k].read;
  }
  if (!adopt) drop_prefetch();
  std::vector<Prefetched> adopted = std::move(prefetched_);
  prefetched_.clear();
  return adopted;
}

class StreamedPass::Run {
 public:
  Run(StreamedPass& pass, std::span<const StreamItem> items)
      : pass_(pass),
        nvme_(pass.store_.nvme_tier()),
        alignment_(nvme_ ? nvme_->alignment() : 4096),
        buffer_count_(pass.buffers_.size()),
        base_(pass.slot_base_),
        items_(items),
        slots_(buffer_count_),
        adopted_(pass.adopt_prefetched(items)) {}

  const Status& failure() const { return failure_; }

  // Each item in turn: its reads waited for, visited, its write-backs
  // started, with the reads of up to buffer_count items ahead in flight.
  void visit_all(const StreamVisitor& visit) {
    StreamedPassStats& stats = pass_.stats_;
    for (size_t i = 0; i < items_.size() && failure_; ++i) {
      if (next_ <= i) {
        fail(start_item(i));
        next_ = i + 1;
        if (!failure_) break;
      }
      read_ahead(i);
      Slot& slot = slot_of(i);
      const Clock::time_point read_start = Clock::now();
      wait_all(slot.reads, i, "read");
      stats.read_wait_seconds += seconds_since(read_start);
      if (!failure_) break;

      const Clock::time_point visit_start = Clock::now();
      Status visited = visit(i, slot.pointers);
      stats.visit_seconds += seconds_since(visit_start);
      if (!visited) {
        fail(visited.with_context(fmt::format("streamed pass: item {}", i)));
        break;
      }
      const StreamItem& item = items_[i];
      for (size_t p = 0; p < item.pieces.size(); ++p) {
        const StreamPiece& piece = item.pieces[p];
        if (slot.homes[p].tier != Tier::nvme || !piece.write) continue;
        slot.writes.push_back(
            {nvme_->write(slot.homes[p].extent, piece.offset, slot.pointers[p], slot.io_lengths[p]),
             p});
        stats.bytes_written += slot.io_lengths[p];
      }
      ++stats.items;
      read_ahead(i + 1);
    }
  }

  // The next run's first pieces are read in the buffers after this run's
  // last one, each once its write-back is done, while the rest drain.
  void prefetch_next(std::span<const StreamItem> prefetch_after) {
    const size_t next_base = pass_.slot_base_;
    const size_t count = std::min(prefetch_after.size(), buffer_count_);
    for (size_t j = 0; j < count; ++j) {
      Slot& slot = slots_[(next_base + j) % buffer_count_];
      if (!slot.reads.empty()) wait_all(slot.reads, slot.item, "read");
      wait_writes(slot);
    }
    // Only a head start: a piece it cannot locate is the next run's error.
    if (failure_) (void)pass_.prefetch_into(prefetch_after, next_base);
  }

  // Nothing of this run may still use a buffer when run() returns.
  void drain() {
    for (Slot& slot : slots_) {
      if (!slot.reads.empty()) wait_all(slot.reads, slot.item, "read");
      wait_writes(slot);
    }
  }

 private:
  Slot& slot_of(size_t j) { return slots_[(base_ + j) % buffer_count_]; }

  void fail(Status status) {
    if (failure_ && !status) failure_ = std::move(status);
  }

  std::string piece_text(size_t item, const StreamPiece& piece) const {
    return fmt::format("streamed pass: item {} piece {} bytes [{}, {})", item,
                       shard_name(piece.shard), piece.offset, piece.offset + piece.length);
  }

  // Waits for a list of transfers; the first failure names its piece.
  void wait_all(std::vector<PieceTransfer>& transfers, size_t item, const char* what) {
    for (PieceTransfer& transfer : transfers) {
      Status status = transfer.handle.wait();
      if (!status)
        fail(status.with_context(
            fmt::format("{} ({})", piece_text(item, items_[item].pieces[transfer.piece]), what)));
    }
    transfers.clear();
  }

  void wait_writes(Slot& slot) {
    if (slot.writes.empty()) return;
    const Clock::time_point start = Clock::now();
    wait_all(slot.writes, slot.item, "write-back");
    pass_.stats_.write_wait_seconds += seconds_since(start);
  }

  // Starts the reads of item j's pieces (after its buffer's last write-back).
  void read_ahead(size_t current) {
    while (failure_ && next_ < items_.size() && next_ < current + buffer_count_ &&
           all_done(slot_of(next_).writes)) {
      fail(start_item(next_));
      ++next_;
    }
  }

  // Takes over what a prefetch read of item j into its buffer; returns the
  // pieces taken and the buffer bytes they use.
  std::pair<size_t, uint64_t> take_prefetched(size_t j, Slot& slot) {
    if (j >= adopted_.size()) return {0, 0};
    Prefetched& p = adopted_[j];  // read into this buffer (j < buffer_count)
    const size_t pieces = p.item.pieces.size();
    for (size_t k = 0; k < pieces; ++k) {
      slot.pointers[k] = p.pointers[k];
      slot.homes[k] = p.homes[k];
      slot.io_lengths[k] = p.io_lengths[k];
    }
    for (PrefetchedRead& read : p.reads) slot.reads.push_back({std::move(read.handle), read.piece});
    p.reads.clear();
    pass_.stats_.bytes_read += p.bytes_read;
    return {pieces, p.used};
  }

  // Locates item j's pieces and starts its reads into its buffer.
  Status start_item(size_t j) {
    Slot& slot = slot_of(j);
    wait_writes(slot);
    if (!failure_) return failure_;
    slot.item = j;
    const StreamItem& item = items_[j];
    slot.pointers.assign(item.pieces.size(), nullptr);
    slot.homes.assign(item.pieces.size(), ShardHome{});
    slot.io_lengths.assign(item.pieces.size(), 0);
    std::byte* buffer = pass_.buffers_[(base_ + j) % buffer_count_].data;
    auto [first_piece, used] = take_prefetched(j, slot);
    for (size_t p = first_piece; p < item.pieces.size(); ++p) {
      const StreamPiece& piece = item.pieces[p];
      Result<ShardHome> home = pass_.store_.home(piece.shard);
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
      if (piece.offset % alignment_ != 0)
        return Status::error(fmt::format("{}: offset is not a multiple of the I/O alignment ({})",
                                         piece_text(j, piece), alignment_));
      // A piece that ends the shard may run on to the extent's aligned end (no
      // read-modify-write); one inside the shard must stop where it ends.
      const bool ends_shard = piece.offset + piece.length == home->bytes;
      slot.io_lengths[p] = ends_shard ? round_up(piece.length, alignment_) : piece.length;
      if (used + round_up(piece.length, alignment_) > pass_.options_.buffer_bytes)
        return Status::error(fmt::format(
            "streamed pass: item {} needs more than the {} buffers hold; create the pass with "
            "buffer_bytes of at least buffer_bytes_for(item)",
            j, format_bytes(pass_.options_.buffer_bytes)));
      slot.pointers[p] = buffer + used;
      used += round_up(piece.length, alignment_);
      if (piece.read) {
        slot.reads.push_back(
            {nvme_->read(home->extent, piece.offset, slot.pointers[p], slot.io_lengths[p]), p});
        pass_.stats_.bytes_read += slot.io_lengths[p];
      }
    }
    return Status::ok();
  }

  StreamedPass& pass_;
  NvmeTier* const nvme_;
  const uint64_t alignment_;
  const size_t buffer_count_;
  const size_t base_;  // item j uses buffer (base + j) mod buffer_count, where a prefetch put it
  const std::span<const StreamItem> items_;
  std::vector<Slot> slots_;
  std::vector<Prefetched> adopted_;
  Status failure_;
  size_t next_ = 0;  // the next item whose reads are not started
};

Status StreamedPass::run(std::span<const StreamItem> items, const StreamVisitor& visit,
                         std::span<const StreamItem> prefetch_after) {
  stats_ = StreamedPassStats{};
  const Clock::time_point run_start = Clock::now();
  Run pass_run(*this, items);
  pass_run.visit_all(visit);
  slot_base_ = (slot_base_ + items.size()) % buffers_.size();
  if (pass_run.failure() && !prefetch_after.empty()) pass_run.prefetch_next(prefetch_after);
  pass_run.drain();
  stats_.seconds = seconds_since(run_start);
  return pass_run.failure();
}

}  // namespace strata::tiers
