// cuBLASLt products (kernels/cuda/matmul.h). Row-major X (r, c) is
// column-major X^T (c, r) with leading dimension c, so each row-major product
// becomes one column-major product:
//   forward   out^T (OC, N)  = W (OC, C) . inp^T (C, N)      A = W^T stored, transposed
//   dinp      dinp^T (C, N) += W^T (C, OC) . dout^T (OC, N)   no transposes
//   dweight   dW^T (C, OC)  += inp^T (C, N) . dout (N, OC)    B transposed
#include "kernels/cuda/matmul.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernels/cuda/launch.h"

namespace strata::kernels::cuda {

struct Matmuls::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

namespace {

cudaDataType_t cuda_type(DType type) {
  switch (type) {
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    case DType::f32:
      break;
  }
  return CUDA_R_32F;
}

const char* op_name(int op) {
  return op == 0   ? "matmul_forward"
         : op == 1 ? "matmul_backward (dinp)"
                   : "matmul_backward (dweight)";
}

// The largest power of two (at most 256) that divides every address.
uint32_t alignment_of(std::initializer_list<const void*> pointers) {
  uint32_t alignment = 256;
  for (const void* p : pointers) {
    const auto address = reinterpret_cast<uintptr_t>(p);
    while (alignment > 1 && address % alignment != 0) alignment /= 2;
  }
  return alignment;
}

Status cublas_error(const char* name, DType type, const std::string& shape, const char* call,
                    cublasStatus_t status) {
  return detail::argument_error(name, type, shape,
                                (std::string(call) + ": " + cublasGetStatusString(status)).c_str());
}

}  // namespace

Result<std::unique_ptr<Matmuls>> Matmuls::create(std::size_t workspace_bytes) {
  std::unique_ptr<Matmuls> matmuls(new Matmuls());
  cublasLtHandle_t handle = nullptr;
  if (cublasStatus_t s = cublasLtCreate(&handle); s != CUBLAS_STATUS_SUCCESS) {
    return Status::error(std::string("cuBLASLt: cannot create a handle: ") +
                         cublasGetStatusString(s));
  }
  matmuls->handle_ = handle;
  if (workspace_bytes > 0) {
    if (cudaError_t e = cudaMalloc(&matmuls->workspace_, workspace_bytes); e != cudaSuccess) {
      cudaGetLastError();
      return Status::error("cuBLASLt: cannot allocate a " + std::to_string(workspace_bytes) +
                           "-byte workspace: " + cudaGetErrorString(e));
    }
  }
  matmuls->workspace_bytes_ = workspace_bytes;
  return matmuls;
}

Result<std::unique_ptr<Matmuls>> Matmuls::create_in(void* workspace, std::size_t workspace_bytes) {
  if (workspace == nullptr && workspace_bytes > 0)
    return Status::error("cuBLASLt: a workspace of " + std::to_string(workspace_bytes) +
                         " bytes at a null address");
  Result<std::unique_ptr<Matmuls>> matmuls = create(0);
  if (!matmuls) return matmuls;
  (*matmuls)->workspace_ = workspace;
  (*matmuls)->workspace_bytes_ = workspace_bytes;
  (*matmuls)->owns_workspace_ = false;
  return matmuls;
}

Matmuls::~Matmuls() {
  plans_.clear();
  if (workspace_ != nullptr && owns_workspace_) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

std::size_t Matmuls::cached_plans() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return plans_.size();
}

std::size_t Matmuls::plan_limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return plan_limit_;
}

void Matmuls::set_plan_limit(std::size_t limit) {
  std::lock_guard<std::mutex> lock(mutex_);
  plan_limit_ = limit < 1 ? 1 : limit;
  while (plans_.size() > plan_limit_) drop_least_recent_locked();
}

// A scan of the cache: it runs only when a new shape is planned, which costs
// a heuristic call far above it.
void Matmuls::drop_least_recent_locked() {
  auto oldest = plans_.begin();
  for (auto it = plans_.begin(); it != plans_.end(); ++it)
    if (it->second.used < oldest->second.used) oldest = it;
  if (oldest != plans_.end()) plans_.erase(oldest);
}

