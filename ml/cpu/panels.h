// Products of several input rows with float32 weights repacked as panels, for the batched decode
// step (decode.cpp). A panel is 16 consecutive outputs (weight rows) with their k weights laid
// out input by input: panel[i * 16 + t] is output t's weight for input i, so one input's weights
// for all 16 outputs are two vectors. A tile of up to six input rows is taken against a panel with
// each input broadcast: twelve accumulators, two weight loads and six broadcasts per twelve
// multiply-adds, and no sums across a vector at the end. Against weight rows taken one at a time
// (dot4: a load per multiply-add, and a sum across each accumulator), a stories15M-sized
// classifier of 16 rows took 2.1-2.4 ms instead of 3.3 on two cores (62-70 against 44 billion
// multiply-adds a second, of the cores' 102). With AVX-512 a panel is one vector and a tile
// takes up to 16 rows (one accumulator each): on a 2-core Xeon the same classifier of 16 rows
// took 1.3 ms instead of the AVX2 tiles' 2.0.
//
// Each product is one accumulator lane adding its row's products input by input, in order, from
// zero: the same sum however many rows share the tile, so a row's result does not depend on the
// rows beside it in a batch.
//
// The tiles read their input rows interleaved: row r's input i at xt[i * ld + r], so that one
// pointer, stepped by `ld` an input, reaches every row of a tile at a constant offset. With a
// pointer per row, a 16-row tile needed more than the 15 general registers: its loop fetched
// pointers from vector registers and the stack on the multiply-adds' port, and the classifier
// of 16 rows ran at 107 instead of 131 billion multiply-adds a second (2-core Xeon, C++ test).
// One row interleaved is the row itself.
#pragma once

#include "dot.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace llama_chat_cpu {

constexpr int64_t kPanel = 16;  // outputs per panel
#ifdef __AVX512F__
// A panel is one 512-bit vector: a tile of up to 16 rows keeps 16 accumulators and a panel's
// weights in 18 of the 32 registers, with each row's input broadcast from memory by its
// multiply-add. The stories15M-sized classifier of 16 rows took 1.3 ms instead of 2.0 with the
// AVX2 tiles (116 against 73 billion multiply-adds a second, 2-core Xeon, C++ test).
constexpr int kMostTileRows = 16;
#else
constexpr int kMostTileRows = 6;
#endif
// The first tile of a panel asks for the weights this far ahead, a cache line per input: the
// hardware's prefetcher alone left a 16-row classifier 10 % slower, and the whole 16-row step 9 %
// slower. With the tiles reading interleaved rows, 4 KiB ahead (some 200 ns of a 16-row tile)
// beats 32: the 16-row classifier took 0.89 ms instead of 1.12 with the AVX-512 tiles (165
// against 131 billion multiply-adds a second, the cores' peak) and 1.79 instead of 1.96 with the
// AVX2 ones, 8 KiB falling in between (2-core Xeon, C++ test). A row alone (two panels at a
// time, `panel_pair`) does not ask: it is bound by the memory, and the one measurement of it
// asking, on a noisy machine, was slower.
constexpr int64_t kAheadBytes = 4 << 10;

#ifdef __AVX512F__
// Rows [0, R) of the interleaved inputs xt (row r's input i at xt[i * ld + r]) against one panel
// of k inputs: row r's 16 results go to out + r * out_stride, stored or added. Each result is one
// lane adding its row's products input by input from zero, as the AVX2 tiles and `panel_pair` add
// them: the same bits on either path. An array of accumulators stays in registers here (every
// index is a constant once unrolled).
template <int R, bool Add, bool Ahead = false>
inline void panel_tile(const float* xt, int64_t ld, const float* panel, int64_t k, float* out,
                       int64_t out_stride) {
  static_assert(R >= 1 && R <= kMostTileRows, "one to sixteen rows a tile");
  __m512 c[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) c[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i, xt += ld) {
    if constexpr (Ahead)  // past the end of the weights it is a hint that fetches nothing
      _mm_prefetch(reinterpret_cast<const char*>(panel + i * kPanel) + kAheadBytes, _MM_HINT_T0);
    const __m512 w = _mm512_loadu_ps(panel + i * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) c[r] = _mm512_fmadd_ps(_mm512_set1_ps(xt[r]), w, c[r]);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* target = out + r * out_stride;
    if constexpr (Add) c[r] = _mm512_add_ps(_mm512_loadu_ps(target), c[r]);
    _mm512_storeu_ps(target, c[r]);
  }
}

