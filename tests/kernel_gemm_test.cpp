// sgemm (kernels/cpu/gemm.h): the reference path is the ordered fp32 sum
// bitwise on every vector path and thread count; both paths stay within the
// product's rounding bound of float64; the kernel class is the best this
// CPU's features allow, read here from /proc/cpuinfo, not from the dispatcher.
//
// ctest runs this file with STRATA_GEMM unset (the automatic choice), and the
// KernelGemmForced tests once more under every STRATA_GEMM class
// (tests/CMakeLists.txt); a class the CPU cannot run skips them.
#include <gtest/gtest.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cpu/float_mode.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/simd.h"
#include "tests/kernel_reference.h"
#include "tests/tiers_test_support.h"

namespace strata::testing {
namespace {

using kernels::cpu::GemmKernel;

// A fresh seed, printed (STRATA_TEST_SEED reruns it); mt19937 takes its low 32 bits.
unsigned fresh_seed() {
  return unsigned(tiers::testing::fresh_seed("kernel_gemm"));
}

// One product's operands as stored: op(A) is (M, K), op(B) is (K, N), with
// row strides wider than the rows.
struct Product {
  bool trans_a = false, trans_b = false;
  int64_t M = 0, N = 0, K = 0, lda = 0, ldb = 0, ldc = 0;
  float alpha = 1.0f, beta = 0.0f;
  std::vector<float> A, B, C;

