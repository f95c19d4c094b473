// A vector width's float operations under one set of names, so that a helper is written once over
// `V` (Floats8: __m256, Floats16: __m512, Floats1: one float) and compiles to the instructions it
// would have written out for that width: each operation is one intrinsic, in the same order, so
// a helper gives the same bits as a copy written for one width would.
#pragma once

#include "dot.h"

#include <cstdint>

// The wrappers are always inlined: a call would cost more than the instruction it wraps.
#define LLAMA_CHAT_VECTOR static inline __attribute__((always_inline))

namespace llama_chat_cpu {

// Plain floats, for builds without AVX2: a*b + c is a multiply and an add, as in the loops it
// replaces (no fused multiply-add there either).
struct Floats1 {
  using Vec = float;
  static constexpr int kWidth = 1;
  LLAMA_CHAT_VECTOR Vec zero() { return 0.f; }
  LLAMA_CHAT_VECTOR Vec broadcast(const float* x) { return *x; }
  LLAMA_CHAT_VECTOR Vec load(const float* p) { return *p; }
  LLAMA_CHAT_VECTOR void store(float* p, Vec v) { *p = v; }
  LLAMA_CHAT_VECTOR Vec add(Vec a, Vec b) { return a + b; }
  LLAMA_CHAT_VECTOR Vec fmadd(Vec a, Vec b, Vec c) { return a * b + c; }
  LLAMA_CHAT_VECTOR void prefetch(const void*) {}
};

#ifdef LLAMA_CHAT_AVX2
struct Floats8 {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  LLAMA_CHAT_VECTOR Vec zero() { return _mm256_setzero_ps(); }
  LLAMA_CHAT_VECTOR Vec set1(float x) { return _mm256_set1_ps(x); }
  LLAMA_CHAT_VECTOR Vec broadcast(const float* x) { return _mm256_broadcast_ss(x); }
  LLAMA_CHAT_VECTOR Vec load(const float* p) { return _mm256_loadu_ps(p); }
  LLAMA_CHAT_VECTOR void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  LLAMA_CHAT_VECTOR Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  LLAMA_CHAT_VECTOR Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  LLAMA_CHAT_VECTOR Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
  LLAMA_CHAT_VECTOR Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  LLAMA_CHAT_VECTOR Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  LLAMA_CHAT_VECTOR Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
  LLAMA_CHAT_VECTOR Vec round(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // 2^n of whole-valued n within a float's normal exponents, made in the exponent's bits.
  LLAMA_CHAT_VECTOR Vec exp2_whole(Vec n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  LLAMA_CHAT_VECTOR void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
};
#endif

#ifdef __AVX512F__
struct Floats16 {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  LLAMA_CHAT_VECTOR Vec zero() { return _mm512_setzero_ps(); }
  LLAMA_CHAT_VECTOR Vec set1(float x) { return _mm512_set1_ps(x); }
  LLAMA_CHAT_VECTOR Vec broadcast(const float* x) { return _mm512_set1_ps(*x); }
  LLAMA_CHAT_VECTOR Vec load(const float* p) { return _mm512_loadu_ps(p); }
  LLAMA_CHAT_VECTOR void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  LLAMA_CHAT_VECTOR Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  LLAMA_CHAT_VECTOR Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  LLAMA_CHAT_VECTOR Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
  LLAMA_CHAT_VECTOR Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  LLAMA_CHAT_VECTOR Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  LLAMA_CHAT_VECTOR Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }
  LLAMA_CHAT_VECTOR Vec round(Vec x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  LLAMA_CHAT_VECTOR Vec exp2_whole(Vec n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  LLAMA_CHAT_VECTOR void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }
};
#endif

// The constants of e^x in vectors (exp_of): the clamp, log2(e), ln2 in two parts (n ln2 is
// exact), and e^r ~ 1 + r + r^2 (kC[5] + kC[4] r + ... + kC[0] r^5), in Horner's order.
namespace exp_poly {
constexpr float kLowest = -87.3f, kHighest = 88.3f, kLog2e = 1.44269504f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kC[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                         4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace exp_poly

#ifdef LLAMA_CHAT_AVX2
// e^x for a vector of floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial (the
// classic single-precision coefficients), 2^n put into the exponent bits. Relative error about
// 2e-7; inputs are clamped to where a float's e^x is finite and normal. Softmax and SwiGLU take
// one per score and hidden unit: std::exp, one value at a time, was a visible part of a batched
// step (docs/batching.md, "Steps on the CPU").
template <typename V>
LLAMA_CHAT_VECTOR typename V::Vec exp_of(typename V::Vec x) {
  using namespace exp_poly;
  x = V::min(V::max(x, V::set1(kLowest)), V::set1(kHighest));
  const typename V::Vec n = V::round(V::mul(x, V::set1(kLog2e)));
  typename V::Vec r = V::fnmadd(n, V::set1(kLn2High), x);
  r = V::fnmadd(n, V::set1(kLn2Low), r);
  typename V::Vec p = V::set1(kC[0]);
  for (int i = 1; i < 6; ++i) p = V::fmadd(p, r, V::set1(kC[i]));
  p = V::fmadd(p, V::mul(r, r), V::add(r, V::set1(1.f)));
  return V::mul(p, V::exp2_whole(n));
}
#endif

// The widest vector of the build.
#if defined(__AVX512F__)
using Widest = Floats16;
#elif defined(LLAMA_CHAT_AVX2)
using Widest = Floats8;
#else
using Widest = Floats1;
#endif

}  // namespace llama_chat_cpu

#undef LLAMA_CHAT_VECTOR
