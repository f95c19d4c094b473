// A KV cache's rows as the one-call decode step reads and writes them (decode.cpp's CacheView):
// float32, bfloat16 or float16 values, or llama.cpp's q8_0 and q4_0 blocks of 32 values with a
// float16 scale (34 and 18 bytes), laid out as model/kv_types.py lays them. Attention reads a
// row where it is, a value or a block at a time: no page is converted to float32 first.
//
// A q4_0 key or value is rotated before it is stored by the orthonormal Hadamard transform of its
// head (a power of two long), which spreads a few outlier channels over the head; the query is
// rotated the same way, once per head, so the scores are unchanged (q . k = Hq . Hk), and the
// weighted sum of the values is rotated back once (sum w Hv = H sum w v, H its own inverse).
#pragma once

#include "dot.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace llama_chat_cpu {

enum class KV { F32, BF16, F16, Q8_0, Q4_0 };

constexpr int64_t kKVBlock = 32;
constexpr int64_t kQ8Bytes = 2 + kKVBlock, kQ4Bytes = 2 + kKVBlock / 2;
// A q4_0 block's scale is its largest value over one of these, the one of least squared error
// (model/kv_types.py's Q4_DIVISORS, in the same order): -8 is llama.cpp's.
constexpr float kQ4Divisors[] = {-8.f,  -8.25f, -8.5f,  -8.75f, -9.f,   -9.25f, -9.5f, -9.75f,
                                 -10.f, -10.25f, -10.5f, -10.75f, -11.f, -11.25f, -11.5f, -11.75f,
                                 -12.f, 7.f,    7.25f,  7.5f,   7.75f,  8.f};

// Bytes of a row of `head_dim` values.
inline int64_t kv_row_bytes(KV kind, int64_t head_dim) {
  switch (kind) {
    case KV::F32: return 4 * head_dim;
    case KV::BF16:
    case KV::F16: return 2 * head_dim;
    case KV::Q8_0: return head_dim / kKVBlock * kQ8Bytes;
    case KV::Q4_0: return head_dim / kKVBlock * kQ4Bytes;
  }
  return 0;
}