// From this many rows on, two panels are taken at once by tiles of up to 14 rows: two weight
// loads and one broadcast per two multiply-adds of each row, 28 accumulators. A stories15M-sized
// classifier of 64 rows took 4.3 ms instead of 4.9 (C++ test, 2-core Xeon); at 16 rows, as two
// tiles of 8, it lost (1.4 against 1.3 ms).
constexpr int64_t kPairedFromRows = 24;
constexpr int kMostPairedRows = 14;

// Rows [0, R) of xt (as in `panel_tile`) against two panels (`next` follows `panel`): row r's 32
// results go to out + r * out_stride. Each result is summed as in `panel_tile`.
template <int R, bool Add>
inline void panel_pair_tile(const float* xt, int64_t ld, const float* panel, const float* next, int64_t k,
                            float* out, int64_t out_stride) {
  static_assert(R >= 1 && R <= kMostPairedRows, "one to fourteen rows a paired tile");
  __m512 c[R], d[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) c[r] = d[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i, xt += ld) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + i * kPanel) + kAheadBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(next + i * kPanel) + kAheadBytes, _MM_HINT_T0);
    const __m512 w = _mm512_loadu_ps(panel + i * kPanel), v = _mm512_loadu_ps(next + i * kPanel);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(xt[r]);
      c[r] = _mm512_fmadd_ps(b, w, c[r]);
      d[r] = _mm512_fmadd_ps(b, v, d[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    float* target = out + r * out_stride;
    if constexpr (Add) {
      c[r] = _mm512_add_ps(_mm512_loadu_ps(target), c[r]);
      d[r] = _mm512_add_ps(_mm512_loadu_ps(target + kPanel), d[r]);
    }
    _mm512_storeu_ps(target, c[r]);
    _mm512_storeu_ps(target + kPanel, d[r]);
  }
}

// The paired tile of exactly `rows` rows (R to kMostPairedRows).
template <int R, bool Add>
inline void paired_rows_from(int rows, const float* xt, int64_t ld, const float* panel, const float* next,
                             int64_t k, float* out, int64_t out_stride) {
  if constexpr (R < kMostPairedRows) {
    if (rows > R) return paired_rows_from<R + 1, Add>(rows, xt, ld, panel, next, k, out, out_stride);
  }
  panel_pair_tile<R, Add>(xt, ld, panel, next, k, out, out_stride);
}

// All `rows` rows of xt (interleaved, `rows` apart) against two whole panels, in near-even paired
// tiles (64 rows: 13, 13, 13, 13, 12).
template <bool Add>
inline void paired_panels(int64_t rows, const float* xt, int64_t k, const float* panel, float* out,
                          int64_t row_stride) {
  const int64_t tiles = (rows + kMostPairedRows - 1) / kMostPairedRows;
  for (int64_t r = 0, t = 0; r < rows; ++t) {
    const int taken = static_cast<int>((rows - r) / (tiles - t));
    paired_rows_from<1, Add>(taken, xt + r, rows, panel, panel + k * kPanel, k, out + r * row_stride, row_stride);
    r += taken;
  }
}
#endif

#ifdef LLAMA_CHAT_AVX2
// 16 results into out[0..16): stored, or added to what is there.
template <bool Add>
inline void put16(float* out, __m256 low, __m256 high) {
  if constexpr (Add) {
    low = _mm256_add_ps(_mm256_loadu_ps(out), low);
    high = _mm256_add_ps(_mm256_loadu_ps(out + 8), high);
  }
  _mm256_storeu_ps(out, low);
  _mm256_storeu_ps(out + 8, high);
}

