// AdamW on the GPU, for training that keeps the optimizer state on the device.
//
// The same step as kernels/cpu/adamw.h, element for element: the constants are
// rounded once from float64 on the host exactly as the CPU kernel rounds them,
// and the kernel performs the same IEEE fp32 operations in the same order
// (explicit round-to-nearest multiplies, adds, fused multiply-adds, square
// root and division; nvcc may not contract them), so a GPU step is bitwise
// equal to the CPU step on the same inputs. Gradient fp32, bf16 or fp16; the
// compute-precision copy (bf16 or fp16) is written in the same pass. It takes
// the CPU kernel's description of a shard update (cpu::AdamWShard,
// kernels/cpu/adamw_shard.h) with every pointer in device memory, and runs
// it in the CPU kernel's pieces: one launch per run of cpu::compact_runs,
// each with its group's hyperparameters.
//
// Compact moments (state_type bf16 or int8): bf16 or blockwise int8 m and v,
// stored exactly as kernels/cpu/adamw.h states (the same codes, scales,
// rounding and block layout: blocks of 256 counted from each run's first
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
#include "kernels/cpu/adamw_shard.h"

namespace strata::kernels::cuda {

// One step on `shard` (every pointer device memory; grad_type and copy_type
// as the CPU kernel takes them), enqueued on `stream`. Fails (enqueueing
// nothing) on what the CPU kernel refuses: a missing array, a negative
// length, missing or unexpected scales, an fp32 copy, segments that do not
// cover the shard, a step below 1 or hyperparameters outside torch's
// accepted ranges.
Status adamw_step(const cpu::AdamWShard& shard, const cpu::AdamWHyperparams& hyper,
                  cudaStream_t stream);

}  // namespace strata::kernels::cuda
