// Token embedding of the CPU backend: row lookup in an fp32 table.
//
// Token ids must be in [0, V); callers check them (core/ reports a bad token
// as an error naming the data file). embedding_forward overwrites `out`;
// embedding_backward adds into `dweight` (+=). The backward splits columns over
// TBB threads and visits tokens in order, so repeated tokens sum in the same
// order for any thread count.
#pragma once

#include <cstdint>

namespace strata::kernels::cpu {

void embedding_forward(float* out,             // (N, C)
                       const int32_t* tokens,  // (N)
                       const float* weight,    // (V, C)
                       int64_t N, int64_t C);

void embedding_backward(float* dweight,         // (V, C), +=
                        const float* dout,      // (N, C)
                        const int32_t* tokens,  // (N)
                        int64_t N, int64_t C);

// A table cut along the vocabulary: `weight` holds rows [begin, end). The
// forward sets the rows of `out` whose token is in the range and leaves the
// others; the backward adds those tokens' rows only, visiting them in order
// as embedding_backward does, so every row's sum is the whole table's.
void embedding_forward_rows(float* out, const int32_t* tokens, const float* weight, int64_t N,
                            int64_t C, int64_t begin, int64_t end);
void embedding_backward_rows(float* dweight, const float* dout, const int32_t* tokens, int64_t N,
                             int64_t C, int64_t begin, int64_t end);

}  // namespace strata::kernels::cpu
