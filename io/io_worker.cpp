#include "io/io_worker.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "io/base/status.h"
#include "io/fault_injection.h"

namespace strata::io {
namespace {

const char* operation_name(RingOp op) {
  switch (op) {
    case RingOp::kRead:
      return "read";
    case RingOp::kWrite:
      return "write";
    case RingOp::kSync:
      return "fdatasync";
  }
  return "?";
}

}  // namespace

IoWorker::IoWorker(WorkerSettings settings, FinishRequest finish, Counters& counters)
    : settings_(std::move(settings)), finish_request_(std::move(finish)), counters_(counters) {}

IoWorker::~IoWorker() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  queue_changed_.notify_one();
  ring_->wake();
  thread_.join();
}

Status IoWorker::start(bool& fell_back, std::string& ring_description) {
  std::future<Status> result = started_.get_future();
  thread_ = std::thread([&] { run(fell_back, ring_description); });
  Status status = result.get();
  if (!status) thread_.join();
  return status;
}

void IoWorker::run(bool& fell_back, std::string& ring_description) {
  // The ring is created here so that this thread is its single issuer.
  if (settings_.backend == IoBackend::kPosix) {
    ring_ = make_posix_ring(settings_.limits);
  } else {
    Result<std::unique_ptr<Ring>> uring = make_uring_ring(settings_.limits);
    if (uring) {
      ring_ = std::move(uring).value();
    } else if (settings_.backend == IoBackend::kAuto) {
      fell_back = true;
      ring_description = uring.status().message();
      ring_ = make_posix_ring(settings_.limits);
    } else {
      started_.set_value(uring.status().with_context("io_uring unavailable"));
      return;
    }
  }
  if (settings_.fault_injector) {
    ring_ = wrap_with_faults(std::move(ring_), settings_.fault_injector, settings_.alignment);
  }
  if (!fell_back) ring_description = ring_->description();
  const unsigned capacity = ring_->capacity();
  slots_.resize(capacity);
  for (unsigned slot = capacity; slot-- > 0;) free_slots_.push_back(slot);
  started_.set_value(Status::ok());  // the out-parameters are gone after this

  std::vector<RingCompletion> completions;
  std::vector<std::shared_ptr<Control>> controls;
  while (true) {
    {
      std::unique_lock lock(mutex_);
      if (in_flight_ == 0 && ready_.empty()) {
        queue_changed_.wait(lock,
                            [&] { return stopping_ || !queue_.empty() || !controls_.empty(); });
        if (stopping_ && queue_.empty() && controls_.empty()) break;
      }
      while (!free_slots_.empty() && !queue_.empty()) {
        uint32_t slot = free_slots_.back();
        free_slots_.pop_back();
        slots_[slot].emplace();
        slots_[slot]->request = std::move(queue_.front());
        queue_.pop_front();
        ready_.push_back(slot);
      }
      controls.assign(controls_.begin(), controls_.end());
      controls_.clear();
      // From here until the wait returns, new work must wake the ring.
      if (in_flight_ > 0 || !ready_.empty()) waiting_in_ring_.store(true);
    }
    for (const std::shared_ptr<Control>& control : controls) {
      control->result.set_value(control->call(*ring_));
    }
    controls.clear();
    while (!ready_.empty()) {
      issue(ready_.front());
      ready_.pop_front();
    }
    if (in_flight_ == 0) continue;

    completions.clear();
    Status status = ring_->submit_and_wait(1, completions);
    waiting_in_ring_.store(false);
    if (!status) {  // the ring itself failed: fail everything in flight
      for (uint32_t slot = 0; slot < slots_.size(); ++slot) {
        if (slots_[slot]) finish(slot, status);
      }
      in_flight_ = 0;
      continue;
    }
    for (const RingCompletion& completion : completions) {
      complete(uint32_t(completion.tag), completion.result);
    }
  }
}

void IoWorker::enqueue(std::vector<BlockRequest>&& requests) {
  bool wake_ring;
  {
    std::lock_guard lock(mutex_);
    for (BlockRequest& request : requests) queue_.push_back(std::move(request));
    wake_ring = waiting_in_ring_.exchange(false);
  }
  queue_changed_.notify_one();
  if (wake_ring) ring_->wake();
}

Status IoWorker::run_on_ring(std::function<Status(Ring&)> call) {
  auto control = std::make_shared<Control>(std::move(call), std::promise<Status>());
  std::future<Status> result = control->result.get_future();
  bool wake_ring;
  {
    std::lock_guard lock(mutex_);
    controls_.push_back(std::move(control));
    wake_ring = waiting_in_ring_.exchange(false);
  }
  queue_changed_.notify_one();
  if (wake_ring) ring_->wake();
  return result.get();
}

Status IoWorker::add_buffer(int slot, void* data, size_t size) {
  return run_on_ring([this, slot, data, size](Ring& ring) {
    Status status = ring.register_buffer(slot, data, size);
    if (status) buffers_[uintptr_t(data)] = {uintptr_t(data) + size, slot};
    return status;
  });
}

Status IoWorker::remove_buffer(int slot, void* data) {
  return run_on_ring([this, slot, data](Ring& ring) {
    buffers_.erase(uintptr_t(data));
    return ring.unregister_buffer(slot);
  });
}

std::vector<float> IoWorker::take_latencies_us() {
  std::lock_guard lock(latencies_mutex_);
  return std::exchange(latencies_us_, {});
}

