// Products of several input rows with float32 weights repacked as panels, for the batched decode
// step (decode.cpp). A panel is 16 consecutive outputs (weight rows) with their k weights laid
// out input by input: panel[i * 16 + t] is output t's weight for input i, so one input's weights
// for all 16 outputs are two vectors. A tile of up to six input rows is taken against a panel with
// each input broadcast: twelve accumulators, two weight loads and six broadcasts per twelve
// multiply-adds, and no sums across a vector at the end, where weight rows taken one at a time
// (dot4) need a load per multiply-add and a sum across each accumulator. With AVX-512 a panel is
// one vector and a tile takes up to 16 rows (one accumulator each). Both are faster than weight
// rows for a batch (docs/batching.md, "Steps on the CPU").
//
// Each product is one accumulator lane adding its row's products input by input, in order, from
// zero: the same sum however many rows share the tile, so a row's result does not depend on the
// rows beside it in a batch.
//
// The tiles read their input rows interleaved: row r's input i at xt[i * ld + r], so that one
// pointer, stepped by `ld` an input, reaches every row of a tile at a constant offset. With a
// pointer per row, a 16-row tile needed more than the 15 general registers: its loop fetched
// pointers from vector registers and the stack on the multiply-adds' port. One row interleaved
// is the row itself.
#pragma once

#include "dot.h"
#include "vectors.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace llama_chat_cpu {

constexpr int64_t kPanel = 16;  // outputs per panel
#ifdef __AVX512F__
// A panel is one 512-bit vector: a tile of up to 16 rows keeps 16 accumulators and a panel's
// weights in 18 of the 32 registers, with each row's input broadcast from memory by its
// multiply-add.
constexpr int kMostTileRows = 16;
#else
constexpr int kMostTileRows = 6;
#endif
// The first tile of a panel asks for the weights this far ahead, a cache line per input: far
// enough to arrive in time, near enough not to leave L1 before it is read; the hardware's
// prefetcher alone was slower, and so were 8 and 32 KiB (docs/batching.md, "Steps on the CPU").
// A row alone (two panels at a time, `panel_pair`) does not ask: it is bound by the memory.
constexpr int64_t kAheadBytes = 4 << 10;

// Rows [0, R) of the interleaved inputs xt (row r's input i at xt[i * ld + r]) against P panels of
// k inputs that follow one another (panel p at panel + p * k * kPanel), in vectors of V: row r's
// P * 16 results go to out + r * out_stride, stored or added. Each result is one lane adding its
// row's products input by input from zero, whatever V, R and P: the same bits on every path. The
// accumulators are an array that stays in registers (every index is a constant once unrolled:
// the unroll pragmas are what keep GCC from storing them after every multiply-add), and go
// straight into the step's outputs, not through a tile on the stack and a copy.
template <typename V, int R, int P, bool Add, bool Ahead>
inline void panel_tile(const float* xt, int64_t ld, const float* panel, int64_t k, float* out, int64_t out_stride) {
  using Vec = typename V::Vec;
  constexpr int kVectors = kPanel / V::kWidth;  // of a panel's weights for one input
  Vec c[R][P][kVectors];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
      for (int v = 0; v < kVectors; ++v) c[r][p][v] = V::zero();
  for (int64_t i = 0; i < k; ++i, xt += ld) {
    Vec w[P][kVectors];
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const float* weights = panel + p * k * kPanel + i * kPanel;
      if constexpr (Ahead)  // past the end of the weights it is a hint that fetches nothing
        V::prefetch(reinterpret_cast<const char*>(weights) + kAheadBytes);
#pragma GCC unroll 16
      for (int v = 0; v < kVectors; ++v) w[p][v] = V::load(weights + v * V::kWidth);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec b = V::broadcast(xt + r);
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
        for (int v = 0; v < kVectors; ++v) c[r][p][v] = V::fmadd(b, w[p][v], c[r][p][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 16
      for (int v = 0; v < kVectors; ++v) {
        float* target = out + r * out_stride + p * kPanel + v * V::kWidth;
        if constexpr (Add) c[r][p][v] = V::add(V::load(target), c[r][p][v]);
        V::store(target, c[r][p][v]);
      }
}

// The tile of exactly `rows` rows (R to Most).
template <typename V, int R, int Most, int P, bool Add, bool Ahead>
inline void tile_of_rows(int rows, const float* xt, int64_t ld, const float* panel, int64_t k, float* out,
                         int64_t out_stride) {
  static_assert(R >= 1 && R <= Most, "a tile has one row or more");
  if constexpr (R < Most) {
    if (rows > R) return tile_of_rows<V, R + 1, Most, P, Add, Ahead>(rows, xt, ld, panel, k, out, out_stride);
  }
  panel_tile<V, R, P, Add, Ahead>(xt, ld, panel, k, out, out_stride);
}

// A tile of `rows` rows against one panel, in the build's widest vectors.
template <bool Add, bool Ahead>
inline void panel_rows(int rows, const float* xt, int64_t ld, const float* panel, int64_t k, float* out,
                       int64_t out_stride) {
  tile_of_rows<Widest, 1, kMostTileRows, 1, Add, Ahead>(rows, xt, ld, panel, k, out, out_stride);
}

// One row against two panels (the second follows `panel`): 32 results into out. Alone, a row is
// bound by reading the weights; two panels at once read them as fast as rows of weights do.
// In 256-bit vectors, AVX-512 builds too.
template <bool Add>
inline void panel_pair(const float* x, const float* panel, int64_t k, float* out) {
#ifdef LLAMA_CHAT_AVX2
  panel_tile<Floats8, 1, 2, Add, false>(x, 1, panel, k, out, 2 * kPanel);
#else
  panel_tile<Floats1, 1, 2, Add, false>(x, 1, panel, k, out, 2 * kPanel);
#endif
}

#ifdef __AVX512F__
// From this many rows on, two panels are taken at once by tiles of up to 14 rows: two weight
// loads and one broadcast per two multiply-adds of each row, 28 accumulators. It pays for many
// rows; 16 rows stay one tile, which paired tiles of 8 did not beat (docs/batching.md, "Steps on
// the CPU").
constexpr int64_t kPairedFromRows = 24;
constexpr int kMostPairedRows = 14;

// All `rows` rows of xt (interleaved, `rows` apart) against two whole panels, in near-even paired
// tiles (64 rows: 13, 13, 13, 13, 12).
template <bool Add>
inline void paired_panels(int64_t rows, const float* xt, int64_t k, const float* panel, float* out,
                          int64_t row_stride) {
  const int64_t tiles = (rows + kMostPairedRows - 1) / kMostPairedRows;
  for (int64_t r = 0, t = 0; r < rows; ++t) {
    const int taken = static_cast<int>((rows - r) / (tiles - t));
    tile_of_rows<Floats16, 1, kMostPairedRows, 2, Add, true>(taken, xt + r, rows, panel, k, out + r * row_stride,
                                                             row_stride);
    r += taken;
  }
}
#endif

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
      panel_pair<Add>(x, panel, k, target);
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
