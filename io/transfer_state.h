// Internal to io/: the shared state of one submitted transfer and the
// block-sized requests it is cut into.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "io/io_engine.h"
#include "io/ring.h"

namespace strata::io {

class IoEngineImpl;

struct TransferState {
  IoEngineImpl* engine = nullptr;
  FileId file = -1;
  std::atomic<uint32_t> pending_requests{0};
  std::atomic<int> done{0};    // 0 while running; waited on with std::atomic::wait
  bool durable = false;        // fdatasync every touched path after the data requests
  bool sync_issued = false;    // touched only by the thread that finishes the data requests
  uint64_t touched_paths = 0;  // bit p: path p holds part of the range
  std::chrono::steady_clock::time_point submitted_at;
  std::chrono::steady_clock::time_point completed_at;

  void record_error(Status error) {
    std::lock_guard lock(status_mutex);
    if (status.is_ok()) status = std::move(error);
  }
  Status final_status() {
    std::lock_guard lock(status_mutex);
    return status;
  }
  bool failed() {
    std::lock_guard lock(status_mutex);
    return !status.is_ok();
  }

 private:
  std::mutex status_mutex;
  Status status;
};

// One file on one path (a stripe of a FileId).
struct PathFile {
  int fd = -1;
  std::string path;
};

// At most block_size bytes on one path file. A request whose length is not a
// multiple of the alignment is a tail (shorter than one alignment block) and
// goes through a bounce block.
struct BlockRequest {
  std::shared_ptr<TransferState> transfer;
  RingOp op = RingOp::kRead;
  int file_slot = -1;
  const PathFile* file = nullptr;
  std::byte* buffer = nullptr;
  uint64_t offset = 0;  // in the path file
  uint32_t length = 0;
};

}  // namespace strata::io