  float a(int64_t i, int64_t k) const { return trans_a ? A[k * lda + i] : A[i * lda + k]; }
  float b(int64_t k, int64_t j) const { return trans_b ? B[j * ldb + k] : B[k * ldb + j]; }
};

Product random_product(std::mt19937& rng, bool trans_a, bool trans_b, int64_t M, int64_t N,
                       int64_t K, float alpha, float beta) {
  Product p;
  p.trans_a = trans_a;
  p.trans_b = trans_b;
  p.M = M, p.N = N, p.K = K, p.alpha = alpha, p.beta = beta;
  p.lda = (trans_a ? M : K) + 3;
  p.ldb = (trans_b ? K : N) + 5;
  p.ldc = N + 2;
  p.A = random_floats(size_t((trans_a ? K : M) * p.lda), rng);
  p.B = random_floats(size_t((trans_b ? N : K) * p.ldb), rng);
  p.C = random_floats(size_t(M * p.ldc), rng);
  return p;
}

std::vector<float> run(const Product& p, bool reference) {
  std::vector<float> c = p.C;
  auto f = reference ? kernels::cpu::sgemm_reference : kernels::cpu::sgemm;
  f(p.trans_a, p.trans_b, p.M, p.N, p.K, p.alpha, p.A.data(), p.lda, p.B.data(), p.ldb, p.beta,
    c.data(), p.ldc);
  return c;
}

// gemm.h's definition, one element at a time: the sum in order k = 0 .. K-1
// from +0, each product and sum rounded to fp32 (volatile keeps them apart).
std::vector<float> ordered_sum(const Product& p) {
  std::vector<float> c = p.C;
  for (int64_t i = 0; i < p.M; ++i) {
    for (int64_t j = 0; j < p.N; ++j) {
      volatile float sum = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) {
        volatile float product = p.a(i, k) * p.b(k, j);
        sum = sum + product;
      }
      volatile float scaled = p.alpha == 1.0f ? sum : p.alpha * sum;
      c[size_t(i * p.ldc + j)] = p.beta == 0.0f ? scaled : c[size_t(i * p.ldc + j)] + scaled;
    }
  }
  return c;
}

// The standard bound on a sum of K products in any order (Higham, Accuracy
// and Stability of Numerical Algorithms, 3.5): |fl(a.b) - a.b| <= gamma_K |a|.|b|,
// gamma_n = n u / (1 - n u), u = 2^-24. alpha's product and C's sum are two
// more roundings: gamma_(K+2) over alpha |a|.|b| + |C|. Returns the largest
// error over its bound (at most 1 holds the bound).
double worst_error_over_bound(const Product& p, const std::vector<float>& c) {
  const double u = std::ldexp(1.0, -24), n = double(p.K + 2), gamma = n * u / (1 - n * u);
  double worst = 0.0;
  for (int64_t i = 0; i < p.M; ++i) {
    for (int64_t j = 0; j < p.N; ++j) {
      double exact = 0.0, magnitude = 0.0;
      for (int64_t k = 0; k < p.K; ++k) {
        exact += double(p.a(i, k)) * p.b(k, j);
        magnitude += std::fabs(double(p.a(i, k)) * p.b(k, j));
      }
      exact *= p.alpha;
      magnitude *= std::fabs(p.alpha);
      const size_t at = size_t(i * p.ldc + j);
      if (p.beta != 0.0f) {
        exact += p.C[at];
        magnitude += std::fabs(p.C[at]);
      }
      const double bound = gamma * magnitude + 1e-300;
      worst = std::max(worst, std::fabs(double(c[at]) - exact) / bound);
    }
  }
  return worst;
}

// Shapes that cross the reference path's tiles (4 x 16) and blocks (64 x 128)
// at odd sizes, with every transpose, alpha and beta the backend uses.
std::vector<Product> products(std::mt19937& rng) {
  std::vector<Product> out;
  // 130 x 260 and 300 x 97 are large enough for the fast path to cut into
  // blocks per thread (along N, then along M), at edges off the 16s.
  const int64_t shapes[][3] = {{1, 1, 1},     {5, 17, 3},    {67, 131, 29},
                               {130, 260, 77}, {300, 97, 61}, {7, 3, 300}};
  for (const auto& s : shapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (float beta : {0.0f, 1.0f})
          out.push_back(random_product(rng, ta, tb, s[0], s[1], s[2], ta ? 0.125f : 1.0f, beta));
  return out;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(KernelGemm, ReferenceIsTheOrderedSumOnEveryVectorPathAndThreadCount) {
  std::mt19937 rng(fresh_seed());
  const std::vector<Product> cases = products(rng);
  std::vector<std::vector<float>> expected;
  for (const Product& p : cases) expected.push_back(ordered_sum(p));
  using kernels::cpu::SimdLevel;
  for (SimdLevel level : {SimdLevel::scalar, SimdLevel::avx2, SimdLevel::avx512}) {
    if (!kernels::cpu::force_simd_level(level).is_ok()) continue;  // this CPU lacks it
    for (int threads : {1, 2, 3}) {
      tbb::global_control limit(tbb::global_control::max_allowed_parallelism, size_t(threads));
      for (size_t n = 0; n < cases.size(); ++n) {
        const Product& p = cases[n];
        EXPECT_TRUE(bitwise_equal(run(p, /*reference=*/true), expected[n]))
            << "vectors " << kernels::cpu::simd_level_name(level) << ", " << threads
            << " threads, M N K " << p.M << " " << p.N << " " << p.K << ", trans " << p.trans_a
            << p.trans_b << ", beta " << p.beta;
      }
    }
  }
  kernels::cpu::reset_simd_level();
}

TEST(KernelGemm, ReferenceIsWithinTheSumsRoundingBound) {
  std::mt19937 rng(fresh_seed());
  for (const Product& p : products(rng)) {
    EXPECT_LE(worst_error_over_bound(p, run(p, /*reference=*/true)), 1.0)
        << "M N K " << p.M << " " << p.N << " " << p.K << ", trans " << p.trans_a << p.trans_b;
  }
}

// The fast path, in whatever class this process runs: within the same bound
// of float64 (any summation order obeys it), and so within twice it of the
// reference path.
void expect_fast_path_within_bound() {
  std::printf("%s\n", kernels::cpu::describe_cpu_kernels().c_str());
  std::mt19937 rng(fresh_seed());
  for (const Product& p : products(rng)) {
    const std::vector<float> fast = run(p, /*reference=*/false);
    EXPECT_LE(worst_error_over_bound(p, fast), 1.0)
        << kernels::cpu::gemm_kernel_name(kernels::cpu::gemm_info().kernel) << ": M N K " << p.M
        << " " << p.N << " " << p.K << ", trans " << p.trans_a << p.trans_b;
  }
}

TEST(KernelGemm, FastPathIsWithinTheSumsRoundingBound) {
  expect_fast_path_within_bound();
}

TEST(KernelGemm, NamesRoundTripAndAClassTheCpuLacksIsRefused) {
  for (GemmKernel k : {GemmKernel::baseline, GemmKernel::avx, GemmKernel::avx2, GemmKernel::avx512,
                       GemmKernel::reference})
    EXPECT_EQ(kernels::cpu::parse_gemm_kernel(kernels::cpu::gemm_kernel_name(k)), k);
  EXPECT_FALSE(kernels::cpu::parse_gemm_kernel("auto").has_value());
  EXPECT_FALSE(kernels::cpu::parse_gemm_kernel("skylakex").has_value());
  EXPECT_TRUE(kernels::cpu::cpu_can_run(GemmKernel::reference));
  EXPECT_TRUE(kernels::cpu::cpu_can_run(GemmKernel::baseline));
  if (kernels::cpu::cpu_gemm_kernel() != GemmKernel::avx512) {
    const Status s = kernels::cpu::select_gemm_kernel(GemmKernel::avx512);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("cannot run the avx512 kernels"), std::string::npos) << s.message();
  }
  // The reference path and back: the loaded class stays.
  const GemmKernel loaded = kernels::cpu::gemm_info().library_kernel;
  ASSERT_TRUE(kernels::cpu::select_gemm_kernel(GemmKernel::reference).is_ok());
  EXPECT_EQ(kernels::cpu::gemm_info().kernel, GemmKernel::reference);
  ASSERT_TRUE(kernels::cpu::select_gemm_kernel(loaded).is_ok());
  EXPECT_EQ(kernels::cpu::gemm_info().kernel, loaded);
  // Another class than the loaded one cannot replace it within the process.
  if (loaded != GemmKernel::baseline) {
    const Status s = kernels::cpu::select_gemm_kernel(GemmKernel::baseline);
    ASSERT_FALSE(s.is_ok());
    EXPECT_NE(s.message().find("already loaded"), std::string::npos) << s.message();
  }
}

// The CPU's flags as the kernel reports them (/proc/cpuinfo, first processor).
std::set<std::string> cpu_flags() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string word; words >> word;) flags.insert(word);
    return flags;
  }
  return {};
}

