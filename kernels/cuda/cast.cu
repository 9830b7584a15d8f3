// Element type conversions on the GPU: widening is exact, narrowing rounds to
// nearest even (overflow to infinity for fp16), one thread per element.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

template <typename To, typename From>
__global__ void cast_kernel(To* dst,          // (n)
                            const From* src,  // (n)
                            int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = from_float<To>(to_float(src[i]));
}

}  // namespace

Status cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n,
            cudaStream_t stream) {
  const std::string shape = shape_text({{"n", n}}) + " from " + std::string(dtype_name(src_type));
  if (n < 0) return argument_error("cast", dst_type, shape, "negative length");
  if (n == 0) return Status::ok();
  return dispatch_type(dst_type, [&](auto to_tag) {
    using To = decltype(to_tag);
    return dispatch_type(src_type, [&](auto from_tag) {
      using From = decltype(from_tag);
      cast_kernel<To, From><<<blocks_for(n, kThreads), kThreads, 0, stream>>>(
          static_cast<To*>(dst), static_cast<const From*>(src), n);
      return check_launch("cast", dst_type, shape);
    });
  });
}

}  // namespace strata::kernels::cuda
