// A prompt's attention on CPUs with AVX-512 BF16: `prompt_attention(q, k, v, past, scale, cap,
// window)`, the queries of a chunk at positions past, past + 1, ... against keys 0 .. past + i.
//
// Numerics: the queries (times the scale), keys, values and the softmax's weights (e^x within
// 4e-6 of it relative: exp_of_nonpositive) are rounded to bfloat16 (to nearest, ties to even),
// and every product is summed in float32 by `vdpbf16ps`
// (32 multiply-adds an instruction, twice float32's). Scores, their soft cap, the running maxima
// and sums, and the output stay float32. The softmax is kept online (Milakov and Gimelshein,
// "Online normalizer calculation for softmax"; FlashAttention): queries 16 at a time walk the
// keys they see 64 at a time, so no score matrix is ever made, and blocks no query of a block
// sees (past its last position, before its first one's window) are never read.
//
// Rounding the inputs costs the measured fidelity less than the int8 rounding of the products'
// inputs already spreads (docs/benchmarks.md, "Prompt attention"). Elsewhere, and for what this
// does not take (other widths, float16 or bfloat16 tensors), ml/ops.py keeps PyTorch's kernels.
#include "memory.h"
#include "vectors.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

using namespace llama_chat_cpu;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBuilt = true;

constexpr int64_t kRows = 16;  // queries a block
constexpr int64_t kKeys = 64;  // keys a block
constexpr int64_t kMaxDim = 256;

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

inline __m512i as_bf16_pairs(const float* x, __m512 by) {
  // 32 floats to 32 bfloat16 in order: the first 16 in the low half.
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(x + 16), by), _mm512_mul_ps(_mm512_loadu_ps(x), by));
}

inline __m512 bf16_low_as_floats(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// A key head for the scores: block b of 64 keys, then channel pair p, then the 64 keys' pair of
// channels (2p, 2p + 1) as one 32-bit word, so one load is sixteen keys' pair. Keys past `keys`
// up to the block's end are zero.
void pack_keys(const float* k, int64_t key_stride, int64_t keys, int64_t dim, int64_t first_block, int64_t stop_block,
               uint32_t* out) {
  const int64_t pairs = dim / 2;
  alignas(64) uint32_t row[kMaxDim / 2];
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t b = first_block; b < stop_block; ++b) {
    uint32_t* block = out + b * pairs * kKeys;
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t key = b * kKeys + j;
      if (key < keys) {
        for (int64_t d = 0; d < dim; d += 32) _mm512_store_si512(row + d / 2, as_bf16_pairs(k + key * key_stride + d, one));
      } else {
        std::fill(row, row + pairs, 0u);
      }
      for (int64_t p = 0; p < pairs; ++p) block[p * kKeys + j] = row[p];
    }
  }
}

// A value head for the weighted sum: key pair t, then channel c, as one word holding the channel
// of keys 2t (low half) and 2t + 1, so one load is sixteen channels of two keys.
void pack_values(const float* v, int64_t key_stride, int64_t keys, int64_t dim, int64_t first_pair, int64_t stop_pair,
                 uint32_t* out) {
  for (int64_t t = first_pair; t < stop_pair; ++t) {
    const float* even = v + 2 * t * key_stride;
    for (int64_t c = 0; c < dim; c += 16) {
      __m512i word = _mm512_setzero_si512();
      if (2 * t < keys) word = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(even + c)));
      if (2 * t + 1 < keys) {
        const __m256i odd = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(even + key_stride + c));
        word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_cvtepu16_epi32(odd), 16));
      }
      _mm512_storeu_si512(out + t * dim + c, word);
    }
  }
}

// e^x of scores less their running maximum (x <= 0; -inf and far below give 0), within 4e-6 of
// it relative (2.7e-6 the polynomial's, the rest t's rounding, for the weights above 1e-9 that
// count): 2^t for t = x log2(e) as 2^f 2^n, n = t rounded, |f| <= 1/2, 2^f by a degree-4
// polynomial fitted for the least largest relative error, 2^n by vscalefps. Half exp_of's
// operations, for weights that are then rounded to bfloat16 (2^-9) anyway.
constexpr float kExp2Poly[5] = {9.570533409714699e-3f, 5.591914802789688e-2f, 2.40247443318367e-1f,
                                6.93121612071991e-1f, 9.999992847442627e-1f};
inline __m512 exp_of_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 5; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, n);
}

// cap * tanh(x / cap) of scores already divided by cap: tanh(y) = 1 - 2 / (e^2y + 1).
inline __m512 capped(__m512 y, float cap) {
  const __m512 e = exp_of<Floats16>(_mm512_add_ps(y, y));
  const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.f), _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// acc[i][c] += the pair of bfloat16 a[i * a_stride] times each pair of the four vectors at b (64
