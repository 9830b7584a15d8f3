// The float64 reference of one element of torch.optim.AdamW's step, shared by
// the AdamW kernel tests (fp32 moments, and the compact bf16/int8 moments,
// which pass their moments decoded). Beside the results it gives the
// magnitudes of the terms that make m and v, which bound their fp32 rounding.
#pragma once

#include <cmath>

#include "kernels/cpu/adamw.h"

namespace strata::testing {

struct AdamWReferenceElement {
  double p = 0;  // the parameter after weight decay, before the step
  double m = 0, v = 0;
  double denom = 0;   // sqrt(v) / sqrt(1 - beta2^t) + eps
  double update = 0;  // (lr / (1 - beta1^t)) * m / denom; the new master is p - update
  double bias_correction1 = 1;
  double m_magnitude = 0, v_magnitude = 0;
};

// `grad` as stored (before grad_scale), `master`, and the moments before the step.
inline AdamWReferenceElement adamw_reference_element(double grad, double master, double m_old,
                                                     double v_old,
                                                     const kernels::cpu::AdamWHyperparams& h) {
  AdamWReferenceElement e;
  e.bias_correction1 = h.bias_correction ? 1.0 - std::pow(h.beta1, double(h.step)) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - std::pow(h.beta2, double(h.step)) : 1.0;
  double g = grad * h.grad_scale;
  double g_magnitude = std::fabs(g);
  e.p = master;
  if (h.decoupled_weight_decay) {
    e.p *= 1.0 - h.lr * h.weight_decay;
  } else {
    g += h.weight_decay * e.p;
    g_magnitude += std::fabs(h.weight_decay * e.p);
  }
  e.m = h.beta1 * m_old + (1.0 - h.beta1) * g;
  e.v = h.beta2 * v_old + (1.0 - h.beta2) * g * g;
  e.denom = std::sqrt(e.v) / std::sqrt(bc2) + h.eps;
  e.update = (h.lr / e.bias_correction1) * e.m / e.denom;
  e.m_magnitude = std::fabs(h.beta1 * m_old) + (1.0 - h.beta1) * g_magnitude;
  e.v_magnitude = h.beta2 * v_old + (1.0 - h.beta2) * g_magnitude * g_magnitude;
  return e;
}

}  // namespace strata::testing