Result<std::shared_ptr<const Matmuls::Plan>> Matmuls::plan_for(Op op, DType type, int64_t m,
                                                               int64_t n, int64_t k,
                                                               bool accumulate,
                                                               uint32_t alignment) {
  const bool tf32 = type == DType::f32 && allow_tf32_;
  const Key key{static_cast<int>(op), static_cast<int>(type), m, n, k, accumulate, tf32, alignment};
  std::lock_guard<std::mutex> lock(mutex_);
  if (auto found = plans_.find(key); found != plans_.end()) {
    found->second.used = ++use_clock_;
    return found->second.plan;
  }

  const char* name = op_name(static_cast<int>(op));
  const std::string shape = detail::shape_text({{"m", m}, {"n", n}, {"k", k}});
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t ab_type = cuda_type(type);
  // The weight gradient accumulates in fp32 whatever the compute type.
  const cudaDataType_t d_type = op == Op::backward_weight ? CUDA_R_32F : ab_type;
  const cublasComputeType_t compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  cublasStatus_t s = cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F);
  if (s != CUBLAS_STATUS_SUCCESS) return cublas_error(name, type, shape, "MatmulDescCreate", s);
  const cublasOperation_t trans_a = op == Op::forward ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t trans_b = op == Op::backward_weight ? CUBLAS_OP_T : CUBLAS_OP_N;
  // A transpose not set would multiply the stored matrices as they are, silently.
  if ((s = cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a,
                                          sizeof trans_a)) ||
      (s = cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b,
                                          sizeof trans_b))) {
    return cublas_error(name, type, shape, "MatmulDescSetAttribute", s);
  }
  // Stored (rows, cols, ld) of A and B in column-major terms, before the transposes.
  const int64_t a_rows = trans_a == CUBLAS_OP_N ? m : k, a_cols = trans_a == CUBLAS_OP_N ? k : m;
  const int64_t b_rows = trans_b == CUBLAS_OP_N ? k : n, b_cols = trans_b == CUBLAS_OP_N ? n : k;
  if ((s = cublasLtMatrixLayoutCreate(&plan->a, ab_type, a_rows, a_cols, a_rows)) ||
      (s = cublasLtMatrixLayoutCreate(&plan->b, ab_type, b_rows, b_cols, b_rows)) ||
      (s = cublasLtMatrixLayoutCreate(&plan->c, d_type, m, n, m))) {
    return cublas_error(name, type, shape, "MatrixLayoutCreate", s);
  }
  cublasLtMatmulPreference_t preference = nullptr;
  if ((s = cublasLtMatmulPreferenceCreate(&preference))) {
    return cublas_error(name, type, shape, "MatmulPreferenceCreate", s);
  }
  s = cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                           &workspace_bytes_, sizeof workspace_bytes_);
  // The heuristic otherwise assumes 256-byte aligned pointers; tensors inside a
  // unit's flat buffer may sit at smaller alignments.
  for (const auto attribute :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    if (s == CUBLAS_STATUS_SUCCESS)
      s = cublasLtMatmulPreferenceSetAttribute(preference, attribute, &alignment, sizeof alignment);
  }
  if (s != CUBLAS_STATUS_SUCCESS) {
    cublasLtMatmulPreferenceDestroy(preference);
    return cublas_error(name, type, shape, "MatmulPreferenceSetAttribute", s);
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  s = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), plan->desc, plan->a,
                                     plan->b, plan->c, plan->c, preference, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(preference);
  if (s != CUBLAS_STATUS_SUCCESS) return cublas_error(name, type, shape, "AlgoGetHeuristic", s);
  if (found == 0) {
    return detail::argument_error(name, type, shape, "cuBLASLt has no algorithm for this product");
  }
  plan->algo = result.algo;
  while (plans_.size() >= plan_limit_) drop_least_recent_locked();
  std::shared_ptr<const Plan> kept = std::move(plan);
  plans_.emplace(key, Cached{kept, ++use_clock_});
  return kept;
}

Status Matmuls::run(Op op, DType type, int64_t m, int64_t n, int64_t k, const void* a,
                    const void* b, void* d, bool accumulate, cudaStream_t stream) {
  // Held to the end of the call: another thread may drop it from the cache meanwhile.
  Result<std::shared_ptr<const Plan>> plan =
      plan_for(op, type, m, n, k, accumulate, alignment_of({a, b, d}));
  if (!plan) return plan.status();
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  const Plan& p = **plan;
  const cublasStatus_t s =
      cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), p.desc, &alpha, a, p.a, b, p.b, &beta,
                     d, p.c, d, p.c, &p.algo, workspace_, workspace_bytes_, stream);
  if (s != CUBLAS_STATUS_SUCCESS) {
    return cublas_error(op_name(static_cast<int>(op)), type,
                        detail::shape_text({{"m", m}, {"n", n}, {"k", k}}), "cublasLtMatmul", s);
  }
  return Status::ok();
}

Status Matmuls::forward(void* out, const void* inp, const void* weight, int64_t N, int64_t C,
                        int64_t OC, DType type, bool accumulate, cudaStream_t stream) {
  if (N <= 0 || C <= 0 || OC <= 0) {
    return detail::argument_error(
        "matmul_forward", type, detail::shape_text({{"N", N}, {"C", C}, {"OC", OC}}), "bad shape");
  }
  return run(Op::forward, type, OC, N, C, weight, inp, out, accumulate, stream);
}

Status Matmuls::backward(void* dinp, float* dweight, const void* dout, const void* inp,
                         const void* weight, int64_t N, int64_t C, int64_t OC, DType type,
                         cudaStream_t stream) {
  if (N <= 0 || C <= 0 || OC <= 0) {
    return detail::argument_error(
        "matmul_backward", type, detail::shape_text({{"N", N}, {"C", C}, {"OC", OC}}), "bad shape");
  }
  if (dinp != nullptr) {
    if (Status s = run(Op::backward_input, type, C, N, OC, weight, dout, dinp, true, stream); !s)
      return s;
  }
  if (dweight != nullptr) {
    return run(Op::backward_weight, type, C, OC, N, inp, dout, dweight, true, stream);
  }
  return Status::ok();
}

}  // namespace strata::kernels::cuda
