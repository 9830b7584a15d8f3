// SwiGLU on the GPU: out = silu(gate) * up over rows [gate (I) | up (I)], in
// fp32, rounded once per output element. Elementwise, one thread per element.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

template <typename T>
__global__ void swiglu_forward_kernel(T* out,            // (N, I)
                                      const T* gate_up,  // (N, 2*I)
                                      int64_t N, int64_t I) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= N * I) return;
  const int64_t n = index / I, i = index % I;
  const float g = to_float(gate_up[n * 2 * I + i]);
  const float u = to_float(gate_up[n * 2 * I + I + i]);
  out[index] = from_float<T>(g / (1.0f + expf(-g)) * u);
}

template <typename T>
__global__ void swiglu_backward_kernel(T* dgate_up,       // (N, 2*I), =
                                       const T* dout,     // (N, I)
                                       const T* gate_up,  // (N, 2*I)
                                       int64_t N, int64_t I) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= N * I) return;
  const int64_t n = index / I, i = index % I;
  const float g = to_float(gate_up[n * 2 * I + i]);
  const float u = to_float(gate_up[n * 2 * I + I + i]);
  const float dy = to_float(dout[index]);
  const float sigmoid = 1.0f / (1.0f + expf(-g));
  const float silu = g * sigmoid;
  // d silu / dg = sigmoid * (1 + g * (1 - sigmoid)).
  dgate_up[n * 2 * I + i] = from_float<T>(dy * u * sigmoid * (1.0f + g * (1.0f - sigmoid)));
  dgate_up[n * 2 * I + I + i] = from_float<T>(dy * silu);
}

}  // namespace

Status swiglu_forward(void* out, const void* gate_up, int64_t N, int64_t I, DType type,
                      cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"I", I}});
  if (N < 0 || I <= 0) return argument_error("swiglu_forward", type, shape, "bad shape");
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<blocks_for(N * I, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(gate_up), N, I);
    return check_launch("swiglu_forward", type, shape);
  });
}

Status swiglu_backward(void* dgate_up, const void* dout, const void* gate_up, int64_t N, int64_t I,
                       DType type, cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"I", I}});
  if (N < 0 || I <= 0) return argument_error("swiglu_backward", type, shape, "bad shape");
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<blocks_for(N * I, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(dgate_up), static_cast<const T*>(dout), static_cast<const T*>(gate_up), N,
        I);
    return check_launch("swiglu_backward", type, shape);
  });
}

}  // namespace strata::kernels::cuda
