// Squared L2 norm and inf/nan flag of a gradient on the GPU. Each block sums a
// fixed chunk of kChunk elements in float64 (every square of an fp32, bf16 or
// fp16 value is exact there) and a second, single-block kernel adds the chunk
// sums in a fixed tree, so the result depends only on the length and the data.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int64_t kChunk = kThreads * 32;

template <typename T>
__global__ void grad_norm_chunk_kernel(double* chunk_sums,    // (chunks)
                                       int32_t* chunk_flags,  // (chunks)
                                       const T* grad,         // (numel)
                                       int64_t numel) {
  __shared__ double shared[32];
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t end = min(begin + kChunk, numel);
  double sum = 0.0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const double value = to_float(grad[i]);
    sum = fma(value, value, sum);
  }
  // A NaN or inf anywhere makes the sum non-finite (squares are >= 0, so an
  // inf cannot cancel); the flag is read from the block's total.
  sum = block_sum_double(sum, shared);
  if (threadIdx.x == 0) {
    chunk_sums[blockIdx.x] = sum;
    chunk_flags[blockIdx.x] = isfinite(sum) ? 0 : 1;
  }
}

__global__ void grad_norm_total_kernel(GradNormResult* result,      // (1)
                                       const double* chunk_sums,    // (chunks)
                                       const int32_t* chunk_flags,  // (chunks)
                                       int64_t chunks) {
  __shared__ double shared[32];
  __shared__ int flag;
  if (threadIdx.x == 0) flag = 0;
  __syncthreads();
  double sum = 0.0;
  int any = 0;
  for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
    sum += chunk_sums[i];
    any |= chunk_flags[i];
  }
  if (any) flag = 1;  // benign race: every writer stores 1
  sum = block_sum_double(sum, shared);
  __syncthreads();
  if (threadIdx.x == 0) {
    result->sum_squares = sum;
    result->nonfinite = flag;
  }
}

int64_t chunk_count(int64_t numel) {
  return (numel + kChunk - 1) / kChunk;
}

}  // namespace

std::size_t grad_norm_scratch_bytes(int64_t numel) {
  return static_cast<std::size_t>(chunk_count(numel)) * (sizeof(double) + sizeof(int32_t));
}

Status grad_norm_squared(GradNormResult* result, const void* grad, DType type, int64_t numel,
                         void* scratch, std::size_t scratch_bytes, cudaStream_t stream) {
  const std::string shape = shape_text({{"numel", numel}});
  if (numel < 0 || chunk_count(numel) > INT32_MAX) {
    return argument_error("grad_norm_squared", type, shape, "bad length");
  }
  if (numel > 0 && (scratch == nullptr || scratch_bytes < grad_norm_scratch_bytes(numel))) {
    return argument_error("grad_norm_squared", type, shape,
                          "scratch is smaller than grad_norm_scratch_bytes");
  }
  const int64_t chunks = chunk_count(numel);
  double* chunk_sums = static_cast<double*>(scratch);                      // (chunks)
  int32_t* chunk_flags = reinterpret_cast<int32_t*>(chunk_sums + chunks);  // (chunks)
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    if (chunks > 0) {
      grad_norm_chunk_kernel<T><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(
          chunk_sums, chunk_flags, static_cast<const T*>(grad), numel);
      if (Status s = check_launch("grad_norm_squared", type, shape); !s) return s;
    }
    grad_norm_total_kernel<<<1, 1024, 0, stream>>>(result, chunk_sums, chunk_flags, chunks);
    return check_launch("grad_norm_squared (total)", type, shape);
  });
}

}  // namespace strata::kernels::cuda
