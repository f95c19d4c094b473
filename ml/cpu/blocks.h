// Products of float32 rows with weights kept as GGUF's packed quant blocks (ggml-common.h), read
// as they are: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (blocks of 32 values) and Q4_K, Q5_K, Q6_K (super-blocks
// of 256). Shared by the products (kernels.cpp, packed_product) and the one-call decode step.
//
// Numerics. The input rows are first rounded to int8 steps, as llama.cpp rounds its activations:
// per block of 32 values for the 32-value kinds (Q8_0's), per super-block of 256 for the K-quants
// (Q8_K's). step = max|x| / 127 (float32), q = x / step rounded to nearest, ties to even
// (x * (1 / step), then the rounding); a span of zeros has step 0. Then each weight block's codes
// meet the rounded inputs in exact integer sums. Blocks of 32 are scaled one by one in float32:
//     product = sum over blocks b of  a_b * step_b * sum_i (u_i - z) * q_i  +  c_b * step_b * sum_i q_i
// where a weight value is a_b * (u_i - z) + c_b (u the stored code, z its zero point, a the block's
// scale, c the min of Q4_1/Q5_1). A K-quant super-block g is one integer and one float step:
//     I_g = sum over its sub-blocks j of  s_j * sum_i (u_i - z) * q_i,   M_g = sum_j m_j * sum_i q_i
//     lane l = fma(M_g, -dmin_g * step_g, fma(I_g, d_g * step_g, lane l)) for g = l, l + 8, ... in order
//     product = ((lane 0 + lane 4) + (lane 2 + lane 6)) + ((lane 1 + lane 5) + (lane 3 + lane 7))
// (s_j, m_j the 6-bit scales and mins of Q4_K/Q5_K's 32-value sub-blocks, z 0; Q6_K: s the int8
// scale of each 16 values, z 32, no M). So the result equals dequantize(w) @ (the rounded rows)
// up to the order of the float32 additions. For the K-quants that order is one and the same on
// every path (a build without fused multiply-adds rounds twice where the others round once); for
// blocks of 32 it differs between the scalar and the vector paths. Within a build it never
// changes with the path, the thread count or the rows beside a row.
//
// Vector paths (256-bit vectors; each 32-value block one vector of unsigned codes): with
// AVX-512 VNNI (or AVX-VNNI), vpdpbusd multiplies the codes by the signed rounded inputs and sums
// each four products into int32 lanes in one instruction; with AVX2 alone, vpmaddubsw and vpmaddwd
// do it in two (Q8_0's signed codes take the sign trick there: |w| times x with w's sign, since
// unsigned codes up to 255 would saturate vpmaddubsw's int16 pairs). Eight blocks (256 values) at
// a time, the eight blocks' int32 lanes become one vector of eight block sums (for several input
// rows the decoded weights are rearranged once so that each lane is one block's, and every row
// just adds its products lane by lane: interleave_group), the zero points are taken off with the
// inputs' block sums (exact integers), and one multiply-add by the eight blocks' scales times the
// inputs' steps adds them to a float32 accumulator (a K-quant's eight sums times their integer
// scales are summed into one integer first: super_parts, super_steps). AVX-512BW expands Q5's
// fifth bits from a mask register; these vectors stay 256 bits wide with AVX-512 too, but for a
// row alone of Q4_K, Q5_K or Q6_K blocks with AVX-512 VNNI, which takes two blocks a 512-bit vector
// (packed_dot_wide).
// A call with several rows (a prompt's) takes tiles of weight rows decoded once instead, 512 bits
// wide with AVX-512 VNNI ("Many rows" below). Every path gives the same bits. Without AVX2, a
// scalar loop does the same sums.
#pragma once

#include "dot.h"
#include "vectors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <string_view>
#include <vector>

#if defined(__F16C__) || defined(LLAMA_CHAT_AVX2)
#include <immintrin.h>
#endif

#if defined(LLAMA_CHAT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define LLAMA_CHAT_VNNI 1
#elif defined(LLAMA_CHAT_AVX2) && defined(__AVXVNNI__)
#define LLAMA_CHAT_VNNI 1
#define LLAMA_CHAT_AVX_VNNI 1
#endif

// 512-bit products with AVX-512 VNNI: a one-row product of K-quant blocks takes two blocks a
// vector ("A row alone in 512 bits" below), as the tiles do.
#if defined(LLAMA_CHAT_VNNI) && !defined(LLAMA_CHAT_AVX_VNNI) && defined(__AVX512BW__)
#define LLAMA_CHAT_WIDE_VNNI 1
#endif

// The helpers of a group's decoding and sums are inlined into the loop over groups, whatever
// the compiler's estimate of their size: called, the decoded group went through memory.
#define LLAMA_CHAT_HOT inline __attribute__((always_inline))

namespace llama_chat_cpu {

// 64-byte aligned storage for vectors of any width.
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t count) { return static_cast<T*>(::operator new(count * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const AlignedAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const AlignedAllocator<U>&) const { return false; }
};

enum class Packed : int { q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k };

struct PackedLayout {
  const char* name;
  int64_t values;  // values per block
  int64_t bytes;   // bytes per block
};

// In the order of `Packed`; the names are ml/packed.py's PACKED_TYPES.
constexpr PackedLayout kPackedLayouts[] = {{"q8_0", 32, 34},   {"q4_0", 32, 18},   {"q4_1", 32, 20},
                                           {"q5_0", 32, 22},   {"q5_1", 32, 24},   {"q4_k", 256, 144},
                                           {"q5_k", 256, 176}, {"q6_k", 256, 210}};

inline const PackedLayout& layout_of(Packed kind) { return kPackedLayouts[static_cast<int>(kind)]; }

inline bool packed_kind(std::string_view name, Packed& kind) {
  for (int i = 0; i < static_cast<int>(sizeof kPackedLayouts / sizeof kPackedLayouts[0]); ++i)
    if (name == kPackedLayouts[i].name) {
      kind = static_cast<Packed>(i);
      return true;
    }
  return false;
}

// Bytes of a row of k values (k a multiple of the block's values).
inline int64_t packed_row_bytes(Packed kind, int64_t k) { return k / layout_of(kind).values * layout_of(kind).bytes; }

LLAMA_CHAT_HOT float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h >> 15) << 31, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else {
    const uint32_t bits = exponent == 31 ? (0xffu << 23) | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13);
    std::memcpy(&magnitude, &bits, sizeof magnitude);
  }
  return sign ? -magnitude : magnitude;
#endif
}

// A half as halves_of_8 (below) converts it: exact for every finite half, a large finite number
// for an infinite or NaN one (a K-quant super-block's d and dmin, which a row alone converts
// eight at a time).
inline float half_as_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  const uint32_t bits = static_cast<uint32_t>(h & 0x7fff) << 13;
  float magnitude;
  std::memcpy(&magnitude, &bits, sizeof magnitude);
  magnitude *= 0x1p112f;
  return h & 0x8000 ? -magnitude : magnitude;
}

// ---------------------------------------------------------------------------------------------
// The rounded input rows.

constexpr int64_t kQuantBlock = 32;   // input values per step
constexpr int64_t kQuantGroup = 256;  // values a vector step takes: eight blocks

// Values an input step spans for weights of `kind`: a super-block for the K-quants (see the
// numerics above).
inline int64_t step_span(Packed kind) { return layout_of(kind).values == kQuantGroup ? kQuantGroup : kQuantBlock; }

// Input rows rounded per `span` values (see the numerics above), each row padded with zeros to a
// multiple of 256 values so that a group's loads never pass its end.
struct RoundedBlocks {
  int64_t rows = 0, k = 0, padded = 0, span = kQuantBlock;
  // padded / span and padded / kQuantBlock: a row's steps and blocks. Kept, not divided out in
  // each access: a division the compiler may not hoist out of a loop (it could trap) ran once
  // per block and input row in the tiles.
  int64_t row_spans = 0, row_blocks = 0;
  std::vector<int8_t> q;            // the rounded values, `padded` a row
  std::vector<float> steps;         // per span: its step
  std::vector<float> step_sums;     // span 32: per block, its step times the sum of its values
  std::vector<int32_t> sums;        // per block of 32: the sum of its values
  std::vector<int16_t> sums16;      // span 256: the same as int16, side by side (pairs for vpmaddwd)
  std::vector<int16_t> half_sums;   // per 16 values: their sum (Q6_K's sub-blocks are 16 long)
  std::vector<int8_t> interleaved;  // q, each group of 256 as interleave_group lays a weight group
  std::vector<int8_t> paired;       // q, each group's blocks in the order 0 2 1 3 4 6 5 7 (kPairedOrder)
  // q + 128, unsigned (the tiles with VNNI: kBiasedTiles), eight rows interleaved a word at a
  // time: word w of row r at word (r / 8 * padded / 4 + w) * 8 + r % 8, so that a pass of the
  // tiles (eight rows from a multiple of 8, or fewer within them) reaches its rows from one
  // pointer at constant offsets
  std::vector<uint8_t> biased;

  const int8_t* q_of(int64_t r) const { return q.data() + r * padded; }
  const float* steps_of(int64_t r) const { return steps.data() + r * row_spans; }
  const float* step_sums_of(int64_t r) const { return step_sums.data() + r * row_blocks; }
  const int32_t* sums_of(int64_t r) const { return sums.data() + r * row_blocks; }
  const int16_t* sums16_of(int64_t r) const { return sums16.data() + r * row_blocks; }
  const int16_t* half_sums_of(int64_t r) const { return half_sums.data() + r * 2 * row_blocks; }
  const int8_t* interleaved_of(int64_t r) const { return interleaved.data() + r * padded; }
  const int8_t* paired_of(int64_t r) const { return paired.data() + r * padded; }
  // span 32: the steps as `biased` lays the words, block b of row r at
  // (r / 8 * row_blocks + b) * 8 + r % 8
  std::vector<float> biased_steps;
  // Row r of `biased`: its word w is 32 * w bytes on.
  const uint8_t* biased_of(int64_t r) const { return biased.data() + r / 8 * 8 * padded + r % 8 * 4; }
  // Row r of `biased_steps`: block b's step is 8 * b floats on.
  const float* biased_steps_of(int64_t r) const { return biased_steps.data() + r / 8 * 8 * row_blocks + r % 8; }
};

inline float largest_of(const float* x, int64_t n) {
  float largest = 0.f;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, std::abs(x[i]));
  return largest;
}

inline float inverse_of(float step) { return step != 0.f ? 1.f / step : 0.f; }

// One block of n (at most 32) values rounded with the inverse of their step: its values' sum and
// each half's.
inline void round_block(const float* x, int64_t n, float inverse, int8_t* q, int32_t& sum, int16_t* half_sums) {
  int32_t halves[2] = {0, 0};
  for (int64_t i = 0; i < kQuantBlock; ++i) {
    const int32_t v = i < n ? static_cast<int32_t>(std::nearbyint(x[i] * inverse)) : 0;
    q[i] = static_cast<int8_t>(v);
    halves[i / 16] += v;
  }
  sum = halves[0] + halves[1];
  half_sums[0] = static_cast<int16_t>(halves[0]);
  half_sums[1] = static_cast<int16_t>(halves[1]);
}

