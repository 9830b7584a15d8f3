// The AdamW kernel: one scalar element function and two vector loops
// (AVX2 + F16C + FMA, AVX-512) that perform the same IEEE operations, fused
// multiply-adds included, in the same order. This file is compiled with
// -ffp-contract=off (kernels/CMakeLists.txt) so that the compiler fuses no
// other multiply and add in one path but not in another; that is what keeps
// the paths bitwise identical.
// GCC 12 warns inside its own avx512fintrin.h (the _mm512_undefined_* idiom,
// GCC bug 105593) when AVX-512 intrinsics are used under a target attribute.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "kernels/cpu/adamw.h"

#include <cmath>
#include <cstring>
#include <string>

#include "kernels/cpu/simd_convert.h"

namespace strata::kernels::cpu {
namespace {

// Every constant of the update, rounded once to fp32 from float64.
struct StepConstants {
  float grad_scale;
  float decay;  // 1 - lr * wd (AdamW), 1 (Adam)
  float l2;     // wd (Adam), 0 (AdamW)
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float neg_step_size;              // -lr / (1 - beta1^t)
  float inv_bias_correction2_sqrt;  // 1 / sqrt(1 - beta2^t)
  float eps;
  bool decoupled;
};

StepConstants make_constants(const AdamWHyperparams& h) {
  const double t = static_cast<double>(h.step);
  const double bias_correction1 = h.bias_correction ? 1.0 - std::pow(h.beta1, t) : 1.0;
  const double bias_correction2 = h.bias_correction ? 1.0 - std::pow(h.beta2, t) : 1.0;
  StepConstants c{};
  c.grad_scale = static_cast<float>(h.grad_scale);
  c.decoupled = h.decoupled_weight_decay;
  c.decay = h.decoupled_weight_decay ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.l2 = h.decoupled_weight_decay ? 0.0f : static_cast<float>(h.weight_decay);
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.neg_step_size = -static_cast<float>(h.lr / bias_correction1);
  c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));
  c.eps = static_cast<float>(h.eps);
  return c;
}

// The reference arithmetic for one element; the vector loops mirror it.
template <ElementType G, CopyKind C>
inline void update_element(const AdamWShard& s, const StepConstants& c, int64_t i) {
  float g = load_as_float<G>(s.grad, i) * c.grad_scale;
  float p = s.master[i];
  if (c.decoupled) {
    p = p * c.decay;
  } else {
    g = std::fma(c.l2, p, g);
  }
  const float m = std::fma(c.one_minus_beta1, g, s.exp_avg[i] * c.beta1);
  const float v = std::fma(c.one_minus_beta2 * g, g, s.exp_avg_sq[i] * c.beta2);
  const float denom = std::fma(std::sqrt(v), c.inv_bias_correction2_sqrt, c.eps);
  p = p + (c.neg_step_size * m) / denom;
  s.exp_avg[i] = m;
  s.exp_avg_sq[i] = v;
  s.master[i] = p;
  store_from_float<C>(s.copy, i, p);
}

template <ElementType G, CopyKind C>
void update_scalar(const AdamWShard& s, const StepConstants& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) update_element<G, C>(s, c, i);
}

// --- AVX2 + F16C + FMA: 16 elements (two vectors) per iteration --------------------------

struct Avx2Constants {
  __m256 grad_scale, decay, l2, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_step_size,
      inv_bias_correction2_sqrt, eps;
};

// Updates elements [i, i + 8) of master, m and v; returns the new master.
template <ElementType G>
STRATA_TARGET_AVX2 inline __m256 update8(const Avx2Constants& k, bool decoupled, float* master,
                                         float* exp_avg, float* exp_avg_sq, const void* grad,
                                         int64_t i) {
  __m256 g = _mm256_mul_ps(load8_as_float<G>(grad, i), k.grad_scale);
  __m256 p = _mm256_loadu_ps(master + i);
  if (decoupled) {
    p = _mm256_mul_ps(p, k.decay);
  } else {
    g = _mm256_fmadd_ps(k.l2, p, g);
  }
  const __m256 m =
      _mm256_fmadd_ps(k.one_minus_beta1, g, _mm256_mul_ps(_mm256_loadu_ps(exp_avg + i), k.beta1));
  const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(k.one_minus_beta2, g), g,
                                   _mm256_mul_ps(_mm256_loadu_ps(exp_avg_sq + i), k.beta2));
  const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), k.inv_bias_correction2_sqrt, k.eps);
  p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(k.neg_step_size, m), denom));
  _mm256_storeu_ps(exp_avg + i, m);
  _mm256_storeu_ps(exp_avg_sq + i, v);
  _mm256_storeu_ps(master + i, p);
  return p;
}

