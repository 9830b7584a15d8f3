// StreamedPass: visits shards whose home is NVMe (or host) through a fixed
// number of pinned host buffers: while a given function works on item i, item
// i+1 (and further, while buffers are free) is read and item i-1 is written
// back, so the CPU and the drives work at the same time and host memory used
// is the buffers, whatever the size of the state.
//
// An item is a list of pieces, each a byte range of one shard, read before the
// visit (unless write-only) and written back after it (unless read-only). The
// pieces of NVMe-homed shards are packed into one buffer, each at a multiple
// of the I/O alignment; pieces of host-homed shards are visited in place. A
// piece's offset must be a multiple of the I/O alignment. The visitor gets one
// pointer per piece, in order, and runs on the calling thread (it may use TBB
// inside); tiers know bytes, not what the bytes mean (tiers/README.md).
//
// Completion: run() returns once every write-back of the pass has completed
// (in the page cache of the device). On the first error (I/O or the
// visitor's) no new item starts, what is in flight is drained, and the error
// is returned naming the item and shard; items already written back keep
// their new bytes, the failed item's shards may hold part of them, and shards
// of items never reached are untouched.
//
// Ownership and threads: the pass borrows the store (which must outlive it) and
// owns its buffers, charged to the host budget at create() for its lifetime.
// One run() at a time per pass; while it runs, the shards it visits must not
// be moved by other calls on the store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "io/base/status.h"
#include "tiers/tiered_store.h"

namespace strata::tiers {

struct StreamPiece {
  ShardKey shard;
  uint64_t offset = 0;  // bytes into the shard; a multiple of the I/O alignment
  uint64_t length = 0;
  bool read = true;   // false: write-only (its bytes in the buffer start undefined)
  bool write = true;  // false: read-only (not written back)
};

struct StreamItem {
  std::vector<StreamPiece> pieces;
};

// Called once per item, in order, with one pointer per piece.
using StreamVisitor = std::function<Status(size_t item, std::span<std::byte* const> pieces)>;

struct StreamedPassOptions {
  unsigned buffer_count = 4;  // offload_optimizer.buffer_count; at least 2
  uint64_t buffer_bytes = 0;  // the largest item's NVMe pieces, each rounded to the alignment
};

struct StreamedPassStats {
  uint64_t items = 0;
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  double seconds = 0;             // the whole run
  double visit_seconds = 0;       // inside the visitor
  double read_wait_seconds = 0;   // waiting for an item's reads (the drives were behind)
  double write_wait_seconds = 0;  // waiting for a buffer's write-back before reusing it
};

class StreamedPass {
 public:
  // Takes buffer_count * buffer_bytes from the host tier (fails with the numbers).
  static Result<std::unique_ptr<StreamedPass>> create(TieredStore& store,
                                                      StreamedPassOptions options);
  ~StreamedPass();
  StreamedPass(const StreamedPass&) = delete;
  StreamedPass& operator=(const StreamedPass&) = delete;

  // `prefetch_after`: once the last item is visited and its write-back
  // started, prefetch(prefetch_after) into the buffers this run is done
  // with, each once its write-back has completed, while the rest drain.
  Status run(std::span<const StreamItem> items, const StreamVisitor& visit,
             std::span<const StreamItem> prefetch_after = {});

  // Starts the reads of the first pieces of items the next run() is expected
  // to begin with (at most buffer_count items), into the buffers, which are
  // idle between runs (or see run()'s prefetch_after). When that run's item j begins with prefetched item j's
  // pieces (same shards, offsets and lengths, in order), it takes those bytes
  // as read; otherwise the prefetched reads are waited for and dropped. The
  // caller says the prefetched bytes stay valid: nothing writes those ranges
  // between this call and that run (the run's own write-backs come after its
  // reads). Pieces must be read pieces of NVMe or host homes; host pieces are
  // visited in place as in run(). Errors are those of locating a piece; a
  // failed read surfaces in the run that takes it.
  Status prefetch(std::span<const StreamItem> items);

  // Bytes of buffer one item needs (what buffer_bytes must cover).
  static uint64_t buffer_bytes_for(const StreamItem& item, uint64_t alignment);
  const StreamedPassStats& last_run() const { return stats_; }
  const StreamedPassOptions& options() const { return options_; }

 private:
  StreamedPass(TieredStore& store, StreamedPassOptions options);
  // Waits for the prefetched reads and forgets them.
  void drop_prefetch();

  // prefetch() with item j in buffer (base + j) mod buffer_count; the buffers
  // must be idle.
  Status prefetch_into(std::span<const StreamItem> items, size_t base);

  struct PrefetchedRead {
    size_t piece = 0;
    io::IoHandle handle;
  };
  // Item j of the last prefetch(): its pieces, where each lies in buffer j,
  // and the reads in flight.
  struct Prefetched {
    StreamItem item;
    std::vector<std::byte*> pointers;
    std::vector<ShardHome> homes;
    std::vector<uint64_t> io_lengths;
    std::vector<PrefetchedRead> reads;
    uint64_t used = 0;  // bytes of buffer j taken
    uint64_t bytes_read = 0;
  };
  std::vector<Prefetched> prefetched_;
  // The prefetched items a run of `items` begins with, else none (dropped).
  std::vector<Prefetched> adopt_prefetched(std::span<const StreamItem> items);
  // One run() in flight: its buffers' slots, reads, visits and write-backs.
  class Run;
  size_t slot_base_ = 0;  // the buffer of the next run's (and prefetch's) item 0

  TieredStore& store_;
  StreamedPassOptions options_;
  std::vector<HostBlock> buffers_;
  StreamedPassStats stats_;
};

}  // namespace strata::tiers
