// Times every CUDA kernel and every matrix product of one Llama 3.2 1B decoder
// layer (hidden 2048, intermediate 8192, 32 query heads, 8 key/value heads,
// head_dim 64, vocabulary 128256 for the head), in bf16, and prints achieved
// TFLOP/s (products, attention) or GB/s (everything else) next to this
// device's measured peaks: a large cuBLASLt bf16 product for FLOP/s and a
// device-to-device copy for bandwidth (bytes read plus bytes written).
//
// Usage: cuda_kernels_bench [--tokens N] [--seq T] [--reps R]
// Defaults: 4096 tokens as 2 sequences of 2048. Prints one line and exits 0
// where no GPU can be used. The inputs hold constant bytes (speed does not
// depend on the values) except the token ids, which are random.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/backend.h"

#if STRATA_HAS_CUDA

#include <cuda_runtime_api.h>

#include "kernels/cpu/adamw.h"
#include "kernels/cuda/adamw.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/ops.h"

namespace {

using strata::Status;
namespace cuda = strata::kernels::cuda;
using cuda::DType;

// Device memory holding constant bytes (0x3c: bf16 and fp32 values near 0.0115).
class Buffer {
 public:
  explicit Buffer(std::size_t bytes) : bytes_(bytes) {
    if (cudaMalloc(&data_, bytes) != cudaSuccess) {
      std::fprintf(stderr, "cuda_kernels_bench: cannot allocate %zu bytes\n", bytes);
      std::exit(1);
    }
    cudaMemset(data_, 0x3c, bytes);
  }
  ~Buffer() { cudaFree(data_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* get() const { return data_; }
  float* f32() const { return static_cast<float*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_;
};

void check(const Status& status, const std::string& what) {
  if (!status) {
    std::fprintf(stderr, "cuda_kernels_bench: %s: %s\n", what.c_str(), status.message().c_str());
    std::exit(1);
  }
}

// Mean milliseconds per call of `body` over `reps` calls, after two warm-up calls.
double time_ms(const std::string& what, int reps, const std::function<Status()>& body) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 2; ++i) check(body(), what);
  cudaEventRecord(start);
  for (int i = 0; i < reps; ++i) check(body(), what);
  cudaEventRecord(stop);
  if (cudaEventSynchronize(stop) != cudaSuccess) {
    std::fprintf(stderr, "cuda_kernels_bench: %s failed on the device: %s\n", what.c_str(),
                 cudaGetErrorString(cudaGetLastError()));
    std::exit(1);
  }
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / reps;
}

struct Peaks {
  double tflops = 0.0;
  double gbps = 0.0;
};

class Report {
 public:
  explicit Report(Peaks peaks) : peaks_(peaks) {
    std::printf("%-34s %-28s %10s %12s %8s\n", "operation", "shape", "ms", "achieved", "of peak");
  }
  void flops(const std::string& name, const std::string& shape, double ms, double flop) {
    const double tflops = flop / (ms * 1e-3) / 1e12;
    std::printf("%-34s %-28s %10.4f %7.1f TF/s %7.1f%%\n", name.c_str(), shape.c_str(), ms, tflops,
                100.0 * tflops / peaks_.tflops);
  }
  void bytes(const std::string& name, const std::string& shape, double ms, double bytes) {
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    std::printf("%-34s %-28s %10.4f %7.0f GB/s %7.1f%%\n", name.c_str(), shape.c_str(), ms, gbps,
                100.0 * gbps / peaks_.gbps);
  }

 private:
  Peaks peaks_;
};

int run(int64_t N, int64_t T, int reps) {
  const int64_t B = N / T, C = 2048, I = 8192, H = 32, KV = 8, D = 64, V = 128256;
  const int64_t QKV = (H + 2 * KV) * D;
  const DType bf16 = DType::bf16;
  const std::size_t e = 2;  // bytes per bf16 element
  auto created = cuda::Matmuls::create();
  if (!created) {
    std::fprintf(stderr, "cuda_kernels_bench: %s\n", created.status().message().c_str());
    return 1;
  }
  cuda::Matmuls& mm = **created;

  // --- peaks ---
  Peaks peaks;
  {
    const int64_t S = 8192;
    Buffer a(S * S * e), b(S * S * e), c(S * S * e);
    const double ms = time_ms("peak product", reps, [&] {
      return mm.forward(c.get(), a.get(), b.get(), S, S, S, bf16, false, nullptr);
    });
    peaks.tflops = 2.0 * S * S * S / (ms * 1e-3) / 1e12;
    const std::size_t bytes = std::size_t{2} << 30;
    Buffer src(bytes), dst(bytes);
    const double copy_ms = time_ms("peak copy", reps, [&] {
      return cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice) == cudaSuccess
                 ? Status::ok()
                 : Status::error("cudaMemcpyAsync");
    });
    peaks.gbps = 2.0 * bytes / (copy_ms * 1e-3) / 1e9;
  }
  std::printf("peaks: %.1f TFLOP/s (cuBLASLt bf16 8192^3), %.0f GB/s (device copy, read + write)\n",
              peaks.tflops, peaks.gbps);
  std::printf("layer: Llama 3.2 1B, %lld tokens (B=%lld, T=%lld), bf16\n\n",
              static_cast<long long>(N), static_cast<long long>(B), static_cast<long long>(T));
  Report report(peaks);

