// AdamW on the GPU, device side: one thread per element, the operations of
// kernels/cpu/adamw.cpp's adamw_element written as explicit
// round-to-nearest intrinsics (__fmul_rn, __fmaf_rn, ...), which nvcc never
// contracts or reorders, so the result is bitwise the CPU kernel's. The
// compact moments follow the CPU kernel's storage rules with the same
// operations: bf16 rounded by the same bit arithmetic as float_to_bf16, int8
// codes from one CUDA block per 256-element block (its exact maxima by an
// integer max over the magnitudes' bits, which has no order to differ in).
#include <cstdint>
#include <type_traits>

#include "kernels/cuda/adamw_constants.h"
#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kThreads = 256;

struct NoCopy {};

// kernels/cpu/adamw.cpp's adamw_element: takes the gradient, master p and
// moments m, v; leaves the new m and v in place and returns the new master.
__device__ __forceinline__ float adamw_element(const AdamWConstants& c, float grad, float p,
                                               float& m, float& v) {
  float g = __fmul_rn(grad, c.grad_scale);
  if (c.decoupled) {
    p = __fmul_rn(p, c.decay);
  } else {
    g = __fmaf_rn(c.l2, p, g);
  }
  m = __fmaf_rn(c.one_minus_beta1, g, __fmul_rn(m, c.beta1));
  v = __fmaf_rn(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(v, c.beta2));
  const float denom = __fmaf_rn(__fsqrt_rn(v), c.inv_bias_correction2_sqrt, c.eps);
  return __fadd_rn(p, __fdiv_rn(__fmul_rn(c.neg_step_size, m), denom));
}

// The moments of one element as stored: fp32, or bf16 bits (Bf16Bits).
struct Bf16Bits {
  uint16_t bits;
};

__device__ __forceinline__ float moment_value(float x) {
  return x;
}
__device__ __forceinline__ float moment_value(Bf16Bits x) {
  return __uint_as_float(uint32_t{x.bits} << 16);
}

// kernels/cpu/simd.h's float_to_bf16: nearest, ties to even; every NaN 0x7fc0.
__device__ __forceinline__ uint16_t bf16_bits_of(float value) {
  const uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <typename S>
__device__ __forceinline__ S moment_of(float x) {
  if constexpr (std::is_same_v<S, float>) {
    return x;
  } else {
    return Bf16Bits{bf16_bits_of(x)};
  }
}

template <typename S, typename G, typename C>
__global__ void adamw_kernel(float* master,  // (numel)
                             S* exp_avg,     // (numel)
                             S* exp_avg_sq,  // (numel)
                             const G* grad,  // (numel)
                             C* copy,        // (numel), unused for NoCopy
                             AdamWConstants c, int64_t numel) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= numel) return;
  float m = moment_value(exp_avg[i]);
  float v = moment_value(exp_avg_sq[i]);
  const float p = adamw_element(c, to_float(grad[i]), master[i], m, v);
  exp_avg[i] = moment_of<S>(m);
  exp_avg_sq[i] = moment_of<S>(v);
  master[i] = p;
  if constexpr (!std::is_same_v<C, NoCopy>) copy[i] = from_float<C>(p);
}

// --- int8 moments: kernels/cpu/adamw.cpp's update_int8_block_scalar ----------------------

constexpr float kMCodes = 127.0f;     // m codes: [-127, 127]
constexpr float kRootCodes = 255.0f;  // sqrt(v) codes: [0, 255]
constexpr float kSmallestScale = 0x1p-100f;
constexpr float kLargestFloat = 3.40282347e38f;

// code_factor: codes / scale, 0 for a scale below 2^-100, inf or NaN.
__device__ __forceinline__ float code_factor(float scale, float codes) {
  return scale >= kSmallestScale && scale <= kLargestFloat ? __fdiv_rn(codes, scale) : 0.0f;
}

