// The SwiGLU gate of Llama's MLP, CPU backend (fp32):
// out = silu(gate) * up, with silu(g) = g * sigmoid(g). The MLP is
// down(swiglu(gate(x), up(x))); the two input projections come fused in one
// row, [gate (I) | up (I)], because gate_proj and up_proj sit next to each
// other in a layer's flat buffer and run as one matrix product.
//
// swiglu_forward overwrites `out`; swiglu_backward overwrites `dgate_up` (=).
// TBB-parallel over rows.
#pragma once

#include <cstdint>

namespace strata::kernels::cpu {

void swiglu_forward(float* out,            // (N, I)
                    const float* gate_up,  // (N, 2*I): gate then up
                    int64_t N, int64_t I);

void swiglu_backward(float* dgate_up,       // (N, 2*I), =
                     const float* dout,     // (N, I)
                     const float* gate_up,  // (N, 2*I)
                     int64_t N, int64_t I);

}  // namespace strata::kernels::cpu
