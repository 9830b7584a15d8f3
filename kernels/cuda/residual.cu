// Residual add on the GPU: out = a + b elementwise, in fp32, rounded once.
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

}  // namespace

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
