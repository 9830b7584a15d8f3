// The fast path's loader and the choice between the paths (gemm.h).
//
// OpenBLAS chooses its kernels in a constructor that runs when the library
// loads, reading OPENBLAS_CORETYPE, and no later call changes them. strata
// therefore does not link OpenBLAS: it loads it with dlopen on first use,
// with OPENBLAS_CORETYPE naming the class chosen here from the CPU's
// features, and puts the environment back as it was right after.
#include "kernels/cpu/gemm.h"

#include <cblas.h>
#include <dlfcn.h>
#include <tbb/blocked_range.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "kernels/cpu/simd.h"

#ifndef STRATA_OPENBLAS_LIBRARY
#define STRATA_OPENBLAS_LIBRARY ""
#endif

namespace strata::kernels::cpu {
namespace {

using SgemmFunction = decltype(&cblas_sgemm);

struct OpenBlas {
  SgemmFunction sgemm = nullptr;
  void (*set_num_threads)(int) = nullptr;
  char* (*get_corename)() = nullptr;
  char* (*get_config)() = nullptr;
  GemmKernel kernel = GemmKernel::baseline;  // what the loaded core is
  std::string core;                          // OpenBLAS's name for it
  std::string version;                       // "OpenBLAS 0.3.21"
  std::string chosen_by;
};

// The class each OpenBLAS core belongs to; unknown names are baseline.
GemmKernel kernel_of_core(std::string core) {
  for (char& c : core) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* name : {"skylakex", "cooperlake", "sapphirerapids"})
    if (core == name) return GemmKernel::avx512;
  for (const char* name : {"haswell", "zen", "excavator"})
    if (core == name) return GemmKernel::avx2;
  for (const char* name : {"sandybridge", "bulldozer", "piledriver", "steamroller"})
    if (core == name) return GemmKernel::avx;
  return GemmKernel::baseline;
}

const char* core_of_kernel(GemmKernel kernel) {
  switch (kernel) {
    case GemmKernel::avx512:
      return "SKYLAKEX";
    case GemmKernel::avx2:
      return "HASWELL";
    case GemmKernel::avx:
      return "SANDYBRIDGE";
    default:
      return "PRESCOTT";
  }
}

struct Choice {
  std::mutex mutex;
  bool environment_read = false;
  bool selected = false;  // by select_gemm_kernel or STRATA_GEMM
  GemmKernel kernel = GemmKernel::baseline;
  std::string selected_by;
  int threads = 0;  // set_blas_threads; 0: one per core the process may use
  const OpenBlas* openblas = nullptr;
};

Choice& choice() {
  static Choice c;
  return c;
}

// Fast reads of the current path by sgemm (written under the mutex).
std::atomic<bool> use_reference{false};
std::atomic<const OpenBlas*> loaded{nullptr};
// The blocks the fast path cuts a large product into (the product's threads).
std::atomic<int> product_parts{1};

[[noreturn]] void fail(const std::string& message) {
  std::fprintf(stderr, "strata: %s\n", message.c_str());
  std::exit(2);
}

std::string choices() {
  return "auto, avx512, avx2, avx, baseline or reference";
}

Status select_locked(Choice& c, GemmKernel kernel, std::string by) {
  if (!cpu_can_run(kernel)) {
    return Status::error(by + ": this CPU cannot run the " + std::string(gemm_kernel_name(kernel)) +
                         " kernels (its best class is " +
                         std::string(gemm_kernel_name(cpu_gemm_kernel())) +
                         "); choose that one or an older class, or auto");
  }
  if (c.openblas != nullptr && kernel != GemmKernel::reference && c.openblas->kernel != kernel) {
    return Status::error(
        by + ": OpenBLAS is already loaded with its " + c.openblas->core + " kernels (" +
        std::string(gemm_kernel_name(c.openblas->kernel)) +
        "); the class is chosen once per process, before the first product (set STRATA_GEMM)");
  }
  c.selected = true;
  c.kernel = kernel;
  c.selected_by = std::move(by);
  use_reference.store(kernel == GemmKernel::reference);
  return Status::ok();
}

Status read_environment_locked(Choice& c) {
  if (c.environment_read) return Status::ok();
  c.environment_read = true;
  const char* value = std::getenv("STRATA_GEMM");
  if (value == nullptr || *value == '\0' || std::string_view(value) == "auto") return Status::ok();
  const std::optional<GemmKernel> kernel = parse_gemm_kernel(value);
  if (!kernel) {
    return Status::error(std::string("STRATA_GEMM=") + value + " is not one of " + choices());
  }
  if (c.selected) return Status::ok();  // an explicit selection wins over the environment
  return select_locked(c, *kernel, std::string("STRATA_GEMM=") + value);
}

template <typename Function>
Function symbol(void* library, const char* name) {
  void* address = dlsym(library, name);
  if (address == nullptr) fail(std::string("OpenBLAS has no ") + name + "; install libopenblas0");
  return reinterpret_cast<Function>(address);
}

// Loads OpenBLAS with the chosen class; exits with one line when it cannot.
const OpenBlas* load_locked(Choice& c) {
  if (c.openblas != nullptr) return c.openblas;
  if (Status s = read_environment_locked(c); !s.is_ok()) fail(s.message());
  auto* blas = new OpenBlas;  // lives as long as the process, as the library does
  const char* inherited_core = std::getenv("OPENBLAS_CORETYPE");
  const char* inherited_threads = std::getenv("OPENBLAS_NUM_THREADS");
  const std::string saved_threads = inherited_threads != nullptr ? inherited_threads : "";
  const std::string saved_core = inherited_core != nullptr ? inherited_core : "";
  GemmKernel wanted = cpu_gemm_kernel();
  if (c.selected && c.kernel != GemmKernel::reference) {
    wanted = c.kernel;
    blas->chosen_by = c.selected_by;
  } else if (inherited_core != nullptr && *inherited_core != '\0') {
    blas->chosen_by = "OPENBLAS_CORETYPE=" + saved_core;
  } else {
    blas->chosen_by = "the CPU's features";
  }
  const bool steer = blas->chosen_by.rfind("OPENBLAS_CORETYPE", 0) != 0;
  if (steer) setenv("OPENBLAS_CORETYPE", core_of_kernel(wanted), 1);
  // One thread: OpenBLAS starts no threads of its own (the products run on TBB's).
  setenv("OPENBLAS_NUM_THREADS", "1", 1);
  void* library = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
  std::string first_error = library == nullptr ? dlerror() : "";
  if (library == nullptr && *STRATA_OPENBLAS_LIBRARY != '\0')
    library = dlopen(STRATA_OPENBLAS_LIBRARY, RTLD_NOW | RTLD_LOCAL);
  if (steer) {
    if (inherited_core != nullptr)
      setenv("OPENBLAS_CORETYPE", saved_core.c_str(), 1);
    else
      unsetenv("OPENBLAS_CORETYPE");
  }
  if (inherited_threads != nullptr)
    setenv("OPENBLAS_NUM_THREADS", saved_threads.c_str(), 1);
  else
    unsetenv("OPENBLAS_NUM_THREADS");
  if (library == nullptr) {
    fail("cannot load OpenBLAS (" + first_error +
         "): install libopenblas0 (tools/setup-debian does), or put its folder on LD_LIBRARY_PATH");
  }
  blas->sgemm = symbol<SgemmFunction>(library, "cblas_sgemm");
  blas->set_num_threads = symbol<void (*)(int)>(library, "openblas_set_num_threads");
  blas->get_corename = symbol<char* (*)()>(library, "openblas_get_corename");
  blas->get_config = symbol<char* (*)()>(library, "openblas_get_config");
  blas->core = blas->get_corename();
  blas->kernel = kernel_of_core(blas->core);
  // "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64": the first two words.
  const std::string config = blas->get_config();
  const size_t second_space = config.find(' ', config.find(' ') + 1);
  blas->version = config.substr(0, second_space);
  if (steer && blas->kernel != wanted) {
    blas->chosen_by +=
        std::string(", which asked for ") + core_of_kernel(wanted) + " (this OpenBLAS lacks it)";
  }
  blas->set_num_threads(1);
  product_parts.store(c.threads > 0 ? c.threads : std::max(1, tbb::info::default_concurrency()));
  c.openblas = blas;
  loaded.store(blas);
  return blas;
}

const OpenBlas& openblas() {
  if (const OpenBlas* blas = loaded.load(std::memory_order_acquire)) return *blas;
  Choice& c = choice();
  std::lock_guard lock(c.mutex);
  return *load_locked(c);
}

// The reference path is chosen (read STRATA_GEMM once first).
bool reference_selected() {
  static const bool environment_checked = [] {
    Choice& c = choice();
    std::lock_guard lock(c.mutex);
    if (Status s = read_environment_locked(c); !s.is_ok()) fail(s.message());
    return true;
  }();
  (void)environment_checked;
  return use_reference.load(std::memory_order_relaxed);
}

}  // namespace

