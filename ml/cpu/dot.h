// Dot products of one float32 row against weight rows of each storage type, shared by the
// products (kernels.cpp) and the one-call decode step (decode.cpp). The storage types: float32,
// bfloat16 (uint16_t), float16 (F16) and int8. 16-bit weights are converted exactly to float32
// and every product is summed in float32, so a 16-bit weight row gives the bits its float32
// conversion gives wherever the two are summed in the same order (every path but the 512-bit
// float16 one below, which sums sixteen lanes where the others sum eight).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define LLAMA_CHAT_AVX2 1
#endif

namespace llama_chat_cpu {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// A float16 (IEEE binary16) weight as its bits: a type of its own, so that the products pick its
// conversion by overload as they pick bfloat16's by uint16_t.
struct F16 {
  uint16_t bits;
};

// Exact: every float16 value, subnormals, infinities and NaNs included, is a float32 value.
inline float f16_to_float(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu,
                 mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: mantissa * 2^-24, normalized
    uint32_t m = mantissa, e = 113;
    while (!(m & 0x400u)) {
      m <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// a * b + c, fused where the build has fused multiply-adds, else two roundings: the tails below
// spell it out, since whether the compiler fuses an expression written a * b + c depends on its
// context, and a float32 and a float16 row of the same values must be summed alike.
inline float madd(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

#ifdef LLAMA_CHAT_AVX2
inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

// Eight weights as floats, from each storage type.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const uint16_t* w) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline __m256 load8(const int8_t* w) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
inline __m256 load8(const F16* w) {
#ifdef __F16C__
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
#else
  float v[8];
  for (int i = 0; i < 8; ++i) v[i] = f16_to_float(w[i].bits);
  return _mm256_loadu_ps(v);
#endif
}
#endif

inline float scalar(float w) { return w; }
inline float scalar(uint16_t w) { return bf16_to_float(w); }
inline float scalar(F16 w) { return f16_to_float(w.bits); }
inline float scalar(int8_t w) { return static_cast<float>(w); }

// One weight row against one input row. Four independent accumulators keep the multiply-adds
// from waiting on each other.
template <typename W>
inline float dot(const float* x, const W* w, int64_t k) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef LLAMA_CHAT_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 32 <= k; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), load8(w + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), load8(w + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), load8(w + i + 24), a3);
  }
  for (; i + 8 <= k; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), load8(w + i), a0);
  sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#else
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (; i + 8 <= k; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += x[i + j] * scalar(w[i + j]);
  for (int j = 0; j < 8; ++j) sum += acc[j];
#endif
  for (; i < k; ++i) sum = madd(x[i], scalar(w[i]), sum);
  return sum;
}

#ifdef LLAMA_CHAT_AVX2
// The four totals of a[0..3] as one vector, each total summed in the same order whichever
// product asks (dot4 and dot3x4 below give equal results for the same rows).
inline __m128 four_sums(const __m256* a) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}
#endif

// Four input rows against one weight row: the weights are loaded (and converted) once for all
// four. One accumulator per input row, eight weights a step, summed as dot3x4 sums them: a range
// of weight rows takes them three at a time there and one at a time at its end, and where a
// range ends (which depends on the thread count) must change no result.
template <typename W>
inline void dot4(const float* x, int64_t stride, const W* w, int64_t k, float* out) {
  int64_t i = 0;
  float sums[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef LLAMA_CHAT_AVX2
  __m256 a[4];
  for (auto& v : a) v = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 wi = load8(w + i);
    for (int r = 0; r < 4; ++r) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * stride + i), wi, a[r]);
  }
  _mm_storeu_ps(sums, four_sums(a));
#endif
  for (; i < k; ++i) {
    const float wi = scalar(w[i]);
    for (int r = 0; r < 4; ++r) sums[r] = madd(x[r * stride + i], wi, sums[r]);
  }
  for (int r = 0; r < 4; ++r) out[r] = sums[r];
}

