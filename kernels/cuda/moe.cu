// A sparse (mixture-of-experts) layer's per-token kernels on the GPU: the
// router's softmax and top k, each routed row's input, the weighted combine
// of the experts' outputs, and their backwards (ops.h). The experts' own
// products are matrix products (kernels/cuda/matmul.h) over each expert's rows.
//
// Every kernel performs the CPU backend's floating-point operations in its
// order (core/model/moe.cpp: MoeKernels::route, combine, backward): a
// token's slots in increasing order of their experts, the softmax's sum and
// the router's dot in float64 in expert order, and __fmul_rn where a product
// feeds a sum, so that nvcc contracts no multiply-add (the CPU build has
// none). fp32 results are therefore the CPU's bits except for expf's rounding
// (the router) and the order of the float64 sum behind each weight's
// gradient (a block reduction, then rounded to fp32).
//
// One thread per token where a token's work is a short serial loop over its
// experts (routing, the router's backward), one thread per expert for the
// probability sums, one block per token or per slot where the work spans a
// row of C. No atomics: the results are the same bits on every run.
#include <algorithm>
#include <string>

#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;
static_assert(kThreads >= kMoeMaxTopK, "one thread per slot orders a token's slots");

// --- routing ----------------------------------------------------------------------

// Whether expert e is among the first k picks.
__device__ __forceinline__ bool already_chosen(const int32_t* chosen, int64_t k, int64_t e) {
  for (int64_t j = 0; j < k; ++j) {
    if (chosen[j] == e) return true;
  }
  return false;
}

template <typename T>
__global__ void moe_route_kernel(float* probs,         // (N, E), =
                                 int32_t* top_expert,  // (N, K), =
                                 float* top_weight,    // (N, K), =
                                 const T* logits,      // (N, E)
                                 int64_t N, int64_t E, int64_t K, bool norm_topk_prob) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const T* logit = logits + n * E;
  float* p = probs + n * E;
  float top = to_float(logit[0]);
  for (int64_t e = 1; e < E; ++e) {
    const float x = to_float(logit[e]);
    if (top < x) top = x;  // std::max_element's comparison
  }
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) {
    p[e] = expf(to_float(logit[e]) - top);
    sum += p[e];
  }
  for (int64_t e = 0; e < E; ++e) p[e] = static_cast<float>(p[e] / sum);

  int32_t chosen[kMoeMaxTopK];
  float weight[kMoeMaxTopK];
  for (int64_t k = 0; k < K; ++k) {  // the k-th largest of the ones not chosen yet
    int64_t best = -1;
    float best_p = 0.0f;
    for (int64_t e = 0; e < E; ++e) {
      // The CPU's test (not chosen, and the first or strictly larger: ties
      // to the lower index), its cheap half first.
      if (best >= 0 && !(p[e] > best_p)) continue;
      if (already_chosen(chosen, k, e)) continue;
      best = e;
      best_p = p[e];
    }
    chosen[k] = static_cast<int32_t>(best);
    weight[k] = best_p;
  }
  if (norm_topk_prob) {
    float total = 0.0f;
    for (int64_t k = 0; k < K; ++k) total += weight[k];
    for (int64_t k = 0; k < K; ++k) weight[k] /= total;
  }
  for (int64_t k = 0; k < K; ++k) {
    top_expert[n * K + k] = chosen[k];
    top_weight[n * K + k] = weight[k];
  }
}

__global__ void moe_prob_sums_kernel(double* sums,        // (E), =
                                     const float* probs,  // (N, E)
                                     int64_t N, int64_t E) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  double sum = 0.0;
  for (int64_t n = 0; n < N; ++n) sum += probs[n * E + e];
  sums[e] = sum;
}

// --- the rows around the experts ----------------------------------------------------

template <typename T>
__global__ void moe_gather_rows_kernel(T* rows,                   // (R, C), =
                                       const T* x,                // (N, C)
                                       const int32_t* row_token,  // (R)
                                       int64_t R, int64_t C) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= R * C) return;
  const int64_t r = index / C, i = index % C;
  rows[index] = x[static_cast<int64_t>(row_token[r]) * C + i];
}

