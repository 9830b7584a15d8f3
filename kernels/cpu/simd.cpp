#include "kernels/cpu/simd.h"

#include <cpuid.h>
#include <tbb/parallel_for.h>
#include <xmmintrin.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/cpu/float_mode.h"

namespace strata::kernels::cpu {

namespace {
constexpr unsigned kFlushToZero = 0x8000, kDenormalsAreZero = 0x0040;  // MXCSR bits
}  // namespace

void flush_subnormals_on_this_thread() {
  _mm_setcsr(_mm_getcsr() | kFlushToZero | kDenormalsAreZero);
}

bool flushes_subnormals() {
  const unsigned both = kFlushToZero | kDenormalsAreZero;
  return (_mm_getcsr() & both) == both;
}

namespace {

// float_mode.h: the thread that loads the kernels flushes subnormals from
// before main(), and every thread it starts inherits the mode.
[[maybe_unused]] const bool flushing_from_the_start = [] {
  flush_subnormals_on_this_thread();
  return true;
}();

// -1: automatic; otherwise a SimdLevel forced by force_simd_level().
std::atomic<int> forced_level{-1};

bool cpu_has_f16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  return (ecx & bit_F16C) != 0;
}

SimdLevel detect_cpu_level() {
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wider registers.
  const bool avx2 =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
  if (avx2 && __builtin_cpu_supports("avx512f")) return SimdLevel::avx512;
  if (avx2) return SimdLevel::avx2;
  return SimdLevel::scalar;
}

SimdLevel environment_cap(SimdLevel cpu) {
  const char* value = std::getenv("STRATA_SIMD");
  if (value == nullptr || *value == '\0') return cpu;
  const std::string name(value);
  SimdLevel wanted = cpu;
  if (name == "scalar") wanted = SimdLevel::scalar;
  if (name == "avx2") wanted = SimdLevel::avx2;
  if (name == "avx512") wanted = SimdLevel::avx512;
  if (name != "scalar" && name != "avx2" && name != "avx512") {
    std::fprintf(stderr, "warning: STRATA_SIMD='%s' is not scalar, avx2 or avx512; ignored\n",
                 value);
  }
  return static_cast<int>(wanted) < static_cast<int>(cpu) ? wanted : cpu;
}

}  // namespace

std::string_view simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::scalar:
      return "scalar";
    case SimdLevel::avx2:
      return "avx2";
    case SimdLevel::avx512:
      return "avx512";
  }
  return "unknown";
}

std::string_view element_type_name(ElementType type) {
  switch (type) {
    case ElementType::f32:
      return "fp32";
    case ElementType::bf16:
      return "bf16";
    case ElementType::f16:
      return "fp16";
  }
  return "unknown";
}

std::size_t element_size(ElementType type) {
  return type == ElementType::f32 ? 4 : 2;
}

SimdLevel cpu_simd_level() {
  static const SimdLevel level = detect_cpu_level();
  return level;
}

SimdLevel active_simd_level() {
  const int forced = forced_level.load(std::memory_order_relaxed);
  if (forced >= 0) return static_cast<SimdLevel>(forced);
  static const SimdLevel automatic = environment_cap(cpu_simd_level());
  return automatic;
}

Status force_simd_level(SimdLevel level) {
  if (static_cast<int>(level) > static_cast<int>(cpu_simd_level())) {
    return Status::error("force_simd_level: this CPU does not support " +
                         std::string(simd_level_name(level)) +
                         " (best: " + std::string(simd_level_name(cpu_simd_level())) + ")");
  }
  forced_level.store(static_cast<int>(level), std::memory_order_relaxed);
  return Status::ok();
}

void reset_simd_level() {
  forced_level.store(-1, std::memory_order_relaxed);
}

void widen_to_float(const void* source, ElementType type, float* out, int64_t n) {
  if (type == ElementType::f32) {
    std::memcpy(out, source, size_t(n) * 4);
    return;
  }
  const auto* bits = static_cast<const uint16_t*>(source);
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, n, 1 << 16), [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t i = r.begin(); i < r.end(); ++i)
          out[i] = type == ElementType::bf16 ? bf16_to_float(bits[i]) : f16_to_float(bits[i]);
      });
}

}  // namespace strata::kernels::cpu
