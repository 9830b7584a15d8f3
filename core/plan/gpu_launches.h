// What the CUDA backend's units issue per plan operation besides FLOPs: the
// launches (kernels, cuBLASLt products, copies and memsets on the compute
// stream) and the host's waits for that stream, counted as
// core/model/cuda_units*.cpp issue them, for the step-time model
// (core/plan/step_model.h).
//
// Why they matter: a kernel costs the host a few microseconds to launch and
// the GPU a few to run however little it computes, and a wait empties the
// stream (the GPU idles until the host, having grouped the rows, launches
// again). A sparse layer runs three products per expert its tokens reach,
// five more backward, so a mixture of many small experts (qwen3-30b-a3b: 128
// of 768 rows) launches hundreds of kernels per layer whose FLOPs alone
// would take less time than launching them. Dense layers launch a few
// dozen, far below their FLOPs' time at real shapes.
//
// Counts per operation (one micro-batch), R the experts a piece reaches:
//   attention forward 7 (+1 with q/k/v biases, +6 with q/k norms), backward 11
//     (+1, +8); dense MLP forward 5, backward 8; a part of it forward 5
//     (+2 for part 0), backward 9 (+2 for part 0);
//   sparse MLP forward 10 + 3R and one wait (the rows grouped by expert on the
//     host), backward 8 + 5R; a layer's backward 1 more (the residual
//     gradient's copy);
//   router piece forward 12 and one wait, backward 9 (its recomputation
//     included); a group of experts forward 6 + 3R and backward 9 + 8R (its
//     rows recomputed included), each one wait (its layer's routing);
//   any other backward that recomputes first issues its forward's again (a
//     sparse one's wait too);
//   the load-balancing gradient's upload: one wait and one copy, at the
//     first backward of a micro-batch that holds a router;
//   a routed fetch's routing: 4 and one wait (a group's, from the chain: 1
//     and one wait); its own `route` operation at several ranks, the routed
//     forward's first step at one;
//   the embedding 1; the head 8, a vocabulary chunk 4.
// R is what an even routing reaches in expectation:
// experts x (1 - (1 - k/E)^N) for N tokens (with N k >> E, every expert).
#pragma once

#include "core/plan/training_plan.h"

namespace strata {

struct GpuLaunches {
  double kernels = 0;  // launches on the compute stream
  int waits = 0;       // host waits for the compute stream
};

// Operation `op` of `plan` (a forward, backward or route; zero for any
// other) as the CUDA units issue it.
GpuLaunches gpu_launches(const TrainingPlan& plan, const PlanOp& op);

// The expected number of a piece's `experts` that a micro-batch of `tokens`
// reaches under an even routing of k of E per token.
double expected_experts_reached(const ModelConfig& model, int64_t tokens, int64_t experts);

}  // namespace strata