// Token n's slots in increasing order of their experts (equal experts, which
// routing never gives, in slot order): slot k goes to the position that counts
// the slots before it in that order. Fills rows (and weights, unless null) in
// shared memory for the whole block.
__device__ __forceinline__ void slots_by_expert(int64_t* rows,              // (K), =
                                                float* weights,             // (K), =, or null
                                                int32_t* experts,           // (K), =
                                                const int32_t* top_expert,  // (K): token n's
                                                const int32_t* row_of,      // (K): token n's
                                                const float* top_weight,    // (K): token n's
                                                int64_t K) {
  if (threadIdx.x < K) {
    const int64_t k = threadIdx.x;
    const int32_t expert = top_expert[k];
    int64_t position = 0;
    for (int64_t j = 0; j < K; ++j) {
      if (top_expert[j] < expert || (top_expert[j] == expert && j < k)) ++position;
    }
    rows[position] = row_of[k];
    experts[position] = expert;
    if (weights != nullptr) weights[position] = top_weight[k];
  }
  __syncthreads();
}

// The slots of experts [first, end) only (every slot: 0 and INT32_MAX);
// their sum starts from `sum` (fp32, or 0 when null) and is written back
// there, and with `out`, out = x2 + that sum, one rounding.
template <typename T>
__global__ void moe_combine_kernel(T* out,                     // (N, C), =, or null
                                   float* sum,                 // (N, C), +=, or null
                                   const T* x2,                // (N, C)
                                   const T* y,                 // (R, C)
                                   const int32_t* top_expert,  // (N, K)
                                   const int32_t* row_of,      // (N, K)
                                   const float* top_weight,    // (N, K)
                                   int64_t C, int64_t K, int32_t first, int32_t end) {
  __shared__ int64_t rows[kMoeMaxTopK];
  __shared__ float weights[kMoeMaxTopK];
  __shared__ int32_t experts[kMoeMaxTopK];
  const int64_t n = blockIdx.x;
  slots_by_expert(rows, weights, experts, top_expert + n * K, row_of + n * K, top_weight + n * K,
                  K);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    float total = sum != nullptr ? sum[n * C + i] : 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      if (experts[j] >= first && experts[j] < end)
        total += __fmul_rn(weights[j], to_float(y[rows[j] * C + i]));
    }
    if (sum != nullptr) sum[n * C + i] = total;
    if (out != nullptr) out[n * C + i] = from_float<T>(to_float(x2[n * C + i]) + total);
  }
}

// The slots of experts [first, end) only; their sum starts from `sum` when
// `accumulate` (else 0) and is written back there (when not null), and
// rounded into dx (when not null).
template <typename T>
__global__ void moe_sum_rows_kernel(T* dx,                      // (N, C), =, or null
                                    float* sum,                 // (N, C), = or +=, or null
                                    bool accumulate,            //
                                    const T* d_rows,            // (R, C)
                                    const int32_t* top_expert,  // (N, K)
                                    const int32_t* row_of,      // (N, K)
                                    int64_t C, int64_t K, int32_t first, int32_t end) {
  __shared__ int64_t rows[kMoeMaxTopK];
  __shared__ int32_t experts[kMoeMaxTopK];
  const int64_t n = blockIdx.x;
  slots_by_expert(rows, nullptr, experts, top_expert + n * K, row_of + n * K, nullptr, K);
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    float total = sum != nullptr && accumulate ? sum[n * C + i] : 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      if (experts[j] >= first && experts[j] < end) total += to_float(d_rows[rows[j] * C + i]);
    }
    if (sum != nullptr) sum[n * C + i] = total;
    if (dx != nullptr) dx[n * C + i] = from_float<T>(total);
  }
}

// --- backward of the weights and the router -------------------------------------------

