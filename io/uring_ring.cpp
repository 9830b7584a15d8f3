// Ring on io_uring: fixed files, fixed buffers, set-up flags as fio uses them.
#include <fmt/format.h>
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>

#include "io/base/status.h"
#include "io/ring.h"

namespace strata::io {
namespace {

// Tag of the eventfd read that lets wake() interrupt a wait; never a request tag.
constexpr uint64_t kWakeTag = ~uint64_t{0};

struct SetupFlag {
  unsigned flag;
  const char* name;
};

// In the order fio drops them when the kernel answers -EINVAL.
constexpr SetupFlag kDroppableFlags[] = {
    {IORING_SETUP_DEFER_TASKRUN, "deferred task run"},
    {IORING_SETUP_SINGLE_ISSUER, "single issuer"},
    {IORING_SETUP_COOP_TASKRUN, "cooperative task run"},
    {IORING_SETUP_CQSIZE, "completion queue x2"},
};

class UringRing final : public Ring {
 public:
  UringRing() = default;
  ~UringRing() override {
    if (initialized_) io_uring_queue_exit(&ring_);
    if (wake_fd_ >= 0) close(wake_fd_);
  }

  Status init(const RingLimits& limits) {
    capacity_ = limits.queue_depth;
    const unsigned entries = limits.queue_depth + 1;  // + the eventfd read
    io_uring_params params{};
    params.flags = IORING_SETUP_CQSIZE | IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER |
                   IORING_SETUP_DEFER_TASKRUN;
    params.cq_entries = 2 * entries;
    int rc = io_uring_queue_init_params(entries, &ring_, &params);
    for (const SetupFlag& droppable : kDroppableFlags) {
      if (rc != -EINVAL) break;
      const unsigned flags = params.flags & ~droppable.flag;
      params = io_uring_params{};
      params.flags = flags;
      params.cq_entries = 2 * entries;
      rc = io_uring_queue_init_params(entries, &ring_, &params);
    }
    if (rc < 0) return Status::error(fmt::format("io_uring_setup: {}", errno_text(-rc)));
    initialized_ = true;
    flags_ = params.flags;

    if ((rc = io_uring_register_files_sparse(&ring_, limits.max_files)) < 0)
      return Status::error(fmt::format("io_uring_register_files_sparse: {}", errno_text(-rc)));
    fixed_buffers_ = io_uring_register_buffers_sparse(&ring_, limits.max_buffers) == 0;
    registered_ring_fd_ = io_uring_register_ring_fd(&ring_) == 1;

    wake_fd_ = eventfd(0, EFD_CLOEXEC);
    if (wake_fd_ < 0) return Status::error(fmt::format("eventfd: {}", errno_text(errno)));
    return Status::ok();
  }

  std::string description() const override {
    std::string text = "io_uring (";
    const char* separator = "";
    for (const SetupFlag& droppable : kDroppableFlags) {
      if (flags_ & droppable.flag) {
        text += separator;
        text += droppable.name;
        separator = ", ";
      }
    }
    if (fixed_buffers_) text += fmt::format("{}fixed buffers", separator), separator = ", ";
    text += fmt::format("{}fixed files", separator);
    if (registered_ring_fd_) text += ", registered ring fd";
    return text + ")";
  }

  unsigned capacity() const override { return capacity_; }

  Status register_file(int slot, int fd) override {
    int rc = io_uring_register_files_update(&ring_, slot, &fd, 1);
    if (rc < 0)
      return Status::error(fmt::format("io_uring file registration: {}", errno_text(-rc)));
    return Status::ok();
  }
  Status unregister_file(int slot) override { return register_file(slot, -1); }

  Status register_buffer(int slot, void* data, size_t size) override {
    if (!fixed_buffers_) return Status::error("fixed buffers not supported by this kernel");
    iovec vector{data, size};
    __u64 tag = 0;
    int rc = io_uring_register_buffers_update_tag(&ring_, slot, &vector, &tag, 1);
    if (rc < 0)
      return Status::error(fmt::format("io_uring buffer registration: {}", errno_text(-rc)));
    return Status::ok();
  }
  Status unregister_buffer(int slot) override {
    if (!fixed_buffers_) return Status::ok();
    iovec empty{nullptr, 0};
    __u64 tag = 0;
    int rc = io_uring_register_buffers_update_tag(&ring_, slot, &empty, &tag, 1);
    if (rc < 0) return Status::error(fmt::format("io_uring buffer release: {}", errno_text(-rc)));
    return Status::ok();
  }

  void prepare(const RingRequest& request) override {
    io_uring_sqe* sqe = next_sqe();
    const bool fixed_file = request.file_slot >= 0;
    const int file = fixed_file ? request.file_slot : request.fd;
    const bool fixed_buffer = request.buffer_slot >= 0 && fixed_buffers_;
    switch (request.op) {
      case RingOp::kRead:
        if (fixed_buffer)
          io_uring_prep_read_fixed(sqe, file, request.buffer, request.length, request.offset,
                                   request.buffer_slot);
        else
          io_uring_prep_read(sqe, file, request.buffer, request.length, request.offset);
        break;
      case RingOp::kWrite:
        if (fixed_buffer)
          io_uring_prep_write_fixed(sqe, file, request.buffer, request.length, request.offset,
                                    request.buffer_slot);
        else
          io_uring_prep_write(sqe, file, request.buffer, request.length, request.offset);
        break;
      case RingOp::kSync:
        io_uring_prep_fsync(sqe, file, IORING_FSYNC_DATASYNC);
        break;
    }
    if (fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data64(sqe, request.tag);
  }

  Status submit_and_wait(unsigned wait_for, std::vector<RingCompletion>& completions) override {
    if (!wake_armed_) {
      io_uring_sqe* sqe = next_sqe();
      io_uring_prep_read(sqe, wake_fd_, &wake_value_, sizeof wake_value_, 0);
      io_uring_sqe_set_data64(sqe, kWakeTag);
      wake_armed_ = true;
    }
    int rc = io_uring_submit_and_wait(&ring_, wait_for);
    if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME)
      return Status::error(fmt::format("io_uring_enter: {}", errno_text(-rc)));
    io_uring_cqe* cqes[64];
    unsigned count;
    while ((count = io_uring_peek_batch_cqe(&ring_, cqes, 64)) > 0) {
      for (unsigned i = 0; i < count; ++i) {
        uint64_t tag = io_uring_cqe_get_data64(cqes[i]);
        if (tag == kWakeTag) {
          wake_armed_ = false;
        } else {
          completions.push_back({tag, cqes[i]->res});
        }
      }
      io_uring_cq_advance(&ring_, count);
    }
    return Status::ok();
  }

  void wake() override {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t written = ::write(wake_fd_, &one, sizeof one);
  }

 private:
  io_uring_sqe* next_sqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // only when the caller exceeded capacity(); submit to make room
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  io_uring ring_{};
  bool initialized_ = false;
  unsigned flags_ = 0;
  unsigned capacity_ = 0;
  bool fixed_buffers_ = false;
  bool registered_ring_fd_ = false;
  int wake_fd_ = -1;
  bool wake_armed_ = false;
  uint64_t wake_value_ = 0;
};

}  // namespace

Result<std::unique_ptr<Ring>> make_uring_ring(const RingLimits& limits) {
  auto ring = std::make_unique<UringRing>();
  Status status = ring->init(limits);
  if (!status) return status;
  return std::unique_ptr<Ring>(std::move(ring));
}

}  // namespace strata::io