template <ElementType G, CopyKind C>
STRATA_TARGET_AVX2 void update_avx2(const AdamWShard& s, const StepConstants& c, int64_t begin,
                                    int64_t end) {
  const Avx2Constants k{_mm256_set1_ps(c.grad_scale),
                        _mm256_set1_ps(c.decay),
                        _mm256_set1_ps(c.l2),
                        _mm256_set1_ps(c.beta1),
                        _mm256_set1_ps(c.one_minus_beta1),
                        _mm256_set1_ps(c.beta2),
                        _mm256_set1_ps(c.one_minus_beta2),
                        _mm256_set1_ps(c.neg_step_size),
                        _mm256_set1_ps(c.inv_bias_correction2_sqrt),
                        _mm256_set1_ps(c.eps)};
  // Locals, so the compiler need not reload them after every store.
  float* const master = s.master;
  float* const exp_avg = s.exp_avg;
  float* const exp_avg_sq = s.exp_avg_sq;
  const void* const grad = s.grad;
  void* const copy = s.copy;
  const bool decoupled = c.decoupled;
  int64_t i = begin;
  if constexpr (C == CopyKind::none) {
    for (; i + 8 <= end; i += 8) update8<G>(k, decoupled, master, exp_avg, exp_avg_sq, grad, i);
  } else {
    // The copy is written 32 bytes at a time with non-temporal stores (it goes
    // to the GPU, not back to this CPU, and they save reading each line
    // first): peel elements until it is aligned.
    while (i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(copy) + i) & 31) != 0) {
      update_element<G, C>(s, c, i++);
    }
    for (; i + 16 <= end; i += 16) {
      const __m256 low = update8<G>(k, decoupled, master, exp_avg, exp_avg_sq, grad, i);
      const __m256 high = update8<G>(k, decoupled, master, exp_avg, exp_avg_sq, grad, i + 8);
      store16_from_float_avx2<C>(copy, i, low, high);
    }
    _mm_sfence();  // order the streamed stores before returning
    for (; i + 8 <= end; i += 8) {
      store8_from_float<C>(copy, i, update8<G>(k, decoupled, master, exp_avg, exp_avg_sq, grad, i));
    }
  }
  for (; i < end; ++i) update_element<G, C>(s, c, i);
}

// --- AVX-512: 16 elements per iteration ---------------------------------------------

template <ElementType G, CopyKind C>
STRATA_TARGET_AVX512 void update_avx512(const AdamWShard& s, const StepConstants& c, int64_t begin,
                                        int64_t end) {
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 l2 = _mm512_set1_ps(c.l2);
  const __m512 beta1 = _mm512_set1_ps(c.beta1);
  const __m512 one_minus_beta1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(c.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 neg_step_size = _mm512_set1_ps(c.neg_step_size);
  const __m512 inv_bias_correction2_sqrt = _mm512_set1_ps(c.inv_bias_correction2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps);
  // Locals, so the compiler need not reload them after every store.
  float* const master = s.master;
  float* const exp_avg = s.exp_avg;
  float* const exp_avg_sq = s.exp_avg_sq;
  const void* const grad = s.grad;
  void* const copy = s.copy;
  const bool decoupled = c.decoupled;
  int64_t i = begin;
  // The copy is written with non-temporal stores (it goes to the GPU, not back
  // to this CPU, and they save reading each line first): peel elements until
  // it is aligned.
  if constexpr (C != CopyKind::none) {
    while (i < end && (reinterpret_cast<uintptr_t>(static_cast<uint16_t*>(copy) + i) & 31) != 0) {
      update_element<G, C>(s, c, i++);
    }
  }
  for (; i + 16 <= end; i += 16) {
    __m512 g = _mm512_mul_ps(load16_as_float<G>(grad, i), grad_scale);
    __m512 p = _mm512_loadu_ps(master + i);
    if (decoupled) {
      p = _mm512_mul_ps(p, decay);
    } else {
      g = _mm512_fmadd_ps(l2, p, g);
    }
    const __m512 m =
        _mm512_fmadd_ps(one_minus_beta1, g, _mm512_mul_ps(_mm512_loadu_ps(exp_avg + i), beta1));
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g,
                                     _mm512_mul_ps(_mm512_loadu_ps(exp_avg_sq + i), beta2));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), inv_bias_correction2_sqrt, eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m), denom));
    _mm512_storeu_ps(exp_avg + i, m);
    _mm512_storeu_ps(exp_avg_sq + i, v);
    _mm512_storeu_ps(master + i, p);
    store16_from_float<C, true>(copy, i, p);
  }
  if constexpr (C != CopyKind::none) _mm_sfence();
  for (; i < end; ++i) update_element<G, C>(s, c, i);
}