#ifdef LLAMA_CHAT_AVX2
inline int32_t horizontal_sum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// largest_of and round_block of whole blocks in vectors: the same operations, so the same bits.
inline float largest_of32(const float* x, int64_t blocks) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 most = _mm256_setzero_ps();
  for (int64_t i = 0; i < 4 * blocks; ++i)
    most = _mm256_max_ps(most, _mm256_and_ps(_mm256_loadu_ps(x + 8 * i), magnitude));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline void round_block32(const float* x, float inverse_step, int8_t* q, int32_t& sum, int16_t* half_sums) {
  const __m256 inverse = _mm256_set1_ps(inverse_step);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i)  // to nearest, ties to even
    i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), inverse));
  const int32_t low = horizontal_sum_i32(_mm256_add_epi32(i32[0], i32[1]));
  const int32_t high = horizontal_sum_i32(_mm256_add_epi32(i32[2], i32[3]));
  // The packs interleave 128-bit lanes; the permutation puts the values back in order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  sum = low + high;
  half_sums[0] = static_cast<int16_t>(low);
  half_sums[1] = static_cast<int16_t>(high);
}

// Eight blocks' vectors (v[j]: block j's 32 bytes as eight 4-byte words) rearranged in place so
// that each lane belongs to one block: v[k] (k < 4) holds word k of blocks 0-3 in its low 128
// bits and word k + 4 of the same blocks in its high ones; v[4 + k] the same of blocks 4-7. The
// products of v[0..3] summed lane by lane are then blocks 0-3's first 16 values' and, in the
// high lanes, their last 16 values' (Q6_K scales those halves); v[4..7] blocks 4-7's. The
// weights of a group are rearranged once for every input row, the rounded rows once for every
// weight row (RoundedBlocks::interleaved): no row then sums across its lanes per block, which
// it did with the same shuffles for each row. A row alone reduces its own sums instead
// (sums_of_groups): it has no other rows to share the rearranged weights with.
LLAMA_CHAT_HOT void interleave_group(__m256i* v) {
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    __m256i* b = v + 4 * h;
    const __m256i t0 = _mm256_unpacklo_epi32(b[0], b[1]), t1 = _mm256_unpackhi_epi32(b[0], b[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(b[2], b[3]), t3 = _mm256_unpackhi_epi32(b[2], b[3]);
    b[0] = _mm256_unpacklo_epi64(t0, t2);
    b[1] = _mm256_unpackhi_epi64(t0, t2);
    b[2] = _mm256_unpacklo_epi64(t1, t3);
    b[3] = _mm256_unpackhi_epi64(t1, t3);
  }
}
#endif

// Q8_0 without VNNI takes the sign trick: its codes are |w| and `signs` holds w.
template <Packed K>
constexpr bool kSignTrick =
#ifdef LLAMA_CHAT_VNNI
    false;
#else
    K == Packed::q8_0;
#endif

// Calls with at least this many input rows take the tiles: decoding a tile costs about what
// eight rows of the other path do (benchmarks/bench_packed.py --rows 4 8 16).
constexpr int64_t kTiledFromRows = 12;

// A group's blocks as a 64-byte load of Q4_K's or Q5_K's codes pairs them: 32 bytes of nibbles
// hold blocks 2c (low) and 2c + 1 (high), so 64 bytes hold blocks 0 and 2 in their low nibbles and
// 1 and 3 in their high ones. RoundedBlocks::paired lays the rounded rows out alike.
constexpr int kPairedOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};

// Runs body(0, n) on the calling thread; a caller with threads passes its own split of [0, n).
struct Serially {
  template <class Body>
  void operator()(int64_t n, const Body& body) const { body(0, n); }
};

// Whether the tiles of `kind` read RoundedBlocks::biased (kBiasedTiles, below): with VNNI, the
// kinds whose codes have a zero point.
constexpr bool biased_tiles(Packed kind) {
#ifdef LLAMA_CHAT_VNNI
  return kind == Packed::q8_0 || kind == Packed::q4_0 || kind == Packed::q5_0 || kind == Packed::q6_k;
#else
  (void)kind;
  return false;
#endif
}

// Row r of out.q into out.biased and its steps into out.biased_steps (where sized).
inline void bias_row(RoundedBlocks& out, int64_t r) {
  const int8_t* q = out.q_of(r);
  uint8_t* row = out.biased.data() + (out.biased_of(r) - out.biased.data());
  for (int64_t w = 0; w < out.padded / 4; ++w) {
    uint32_t word;
    std::memcpy(&word, q + 4 * w, sizeof word);
    word ^= 0x80808080u;
    std::memcpy(row + 32 * w, &word, sizeof word);
  }
  if (out.biased_steps.empty()) return;
  float* steps = out.biased_steps.data() + (out.biased_steps_of(r) - out.biased_steps.data());
  for (int64_t b = 0; b < out.row_blocks; ++b) steps[8 * b] = out.steps_of(r)[b];
}

// Rows [0, rows) of x (each k long, `stride` apart) into `out`, whose vectors are reused, a step
// per `span` values (step_span: 32, or 256 where k is whole super-blocks); the rows are rounded in
// the ranges `split` gives (each row on its own: any split, the same bytes). for_biased_tiles:
// whether the weights are of a kind whose tiles read RoundedBlocks::biased (biased_tiles).
template <class Split = Serially>
inline void round_blocks(const float* x, int64_t rows, int64_t k, int64_t stride, RoundedBlocks& out,
                         int64_t span = kQuantBlock, const Split& split = {}, bool for_biased_tiles = true) {
  out.rows = rows;
  out.k = k;
  out.span = span;
  out.padded = (k + kQuantGroup - 1) / kQuantGroup * kQuantGroup;
  const int64_t blocks = out.padded / kQuantBlock, spans = out.padded / span, per_span = span / kQuantBlock;
  out.row_spans = spans;
  out.row_blocks = blocks;
  out.q.assign(static_cast<size_t>(rows * out.padded), 0);
  out.steps.assign(static_cast<size_t>(rows * spans), 0.f);
  out.step_sums.assign(span == kQuantBlock ? static_cast<size_t>(rows * blocks) : 0, 0.f);
  out.sums.assign(static_cast<size_t>(rows * blocks), 0);
  out.sums16.assign(span == kQuantBlock ? 0 : static_cast<size_t>(rows * blocks), 0);
  out.half_sums.assign(static_cast<size_t>(rows * blocks * 2), 0);
  // Rows past the last, up to a multiple of 8, are zeros (128).
  const bool biased =
#ifdef LLAMA_CHAT_VNNI
      for_biased_tiles && rows >= kTiledFromRows;
#else
      false;
#endif
  const int64_t eights = (rows + 7) / 8;
  out.biased.assign(biased ? static_cast<size_t>(eights * 8 * out.padded) : 0, 0x80);
  out.biased_steps.assign(biased && span == kQuantBlock ? static_cast<size_t>(eights * 8 * blocks) : 0, 0.f);
  split(rows, [&](int64_t first, int64_t stop) {
    for (int64_t r = first; r < stop; ++r) {
      const float* xr = x + r * stride;
      int8_t* q = out.q.data() + r * out.padded;
      int32_t* sums = out.sums.data() + r * blocks;
      int16_t* halves = out.half_sums.data() + r * blocks * 2;
      for (int64_t t = 0; t * span < k; ++t) {
        const int64_t values = std::min(span, k - t * span), whole = values / kQuantBlock;
        const float* xs = xr + t * span;
        float largest = 0.f;
#ifdef LLAMA_CHAT_AVX2
        largest = largest_of32(xs, whole);
        largest = std::max(largest, largest_of(xs + whole * kQuantBlock, values - whole * kQuantBlock));
#else
        largest = largest_of(xs, values);
#endif
        const float step = largest / 127.f, inverse = inverse_of(step);
        out.steps[static_cast<size_t>(r * spans + t)] = step;
        for (int64_t j = 0; j * kQuantBlock < values; ++j) {
          const int64_t b = t * per_span + j, n = std::min(kQuantBlock, values - j * kQuantBlock);
#ifdef LLAMA_CHAT_AVX2
          if (n == kQuantBlock)
            round_block32(xr + b * kQuantBlock, inverse, q + b * kQuantBlock, sums[b], halves + 2 * b);
          else
#endif
            round_block(xr + b * kQuantBlock, n, inverse, q + b * kQuantBlock, sums[b], halves + 2 * b);
          const size_t at = static_cast<size_t>(r * blocks + b);
          if (span == kQuantBlock) out.step_sums[at] = step * static_cast<float>(sums[b]);
          else out.sums16[at] = static_cast<int16_t>(sums[b]);
        }
      }
      if (biased) bias_row(out, r);
    }
  });
#ifdef LLAMA_CHAT_WIDE_VNNI
  // A row alone reads Q4_K and Q5_K blocks against these (packed_dot_wide); tiles never do.
  if (rows < kTiledFromRows) {
    out.paired.resize(out.q.size());
    for (int64_t at = 0; at < static_cast<int64_t>(out.q.size()); at += kQuantGroup)
      for (int j = 0; j < 8; ++j)
        std::memcpy(out.paired.data() + at + 32 * j, out.q.data() + at + 32 * kPairedOrder[j], 32);
  }
#endif
#ifdef LLAMA_CHAT_AVX2
  // A row alone reads q (packed_dot_rows), and so do the tiles that calls of many rows take.
  if (rows < 2 || rows >= kTiledFromRows) return;
  out.interleaved.resize(out.q.size());
  for (int64_t at = 0; at < static_cast<int64_t>(out.q.size()); at += kQuantGroup) {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out.q.data() + at + 32 * j));
    interleave_group(v);
    for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.interleaved.data() + at + 32 * j), v[j]);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Scalar path: one block of 32 codes at a time.

// Block b (the b-th 32 values) of a row: codes u, zero point z, the integer scale of each half
// (Q6_K's sub-blocks; 1 elsewhere), the float scale a and offset c; of a K-quant's super-block,
// the block's integer scale s and min m (Q4_K, Q5_K) and the super-block's d and -dmin.
struct ScalarBlock {
  int32_t u[32];
  int32_t z = 0;
  int32_t halves[2] = {1, 1};
  float a = 0.f, c = 0.f;
  int32_t s = 1, m = 0;
  float d = 0.f, neg_dmin = 0.f;
};

