// The vocabulary-cut embedding and head (core/model/vocab_chunks.h). Every
// product and loss runs as the whole head runs it, over the same blocks of
// rows (UnitWorkspace::head_rows), so that on the reference products each
// logit, each token's loss and each lm_head gradient is the whole head's.
#include "core/model/vocab_chunks.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>

#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"

namespace strata {
namespace cpu = kernels::cpu;

struct VocabChunkKernels {
  // Chunk k of the head: its lm_head rows, its gradient and its block of the
  // logits store (UnitBatch::head_logits).
  struct HeadChunk {
    const float* lm_head = nullptr;
    float* d_lm_head = nullptr;
    int64_t begin = 0, rows = 0;
    float* block = nullptr;
  };

  static HeadChunk head_chunk(const ModelLayout& model, int64_t u, const UnitParams& params,
                              const UnitGrads* grads, const UnitBatch& batch) {
    const ModelConfig& c = model.config;
    const UnitLayout& layout = model.units[size_t(u)];
    const TensorSlot* slot = lm_head_slot(layout);
    const int64_t k = layout.unit.chunk, N = batch.B * batch.T;
    HeadChunk h;
    h.lm_head = params.flat + slot->offset;
    h.d_lm_head = grads != nullptr ? grads->flat + slot->offset : nullptr;
    h.begin = c.vocab_chunk_begin(k);
    h.rows = c.vocab_chunk_begin(k + 1) - h.begin;
    h.block = batch.head_logits + N * h.begin;
    return h;
  }

  // Rows [first, first + rows) of the whole logits, between the store (chunk
  // after chunk) and `full` (rows, V): gathered from the store, or scattered back.
  static void move_rows(const ModelConfig& c, float* store, int64_t N, int64_t first, int64_t rows,
                        float* full, bool gather) {
    const int64_t V = c.vocab_size;
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, rows), [&](const auto& range) {
      for (int64_t r = range.begin(); r < range.end(); ++r) {
        for (int64_t k = 0; k < c.vocab_chunks; ++k) {
          const int64_t begin = c.vocab_chunk_begin(k), width = c.vocab_chunk_begin(k + 1) - begin;
          float* chunk_row = store + N * begin + (first + r) * width;
          float* full_row = full + r * V + begin;
          if (gather)
            std::copy(chunk_row, chunk_row + width, full_row);
          else
            std::copy(full_row, full_row + width, chunk_row);
        }
      }
    });
  }

  static double loss_sum(const UnitWorkspace& ws, int64_t N) {
    double sum = 0.0;
    for (int64_t n = 0; n < N; ++n) sum += ws.losses[size_t(n)];
    return sum;
  }

  // The last head chunk without its backward (evaluation): the loss over the
  // whole rows.
  static double last_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                             const UnitBatch& batch, const float* xn, float* logits_out,
                             UnitWorkspace& ws) {
    const ModelConfig& c = model.config;
    const int64_t N = batch.B * batch.T, C = c.hidden_size, V = c.vocab_size;
    const HeadChunk h = head_chunk(model, u, params, nullptr, batch);
    cpu::matmul_forward(h.block, xn, h.lm_head, N, C, h.rows);
    for (int64_t begin = 0; begin < N; begin += ws.head_rows) {
      const int64_t rows = std::min(ws.head_rows, N - begin);
      move_rows(c, batch.head_logits, N, begin, rows, ws.logits.data(), true);
      if (logits_out != nullptr)
        std::copy(ws.logits.begin(), ws.logits.begin() + rows * V, logits_out + begin * V);
      if (batch.targets != nullptr)
        cpu::cross_entropy_forward(ws.losses.data() + begin, ws.logits.data(),
                                   batch.targets + begin, rows, V);
    }
    return batch.targets != nullptr ? loss_sum(ws, N) : 0.0;
  }

  // A head chunk but the last: its logits block; the output is the normed rows.
  static void head_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                           const UnitBatch& batch, const float* x, float* output,
                           UnitWorkspace& ws) {
    const ModelConfig& c = model.config;
    const int64_t N = batch.B * batch.T, C = c.hidden_size;
    if (model.units[size_t(u)].unit.chunk == 0)
      cpu::rmsnorm_forward(output, ws.head_rstd.data(), x, params.flat, N, C,
                           static_cast<float>(c.rms_norm_eps));
    else if (x != output)
      std::copy(x, x + N * C, output);
    const HeadChunk h = head_chunk(model, u, params, nullptr, batch);
    cpu::matmul_forward(h.block, output, h.lm_head, N, C, h.rows);
  }

  static double head_pass(const ModelLayout& model, const UnitParams& params,
                          const UnitBatch& batch, const float* xn, float* dxn, const UnitGrads& g,
                          float* logits_out, UnitWorkspace& ws) {
    const ModelConfig& c = model.config;
    const int64_t N = batch.B * batch.T, C = c.hidden_size, V = c.vocab_size;
    const HeadChunk h = head_chunk(model, int64_t(model.units.size()) - 1, params, &g, batch);
    cpu::matmul_forward(h.block, xn, h.lm_head, N, C, h.rows);
    std::fill(ws.d_xn.begin(), ws.d_xn.end(), 0.0f);
    for (int64_t begin = 0; begin < N; begin += ws.head_rows) {
      const int64_t rows = std::min(ws.head_rows, N - begin);
      move_rows(c, batch.head_logits, N, begin, rows, ws.logits.data(), true);
      if (logits_out != nullptr)
        std::copy(ws.logits.begin(), ws.logits.begin() + rows * V, logits_out + begin * V);
      cpu::cross_entropy_forward_backward(ws.losses.data() + begin, ws.logits.data(),
                                          ws.logits.data(), batch.targets + begin, batch.loss_scale,
                                          rows, V);
      move_rows(c, batch.head_logits, N, begin, rows, ws.logits.data(), false);
      cpu::matmul_backward(ws.d_xn.data() + begin * C, h.d_lm_head, h.block + begin * h.rows,
                           xn + begin * C, h.lm_head, rows, C, h.rows);
    }
    std::copy(ws.d_xn.begin(), ws.d_xn.begin() + N * C, dxn);
    return loss_sum(ws, N);
  }

  static void head_backward(const ModelLayout& model, int64_t u, const UnitParams& params,
                            const UnitBatch& batch, const float* x, const float* dout,
                            float* dinput, const UnitGrads& g, UnitWorkspace& ws) {
    const ModelConfig& c = model.config;
    const UnitLayout& layout = model.units[size_t(u)];
    const int64_t N = batch.B * batch.T, C = c.hidden_size;
    const HeadChunk h = head_chunk(model, u, params, &g, batch);
    const bool first = layout.unit.chunk == 0;
    const float* xn = x;  // a later chunk's input is the normed rows
    if (first) {
      cpu::rmsnorm_forward(ws.head_xn.data(), ws.head_rstd.data(), x, params.flat, N, C,
                           static_cast<float>(c.rms_norm_eps));
      xn = ws.head_xn.data();
    }
    std::copy(dout, dout + N * C, ws.d_xn.begin());
    for (int64_t begin = 0; begin < N; begin += ws.head_rows) {
      const int64_t rows = std::min(ws.head_rows, N - begin);
      cpu::matmul_backward(ws.d_xn.data() + begin * C, h.d_lm_head, h.block + begin * h.rows,
                           xn + begin * C, h.lm_head, rows, C, h.rows);
    }
    if (!first) {
      std::copy(ws.d_xn.begin(), ws.d_xn.begin() + N * C, dinput);
      return;
    }
    std::fill(dinput, dinput + N * C, 0.0f);
    cpu::rmsnorm_backward(dinput, g.flat, ws.d_xn.data(), x, params.flat, ws.head_rstd.data(), N,
                          C);
  }
};

