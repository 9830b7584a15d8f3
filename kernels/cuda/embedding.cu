// Token embedding on the GPU: row lookup forward; backward by sorting the
// tokens (a stable radix sort keeps equal tokens in row order) and letting one
// block per distinct token add that token's rows in order, so the sum order is
// the CPU backend's and no atomics are needed.
#include <cub/device/device_radix_sort.cuh>

#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

// Rows of tokens in [begin, end) from weight's rows (token - begin); the others untouched.
template <typename T>
__global__ void embedding_forward_kernel(T* out,                 // (N, C)
                                         const int32_t* tokens,  // (N)
                                         const T* weight,        // (end - begin, C)
                                         int64_t N, int64_t C, int64_t begin, int64_t end) {
  const int64_t n = blockIdx.x;
  const int64_t token = tokens[n];
  if (token < begin || token >= end) return;
  const T* row = weight + (token - begin) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) out[n * C + c] = row[c];
}

__global__ void embedding_sort_input_kernel(int32_t* keys,          // (N)
                                            int32_t* rows,          // (N)
                                            const int32_t* tokens,  // (N)
                                            int64_t N) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  keys[n] = tokens[n];
  rows[n] = static_cast<int32_t>(n);
}

// blockIdx.x: a position in sorted order (only the first of each token works),
// blockIdx.y: a chunk of kThreads columns.
// Tokens in [begin, end) only, into dweight's row (token - begin).
template <typename T>
__global__ void embedding_backward_kernel(float* dweight,                // (end - begin, C), +=
                                          const T* dout,                 // (N, C)
                                          const int32_t* sorted_tokens,  // (N)
                                          const int32_t* sorted_rows,    // (N)
                                          int64_t N, int64_t C, int64_t begin, int64_t end) {
  const int64_t first = blockIdx.x;
  const int32_t token = sorted_tokens[first];
  if (first > 0 && sorted_tokens[first - 1] == token) return;
  if (token < begin || token >= end) return;
  const int64_t c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  // Added one row at a time into the running value, as the CPU backend does.
  float* into = dweight + (static_cast<int64_t>(token) - begin) * C + c;
  float sum = *into;
  for (int64_t p = first; p < N && sorted_tokens[p] == token; ++p) {
    sum += to_float(dout[static_cast<int64_t>(sorted_rows[p]) * C + c]);
  }
  *into = sum;
}

int key_bits(int64_t V) {
  int bits = 1;
  while (bits < 31 && (int64_t{1} << bits) < V) ++bits;
  return bits;
}

std::size_t align_up(std::size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// CUB's temporary storage for sorting N (token, position) pairs. CUB asks
// the current device; where there is none (a plan for a GPU made on a
// machine without one) it cannot answer, and this estimates what its
// one-sweep sort takes: a third key and value buffer, a look-back word per
// digit per tile of at least 256 items, and its per-pass bins and counters.
std::size_t sort_temp_bytes(int64_t N, int64_t V) {
  std::size_t bytes = 0;
  const cudaError_t asked = cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(N), 0,
      key_bits(V));
  if (asked == cudaSuccess) return bytes;
  cudaGetLastError();  // no device: not an error of a later call
  return 12 * static_cast<std::size_t>(N) + (std::size_t{64} << 10);
}

}  // namespace

Status embedding_forward(void* out, const int32_t* tokens, const void* weight, int64_t N, int64_t C,
                         DType type, cudaStream_t stream) {
  return embedding_forward_rows(out, tokens, weight, N, C, 0, INT32_MAX, type, stream);
}

Status embedding_forward_rows(void* out, const int32_t* tokens, const void* weight, int64_t N,
                              int64_t C, int64_t begin, int64_t end, DType type,
                              cudaStream_t stream) {
  const std::string shape = shape_text({{"N", N}, {"C", C}, {"begin", begin}, {"end", end}});
  if (N < 0 || C <= 0 || N > INT32_MAX || begin < 0 || end < begin) {
    return argument_error("embedding_forward", type, shape, "bad shape");
  }
  if (N == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    embedding_forward_kernel<T><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        static_cast<T*>(out), tokens, static_cast<const T*>(weight), N, C, begin, end);
    return check_launch("embedding_forward", type, shape);
  });
}

std::size_t embedding_backward_scratch_bytes(int64_t N, int64_t V) {
  return 4 * align_up(static_cast<std::size_t>(N) * sizeof(int32_t)) +
         align_up(sort_temp_bytes(N, V));
}

Status embedding_backward(float* dweight, const void* dout, const int32_t* tokens, int64_t N,
                          int64_t C, int64_t V, DType type, void* scratch,
                          std::size_t scratch_bytes, cudaStream_t stream) {
  return embedding_backward_rows(dweight, dout, tokens, N, C, V, 0, V, type, scratch, scratch_bytes,
                                 stream);
}

Status embedding_backward_rows(float* dweight, const void* dout, const int32_t* tokens, int64_t N,
                               int64_t C, int64_t V, int64_t begin, int64_t end, DType type,
                               void* scratch, std::size_t scratch_bytes, cudaStream_t stream) {
  const std::string shape =
      shape_text({{"N", N}, {"C", C}, {"V", V}, {"begin", begin}, {"end", end}});
  if (N < 0 || C <= 0 || V <= 0 || N > INT32_MAX || C > int64_t{kThreads} * 65535 || begin < 0 ||
      end < begin || end > V) {
    return argument_error("embedding_backward", type, shape, "bad shape");
  }
  if (N == 0) return Status::ok();
  if (scratch == nullptr || scratch_bytes < embedding_backward_scratch_bytes(N, V)) {
    return argument_error("embedding_backward", type, shape,
                          "scratch is smaller than embedding_backward_scratch_bytes");
  }
  const std::size_t ints = align_up(static_cast<std::size_t>(N) * sizeof(int32_t));
  char* base = static_cast<char*>(scratch);
  int32_t* keys = reinterpret_cast<int32_t*>(base);                    // (N)
  int32_t* rows = reinterpret_cast<int32_t*>(base + ints);             // (N)
  int32_t* sorted_keys = reinterpret_cast<int32_t*>(base + 2 * ints);  // (N)
  int32_t* sorted_rows = reinterpret_cast<int32_t*>(base + 3 * ints);  // (N)
  void* temp = base + 4 * ints;
  std::size_t temp_bytes = scratch_bytes - 4 * ints;

  embedding_sort_input_kernel<<<blocks_for(N, kThreads), kThreads, 0, stream>>>(keys, rows, tokens,
                                                                                N);
  if (Status s = check_launch("embedding_backward (sort input)", type, shape); !s) return s;
  const cudaError_t sorted =
      cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, sorted_keys, rows, sorted_rows,
                                      static_cast<int>(N), 0, key_bits(V), stream);
  if (sorted != cudaSuccess) {
    cudaGetLastError();
    return argument_error("embedding_backward (radix sort)", type, shape,
                          cudaGetErrorString(sorted));
  }
  return dispatch_type(type, [&](auto tag) {
    using T = decltype(tag);
    const dim3 grid(static_cast<unsigned>(N), blocks_for(C, kThreads));
    embedding_backward_kernel<T><<<grid, kThreads, 0, stream>>>(
        dweight, static_cast<const T*>(dout), sorted_keys, sorted_rows, N, C, begin, end);
    return check_launch("embedding_backward", type, shape);
  });
}

}  // namespace strata::kernels::cuda