// Q4_K/Q5_K's 6-bit scale and min of sub-block j from their 12 bytes (llama.cpp's get_scale_min_k4).
inline void k_scale_min(const uint8_t* s, int j, int32_t& scale, int32_t& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline void decode_block(Packed kind, const uint8_t* row, int64_t b, ScalarBlock& out) {
  const PackedLayout& layout = layout_of(kind);
  out.z = 0;
  out.halves[0] = out.halves[1] = 1;
  out.c = 0.f;
  if (layout.values == 32) {
    const uint8_t* p = row + b * layout.bytes;
    out.a = half_to_float(p);
    const uint8_t* qs = p + 2;
    uint32_t fifth = 0;
    switch (kind) {
      case Packed::q8_0:
        for (int i = 0; i < 32; ++i) out.u[i] = static_cast<int8_t>(qs[i]);
        return;
      case Packed::q4_0: out.z = 8; break;
      case Packed::q4_1: out.c = half_to_float(p + 2); qs = p + 4; break;
      case Packed::q5_0: out.z = 16; std::memcpy(&fifth, p + 2, 4); qs = p + 6; break;
      default: out.c = half_to_float(p + 2); std::memcpy(&fifth, p + 4, 4); qs = p + 8; break;  // q5_1
    }
    for (int i = 0; i < 16; ++i) {
      out.u[i] = (qs[i] & 0xf) | (((fifth >> i) & 1) << 4);
      out.u[i + 16] = (qs[i] >> 4) | (((fifth >> (i + 16)) & 1) << 4);
    }
    return;
  }
  const uint8_t* p = row + (b / 8) * layout.bytes;
  const int j = static_cast<int>(b % 8);  // the 32-value block within its super-block
  if (kind == Packed::q6_k) {
    const int half = j / 4, part = j % 4;
    const uint8_t* ql = p + 64 * half + 32 * (part % 2);
    const uint8_t* qh = p + 128 + 32 * half;
    for (int l = 0; l < 32; ++l)
      out.u[l] = ((part < 2 ? ql[l] : ql[l] >> 4) & 0xf) | (((qh[l] >> (2 * part)) & 3) << 4);
    out.z = 32;
    out.halves[0] = static_cast<int8_t>(p[192 + 2 * j]);
    out.halves[1] = static_cast<int8_t>(p[192 + 2 * j + 1]);
    out.d = half_as_float(p + 208);
    out.s = 1;
    out.m = 0;
    return;
  }
  k_scale_min(p + 4, j, out.s, out.m);
  out.d = half_as_float(p);
  out.neg_dmin = -half_as_float(p + 2);
  const bool five = kind == Packed::q5_k;
  const uint8_t* qs = p + (five ? 48 : 16) + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) {
    out.u[l] = j % 2 ? qs[l] >> 4 : qs[l] & 0xf;
    if (five) out.u[l] |= ((p[16 + l] >> j) & 1) << 4;
  }
}

// One weight row of `blocks` 32-value blocks against rounded row r.
inline float packed_dot_scalar(Packed kind, const uint8_t* row, int64_t blocks, const RoundedBlocks& in, int64_t r) {
  const int8_t* q = in.q_of(r);
  const float* steps = in.steps_of(r);
  const bool super = in.span == kQuantGroup;
  ScalarBlock block;
  float total = 0.f, lanes[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};  // K-quants: super-block g's in lane g mod 8
  int32_t scaled = 0, mins = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    decode_block(kind, row, b, block);
    int32_t sum = 0;
    for (int h = 0; h < 2; ++h) {
      int32_t part = 0;
      for (int i = 16 * h; i < 16 * h + 16; ++i) part += (block.u[i] - block.z) * q[b * 32 + i];
      sum += part * block.halves[h];
    }
    if (!super) {
      total += block.a * steps[b] * static_cast<float>(sum);
      if (block.c != 0.f) total += block.c * in.step_sums_of(r)[b];
      continue;
    }
    scaled += block.s * sum;
    mins += block.m * in.sums_of(r)[b];
    if (b % 8 == 7) {
      const float step = steps[b / 8];
      float& lane = lanes[(b / 8) % 8];
      lane = madd(static_cast<float>(scaled), block.d * step, lane);
      if (kind != Packed::q6_k) lane = madd(static_cast<float>(mins), block.neg_dmin * step, lane);
      scaled = mins = 0;
    }
  }
  if (super) total = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  return total;
}

// ---------------------------------------------------------------------------------------------
// Vector path: eight blocks of 32 (a group of 256 values) at a time.

#ifdef LLAMA_CHAT_AVX2

// acc plus, in each int32 lane, the sum of its four unsigned-by-signed byte products.
LLAMA_CHAT_HOT __m256i dot_add(__m256i acc, __m256i u, __m256i y) {
#if defined(LLAMA_CHAT_AVX_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, u, y);
#elif defined(LLAMA_CHAT_VNNI)
  return _mm256_dpbusd_epi32(acc, u, y);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1)));
#endif
}

// The sums of eight vectors' lanes (v[j]: block j's four-product sums), in the order of the
// sums of interleaved groups (below): pairs of vectors interleaved and added, twice (single-
// operation shuffles only: vphaddd is several on some cores).
LLAMA_CHAT_HOT void sums_of_groups(const __m256i* v, __m256i* quads) {
  __m256i pairs[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j)
    pairs[j] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * j], v[2 * j + 1]),
                                _mm256_unpackhi_epi32(v[2 * j], v[2 * j + 1]));
#pragma GCC unroll 2
  for (int j = 0; j < 2; ++j)
    quads[j] = _mm256_add_epi32(_mm256_unpacklo_epi64(pairs[2 * j], pairs[2 * j + 1]),
                                _mm256_unpackhi_epi64(pairs[2 * j], pairs[2 * j + 1]));
}

// Lane j: block j's sum, from the sums of interleaved groups' lanes (quads[h]: blocks 4h to 4h + 3's
// first halves low, second halves high).
LLAMA_CHAT_HOT __m256i join_halves(const __m256i* quads) {
  return _mm256_add_epi32(_mm256_permute2x128_si256(quads[0], quads[1], 0x20),
                          _mm256_permute2x128_si256(quads[0], quads[1], 0x31));
}

LLAMA_CHAT_HOT __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
LLAMA_CHAT_HOT __m256i high_nibbles(__m256i v) { return low_nibbles(_mm256_srli_epi16(v, 4)); }

// 16 bytes of nibbles as 32 codes: the low nibbles first, then the high ones (Q4_0, Q4_1, Q5_*).
// The bytes are loaded into both halves and the upper half shifted: no shuffle, of which a core
// has fewer units than of the other vector operations, and a group needs many elsewhere.
LLAMA_CHAT_HOT __m256i nibbles_of_16(const uint8_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return low_nibbles(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)));
}

// The halves in the low 16 bits of v's lanes as eight floats: their bits moved into a float's
// place and scaled by 2^112, exact for every finite half, subnormal ones included (an infinite or
// NaN half, in no sane file, becomes a large finite number).
LLAMA_CHAT_HOT __m256 halves_as_floats(__m256i v) {
  const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7fff)), 13);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x8000)), 16);
  const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p112f));
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

// The 32 bits at p, p + Stride, ..., of `count` blocks (the rest 0), each loaded into its lane and
// blended in (no shuffles).
template <int64_t Stride>
LLAMA_CHAT_HOT __m256i words_of_8(const uint8_t* p, int count) {
  __m256i v = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    if (j >= count) break;
    int32_t word;
    std::memcpy(&word, p + j * Stride, sizeof word);
    v = _mm256_blend_epi32(v, _mm256_set1_epi32(word), 1 << j);
  }
  return v;
}

// The fp16 numbers at p, p + Stride, ..., of `count` blocks (the rest 0), as eight floats.
template <int64_t Stride>
LLAMA_CHAT_HOT __m256 halves_of_8(const uint8_t* p, int count) {
  return halves_as_floats(words_of_8<Stride>(p, count));
}

// 32 bits (little-endian) as 32 bytes: 0x10 where the bit is set (Q5_0/Q5_1's fifth bits).
LLAMA_CHAT_HOT __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_set1_epi8(bits, 0x10);
#else
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                        _mm256_set1_epi64x(-1));
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
#endif
}

// The zero point z as a shift (z = 1 << shift), taken off with the inputs' block sums; 0 for none.
template <Packed K>
constexpr int kZeroShift = K == Packed::q4_0 ? 3 : K == Packed::q5_0 ? 4 : (K == Packed::q8_0 && !kSignTrick<K>) ? 7 : 0;

template <Packed K>
constexpr bool kOffset = K == Packed::q4_1 || K == Packed::q5_1;

// Q4_K and Q5_K: mins, taken off a super-block's sum as one integer (the numerics above).
template <Packed K>
constexpr bool kMins = K == Packed::q4_k || K == Packed::q5_k;

// The zero point of a kind's codes: kZeroShift's, and Q6_K's 32.
template <Packed K>
constexpr int kTileZero = K == Packed::q6_k ? 32 : kZeroShift<K> > 0 ? 1 << kZeroShift<K> : 0;

// With VNNI, the tiles of kinds with a zero point z hold the codes less it (signed) and take the
// rounded inputs plus 128 (unsigned, RoundedBlocks::biased): sum (u - z) (q + 128) is the block's
// sum (u - z) q plus 128 sum (u - z), a constant of the weight row that the tile keeps
// (DecodedTile::zero) and each sum starts from. Exact as the inputs' zero-point sums taken off
// after, without a broadcast and a subtraction per block (Q6_K: half) and input row; and the
// inputs, laid out eight rows interleaved, are reached from one pointer. Q4_K and Q5_K (no zero
// point) ran no faster so. Which kinds: biased_tiles.
template <Packed K>
constexpr bool kBiasedTiles = biased_tiles(K);

// Eight blocks of a row, decoded.
struct Group {
  __m256i u[8];      // unsigned codes, interleaved (Q8_0 with the sign trick: magnitudes)
  __m256i signs[8];  // Q8_0 with the sign trick: the signed codes, interleaved
  __m256i halves[2];  // Q6_K: the 16-value sub-blocks' scales in the order of interleaved sums
  __m256i scales16;  // Q6_K: the sixteen sub-block scales as int16, for the zero point
  __m256 scale;      // a, per block
  __m256 offset;     // c, per block
  __m256i scales;    // Q4_K, Q5_K: the blocks' integer scales
  __m128i mins16;    // Q4_K, Q5_K: the blocks' mins, as int16
  float d, neg_dmin;  // K-quants: the super-block's d and -dmin
};

// Blocks [8g, 8g + count) of a row of 32-value blocks (count from 1 to 8; the rest are zeros).
template <Packed K, bool Interleave>
LLAMA_CHAT_HOT void decode_small_group(const uint8_t* row, int64_t g, int count, Group& out) {
  constexpr int64_t bytes = kPackedLayouts[static_cast<int>(K)].bytes;
  const uint8_t* first = row + 8 * g * bytes;
  out.scale = halves_of_8<bytes>(first, count);
  if constexpr (kOffset<K>) out.offset = halves_of_8<bytes>(first + 2, count);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    if (j >= count) {
      out.u[j] = out.signs[j] = _mm256_setzero_si256();
      continue;
    }
    const uint8_t* p = first + j * bytes;
    if constexpr (K == Packed::q8_0) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2));
      if constexpr (kSignTrick<K>) out.signs[j] = q;
      else out.u[j] = _mm256_xor_si256(q, _mm256_set1_epi8(static_cast<char>(0x80)));  // q + 128
    } else if constexpr (K == Packed::q4_0) {
      out.u[j] = nibbles_of_16(p + 2);
    } else if constexpr (K == Packed::q4_1) {
      out.u[j] = nibbles_of_16(p + 4);
    } else if constexpr (K == Packed::q5_0) {
      out.u[j] = _mm256_or_si256(nibbles_of_16(p + 6), fifth_bits(p + 2));
    } else {  // q5_1
      out.u[j] = _mm256_or_si256(nibbles_of_16(p + 8), fifth_bits(p + 4));
    }
  }
  if constexpr (kSignTrick<K>) {
    if constexpr (Interleave) interleave_group(out.signs);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) out.u[j] = _mm256_abs_epi8(out.signs[j]);
  } else if constexpr (Interleave) {
    interleave_group(out.u);
  }
}