std::string_view gemm_kernel_name(GemmKernel kernel) {
  switch (kernel) {
    case GemmKernel::baseline:
      return "baseline";
    case GemmKernel::avx:
      return "avx";
    case GemmKernel::avx2:
      return "avx2";
    case GemmKernel::avx512:
      return "avx512";
    case GemmKernel::reference:
      return "reference";
  }
  return "unknown";
}

std::optional<GemmKernel> parse_gemm_kernel(std::string_view name) {
  for (GemmKernel k : {GemmKernel::baseline, GemmKernel::avx, GemmKernel::avx2, GemmKernel::avx512,
                       GemmKernel::reference})
    if (name == gemm_kernel_name(k)) return k;
  return std::nullopt;
}

GemmKernel cpu_gemm_kernel() {
  static const GemmKernel best = [] {
    __builtin_cpu_init();
    // __builtin_cpu_supports also checks that the OS saves the registers (XGETBV).
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
      return GemmKernel::avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return GemmKernel::avx2;
    if (__builtin_cpu_supports("avx")) return GemmKernel::avx;
    return GemmKernel::baseline;
  }();
  return best;
}

bool cpu_can_run(GemmKernel kernel) {
  return kernel == GemmKernel::reference ||
         static_cast<int>(kernel) <= static_cast<int>(cpu_gemm_kernel());
}

