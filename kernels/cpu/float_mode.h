// The floating-point mode strata's CPU kernels run in: subnormal floats
// flushed to zero (MXCSR's FTZ) and read as zero (DAZ) on every thread.
//
// A subnormal (below 1.18e-38 in fp32) costs an x86 core a microcode assist
// of a hundred cycles or more on many CPUs (Intel's among them), in every
// product and element-wise kernel that meets one. Training makes them: a
// sharpening attention's far probabilities (exp of -88 or less) and the
// gradients through them. On a 2-core Intel Xeon the README's first command
// slowed from 0.19 to 0.37 s a step over its 200 steps without the flush, and
// held 0.19 s with it. Values that small are far below anything a step
// changes (a weight moves by about lr), so flushing them changes no result
// beyond the tolerances strata is held to against PyTorch, and it is the same
// on every machine: the bits stay the same across CPUs and thread counts.
//
// The mode is set on the thread that loads strata's kernels, before main()
// (a static initializer in simd.cpp, which every kernel links), and threads
// inherit it from the thread that starts them (Linux copies the FP state on
// clone): the engine's lanes, TBB's workers, the I/O threads.
#pragma once

namespace strata::kernels::cpu {

// Sets FTZ and DAZ on the calling thread.
void flush_subnormals_on_this_thread();

// Whether the calling thread flushes subnormals (FTZ and DAZ both set).
bool flushes_subnormals();

}  // namespace strata::kernels::cpu
