// CPU AdamW step against the memory-bandwidth ceiling.
//
//   adamw_bench [--params=N] [--threads=T] [google benchmark flags]
//
// Times, on N parameters (default 64 Mi) with T TBB threads (default: all):
//   AdamWStep/fp32   fp32 gradient in, no compute copy  (28 bytes per parameter)
//   AdamWStep/mixed  bf16 gradient in, bf16 copy out     (28 bytes per parameter)
//   Ceiling/fp32, Ceiling/mixed  a plain loop with exactly the same reads and
//                    in-place writes (and the same threads and ranges)
//   GradNorm/fp32, GradNorm/bf16  the norm + inf/NaN pass (one read)
// Every array holds random data: pages of identical content can be served
// faster than real memory. Counters: params_per_s, and bytes_per_second
// counted as the bytes the step must move. benches/adamw_compare.py runs this
// beside DeepSpeed's CPU Adam and torch.optim.AdamW and prints the ratios.
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <tbb/global_control.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/adamw.h"
#include "kernels/cpu/grad_norm.h"

namespace {

using strata::kernels::cpu::ElementType;

int64_t g_params = int64_t{64} << 20;

// Arrays of the benchmark, allocated and filled once, touched by the same
// range-to-thread mapping as the kernel.
struct Arrays {
  std::unique_ptr<float[]> master, exp_avg, exp_avg_sq, grad32;
  std::unique_ptr<uint16_t[]> grad16, copy;
};

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) (or [0, 1) when `positive`), different for every (stream, i).
float random_value(uint64_t stream, int64_t i, bool positive) {
  const uint32_t bits = static_cast<uint32_t>(mix(stream * 0x100000000ull + uint64_t(i)) >> 40);
  const float unit = static_cast<float>(bits) * (1.0f / 16777216.0f);
  return positive ? unit : 2.0f * unit - 1.0f;
}

Arrays& arrays() {
  static Arrays a = [] {
    Arrays x;
    const int64_t n = g_params;
    x.master.reset(new float[n]);
    x.exp_avg.reset(new float[n]);
    x.exp_avg_sq.reset(new float[n]);
    x.grad32.reset(new float[n]);
    x.grad16.reset(new uint16_t[n]);
    x.copy.reset(new uint16_t[n]);
    const uint64_t seed = std::random_device{}();
    strata::kernels::cpu::for_each_static_range(n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        x.master[i] = random_value(seed + 1, i, false);
        x.exp_avg[i] = 1e-2f * random_value(seed + 2, i, false);
        x.exp_avg_sq[i] = 1e-4f * random_value(seed + 3, i, true);
        x.grad32[i] = 1e-2f * random_value(seed + 4, i, false);
        x.grad16[i] = strata::kernels::cpu::float_to_bf16(x.grad32[i]);
        x.copy[i] = static_cast<uint16_t>(mix(seed + 5 + uint64_t(i)));
      }
    });
    return x;
  }();
  return a;
}

void set_counters(benchmark::State& state, double bytes_per_param) {
  const double params = static_cast<double>(g_params) * static_cast<double>(state.iterations());
  state.counters["params_per_s"] = benchmark::Counter(params, benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(params * bytes_per_param));
}

void BM_AdamWStep(benchmark::State& state, bool mixed) {
  Arrays& a = arrays();
  strata::kernels::cpu::AdamWShard shard;
  shard.numel = g_params;
  shard.master = a.master.get();
  shard.exp_avg = a.exp_avg.get();
  shard.exp_avg_sq = a.exp_avg_sq.get();
  shard.grad = mixed ? static_cast<const void*>(a.grad16.get()) : a.grad32.get();
  shard.grad_type = mixed ? ElementType::bf16 : ElementType::f32;
  shard.copy = mixed ? a.copy.get() : nullptr;
  shard.copy_type = ElementType::bf16;
  strata::kernels::cpu::AdamWHyperparams hyper;
  hyper.lr = 1e-4;  // small steps keep the random state in range over many iterations
  hyper.weight_decay = 0.01;
  for (auto _ : state) {
    if (!strata::kernels::cpu::adamw_step(shard, hyper)) state.SkipWithError("adamw_step failed");
    ++hyper.step;
  }
  set_counters(state, 28.0);
  state.SetLabel(std::string(
      strata::kernels::cpu::simd_level_name(strata::kernels::cpu::active_simd_level())));
}