// Three weight rows (each k long, one after another) against four input rows: out[q * 4 + r] is
// weight row q with input row r, twelve accumulators. It pays in steps of many rows and loses in
// steps of few (docs/batching.md, "Steps on the CPU"); in a loop of its own it is barely faster
// than dot4 (the compiler, short of registers, folds the weight loads into the multiply-adds).
// Each sum is dot4's, to the bit.
template <typename W>
inline void dot3x4(const float* x, int64_t stride, const W* w, int64_t k, float* out) {
#ifdef LLAMA_CHAT_AVX2
  int64_t i = 0;
  __m256 a[12];
  for (auto& v : a) v = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    const __m256 w0 = load8(w + i), w1 = load8(w + k + i), w2 = load8(w + 2 * k + i);
    for (int r = 0; r < 4; ++r) {
      const __m256 xr = _mm256_loadu_ps(x + r * stride + i);
      a[r] = _mm256_fmadd_ps(xr, w0, a[r]);
      a[4 + r] = _mm256_fmadd_ps(xr, w1, a[4 + r]);
      a[8 + r] = _mm256_fmadd_ps(xr, w2, a[8 + r]);
    }
  }
  for (int q = 0; q < 3; ++q) {
    float sums[4];
    _mm_storeu_ps(sums, four_sums(a + 4 * q));
    const W* wq = w + q * k;
    for (int64_t t = i; t < k; ++t) {
      const float wt = scalar(wq[t]);
      for (int r = 0; r < 4; ++r) sums[r] = madd(x[r * stride + t], wt, sums[r]);
    }
    for (int r = 0; r < 4; ++r) out[q * 4 + r] = sums[r];
  }
#else
  for (int q = 0; q < 3; ++q) dot4(x, stride, w + q * k, k, out + 4 * q);
#endif
}

#ifdef __AVX512F__
// float16 weights in 512-bit vectors: sixteen converted by one instruction (vcvtph2ps), half the
// instructions per weight of the eight-wide templates above, which counts where a product is
// bound by the core (several input rows) rather than by reading the weights. These overloads
// are taken over the templates; they sum as the templates do, in sixteen lanes instead of eight
// (the order of additions a float32 row of the same values takes differs: see the header's
// opening comment), and dot3x4's sums are dot4's to the bit.
inline __m512 load16(const F16* w) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}

inline float dot(const float* x, const F16* w, int64_t k) {
  int64_t i = 0;
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  for (; i + 64 <= k; i += 64) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load16(w + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), load16(w + i + 16), a1);
    a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 32), load16(w + i + 32), a2);
    a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 48), load16(w + i + 48), a3);
  }
  for (; i + 16 <= k; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), load16(w + i), a0);
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  for (; i < k; ++i) sum = madd(x[i], f16_to_float(w[i].bits), sum);
  return sum;
}

inline void dot4(const float* x, int64_t stride, const F16* w, int64_t k, float* out) {
  int64_t i = 0;
  __m512 a[4];
  for (auto& v : a) v = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m512 wi = load16(w + i);
    for (int r = 0; r < 4; ++r) a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * stride + i), wi, a[r]);
  }
  float sums[4];
  for (int r = 0; r < 4; ++r) sums[r] = _mm512_reduce_add_ps(a[r]);
  for (; i < k; ++i) {
    const float wi = f16_to_float(w[i].bits);
    for (int r = 0; r < 4; ++r) sums[r] = madd(x[r * stride + i], wi, sums[r]);
  }
  for (int r = 0; r < 4; ++r) out[r] = sums[r];
}

inline void dot3x4(const float* x, int64_t stride, const F16* w, int64_t k, float* out) {
  int64_t i = 0;
  __m512 a[12];
  for (auto& v : a) v = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m512 w0 = load16(w + i), w1 = load16(w + k + i), w2 = load16(w + 2 * k + i);
    for (int r = 0; r < 4; ++r) {
      const __m512 xr = _mm512_loadu_ps(x + r * stride + i);
      a[r] = _mm512_fmadd_ps(xr, w0, a[r]);
      a[4 + r] = _mm512_fmadd_ps(xr, w1, a[4 + r]);
      a[8 + r] = _mm512_fmadd_ps(xr, w2, a[8 + r]);
    }
  }
  for (int q = 0; q < 3; ++q) {
    float sums[4];
    for (int r = 0; r < 4; ++r) sums[r] = _mm512_reduce_add_ps(a[4 * q + r]);
    const F16* wq = w + q * k;
    for (int64_t t = i; t < k; ++t) {
      const float wt = f16_to_float(wq[t].bits);
      for (int r = 0; r < 4; ++r) sums[r] = madd(x[r * stride + t], wt, sums[r]);
    }
    for (int r = 0; r < 4; ++r) out[q * 4 + r] = sums[r];
  }
}
#endif