// words): four rows of a block against sixteen lanes of four vectors, each vector loaded once.
inline void dot_4x4(__m512 (&acc)[4][4], const uint32_t* b, const uint32_t* a, int64_t a_stride) {
  const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 16),
                 b2 = (__m512bh)_mm512_loadu_si512(b + 32), b3 = (__m512bh)_mm512_loadu_si512(b + 48);
  for (int i = 0; i < 4; ++i) {
    const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i * a_stride]));
    acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
    acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    acc[i][2] = _mm512_dpbf16_ps(acc[i][2], ai, b2);
    acc[i][3] = _mm512_dpbf16_ps(acc[i][3], ai, b3);
  }
}

struct Rule {
  float scale, cap;  // cap 0: none
  int64_t window;    // 0: none
};

// One block of up to 16 queries of one head, at positions first, first + 1, ..., against the
// packed keys and values of its key head; `out` gets `rows` rows of `dim` floats.
void attend_block(const float* q, int64_t q_stride, int64_t rows, int64_t first, const uint32_t* keys,
                  const uint32_t* values, int64_t dim, const Rule& rule, float* out, int64_t out_stride) {
  const int64_t pairs = dim / 2;
  alignas(64) uint32_t qp[kRows][kMaxDim / 2];
  alignas(64) float o[kRows][kMaxDim];
  alignas(64) float s[kRows][kKeys];
  alignas(64) uint32_t pp[kRows][kKeys / 2];
  float m[kRows], l[kRows], alpha[kRows];
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const __m512 by = _mm512_set1_ps(rule.cap > 0.f ? rule.scale / rule.cap : rule.scale);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t d = 0; d < dim; d += 32)
      _mm512_store_si512(qp[r] + d / 2, r < rows ? as_bf16_pairs(q + r * q_stride + d, by) : _mm512_setzero_si512());
    std::fill(o[r], o[r] + dim, 0.f);
    m[r] = minus_inf;
    l[r] = 0.f;
  }
  const int64_t groups = (rows + 3) / 4;  // of four queries
  const int64_t last = first + rows - 1;
  const int64_t low = rule.window > 0 ? std::max<int64_t>(0, first - rule.window + 1) : 0;
  for (int64_t k0 = low / kKeys * kKeys; k0 <= last; k0 += kKeys) {
    const uint32_t* kb = keys + k0 / kKeys * pairs * kKeys;
    for (int64_t g = 0; g < groups; ++g) {
      __m512 acc[4][4];
      for (auto& row : acc)
        for (auto& a : row) a = _mm512_setzero_ps();
      for (int64_t p = 0; p < pairs; ++p) dot_4x4(acc, kb + p * kKeys, &qp[4 * g][p], kMaxDim / 2);
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 4; ++c) _mm512_store_ps(s[4 * g + i] + 16 * c, acc[i][c]);
    }
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t r = 0; r < kRows; ++r) {
      if (r >= rows) {
        alpha[r] = 0.f;
        std::fill(pp[r], pp[r] + kKeys / 2, 0u);
        continue;
      }
      const int64_t pos = first + r;
      const int64_t lo = rule.window > 0 ? pos - rule.window + 1 : 0;
      const bool sees_all = k0 >= lo && k0 + kKeys - 1 <= pos;  // most blocks: no mask to make
      __m512 x[4];
      __mmask16 seen[4];
      __m512 top = _mm512_set1_ps(minus_inf);
      for (int c = 0; c < 4; ++c) {
        if (sees_all) {
          seen[c] = 0xffff;
        } else {
          const __m512i key = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k0 + 16 * c)), lane);
          seen[c] = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos))) &
                    _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(lo, -1))));
        }
        x[c] = _mm512_load_ps(s[r] + 16 * c);
        if (rule.cap > 0.f) x[c] = capped(x[c], rule.cap);
        top = _mm512_mask_max_ps(top, seen[c], top, x[c]);
      }
      const float block_max = _mm512_reduce_max_ps(top);
      const float m_new = std::max(m[r], block_max);
      if (m_new == minus_inf) {  // no key of this block is seen by this query
        alpha[r] = 1.f;
        std::fill(pp[r], pp[r] + kKeys / 2, 0u);
        continue;
      }
      // Once the largest score is found, later blocks rarely raise it: no exp and no rescaling.
      alpha[r] = m_new == m[r] ? 1.f : m[r] == minus_inf ? 0.f : std::exp(m[r] - m_new);
      m[r] = m_new;
      const __m512 shift = _mm512_set1_ps(m_new);
      __m512 e[4];
      for (int c = 0; c < 4; ++c) e[c] = _mm512_maskz_mov_ps(seen[c], exp_of_nonpositive(_mm512_sub_ps(x[c], shift)));
      const __m512i p01 = (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]), p23 = (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]);
      _mm512_store_si512(pp[r], p01);
      _mm512_store_si512(pp[r] + 16, p23);
      // The sum of the weights as rounded: those the values are multiplied by.
      __m512 sum = _mm512_add_ps(bf16_low_as_floats(_mm512_castsi512_si256(p01)),
                                 bf16_low_as_floats(_mm512_extracti64x4_epi64(p01, 1)));
      sum = _mm512_add_ps(sum, bf16_low_as_floats(_mm512_castsi512_si256(p23)));
      sum = _mm512_add_ps(sum, bf16_low_as_floats(_mm512_extracti64x4_epi64(p23, 1)));
      l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    // Rescaled apart from the products: done in their loop, the branches made GCC keep an
    // accumulator on the stack, stored and loaded again every step.
    for (int64_t r = 0; r < rows; ++r) {
      if (alpha[r] == 1.f) continue;
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int64_t c = 0; c < dim; c += 16) _mm512_store_ps(o[r] + c, _mm512_mul_ps(_mm512_load_ps(o[r] + c), a));
    }
    const uint32_t* vb = values + k0 / 2 * dim;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t c0 = 0; c0 < dim; c0 += 64) {
        __m512 acc[4][4];
        for (int i = 0; i < 4; ++i)
          for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_load_ps(o[4 * g + i] + c0 + 16 * c);
        for (int64_t t = 0; t < kKeys / 2; ++t) dot_4x4(acc, vb + t * dim + c0, &pp[4 * g][t], kKeys / 2);
        for (int i = 0; i < 4; ++i)
          for (int c = 0; c < 4; ++c) _mm512_store_ps(o[4 * g + i] + c0 + 16 * c, acc[i][c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t c = 0; c < dim; c += 16) _mm512_storeu_ps(out + r * out_stride + c, _mm512_mul_ps(_mm512_load_ps(o[r] + c), inv));
  }
}

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t past, double scale,
                            double cap, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prompt_attention: q, k, v are (heads, tokens, dim)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "prompt_attention: float32 tensors");
  const int64_t heads = q.size(0), seq = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k.size(0), keys = k.size(1);
  TORCH_CHECK(dim % 64 == 0 && dim <= kMaxDim, "prompt_attention: head_dim a multiple of 64, at most 256");
  TORCH_CHECK(k.size(2) == dim && v.size(2) == dim && v.size(0) == kv_heads && v.size(1) == keys,
              "prompt_attention: k and v of the same shape, q's head_dim");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "prompt_attention: heads a multiple of kv_heads");
  TORCH_CHECK(past >= 0 && keys >= past + seq, "prompt_attention: the keys cover past + the queries");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prompt_attention: rows of contiguous channels");
  const int64_t blocks = round_up(keys, kKeys) / kKeys;
  at::Tensor packed_k = kept_empty({kv_heads, blocks * kKeys * dim / 2}, q.options().dtype(at::kInt));
  at::Tensor packed_v = kept_empty({kv_heads, blocks * kKeys * dim / 2}, q.options().dtype(at::kInt));
  auto* pk = reinterpret_cast<uint32_t*>(packed_k.data_ptr<int32_t>());
  auto* pv = reinterpret_cast<uint32_t*>(packed_v.data_ptr<int32_t>());
  const float *qd = q.data_ptr<float>(), *kd = k.data_ptr<float>(), *vd = v.data_ptr<float>();
  const int64_t head_words = blocks * kKeys * dim / 2;
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / blocks, b = i % blocks;
      pack_keys(kd + h * k.stride(0), k.stride(1), keys, dim, b, b + 1, pk + h * head_words);
      pack_values(vd + h * v.stride(0), v.stride(1), keys, dim, b * kKeys / 2, (b + 1) * kKeys / 2, pv + h * head_words);
    }
  });
  at::Tensor out = kept_empty({heads, seq, dim}, q.options());
  float* od = out.data_ptr<float>();
  const Rule rule{static_cast<float>(scale), static_cast<float>(cap), window};
  const int64_t n_rep = heads / kv_heads, q_blocks = (seq + kRows - 1) / kRows;
  const int64_t items = heads * q_blocks;
  // Work items in key-head order, the heads sharing a key head next to each other, dealt out in
  // turn: each thread's next item reads the keys its last one read, and the causal blocks'
  // growing costs are shared evenly.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t item = t; item < items; item += threads) {
        const int64_t g = item / (q_blocks * n_rep), qb = item / n_rep % q_blocks, h = g * n_rep + item % n_rep;
        const int64_t row0 = qb * kRows, rows = std::min(kRows, seq - row0);
        attend_block(qd + h * q.stride(0) + row0 * q.stride(1), q.stride(1), rows, past + row0, pk + g * head_words,
                     pv + g * head_words, dim, rule, od + (h * seq + row0) * dim, dim);
      }
    }
  });
  return out;
}
#else
constexpr bool kBuilt = false;

at::Tensor prompt_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double, double, int64_t) {
  TORCH_CHECK(false, "prompt_attention: this build has no AVX-512 BF16 instructions");
}
#endif

bool prompt_attention_built() { return kBuilt; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_chat_cpu, m) {
  m.def("prompt_attention_built() -> bool", &prompt_attention_built);
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, int past, float scale, float cap, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_chat_cpu, CPU, m) { m.impl("prompt_attention", &prompt_attention); }
