// Internal to kernels/cuda: element conversions, warp and block reductions,
// the dispatch from DType to a kernel template, and the launch check that
// turns a CUDA error into a Status naming the kernel, type and shape.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "io/base/status.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda::detail {

using bf16 = __nv_bfloat16;
using f16 = __half;

__device__ __forceinline__ float to_float(float x) {
  return x;
}
__device__ __forceinline__ float to_float(bf16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ float to_float(f16 x) {
  return __half2float(x);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ f16 from_float<f16>(float x) {
  return __float2half_rn(x);
}

// x rounded to T and back: where Hugging Face materialises a tensor in the
// compute type, the kernels round at the same point.
template <typename T>
__device__ __forceinline__ float round_to(float x) {
  return to_float(from_float<T>(x));
}

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset >>= 1)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `shared` holds 32 floats; the call synchronises twice, so it
// may be called again with the same `shared`.
__device__ __forceinline__ float block_sum(float x, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  x = warp_sum(x);
  __syncthreads();  // an earlier call may still be reading `shared`
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : 0.0f;
  return warp_sum(x);
}

// The same in float64, called once per block (`shared`, 32 doubles, is not
// reused); every thread gets the result.
__device__ __forceinline__ double block_sum_double(double x, double* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = lane < warps ? shared[lane] : 0.0;
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Calls launch(T{}) with T the element type of `type` (float, bf16 or f16).
template <typename Launch>
Status dispatch_type(DType type, Launch&& launch) {
  switch (type) {
    case DType::f32:
      return launch(float{});
    case DType::bf16:
      return launch(bf16{});
    case DType::f16:
      return launch(f16{});
  }
  return Status::error("unknown element type");
}

inline unsigned blocks_for(int64_t work, int threads) {
  return static_cast<unsigned>((work + threads - 1) / threads);
}

}  // namespace strata::kernels::cuda::detail