TEST(KernelGemm, ChosenClassIsTheBestTheCpusFeaturesAllow) {
  const std::set<std::string> flags = cpu_flags();
  if (flags.empty()) GTEST_SKIP() << "no flags line in /proc/cpuinfo";
  auto has = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (!flags.count(n)) return false;
    return true;
  };
  GemmKernel best = GemmKernel::baseline;
  if (has({"avx"})) best = GemmKernel::avx;
  if (has({"avx2", "fma"})) best = GemmKernel::avx2;
  if (has({"avx512f", "avx512dq", "avx512bw", "avx512vl"})) best = GemmKernel::avx512;
  std::printf("/proc/cpuinfo allows %s; %s\n", kernels::cpu::gemm_kernel_name(best).data(),
              kernels::cpu::describe_cpu_kernels().c_str());
  EXPECT_EQ(kernels::cpu::cpu_gemm_kernel(), best);
  if (std::getenv("STRATA_GEMM") != nullptr)
    GTEST_SKIP() << "STRATA_GEMM is set: the class is forced (ctest runs this test without it)";
  if (const char* core = std::getenv("OPENBLAS_CORETYPE"))
    GTEST_SKIP() << "OPENBLAS_CORETYPE=" << core << " is set here: OpenBLAS runs that core";
  const kernels::cpu::GemmInfo info = kernels::cpu::gemm_info();
  EXPECT_EQ(info.library_kernel, best) << "OpenBLAS runs its " << info.library_core << " kernels";
  EXPECT_EQ(info.kernel, best);
  EXPECT_EQ(info.chosen_by, "the CPU's features");
}