// A Q4_K/Q5_K super-block's scales and mins (bytes 0-7 and 8-15 of `both`), d and dmin.
LLAMA_CHAT_HOT void k_scales_of(const uint8_t* p, __m128i both, Group& out) {
  out.scales = _mm256_cvtepu8_epi32(both);
  out.mins16 = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(both, both));
  out.d = half_as_float(p);
  out.neg_dmin = -half_as_float(p + 2);
}

// Super-block g of a Q4_K/Q5_K row: its integer scales and mins.
// The 12 bytes are taken apart four at a time (llama.cpp's way): k_scale_min for all eight.
LLAMA_CHAT_HOT void k_scales(const uint8_t* p, Group& out) {
  uint32_t w[4];
  std::memcpy(w, p + 4, 12);
  constexpr uint32_t six = 0x3f3f3f3f, four = 0x0f0f0f0f, two = 0x03030303;
  w[3] = ((w[2] >> 4) & four) | (((w[1] >> 6) & two) << 4);  // mins 4-7
  const uint32_t mins = w[1] & six;                            // mins 0-3
  w[1] = (w[2] & four) | (((w[0] >> 6) & two) << 4);          // scales 4-7
  w[2] = mins;
  w[0] &= six;                                                 // scales 0-3
  k_scales_of(p, _mm_setr_epi32(static_cast<int>(w[0]), static_cast<int>(w[1]), static_cast<int>(w[2]),
                                 static_cast<int>(w[3])),
              out);
}

template <Packed K, bool Interleave>
LLAMA_CHAT_HOT void decode_super_block(const uint8_t* row, int64_t g, Group& out) {
  constexpr int64_t bytes = kPackedLayouts[static_cast<int>(K)].bytes;
  const uint8_t* p = row + g * bytes;
  if constexpr (K == Packed::q4_k || K == Packed::q5_k) {
    k_scales(p, out);
    const uint8_t* qs = p + (K == Packed::q5_k ? 48 : 16);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      out.u[2 * c] = low_nibbles(v);
      out.u[2 * c + 1] = high_nibbles(v);
    }
    if constexpr (K == Packed::q5_k) {
      // Bit j of byte l is the fifth bit of sub-block j's value l: moved to bit 4 in place (a
      // 16-bit shift by at most 4 brings no bit of the neighbouring byte to bit 4).
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
      const __m256i bit4 = _mm256_set1_epi8(0x10);
      out.u[0] = _mm256_or_si256(out.u[0], _mm256_and_si256(_mm256_slli_epi16(high, 4), bit4));
      out.u[1] = _mm256_or_si256(out.u[1], _mm256_and_si256(_mm256_slli_epi16(high, 3), bit4));
      out.u[2] = _mm256_or_si256(out.u[2], _mm256_and_si256(_mm256_slli_epi16(high, 2), bit4));
      out.u[3] = _mm256_or_si256(out.u[3], _mm256_and_si256(_mm256_slli_epi16(high, 1), bit4));
      out.u[4] = _mm256_or_si256(out.u[4], _mm256_and_si256(high, bit4));
      out.u[5] = _mm256_or_si256(out.u[5], _mm256_and_si256(_mm256_srli_epi16(high, 1), bit4));
      out.u[6] = _mm256_or_si256(out.u[6], _mm256_and_si256(_mm256_srli_epi16(high, 2), bit4));
      out.u[7] = _mm256_or_si256(out.u[7], _mm256_and_si256(_mm256_srli_epi16(high, 3), bit4));
    }
  } else {  // q6_k: ql 128 bytes, qh 64, 16 int8 scales, fp16 d
    const __m256i pair = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i ql0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h));
      const __m256i ql1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32));
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
      out.u[4 * h] = _mm256_or_si256(low_nibbles(ql0), _mm256_and_si256(_mm256_slli_epi16(qh, 4), pair));
      out.u[4 * h + 1] = _mm256_or_si256(low_nibbles(ql1), _mm256_and_si256(_mm256_slli_epi16(qh, 2), pair));
      out.u[4 * h + 2] = _mm256_or_si256(high_nibbles(ql0), _mm256_and_si256(qh, pair));
      out.u[4 * h + 3] = _mm256_or_si256(high_nibbles(ql1), _mm256_and_si256(_mm256_srli_epi16(qh, 2), pair));
    }
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
    out.scales16 = _mm256_cvtepi8_epi16(s8);
    // Sub-block 2j is block j's first half, 2j + 1 its second.
    const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m128i ordered = _mm_shuffle_epi8(s8, order);
    out.halves[0] = _mm256_cvtepi8_epi32(ordered);
    out.halves[1] = _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(ordered, ordered));
    out.d = half_as_float(p + 208);
    out.neg_dmin = 0.f;
  }
  if constexpr (Interleave) interleave_group(out.u);
}

template <Packed K>
constexpr bool kSuperSteps = kPackedLayouts[static_cast<int>(K)].values == kQuantGroup;

// A K-quant super-block's two integers for one rounded row, from its blocks' sums s (lane j:
// block j, Q6_K's already scaled and less its zero point), as one vector: lanes 0-3 add up to I,
// the sums times their integer scales, and lanes 4-7 to M (Q4_K, Q5_K; 0 for Q6_K).
template <Packed K>
LLAMA_CHAT_HOT __m256i super_parts(__m256i s, const Group& w, const RoundedBlocks& in, int64_t r, int64_t g) {
  const __m256i scaled = K == Packed::q6_k ? s : _mm256_mullo_epi32(s, w.scales);
  const __m128i sums = _mm_add_epi32(_mm256_castsi256_si128(scaled), _mm256_extracti128_si256(scaled, 1));
  __m128i mins = _mm_setzero_si128();
  if constexpr (kMins<K>)
    mins = _mm_madd_epi16(w.mins16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(in.sums16_of(r) + 8 * g)));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(sums), mins, 1);
}

// The d and -dmin of super-blocks [g0, g0 + count) (count from 1 to 8; first: g0's bytes), lane j
// super-block g0 + j's, the rest 0.
struct SuperScales {
  __m256 d, neg_dmin;
  __m256i taken;  // lanes under count

  template <Packed K>
  LLAMA_CHAT_HOT static SuperScales of(const uint8_t* first, int count) {
    constexpr int64_t bytes = kPackedLayouts[static_cast<int>(K)].bytes;
    SuperScales out;
    out.taken = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    // Q4_K's and Q5_K's first 32 bits (d, then dmin), Q6_K's last (two scales, then d: a row's
    // last bytes are its last super-block's d): in one gather with AVX-512, which was faster
    // there than eight loads, and not on the AVX2 cores whose gathers are slow.
    const uint8_t* at = first + (K == Packed::q6_k ? 206 : 0);
#ifdef __AVX512F__
    const __m256i words = _mm256_mask_i32gather_epi32(
        _mm256_setzero_si256(), reinterpret_cast<const int*>(at),
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(static_cast<int>(bytes))),
        out.taken, 1);
#else
    const __m256i words = words_of_8<bytes>(at, count);
#endif
    out.d = halves_as_floats(K == Packed::q6_k ? _mm256_srli_epi32(words, 16) : words);
    out.neg_dmin = _mm256_xor_ps(halves_as_floats(_mm256_srli_epi32(words, 16)), _mm256_set1_ps(-0.f));
    return out;
  }
};

// The float steps of super-blocks [g0, g0 + count) of one rounded row (parts[j]: super-block
// g0 + j's super_parts, 0 past count; steps: the row's from g0), added to acc: lane j takes
// super-block g0 + j's, in the order of the numerics above. Their I and M are summed from their
// parts together, in six horizontal additions.
template <Packed K>
LLAMA_CHAT_HOT __m256 super_steps(const __m256i* parts, const SuperScales& scales, const float* steps, __m256 acc) {
  const __m256i low = _mm256_hadd_epi32(_mm256_hadd_epi32(parts[0], parts[1]), _mm256_hadd_epi32(parts[2], parts[3]));
  const __m256i high = _mm256_hadd_epi32(_mm256_hadd_epi32(parts[4], parts[5]), _mm256_hadd_epi32(parts[6], parts[7]));
  const __m256 step = _mm256_maskload_ps(steps, scales.taken);  // lanes past the row's end add 0 * 0
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(low, high, 0x20)), _mm256_mul_ps(scales.d, step),
                        acc);
  if constexpr (kMins<K>)
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_permute2x128_si256(low, high, 0x31)),
                          _mm256_mul_ps(scales.neg_dmin, step), acc);
  return acc;
}

// One rounded row's share of a decoded group: lane j, block j's sum less its zero point (Q6_K's
// halves times their scales).
template <Packed K, bool Interleaved>
LLAMA_CHAT_HOT __m256i group_sums(const Group& w, const RoundedBlocks& in, int64_t r, int64_t g) {
  __m256i quads[2];
  if constexpr (Interleaved) {
    const int8_t* y = in.interleaved_of(r) + g * kQuantGroup;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256i sum = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int k = 4 * h; k < 4 * h + 4; ++k) {
        __m256i yk = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 32 * k));
        if constexpr (kSignTrick<K>) yk = _mm256_sign_epi8(yk, w.signs[k]);
        sum = dot_add(sum, w.u[k], yk);
      }
      quads[h] = sum;
    }
  } else {
    const int8_t* y = in.q_of(r) + g * kQuantGroup;
    __m256i p[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i yj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + 32 * j));
      if constexpr (kSignTrick<K>) yj = _mm256_sign_epi8(yj, w.signs[j]);
      p[j] = dot_add(_mm256_setzero_si256(), w.u[j], yj);
    }
    sums_of_groups(p, quads);
  }
  if constexpr (K == Packed::q6_k) {
    quads[0] = _mm256_mullo_epi32(quads[0], w.halves[0]);
    quads[1] = _mm256_mullo_epi32(quads[1], w.halves[1]);
  }
  __m256i s = join_halves(quads);
  const int64_t b = g * (kQuantGroup / kQuantBlock);
  if constexpr (K == Packed::q6_k) {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.half_sums_of(r) + 2 * b));
    s = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(halves, w.scales16), 5));
  } else if constexpr (kZeroShift<K> > 0) {
    const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.sums_of(r) + b));
    s = _mm256_sub_epi32(s, _mm256_slli_epi32(sums, kZeroShift<K>));
  }
  return s;
}