// Rows [0, R) of the interleaved inputs xt (row r's input i at xt[i * ld + r]) against one panel
// of k inputs: row r's 16 results go to out + r * out_stride, stored or added. Straight into the
// step's outputs: through a tile on the stack and a copy, the stories15M-sized classifier of 16
// rows took a quarter longer (C++ test).
#ifndef __AVX512F__
template <int R, bool Add, bool Ahead = false>
inline void panel_tile(const float* xt, int64_t ld, const float* panel, int64_t k, float* out,
                       int64_t out_stride) {
  static_assert(R >= 1 && R <= kMostTileRows, "one to six rows a tile");
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // Named accumulators, not an array: GCC kept an array of them in memory, storing every one
  // after each multiply-add (16 instead of 60 billion multiply-adds a second).
  for (int64_t i = 0; i < k; ++i, xt += ld) {
    if constexpr (Ahead)  // past the end of the weights it is a hint that fetches nothing
      _mm_prefetch(reinterpret_cast<const char*>(panel + i * kPanel) + kAheadBytes, _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanel), w1 = _mm256_loadu_ps(panel + i * kPanel + 8);
    __m256 b = _mm256_broadcast_ss(xt);
    c00 = _mm256_fmadd_ps(b, w0, c00);
    c01 = _mm256_fmadd_ps(b, w1, c01);
    if constexpr (R > 1) {
      b = _mm256_broadcast_ss(xt + 1);
      c10 = _mm256_fmadd_ps(b, w0, c10);
      c11 = _mm256_fmadd_ps(b, w1, c11);
    }
    if constexpr (R > 2) {
      b = _mm256_broadcast_ss(xt + 2);
      c20 = _mm256_fmadd_ps(b, w0, c20);
      c21 = _mm256_fmadd_ps(b, w1, c21);
    }
    if constexpr (R > 3) {
      b = _mm256_broadcast_ss(xt + 3);
      c30 = _mm256_fmadd_ps(b, w0, c30);
      c31 = _mm256_fmadd_ps(b, w1, c31);
    }
    if constexpr (R > 4) {
      b = _mm256_broadcast_ss(xt + 4);
      c40 = _mm256_fmadd_ps(b, w0, c40);
      c41 = _mm256_fmadd_ps(b, w1, c41);
    }
    if constexpr (R > 5) {
      b = _mm256_broadcast_ss(xt + 5);
      c50 = _mm256_fmadd_ps(b, w0, c50);
      c51 = _mm256_fmadd_ps(b, w1, c51);
    }
  }
  put16<Add>(out, c00, c01);
  if constexpr (R > 1) put16<Add>(out + out_stride, c10, c11);
  if constexpr (R > 2) put16<Add>(out + 2 * out_stride, c20, c21);
  if constexpr (R > 3) put16<Add>(out + 3 * out_stride, c30, c31);
  if constexpr (R > 4) put16<Add>(out + 4 * out_stride, c40, c41);
  if constexpr (R > 5) put16<Add>(out + 5 * out_stride, c50, c51);
}
#endif

// One row against two panels (`next` follows `panel`): 32 results into out. Alone, a row is
// bound by reading the weights; two panels at once read them as fast as rows of weights do.
template <bool Add>
inline void panel_pair(const float* x, const float* panel, const float* next, int64_t k, float* out) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 b = _mm256_broadcast_ss(x + i);
    c00 = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + i * kPanel), c00);
    c01 = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + i * kPanel + 8), c01);
    c10 = _mm256_fmadd_ps(b, _mm256_loadu_ps(next + i * kPanel), c10);
    c11 = _mm256_fmadd_ps(b, _mm256_loadu_ps(next + i * kPanel + 8), c11);
  }
  put16<Add>(out, c00, c01);
  put16<Add>(out + kPanel, c10, c11);
}
#else
template <int R, bool Add, bool Ahead = false>
inline void panel_tile(const float* xt, int64_t ld, const float* panel, int64_t k, float* out,
                       int64_t out_stride) {
  float sums[kMostTileRows * kPanel] = {};
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < R; ++r)
      for (int64_t t = 0; t < kPanel; ++t) sums[r * kPanel + t] += xt[i * ld + r] * panel[i * kPanel + t];
  for (int r = 0; r < R; ++r)
    for (int64_t t = 0; t < kPanel; ++t) {
      if constexpr (Add) out[r * out_stride + t] += sums[r * kPanel + t];
      else out[r * out_stride + t] = sums[r * kPanel + t];
    }
}

