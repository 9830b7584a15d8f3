// CPU AdamW step against the memory-bandwidth ceiling.
//
//   adamw_bench [--params=N] [--threads=T] [--iterations=I] [google benchmark flags]
//
// Times, on N parameters (default 64 Mi) with T TBB threads (default: all):
//   AdamWStep/fp32   fp32 moments, fp32 gradient in, no compute copy  (28 bytes per parameter)
//   AdamWStep/mixed  fp32 moments, bf16 gradient in, bf16 copy out     (28 bytes per parameter)
//   AdamWBf16State/fp32, AdamWBf16State/mixed  the same with bf16 moments (20 bytes)
//   AdamWInt8State/fp32, AdamWInt8State/mixed  the same with int8 moments (16 bytes + 1/16)
//   Ceiling/fp32, Ceiling/mixed, Ceiling/bf16state, Ceiling/int8state  a plain
//                    loop with exactly the same reads and in-place writes as
//                    the step of that name (fp32 gradient and no copy for the
//                    compact states), with the same threads and ranges
//   GradNorm/fp32, GradNorm/bf16  the norm + inf/NaN pass (one read)
// Every array holds random data: pages of identical content can be served
// faster than real memory. Counters: params_per_s, and bytes_per_second
// counted as the bytes the step must move. --iterations=I times exactly I
// steps per repetition (with --benchmark_repetitions, a median of single
// steps). benches/adamw_compare.py runs this beside DeepSpeed's CPU Adam and
// torch.optim.AdamW and prints the ratios.
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
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/grad_norm.h"

namespace {

using strata::kernels::cpu::AdamWStateType;
using strata::kernels::cpu::ElementType;

int64_t g_params = int64_t{64} << 20;

// Page-aligned arrays, as the engine's host tier maps its memory (torch aligns
// its tensors to 64 bytes): with new[]'s 16-byte alignment every 64-byte
// vector load would straddle two cache lines, which costs the kernels and the
// ceilings (not torch) several percent at full bandwidth.
struct FreeAligned {
  void operator()(void* data) const { std::free(data); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], FreeAligned>;

template <typename T>
Buffer<T> allocate(int64_t n) {
  constexpr std::size_t kPage = 4096;
  const std::size_t bytes = (static_cast<std::size_t>(n) * sizeof(T) + kPage - 1) / kPage * kPage;
  return Buffer<T>(static_cast<T*>(std::aligned_alloc(kPage, bytes)));
}

// Arrays of the benchmark, allocated and filled once, touched by the same
// range-to-thread mapping as the kernel.
struct Arrays {
  Buffer<float> master, exp_avg, exp_avg_sq, grad32;
  Buffer<uint16_t> grad16, copy;
  Buffer<uint16_t> exp_avg16, exp_avg_sq16;  // bf16 moments
  Buffer<int8_t> exp_avg8;                   // int8 moments
  Buffer<uint8_t> exp_avg_sq8;
  Buffer<float> exp_avg_scale, exp_avg_sq_scale;  // one per int8 block
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
    x.master = allocate<float>(n);
    x.exp_avg = allocate<float>(n);
    x.exp_avg_sq = allocate<float>(n);
    x.grad32 = allocate<float>(n);
    x.grad16 = allocate<uint16_t>(n);
    x.copy = allocate<uint16_t>(n);
    x.exp_avg16 = allocate<uint16_t>(n);
    x.exp_avg_sq16 = allocate<uint16_t>(n);
    x.exp_avg8 = allocate<int8_t>(n);
    x.exp_avg_sq8 = allocate<uint8_t>(n);
    const int64_t blocks = strata::kernels::cpu::adamw_state_scale_count(AdamWStateType::int8, n);
    x.exp_avg_scale = allocate<float>(blocks);
    x.exp_avg_sq_scale = allocate<float>(blocks);
    const uint64_t seed = std::random_device{}();
    strata::kernels::cpu::for_each_static_range(n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        x.master[i] = random_value(seed + 1, i, false);
        x.exp_avg[i] = 1e-2f * random_value(seed + 2, i, false);
        x.exp_avg_sq[i] = 1e-4f * random_value(seed + 3, i, true);
        x.grad32[i] = 1e-2f * random_value(seed + 4, i, false);
        x.grad16[i] = strata::kernels::cpu::float_to_bf16(x.grad32[i]);
        x.copy[i] = static_cast<uint16_t>(mix(seed + 5 + uint64_t(i)));
        x.exp_avg16[i] = strata::kernels::cpu::float_to_bf16(x.exp_avg[i]);
        x.exp_avg_sq16[i] = strata::kernels::cpu::float_to_bf16(x.exp_avg_sq[i]);
        x.exp_avg8[i] = static_cast<int8_t>(127.0f * random_value(seed + 6, i, false));
        x.exp_avg_sq8[i] = static_cast<uint8_t>(255.0f * random_value(seed + 7, i, true));
      }
    });
    for (int64_t b = 0; b < blocks; ++b) {
      x.exp_avg_scale[b] = 1e-2f;     // max |m| of the block
      x.exp_avg_sq_scale[b] = 1e-2f;  // max sqrt(v) of the block
    }
    return x;
  }();
  return a;
}