// The fast path cuts a large product into blocks per thread: the blocks
// depend on the thread count it is given, never on which of TBB's threads runs
// them, how many there are or who calls (the engine's ranks call at once).
TEST(KernelGemm, FastPathIsTheSameBitsWhicheverThreadsRunItsBlocks) {
  std::mt19937 rng(fresh_seed());
  for (int blocks : {2, 3}) {
    kernels::cpu::set_blas_threads(blocks);
    EXPECT_EQ(kernels::cpu::gemm_info().threads, blocks);
    for (const Product& p : {random_product(rng, false, false, 300, 97, 61, 1.0f, 1.0f),
                             random_product(rng, true, true, 130, 260, 77, 0.125f, 0.0f)}) {
      const std::vector<float> here = run(p, false);
      std::vector<float> one_thread;
      tbb::task_arena(1).execute([&] { one_thread = run(p, false); });
      EXPECT_TRUE(bitwise_equal(here, one_thread)) << blocks << " blocks on one thread";
      std::vector<float> first, second;
      std::thread other([&] { first = run(p, false); });
      second = run(p, false);
      other.join();
      EXPECT_TRUE(bitwise_equal(here, first) && bitwise_equal(here, second))
          << blocks << " blocks, two callers at once";
      EXPECT_LE(worst_error_over_bound(p, here), 1.0) << blocks << " blocks";
    }
  }
  kernels::cpu::set_blas_threads(0);
}

// Run once per class by ctest with STRATA_GEMM=<class>.
// float_mode.h: every thread that computes flushes subnormals, from before
// main() on the main thread, by inheritance on the threads started after it
// (a std::thread as the engine's lanes are, TBB's workers); and a product
// reads a subnormal operand as zero and flushes a subnormal result to zero,
// on the fast path and the reference alike.
TEST(KernelFloatMode, EveryThreadThatComputesFlushesSubnormals) {
  EXPECT_TRUE(kernels::cpu::flushes_subnormals());
  bool started = false;
  std::thread([&] { started = kernels::cpu::flushes_subnormals(); }).join();
  EXPECT_TRUE(started);
  std::atomic<int> runs{0}, flushing{0};
  tbb::parallel_for(0, 4096, [&](int) {
    runs.fetch_add(1);
    if (kernels::cpu::flushes_subnormals()) flushing.fetch_add(1);
  });
  EXPECT_EQ(flushing.load(), runs.load());
  for (bool reference : {false, true}) {
    // (1e-39 x 1) + (1e-20 x 1e-20): a subnormal operand and a subnormal product.
    const std::vector<float> a = {1e-39f, 1e-20f}, b = {1.0f, 1e-20f};
    float c = 1.0f;
    auto f = reference ? kernels::cpu::sgemm_reference : kernels::cpu::sgemm;
    f(false, false, 1, 1, 2, 1.0f, a.data(), 2, b.data(), 1, 0.0f, &c, 1);
    EXPECT_EQ(c, 0.0f) << (reference ? "reference" : "fast path");
  }
}

TEST(KernelGemmForced, TheForcedClassRunsWithinTheBound) {
  const char* forced = std::getenv("STRATA_GEMM");
  if (forced == nullptr) GTEST_SKIP() << "STRATA_GEMM is not set";
  const auto kernel = kernels::cpu::parse_gemm_kernel(forced);
  ASSERT_TRUE(kernel.has_value()) << forced;
  if (!kernels::cpu::cpu_can_run(*kernel))
    GTEST_SKIP() << "this CPU cannot run the " << forced << " kernels";
  ASSERT_TRUE(kernels::cpu::select_gemm_kernel_from_environment().is_ok());
  const kernels::cpu::GemmInfo info = kernels::cpu::gemm_info();
  EXPECT_EQ(info.kernel, *kernel) << info.library_core;
  EXPECT_EQ(info.chosen_by, std::string("STRATA_GEMM=") + forced);
  expect_fast_path_within_bound();
}

}  // namespace
}  // namespace strata::testing
