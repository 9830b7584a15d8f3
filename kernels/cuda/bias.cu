// The bias of a linear layer on the GPU (Qwen2's q, k and v): added to every
// row after the product, and its gradient the column sums of the output's
// gradient. The forward adds in fp32 and rounds once per element. The
// backward gives each block 32 columns; its 8 row groups sum rows
// y, y + 8, ... in order and are added in a fixed order, so the result does
// not depend on scheduling (no atomics).
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kColumns = 32;   // columns per block of the backward
constexpr int kRowGroups = 8;  // row groups per block of the backward

template <typename T>
__global__ void bias_forward_kernel(T* out,         // (N, OC), +=
                                    const T* bias,  // (OC)
                                    int64_t N, int64_t OC) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= N * OC) return;
  out[index] = from_float<T>(to_float(out[index]) + to_float(bias[index % OC]));
}

template <typename T>
__global__ void bias_backward_kernel(float* dbias,   // (OC), +=
                                     const T* dout,  // (N, OC)
                                     int64_t N, int64_t OC) {
  __shared__ float partial[kRowGroups][kColumns];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x;
  float sum = 0.0f;
  if (c < OC) {
    for (int64_t n = threadIdx.y; n < N; n += kRowGroups) sum += to_float(dout[n * OC + c]);
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && c < OC) {
    float total = 0.0f;
    for (int g = 0; g < kRowGroups; ++g) total += partial[g][threadIdx.x];
    dbias[c] += total;
  }
}

}  // namespace

Status bias_forward(void* out, const void* bias, int64_t N, int64_t OC, DType type,
                    cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"OC", OC}});
  if (N < 0 || OC <= 0) return argument_error("bias_forward", type, shape, "bad shape");
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    bias_forward_kernel<T><<<blocks_for(N * OC, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(bias), N, OC);
    return check_launch("bias_forward", type, shape);
  });
}

Status bias_backward(float* dbias, const void* dout, int64_t N, int64_t OC, DType type,
                     cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"OC", OC}});
  if (N < 0 || OC <= 0) return argument_error("bias_backward", type, shape, "bad shape");
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    const dim3 threads(kColumns, kRowGroups);
    bias_backward_kernel<T><<<blocks_for(OC, kColumns), threads, 0, stream>>>(
        dbias, static_cast<const T*>(dout), N, OC);
    return check_launch("bias_backward", type, shape);
  });
}

}  // namespace strata::kernels::cuda