// int8 weights against activations rounded to 15-bit integers (one scale per input row): the
// products of pairs are summed in 32-bit integers by one instruction (vpmaddwd), two to three
// times fewer instructions per weight than converting every weight to float, which is what
// keeps a one-row int8 product at the memory's speed instead of the core's. The rounding of the
// activations is 2^-14 of the row's largest value, below float16's and far below the weights'.
constexpr float kActivationSteps = 16383.f;
// Sums of int16 pairs are below 2 * 127 * 16383 in size; this many 16-wide blocks fit an int32.
constexpr int64_t kBlocksPerFlush = 256;

#ifdef LLAMA_CHAT_AVX2
inline float dot_int8(const int16_t* x, const int8_t* w, int64_t k) {
  int64_t i = 0;
  float total = 0.f;
  while (i + 16 <= k) {
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    const int64_t stop = std::min<int64_t>(k, i + 16 * kBlocksPerFlush);
    for (; i + 32 <= stop; i += 32) {
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16)));
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i + 16));
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, x0));
      a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(w1, x1));
    }
    for (; i + 16 <= stop; i += 16) {
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
      a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))));
    }
    total += horizontal_sum(_mm256_cvtepi32_ps(_mm256_add_epi32(a0, a1)));
  }
  int64_t tail = 0;
  for (; i < k; ++i) tail += static_cast<int64_t>(x[i]) * w[i];
  return total + static_cast<float>(tail);
}

// dot_int8 of four rows of x (each `stride` apart) against one weight row, each weight block
// loaded and widened once for all four: the same lanes, flushes and sums as dot_int8, so each
// result is dot_int8's to the bit (integer sums are exact in any order).
inline void dot4_int8(const int16_t* x, int64_t stride, const int8_t* w, int64_t k, float* out) {
  int64_t i = 0;
  float total[4] = {0.f, 0.f, 0.f, 0.f};
  while (i + 16 <= k) {
    __m256i a0[4], a1[4];
    for (int r = 0; r < 4; ++r) a0[r] = a1[r] = _mm256_setzero_si256();
    const int64_t stop = std::min<int64_t>(k, i + 16 * kBlocksPerFlush);
    for (; i + 32 <= stop; i += 32) {
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16)));
      for (int r = 0; r < 4; ++r) {
        const int16_t* xr = x + r * stride + i;
        a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))));
        a1[r] = _mm256_add_epi32(a1[r],
                                 _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16))));
      }
    }
    for (; i + 16 <= stop; i += 16) {
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
      for (int r = 0; r < 4; ++r)
        a0[r] = _mm256_add_epi32(
            a0[r], _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * stride + i))));
    }
    for (int r = 0; r < 4; ++r) total[r] += horizontal_sum(_mm256_cvtepi32_ps(_mm256_add_epi32(a0[r], a1[r])));
  }
  for (int r = 0; r < 4; ++r) {
    int64_t tail = 0;
    for (int64_t t = i; t < k; ++t) tail += static_cast<int64_t>(x[r * stride + t]) * w[t];
    out[r] = total[r] + static_cast<float>(tail);
  }
}

// Each row of x as int16 steps of (largest magnitude / kActivationSteps); the step per row.
inline void round_rows(const float* x, int64_t rows, int64_t k, int16_t* out, float* steps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    float largest = 0.f;
    for (int64_t i = 0; i < k; ++i) largest = std::max(largest, std::abs(xr[i]));
    const float step = largest > 0.f ? largest / kActivationSteps : 1.f;
    const float inverse = 1.f / step;
    for (int64_t i = 0; i < k; ++i) out[r * k + i] = static_cast<int16_t>(std::nearbyint(xr[i] * inverse));
    steps[r] = step;
  }
}

#endif

}  // namespace llama_chat_cpu
