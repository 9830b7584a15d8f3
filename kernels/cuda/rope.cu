// Rotary position embeddings on the GPU (rotate_half convention, as
// kernels/cpu/rope.h): one thread per rotated pair (x_i, x_{i+D/2}), in fp32
// with the fp32 cos/sin tables, rounded once.
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

// direction +1: forward rotation; -1: its transpose (the backward).
template <typename E>
__global__ void rope_kernel(E* x,              // (B*T, row_stride), heads*D used
                            const float* cos,  // (T, D/2)
                            const float* sin,  // (T, D/2)
                            int64_t rows, int64_t T, int64_t heads, int64_t D, int64_t row_stride,
                            float direction) {
  const int64_t half = D / 2;
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= rows * heads * half) return;
  const int64_t i = index % half;
  const int64_t head = (index / half) % heads;
  const int64_t n = index / (half * heads);
  const int64_t t = n % T;
  const float c = cos[t * half + i];
  const float s = direction * sin[t * half + i];
  E* pair = x + n * row_stride + head * D + i;
  const float x1 = to_float(pair[0]);
  const float x2 = to_float(pair[half]);
  // x * cos + rotate_half(x) * sin, with rotate_half(x) = (-x2, x1).
  pair[0] = from_float<E>(x1 * c - x2 * s);
  pair[half] = from_float<E>(x2 * c + x1 * s);
}

Status rope_apply(const char* name, void* x, const float* cos, const float* sin, int64_t B,
                  int64_t T, int64_t heads, int64_t D, int64_t row_stride, DType type,
                  float direction, cudaStream_t stream) {
  const std::string shape =
      shape_text({{"B", B}, {"T", T}, {"heads", heads}, {"D", D}, {"row_stride", row_stride}});
  if (B < 0 || T < 0 || heads <= 0 || D <= 0 || D % 2 != 0 || row_stride < heads * D) {
    return argument_error(name, type, shape, "bad shape (D must be even, row_stride >= heads*D)");
  }
  const int64_t work = B * T * heads * (D / 2);
  if (work == 0) return Status::ok();
  return dispatch_type(type, [&](auto tag) {
    using E = decltype(tag);
    rope_kernel<E><<<blocks_for(work, kThreads), kThreads, 0, stream>>>(
        static_cast<E*>(x), cos, sin, B * T, T, heads, D, row_stride, direction);
    return check_launch(name, type, shape);
  });
}

}  // namespace

Status rope_forward(void* x, const float* cos, const float* sin, int64_t B, int64_t T,
                    int64_t heads, int64_t D, int64_t row_stride, DType type, cudaStream_t stream) {
  return rope_apply("rope_forward", x, cos, sin, B, T, heads, D, row_stride, type, 1.0f, stream);
}

Status rope_backward(void* dx, const float* cos, const float* sin, int64_t B, int64_t T,
                     int64_t heads, int64_t D, int64_t row_stride, DType type,
                     cudaStream_t stream) {
  return rope_apply("rope_backward", dx, cos, sin, B, T, heads, D, row_stride, type, -1.0f, stream);
}

}  // namespace strata::kernels::cuda