double vocab_chunk_forward(const ModelLayout& model, int64_t u, const UnitParams& params,
                           const UnitBatch& batch, const float* input, float* output,
                           UnitWorkspace& ws) {
  const ModelConfig& c = model.config;
  const UnitShape& unit = model.units[size_t(u)].unit;
  const int64_t N = batch.B * batch.T, C = c.hidden_size;
  if (unit.kind == UnitKind::embedding) {
    if (input == nullptr)
      std::fill(output, output + N * C, 0.0f);
    else if (input != output)
      std::copy(input, input + N * C, output);
    cpu::embedding_forward_rows(output, batch.tokens, params.flat, N, C,
                                c.vocab_chunk_begin(unit.chunk),
                                c.vocab_chunk_begin(unit.chunk + 1));
    if (unit.chunk == 0 && batch.router != nullptr) batch.router->reset(c.num_experts);
    return 0.0;
  }
  if (unit.chunk == c.vocab_chunks - 1)
    return VocabChunkKernels::last_forward(model, u, params, batch, input, output, ws);
  VocabChunkKernels::head_forward(model, u, params, batch, input, output, ws);
  return 0.0;
}

void vocab_chunk_backward(const ModelLayout& model, int64_t u, const UnitParams& params,
                          const UnitBatch& batch, const float* input, const float* doutput,
                          float* dinput, const UnitGrads& grads, UnitWorkspace& ws) {
  const ModelConfig& c = model.config;
  const UnitShape& unit = model.units[size_t(u)].unit;
  const int64_t N = batch.B * batch.T, C = c.hidden_size;
  if (unit.kind == UnitKind::head) {
    VocabChunkKernels::head_backward(model, u, params, batch, input, doutput, dinput, grads, ws);
    return;
  }
  cpu::embedding_backward_rows(grads.flat, doutput, batch.tokens, N, C,
                               c.vocab_chunk_begin(unit.chunk),
                               c.vocab_chunk_begin(unit.chunk + 1));
  if (dinput != nullptr && dinput != doutput) std::copy(doutput, doutput + N * C, dinput);
}

double vocab_chunk_head_pass(const ModelLayout& model, const UnitParams& params,
                             const UnitBatch& batch, const float* input, float* dinput,
                             const UnitGrads& grads, UnitWorkspace& ws, float* logits) {
  return VocabChunkKernels::head_pass(model, params, batch, input, dinput, grads, logits, ws);
}

}  // namespace strata