inline bool kv_power_of_two(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

// float32 to float16's bits, rounded to nearest, ties to even (torch's .half()).
inline uint16_t float_to_f16(float f) {
#ifdef __F16C__
  return static_cast<uint16_t>(_cvtss_sh(f, 0));
#else
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past the largest: infinity
  if (x < 0x38800000u) {  // a subnormal half (or zero): scaled to the half's step of 2^-24, rounded
    float magnitude;
    std::memcpy(&magnitude, &x, sizeof magnitude);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(magnitude * 16777216.f)));
  }
  const uint32_t rounded = x + 0xfffu + ((x >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
#endif
}

// x times the orthonormal Sylvester Hadamard matrix, in place (n a power of two): the fast
// transform's rounds of sums and differences, then 1 / sqrt(n), in the order kv_types.hadamard
// takes, so both give the same floats.
inline void hadamard(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

// One row of values into a row of `kind`, as kv_types.KVType.store does.
inline void kv_store_row(KV kind, const float* values, int64_t head_dim, uint8_t* out) {
  switch (kind) {
    case KV::F32:
      std::memcpy(out, values, sizeof(float) * head_dim);
      return;
    case KV::BF16: {
      uint16_t* to = reinterpret_cast<uint16_t*>(out);
      for (int64_t i = 0; i < head_dim; ++i) to[i] = float_to_bf16(values[i]);
      return;
    }
    case KV::F16: {
      uint16_t* to = reinterpret_cast<uint16_t*>(out);
      for (int64_t i = 0; i < head_dim; ++i) to[i] = float_to_f16(values[i]);
      return;
    }
    case KV::Q8_0:
      for (int64_t b = 0; b < head_dim / kKVBlock; ++b, out += kQ8Bytes) {
        const float* x = values + b * kKVBlock;
        float largest = 0.f;
        for (int64_t i = 0; i < kKVBlock; ++i) largest = std::max(largest, std::fabs(x[i]));
        const float scale = largest / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
        const uint16_t bits = float_to_f16(scale);
        std::memcpy(out, &bits, 2);
        for (int64_t i = 0; i < kKVBlock; ++i) {
          const float q = std::min(127.f, std::max(-127.f, std::nearbyint(x[i] * inverse)));
          out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(q));
        }
      }
      return;
    case KV::Q4_0:
      for (int64_t b = 0; b < head_dim / kKVBlock; ++b, out += kQ4Bytes) {
        const float* x = values + b * kKVBlock;
        float largest = 0.f, magnitude = 0.f;
        for (int64_t i = 0; i < kKVBlock; ++i)
          if (std::fabs(x[i]) > magnitude) {
            magnitude = std::fabs(x[i]);
            largest = x[i];
          }
        // The scale of least squared error among largest / kQ4Divisors, as stored (float16).
        uint16_t best_bits = 0;
        uint8_t best[kKVBlock] = {}, levels[kKVBlock];
        float best_error = INFINITY;
        for (const float divisor : kQ4Divisors) {
          const uint16_t bits = float_to_f16(largest / divisor);
          const float scale = f16_to_float(bits), inverse = scale != 0.f ? 1.f / scale : 0.f;
          float error = 0.f;
          for (int64_t i = 0; i < kKVBlock; ++i) {
            const float t = x[i] * inverse;
            levels[i] = static_cast<uint8_t>(std::min(15, std::max(0, static_cast<int>(t + 8.5f))));
            const float e = static_cast<float>(levels[i] - 8) * scale - x[i];
            error += e * e;
          }
          if (error < best_error) {  // ties keep the earlier divisor
            best_error = error;
            best_bits = bits;
            std::memcpy(best, levels, sizeof best);
          }
        }
        std::memcpy(out, &best_bits, 2);
        for (int64_t i = 0; i < kKVBlock / 2; ++i)
          out[2 + i] = static_cast<uint8_t>(best[i] | (best[i + kKVBlock / 2] << 4));
      }
      return;
  }
}

inline float kv_scale(const uint8_t* block) {
  uint16_t bits;
  std::memcpy(&bits, block, 2);
  return f16_to_float(bits);
}

// A q4_0 block's 32 values, before the scale, as int8 (-8..7).
inline void q4_levels(const uint8_t* block, int8_t* out) {
  for (int64_t i = 0; i < kKVBlock / 2; ++i) {
    out[i] = static_cast<int8_t>((block[2 + i] & 15) - 8);
    out[i + kKVBlock / 2] = static_cast<int8_t>((block[2 + i] >> 4) - 8);
  }
}

// q . row, a row of `kind`.
inline float kv_dot(KV kind, const float* q, const uint8_t* row, int64_t head_dim) {
  switch (kind) {
    case KV::F32: return dot(q, reinterpret_cast<const float*>(row), head_dim);
    case KV::BF16: return dot(q, reinterpret_cast<const uint16_t*>(row), head_dim);
    case KV::F16: return dot(q, reinterpret_cast<const F16*>(row), head_dim);
    case KV::Q8_0: {
      float sum = 0.f;
      for (int64_t b = 0; b < head_dim / kKVBlock; ++b, row += kQ8Bytes)
        sum += kv_scale(row) * dot(q + b * kKVBlock, reinterpret_cast<const int8_t*>(row + 2), kKVBlock);
      return sum;
    }
    case KV::Q4_0: {
      float sum = 0.f;
      int8_t levels[kKVBlock];
      for (int64_t b = 0; b < head_dim / kKVBlock; ++b, row += kQ4Bytes) {
        q4_levels(row, levels);
        sum += kv_scale(row) * dot(q + b * kKVBlock, levels, kKVBlock);
      }
      return sum;
    }
  }
  return 0.f;
}

// out += w * row, a row of `kind`.
inline void kv_add(KV kind, float w, const uint8_t* row, int64_t head_dim, float* out) {
  switch (kind) {
    case KV::F32: {
      const float* v = reinterpret_cast<const float*>(row);
      for (int64_t i = 0; i < head_dim; ++i) out[i] += w * v[i];
      return;
    }
    case KV::BF16: {
      const uint16_t* v = reinterpret_cast<const uint16_t*>(row);
      for (int64_t i = 0; i < head_dim; ++i) out[i] += w * bf16_to_float(v[i]);
      return;
    }
    case KV::F16: {
      const F16* v = reinterpret_cast<const F16*>(row);
      for (int64_t i = 0; i < head_dim; ++i) out[i] += w * f16_to_float(v[i].bits);
      return;
    }
    case KV::Q8_0:
      for (int64_t b = 0; b < head_dim / kKVBlock; ++b, row += kQ8Bytes) {
        const float ws = w * kv_scale(row);
        const int8_t* v = reinterpret_cast<const int8_t*>(row + 2);
        for (int64_t i = 0; i < kKVBlock; ++i) out[b * kKVBlock + i] += ws * static_cast<float>(v[i]);
      }
      return;
    case KV::Q4_0: {
      int8_t levels[kKVBlock];
      for (int64_t b = 0; b < head_dim / kKVBlock; ++b, row += kQ4Bytes) {
        const float ws = w * kv_scale(row);
        q4_levels(row, levels);
        for (int64_t i = 0; i < kKVBlock; ++i) out[b * kKVBlock + i] += ws * static_cast<float>(levels[i]);
      }
      return;
    }
  }
}

#ifdef __AVX512F__
// Values 16c .. 16c + 15 of a row as one vector, per kind: the 512-bit attention's loads.
template <KV Kind>
inline __m512 kv_load16(const uint8_t* row, int c) {
  if constexpr (Kind == KV::F32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + 16 * c);
  } else if constexpr (Kind == KV::F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
  } else if constexpr (Kind == KV::BF16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else if constexpr (Kind == KV::Q8_0) {
    const uint8_t* block = row + (c / 2) * kQ8Bytes;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * (c % 2)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), _mm512_set1_ps(kv_scale(block)));
  } else {
    const uint8_t* block = row + (c / 2) * kQ4Bytes;
    __m512i levels = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2)));
    levels = c % 2 ? _mm512_srli_epi32(levels, 4) : _mm512_and_si512(levels, _mm512_set1_epi32(15));
    levels = _mm512_sub_epi32(levels, _mm512_set1_epi32(8));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(levels), _mm512_set1_ps(kv_scale(block)));
  }
}
#endif

}  // namespace llama_chat_cpu
