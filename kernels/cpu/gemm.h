// The CPU backend's matrix product, sgemm, and the choice of kernel behind it.
//
// Every product of the CPU backend (matmul.h, attention.h) goes through sgemm()
// below, which runs one of two paths:
//
// - the fast path: OpenBLAS, with its kernel class chosen from what the CPU
//   can do, never from a table of CPU models. OpenBLAS picks its kernels from
//   the CPU model when the library loads, and falls back to its oldest kernel
//   (SSE3) on a model newer than the build; strata therefore loads OpenBLAS
//   itself, on the first product or the first gemm_info(), and tells it which
//   class to run (OPENBLAS_CORETYPE, set for the load only). The classes, best
//   first: avx512 (AVX-512 F/DQ/BW/VL: OpenBLAS's SkylakeX kernels), avx2
//   (AVX2 + FMA: Haswell), avx (Sandy Bridge), baseline (SSE3: Prescott).
//   Its results depend on the class and the thread count (the kernels block
//   and sum differently, and the blocks are cut per thread), not on anything
//   else.
// - the reference path: strata's own product, the same bits on every x86-64
//   CPU and for every thread count. Element (i, j) is the float sum, in order
//   k = 0, 1, ..., K-1, of the rounded products op(A)[i][k] * op(B)[k][j],
//   starting from +0 (each product and each sum rounded to fp32 on its own, no
//   fused multiply-add), then times alpha (when alpha != 1) and added to C
//   (when beta == 1). Vectors of any width (STRATA_SIMD: scalar, avx2,
//   avx512) only compute several elements at once, so they change its speed,
//   never its bits. Pinned results (the golden hashes) run on it; the fast
//   path is checked against it within the product's error bound.
//
// The choice is the process's: STRATA_GEMM (auto | avx512 | avx2 | avx |
// baseline | reference), or select_gemm_kernel() before the first product
// (`strata train --gemm`). A class the CPU lacks is refused. Without either,
// an OPENBLAS_CORETYPE already in the environment is left to OpenBLAS (the
// report says so); otherwise the best class the CPU's features allow runs.
//
// Threads. OpenBLAS runs single-threaded and starts no threads of its own: a
// product of 2 MFLOP or more is cut along C's longer side into one block per
// thread (set_blas_threads; edges on multiples of 16), each block one OpenBLAS
// call run as a TBB task, so the products share TBB's threads with the other
// kernels instead of waking threads of their own against them (which, with
// the element-wise kernels' TBB workers still spinning, ran whole stretches
// of steps at half speed). The cuts depend on the shape and the thread count only.
// sgemm() may be called from several threads and from inside TBB tasks; the
// other functions are thread-safe too.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "io/base/status.h"

namespace strata::kernels::cpu {

// Kernel classes of the fast path, oldest first, then the reference path.
enum class GemmKernel { baseline = 0, avx = 1, avx2 = 2, avx512 = 3, reference = 4 };

std::string_view gemm_kernel_name(GemmKernel kernel);
std::optional<GemmKernel> parse_gemm_kernel(std::string_view name);  // auto -> nullopt

// The best fast class this CPU and its operating system support (CPUID, XGETBV).
GemmKernel cpu_gemm_kernel();

// Whether this CPU can run `kernel` (the reference path runs everywhere).
bool cpu_can_run(GemmKernel kernel);

// Chooses the path before the first product: any class the CPU can run, or
// the reference path. Once OpenBLAS is loaded its class is fixed for the
// process: switching between the reference path and the loaded class is
// always allowed, another class is refused.
Status select_gemm_kernel(GemmKernel kernel);

// Reads STRATA_GEMM as select_gemm_kernel would take it (nothing when unset
// or `auto`; an error naming the value and the choices when it is not one).
Status select_gemm_kernel_from_environment();

struct GemmInfo {
  GemmKernel kernel;          // what sgemm runs now
  GemmKernel library_kernel;  // OpenBLAS's loaded class (the fast path)
  std::string library;        // "OpenBLAS 0.3.21"
  std::string library_core;   // OpenBLAS's name for its kernels: "SkylakeX", "Haswell", ...
  std::string chosen_by;      // "the CPU's features", "STRATA_GEMM=avx2", ...
  int threads = 1;            // threads of the products
};

// Loads OpenBLAS if needed and says what runs. Exits the process with one
// line on stderr when OpenBLAS cannot be loaded (install it: tools/setup-debian).
GemmInfo gemm_info();

// One line for banners and benches: "gemm avx512 (OpenBLAS 0.3.21 SkylakeX,
// chosen by the CPU's features), 2 threads; adamw simd avx512".
std::string describe_cpu_kernels();

// C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) + beta * C, row-major, with
// op(X) = X^T when trans_X; lda/ldb/ldc are the row strides of A, B and C as
// stored. beta is 0 (C is overwritten, never read) or 1 (added into).
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// The reference path itself, whatever is selected (tests, benches).
void sgemm_reference(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                     int64_t ldc);

// The blocks the fast path cuts a large product into, one per thread (0, and
// the default: one per core this process may run on; OPENBLAS_NUM_THREADS is
// not read). They run on TBB's pool, whose size tbb::global_control sets.
void set_blas_threads(int threads);

}  // namespace strata::kernels::cpu