// One rounded row's share of a decoded group of 32-value blocks, added to acc.
template <Packed K, bool Interleaved>
LLAMA_CHAT_HOT __m256 add_group(const Group& w, const RoundedBlocks& in, int64_t r, int64_t g, __m256 acc) {
  const __m256i s = group_sums<K, Interleaved>(w, in, r, g);
  const int64_t b = g * (kQuantGroup / kQuantBlock);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(w.scale, _mm256_loadu_ps(in.steps_of(r) + b)), acc);
  if constexpr (kOffset<K>) acc = _mm256_fmadd_ps(w.offset, _mm256_loadu_ps(in.step_sums_of(r) + b), acc);
  return acc;
}

// Each group asks for the weight bytes this far ahead of it, a cache line per 64 bytes it
// reads. Weight rows are read one after another, so ahead of a row's end is the next row. With
// the hardware's prefetchers alone, a row's product on some cores (Sapphire Rapids) waited on
// memory and then computed, in turns, instead of doing both at once; nearer and farther
// distances overlapped them less.
constexpr int64_t kRowAheadBytes = 2 << 10;

template <int64_t Bytes>
LLAMA_CHAT_HOT void ask_ahead(const uint8_t* p) {
#pragma GCC unroll 8
  for (int64_t line = 0; line < Bytes; line += 64)  // past the end of the weights it fetches nothing
    _mm_prefetch(reinterpret_cast<const char*>(p) + kRowAheadBytes + line, _MM_HINT_T0);
}

#ifdef LLAMA_CHAT_WIDE_VNNI
// A row alone in 512 bits (Q4_K, Q5_K, Q6_K). Each vector holds two blocks' codes, one in each
// 256-bit half, as they come out of a 64-byte load with no shuffle; four vpdpbusd take a group,
// and the four vectors' lanes are summed into one vector of eight block sums in three steps of
// shuffles and adds (eight shuffles, where the 256-bit path's eight vectors of one block each
// took sixteen). The block sums are the same integers, and what follows is add_group's float
// arithmetic in the same order: the same bits as packed_dot_rows<K, 1> in 256 bits and the tiles.
template <Packed K>
constexpr bool kWide = K == Packed::q4_k || K == Packed::q5_k || K == Packed::q6_k;

// A group's four vectors of products p[m] (two blocks each) summed per 128-bit lane: lane 4k + m
// of the result is the sum of p[m]'s lanes in its 128-bit lane k (k = 0, 1: the two halves of
// p[m]'s low block; 2, 3: of its high block).
LLAMA_CHAT_HOT __m512i sums_of_pairs(const __m512i* p) {
  const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
  const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
}

// Lane b: block b's sum, its two halves' lanes of sums_of_pairs (first: idx_first, second: idx_second).
LLAMA_CHAT_HOT __m256i join_pairs(__m512i quads, __m512i first, __m512i second) {
  return _mm256_add_epi32(_mm512_castsi512_si256(_mm512_permutexvar_epi32(first, quads)),
                          _mm512_castsi512_si256(_mm512_permutexvar_epi32(second, quads)));
}

// k_scales for a row alone, the same values in fewer shuffles (with 512-bit operations in flight
// one port takes them all, and they bound a group's pace): the 12 bytes of scales and mins
// (read as 16, the last 4 left out) sorted by one byte shuffle into the sources of scales 0-3,
// 4-7 (low bits), mins 0-3 and 4-7 (low bits); the high bits of 4-7 come from the sources of
// 0-3, 30 bits below in the same 64 bits.
LLAMA_CHAT_HOT void k_scales_wide(const uint8_t* p, Group& out) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
  const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i low = _mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi32(0, 0, 0, 0x0f0f0f0f));
  const __m128i top = _mm_and_si128(_mm_slli_epi64(a, 30), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  k_scales_of(p, _mm_ternarylogic_epi32(low, high, top, 0xfe), out);  // low | high | top
}

template <Packed K>
inline float packed_dot_wide(const uint8_t* row, const RoundedBlocks& in, int64_t r) {
  constexpr int64_t bytes = kPackedLayouts[static_cast<int>(K)].bytes;
  const int64_t groups = in.k / kQuantGroup;
  const int8_t* ys = K == Packed::q6_k ? in.q_of(r) : in.paired_of(r);
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  // Q6_K's pairs are blocks (0, 1), (2, 3), (4, 5), (6, 7); Q4_K's and Q5_K's (0, 2), (1, 3),
  // (4, 6), (5, 7) (kPairedOrder). Where each block's halves land in sums_of_pairs:
  const __m512i first = K == Packed::q6_k ? _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0)
                                          : _mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(4));
  __m256 acc = _mm256_setzero_ps();
  Group w;
  // Eight super-blocks at a time, their parts in registers.
  for (int64_t g0 = 0; g0 < groups; g0 += 8) {
    const int count = static_cast<int>(std::min<int64_t>(8, groups - g0));
    __m256i parts[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      if (j >= count) {
        parts[j] = _mm256_setzero_si256();
        continue;
      }
      const int64_t g = g0 + j;
      const uint8_t* p = row + g * bytes;
      const int8_t* y = ys + g * kQuantGroup;
      ask_ahead<bytes>(p);
      __m512i codes[4];
      if constexpr (K == Packed::q6_k) {
        // ql's 64 bytes of a half hold blocks 4h, 4h + 1 in their low nibbles and 4h + 2, 4h + 3 in
        // their high ones; qh's 32 bytes, in both 256-bit halves, give each its two high bits.
    #pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512i ql = _mm512_loadu_si512(p + 64 * h);
          const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h)));
          const __m512i pair = _mm512_set1_epi8(0x30);
          codes[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                         _mm512_and_si512(_mm512_sllv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2)), pair));
          codes[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                             _mm512_and_si512(_mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)), pair));
        }
        const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
        w.scales16 = _mm256_cvtepi8_epi16(s8);
        w.d = half_as_float(p + 208);
        w.neg_dmin = 0.f;
      } else {
        k_scales_wide(p, w);
        const uint8_t* qs = p + (K == Packed::q5_k ? 48 : 16);
    #pragma GCC unroll 2
        for (int c = 0; c < 2; ++c) {
          const __m512i v = _mm512_loadu_si512(qs + 64 * c);
          codes[2 * c] = _mm512_and_si512(v, low4);
          codes[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
        if constexpr (K == Packed::q5_k) {
          // Bit j of byte l is the fifth bit of block j's value l, moved to bit 4 of its place.
          const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
          const __m512i bit4 = _mm512_set1_epi8(0x10);
          const __m512i fifth[4] = {_mm512_sllv_epi64(high, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2)),
                                    _mm512_sllv_epi64(high, _mm512_setr_epi64(3, 3, 3, 3, 1, 1, 1, 1)),
                                    _mm512_srlv_epi64(high, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2)),
                                    _mm512_srlv_epi64(high, _mm512_setr_epi64(1, 1, 1, 1, 3, 3, 3, 3))};
    #pragma GCC unroll 4
          for (int m = 0; m < 4; ++m) codes[m] = _mm512_or_si512(codes[m], _mm512_and_si512(fifth[m], bit4));
        }
      }
      __m512i products[4];
    #pragma GCC unroll 4
      for (int m = 0; m < 4; ++m)
        products[m] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[m], _mm512_loadu_si512(y + 64 * m));
      __m512i quads = sums_of_pairs(products);
      if constexpr (K == Packed::q6_k) {
        // Lane 4k + m holds sub-block 4m + k (block 2m + k / 2, half k % 2).
        const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
        quads = _mm512_mullo_epi32(quads, _mm512_cvtepi8_epi32(_mm_shuffle_epi8(s8, order)));
      }
      __m256i s = join_pairs(quads, first, second);
      const int64_t b = g * (kQuantGroup / kQuantBlock);
      if constexpr (K == Packed::q6_k) {
        const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.half_sums_of(r) + 2 * b));
        s = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_madd_epi16(halves, w.scales16), 5));
      }
      parts[j] = super_parts<K>(s, w, in, r, g);
    }
    acc = super_steps<K>(parts, SuperScales::of<K>(row + g0 * bytes, count), in.steps_of(r) + g0, acc);
  }
  return horizontal_sum(acc);
}
#endif