template <bool Add>
inline void panel_pair(const float* x, const float* panel, const float* next, int64_t k, float* out) {
  panel_tile<1, Add>(x, 1, panel, k, out, kPanel);
  panel_tile<1, Add>(x, 1, next, k, out + kPanel, kPanel);
}
#endif

// The tile of exactly `rows` rows (R to kMostTileRows).
template <int R, bool Add, bool Ahead>
inline void panel_rows_from(int rows, const float* xt, int64_t ld, const float* panel, int64_t k, float* out,
                            int64_t out_stride) {
  if constexpr (R < kMostTileRows) {
    if (rows > R) return panel_rows_from<R + 1, Add, Ahead>(rows, xt, ld, panel, k, out, out_stride);
  }
  panel_tile<R, Add, Ahead>(xt, ld, panel, k, out, out_stride);
}

template <bool Add, bool Ahead>
inline void panel_rows(int rows, const float* xt, int64_t ld, const float* panel, int64_t k, float* out,
                       int64_t out_stride) {
  panel_rows_from<1, Add, Ahead>(rows, xt, ld, panel, k, out, out_stride);
}

// Rows for the next tile when `left` remain: the most a tile takes, but between one and two
// tiles' worth split in two near-even tiles (AVX2's 16 rows: 6, 5, 5), since a tile of few rows
// runs at little more than a weight row's pace.
inline int tile_rows(int64_t left) {
  if (left <= kMostTileRows) return static_cast<int>(left);
  if (left < 2 * kMostTileRows) return static_cast<int>((left + 1) / 2);
  return kMostTileRows;
}

// Columns [from, to) of a tile of `rows` rows into out (row r at out + r * row_stride, column
// `from` at out[0]): stored, or added to what is there.
template <bool Add>
inline void put_tile(const float* tile, int rows, int64_t from, int64_t to, float* out, int64_t row_stride) {
  for (int r = 0; r < rows; ++r) {
    const float* source = tile + r * kPanel;
    float* target = out + r * row_stride;
    for (int64_t t = from; t < to; ++t) {
      if constexpr (Add) target[t - from] += source[t];
      else target[t - from] = source[t];
    }
  }
}

// Outputs [first, stop) of a panel-packed matrix (k inputs) against `rows` rows of k inputs,
// interleaved (row r's input i at x[i * rows + r]): out[r * row_stride + (j - first)] is output j
// of row r, stored or added. A range that does not start or end on a panel's edge is right, but
// computes whole panels: the cut ones into a tile, whose wanted columns are then copied.
template <bool Add>
void panel_products(const float* panels, int64_t k, const float* x, int64_t rows, int64_t first, int64_t stop,
                    float* out, int64_t row_stride) {
  alignas(32) float tile[kMostTileRows * kPanel];
  for (int64_t p = first / kPanel; p * kPanel < stop; ++p) {
    const float* panel = panels + p * k * kPanel;
    const int64_t base = p * kPanel;
    const int64_t from = std::max(first, base) - base, to = std::min(stop, base + kPanel) - base;
    float* target = out + (base + from - first);
    const bool whole = from == 0 && to == kPanel;
    if (rows == 1 && whole && base + 2 * kPanel <= stop) {
      panel_pair<Add>(x, panel, panel + k * kPanel, k, target);
      ++p;
      continue;
    }
#ifdef __AVX512F__
    if (rows >= kPairedFromRows && whole && base + 2 * kPanel <= stop) {
      paired_panels<Add>(rows, x, k, panel, target, row_stride);
      ++p;
      continue;
    }
#endif
    for (int64_t r = 0; r < rows;) {
      const int taken = tile_rows(rows - r);
      // The first tile reads the panel from memory and asks for what follows; the others read
      // it from the cache.
      if (whole && r == 0) {
        panel_rows<Add, true>(taken, x, rows, panel, k, target, row_stride);
      } else if (whole) {
        panel_rows<Add, false>(taken, x + r, rows, panel, k, target + r * row_stride, row_stride);
      } else {
        panel_rows<false, false>(taken, x + r, rows, panel, k, tile, kPanel);
        put_tile<Add>(tile, taken, from, to, target + r * row_stride, row_stride);
      }
      r += taken;
    }
  }
}

}  // namespace llama_chat_cpu