void set_counters(benchmark::State& state, double bytes_per_param) {
  const double params = static_cast<double>(g_params) * static_cast<double>(state.iterations());
  state.counters["params_per_s"] = benchmark::Counter(params, benchmark::Counter::kIsRate);
  state.SetBytesProcessed(static_cast<int64_t>(params * bytes_per_param));
}

// The step's bytes per parameter: gradient and copy, master read and written,
// both moments read and written (and the int8 scales, 8 bytes each way per block).
double step_bytes(AdamWStateType type, bool mixed) {
  const double moments =
      static_cast<double>(strata::kernels::cpu::adamw_state_bytes(type, g_params)) / g_params;
  return (mixed ? 2.0 + 2.0 : 4.0) + 8.0 + 2.0 * moments;
}

void BM_AdamWStep(benchmark::State& state, AdamWStateType type, bool mixed) {
  Arrays& a = arrays();
  strata::kernels::cpu::AdamWShard shard;
  shard.numel = g_params;
  shard.state_type = type;
  shard.master = a.master.get();
  switch (type) {
    case AdamWStateType::f32:
      shard.exp_avg = a.exp_avg.get();
      shard.exp_avg_sq = a.exp_avg_sq.get();
      break;
    case AdamWStateType::bf16:
      shard.exp_avg = a.exp_avg16.get();
      shard.exp_avg_sq = a.exp_avg_sq16.get();
      break;
    case AdamWStateType::int8:
      shard.exp_avg = a.exp_avg8.get();
      shard.exp_avg_sq = a.exp_avg_sq8.get();
      shard.exp_avg_scale = a.exp_avg_scale.get();
      shard.exp_avg_sq_scale = a.exp_avg_sq_scale.get();
      break;
  }
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
  set_counters(state, step_bytes(type, mixed));
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

// Asks for the line 1024 elements ahead, as the kernels do for their fp32
// arrays and gradient (kernels/cpu/adamw.cpp).
template <typename T>
void prefetch_ahead(const T* data, int64_t i) {
  _mm_prefetch(reinterpret_cast<const char*>(data + i + 1024), _MM_HINT_T0);
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
    if (i % 16 == 0) {
      prefetch_ahead(p, i);
      prefetch_ahead(m, i);
      prefetch_ahead(v, i);
      if (mixed) {
        prefetch_ahead(a.grad16.get(), i);
      } else {
        prefetch_ahead(a.grad32.get(), i);
      }
    }
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

// Moments and scales: one integer add per element (codes wrap around, so the
// data stays random), a tiny add per scale.
void ceiling_compact_scalar(Arrays& a, AdamWStateType type, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    a.master[i] += a.grad32[i] * 0x1p-20f;
    if (type == AdamWStateType::bf16) {
      ++a.exp_avg16[i];
      ++a.exp_avg_sq16[i];
    } else {
      a.exp_avg8[i] = static_cast<int8_t>(a.exp_avg8[i] + 1);
      ++a.exp_avg_sq8[i];
    }
  }
}

// The reads and in-place writes of a step with compact moments (fp32
// gradient, no copy), 32 elements at a time.
__attribute__((target("avx2"))) void ceiling_compact_avx2(Arrays& a, AdamWStateType type,
                                                          int64_t begin, int64_t end) {
  float* p = a.master.get();
  const float* g = a.grad32.get();
  const __m256 tiny = _mm256_set1_ps(0x1p-20f);
  const bool bf16 = type == AdamWStateType::bf16;
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    for (int64_t k = i; k < i + 32; k += 16) {
      prefetch_ahead(p, k);
      prefetch_ahead(g, k);
    }
    for (int64_t k = i; k < i + 32; k += 8) {
      _mm256_storeu_ps(p + k, _mm256_add_ps(_mm256_loadu_ps(p + k),
                                            _mm256_mul_ps(_mm256_loadu_ps(g + k), tiny)));
    }
    if (bf16) {
      for (uint16_t* moment : {a.exp_avg16.get(), a.exp_avg_sq16.get()}) {
        for (int64_t k = i; k < i + 32; k += 16) {
          auto* const at = reinterpret_cast<__m256i*>(moment + k);
          _mm256_storeu_si256(at, _mm256_add_epi16(_mm256_loadu_si256(at), _mm256_set1_epi16(1)));
        }
      }
    } else {
      for (void* moment : {static_cast<void*>(a.exp_avg8.get() + i),
                           static_cast<void*>(a.exp_avg_sq8.get() + i)}) {
        auto* const at = static_cast<__m256i*>(moment);
        _mm256_storeu_si256(at, _mm256_add_epi8(_mm256_loadu_si256(at), _mm256_set1_epi8(1)));
      }
    }
  }
  ceiling_compact_scalar(a, type, i, end);
  if (!bf16) {
    constexpr int64_t kBlock = strata::kernels::cpu::kAdamWInt8Block;
    for (int64_t b = begin / kBlock; b < (end + kBlock - 1) / kBlock; ++b) {
      a.exp_avg_scale[b] += 0x1p-40f;
      a.exp_avg_sq_scale[b] += 0x1p-40f;
    }
  }
}