// One block per slot (n, k). Each element of the slot's row is read and then
// overwritten by the one thread that owns it, and no other slot shares the
// row, so the gradient may replace the output in place.
// With top_expert, only the slots of experts [first, end): the others' blocks
// return at once, every thread alike.
template <typename T>
__global__ void moe_weight_backward_kernel(float* d_top_weight,        // (N, K), =
                                           T* y,                       // (R, C): in, then =
                                           const T* dout,              // (N, C)
                                           const int32_t* top_expert,  // (N, K), or null
                                           const int32_t* row_of,      // (N, K)
                                           const float* top_weight,    // (N, K)
                                           int64_t C, int64_t K, int32_t first, int32_t end) {
  __shared__ double reduce[32];
  const int64_t slot = blockIdx.x, n = slot / K;
  if (top_expert != nullptr && (top_expert[slot] < first || top_expert[slot] >= end)) return;
  T* row = y + static_cast<int64_t>(row_of[slot]) * C;
  const T* dy = dout + n * C;
  const float weight = top_weight[slot];
  double dot = 0.0;
  for (int64_t i = threadIdx.x; i < C; i += blockDim.x) {
    const float grad = to_float(dy[i]);
    dot += static_cast<double>(grad) * to_float(row[i]);  // exact in float64
    row[i] = from_float<T>(weight * grad);
  }
  dot = block_sum_double(dot, reduce);
  if (threadIdx.x == 0) d_top_weight[slot] = static_cast<float>(dot);
}

// d p_e of one token: the load-balancing loss's share, then the share of
// every slot that chose e, in slot order, as the CPU adds them into its row.
__device__ __forceinline__ float router_prob_grad(int64_t e, const float* aux_grad,  // (E)
                                                  const int32_t* chosen,             // (K)
                                                  const float* slot_grad,            // (K)
                                                  int64_t K) {
  float grad = aux_grad != nullptr ? aux_grad[e] : 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    if (chosen[k] == e) grad += slot_grad[k];
  }
  return grad;
}

template <typename T>
__global__ void moe_router_backward_kernel(T* d_logits,                // (N, E), =
                                           const float* probs,         // (N, E)
                                           const int32_t* top_expert,  // (N, K)
                                           const float* top_weight,    // (N, K)
                                           const float* d_top_weight,  // (N, K)
                                           const float* aux_grad,      // (E), or null
                                           int64_t N, int64_t E, int64_t K, bool norm_topk_prob) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const float* p = probs + n * E;
  const int32_t* chosen = top_expert + n * K;
  const float* weight = top_weight + n * K;
  const float* dw = d_top_weight + n * K;
  // Each slot's addition to d p[chosen[k]]; no (N, E) scratch holds d p.
  float slot_grad[kMoeMaxTopK];
  if (norm_topk_prob) {  // weight_k = p_k / S: d p_k = (dw_k - sum_j dw_j weight_j) / S
    float total = 0.0f, dot = 0.0f;
    for (int64_t k = 0; k < K; ++k) {
      total += p[chosen[k]];
      dot += __fmul_rn(dw[k], weight[k]);
    }
    for (int64_t k = 0; k < K; ++k) slot_grad[k] = (dw[k] - dot) / total;
  } else {
    for (int64_t k = 0; k < K; ++k) slot_grad[k] = dw[k];
  }
  double dot = 0.0;  // p . d p; each product exact in float64
  for (int64_t e = 0; e < E; ++e) {
    dot += static_cast<double>(p[e]) * router_prob_grad(e, aux_grad, chosen, slot_grad, K);
  }
  const float p_dot_dp = static_cast<float>(dot);
  for (int64_t e = 0; e < E; ++e) {
    const float dp = router_prob_grad(e, aux_grad, chosen, slot_grad, K);
    d_logits[n * E + e] = from_float<T>(p[e] * (dp - p_dot_dp));
  }
}

// --- argument checks --------------------------------------------------------------------

// OK when 1 <= K <= limit, else the refusal naming the bound.
Status check_top_k(const char* kernel, DType type, const std::string& shape, int64_t K,
                   int64_t limit) {
  if (K >= 1 && K <= limit) return Status::ok();
  const std::string what =
      "K outside [1, " + std::to_string(limit) +
      "] (at least 1, at most E and kMoeMaxTopK = " + std::to_string(kMoeMaxTopK) + ")";
  return argument_error(kernel, type, shape, what.c_str());
}

}  // namespace

Status moe_route(float* probs, int32_t* top_expert, float* top_weight, const void* logits,
                 int64_t N, int64_t E, int64_t K, bool norm_topk_prob, DType type,
                 cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"E", E}, {"K", K}});
  if (N < 0 || E <= 0) return argument_error("moe_route", type, shape, "bad shape");
  if (Status status = check_top_k("moe_route", type, shape, K, std::min(E, kMoeMaxTopK));
      !status.is_ok()) {
    return status;
  }
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    moe_route_kernel<T><<<blocks_for(N, kThreads), kThreads, 0, stream>>>(
        probs, top_expert, top_weight, static_cast<const T*>(logits), N, E, K, norm_topk_prob);
    return check_launch("moe_route", type, shape);
  });
}