// Rounded rows [r0, r0 + R) against one weight row: out[i] for row r0 + i.
template <Packed K, int R>
inline void packed_dot_rows(const uint8_t* row, const RoundedBlocks& in, int64_t r0, float* out) {
  constexpr bool super = kPackedLayouts[static_cast<int>(K)].values == kQuantGroup;
  constexpr int64_t group_bytes = (super ? 1 : 8) * kPackedLayouts[static_cast<int>(K)].bytes;
  const int64_t blocks = in.k / kQuantBlock, full = blocks / 8;
  constexpr bool interleave = R > 1;  // see interleave_group
#ifdef LLAMA_CHAT_WIDE_VNNI
  if constexpr (R == 1 && kWide<K>) {
    out[0] = packed_dot_wide<K>(row, in, r0);
    return;
  }
#endif
  __m256 acc[R];
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  Group w;
  if constexpr (super) {
    for (int64_t g0 = 0; g0 < full; g0 += 8) {  // eight super-blocks at a time, their parts in registers
      const int count = static_cast<int>(std::min<int64_t>(8, full - g0));
      __m256i parts[R][8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const int64_t g = g0 + j;
        if (j < count) {
          ask_ahead<group_bytes>(row + g * group_bytes);
          decode_super_block<K, interleave>(row, g, w);
        }
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i)
          parts[i][j] = j < count ? super_parts<K>(group_sums<K, interleave>(w, in, r0 + i, g), w, in, r0 + i, g)
                                  : _mm256_setzero_si256();
      }
      const SuperScales scales = SuperScales::of<K>(row + g0 * group_bytes, count);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i] = super_steps<K>(parts[i], scales, in.steps_of(r0 + i) + g0, acc[i]);
    }
  } else {
    for (int64_t g = 0; g < full; ++g) {
      ask_ahead<group_bytes>(row + g * group_bytes);
      decode_small_group<K, interleave>(row, g, 8, w);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i] = add_group<K, interleave>(w, in, r0 + i, g, acc[i]);
    }
    if (blocks % 8) {
      decode_small_group<K, interleave>(row, full, static_cast<int>(blocks % 8), w);
      for (int i = 0; i < R; ++i) acc[i] = add_group<K, interleave>(w, in, r0 + i, full, acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = horizontal_sum(acc[i]);
}
#endif

#ifdef LLAMA_CHAT_AVX2
// ---------------------------------------------------------------------------------------------
// Many rows (a prompt's): weight rows decoded once into tiles, side by side.
//
// The path above decodes a group of a weight row again for every four input rows and spends
// most of its instructions on that and on moving sums between lanes. Here a tile of weight rows
// (16 with AVX-512 VNNI, else 8) is decoded once into vectors that hold four codes of each of
// its rows (lane j: row j), so one instruction takes four products for every row of the tile
// against a broadcast of four input values, and every input row of the call reuses the tile
// from the cache. The result is the same bits as packed_dot_rows: a block's integer sum is exact
// in any order, and each row's float sums are kept as the old path's lanes keep them (a 32-value
// kind's block b, a K-quant's super-block g, in lane b or g mod 8), in the same order, then added as
// horizontal_sum adds lanes.
//
// Without VNNI (AVX2) the four-product sums are vpmaddubsw's int16 pairs, added as int16 over as
// many codes as cannot overflow before one vpmaddwd widens them (kPairRun), and Q8_0's signed
// codes take the sign trick here too (magnitudes in `codes`, the codes in `signs`). A tile is
// taken a range of blocks and a block of input rows at a time (kChunkBlocks, kRowBlock), so that
// what a pass reads stays in L1 and L2 however long the rows and however many.


// The vector a tile's lanes fill, its float operations vectors.h's: 8 rows of 32-bit lanes in
// 256 bits, and below 16 in 512. The integer operations a tile adds are named with an i.
struct Lanes8 : Floats8 {
  using I = __m256i;
  static constexpr int kRows = 8;
#ifdef LLAMA_CHAT_VNNI
  static constexpr bool kPairs = false;
#else
  // Without VNNI a four-product sum is vpmaddubsw (pairs into int16) then vpmaddwd (into int32):
  // the pairs of several codes are added as int16 first where they cannot overflow, and widened
  // once (tile_sums).
  static constexpr bool kPairs = true;
  static I pairs(I u, I y) { return _mm256_maddubs_epi16(u, y); }
  static I iadd16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen(I t) { return _mm256_madd_epi16(t, _mm256_set1_epi16(1)); }
  static I widen_by(I t, I by) { return _mm256_madd_epi16(t, by); }
  static I ishl5(I a) { return _mm256_slli_epi32(a, 5); }
  static I isign(I y, I w) { return _mm256_sign_epi8(y, w); }
#endif
  // Input rows a pass takes together, their sums in registers (32 vector registers with
  // AVX-512, 16 without).
#if defined(__AVX512VL__)
  static constexpr int kPassRows = 8;
#else
  static constexpr int kPassRows = 4;
#endif
  static I izero() { return _mm256_setzero_si256(); }
  static I iload(const int32_t* p) { return _mm256_load_si256(reinterpret_cast<const I*>(p)); }
  static I iset1(int32_t v) { return _mm256_set1_epi32(v); }
  static I idot(I acc, I u, I y) { return dot_add(acc, u, y); }
  // acc plus, in each int32 lane, the sum of its two int16 products.
  static I idot16(I acc, I a, I b) {
#if defined(LLAMA_CHAT_AVX_VNNI)
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#elif defined(LLAMA_CHAT_VNNI)
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
  }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static I imullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static Vec to_float(I a) { return _mm256_cvtepi32_ps(a); }
};

#if defined(LLAMA_CHAT_VNNI) && !defined(LLAMA_CHAT_AVX_VNNI) && defined(__AVX512BW__)
// Half the instructions and loads per product of Lanes8.
struct Lanes16 : Floats16 {
  using I = __m512i;
  static constexpr int kRows = 16;
  static constexpr bool kPairs = false;
  static constexpr int kPassRows = 8;
  static I izero() { return _mm512_setzero_si512(); }
  static I iload(const int32_t* p) { return _mm512_load_si512(p); }
  static I iset1(int32_t v) { return _mm512_set1_epi32(v); }
  static I idot(I acc, I u, I y) { return _mm512_dpbusd_epi32(acc, u, y); }
  static I idot16(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static I imullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static Vec to_float(I a) { return _mm512_cvtepi32_ps(a); }
};
using TileLanes = Lanes16;
#else
using TileLanes = Lanes8;
#endif

// Weight rows a call of `rows` input rows is best split in multiples of: a tile's, where it takes
// tiles (a range of 35 rows took three tiles of 16, a quarter of their lanes empty).
inline int64_t packed_split_rows(int64_t rows) { return rows >= kTiledFromRows ? TileLanes::kRows : 1; }

// Eight vectors of eight 32-bit lanes transposed in place: v[c] lane j becomes v[j] lane c.
LLAMA_CHAT_HOT void transpose_8x8(__m256i* v) {
  __m256i t[8], u[8];
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x20);
    v[4 + i] = _mm256_permute2x128_si256(u[i], u[4 + i], 0x31);
  }
}

// A tile's weight rows (fewer at the end of a range: the rest zeros), every block decoded; n
// is the rows a tile holds, and each entry below has n lanes, lane j for row j.
struct DecodedTile {
  int64_t blocks = 0, n = 0;
  std::vector<int32_t, AlignedAllocator<int32_t>> codes;  // [(b * 8 + c) * n + j]: values 4c..4c + 3 of block b
  std::vector<float, AlignedAllocator<float>> scale;      // [b * n + j]: the block's a (K-quants: [g * n + j] d)
  std::vector<float, AlignedAllocator<float>> offset;     // [b * n + j]: the block's c (K-quants: [g * n + j] -dmin)
  std::vector<int32_t, AlignedAllocator<int32_t>> scales;  // Q4_K, Q5_K: [b * n + j] the block's integer scale
  std::vector<int32_t, AlignedAllocator<int32_t>> mins;    // Q4_K, Q5_K: [(4g + p) * n + j] mins 2p, 2p + 1 as int16
  std::vector<int32_t, AlignedAllocator<int32_t>> scales16;  // Q4_K, Q5_K without VNNI: scales as int16, twice
  std::vector<int32_t, AlignedAllocator<int32_t>> halves;  // [(2b + h) * n + j]: Q6_K's scale of half h
  std::vector<int32_t, AlignedAllocator<int32_t>> signs;   // as codes: Q8_0's signed codes (sign trick)
  std::vector<int32_t, AlignedAllocator<int32_t>> zero;    // kBiasedTiles: [b * n + j] -128 sum (u - z)
  std::vector<int32_t, AlignedAllocator<int32_t>> zero_halves;  // Q6_K: [(2b + h) * n + j] the same of half h
  // Q6_K, as int16 pairs: [(2b + h) * n + j] half h's scale twice, [(2 blocks + b) * n + j] the
  // scales of halves 0 and 1
  std::vector<int32_t, AlignedAllocator<int32_t>> halves16;

  void resize(Packed kind, bool sign_trick, int64_t block_count, int64_t rows) {
    blocks = block_count;
    n = rows;
    codes.resize(static_cast<size_t>(blocks * 8 * n));
    if (sign_trick) signs.resize(codes.size());
    zero.resize(static_cast<size_t>(blocks * n));
    if (kind == Packed::q6_k) zero_halves.resize(static_cast<size_t>(blocks * 2 * n));
    if (kind == Packed::q6_k) halves16.resize(static_cast<size_t>(blocks * 3 * n));
    if (kind == Packed::q4_k || kind == Packed::q5_k) {
      scales.resize(static_cast<size_t>(blocks * n));
      scales16.resize(static_cast<size_t>(blocks * n));
      mins.resize(static_cast<size_t>(blocks / 2 * n));
    }
    scale.resize(static_cast<size_t>(blocks * n));
    offset.resize(static_cast<size_t>(blocks * n));
    halves.resize(static_cast<size_t>(blocks * 2 * n));
  }
};

// Weight rows [first, first + count) of `data` (count at most rows) into a tile of `rows` lanes,
// eight rows at a time.
template <Packed K>
void decode_tile(const uint8_t* data, int64_t row_bytes, int64_t first, int64_t count, int64_t blocks, int64_t rows,
                 DecodedTile& tile) {
  constexpr bool super = kPackedLayouts[static_cast<int>(K)].values == kQuantGroup;
  constexpr int64_t bytes = kPackedLayouts[static_cast<int>(K)].bytes;
  tile.resize(K, kSignTrick<K>, blocks, rows);
  const int64_t n = rows, groups = (blocks + 7) / 8;
  Group w[8];
  for (int64_t eighth = 0; eighth < rows; eighth += 8) {
    const int64_t here = std::max<int64_t>(0, std::min<int64_t>(8, count - eighth));
    for (int64_t g = 0; g < groups; ++g) {
      const int in_group = static_cast<int>(std::min<int64_t>(8, blocks - 8 * g));
      for (int64_t j = 0; j < 8; ++j) {
        if (j >= here) {
          for (int b = 0; b < 8; ++b) w[j].u[b] = w[j].signs[b] = _mm256_setzero_si256();
          w[j].scale = w[j].offset = _mm256_setzero_ps();
          w[j].scales = _mm256_setzero_si256();
          w[j].mins16 = _mm_setzero_si128();
          w[j].d = w[j].neg_dmin = 0.f;
          continue;
        }
        const uint8_t* row = data + (first + eighth + j) * row_bytes;
        if constexpr (super) decode_super_block<K, false>(row, g, w[j]);
        else decode_small_group<K, false>(row, g, in_group, w[j]);
        if constexpr (!kOffset<K>) w[j].offset = _mm256_setzero_ps();
        if constexpr (!kMins<K>) w[j].scales = _mm256_setzero_si256();
      }
      __m256i scales[8], offsets[8];
      for (int j = 0; j < 8; ++j) {
        scales[j] = super ? w[j].scales : _mm256_castps_si256(w[j].scale);
        offsets[j] = _mm256_castps_si256(w[j].offset);
      }
      transpose_8x8(scales);
      transpose_8x8(offsets);
      if constexpr (super) {
        for (int64_t j = 0; j < 8; ++j) {
          tile.scale[g * n + eighth + j] = w[j].d;
          tile.offset[g * n + eighth + j] = w[j].neg_dmin;
          if constexpr (kMins<K>) {
            alignas(16) int32_t pairs[4];
            _mm_store_si128(reinterpret_cast<__m128i*>(pairs), w[j].mins16);
            for (int64_t m = 0; m < 4; ++m) tile.mins[(4 * g + m) * n + eighth + j] = pairs[m];
          }
        }
      }
      for (int bb = 0; bb < in_group; ++bb) {
        const int64_t b = 8 * g + bb;
        __m256i v[8];
        for (int j = 0; j < 8; ++j) v[j] = w[j].u[bb];
        transpose_8x8(v);
        if constexpr (kBiasedTiles<K>) {
          __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
          for (int c = 0; c < 8; ++c) {
            v[c] = _mm256_sub_epi8(v[c], _mm256_set1_epi8(static_cast<char>(kTileZero<K>)));
            half[c / 4] = dot_add(half[c / 4], _mm256_set1_epi8(1), v[c]);
          }
          const auto times_128 = [](__m256i sum) { return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum, 7)); };
          _mm256_store_si256(reinterpret_cast<__m256i*>(tile.zero.data() + b * n + eighth),
                             times_128(_mm256_add_epi32(half[0], half[1])));
          if constexpr (K == Packed::q6_k)
            for (int h = 0; h < 2; ++h)
              _mm256_store_si256(reinterpret_cast<__m256i*>(tile.zero_halves.data() + (2 * b + h) * n + eighth),
                                 times_128(half[h]));
        }
        for (int c = 0; c < 8; ++c)
          _mm256_store_si256(reinterpret_cast<__m256i*>(tile.codes.data() + (b * 8 + c) * n + eighth), v[c]);
        if constexpr (kSignTrick<K>) {
          for (int j = 0; j < 8; ++j) v[j] = w[j].signs[bb];
          transpose_8x8(v);
          for (int c = 0; c < 8; ++c)
            _mm256_store_si256(reinterpret_cast<__m256i*>(tile.signs.data() + (b * 8 + c) * n + eighth), v[c]);
        }
        if constexpr (kMins<K>) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(tile.scales.data() + b * n + eighth), scales[bb]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(tile.scales16.data() + b * n + eighth),
                             _mm256_or_si256(scales[bb], _mm256_slli_epi32(scales[bb], 16)));
        } else if constexpr (!super) {
          _mm256_store_si256(reinterpret_cast<__m256i*>(tile.scale.data() + b * n + eighth), scales[bb]);
          _mm256_store_si256(reinterpret_cast<__m256i*>(tile.offset.data() + b * n + eighth), offsets[bb]);
        }
        if constexpr (K == Packed::q6_k) {
          for (int64_t j = 0; j < 8; ++j) {
            const uint8_t* p = data + (first + eighth + j) * row_bytes + g * bytes;
            tile.halves[(2 * b) * n + eighth + j] = j < here ? static_cast<int8_t>(p[192 + 2 * bb]) : 0;
            tile.halves[(2 * b + 1) * n + eighth + j] = j < here ? static_cast<int8_t>(p[192 + 2 * bb + 1]) : 0;
            const uint32_t first16 = static_cast<uint16_t>(tile.halves[(2 * b) * n + eighth + j]),
                           second16 = static_cast<uint16_t>(tile.halves[(2 * b + 1) * n + eighth + j]);
            tile.halves16[(2 * b) * n + eighth + j] = static_cast<int32_t>(first16 | first16 << 16);
            tile.halves16[(2 * b + 1) * n + eighth + j] = static_cast<int32_t>(second16 | second16 << 16);
            tile.halves16[(2 * blocks + b) * n + eighth + j] = static_cast<int32_t>(first16 | second16 << 16);
          }
        }
      }
    }
  }
}