// fp32 moments: `mixed` as the step's; compact moments: fp32 gradient, no copy.
void BM_Ceiling(benchmark::State& state, AdamWStateType type, bool mixed) {
  Arrays& a = arrays();
  const bool avx2 =
      strata::kernels::cpu::active_simd_level() >= strata::kernels::cpu::SimdLevel::avx2;
  const int64_t alignment =
      type == AdamWStateType::int8 ? strata::kernels::cpu::kAdamWInt8Block : 64;
  for (auto _ : state) {
    strata::kernels::cpu::for_each_static_range(
        g_params,
        [&](int64_t begin, int64_t end) {
          if (type != AdamWStateType::f32) {
            if (avx2) {
              ceiling_compact_avx2(a, type, begin, end);
            } else {
              ceiling_compact_scalar(a, type, begin, end);
            }
          } else if (avx2) {
            ceiling_avx2(a, mixed, begin, end);
          } else {
            ceiling_scalar(a, mixed, begin, end);
          }
        },
        alignment);
    benchmark::ClobberMemory();
  }
  set_counters(state, step_bytes(type, mixed));
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
  int64_t iterations = 0;  // 0: as many as --benchmark_min_time needs
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--params=", 0) == 0) {
      g_params = std::strtoll(arg.c_str() + 9, nullptr, 10);
    } else if (arg.rfind("--threads=", 0) == 0) {
      threads = std::atoi(arg.c_str() + 10);
    } else if (arg.rfind("--iterations=", 0) == 0) {
      iterations = std::strtoll(arg.c_str() + 13, nullptr, 10);
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
  benchmark::AddCustomContext("cpu_kernels", strata::kernels::cpu::describe_cpu_kernels());
  benchmark::AddCustomContext("threads", std::to_string(tbb::global_control::active_value(
                                             tbb::global_control::max_allowed_parallelism)));
  benchmark::AddCustomContext("simd", std::string(strata::kernels::cpu::simd_level_name(
                                          strata::kernels::cpu::active_simd_level())));
  std::vector<benchmark::internal::Benchmark*> cases = {
      benchmark::RegisterBenchmark("AdamWStep/fp32", BM_AdamWStep, AdamWStateType::f32, false),
      benchmark::RegisterBenchmark("AdamWStep/mixed", BM_AdamWStep, AdamWStateType::f32, true),
      benchmark::RegisterBenchmark("AdamWBf16State/fp32", BM_AdamWStep, AdamWStateType::bf16,
                                   false),
      benchmark::RegisterBenchmark("AdamWBf16State/mixed", BM_AdamWStep, AdamWStateType::bf16,
                                   true),
      benchmark::RegisterBenchmark("AdamWInt8State/fp32", BM_AdamWStep, AdamWStateType::int8,
                                   false),
      benchmark::RegisterBenchmark("AdamWInt8State/mixed", BM_AdamWStep, AdamWStateType::int8,
                                   true),
      benchmark::RegisterBenchmark("Ceiling/fp32", BM_Ceiling, AdamWStateType::f32, false),
      benchmark::RegisterBenchmark("Ceiling/mixed", BM_Ceiling, AdamWStateType::f32, true),
      benchmark::RegisterBenchmark("Ceiling/bf16state", BM_Ceiling, AdamWStateType::bf16, false),
      benchmark::RegisterBenchmark("Ceiling/int8state", BM_Ceiling, AdamWStateType::int8, false),
      benchmark::RegisterBenchmark("GradNorm/fp32", BM_GradNorm, false),
      benchmark::RegisterBenchmark("GradNorm/bf16", BM_GradNorm, true)};
  for (benchmark::internal::Benchmark* bench : cases) {
    bench->UseRealTime();
    if (iterations > 0) bench->Iterations(iterations);
  }
  int rest_count = static_cast<int>(rest.size());
  benchmark::Initialize(&rest_count, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