Status select_gemm_kernel(GemmKernel kernel) {
  Choice& c = choice();
  std::lock_guard lock(c.mutex);
  c.environment_read = true;  // an explicit choice replaces STRATA_GEMM
  return select_locked(c, kernel, "--gemm " + std::string(gemm_kernel_name(kernel)));
}

Status select_gemm_kernel_from_environment() {
  Choice& c = choice();
  std::lock_guard lock(c.mutex);
  return read_environment_locked(c);
}

GemmInfo gemm_info() {
  const OpenBlas& blas = openblas();
  GemmInfo info;
  info.library_kernel = blas.kernel;
  info.library = blas.version;
  info.library_core = blas.core;
  info.kernel = use_reference.load() ? GemmKernel::reference : blas.kernel;
  {
    Choice& c = choice();
    std::lock_guard lock(c.mutex);
    info.chosen_by = info.kernel == GemmKernel::reference ? c.selected_by : blas.chosen_by;
  }
  info.threads = info.kernel == GemmKernel::reference ? tbb::this_task_arena::max_concurrency()
                                                      : product_parts.load();
  return info;
}

std::string describe_cpu_kernels() {
  const GemmInfo info = gemm_info();
  std::string line = "gemm " + std::string(gemm_kernel_name(info.kernel));
  if (info.kernel == GemmKernel::reference) {
    line += " (strata's, the same bits on every x86-64; chosen by " + info.chosen_by + ")";
  } else {
    line += " (" + info.library + " " + info.library_core + " kernels, chosen by " +
            info.chosen_by + ")";
  }
  line += ", " + std::to_string(info.threads) + (info.threads == 1 ? " thread" : " threads");
  line += "; adamw simd " + std::string(simd_level_name(active_simd_level()));
  return line;
}

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (beta != 0.0f && beta != 1.0f) fail("sgemm: beta must be 0 or 1");
  if (reference_selected()) {
    sgemm_reference(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const OpenBlas& blas = openblas();
  auto product = [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    const float* a = trans_a ? A + m0 : A + m0 * lda;
    const float* b = trans_b ? B + n0 * ldb : B + n0;
    blas.sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
               trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m1 - m0),
               static_cast<blasint>(n1 - n0), static_cast<blasint>(K), alpha, a,
               static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, C + m0 * ldc + n0,
               static_cast<blasint>(ldc));
  };
  // A product of 2 MFLOP or more is cut along C's longer side into one block
  // per thread (edges on multiples of 16), each a single-threaded OpenBLAS
  // call run as a TBB task: the cuts depend on the shape and the thread count
  // only, and the products share TBB's threads with every other kernel
  // instead of waking threads of their own against them.
  const bool rows = M >= N;
  const int64_t side = rows ? M : N;
  const int64_t parts = std::min<int64_t>(product_parts.load(std::memory_order_relaxed), side / 32);
  if (parts <= 1 || 2.0 * double(M) * double(N) * double(K) < double(1 << 21)) {
    product(0, M, 0, N);
    return;
  }
  auto edge = [&](int64_t i) { return i == parts ? side : side * i / parts / 16 * 16; };
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, parts, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t i = r.begin(); i < r.end(); ++i) {
          if (rows)
            product(edge(i), edge(i + 1), 0, N);
          else
            product(0, M, edge(i), edge(i + 1));
        }
      },
      tbb::static_partitioner());
}

void set_blas_threads(int threads) {
  if (threads <= 0) threads = tbb::info::default_concurrency();
  threads = threads > 0 ? threads : 1;
  Choice& c = choice();
  std::lock_guard lock(c.mutex);
  c.threads = threads;
  product_parts.store(threads);
}

}  // namespace strata::kernels::cpu
