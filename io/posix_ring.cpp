// Ring on pread/pwrite/fdatasync, for kernels or sandboxes without io_uring.
// Requests run synchronously inside submit_and_wait on the owning I/O thread, so
// the engine's I/O threads are the thread pool; raise threads_per_path for depth.
#include <unistd.h>

#include <cerrno>

#include "io/ring.h"

namespace strata::io {
namespace {

class PosixRing final : public Ring {
 public:
  explicit PosixRing(const RingLimits& limits) : capacity_(limits.queue_depth) {}

  std::string description() const override { return "pread/pwrite"; }
  unsigned capacity() const override { return capacity_; }
  Status register_file(int, int) override { return Status::ok(); }
  Status unregister_file(int) override { return Status::ok(); }
  Status register_buffer(int, void*, size_t) override { return Status::ok(); }
  Status unregister_buffer(int) override { return Status::ok(); }

  void prepare(const RingRequest& request) override { prepared_.push_back(request); }

  Status submit_and_wait(unsigned, std::vector<RingCompletion>& completions) override {
    for (const RingRequest& request : prepared_) {
      ssize_t result = 0;
      switch (request.op) {
        case RingOp::kRead:
          result = pread(request.fd, request.buffer, request.length, off_t(request.offset));
          break;
        case RingOp::kWrite:
          result = pwrite(request.fd, request.buffer, request.length, off_t(request.offset));
          break;
        case RingOp::kSync:
          result = fdatasync(request.fd);
          break;
      }
      completions.push_back({request.tag, result < 0 ? -int64_t{errno} : int64_t{result}});
    }
    prepared_.clear();
    return Status::ok();
  }

  void wake() override {}

 private:
  unsigned capacity_;
  std::vector<RingRequest> prepared_;
};

}  // namespace

std::unique_ptr<Ring> make_posix_ring(const RingLimits& limits) {
  return std::make_unique<PosixRing>(limits);
}

}  // namespace strata::io