  // --- matrix products of one layer and the head ---
  struct Product {
    const char* name;
    int64_t C, OC;
  };
  const Product products[] = {{"qkv_proj", C, QKV},
                              {"o_proj", H * D, C},
                              {"gate_up_proj", C, 2 * I},
                              {"down_proj", I, C},
                              {"lm_head", C, V}};
  for (const Product& p : products) {
    Buffer inp(N * p.C * e), weight(p.OC * p.C * e), out(N * p.OC * e), dinp(N * p.C * e);
    Buffer dweight(p.OC * p.C * 4);
    const std::string shape = fmt::format("{}x{} . {}x{}", N, p.C, p.OC, p.C);
    const double flop = 2.0 * N * p.C * p.OC;
    report.flops(std::string(p.name) + " forward", shape,
                 time_ms(p.name, reps,
                         [&] {
                           return mm.forward(out.get(), inp.get(), weight.get(), N, p.C, p.OC, bf16,
                                             false, nullptr);
                         }),
                 flop);
    report.flops(std::string(p.name) + " backward dinp", shape,
                 time_ms(p.name, reps,
                         [&] {
                           return mm.backward(dinp.get(), nullptr, out.get(), inp.get(),
                                              weight.get(), N, p.C, p.OC, bf16, nullptr);
                         }),
                 flop);
    report.flops(std::string(p.name) + " backward dweight", shape + " fp32 dW",
                 time_ms(p.name, reps,
                         [&] {
                           return mm.backward(nullptr, dweight.f32(), out.get(), inp.get(),
                                              weight.get(), N, p.C, p.OC, bf16, nullptr);
                         }),
                 flop);
  }

  // --- kernels ---
  Buffer x(N * C * e), y(N * C * e), w(C * e), rstd(N * 4), dweight_c(C * 4);
  Buffer scratch(std::max(cuda::rmsnorm_backward_scratch_bytes(N, C),
                          std::max(cuda::embedding_backward_scratch_bytes(N, V),
                                   cuda::grad_norm_scratch_bytes(V * C))));
  const std::string nc = fmt::format("N={} C={}", N, C);
  report.bytes("rmsnorm forward", nc,
               time_ms("rmsnorm_forward", reps,
                       [&] {
                         return cuda::rmsnorm_forward(y.get(), rstd.f32(), x.get(), w.get(), N, C,
                                                      1e-5f, bf16, nullptr);
                       }),
               2.0 * N * C * e);
  report.bytes("rmsnorm backward", nc,
               time_ms("rmsnorm_backward", reps,
                       [&] {
                         return cuda::rmsnorm_backward(y.get(), dweight_c.f32(), x.get(), x.get(),
                                                       w.get(), rstd.f32(), N, C, bf16,
                                                       scratch.get(), scratch.bytes(), nullptr);
                       }),
               4.0 * N * C * e);  // dout, inp, dinp read and written
  report.bytes(
      "residual add", nc,
      time_ms(
          "residual_forward", reps,
          [&] { return cuda::residual_forward(y.get(), y.get(), x.get(), N * C, bf16, nullptr); }),
      3.0 * N * C * e);

