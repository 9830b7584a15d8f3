// AdamW on the GPU, for runs that keep the optimizer state on the device.
//
// The same step as kernels/cpu/adamw.h, element for element: the constants are
// rounded once from float64 on the host exactly as the CPU kernel rounds them,
// and the kernel performs the same IEEE fp32 operations in the same order
// (explicit round-to-nearest multiplies, adds, fused multiply-adds, square
// root and division; nvcc may not contract them), so a GPU step is bitwise
// equal to the CPU step on the same inputs. Gradient fp32, bf16 or fp16; the
// compute-precision copy (bf16 or fp16) is written in the same pass.
//
// Compact moments (AdamWDeviceStateShard): bf16 or blockwise int8 m and v,
// stored exactly as kernels/cpu/adamw.h states (the same codes, scales,
// rounding and block layout: blocks of 256 counted from the shard's first
// element, their scales in device memory), read and written in that form in
// the same pass. The operations are the CPU kernel's too (int8: the block's
// maxima as an integer max over magnitude bits, which no order changes), so
// a GPU step on compact moments is bitwise the CPU step on the same inputs:
// master, copy, codes and scales. Its error against a float64 step of the
// same formats is therefore the CPU kernel's, stated and checked in
// tests/adamw_compact_test.cpp (bf16: half a bf16 ulp plus fp32 slop; int8:
// half a code step plus fp32 slop, a code at most 1 from the float64
// encoding and only next to a rounding tie; master within 1e-6 relative).
// What could break the equality, and is excluded: multiply-add contraction
// (every operation is an explicit _rn intrinsic, which nvcc never fuses) and
// flushing subnormals (strata builds without -ftz / --use_fast_math). The
// compute copy is rounded by the CUDA conversion intrinsics, as for fp32
// moments: equal for every number; a NaN master's copy may carry another NaN
// bit pattern than the CPU's.
//
// Asynchronous on `stream`; every pointer is device memory; arrays of one call
// must not overlap.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "io/base/status.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cuda/ops.h"

namespace strata::kernels::cuda {

struct AdamWDeviceShard {
  int64_t numel = 0;
  float* master = nullptr;      // (numel) fp32 master weights, updated in place
  float* exp_avg = nullptr;     // (numel) first moment m, updated in place
  float* exp_avg_sq = nullptr;  // (numel) second moment v, updated in place
  const void* grad = nullptr;   // (numel) of grad_type
  DType grad_type = DType::f32;
  void* copy = nullptr;           // (numel) of copy_type, written; nullptr: no copy (fp32 mode)
  DType copy_type = DType::bf16;  // bf16 or f16
};

// Fails (enqueueing nothing) on a missing array, a negative length, an fp32
// copy, a step below 1 or hyperparameters outside torch's accepted ranges.
Status adamw_step(const AdamWDeviceShard& shard, const cpu::AdamWHyperparams& hyper,
                  cudaStream_t stream);

// cpu::AdamWStateShard on the device: one shard whose moments are of
// `state_type`. Arrays of `numel` elements unless stated; none overlap.
struct AdamWDeviceStateShard {
  int64_t numel = 0;
  cpu::AdamWStateType state_type = cpu::AdamWStateType::bf16;
  float* master = nullptr;  // (numel) fp32 master weights, updated in place
  // (numel) m and v, updated in place: f32: float; bf16: uint16_t bits;
  // int8: int8_t codes for m, uint8_t codes of sqrt(v) for v.
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  // int8 only (nullptr otherwise), (cpu::adamw_state_scale_count(int8, numel))
  // each, updated in place: max |m| and max sqrt(v) of each block.
  float* exp_avg_scale = nullptr;
  float* exp_avg_sq_scale = nullptr;
  const void* grad = nullptr;  // (numel) of grad_type
  DType grad_type = DType::f32;
  void* copy = nullptr;           // (numel) of copy_type, written; nullptr: no copy
  DType copy_type = DType::bf16;  // bf16 or f16
};

// Fails (enqueueing nothing) as adamw_step above does, and on missing or
// unexpected scales (the CPU kernel's checks). fp32 moments: exactly
// adamw_step on an AdamWDeviceShard of the same arrays.
Status adamw_step(const AdamWDeviceStateShard& shard, const cpu::AdamWHyperparams& hyper,
                  cudaStream_t stream);

}  // namespace strata::kernels::cuda
