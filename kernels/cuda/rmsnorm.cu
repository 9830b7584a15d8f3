// RMSNorm on the GPU, as Hugging Face's LlamaRMSNorm: the mean square and
// 1/sqrt in fp32, the normalised row cast to the input type, then times the
// weight (rounded again). One block per row.
//
// Backward: each block takes a fixed chunk of kRowsPerChunk rows, computes dx
// row by row and keeps its chunk's share of dweight in a scratch row of its
// own; a second kernel adds the chunk rows into dweight in chunk order. The
// sums therefore do not depend on scheduling, and no atomics are used.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int64_t kRowsPerChunk = 32;

template <typename T>
__global__ void rmsnorm_forward_kernel(T* out,           // (N, C)
                                       float* rstd,      // (N)
                                       const T* inp,     // (N, C)
                                       const T* weight,  // (C)
                                       int64_t C, float eps) {
  __shared__ float reduce[32];
  const int64_t n = blockIdx.x;
  const T* x = inp + n * C;
  float sum_squares = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float value = to_float(x[c]);
    sum_squares = fmaf(value, value, sum_squares);
  }
  sum_squares = block_sum(sum_squares, reduce);
  const float r = 1.0f / sqrtf(sum_squares / static_cast<float>(C) + eps);
  if (threadIdx.x == 0) rstd[n] = r;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    out[n * C + c] = from_float<T>(to_float(weight[c]) * round_to<T>(to_float(x[c]) * r));
  }
}

template <typename T>
__global__ void rmsnorm_backward_kernel(T* dinp,            // (N, C), +=
                                        float* partial,     // (chunks, C), = per chunk
                                        const T* dout,      // (N, C)
                                        const T* inp,       // (N, C)
                                        const T* weight,    // (C)
                                        const float* rstd,  // (N)
                                        int64_t N, int64_t C) {
  __shared__ float reduce[32];
  const int64_t chunk = blockIdx.x;
  float* dweight_part = partial + chunk * C;
  const int64_t first = chunk * kRowsPerChunk;
  const int64_t last = min(first + kRowsPerChunk, N);
  for (int64_t n = first; n < last; ++n) {
    const T* x = inp + n * C;
    const T* dy = dout + n * C;
    const float r = rstd[n];
    // With xhat = x * r and y = w * xhat: dx = r * (g - xhat * mean(g * xhat)), g = dy * w.
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      dot = fmaf(to_float(dy[c]) * to_float(weight[c]), to_float(x[c]) * r, dot);
    }
    const float mean_dot = block_sum(dot, reduce) / static_cast<float>(C);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      const float dyc = to_float(dy[c]);
      const float xhat = to_float(x[c]) * r;
      const float dx = r * (dyc * to_float(weight[c]) - xhat * mean_dot);
      dinp[n * C + c] = from_float<T>(to_float(dinp[n * C + c]) + dx);
      // The weight multiplies the normalised row as rounded to T (forward).
      const float contribution = dyc * round_to<T>(xhat);
      dweight_part[c] = n == first ? contribution : dweight_part[c] + contribution;
    }
  }
}

__global__ void rmsnorm_dweight_kernel(float* dweight,        // (C), +=
                                       const float* partial,  // (chunks, C)
                                       int64_t chunks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float sum = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) sum += partial[k * C + c];
  dweight[c] += sum;
}

int64_t chunk_count(int64_t N) {
  return (N + kRowsPerChunk - 1) / kRowsPerChunk;
}

}  // namespace

Status rmsnorm_forward(void* out, float* rstd, const void* inp, const void* weight, int64_t N,
                       int64_t C, float eps, DType type, cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"C", C}});
  if (N < 0 || C <= 0 || N > INT32_MAX) {
    return argument_error("rmsnorm_forward", type, shape, "bad shape");
  }
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_forward_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        static_cast<T*>(out), rstd, static_cast<const T*>(inp), static_cast<const T*>(weight), C,
        eps);
    return check_launch("rmsnorm_forward", type, shape);
  });
}

std::size_t rmsnorm_backward_scratch_bytes(int64_t N, int64_t C) {
  return static_cast<std::size_t>(chunk_count(N) * C) * sizeof(float);
}

Status rmsnorm_backward(void* dinp, float* dweight, const void* dout, const void* inp,
                        const void* weight, const float* rstd, int64_t N, int64_t C, DType type,
                        void* scratch, std::size_t scratch_bytes, cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"C", C}});
  if (N < 0 || C <= 0) return argument_error("rmsnorm_backward", type, shape, "bad shape");
  if (N == 0) return Status::ok();
  if (scratch == nullptr || scratch_bytes < rmsnorm_backward_scratch_bytes(N, C)) {
    return argument_error("rmsnorm_backward", type, shape,
                          "scratch is smaller than rmsnorm_backward_scratch_bytes");
  }
  const int64_t chunks = chunk_count(N);
  float* partial = static_cast<float*>(scratch);  // (chunks, C)
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    rmsnorm_backward_kernel<T><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(
        static_cast<T*>(dinp), partial, static_cast<const T*>(dout), static_cast<const T*>(inp),
        static_cast<const T*>(weight), rstd, N, C);
    if (Status s = check_launch("rmsnorm_backward", type, shape); !s) return s;
    rmsnorm_dweight_kernel<<<blocks_for(C, kThreads), kThreads, 0, stream>>>(dweight, partial,
                                                                             chunks, C);
    return check_launch("rmsnorm_backward (dweight)", type, shape);
  });
}

}  // namespace strata::kernels::cuda
