// Fused softmax cross-entropy on the GPU, one block per row of logits. Pass 1
// keeps a running (max, sum of exponentials) per thread and merges them across
// the block (an online softmax: the row is read once); the loss is
// logsumexp - logit[target]. Pass 2, when a gradient is wanted, writes
// dloss * (softmax - onehot) over the logits. Logits are upcast to fp32 as in
// Hugging Face's loss.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 512;

// Merges (max, sum) pairs: sum is relative to max.
__device__ __forceinline__ void merge(float& max, float& sum, float other_max, float other_sum) {
  const float merged = fmaxf(max, other_max);
  if (merged == -INFINITY) return;  // both empty
  sum = sum * expf(max - merged) + other_sum * expf(other_max - merged);
  max = merged;
}

template <typename T>
__global__ void cross_entropy_kernel(float* losses,           // (N), or null
                                     T* dlogits,              // (N, V), or null; may alias logits
                                     const T* logits,         // (N, V)
                                     const int32_t* targets,  // (N)
                                     float dloss, int64_t V) {
  __shared__ float shared_max[32], shared_sum[32];
  __shared__ float target_logit;
  const int64_t n = blockIdx.x;
  const T* row = logits + n * V;
  const int32_t target = targets[n];
  if (threadIdx.x == 0) target_logit = target >= 0 ? to_float(row[target]) : 0.0f;

  float max = -INFINITY, sum = 0.0f;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    const float x = to_float(row[i]);
    if (x > max) {
      sum = sum * expf(max - x) + 1.0f;
      max = x;
    } else {
      sum += expf(x - max);
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other_max = __shfl_xor_sync(0xffffffffu, max, offset);
    const float other_sum = __shfl_xor_sync(0xffffffffu, sum, offset);
    merge(max, sum, other_max, other_sum);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) {
    shared_max[warp] = max;
    shared_sum[warp] = sum;
  }
  __syncthreads();  // also publishes target_logit before the row may be overwritten
  max = -INFINITY;
  sum = 0.0f;
  for (int w = 0; w < warps; ++w) merge(max, sum, shared_max[w], shared_sum[w]);
  const float lse = max + logf(sum);
  if (losses != nullptr && threadIdx.x == 0) losses[n] = target >= 0 ? lse - target_logit : 0.0f;
  if (dlogits == nullptr) return;
  T* drow = dlogits + n * V;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    float grad = 0.0f;
    if (target >= 0) grad = dloss * (expf(to_float(row[i]) - lse) - (i == target ? 1.0f : 0.0f));
    drow[i] = from_float<T>(grad);
  }
}

Status cross_entropy_launch(const char* name, float* losses, void* dlogits, const void* logits,
                            const int32_t* targets, float dloss, int64_t N, int64_t V, DType type,
                            cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"V", V}});
  if (N < 0 || V <= 0 || N > INT32_MAX) return argument_error(name, type, shape, "bad shape");
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    cross_entropy_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        losses, static_cast<T*>(dlogits), static_cast<const T*>(logits), targets, dloss, V);
    return check_launch(name, type, shape);
  });
}

}  // namespace

Status cross_entropy_forward(float* losses, const void* logits, const int32_t* targets, int64_t N,
                             int64_t V, DType type, cudaStream_t stream) {
  return cross_entropy_launch("cross_entropy_forward", losses, nullptr, logits, targets, 0.0f, N, V,
                              type, stream);
}

Status cross_entropy_forward_backward(float* losses, void* dlogits, const void* logits,
                                      const int32_t* targets, float dloss, int64_t N, int64_t V,
                                      DType type, cudaStream_t stream) {
  return cross_entropy_launch("cross_entropy_forward_backward", losses, dlogits, logits, targets,
                              dloss, N, V, type, stream);
}

}  // namespace strata::kernels::cuda
