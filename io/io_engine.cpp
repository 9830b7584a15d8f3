#include "io/io_engine.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>

#include "io/io_worker.h"
#include "io/swap_directory.h"
#include "io/transfer_state.h"

namespace strata::io {
namespace {

// The kernel takes at most 1 GiB per registered buffer; larger ones use several slots.
constexpr uint64_t kMaxRegisteredBytes = uint64_t{1} << 30;
constexpr unsigned kMaxBufferSlots = 256;
constexpr size_t kMaxPaths = 64;  // touched paths are a 64-bit mask

struct FileRecord {
  std::string name;
  uint64_t capacity = 0;
  std::vector<PathFile> path_files;  // index = path
};

void finish_transfer_now(TransferState& transfer) {
  transfer.completed_at = std::chrono::steady_clock::now();
  transfer.done.store(1, std::memory_order_release);
  transfer.done.notify_all();
}

IoHandle failed_handle(Status status) {
  auto state = std::make_shared<TransferState>();
  state->submitted_at = std::chrono::steady_clock::now();
  state->record_error(std::move(status));
  finish_transfer_now(*state);
  return IoHandle(std::move(state));
}

}  // namespace

class IoEngineImpl {
 public:
  IoOptions options;
  uint64_t alignment = 4096;
  std::vector<DirectoryInfo> directories;  // index = path
  IoWorker::Counters counters;
  std::vector<std::unique_ptr<IoWorker>> workers;        // path p owns [p * T, (p + 1) * T)
  std::unique_ptr<std::atomic<uint64_t>[]> next_worker;  // per path, round robin
  std::string backend_description;

  // Transfers handed to the workers and not finished; the destructor waits for 0.
  std::mutex running_mutex;
  std::condition_variable running_changed;
  uint64_t transfers_running = 0;

  void count_transfer_started() {
    std::lock_guard lock(running_mutex);
    ++transfers_running;
  }

  std::mutex files_mutex;
  std::vector<std::unique_ptr<FileRecord>> files;  // index = FileId = file slot in every ring

  std::mutex buffers_mutex;
  std::map<void*, std::vector<int>> buffer_slots;
  std::vector<bool> buffer_slot_used = std::vector<bool>(kMaxBufferSlots, false);

  IoWorker& worker_for_path(size_t path) { return *workers[worker_index_for_path(path)]; }
  size_t worker_index_for_path(size_t path) {
    const unsigned threads = options.threads_per_path;
    return path * threads + next_worker[path].fetch_add(1, std::memory_order_relaxed) % threads;
  }

  const FileRecord* file_record(FileId file) {
    std::lock_guard lock(files_mutex);
    if (file < 0 || size_t(file) >= files.size()) return nullptr;
    return files[file].get();
  }

  void finish_transfer(TransferState& transfer) {
    finish_transfer_now(transfer);
    std::lock_guard lock(running_mutex);
    if (--transfers_running == 0) running_changed.notify_all();
  }