Status moe_prob_sums(double* sums, const float* probs, int64_t N, int64_t E, cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"E", E}});
  if (N < 0 || E <= 0) return argument_error("moe_prob_sums", DType::f32, shape, "bad shape");
  // No early return for N == 0: the sums are then zeros, and still written.
  moe_prob_sums_kernel<<<blocks_for(E, kThreads), kThreads, 0, stream>>>(sums, probs, N, E);
  return check_launch("moe_prob_sums", DType::f32, shape);
}

Status moe_gather_rows(void* rows, const void* x, const int32_t* row_token, int64_t R, int64_t N,
                       int64_t C, DType type, cudaStream_t stream) {
  const std::string shape = shape_text({{"R", R}, {"N", N}, {"C", C}});
  if (R < 0 || N < 0 || C <= 0 || (R > 0 && N == 0)) {
    return argument_error("moe_gather_rows", type, shape, "bad shape");
  }
  if (R == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    moe_gather_rows_kernel<T><<<blocks_for(R * C, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(rows), static_cast<const T*>(x), row_token, R, C);
    return check_launch("moe_gather_rows", type, shape);
  });
}

// The launches of the combine, the weights' backward and the rows' sum,
// whole or over a group of experts.
namespace {

// The shape of a launch of one block per token (or per slot) over experts [first, end).
Status check_token_blocks(const char* kernel, DType type, const std::string& shape, int64_t N,
                          int64_t C, int64_t K, int64_t first, int64_t end) {
  if (N < 0 || C <= 0 || N > INT32_MAX || first < 0 || end < first || end > INT32_MAX) {
    return argument_error(kernel, type, shape, "bad shape");
  }
  return check_top_k(kernel, type, shape, K, kMoeMaxTopK);
}

Status combine(const char* kernel, void* out, float* sum, const void* x2, const void* y,
               const int32_t* top_expert, const int32_t* row_of, const float* top_weight,
               int64_t first, int64_t end, int64_t N, int64_t C, int64_t K, DType type,
               cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"C", C}, {"K", K}});
  if (Status status = check_token_blocks(kernel, type, shape, N, C, K, first, end);
      !status.is_ok()) {
    return status;
  }
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    moe_combine_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        static_cast<T*>(out), sum, static_cast<const T*>(x2), static_cast<const T*>(y), top_expert,
        row_of, top_weight, C, K, static_cast<int32_t>(first), static_cast<int32_t>(end));
    return check_launch(kernel, type, shape);
  });
}

Status weight_backward(const char* kernel, float* d_top_weight, void* y, const void* dout,
                       const int32_t* top_expert, const int32_t* row_of, const float* top_weight,
                       int64_t first, int64_t end, int64_t N, int64_t C, int64_t K, DType type,
                       cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"C", C}, {"K", K}});
  if (Status status = check_token_blocks(kernel, type, shape, N, C, K, first, end);
      !status.is_ok()) {
    return status;
  }
  // One block per slot.
  if (N > INT32_MAX / K) return argument_error(kernel, type, shape, "bad shape");
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    moe_weight_backward_kernel<T><<<static_cast<unsigned>(N * K), kThreads, 0, stream>>>(
        d_top_weight, static_cast<T*>(y), static_cast<const T*>(dout), top_expert, row_of,
        top_weight, C, K, static_cast<int32_t>(first), static_cast<int32_t>(end));
    return check_launch(kernel, type, shape);
  });
}

Status sum_rows(const char* kernel, void* dx, float* sum, bool accumulate, const void* d_rows,
                const int32_t* top_expert, const int32_t* row_of, int64_t first, int64_t end,
                int64_t N, int64_t C, int64_t K, DType type, cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"C", C}, {"K", K}});
  if (Status status = check_token_blocks(kernel, type, shape, N, C, K, first, end);
      !status.is_ok()) {
    return status;
  }
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    moe_sum_rows_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        static_cast<T*>(dx), sum, accumulate, static_cast<const T*>(d_rows), top_expert, row_of, C,
        K, static_cast<int32_t>(first), static_cast<int32_t>(end));
    return check_launch(kernel, type, shape);
  });
}

