// The CPU computation of a sparse layer's mixture of experts (model.h states
// the semantics), shared by a whole layer or MLP piece (model.cpp) and by a
// sparse layer cut into a router piece and pieces of experts
// (ModelConfig::expert_groups; the expert_group_* functions below).
//
// A sparse layer's output is x2 + each token's weighted expert outputs,
// added in expert order (from zero), and its backward sums each token's
// rows' input gradients in expert order, then the router's part. Cut into
// groups, the forward adds the same products in the same order (each group
// its experts' into ExpertChain::sum, group after group), so the output is
// the whole MLP's bits; the backward runs the groups the other way, each
// adding its experts' rows into the gradient of the normed rows it passes
// on, so a token whose k experts lie in several groups sums them in another
// order: bitwise for k <= 2 (one addition commutes), within the bound
// core/README.md ("Expert groups") derives for k > 2. Every other gradient
// (the experts', the router's) is the whole MLP's bits.
//
// Internal to core/model; thread-safety as model.h (one workspace per caller).
#pragma once

#include <cstdint>

#include "core/model/model.h"

namespace strata {

struct MoeKernels {
  // The router over the normed rows xn (N, C): probabilities (N, E), each
  // token's top k experts (ties to the lower index) and weights, then the
  // routed rows grouped by expert.
  static void route(const ModelConfig& c, const float* router, const float* xn, UnitWorkspace& ws);
  // The rows of experts [first, end) over their routed rows from xn: their
  // inputs, gate_up, SwiGLU and outputs y. `experts` points at expert
  // `first`'s gate.
  static void experts_forward(const ModelConfig& c, const float* experts, int64_t first,
                              int64_t end, const float* xn, UnitWorkspace& ws);
  // out = x2 + each token's weighted expert outputs, in expert order.
  static void combine(const ModelConfig& c, const UnitWorkspace& ws, const float* x2, float* out);
  // The whole mixture's backward from dout (N, C): the experts' and the
  // router's gradients (+=), d(xn) into ws.d_xn (=); aux_grad (E) or null.
  static void backward(const ModelConfig& c, const float* router, const float* experts,
                       float* d_router, float* d_experts, const float* xn, const float* dout,
                       const float* aux_grad, UnitWorkspace& ws);
  // The micro-batch's router statistics gain this layer's tokens.
  static void add_router_stats(const ModelConfig& c, const UnitWorkspace& ws, RouterStats& stats);

  // --- a sparse layer cut into expert groups ------------------------------
  // The router piece (input x2, output the normed rows): the norm and the
  // routing, recorded in the chain for the groups; the chain's rows take
  // x2 and its sum is zeroed. No `out`: the recomputation of a backward.
  static void router_forward(const ModelConfig& c, const float* router, const float* norm,
                             const float* x2, float* out, int64_t sparse_layer,
                             const ExpertChain& chain, UnitWorkspace& ws);
  // A group (input the normed rows): adds its experts' weighted outputs to
  // the chain's sum; the last group outputs x2 + sum, the others their input.
  static void group_forward(const ModelConfig& c, const float* experts, int64_t first, int64_t end,
                            bool last, const float* xn, float* out, int64_t sparse_layer,
                            const ExpertChain& chain, UnitWorkspace& ws);
  // A group's backward: the last group keeps doutput (the layer's output
  // gradient) in the chain's rows; each writes its slots' weight gradients
  // into the chain, adds its experts' gradients (+=), and passes the normed
  // rows' gradient on: dinput = doutput (0 for the last group) plus its
  // experts' rows. dinput may alias doutput.
  static void group_backward(const ModelConfig& c, const float* experts, float* d_experts,
                             int64_t first, int64_t end, bool last, const float* xn,
                             const float* doutput, float* dinput, int64_t sparse_layer,
                             const ExpertChain& chain, UnitWorkspace& ws);
  // The router piece's backward: doutput is the normed rows' gradient the
  // groups summed; dx = the layer's output gradient (the chain's rows) plus
  // the norm's backward of that gradient and the router's part. dx may
  // alias doutput.
  static void router_backward(const ModelConfig& c, const float* router, const float* norm,
                              float* d_router, float* d_norm, const float* x2, const float* doutput,
                              float* dx, const float* aux_grad, const ExpertChain& chain,
                              UnitWorkspace& ws);

 private:
  // d(each slot's weight) = dout . y for the slots of experts [first, end)
  // into d_weight (N, K); then those rows of y become weight * dout.
  static void weight_grads(const ModelConfig& c, const float* dout, int64_t first, int64_t end,
                           float* d_weight, UnitWorkspace& ws);
  // Experts [first, end)'s backward over their rows: their gradients (+=)
  // and their rows' input gradients (d_moe_x).
  static void experts_backward(const ModelConfig& c, const float* experts, float* d_experts,
                               int64_t first, int64_t end, UnitWorkspace& ws);
  // dxn (N, C) += each token's rows' input gradients of experts [first,
  // end), in expert order.
  static void add_row_grads(const ModelConfig& c, const UnitWorkspace& ws, int64_t first,
                            int64_t end, float* dxn);
  // Through the weights (renormalised or not) and the load-balancing loss
  // to the probabilities, the softmax and the router's product: d_router +=,
  // dxn += the router's part.
  static void router_grads(const ModelConfig& c, const float* router, float* d_router,
                           const float* xn, const float* d_weight, const float* aux_grad,
                           float* dxn, UnitWorkspace& ws);
  // Token n's k slots in the order of their experts' indices.
  static void slots_by_expert(const UnitWorkspace& ws, int64_t n, int64_t K, int64_t* order);
  // The chain's recorded routing of `sparse_layer` into ws, grouped.
  static void load_routing(const ModelConfig& c, int64_t sparse_layer, const ExpertChain& chain,
                           UnitWorkspace& ws);
};

}  // namespace strata