using RangeFunction = void (*)(const AdamWShard&, const StepConstants&, int64_t, int64_t);

template <ElementType G, CopyKind C>
RangeFunction pick_for_level(SimdLevel level) {
  switch (level) {
    case SimdLevel::avx512:
      return &update_avx512<G, C>;
    case SimdLevel::avx2:
      return &update_avx2<G, C>;
    case SimdLevel::scalar:
      break;
  }
  return &update_scalar<G, C>;
}

template <ElementType G>
RangeFunction pick_for_copy(const AdamWShard& s, SimdLevel level) {
  if (s.copy == nullptr) return pick_for_level<G, CopyKind::none>(level);
  if (s.copy_type == ElementType::bf16) return pick_for_level<G, CopyKind::bf16>(level);
  return pick_for_level<G, CopyKind::f16>(level);
}

RangeFunction pick(const AdamWShard& s, SimdLevel level) {
  switch (s.grad_type) {
    case ElementType::f32:
      return pick_for_copy<ElementType::f32>(s, level);
    case ElementType::bf16:
      return pick_for_copy<ElementType::bf16>(s, level);
    case ElementType::f16:
      return pick_for_copy<ElementType::f16>(s, level);
  }
  return nullptr;
}

Status check(const AdamWShard& s, const AdamWHyperparams& h) {
  if (s.numel < 0)
    return Status::error("adamw_step: negative shard length " + std::to_string(s.numel));
  if (s.numel > 0 && (s.master == nullptr || s.exp_avg == nullptr || s.exp_avg_sq == nullptr ||
                      s.grad == nullptr)) {
    return Status::error("adamw_step: master, exp_avg, exp_avg_sq and grad must all be given");
  }
  if (s.copy != nullptr && s.copy_type == ElementType::f32) {
    return Status::error(
        "adamw_step: the compute copy must be bf16 or fp16 (fp32 mode has no copy)");
  }
  if (h.step < 1)
    return Status::error("adamw_step: step must be >= 1, got " + std::to_string(h.step));
  if (!(h.lr >= 0.0))
    return Status::error("adamw_step: invalid learning rate " + std::to_string(h.lr));
  if (!(h.eps >= 0.0)) return Status::error("adamw_step: invalid eps " + std::to_string(h.eps));
  if (!(h.beta1 >= 0.0 && h.beta1 < 1.0) || !(h.beta2 >= 0.0 && h.beta2 < 1.0)) {
    return Status::error("adamw_step: betas must lie in [0, 1), got " + std::to_string(h.beta1) +
                         ", " + std::to_string(h.beta2));
  }
  if (!(h.weight_decay >= 0.0)) {
    return Status::error("adamw_step: invalid weight_decay " + std::to_string(h.weight_decay));
  }
  return Status::ok();
}

}  // namespace

Status adamw_step(const AdamWShard& shard, const AdamWHyperparams& hyper) {
  if (Status status = check(shard, hyper); !status) return status;
  const StepConstants constants = make_constants(hyper);
  const RangeFunction update = pick(shard, active_simd_level());
  for_each_static_range(shard.numel,
                        [&](int64_t begin, int64_t end) { update(shard, constants, begin, end); });
  return Status::ok();
}

void first_touch_zero(float* data, int64_t n) {
  for_each_static_range(n, [&](int64_t begin, int64_t end) {
    std::memset(data + begin, 0, static_cast<std::size_t>(end - begin) * sizeof(float));
  });
}

}  // namespace strata::kernels::cpu
