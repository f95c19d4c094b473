// Products of several input rows with float32 weights repacked as panels, for the batched decode
// step (cpu_decode.cpp). A panel is 16 consecutive outputs (weight rows) with their k weights laid
// out input by input: panel[i * 16 + t] is output t's weight for input i, so one input's weights
// for all 16 outputs are two vectors. A tile of up to six input rows is taken against a panel with
// each input broadcast: twelve accumulators, two weight loads and six broadcasts per twelve
// multiply-adds, and no sums across a vector at the end. Against weight rows taken one at a time
// (dot4: a load per multiply-add, and a sum across each accumulator), a stories15M-sized
// classifier of 16 rows took 2.1-2.4 ms instead of 3.3 on two cores (62-70 against 44 billion
// multiply-adds a second, of the cores' 102).
//
// Each product is one accumulator lane adding its row's products input by input, in order, from
// zero: the same sum however many rows share the tile, so a row's result does not depend on the
// rows beside it in a batch.
#pragma once

#include "cpu_dot.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace llama_chat_cpu {

constexpr int64_t kPanel = 16;  // outputs per panel
constexpr int kMostTileRows = 6;

#ifdef LLAMA_CHAT_AVX2
// Rows x[0..R) (each `stride` apart) against one panel of k inputs: tile[r * 16 + t].
template <int R>
inline void panel_tile(const float* x, int64_t stride, const float* panel, int64_t k, float* tile) {
  static_assert(R >= 1 && R <= kMostTileRows, "one to six rows a tile");
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // Named accumulators, not an array: GCC kept an array of them in memory, storing every one
  // after each multiply-add (16 instead of 60 billion multiply-adds a second).
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_loadu_ps(panel + i * kPanel), w1 = _mm256_loadu_ps(panel + i * kPanel + 8);
    __m256 b = _mm256_broadcast_ss(x + i);
    c00 = _mm256_fmadd_ps(b, w0, c00);
    c01 = _mm256_fmadd_ps(b, w1, c01);
    if constexpr (R > 1) {
      b = _mm256_broadcast_ss(x + stride + i);
      c10 = _mm256_fmadd_ps(b, w0, c10);
      c11 = _mm256_fmadd_ps(b, w1, c11);
    }
    if constexpr (R > 2) {
      b = _mm256_broadcast_ss(x + 2 * stride + i);
      c20 = _mm256_fmadd_ps(b, w0, c20);
      c21 = _mm256_fmadd_ps(b, w1, c21);
    }
    if constexpr (R > 3) {
      b = _mm256_broadcast_ss(x + 3 * stride + i);
      c30 = _mm256_fmadd_ps(b, w0, c30);
      c31 = _mm256_fmadd_ps(b, w1, c31);
    }
    if constexpr (R > 4) {
      b = _mm256_broadcast_ss(x + 4 * stride + i);
      c40 = _mm256_fmadd_ps(b, w0, c40);
      c41 = _mm256_fmadd_ps(b, w1, c41);
    }
    if constexpr (R > 5) {
      b = _mm256_broadcast_ss(x + 5 * stride + i);
      c50 = _mm256_fmadd_ps(b, w0, c50);
      c51 = _mm256_fmadd_ps(b, w1, c51);
    }
  }
  const __m256 all[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
  for (int v = 0; v < 2 * R; ++v) _mm256_storeu_ps(tile + v * 8, all[v]);
}

// One row against two panels (`next` follows `panel`): tile[t] and tile[16 + t]. Alone, a row
// is bound by reading the weights; two panels at once read them as fast as rows of weights do.
inline void panel_pair(const float* x, const float* panel, const float* next, int64_t k, float* tile) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00;
  for (int64_t i = 0; i < k; ++i) {
    const __m256 b = _mm256_broadcast_ss(x + i);
    c00 = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + i * kPanel), c00);
    c01 = _mm256_fmadd_ps(b, _mm256_loadu_ps(panel + i * kPanel + 8), c01);
    c10 = _mm256_fmadd_ps(b, _mm256_loadu_ps(next + i * kPanel), c10);
    c11 = _mm256_fmadd_ps(b, _mm256_loadu_ps(next + i * kPanel + 8), c11);
  }
  _mm256_storeu_ps(tile, c00);
  _mm256_storeu_ps(tile + 8, c01);
  _mm256_storeu_ps(tile + 16, c10);
  _mm256_storeu_ps(tile + 24, c11);
}
#else
template <int R>
inline void panel_tile(const float* x, int64_t stride, const float* panel, int64_t k, float* tile) {
  std::fill(tile, tile + R * kPanel, 0.f);
  for (int64_t i = 0; i < k; ++i)
    for (int r = 0; r < R; ++r)
      for (int64_t t = 0; t < kPanel; ++t) tile[r * kPanel + t] += x[r * stride + i] * panel[i * kPanel + t];
}

inline void panel_pair(const float* x, const float* panel, const float* next, int64_t k, float* tile) {
  panel_tile<1>(x, k, panel, k, tile);
  panel_tile<1>(x, k, next, k, tile + kPanel);
}
#endif

inline void panel_rows(int rows, const float* x, int64_t stride, const float* panel, int64_t k, float* tile) {
  switch (rows) {
    case 1: panel_tile<1>(x, stride, panel, k, tile); break;
    case 2: panel_tile<2>(x, stride, panel, k, tile); break;
    case 3: panel_tile<3>(x, stride, panel, k, tile); break;
    case 4: panel_tile<4>(x, stride, panel, k, tile); break;
    case 5: panel_tile<5>(x, stride, panel, k, tile); break;
    default: panel_tile<6>(x, stride, panel, k, tile);
  }
}

// Rows for the next tile when `left` remain: six, but seven to eleven split in two near-even
// tiles (16 rows: 6, 5, 5), since a tile of few rows runs at little more than a weight row's pace.
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

// Outputs [first, stop) of a panel-packed matrix (k inputs) against `rows` rows of x (each k
// long): out[r * row_stride + (j - first)] is output j of row r, stored or added. Ranges that do
// not start or end on a panel's edge are right, but compute whole panels.
template <bool Add>
void panel_products(const float* panels, int64_t k, const float* x, int64_t rows, int64_t first, int64_t stop,
                    float* out, int64_t row_stride) {
  alignas(32) float tile[kMostTileRows * kPanel];
  for (int64_t p = first / kPanel; p * kPanel < stop; ++p) {
    const float* panel = panels + p * k * kPanel;
    const int64_t base = p * kPanel;
    const int64_t from = std::max(first, base) - base, to = std::min(stop, base + kPanel) - base;
    float* target = out + (base + from - first);
    if (rows == 1 && base + 2 * kPanel <= stop && from == 0) {
      panel_pair(x, panel, panel + k * kPanel, k, tile);
      put_tile<Add>(tile, 1, 0, kPanel, target, row_stride);
      put_tile<Add>(tile + kPanel, 1, 0, kPanel, target + kPanel, row_stride);
      ++p;
      continue;
    }
    for (int64_t r = 0; r < rows;) {
      const int taken = tile_rows(rows - r);
      panel_rows(taken, x + r * k, k, panel, k, tile);
      put_tile<Add>(tile, taken, from, to, target + r * row_stride, row_stride);
      r += taken;
    }
  }
}

}  // namespace llama_chat_cpu