void ceiling_scalar(Arrays& a, bool mixed, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float g =
        (mixed ? strata::kernels::cpu::bf16_to_float(a.grad16[i]) : a.grad32[i]) * 0x1p-20f;
    a.master[i] += g;
    a.exp_avg[i] += g;
    a.exp_avg_sq[i] += g;
    if (mixed) {
      a.copy[i] = static_cast<uint16_t>(strata::kernels::cpu::float_bits(a.master[i]) >> 16);
    }
  }
}

// The same reads and in-place writes as the step, with one add per array.
__attribute__((target("avx2"))) void ceiling_avx2(Arrays& a, bool mixed, int64_t begin,
                                                  int64_t end) {
  float* p = a.master.get();
  float* m = a.exp_avg.get();
  float* v = a.exp_avg_sq.get();
  const __m256 tiny = _mm256_set1_ps(0x1p-20f);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 g;
    if (mixed) {
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.grad16.get() + i));
      g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    } else {
      g = _mm256_loadu_ps(a.grad32.get() + i);
    }
    g = _mm256_mul_ps(g, tiny);  // small, normal (never denormal) changes keep the data random
    const __m256 pn = _mm256_add_ps(_mm256_loadu_ps(p + i), g);
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), g));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), g));
    _mm256_storeu_ps(p + i, pn);
    if (mixed) {
      const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(pn), 16);
      const __m256i pairs = _mm256_packus_epi32(bits, bits);
      // Non-temporal, as the kernel writes its copy (ranges start on 64 elements).
      _mm_stream_si128(reinterpret_cast<__m128i*>(a.copy.get() + i),
                       _mm256_castsi256_si128(_mm256_permute4x64_epi64(pairs, 0xd8)));
    }
  }
  _mm_sfence();
  ceiling_scalar(a, mixed, i, end);
}

void BM_Ceiling(benchmark::State& state, bool mixed) {
  Arrays& a = arrays();
  const bool avx2 =
      strata::kernels::cpu::active_simd_level() >= strata::kernels::cpu::SimdLevel::avx2;
  for (auto _ : state) {
    strata::kernels::cpu::for_each_static_range(g_params, [&](int64_t begin, int64_t end) {
      if (avx2) {
        ceiling_avx2(a, mixed, begin, end);
      } else {
        ceiling_scalar(a, mixed, begin, end);
      }
    });
    benchmark::ClobberMemory();
  }
  set_counters(state, 28.0);
}

void BM_GradNorm(benchmark::State& state, bool bf16) {
  Arrays& a = arrays();
  double sink = 0;
  for (auto _ : state) {
    auto result =
        bf16 ? strata::kernels::cpu::grad_norm_squared(a.grad16.get(), ElementType::bf16, g_params)
             : strata::kernels::cpu::grad_norm_squared(a.grad32.get(), ElementType::f32, g_params);
    sink += result->sum_squares;
  }
  benchmark::DoNotOptimize(sink);
  set_counters(state, bf16 ? 2.0 : 4.0);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--params=", 0) == 0) {
      g_params = std::strtoll(arg.c_str() + 9, nullptr, 10);
    } else if (arg.rfind("--threads=", 0) == 0) {
      threads = std::atoi(arg.c_str() + 10);
    } else {
      rest.push_back(argv[i]);
    }
  }
  std::unique_ptr<tbb::global_control> limit;
  if (threads > 0) {
    limit = std::make_unique<tbb::global_control>(tbb::global_control::max_allowed_parallelism,
                                                  threads);
  }
  benchmark::AddCustomContext("params", std::to_string(g_params));
  benchmark::AddCustomContext("threads", std::to_string(tbb::global_control::active_value(
                                             tbb::global_control::max_allowed_parallelism)));
  benchmark::AddCustomContext("simd", std::string(strata::kernels::cpu::simd_level_name(
                                          strata::kernels::cpu::active_simd_level())));
  benchmark::RegisterBenchmark("AdamWStep/fp32", BM_AdamWStep, false)->UseRealTime();
  benchmark::RegisterBenchmark("AdamWStep/mixed", BM_AdamWStep, true)->UseRealTime();
  benchmark::RegisterBenchmark("Ceiling/fp32", BM_Ceiling, false)->UseRealTime();
  benchmark::RegisterBenchmark("Ceiling/mixed", BM_Ceiling, true)->UseRealTime();
  benchmark::RegisterBenchmark("GradNorm/fp32", BM_GradNorm, false)->UseRealTime();
  benchmark::RegisterBenchmark("GradNorm/bf16", BM_GradNorm, true)->UseRealTime();
  int rest_count = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_count, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
