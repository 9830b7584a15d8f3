// Internal to core/model/cuda_units*.cpp: the workspace's buffers of a
// CudaUnits (core/model/cuda_units.h), which cuda_units.cpp lays out and the
// units' files share, and their error shorthand. Not for other rooms.
#pragma once

#if STRATA_HAS_CUDA
#include <cstdint>
#include <vector>

#include "core/model/cuda_units.h"

namespace strata {

struct CudaUnits::Buffers {
  void *xn1, *qkv, *attn, *x2, *xn2, *gate_up, *mlp;
  float *rstd1, *lse, *rstd2;
  void *d_mlp, *d_gate_up, *d_xn, *d_attn, *d_qkv;
  float* delta;
  void* head_xn;
  float* head_rstd;
  void* logits;
  void* scratch;
  int64_t scratch_bytes;
  float *cos, *sin;
  void *q_raw, *k_raw;
  float *q_rstd, *k_rstd;
  void *heads, *d_heads;
  int64_t head_rows;
  // Sparse layers (core/model/model.h): the router's logits (then their
  // gradient) and probabilities, each token's experts, weights and the
  // weights' gradient, the grouped rows (row_of, row_token), the
  // load-balancing gradient and the probabilities' sums; the routed rows'
  // activations and gradients. The grouping is computed on the host, from
  // the routing of the last forward: its copies stay here for the backward.
  void* router_logits;
  float* probs;
  int32_t* top_expert;
  float *top_weight, *d_top_weight;
  int32_t *row_of, *row_token;
  float* aux_grad;
  double* prob_sums;
  void *moe_x, *moe_gate_up, *moe_act, *moe_y, *d_moe_x, *d_moe_gate_up, *d_moe_act;
  std::vector<int32_t> host_top_expert, host_row_of, host_row_token;
  std::vector<int64_t> expert_begin;  // (E + 1)
  std::vector<double> host_prob_sums;
  std::vector<float> host_aux_grad;
};

// Every unit call returns its first failure; STRATA_CHECK keeps that short (a function
// cannot return from its caller).
#define STRATA_CHECK(expression)                                 \
  do {                                                           \
    if (Status status_ = (expression); !status_) return status_; \
  } while (false)

}  // namespace strata
#endif