  Buffer qkv(N * QKV * e), attn(N * H * D * e), lse(B * H * T * 4), delta(B * H * T * 4);
  Buffer dqkv(N * QKV * e), cos(T * D / 2 * 4), sin(T * D / 2 * 4);
  const std::string rope_shape = fmt::format("N={} heads={} D={}", N, H + KV, D);
  report.bytes("rope forward (q and k)", rope_shape,
               time_ms("rope_forward", reps,
                       [&] {
                         return cuda::rope_forward(qkv.get(), cos.f32(), sin.f32(), B, T, H + KV, D,
                                                   QKV, bf16, nullptr);
                       }),
               2.0 * N * (H + KV) * D * e);
  report.bytes("rope backward (q and k)", rope_shape,
               time_ms("rope_backward", reps,
                       [&] {
                         return cuda::rope_backward(qkv.get(), cos.f32(), sin.f32(), B, T, H + KV,
                                                    D, QKV, bf16, nullptr);
                       }),
               2.0 * N * (H + KV) * D * e);

  cuda::AttentionShape s;
  s.B = B;
  s.T = T;
  s.H = H;
  s.KV = KV;
  s.D = D;
  s.row_stride = QKV;
  char* q = static_cast<char*>(qkv.get());
  char* dq = static_cast<char*>(dqkv.get());
  const double causal_flop = 4.0 * B * H * D * (T * (T + 1) / 2.0);  // QK^T and PV, causal half
  const std::string attn_shape = fmt::format("B={} T={} H={} KV={} D={}", B, T, H, KV, D);
  report.flops("attention forward", attn_shape,
               time_ms("attention_forward", reps,
                       [&] {
                         return cuda::attention_forward(attn.get(), lse.f32(), q, q + H * D * e,
                                                        q + (H + KV) * D * e, s, bf16, nullptr);
                       }),
               causal_flop);
  // Backward recomputes QK^T twice (dq and dk/dv passes) and does four more products.
  report.flops("attention backward", attn_shape,
               time_ms("attention_backward", reps,
                       [&] {
                         return cuda::attention_backward(dq, dq + H * D * e, dq + (H + KV) * D * e,
                                                         delta.f32(), attn.get(), attn.get(),
                                                         lse.f32(), q, q + H * D * e,
                                                         q + (H + KV) * D * e, s, bf16, nullptr);
                       }),
               2.5 * causal_flop);

  Buffer gate_up(N * 2 * I * e), mlp(N * I * e), dgate_up(N * 2 * I * e);
  const std::string ni = fmt::format("N={} I={}", N, I);
  report.bytes(
      "swiglu forward", ni,
      time_ms("swiglu_forward", reps,
              [&] { return cuda::swiglu_forward(mlp.get(), gate_up.get(), N, I, bf16, nullptr); }),
      3.0 * N * I * e);
  report.bytes("swiglu backward", ni,
               time_ms("swiglu_backward", reps,
                       [&] {
                         return cuda::swiglu_backward(dgate_up.get(), mlp.get(), gate_up.get(), N,
                                                      I, bf16, nullptr);
                       }),
               5.0 * N * I * e);

  std::vector<int32_t> host_tokens(N);
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> pick(0, static_cast<int32_t>(V - 1));
  for (auto& t : host_tokens) t = pick(rng);
  Buffer tokens(N * 4), logits(N * V * e), losses(N * 4), table(V * C * e), dtable(V * C * 4);
  cudaMemcpy(tokens.get(), host_tokens.data(), N * 4, cudaMemcpyHostToDevice);
  const int32_t* tok = static_cast<const int32_t*>(tokens.get());
  const std::string nv = fmt::format("N={} V={}", N, V);
  // Each pass reads the logits and writes them (in place) once; logits are
  // re-filled by nothing, so values drift, which does not change the speed.
  report.bytes("cross-entropy forward+backward", nv,
               time_ms("cross_entropy", reps,
                       [&] {
                         return cuda::cross_entropy_forward_backward(losses.f32(), logits.get(),
                                                                     logits.get(), tok, 1.0f / N, N,
                                                                     V, bf16, nullptr);
                       }),
               3.0 * N * V * e);  // read twice (max/sum pass, gradient pass), write once
  report.bytes(
      "embedding forward", nc,
      time_ms(
          "embedding_forward", reps,
          [&] { return cuda::embedding_forward(y.get(), tok, table.get(), N, C, bf16, nullptr); }),
      2.0 * N * C * e);
  report.bytes("embedding backward", nc,
               time_ms("embedding_backward", reps,
                       [&] {
                         return cuda::embedding_backward(dtable.f32(), x.get(), tok, N, C, V, bf16,
                                                         scratch.get(), scratch.bytes(), nullptr);
                       }),
               N * C * (e + 8.0));  // dout read, fp32 rows read and written

