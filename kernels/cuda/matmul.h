// Matrix products of the CUDA backend, through cuBLASLt.
//
// The same products as kernels/cpu/matmul.h (row-major; a linear layer's
// weight is [out, in] and out = inp @ weight^T), on device pointers:
//  - forward:  out (N, OC) of type, = or += (accumulate), from inp and weight;
//  - backward: dinp (N, C) of type, +=; dweight (OC, C) in fp32, +=, so
//    parameter gradients accumulate in fp32 over micro-batches (core/README.md,
//    plan) while activations stay in the compute type.
// bf16 and fp16 products accumulate in fp32 (CUBLAS_COMPUTE_32F); fp32
// products use true fp32 unless allow_tf32 is set (CUBLAS_COMPUTE_32F_FAST_TF32).
//
// A Matmuls object owns one cuBLASLt handle and one workspace on the device
// that was current when it was created. The first product of each (operation,
// type, shape, accumulate, tf32, pointer alignment) builds the descriptors and asks cuBLASLt's
// heuristic for an algorithm; the choice is cached and reused, so later calls
// only enqueue the product. The cache keeps the plan_limit() most recently
// used shapes and drops the least recently used beyond them: a mixture's
// expert products see a new row count almost every step, and an unbounded
// cache would grow with the run. Calls may come from several threads (the
// cache is locked, and a plan dropped while another thread's call uses it
// lives until that call returns); a call's work runs on its `stream`, and
// products that share the workspace must be ordered (one stream, or streams
// the caller serialises).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "io/base/status.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {

class Matmuls {
 public:
  static constexpr std::size_t kDefaultWorkspaceBytes = std::size_t{32} << 20;
  // Plans kept: a dense model needs a few per layer shape; a mixture's
  // experts one per product and row count, and meet new row counts every step.
  static constexpr std::size_t kDefaultPlanLimit = 1024;

  // Creates the handle and allocates the workspace on the current device.
  static Result<std::unique_ptr<Matmuls>> create(
      std::size_t workspace_bytes = kDefaultWorkspaceBytes);
  // The same with a workspace the caller owns (device memory on the current
  // device, 256-byte aligned, outliving the Matmuls), e.g. from a budgeted pool.
  static Result<std::unique_ptr<Matmuls>> create_in(void* workspace, std::size_t workspace_bytes);
  ~Matmuls();
  Matmuls(const Matmuls&) = delete;
  Matmuls& operator=(const Matmuls&) = delete;

  // TF32 tensor cores for fp32 products (off by default: tests compare fp32 at 1e-4).
  void set_allow_tf32(bool allow) { allow_tf32_ = allow; }

  Status forward(void* out,           // (N, OC) of type, = (or += with accumulate)
                 const void* inp,     // (N, C) of type
                 const void* weight,  // (OC, C) of type
                 int64_t N, int64_t C, int64_t OC, DType type, bool accumulate,
                 cudaStream_t stream);

  Status backward(void* dinp,          // (N, C) of type, +=; null to skip
                  float* dweight,      // (OC, C) fp32, +=; null to skip
                  const void* dout,    // (N, OC) of type
                  const void* inp,     // (N, C) of type
                  const void* weight,  // (OC, C) of type
                  int64_t N, int64_t C, int64_t OC, DType type, cudaStream_t stream);

  // Product shapes whose plans are kept (at most plan_limit()).
  std::size_t cached_plans() const;
  std::size_t plan_limit() const;
  // At least 1; drops the least recently used plans beyond it.
  void set_plan_limit(std::size_t limit);

 private:
  struct Plan;  // descriptors and the chosen algorithm of one product shape
  enum class Op { forward, backward_input, backward_weight };
  // op, type, m, n, k, accumulate, tf32, alignment of the pointers (the smallest, <= 256 bytes)
  using Key = std::tuple<int, int, int64_t, int64_t, int64_t, bool, bool, uint32_t>;

  Matmuls() = default;
  // D (m, n) = alpha op(A) op(B) + beta C in cuBLAS's column-major terms.
  Status run(Op op, DType type, int64_t m, int64_t n, int64_t k, const void* a, const void* b,
             void* d, bool accumulate, cudaStream_t stream);
  Result<std::shared_ptr<const Plan>> plan_for(Op op, DType type, int64_t m, int64_t n, int64_t k,
                                               bool accumulate, uint32_t alignment);
  void drop_least_recent_locked();

  void* handle_ = nullptr;     // cublasLtHandle_t
  void* workspace_ = nullptr;  // device, workspace_bytes_
  bool owns_workspace_ = true;
  std::size_t workspace_bytes_ = 0;
  bool allow_tf32_ = false;
  mutable std::mutex mutex_;
  struct Cached {
    std::shared_ptr<const Plan> plan;
    uint64_t used = 0;  // use_clock_ at its last use
  };
  std::map<Key, Cached> plans_;
  uint64_t use_clock_ = 0;
  std::size_t plan_limit_ = kDefaultPlanLimit;
};

}  // namespace strata::kernels::cuda
