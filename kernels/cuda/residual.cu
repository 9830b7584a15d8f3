// Residual add on the GPU: out = a + b elementwise, in fp32, rounded once;
// and the fp32 sums that pieces of a layer add in turn.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

template <typename T>
__global__ void residual_forward_kernel(T* out,      // (n), may alias a or b
                                        const T* a,  // (n)
                                        const T* b,  // (n)
                                        int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = from_float<T>(to_float(a[i]) + to_float(b[i]));
}

template <typename T>
__global__ void accumulate_f32_kernel(float* sum,  // (n)
                                      const T* x,  // (n)
                                      int64_t n, bool accumulate) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) sum[i] = (accumulate ? sum[i] : 0.0f) + to_float(x[i]);
}

template <typename T>
__global__ void residual_add_f32_kernel(T* out,          // (n), may alias a
                                        const T* a,      // (n)
                                        const float* b,  // (n)
                                        int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = from_float<T>(to_float(a[i]) + b[i]);
}

}  // namespace

Status accumulate_f32(float* sum, const void* x, int64_t n, bool accumulate, DType type,
                      cudaStream_t stream) {
  const std::string shape = shape_text({{"n", n}});
  if (n < 0) return argument_error("accumulate_f32", type, shape, "negative length");
  if (n == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    accumulate_f32_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
        sum, static_cast<const T*>(x), n, accumulate);
    return check_launch("accumulate_f32", type, shape);
  });
}

Status residual_add_f32(void* out, const void* a, const float* b, int64_t n, DType type,
                        cudaStream_t stream) {
  const std::string shape = shape_text({{"n", n}});
  if (n < 0) return argument_error("residual_add_f32", type, shape, "negative length");
  if (n == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    residual_add_f32_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(a), b, n);
    return check_launch("residual_add_f32", type, shape);
  });
}

Status residual_forward(void* out, const void* a, const void* b, int64_t n, DType type,
                        cudaStream_t stream) {
  const std::string shape = shape_text({{"n", n}});
  if (n < 0) return argument_error("residual_forward", type, shape, "negative length");
  if (n == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    residual_forward_kernel<T><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n);
    return check_launch("residual_forward", type, shape);
  });
}

}  // namespace strata::kernels::cuda
