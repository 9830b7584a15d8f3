// Fault injection for the I/O engine, in the spirit of LevelDB's test Env.
//
// Contract. A FaultInjector holds a list of faults, each aimed at the n-th call
// (counted from 1, over all rings of one engine) of one operation: fail it with
// an errno without touching the file, make it transfer only part of what was
// asked (a real, shorter request, so what the kernel reports is true), or stall
// it before it reaches the kernel. Set IoOptions::fault_injector and every ring
// the engine creates is wrapped, so the engine's retry and error paths run
// exactly as they would against the kernel. Thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "io/ring.h"

namespace strata::io {

enum class FaultKind {
  kError,          // completes with -error_number; nothing is transferred
  kShortTransfer,  // transfers half the request (rounded down to the alignment)
  kStall,          // waits `stall` before the request is submitted
};

struct Fault {
  RingOp op = RingOp::kRead;
  uint64_t nth_call = 1;
  FaultKind kind = FaultKind::kError;
  int error_number = 0;
  std::chrono::milliseconds stall{0};
  // How many calls in a row, starting at nth_call, get this fault.
  uint64_t times = 1;
};

class FaultInjector {
 public:
  void add(const Fault& fault);
  uint64_t calls(RingOp op) const;
  uint64_t faults_injected() const;

  // Counts a call of `op` with `length` bytes and returns the fault it gets, if
  // any. A short-transfer fault waits for a request at least two alignment
  // blocks long (a shorter one cannot be cut and stay aligned).
  std::optional<Fault> on_call(RingOp op, uint64_t length, uint64_t alignment);

 private:
  mutable std::mutex mutex_;
  std::vector<Fault> faults_;
  uint64_t calls_[3] = {0, 0, 0};
  uint64_t injected_ = 0;
};

// Wraps `ring` so that its calls consult `injector`.
std::unique_ptr<Ring> wrap_with_faults(std::unique_ptr<Ring> ring,
                                       std::shared_ptr<FaultInjector> injector, uint64_t alignment);

}  // namespace strata::io
