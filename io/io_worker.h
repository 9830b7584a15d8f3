// Internal to io/: one I/O thread, the ring it owns, and its request queue.
//
// Contract. Any thread may enqueue requests or control calls; only the
// worker's own thread touches the ring. The worker keeps at most
// ring.capacity() requests in flight, retries short transfers, -EAGAIN and
// -EINTR, and reports every finished request to its transfer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "io/ring.h"
#include "io/transfer_state.h"

namespace strata::io {

struct WorkerSettings {
  RingLimits limits;
  uint64_t alignment = 4096;
  unsigned max_retries = 64;
  IoBackend backend = IoBackend::kAuto;
  std::shared_ptr<FaultInjector> fault_injector;
};

class IoWorker {
 public:
  // Reports each finished request (ok or not) of a transfer.
  using FinishRequest = std::function<void(const std::shared_ptr<TransferState>&, Status)>;
  struct Counters {
    std::atomic<uint64_t> bytes_read{0}, bytes_written{0}, requests{0}, retries{0}, syncs{0};
  };

  IoWorker(WorkerSettings settings, FinishRequest finish, Counters& counters);
  ~IoWorker();  // finishes what was queued, then stops

  // Starts the thread and creates its ring; the status says whether that worked
  // and `fell_back` whether io_uring was unavailable (kAuto only).
  Status start(bool& fell_back, std::string& ring_description);

  void enqueue(std::vector<BlockRequest>&& requests);
  // Runs `call` on the worker's thread with its ring and waits for it.
  Status run_on_ring(std::function<Status(Ring&)> call);
  // Buffer registry of this worker's ring: [data, data + size) is fixed buffer `slot`.
  Status add_buffer(int slot, void* data, size_t size);
  Status remove_buffer(int slot, void* data);

  std::vector<float> take_latencies_us();

 private:
  struct InFlight {
    BlockRequest request;
    uint32_t done = 0;  // bytes of the request finished
    unsigned retries_without_progress = 0;
    bool tail_read_done = false;  // tails: the bounce block holds the file's block
    std::unique_ptr<std::byte, void (*)(void*)> bounce{nullptr, nullptr};
    std::chrono::steady_clock::time_point issued_at;
  };
  struct Control {
    std::function<Status(Ring&)> call;
    std::promise<Status> result;
  };
  struct BufferRegion {
    uintptr_t end;
    int slot;
  };

  void run(bool& fell_back, std::string& ring_description);
  void issue(uint32_t slot);
  void complete(uint32_t slot, int64_t result);
  void finish(uint32_t slot, Status status);
  int buffer_slot_of(const std::byte* data, uint32_t length) const;

  WorkerSettings settings_;
  FinishRequest finish_request_;
  Counters& counters_;
  std::unique_ptr<Ring> ring_;
  std::promise<Status> started_;  // a member, so it outlives the thread's set_value
  std::thread thread_;

  std::mutex mutex_;  // guards queue_, controls_, stopping_, waiting_in_ring_ (writes of true)
  std::condition_variable queue_changed_;
  std::deque<BlockRequest> queue_;
  std::deque<std::shared_ptr<Control>>
      controls_;  // shared: the caller may return before set_value does
  bool stopping_ = false;
  std::atomic<bool> waiting_in_ring_{false};

  // Owned by the worker thread.
  std::vector<std::optional<InFlight>> slots_;
  std::vector<uint32_t> free_slots_;
  std::deque<uint32_t> ready_;  // slots prepared for (re)issue
  unsigned in_flight_ = 0;
  std::map<uintptr_t, BufferRegion> buffers_;  // by start address

  std::mutex latencies_mutex_;
  std::vector<float> latencies_us_;
};

}  // namespace strata::io