  // --- optimizer-side kernels over the embedding's V x C parameters ---
  const int64_t P = V * C;
  const std::string pn = fmt::format("numel={}", P);
  Buffer master(P * 4), m(P * 4), v(P * 4), grad(P * 4), copy(P * e), result(64);
  strata::kernels::cpu::AdamWShard shard;
  shard.numel = P;
  shard.master = master.f32();
  shard.exp_avg = m.f32();
  shard.exp_avg_sq = v.f32();
  shard.grad = grad.get();
  shard.grad_type = strata::kernels::cpu::ElementType::f32;
  shard.copy = copy.get();
  shard.copy_type = strata::kernels::cpu::ElementType::bf16;
  strata::kernels::cpu::AdamWHyperparams hyper;
  report.bytes("adamw (fp32 grad, bf16 copy)", pn,
               time_ms("adamw_step", reps, [&] { return cuda::adamw_step(shard, hyper, nullptr); }),
               P * (3 * 8.0 + 4 + e));
  // Compact moments in the same buffers: bf16 (2 bytes each), int8 (1 byte
  // each, plus two fp32 scales per 256 elements read and written).
  const int64_t blocks =
      strata::kernels::cpu::adamw_state_scale_count(strata::kernels::cpu::AdamWStateType::int8, P);
  Buffer scales(static_cast<std::size_t>(2 * blocks * 4));
  for (const auto state :
       {strata::kernels::cpu::AdamWStateType::bf16, strata::kernels::cpu::AdamWStateType::int8}) {
    const bool int8 = state == strata::kernels::cpu::AdamWStateType::int8;
    strata::kernels::cpu::AdamWShard compact;
    compact.numel = P;
    compact.state_type = state;
    compact.master = master.f32();
    compact.exp_avg = m.get();
    compact.exp_avg_sq = v.get();
    compact.exp_avg_scale = int8 ? scales.f32() : nullptr;
    compact.exp_avg_sq_scale = int8 ? scales.f32() + blocks : nullptr;
    compact.grad = grad.get();
    compact.grad_type = strata::kernels::cpu::ElementType::f32;
    compact.copy = copy.get();
    compact.copy_type = strata::kernels::cpu::ElementType::bf16;
    const double moment = int8 ? 1.0 : 2.0;
    report.bytes(
        int8 ? "adamw, int8 moments (fp32 grad, bf16 copy)"
             : "adamw, bf16 moments (fp32 grad, bf16 copy)",
        pn, time_ms("adamw_step", reps, [&] { return cuda::adamw_step(compact, hyper, nullptr); }),
        P * (2 * 4.0 + 4 * moment + 4 + e) + (int8 ? 16.0 * blocks : 0.0));
  }
  report.bytes("grad norm (fp32)", pn,
               time_ms("grad_norm_squared", reps,
                       [&] {
                         return cuda::grad_norm_squared(
                             static_cast<cuda::GradNormResult*>(result.get()), grad.get(),
                             DType::f32, P, scratch.get(), scratch.bytes(), nullptr);
                       }),
               P * 4.0);
  report.bytes(
      "cast fp32 -> bf16", pn,
      time_ms("cast", reps,
              [&] { return cuda::cast(copy.get(), bf16, master.get(), DType::f32, P, nullptr); }),
      P * (4.0 + e));
  return 0;
}

}  // namespace

#endif

int main(int argc, char** argv) {
  long long tokens = 4096, seq = 2048;
  int reps = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--tokens") == 0)
      tokens = std::atoll(argv[i + 1]);
    else if (std::strcmp(argv[i], "--seq") == 0)
      seq = std::atoll(argv[i + 1]);
    else if (std::strcmp(argv[i], "--reps") == 0)
      reps = std::atoi(argv[i + 1]);
  }
  if (seq <= 0 || tokens < seq || tokens % seq != 0 || reps <= 0) {
    std::fprintf(stderr, "cuda_kernels_bench: --tokens must be a positive multiple of --seq\n");
    return 2;
  }
  const strata::kernels::GpuQuery gpus = strata::kernels::query_gpus();
  if (gpus.devices.empty()) {
    std::printf("cuda_kernels_bench: skipped, %s\n", gpus.why_none.c_str());
    return 0;
  }
#if STRATA_HAS_CUDA
  std::printf("device: %s\n", gpus.devices[0].name.c_str());
  return run(tokens, seq, reps);
#else
  return 0;
#endif
}