int IoWorker::buffer_slot_of(const std::byte* data, uint32_t length) const {
  auto after = buffers_.upper_bound(uintptr_t(data));
  if (after == buffers_.begin()) return -1;
  const BufferRegion& region = std::prev(after)->second;
  return uintptr_t(data) + length <= region.end ? region.slot : -1;
}

void IoWorker::issue(uint32_t slot) {
  InFlight& flight = *slots_[slot];
  const BlockRequest& request = flight.request;
  const uint64_t alignment = settings_.alignment;
  RingRequest ring_request{.tag = slot,
                           .op = request.op,
                           .file_slot = request.file_slot,
                           .fd = request.file->fd,
                           .offset = request.offset};
  if (request.op != RingOp::kSync && request.length % alignment != 0) {
    // A tail: read the whole alignment block into the bounce block; a write
    // then patches its bytes in and writes the block back.
    if (!flight.bounce) {
      flight.bounce = {static_cast<std::byte*>(std::aligned_alloc(alignment, alignment)),
                       std::free};
    }
    ring_request.op = flight.tail_read_done ? RingOp::kWrite : RingOp::kRead;
    ring_request.buffer = flight.bounce.get();
    ring_request.length = uint32_t(alignment);
  } else if (request.op != RingOp::kSync) {
    ring_request.buffer = request.buffer + flight.done;
    ring_request.length = request.length - flight.done;
    ring_request.offset = request.offset + flight.done;
    ring_request.buffer_slot = buffer_slot_of(request.buffer + flight.done, ring_request.length);
  }
  flight.issued_at = std::chrono::steady_clock::now();
  ring_->prepare(ring_request);
  ++in_flight_;
}

void IoWorker::complete(uint32_t slot, int64_t result) {
  --in_flight_;
  InFlight& flight = *slots_[slot];
  const BlockRequest& request = flight.request;
  const uint64_t alignment = settings_.alignment;
  {
    float latency_us = std::chrono::duration<float, std::micro>(std::chrono::steady_clock::now() -
                                                                flight.issued_at)
                           .count();
    std::lock_guard lock(latencies_mutex_);
    latencies_us_.push_back(latency_us);
  }
  counters_.requests.fetch_add(1, std::memory_order_relaxed);

  auto describe = [&](const std::string& what) {
    return Status::error(fmt::format("{} of {} bytes at offset {} in {} failed: {}",
                                     operation_name(request.op), request.length - flight.done,
                                     request.offset + flight.done, request.file->path, what));
  };
  auto retry = [&](bool made_progress) {
    if (made_progress) {
      flight.retries_without_progress = 0;
    } else if (++flight.retries_without_progress > settings_.max_retries) {
      return finish(slot,
                    describe(fmt::format("no progress after {} retries", settings_.max_retries)));
    }
    counters_.retries.fetch_add(1, std::memory_order_relaxed);
    ready_.push_back(slot);
  };
  auto count_bytes = [&](uint64_t bytes) {
    (request.op == RingOp::kRead ? counters_.bytes_read : counters_.bytes_written)
        .fetch_add(bytes, std::memory_order_relaxed);
  };

  if (result == -EAGAIN || result == -EINTR) return retry(false);
  if (result < 0) return finish(slot, describe(errno_text(int(-result))));

  if (request.op == RingOp::kSync) {
    counters_.syncs.fetch_add(1, std::memory_order_relaxed);
    return finish(slot, Status::ok());
  }

  if (request.length % alignment != 0) {  // a tail, through the bounce block
    std::byte* bounce = flight.bounce.get();
    if (flight.tail_read_done) {  // the write-back of a patched block
      if (uint64_t(result) < alignment) return retry(false);
      count_bytes(request.length);
      return finish(slot, Status::ok());
    }
    if (request.op == RingOp::kRead) {
      if (result == 0) return finish(slot, describe("end of file"));
      if (uint64_t(result) < request.length) return retry(false);
      std::memcpy(request.buffer, bounce, request.length);
      count_bytes(request.length);
      return finish(slot, Status::ok());
    }
    // Read stage of a tail write. 0 means the block lies past the end of the
    // file (nothing to keep); a partial block is retried rather than guessed.
    if (result == 0)
      std::memset(bounce, 0, alignment);
    else if (uint64_t(result) < alignment)
      return retry(false);
    std::memcpy(bounce, request.buffer, request.length);
    flight.tail_read_done = true;
    ready_.push_back(slot);
    return;
  }

  const uint32_t remaining = request.length - flight.done;
  if (result == 0 && request.op == RingOp::kRead) return finish(slot, describe("end of file"));
  // A short O_DIRECT transfer resumes at an aligned point; bytes past it are redone.
  const uint32_t advanced = uint64_t(result) >= remaining
                                ? remaining
                                : uint32_t(uint64_t(result) / alignment * alignment);
  flight.done += advanced;
  count_bytes(advanced);
  if (flight.done == request.length) return finish(slot, Status::ok());
  retry(advanced > 0);
}

void IoWorker::finish(uint32_t slot, Status status) {
  std::shared_ptr<TransferState> transfer = std::move(slots_[slot]->request.transfer);
  slots_[slot].reset();
  free_slots_.push_back(slot);
  finish_request_(transfer, std::move(status));
}

}  // namespace strata::io
