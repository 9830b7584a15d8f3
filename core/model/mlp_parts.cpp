// A dense layer's MLP cut into parts along its intermediate dimension
// (mlp_part_kernels.h).
#include <algorithm>

#include "core/model/mlp_part_kernels.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/swiglu.h"

namespace strata {
namespace cpu = kernels::cpu;

MlpPart mlp_part(const ModelLayout& model, int64_t u) {
  const UnitLayout& layout = model.units[size_t(u)];
  MlpPart part;
  part.rows = layout.tensors[0].shape[0];
  part.gate_up = layout.tensors[0].offset;
  part.down = layout.tensors[2].offset;
  part.first = layout.unit.mlp_part == 0;
  part.last = layout.unit.mlp_part == model.config.mlp_parts - 1;
  if (part.first) part.norm = layout.tensors[3].offset;
  return part;
}

void MlpPartKernels::forward(const ModelLayout& model, int64_t u, const float* flat,
                             const float* input, float* out, const ExpertChain& chain,
                             UnitWorkspace& ws) {
  const ModelConfig& c = model.config;
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size;
  const MlpPart p = mlp_part(model, u);
  const float* xn = input;
  if (p.first) {
    cpu::rmsnorm_forward(ws.xn2.data(), ws.rstd2.data(), input, flat + p.norm, N, C,
                         static_cast<float>(c.rms_norm_eps));
    xn = ws.xn2.data();
  }
  cpu::matmul_forward(ws.gate_up.data(), xn, flat + p.gate_up, N, C, 2 * p.rows);
  cpu::swiglu_forward(ws.mlp.data(), ws.gate_up.data(), N, p.rows);
  if (out == nullptr) return;
  if (p.first) std::copy(input, input + N * C, chain.rows);
  cpu::matmul_forward(chain.sum, ws.mlp.data(), flat + p.down, N, p.rows, C,
                      /*accumulate=*/!p.first);
  if (p.last) {
    for (int64_t i = 0; i < N * C; ++i) out[i] = chain.rows[i] + chain.sum[i];
  } else if (out != xn) {
    std::copy(xn, xn + N * C, out);
  }
}

void MlpPartKernels::backward(const ModelLayout& model, int64_t u, const float* flat,
                              float* grad_flat, const float* input, const float* doutput,
                              float* dinput, const ExpertChain& chain, UnitWorkspace& ws,
                              bool recompute) {
  const ModelConfig& c = model.config;
  const int64_t N = ws.B_ * ws.T_, C = c.hidden_size;
  const MlpPart p = mlp_part(model, u);
  if (recompute) forward(model, u, flat, input, nullptr, chain, ws);
  const float* xn = p.first ? ws.xn2.data() : input;
  // The layer's output gradient: the last part's doutput, kept for the others.
  if (p.last) std::copy(doutput, doutput + N * C, chain.rows);
  std::fill(ws.d_mlp.begin(), ws.d_mlp.begin() + N * p.rows, 0.0f);
  cpu::matmul_backward(ws.d_mlp.data(), grad_flat + p.down, chain.rows, ws.mlp.data(),
                       flat + p.down, N, p.rows, C);
  cpu::swiglu_backward(ws.d_gate_up.data(), ws.d_mlp.data(), ws.gate_up.data(), N, p.rows);
  // The normed rows' gradient: what the later parts summed, plus this part's.
  float* d_xn = p.first ? ws.d_xn.data() : dinput;
  if (p.last)
    std::fill(d_xn, d_xn + N * C, 0.0f);
  else if (d_xn != doutput)
    std::copy(doutput, doutput + N * C, d_xn);
  cpu::matmul_backward(d_xn, grad_flat + p.gate_up, ws.d_gate_up.data(), xn, flat + p.gate_up, N, C,
                       2 * p.rows);
  if (!p.first) return;
  // The residual's gradient, then the norm's backward adds into it (as mlp_backward).
  std::copy(chain.rows, chain.rows + N * C, dinput);
  cpu::rmsnorm_backward(dinput, grad_flat + p.norm, ws.d_xn.data(), input, flat + p.norm,
                        ws.rstd2.data(), N, C);
}

}  // namespace strata