// code_of: nearest, ties to even (cvt.rni); a NaN gives code 0. t is never
// infinite (adamw.h: |t| <= codes + 1/2 or t = x * 0).
__device__ __forceinline__ int32_t code_of(float t) {
  return t == t ? __float2int_rn(t) : 0;
}

// The largest of x over the CUDA block (kInt8Block threads, 8 warps): every
// thread gets it. `shared` holds 8 values and is read after one barrier.
__device__ __forceinline__ uint32_t block_max_bits(uint32_t x, uint32_t* shared) {
  for (int offset = 16; offset > 0; offset >>= 1)
    x = max(x, __shfl_xor_sync(0xffffffffu, x, offset));
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = x;
  __syncthreads();
  x = shared[0];
  for (int w = 1; w < kInt8Block / 32; ++w) x = max(x, shared[w]);
  return x;
}

// One CUDA block per int8 block (blockIdx.x), one thread per element; the
// last block may be short.
template <typename G, typename C>
__global__ void __launch_bounds__(kInt8Block)
    adamw_blockwise_kernel(float* master,            // (numel)
                           int8_t* exp_avg,          // (numel) codes of m
                           uint8_t* exp_avg_sq,      // (numel) codes of sqrt(v)
                           float* exp_avg_scale,     // (blocks) max |m|
                           float* exp_avg_sq_scale,  // (blocks) max sqrt(v)
                           const G* grad,            // (numel)
                           C* copy,                  // (numel), unused for NoCopy
                           AdamWConstants c, int64_t numel) {
  __shared__ uint32_t m_shared[kInt8Block / 32], root_shared[kInt8Block / 32];
  const int64_t block = blockIdx.x;
  const int64_t i = block * kInt8Block + threadIdx.x;
  const bool active = i < numel;
  // Every thread reads the old scales before the barrier in block_max_bits;
  // thread 0 writes the new ones after it.
  const float m_unit = __fdiv_rn(exp_avg_scale[block], kMCodes);
  const float root_unit = __fdiv_rn(exp_avg_sq_scale[block], kRootCodes);
  float m = 0.0f, root = 0.0f;
  if (active) {
    m = __fmul_rn(static_cast<float>(exp_avg[i]), m_unit);
    root = __fmul_rn(static_cast<float>(exp_avg_sq[i]), root_unit);
    float v = __fmul_rn(root, root);
    const float p = adamw_element(c, to_float(grad[i]), master[i], m, v);
    master[i] = p;
    if constexpr (!std::is_same_v<C, NoCopy>) copy[i] = from_float<C>(p);
    root = __fsqrt_rn(v);
  }
  // Inactive threads give 0, below every magnitude (as the CPU's start value).
  const float m_scale = __uint_as_float(block_max_bits(__float_as_uint(m) & 0x7fffffffu, m_shared));
  const float root_scale =
      __uint_as_float(block_max_bits(__float_as_uint(root) & 0x7fffffffu, root_shared));
  if (threadIdx.x == 0) {
    exp_avg_scale[block] = m_scale;
    exp_avg_sq_scale[block] = root_scale;
  }
  if (!active) return;
  const float m_factor = code_factor(m_scale, kMCodes);
  const float root_factor = code_factor(root_scale, kRootCodes);
  exp_avg[i] = static_cast<int8_t>(code_of(__fmul_rn(m, m_factor)));
  int32_t root_code = code_of(__fmul_rn(root, root_factor));
  if (root > 0.0f) root_code = max(root_code, 1);  // a v > 0 never reads back as 0
  exp_avg_sq[i] = static_cast<uint8_t>(root_code);
}

}  // namespace