LLAMA_CHAT_HOT int32_t word_at(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// Codes a run of int16 pair sums takes before it is widened to int32 (vpmaddubsw's pairs, then
// int16 additions; Lanes8::kPairs): a pair is at most 2 * 127 * the largest code, and the run's
// sum must stay within int16. Four-bit codes (up to 15) take a whole block (8 words: 16 pairs of
// at most 3810 each, 30480), five-bit ones half (31496), Q6_K's six-bit ones a quarter (32004),
// Q8_0's magnitudes (up to 128, sign trick) one word. The sums are exact integers either way.
template <Packed K>
constexpr int kPairRun = K == Packed::q6_k ? 2 : (K == Packed::q5_0 || K == Packed::q5_1 || K == Packed::q5_k) ? 4
                         : K == Packed::q8_0 ? 1 : 8;

// s[i] = words [C0, C1) of block b of rounded row r0 + i against the tile's codes, each lane the
// exact integer sum of its weight row's products.
template <Packed K, class L, int R, int C0, int C1>
LLAMA_CHAT_HOT void tile_sums(const DecodedTile& tile, const RoundedBlocks& in, int64_t r0, int64_t b,
                              typename L::I* s, typename L::I by = L::izero()) {
  using I = typename L::I;
  constexpr int64_t n = L::kRows;
  const int32_t* codes = tile.codes.data() + b * 8 * n;
  if constexpr (L::kPairs) {
    constexpr int G = kPairRun<K>;
    const int32_t* signs = kSignTrick<K> ? tile.signs.data() + b * 8 * n : nullptr;
#pragma GCC unroll 8
    for (int c = C0; c < C1; c += G) {
      I t[R];
#pragma GCC unroll 8
      for (int cc = c; cc < c + G; ++cc) {
        const I wv = L::iload(codes + cc * n);
        I sv;
        if constexpr (kSignTrick<K>) sv = L::iload(signs + cc * n);
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          I y = L::iset1(word_at(in.q_of(r0 + i) + 32 * b + 4 * cc));
          if constexpr (kSignTrick<K>) y = L::isign(y, sv);
          const I p = L::pairs(wv, y);
          t[i] = cc == c ? p : L::iadd16(t[i], p);
        }
      }
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        // Q6_K's pairs are widened by its half's scale, Q4_K's and Q5_K's by their block's
        // (block_sums), the others' by ones.
        const I wide = K == Packed::q6_k || kMins<K> ? L::widen_by(t[i], by) : L::widen(t[i]);
        s[i] = c == C0 ? wide : L::iadd(s[i], wide);
      }
    }
  } else if constexpr (kBiasedTiles<K>) {
    const I zero = C1 - C0 == 8 ? L::iload(tile.zero.data() + b * n)
                                : L::iload(tile.zero_halves.data() + (2 * b + C0 / 4) * n);
    const int8_t* biased = reinterpret_cast<const int8_t*>(in.biased_of(r0));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) s[i] = zero;
#pragma GCC unroll 8
    for (int c = C0; c < C1; ++c) {
      const I wv = L::iload(codes + c * n);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) s[i] = L::idot(s[i], L::iset1(word_at(biased + 32 * (8 * b + c) + 4 * i)), wv);
    }
  } else {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) s[i] = L::izero();
#pragma GCC unroll 8
    for (int c = C0; c < C1; ++c) {
      const I wv = L::iload(codes + c * n);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) s[i] = L::idot(s[i], wv, L::iset1(word_at(in.q_of(r0 + i) + 32 * b + 4 * c)));
    }
  }
}

// s[i] = block b of rounded row r0 + i against the tile: each lane the exact integer sum of its
// weight row's products less the zero point, times the scale where it is an integer (Q6_K's
// halves, Q4_K's and Q5_K's blocks).
template <Packed K, class L, int R>
LLAMA_CHAT_HOT void block_sums(const DecodedTile& tile, const RoundedBlocks& in, int64_t r0, int64_t b,
                               typename L::I* s) {
  using I = typename L::I;
  constexpr int64_t n = L::kRows;
  if constexpr (K == Packed::q6_k && L::kPairs) {
    // Each half's pair sums widened by vpmaddwd with the half's scale instead of ones, and
    // both halves' zero points in one vpmaddwd of the input's two half sums with the two
    // scales: sc0 * (raw0 - 32 hs0) + sc1 * (raw1 - 32 hs1), the integer of the branch below.
    tile_sums<K, L, R, 0, 4>(tile, in, r0, b, s, L::iload(tile.halves16.data() + (2 * b) * n));
    I second[R];
    tile_sums<K, L, R, 4, 8>(tile, in, r0, b, second, L::iload(tile.halves16.data() + (2 * b + 1) * n));
    const I pair = L::iload(tile.halves16.data() + (2 * tile.blocks + b) * n);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      int32_t both;
      std::memcpy(&both, in.half_sums_of(r0 + i) + 2 * b, sizeof both);
      s[i] = L::isub(L::iadd(s[i], second[i]), L::ishl5(L::widen_by(L::iset1(both), pair)));
    }
  } else if constexpr (K == Packed::q6_k) {
    // Each half's sum less its zero point, times the half's scale: the same integer as the
    // old path's scaled halves less 32 times the scaled input sums.
    I first_half[R];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      if (h == 0) tile_sums<K, L, R, 0, 4>(tile, in, r0, b, s);
      else tile_sums<K, L, R, 4, 8>(tile, in, r0, b, s);
      const I scale = L::iload(tile.halves.data() + (2 * b + h) * n);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        if constexpr (!kBiasedTiles<K>)
          s[i] = L::isub(s[i], L::iset1(static_cast<int32_t>(in.half_sums_of(r0 + i)[2 * b + h]) << 5));
        s[i] = L::imullo(s[i], scale);
        if (h == 0) first_half[i] = s[i];
        else s[i] = L::iadd(s[i], first_half[i]);
      }
    }
  } else if constexpr (kMins<K> && L::kPairs) {
    // The pairs widened by the block's scale: its sum times the scale, as the branch below.
    tile_sums<K, L, R, 0, 8>(tile, in, r0, b, s, L::iload(tile.scales16.data() + b * n));
  } else {
    tile_sums<K, L, R, 0, 8>(tile, in, r0, b, s);
    if constexpr (kMins<K>) {
      const I scale = L::iload(tile.scales.data() + b * n);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) s[i] = L::imullo(s[i], scale);
    }
    if constexpr (kZeroShift<K> > 0 && !kBiasedTiles<K>) {
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) s[i] = L::isub(s[i], L::iset1(in.sums_of(r0 + i)[b] << kZeroShift<K>));
    }
  }
}

// Input rows [r0, r0 + R) against blocks [b0, b1) of a tile: lanes[i][l] lane j goes on adding
// row r0 + i's products with the tile's row j over the blocks b = l mod 8 (zeros before the
// first blocks). Taken a range of blocks at a time, every sum still adds its blocks in order.
template <Packed K, class L, int R>
LLAMA_CHAT_HOT void tile_pass(const DecodedTile& tile, const RoundedBlocks& in, int64_t r0, int64_t b0, int64_t b1,
                              typename L::Vec (*lanes)[8]) {
  using I = typename L::I;
  using F = typename L::Vec;
  constexpr int64_t n = L::kRows;
  for (int l = 0; l < 8; ++l) {
    F acc[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) acc[i] = lanes[i][l];
    for (int64_t b = b0 + ((l - b0) % 8 + 8) % 8; b < b1; b += 8) {
      I s[R];
      block_sums<K, L, R>(tile, in, r0, b, s);
      const F scale = L::load(tile.scale.data() + b * n);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const float step = kBiasedTiles<K> ? in.biased_steps_of(r0)[8 * b + i] : in.steps_of(r0 + i)[b];
        acc[i] = L::fmadd(L::to_float(s[i]), L::mul(scale, L::set1(step)), acc[i]);
        if constexpr (kOffset<K>)
          acc[i] = L::fmadd(L::load(tile.offset.data() + b * n), L::set1(in.step_sums_of(r0 + i)[b]), acc[i]);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) lanes[i][l] = acc[i];
  }
}

