// The CPU computation of a dense layer's MLP cut into parts along its
// intermediate dimension (ModelConfig::mlp_parts; model.h states the units'
// semantics, core/README.md ("MLP parts") the bound).
//
// Part p holds rows [b, e) of gate_proj and up_proj (adjacent: one
// product), the same columns of down_proj, and part 0 the post-attention
// norm. Part 0 takes the layer's x2, keeps it in the micro-batch's
// ExpertChain (rows) and outputs the normed rows; every part computes its
// rows' SwiGLU and adds its down product into the chain's sum (part 0 from
// zero); the later parts pass the normed rows on, the last outputs x2 +
// sum. Backward, the last part keeps the layer's output gradient in the
// chain's rows, each part adds its product into the normed rows' gradient
// it passes down (the last from zero), and part 0 takes the norm and the
// residual. Every parameter gradient but the norm's is the whole MLP's bits
// on the reference products (each element the same sum in the same
// order); the layer's output and the normed rows' gradient are sums over
// the intermediate dimension that the parts add in pieces.
//
// Internal to core/model; thread-safety as model.h (one workspace per caller).
#pragma once

#include <cstdint>

#include "core/model/model.h"

namespace strata {

// Where a part's tensors lie in its flat buffer (add_layer_slots: gate, up,
// down, then part 0's norm), in elements; both backends' parts read it.
struct MlpPart {
  int64_t rows = 0;  // of gate_proj (and up_proj, and columns of down_proj)
  int64_t gate_up = 0, down = 0, norm = -1;
  bool first = false, last = false;
};
MlpPart mlp_part(const ModelLayout& model, int64_t u);

struct MlpPartKernels {
  // Unit u's forward from `input` (part 0: x2; the others: the normed
  // rows). No `out`: the recomputation of a backward, which leaves the
  // chain alone.
  static void forward(const ModelLayout& model, int64_t u, const float* flat, const float* input,
                      float* out, const ExpertChain& chain, UnitWorkspace& ws);
  // Unit u's backward: gradients (+=), dinput = doutput (none for the last
  // part) plus its part of the normed rows' gradient, or (part 0) the
  // layer's input gradient. dinput may alias doutput.
  static void backward(const ModelLayout& model, int64_t u, const float* flat, float* grad_flat,
                       const float* input, const float* doutput, float* dinput,
                       const ExpertChain& chain, UnitWorkspace& ws, bool recompute);
};

}  // namespace strata