constexpr int64_t kEveryExpert = INT32_MAX;

}  // namespace

Status moe_combine(void* out, const void* x2, const void* y, const int32_t* top_expert,
                   const int32_t* row_of, const float* top_weight, int64_t N, int64_t C, int64_t K,
                   DType type, cudaStream_t stream) {
  return combine("moe_combine", out, nullptr, x2, y, top_expert, row_of, top_weight, 0,
                 kEveryExpert, N, C, K, type, stream);
}

Status moe_combine_experts(float* sum, void* out, const void* x2, const void* y,
                           const int32_t* top_expert, const int32_t* row_of,
                           const float* top_weight, int64_t first, int64_t end, int64_t N,
                           int64_t C, int64_t K, DType type, cudaStream_t stream) {
  if (sum == nullptr) {
    return argument_error("moe_combine_experts", type, shape_text({{"N", N}, {"C", C}}), "no sum");
  }
  if (out != nullptr && x2 == nullptr) {
    return argument_error("moe_combine_experts", type, shape_text({{"N", N}, {"C", C}}),
                          "an output without x2");
  }
  return combine("moe_combine_experts", out, sum, x2, y, top_expert, row_of, top_weight, first, end,
                 N, C, K, type, stream);
}

Status moe_weight_backward(float* d_top_weight, void* y, const void* dout, const int32_t* row_of,
                           const float* top_weight, int64_t N, int64_t C, int64_t K, DType type,
                           cudaStream_t stream) {
  return weight_backward("moe_weight_backward", d_top_weight, y, dout, nullptr, row_of, top_weight,
                         0, kEveryExpert, N, C, K, type, stream);
}

Status moe_weight_backward_experts(float* d_top_weight, void* y, const void* dout,
                                   const int32_t* top_expert, const int32_t* row_of,
                                   const float* top_weight, int64_t first, int64_t end, int64_t N,
                                   int64_t C, int64_t K, DType type, cudaStream_t stream) {
  if (top_expert == nullptr) {
    return argument_error("moe_weight_backward_experts", type, shape_text({{"N", N}, {"C", C}}),
                          "no experts");
  }
  return weight_backward("moe_weight_backward_experts", d_top_weight, y, dout, top_expert, row_of,
                         top_weight, first, end, N, C, K, type, stream);
}

Status moe_router_backward(void* d_logits, const float* probs, const int32_t* top_expert,
                           const float* top_weight, const float* d_top_weight,
                           const float* aux_grad, int64_t N, int64_t E, int64_t K,
                           bool norm_topk_prob, DType type, cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"E", E}, {"K", K}});
  if (N < 0 || E <= 0) return argument_error("moe_router_backward", type, shape, "bad shape");
  if (Status status = check_top_k("moe_router_backward", type, shape, K, std::min(E, kMoeMaxTopK));
      !status.is_ok()) {
    return status;
  }
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    moe_router_backward_kernel<T><<<blocks_for(N, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(d_logits), probs, top_expert, top_weight, d_top_weight, aux_grad, N, E, K,
        norm_topk_prob);
    return check_launch("moe_router_backward", type, shape);
  });
}

Status moe_sum_rows(void* dx, const void* d_rows, const int32_t* top_expert, const int32_t* row_of,
                    int64_t N, int64_t C, int64_t K, DType type, cudaStream_t stream) {
  return sum_rows("moe_sum_rows", dx, nullptr, false, d_rows, top_expert, row_of, 0, kEveryExpert,
                  N, C, K, type, stream);
}

Status moe_add_rows(float* sum, bool accumulate, const void* d_rows, const int32_t* top_expert,
                    const int32_t* row_of, int64_t first, int64_t end, int64_t N, int64_t C,
                    int64_t K, DType type, cudaStream_t stream) {
  if (sum == nullptr) {
    return argument_error("moe_add_rows", type, shape_text({{"N", N}, {"C", C}}), "no sum");
  }
  return sum_rows("moe_add_rows", nullptr, sum, accumulate, d_rows, top_expert, row_of, first, end,
                  N, C, K, type, stream);
}

}  // namespace strata::kernels::cuda