// Input rows [r0, r0 + R) against the K-quant super-blocks [b0 / 8, b1 / 8) of a tile: lanes[i][l]
// lane j goes on adding row r0 + i's steps of super-blocks g = l mod 8 with the tile's row j (the
// numerics above), as super_steps adds a row alone's.
template <Packed K, class L, int R>
LLAMA_CHAT_HOT void tile_pass_super(const DecodedTile& tile, const RoundedBlocks& in, int64_t r0, int64_t b0,
                                    int64_t b1, typename L::Vec (*lanes)[8]) {
  using I = typename L::I;
  using F = typename L::Vec;
  constexpr int64_t n = L::kRows;
  for (int64_t g = b0 / 8; g < b1 / 8; ++g) {
    I total[R];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) total[i] = L::izero();
#pragma GCC unroll 1
    for (int bb = 0; bb < 8; ++bb) {
      const int64_t b = 8 * g + bb;
      I s[R];
      block_sums<K, L, R>(tile, in, r0, b, s);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) total[i] = L::iadd(total[i], s[i]);
    }
    const F d = L::load(tile.scale.data() + g * n);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      lanes[i][g % 8] = L::fmadd(L::to_float(total[i]), L::mul(d, L::set1(in.steps_of(r0 + i)[g])), lanes[i][g % 8]);
    if constexpr (kMins<K>) {
      const F neg_dmin = L::load(tile.offset.data() + g * n);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        I m = L::izero();
        const int16_t* sums = in.sums16_of(r0 + i) + 8 * g;
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          int32_t pair;
          std::memcpy(&pair, sums + 2 * p, sizeof pair);
          m = L::idot16(m, L::iload(tile.mins.data() + (4 * g + p) * n), L::iset1(pair));
        }
        lanes[i][g % 8] = L::fmadd(L::to_float(m), L::mul(neg_dmin, L::set1(in.steps_of(r0 + i)[g])), lanes[i][g % 8]);
      }
    }
  }
}

// A row's eight lanes added in horizontal_sum's order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
template <class L>
LLAMA_CHAT_HOT typename L::Vec lanes_sum(const typename L::Vec* a) {
  return L::add(L::add(L::add(a[0], a[4]), L::add(a[2], a[6])), L::add(L::add(a[1], a[5]), L::add(a[3], a[7])));
}

// A tile's blocks are taken this many at a time (its codes for them about 16 KiB, held in L1
// while every pass of input rows reads them).
template <class L>
constexpr int64_t kChunkBlocks = (16 << 10) / (32 * L::kRows);
// Tiles are decoded a group at a time (their codes about kGroupBytes, at most kMostTiles tiles)
// and the input rows taken a block of rows at a time (their rounded values about kRowBlockBytes,
// at most kRowBlock rows), every tile of the group against every row of the block: the block's
// rows stay in L2 while the group's tiles take them, and a prompt's rows are read from memory
// once a group instead of once a tile. Short rows' groups (1,536 inputs: 16 tiles, 192 KiB) stay
// in L2 beside the block; long rows' (8,960: 14 tiles) in L3, each tile read from there once a
// block of rows (12), which costs less than reading the whole prompt once every tile or two.
constexpr int64_t kGroupBytes = 1 << 20;
constexpr int64_t kMostTiles = 16;
constexpr int64_t kRowBlockBytes = 128 << 10;
constexpr int64_t kRowBlock = 64;

template <bool Add, Packed K>
void packed_tiles_of(const uint8_t* data, const RoundedBlocks& in, int64_t row_first, int64_t row_stop, int64_t first,
                     int64_t stop, float* out, int64_t row_stride) {
  using L = TileLanes;
  using F = typename L::Vec;
  const int64_t row_bytes = packed_row_bytes(K, in.k), blocks = in.k / kQuantBlock;
  const int64_t row_block =
      std::max<int64_t>(L::kPassRows, std::min(kRowBlock, kRowBlockBytes / in.padded / L::kPassRows * L::kPassRows));
  // Rows that fit one block take each tile once either way: a group would only push its codes
  // out of L1.
  const int64_t group = row_stop - row_first <= row_block
                            ? 1
                            : std::clamp<int64_t>(kGroupBytes / (L::kRows * in.padded), 1, kMostTiles);
  std::vector<DecodedTile> tiles(static_cast<size_t>(group));
  std::vector<F, AlignedAllocator<F>> state(static_cast<size_t>(kRowBlock * 8));
  F(*lanes)[8] = reinterpret_cast<F(*)[8]>(state.data());
  alignas(64) float values[L::kRows];
  for (int64_t group_first = first; group_first < stop; group_first += group * L::kRows) {
    const int64_t in_group = std::min(group, (stop - group_first + L::kRows - 1) / L::kRows);
    for (int64_t t = 0; t < in_group; ++t) {
      const int64_t tile_first = group_first + t * L::kRows;
      decode_tile<K>(data, row_bytes, tile_first, std::min<int64_t>(L::kRows, stop - tile_first), blocks, L::kRows,
                     tiles[t]);
    }
    for (int64_t rb = row_first; rb < row_stop; rb += row_block) {
      const int64_t re = std::min(row_stop, rb + row_block);
      for (int64_t t = 0; t < in_group; ++t) {
        const DecodedTile& tile = tiles[t];
        const int64_t tile_first = group_first + t * L::kRows, count = std::min<int64_t>(L::kRows, stop - tile_first);
        for (int64_t i = 0; i < (re - rb) * 8; ++i) state[i] = L::zero();
        for (int64_t b0 = 0; b0 < blocks; b0 += kChunkBlocks<L>) {
          const int64_t b1 = std::min(blocks, b0 + kChunkBlocks<L>);
          int64_t r = rb;
          if constexpr (kSuperSteps<K>) {
            for (; r + L::kPassRows <= re; r += L::kPassRows)
              tile_pass_super<K, L, L::kPassRows>(tile, in, r, b0, b1, lanes + (r - rb));
            for (; r + 2 <= re; r += 2) tile_pass_super<K, L, 2>(tile, in, r, b0, b1, lanes + (r - rb));
            if (r < re) tile_pass_super<K, L, 1>(tile, in, r, b0, b1, lanes + (r - rb));
          } else {
            for (; r + L::kPassRows <= re; r += L::kPassRows)
              tile_pass<K, L, L::kPassRows>(tile, in, r, b0, b1, lanes + (r - rb));
            for (; r + 2 <= re; r += 2) tile_pass<K, L, 2>(tile, in, r, b0, b1, lanes + (r - rb));
            if (r < re) tile_pass<K, L, 1>(tile, in, r, b0, b1, lanes + (r - rb));
          }
        }
        for (int64_t r = rb; r < re; ++r) {
          const F sum = lanes_sum<L>(lanes[r - rb]);
          float* o = out + (r - row_first) * row_stride + (tile_first - first);
          if (count == L::kRows) {  // stored straight: a copy through `values` was a call per row
            if constexpr (Add) L::store(o, L::add(L::load(o), sum));
            else L::store(o, sum);
            continue;
          }
          L::store(values, sum);
          for (int64_t j = 0; j < count; ++j) {
            if constexpr (Add) o[j] += values[j];
            else o[j] = values[j];
          }
        }
      }
    }
  }
}
#endif

#ifndef LLAMA_CHAT_AVX2
inline int64_t packed_split_rows(int64_t) { return 1; }
#endif

// Rounded rows [row_first, row_stop) against weight rows [first, stop) of `data` (rows of
// in.k values, packed): out[(r - row_first) * row_stride + (j - first)] is weight row j with
// rounded row r; stored, or with Add added to what is there.
// Weight rows a tile of them has, for rows of `row_bytes`: about 16 KiB, so that a tile stays in
// the core's caches while every four input rows take it (and those rows' values stay in L1).
inline int64_t packed_tile_rows(int64_t row_bytes) { return std::max<int64_t>(1, (16 << 10) / row_bytes); }

template <bool Add, Packed K>
void packed_range_of(const uint8_t* data, const RoundedBlocks& in, int64_t row_first, int64_t row_stop, int64_t first,
                     int64_t stop, float* out, int64_t row_stride) {
  const int64_t row_bytes = packed_row_bytes(K, in.k);
  auto put = [&](int64_t r, int64_t j, float v) {
    float& slot = out[(r - row_first) * row_stride + (j - first)];
    if constexpr (Add) slot += v;
    else slot = v;
  };
#ifdef LLAMA_CHAT_AVX2
  if (in.rows >= kTiledFromRows)  // as round_blocks decided (it left out what tiles do not read)
    return packed_tiles_of<Add, K>(data, in, row_first, row_stop, first, stop, out, row_stride);
  const int64_t tile = packed_tile_rows(row_bytes);
  for (int64_t tile_first = first; tile_first < stop; tile_first += tile) {
    const int64_t tile_stop = std::min(stop, tile_first + tile);
    // Four rounded rows share each decoded group, and the tile's weight rows the four rows.
    float four[4];
    int64_t r = row_first;
    for (; r + 4 <= row_stop; r += 4)
      for (int64_t j = tile_first; j < tile_stop; ++j) {
        packed_dot_rows<K, 4>(data + j * row_bytes, in, r, four);
        for (int i = 0; i < 4; ++i) put(r + i, j, four[i]);
      }
    if (r == row_stop) continue;
    for (int64_t j = tile_first; j < tile_stop; ++j) {
      const uint8_t* row = data + j * row_bytes;
      switch (row_stop - r) {
        case 3: packed_dot_rows<K, 3>(row, in, r, four); break;
        case 2: packed_dot_rows<K, 2>(row, in, r, four); break;
        default: packed_dot_rows<K, 1>(row, in, r, four); break;
      }
      for (int64_t i = 0; r + i < row_stop; ++i) put(r + i, j, four[i]);
    }
  }
#else
  for (int64_t j = first; j < stop; ++j)
    for (int64_t r = row_first; r < row_stop; ++r)
      put(r, j, packed_dot_scalar(K, data + j * row_bytes, in.k / kQuantBlock, in, r));
#endif
}

template <bool Add = false>
void packed_range(Packed kind, const uint8_t* data, const RoundedBlocks& in, int64_t row_first, int64_t row_stop,
                  int64_t first, int64_t stop, float* out, int64_t row_stride) {
  switch (kind) {
    case Packed::q8_0: return packed_range_of<Add, Packed::q8_0>(data, in, row_first, row_stop, first, stop, out, row_stride);
    case Packed::q4_0: return packed_range_of<Add, Packed::q4_0>(data, in, row_first, row_stop, first, stop, out, row_stride);
    case Packed::q4_1: return packed_range_of<Add, Packed::q4_1>(data, in, row_first, row_stop, first, stop, out, row_stride);
    case Packed::q5_0: return packed_range_of<Add, Packed::q5_0>(data, in, row_first, row_stop, first, stop, out, row_stride);
    case Packed::q5_1: return packed_range_of<Add, Packed::q5_1>(data, in, row_first, row_stop, first, stop, out, row_stride);
    case Packed::q4_k: return packed_range_of<Add, Packed::q4_k>(data, in, row_first, row_stop, first, stop, out, row_stride);
    case Packed::q5_k: return packed_range_of<Add, Packed::q5_k>(data, in, row_first, row_stop, first, stop, out, row_stride);
    case Packed::q6_k: return packed_range_of<Add, Packed::q6_k>(data, in, row_first, row_stop, first, stop, out, row_stride);
  }
}

}  // namespace llama_chat_cpu