namespace detail {

Status adamw_launch(float* master, float* exp_avg, float* exp_avg_sq, const void* grad_data,
                    DType grad_type, void* copy, DType copy_type, int64_t numel,
                    const AdamWConstants& constants, cudaStream_t stream) {
  const std::string shape = shape_text({{"numel", numel}});
  const unsigned blocks = blocks_for(numel, kThreads);
  return dispatch_type(grad_type, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    const G* grad = static_cast<const G*>(grad_data);
    if (copy == nullptr) {
      adamw_kernel<float, G, NoCopy><<<blocks, kThreads, 0, stream>>>(
          master, exp_avg, exp_avg_sq, grad, nullptr, constants, numel);
    } else if (copy_type == DType::bf16) {
      adamw_kernel<float, G, bf16><<<blocks, kThreads, 0, stream>>>(
          master, exp_avg, exp_avg_sq, grad, static_cast<bf16*>(copy), constants, numel);
    } else {
      adamw_kernel<float, G, f16><<<blocks, kThreads, 0, stream>>>(
          master, exp_avg, exp_avg_sq, grad, static_cast<f16*>(copy), constants, numel);
    }
    return check_launch("adamw_step", grad_type, shape);
  });
}

Status adamw_bf16_launch(float* master, uint16_t* exp_avg, uint16_t* exp_avg_sq,
                         const void* grad_data, DType grad_type, void* copy, DType copy_type,
                         int64_t numel, const AdamWConstants& constants, cudaStream_t stream) {
  const std::string shape = shape_text({{"numel", numel}});
  const unsigned blocks = blocks_for(numel, kThreads);
  auto* const m = reinterpret_cast<Bf16Bits*>(exp_avg);
  auto* const v = reinterpret_cast<Bf16Bits*>(exp_avg_sq);
  return dispatch_type(grad_type, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    const G* grad = static_cast<const G*>(grad_data);
    if (copy == nullptr) {
      adamw_kernel<Bf16Bits, G, NoCopy>
          <<<blocks, kThreads, 0, stream>>>(master, m, v, grad, nullptr, constants, numel);
    } else if (copy_type == DType::bf16) {
      adamw_kernel<Bf16Bits, G, bf16><<<blocks, kThreads, 0, stream>>>(
          master, m, v, grad, static_cast<bf16*>(copy), constants, numel);
    } else {
      adamw_kernel<Bf16Bits, G, f16><<<blocks, kThreads, 0, stream>>>(
          master, m, v, grad, static_cast<f16*>(copy), constants, numel);
    }
    return check_launch("adamw_step (bf16 moments)", grad_type, shape);
  });
}

Status adamw_int8_launch(float* master, int8_t* exp_avg, uint8_t* exp_avg_sq, float* exp_avg_scale,
                         float* exp_avg_sq_scale, const void* grad_data, DType grad_type,
                         void* copy, DType copy_type, int64_t numel,
                         const AdamWConstants& constants, cudaStream_t stream) {
  const std::string shape = shape_text({{"numel", numel}});
  const unsigned blocks = blocks_for(numel, kInt8Block);
  return dispatch_type(grad_type, [&](auto grad_tag) {
    using G = decltype(grad_tag);
    const G* grad = static_cast<const G*>(grad_data);
    if (copy == nullptr) {
      adamw_blockwise_kernel<G, NoCopy>
          <<<blocks, kInt8Block, 0, stream>>>(master, exp_avg, exp_avg_sq, exp_avg_scale,
                                              exp_avg_sq_scale, grad, nullptr, constants, numel);
    } else if (copy_type == DType::bf16) {
      adamw_blockwise_kernel<G, bf16><<<blocks, kInt8Block, 0, stream>>>(
          master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, grad,
          static_cast<bf16*>(copy), constants, numel);
    } else {
      adamw_blockwise_kernel<G, f16><<<blocks, kInt8Block, 0, stream>>>(
          master, exp_avg, exp_avg_sq, exp_avg_scale, exp_avg_sq_scale, grad,
          static_cast<f16*>(copy), constants, numel);
    }
    return check_launch("adamw_step (int8 moments)", grad_type, shape);
  });
}

}  // namespace detail
}  // namespace strata::kernels::cuda
