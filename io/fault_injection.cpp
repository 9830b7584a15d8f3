#include "io/fault_injection.h"

#include <thread>

namespace strata::io {

void FaultInjector::add(const Fault& fault) {
  std::lock_guard lock(mutex_);
  faults_.push_back(fault);
}

uint64_t FaultInjector::calls(RingOp op) const {
  std::lock_guard lock(mutex_);
  return calls_[int(op)];
}

uint64_t FaultInjector::faults_injected() const {
  std::lock_guard lock(mutex_);
  return injected_;
}

std::optional<Fault> FaultInjector::on_call(RingOp op, uint64_t length, uint64_t alignment) {
  std::lock_guard lock(mutex_);
  const uint64_t call = ++calls_[int(op)];
  for (Fault& fault : faults_) {
    if (fault.op != op || fault.times == 0 || call < fault.nth_call) continue;
    if (fault.kind == FaultKind::kShortTransfer && length < 2 * alignment) continue;
    --fault.times;
    ++injected_;
    return fault;
  }
  return std::nullopt;
}

namespace {

class FaultInjectingRing final : public Ring {
 public:
  FaultInjectingRing(std::unique_ptr<Ring> inner, std::shared_ptr<FaultInjector> injector,
                     uint64_t alignment)
      : inner_(std::move(inner)), injector_(std::move(injector)), alignment_(alignment) {}

  std::string description() const override { return inner_->description() + " + faults"; }
  unsigned capacity() const override { return inner_->capacity(); }
  Status register_file(int slot, int fd) override { return inner_->register_file(slot, fd); }
  Status unregister_file(int slot) override { return inner_->unregister_file(slot); }
  Status register_buffer(int slot, void* data, size_t size) override {
    return inner_->register_buffer(slot, data, size);
  }
  Status unregister_buffer(int slot) override { return inner_->unregister_buffer(slot); }

  void prepare(const RingRequest& request) override {
    std::optional<Fault> fault = injector_->on_call(request.op, request.length, alignment_);
    if (!fault) return inner_->prepare(request);
    switch (fault->kind) {
      case FaultKind::kError:
        synthetic_.push_back({request.tag, -int64_t{fault->error_number}});
        return;
      case FaultKind::kShortTransfer: {
        RingRequest shorter = request;
        shorter.length = uint32_t(request.length / 2 / alignment_ * alignment_);
        return inner_->prepare(shorter);
      }
      case FaultKind::kStall:
        std::this_thread::sleep_for(fault->stall);
        return inner_->prepare(request);
    }
  }

  Status submit_and_wait(unsigned wait_for, std::vector<RingCompletion>& completions) override {
    Status status = inner_->submit_and_wait(synthetic_.empty() ? wait_for : 0, completions);
    completions.insert(completions.end(), synthetic_.begin(), synthetic_.end());
    synthetic_.clear();
    return status;
  }

  void wake() override { inner_->wake(); }

 private:
  std::unique_ptr<Ring> inner_;
  std::shared_ptr<FaultInjector> injector_;
  uint64_t alignment_;
  std::vector<RingCompletion> synthetic_;
};

}  // namespace

std::unique_ptr<Ring> wrap_with_faults(std::unique_ptr<Ring> ring,
                                       std::shared_ptr<FaultInjector> injector,
                                       uint64_t alignment) {
  return std::make_unique<FaultInjectingRing>(std::move(ring), std::move(injector), alignment);
}

}  // namespace strata::io
