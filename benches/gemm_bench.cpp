// The CPU backend's products (kernels/cpu/gemm.h): GFLOP/s of the fast path in
// the class this process runs and of the reference path, on the shapes of a
// Llama layer's linear layers, and the CPU time the product's threads (TBB's)
// burn while the process sleeps after a product (idle_cpu_per_s: about 1 per
// spinning thread, 0 when they sleep).
//
//   build/benches/gemm_bench                      the class the CPU allows
//   STRATA_GEMM=baseline build/benches/gemm_bench OpenBLAS's fallback kernels
//
// The context line `cpu_kernels` names the class, its threads and the AdamW
// SIMD path.
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "kernels/cpu/gemm.h"

namespace {

double process_cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return double(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         1e-6 * double(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec);
}

std::vector<float> random_floats(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// out (N, OC) = inp (N, C) @ weight (OC, C)^T: a linear layer's forward.
void linear_forward(benchmark::State& state, bool reference) {
  const int64_t N = state.range(0), C = state.range(1), OC = state.range(2);
  const std::vector<float> inp = random_floats(size_t(N * C), 1);
  const std::vector<float> weight = random_floats(size_t(OC * C), 2);
  std::vector<float> out(size_t(N * OC));
  auto product = reference ? strata::kernels::cpu::sgemm_reference : strata::kernels::cpu::sgemm;
  for (auto _ : state) {
    product(false, true, N, OC, C, 1.0f, inp.data(), C, weight.data(), C, 0.0f, out.data(), OC);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["GFLOP/s"] =
      benchmark::Counter(double(2 * N * C * OC) * double(state.iterations()),
                         benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}

void BM_fast(benchmark::State& state) {
  linear_forward(state, false);
}
void BM_reference(benchmark::State& state) {
  linear_forward(state, true);
}

// One product, then 50 ms of sleep: the process's CPU time during the sleep.
void BM_idle_after_product(benchmark::State& state) {
  const int64_t n = 256;
  const std::vector<float> a = random_floats(size_t(n * n), 3), b = random_floats(size_t(n * n), 4);
  std::vector<float> c(size_t(n * n));
  double idle_cpu = 0.0, idle_wall = 0.0;
  for (auto _ : state) {
    strata::kernels::cpu::sgemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f,
                                c.data(), n);
    const double cpu0 = process_cpu_seconds();
    const auto wall0 = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    idle_wall += std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
    idle_cpu += process_cpu_seconds() - cpu0;
  }
  state.counters["idle_cpu_per_s"] = idle_cpu / idle_wall;
}

// Shapes of a Llama 3.2 1B layer at 512 tokens: q/o (2048 x 2048), k/v
// (512 x 2048), gate/up (8192 x 2048), down (2048 x 8192).
void shapes(benchmark::internal::Benchmark* b) {
  b->Args({512, 2048, 2048})
      ->Args({512, 2048, 512})
      ->Args({512, 2048, 8192})
      ->Args({512, 8192, 2048})
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
}

}  // namespace

BENCHMARK(BM_fast)->Apply(shapes);
BENCHMARK(BM_reference)->Apply(shapes);
BENCHMARK(BM_idle_after_product)->Iterations(10)->Unit(benchmark::kMillisecond)->UseRealTime();

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::AddCustomContext("cpu_kernels", strata::kernels::cpu::describe_cpu_kernels());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