  // Called by the workers for each finished block request.
  void finish_request(const std::shared_ptr<TransferState>& transfer, Status status) {
    if (!status) transfer->record_error(std::move(status));
    if (transfer->pending_requests.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (transfer->durable && !transfer->sync_issued && !transfer->failed()) {
      transfer->sync_issued = true;  // fdatasync only after every write has completed
      enqueue_syncs(transfer);
      return;
    }
    finish_transfer(*transfer);
  }

  void enqueue_syncs(const std::shared_ptr<TransferState>& transfer) {
    const FileRecord* record = file_record(transfer->file);
    std::vector<size_t> paths;
    for (size_t path = 0; path < options.paths.size(); ++path) {
      if (transfer->touched_paths & (uint64_t{1} << path)) paths.push_back(path);
    }
    if (paths.empty()) return finish_transfer(*transfer);
    transfer->pending_requests.store(uint32_t(paths.size()), std::memory_order_release);
    for (size_t path : paths) {
      std::vector<BlockRequest> sync(1);
      sync[0] = BlockRequest{.transfer = transfer,
                             .op = RingOp::kSync,
                             .file_slot = transfer->file,
                             .file = &record->path_files[path]};
      worker_for_path(path).enqueue(std::move(sync));
    }
  }

  IoHandle submit(RingOp op, FileId file, uint64_t offset, std::byte* buffer, uint64_t length,
                  bool durable) {
    const FileRecord* record = file_record(file);
    const char* what = op == RingOp::kRead ? "read" : "write";
    if (record == nullptr)
      return failed_handle(Status::error(fmt::format("{}: no open file {}", what, file)));
    if (offset % alignment != 0 || uintptr_t(buffer) % alignment != 0) {
      return failed_handle(
          Status::error(fmt::format("{} of {} bytes at offset {} in {}: offset and buffer address "
                                    "must be multiples of {} (O_DIRECT)",
                                    what, length, offset, record->name, alignment)));
    }
    if (offset + length > record->capacity) {
      return failed_handle(Status::error(
          fmt::format("{} of {} bytes at offset {} in {}: past its capacity of {} bytes", what,
                      length, offset, record->name, record->capacity)));
    }

    auto transfer = std::make_shared<TransferState>();
    transfer->engine = this;
    transfer->file = file;
    transfer->durable = durable;
    transfer->submitted_at = std::chrono::steady_clock::now();

    // Cut [offset, offset + length) at stripe-unit boundaries; unit u lives on
    // path u % N at offset (u / N) * unit of that path's file.
    const uint64_t unit = options.block_size;
    const size_t path_count = options.paths.size();
    std::vector<std::vector<BlockRequest>> batches(workers.size());
    uint32_t request_count = 0;
    for (uint64_t position = offset; position < offset + length;) {
      const uint64_t stripe = position / unit;
      const size_t path = stripe % path_count;
      const uint64_t within = position % unit;
      const uint64_t piece = std::min(unit - within, offset + length - position);
      BlockRequest request{.transfer = transfer,
                           .op = op,
                           .file_slot = file,
                           .file = &record->path_files[path],
                           .buffer = buffer + (position - offset),
                           .offset = (stripe / path_count) * unit + within,
                           .length = uint32_t(piece)};
      const uint64_t tail = piece % alignment;
      if (tail != 0 && piece > tail) {  // the aligned body and the tail travel separately
        BlockRequest tail_request = request;
        tail_request.buffer += piece - tail;
        tail_request.offset += piece - tail;
        tail_request.length = uint32_t(tail);
        request.length = uint32_t(piece - tail);
        batches[worker_index_for_path(path)].push_back(std::move(tail_request));
        ++request_count;
      }
      batches[worker_index_for_path(path)].push_back(std::move(request));
      ++request_count;
      transfer->touched_paths |= uint64_t{1} << path;
      position += piece;
    }
    if (request_count == 0) {
      finish_transfer_now(*transfer);
      return IoHandle(std::move(transfer));
    }
    transfer->pending_requests.store(request_count, std::memory_order_release);
    count_transfer_started();
    for (size_t worker = 0; worker < workers.size(); ++worker) {
      if (!batches[worker].empty()) workers[worker]->enqueue(std::move(batches[worker]));
    }
    return IoHandle(std::move(transfer));
  }
};

// ---- IoHandle ---------------------------------------------------------------

IoHandle::IoHandle(std::shared_ptr<TransferState> state) : state_(std::move(state)) {}

IoHandle& IoHandle::operator=(IoHandle&& other) noexcept {
  if (this != &other) {
    if (state_) state_->done.wait(0, std::memory_order_acquire);
    state_ = std::move(other.state_);
  }
  return *this;
}

IoHandle::~IoHandle() {
  if (state_) state_->done.wait(0, std::memory_order_acquire);
}

bool IoHandle::is_done() const {
  return state_ == nullptr || state_->done.load(std::memory_order_acquire) != 0;
}

Status IoHandle::wait() {
  if (state_ == nullptr) return Status::error("wait on an empty IoHandle");
  state_->done.wait(0, std::memory_order_acquire);
  return state_->final_status();
}

std::chrono::nanoseconds IoHandle::latency() const {
  if (!is_done() || state_ == nullptr) return std::chrono::nanoseconds(0);
  return state_->completed_at - state_->submitted_at;
}

// ---- IoEngine -----------------------------------------------------------------

IoEngine::IoEngine(std::unique_ptr<IoEngineImpl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<IoEngine>> IoEngine::open(IoOptions options) {
  if (options.paths.empty())
    return Status::error("no NVMe path given; name at least one directory");
  if (options.paths.size() > kMaxPaths)
    return Status::error(fmt::format("{} NVMe paths given; at most {} are supported",
                                     options.paths.size(), kMaxPaths));
  if (options.queue_depth == 0 || options.threads_per_path == 0 || options.block_size == 0)
    return Status::error("block size, queue depth and threads per path must be at least 1");
  if (options.block_size > (uint64_t{1} << 31))
    return Status::error(
        fmt::format("block size {} is over the 2 GiB a request can carry", options.block_size));
  if (!options.notice) {
    options.notice = [](const std::string& text) { fmt::print(stderr, "strata: {}\n", text); };
  }

  auto impl = std::make_unique<IoEngineImpl>();
  std::vector<std::string> canonical;
  for (const std::string& path : options.paths) {
    Result<DirectoryInfo> info = inspect_swap_directory(path);
    if (!info) return info.status();
    std::error_code ignored;
    std::string resolved = std::filesystem::weakly_canonical(path, ignored).string();
    if (std::find(canonical.begin(), canonical.end(), resolved) != canonical.end())
      return Status::error(fmt::format(
          "NVMe path '{}' is given twice; each path must be a different directory", path));
    canonical.push_back(resolved);
    if (!info->direct_io) {
      if (!options.allow_buffered_io) {
        return Status::error(fmt::format(
            "NVMe path '{}' ({}) does not support O_DIRECT; use a directory on a filesystem that "
            "does "
            "(ext4, xfs on NVMe), or allow buffered I/O through the page cache (--buffered-io)",
            path, info->filesystem));
      }
      options.notice(fmt::format(
          "'{}' ({}) has no O_DIRECT; using buffered I/O through the page cache, as asked", path,
          info->filesystem));
    }
    impl->alignment = std::max(impl->alignment, info->alignment);
    impl->directories.push_back(*info);
  }
  // 4096 unless a path reports more; smaller reported values still work with 4096.
  if (options.block_size % impl->alignment != 0) {
    return Status::error(
        fmt::format("block size {} is not a multiple of the direct I/O alignment {}",
                    options.block_size, impl->alignment));
  }

  impl->options = options;
  impl->files.resize(0);
  impl->next_worker = std::make_unique<std::atomic<uint64_t>[]>(options.paths.size());
  IoBackend backend = options.backend;
  IoEngineImpl* raw = impl.get();
  for (size_t index = 0; index < options.paths.size() * options.threads_per_path; ++index) {
    WorkerSettings settings{.limits = {.queue_depth = options.queue_depth,
                                       .max_files = options.max_files,
                                       .max_buffers = kMaxBufferSlots},
                            .alignment = impl->alignment,
                            .max_retries = options.max_retries,
                            .backend = backend,
                            .fault_injector = options.fault_injector};
    auto worker = std::make_unique<IoWorker>(
        settings,
        [raw](const std::shared_ptr<TransferState>& transfer, Status status) {
          raw->finish_request(transfer, std::move(status));
        },
        impl->counters);
    bool fell_back = false;
    std::string description;
    Status started = worker->start(fell_back, description);
    if (!started) return started;
    if (fell_back) {
      options.notice(
          fmt::format("io_uring is not available ({}); using pread/pwrite threads on the "
                      "same O_DIRECT files",
                      description));
      backend = IoBackend::kPosix;
      description = "pread/pwrite";
    }
    if (index == 0) impl->backend_description = description;
    impl->workers.push_back(std::move(worker));
  }
  return std::unique_ptr<IoEngine>(new IoEngine(std::move(impl)));
}

IoEngine::~IoEngine() {
  // Every transfer finishes first: a durable write may still queue its
  // fdatasync on another path's worker.
  {
    std::unique_lock lock(impl_->running_mutex);
    impl_->running_changed.wait(lock, [&] { return impl_->transfers_running == 0; });
  }
  impl_->workers.clear();
  for (auto& record : impl_->files) {
    if (!record) continue;
    for (PathFile& file : record->path_files) close(file.fd);
  }
}

Result<FileId> IoEngine::create_file(const std::string& name, uint64_t capacity) {
  if (name.empty() || name.find('/') != std::string::npos)
    return Status::error(fmt::format("swap file name '{}' must be a plain file name", name));
  const size_t path_count = impl_->options.paths.size();
  const uint64_t unit = impl_->options.block_size;
  const uint64_t units = (capacity + unit - 1) / unit;
  const uint64_t per_path_bytes = (units + path_count - 1) / path_count * unit;

  auto record = std::make_unique<FileRecord>();
  record->name = name;
  record->capacity = capacity;
  for (size_t path = 0; path < path_count; ++path) {
    Result<SwapFileHandle> opened = open_swap_file(impl_->options.paths[path], name, per_path_bytes,
                                                   impl_->directories[path].direct_io);
    if (!opened) {
      for (PathFile& file : record->path_files) close(file.fd);
      return opened.status();
    }
    record->path_files.push_back({opened->fd, opened->path});
  }

  std::lock_guard lock(impl_->files_mutex);
  FileId id = 0;
  while (size_t(id) < impl_->files.size() && impl_->files[id]) ++id;
  if (unsigned(id) >= impl_->options.max_files) {
    for (PathFile& file : record->path_files) close(file.fd);
    return Status::error(
        fmt::format("too many open swap files (max_files = {})", impl_->options.max_files));
  }
  for (size_t worker = 0; worker < impl_->workers.size(); ++worker) {
    const PathFile& file = record->path_files[worker / impl_->options.threads_per_path];
    Status registered = impl_->workers[worker]->run_on_ring(
        [id, fd = file.fd](Ring& ring) { return ring.register_file(id, fd); });
    if (!registered) {
      for (PathFile& path_file : record->path_files) close(path_file.fd);
      return registered.with_context(file.path);
    }
  }
  if (size_t(id) == impl_->files.size()) impl_->files.emplace_back();
  impl_->files[id] = std::move(record);
  return id;
}

Status IoEngine::remove_file(FileId file) {
  std::unique_ptr<FileRecord> record;
  {
    std::lock_guard lock(impl_->files_mutex);
    if (file < 0 || size_t(file) >= impl_->files.size() || !impl_->files[file])
      return Status::error(fmt::format("remove_file: no open file {}", file));
    record = std::move(impl_->files[file]);
  }
  Status result;
  for (auto& worker : impl_->workers) {
    Status status = worker->run_on_ring([file](Ring& ring) { return ring.unregister_file(file); });
    if (!status && result) result = status;
  }
  for (PathFile& path_file : record->path_files) {
    close(path_file.fd);
    if (unlink(path_file.path.c_str()) != 0 && result)
      result = Status::from_errno(errno, "unlink " + path_file.path);
  }
  return result;
}

uint64_t IoEngine::capacity(FileId file) const {
  const FileRecord* record = impl_->file_record(file);
  return record ? record->capacity : 0;
}

Status IoEngine::register_buffer(void* data, size_t size) {
  if (uintptr_t(data) % impl_->alignment != 0)
    return Status::error(
        fmt::format("register_buffer: address is not a multiple of {}", impl_->alignment));
  std::lock_guard lock(impl_->buffers_mutex);
  if (impl_->buffer_slots.count(data))
    return Status::error("register_buffer: buffer already registered");
  std::vector<int> slots;
  auto release = [&] {
    for (size_t part = 0; part < slots.size(); ++part) {
      for (auto& worker : impl_->workers)
        worker->remove_buffer(slots[part],
                              static_cast<std::byte*>(data) + part * kMaxRegisteredBytes);
      impl_->buffer_slot_used[slots[part]] = false;
    }
  };
  for (uint64_t start = 0; start < size; start += kMaxRegisteredBytes) {
    auto free_slot =
        std::find(impl_->buffer_slot_used.begin(), impl_->buffer_slot_used.end(), false);
    if (free_slot == impl_->buffer_slot_used.end()) {
      release();
      return Status::error(
          fmt::format("register_buffer: all {} fixed-buffer slots are taken", kMaxBufferSlots));
    }
    *free_slot = true;
    const int slot = int(free_slot - impl_->buffer_slot_used.begin());
    slots.push_back(slot);
    std::byte* part = static_cast<std::byte*>(data) + start;
    const size_t part_size = std::min<uint64_t>(kMaxRegisteredBytes, size - start);
    for (auto& worker : impl_->workers) {
      Status status = worker->add_buffer(slot, part, part_size);
      if (!status) {
        release();
        return status.with_context("register_buffer");
      }
    }
  }
  impl_->buffer_slots[data] = std::move(slots);
  return Status::ok();
}

Status IoEngine::unregister_buffer(void* data) {
  std::lock_guard lock(impl_->buffers_mutex);
  auto found = impl_->buffer_slots.find(data);
  if (found == impl_->buffer_slots.end())
    return Status::error("unregister_buffer: buffer is not registered");
  Status result;
  for (size_t part = 0; part < found->second.size(); ++part) {
    const int slot = found->second[part];
    for (auto& worker : impl_->workers) {
      Status status =
          worker->remove_buffer(slot, static_cast<std::byte*>(data) + part * kMaxRegisteredBytes);
      if (!status && result) result = status;
    }
    impl_->buffer_slot_used[slot] = false;
  }
  impl_->buffer_slots.erase(found);
  return result;
}

IoHandle IoEngine::read(FileId file, uint64_t offset, void* buffer, uint64_t length) {
  return impl_->submit(RingOp::kRead, file, offset, static_cast<std::byte*>(buffer), length, false);
}

IoHandle IoEngine::write(FileId file, uint64_t offset, const void* buffer, uint64_t length,
                         Durability durability) {
  // The engine only reads from a write's buffer; the cast is for the shared request type.
  return impl_->submit(RingOp::kWrite, file, offset,
                       static_cast<std::byte*>(const_cast<void*>(buffer)), length,
                       durability == Durability::kSync);
}

IoHandle IoEngine::sync(FileId file) {
  if (impl_->file_record(file) == nullptr)
    return failed_handle(Status::error(fmt::format("sync: no open file {}", file)));
  auto transfer = std::make_shared<TransferState>();
  transfer->engine = impl_.get();
  transfer->file = file;
  transfer->submitted_at = std::chrono::steady_clock::now();
  transfer->touched_paths = impl_->options.paths.size() == kMaxPaths
                                ? ~uint64_t{0}
                                : (uint64_t{1} << impl_->options.paths.size()) - 1;
  transfer->sync_issued = true;
  impl_->count_transfer_started();
  impl_->enqueue_syncs(transfer);
  return IoHandle(std::move(transfer));
}

uint64_t IoEngine::alignment() const {
  return impl_->alignment;
}
const IoOptions& IoEngine::options() const {
  return impl_->options;
}
std::string IoEngine::backend_description() const {
  return impl_->backend_description;
}

IoCounters IoEngine::counters() const {
  const IoWorker::Counters& counters = impl_->counters;
  return {counters.bytes_read.load(), counters.bytes_written.load(), counters.requests.load(),
          counters.retries.load(), counters.syncs.load()};
}

std::vector<float> IoEngine::take_request_latencies_us() {
  std::vector<float> all;
  for (auto& worker : impl_->workers) {
    std::vector<float> part = worker->take_latencies_us();
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

}  // namespace strata::io
