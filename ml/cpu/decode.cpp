// One decode token through every layer of a Llama model in one call, on the CPU:
// torch.ops.llama_chat_cpu.decode_step. A step of the eager model is some 25 parallel products
// for a stories15M-sized model, and each wakes torch's sleeping OpenMP helper, which costs about
// as long as the product itself (docs/benchmarks.md, "CPU decode products"); llama2.c's threads
// spin between its products instead, which takes the cores from the streaming pipeline. Here the whole token is one parallel region: the
// helper wakes once, and between the stages of a layer a thread that needs a stage's results
// spins until its last unit is done (every thread is working on this token then). Each stage's
// work (heads, or chunks of weight rows) is taken by threads as they come.
//
// Per layer: rms norm (each thread into its own buffer: cheaper than another stage), q/k/v by
// head (rotated and written into the cache as each head's rows are done), attention by row and
// query head (in 512-bit vectors where it can: `attend_head`), the output projection added into
// the residual, the SwiGLU's (or GeGLU's) gate and up rows together with the activation, and its
// down projection added into the residual. Then the final norm and the classifier. The switches
// of the model families that change a layer's arithmetic are here too (`StepModel`): Qwen's
// biases and head norms, Gemma's scaled embedding, output norms (a stage of their own: a norm
// needs the whole row), windows, scores' scale and soft caps, and a rotary table per layer.
// Arithmetic is float32 throughout, whatever the weights' and cache's storage
// type, and each output is one thread's sum in a fixed order: the result does not depend on the
// number of threads.
//
// Built with kernels.cpp into one library by llama_chat/ml/cpu/kernels.py.
#include "blocks.h"
#include "dot.h"
#include "panels.h"
#include "pick.h"
#include "vectors.h"
#include "kv_rows.h"
#include "memory.h"

#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

using namespace llama_chat_cpu;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

// v[i] = e^(v[i] - shift); returns their sum.
inline float exp_and_sum(float* v, int64_t n, float shift) {
  int64_t i = 0;
  float total = 0.f;
#ifdef LLAMA_CHAT_AVX2
  __m256 sum = _mm256_setzero_ps();
  const __m256 by = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_of<Floats8>(_mm256_sub_ps(_mm256_loadu_ps(v + i), by));
    _mm256_storeu_ps(v + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  total = horizontal_sum(sum);
#endif
  for (; i < n; ++i) total += (v[i] = std::exp(v[i] - shift));
  return total;
}

// GELU's tanh approximation written as a sigmoid, torch's constants (F.gelu(approximate="tanh")):
// 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), u = beta (g + kappa g^3).
constexpr float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5), kGeluKappa = 0.044715f;

// out[i] = act(gate[i]) * up[i], act(g) = g / (1 + e^(-z)): SwiGLU's z = g, GeGLU's z = 2u (out may
// be gate).
template <bool Gelu>
inline void gated(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#ifdef LLAMA_CHAT_AVX2
  const __m256 one = _mm256_set1_ps(1.f);
  auto minus_z = [](__m256 g) {
    if constexpr (Gelu) {
      const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
      const __m256 inner = _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(kGeluKappa), cube));
      const __m256 u = _mm256_mul_ps(_mm256_set1_ps(kGeluBeta), inner);
      return _mm256_mul_ps(u, _mm256_set1_ps(-2.f));
    } else {
      return _mm256_sub_ps(_mm256_setzero_ps(), g);
    }
  };
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_of<Floats8>(minus_z(g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  if (i < n) {  // the tail through the same e^x, so that where a range ends changes nothing
    float g[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}, e[8];
    std::memcpy(g, gate + i, sizeof(float) * static_cast<size_t>(n - i));
    _mm256_storeu_ps(e, exp_of<Floats8>(minus_z(_mm256_loadu_ps(g))));
    for (int64_t t = 0; i < n; ++i, ++t) out[i] = g[t] / (1.f + e[t]) * up[i];
  }
#endif
  for (; i < n; ++i) {
    const float g = gate[i];
    const float z = Gelu ? 2.f * (kGeluBeta * (g + kGeluKappa * (g * g * g))) : g;
    out[i] = g / (1.f + std::exp(-z)) * up[i];
  }
}

#ifdef LLAMA_CHAT_AVX2
// tanh of eight floats: below 0.55 tanh's odd Taylor polynomial to a^15 (the first term left out
// is under half a float's step there), above it 1 - 2 / (e^2a + 1), which cancels nothing there;
// the sign put back, a NaN kept. Within a few steps of a float of std::tanh.
inline __m256 tanh_of(__m256 y) {
  static constexpr float kTaylor[7] = {
      static_cast<float>(-929569.0 / 638512875.0), static_cast<float>(21844.0 / 6081075.0),
      static_cast<float>(-1382.0 / 155925.0), static_cast<float>(62.0 / 2835.0),
      static_cast<float>(-17.0 / 315.0), static_cast<float>(2.0 / 15.0), static_cast<float>(-1.0 / 3.0)};
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  const __m256 a = _mm256_andnot_ps(sign, y), squared = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(kTaylor[0]);
  for (int i = 1; i < 7; ++i) p = _mm256_fmadd_ps(p, squared, _mm256_set1_ps(kTaylor[i]));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, squared), a, a);
  const __m256 e = exp_of<Floats8>(_mm256_add_ps(a, a));
  const __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
  const __m256 t = _mm256_blendv_ps(large, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.55f), _CMP_LT_OQ));
  return _mm256_blendv_ps(_mm256_or_ps(t, _mm256_and_ps(y, sign)), y, _mm256_cmp_ps(y, y, _CMP_UNORD_Q));
}
#endif

// v[i] = cap * tanh(v[i] / cap), Gemma 2's soft cap, as the layers compute it.
inline void soft_cap(float* v, int64_t n, float cap) {
  int64_t i = 0;
#ifdef LLAMA_CHAT_AVX2
  const __m256 by = _mm256_set1_ps(cap);
  auto capped = [&](__m256 x) { return _mm256_mul_ps(tanh_of(_mm256_div_ps(x, by)), by); };
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(v + i, capped(_mm256_loadu_ps(v + i)));
  if (i < n) {  // the tail through the same vectors, so that where a range ends changes nothing
    float x[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::memcpy(x, v + i, sizeof(float) * static_cast<size_t>(n - i));
    _mm256_storeu_ps(x, capped(_mm256_loadu_ps(x)));
    std::memcpy(v + i, x, sizeof(float) * static_cast<size_t>(n - i));
    i = n;
  }
#endif
  for (; i < n; ++i) v[i] = std::tanh(v[i] / cap) * cap;
}

// A stage's work (heads, or weight rows), handed out to threads in ranges as they ask, and how
// much of it is done. A thread that wants the stage's results waits for all of it to be done,
// not for every thread to arrive: a thread the OS has descheduled holds up the others only while
// it holds a range, and one that comes late finds the work taken and goes on.
struct Stage {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Waiters spin: a stage is short, and a sleeping thread's wake-up would take about as long.
// After this many spins a waiter yields its core, for a machine busy with other work.
constexpr int kSpinsBeforeYield = 1 << 14;

// Ranges shrink as the work runs out (a share of what is left per thread, halved, down to
// `smallest`): long runs of consecutive weight rows stream best, short ones at the end keep the
// threads finishing together.
// Every range but the last is a multiple of `align` long, so each starts on a multiple of it.
inline bool take(Stage& stage, int64_t total, int64_t smallest, int64_t align, int team, int64_t& begin,
                 int64_t& end) {
  int64_t at = stage.next.load(std::memory_order_relaxed);
  for (;;) {
    if (at >= total) return false;
    int64_t size = std::max(smallest, (total - at) / (2 * static_cast<int64_t>(team)));
    size = (size + align - 1) / align * align;
    const int64_t stop = std::min(total, at + size);
    if (stage.next.compare_exchange_weak(at, stop, std::memory_order_relaxed)) {
      begin = at;
      end = stop;
      return true;
    }
  }
}

// Runs body(begin, end) on the ranges of [0, total) this thread takes (starting on multiples of
// `align`); prepare() first, once, if it takes any (the stage's input is read only while the
// stage is unfinished, so no later stage is writing it). Returns when all of the stage is done.
template <typename Prepare, typename Body>
void run_stage(Stage& stage, int64_t total, int64_t smallest, int64_t align, int team, const Prepare& prepare,
               const Body& body) {
  int64_t begin = 0, end = 0;
  if (take(stage, total, smallest, align, team, begin, end)) {
    prepare();
    int64_t mine = 0;
    do {
      body(begin, end);
      mine += end - begin;
    } while (take(stage, total, smallest, align, team, begin, end));
    stage.done.fetch_add(mine, std::memory_order_acq_rel);
  }
  for (int spins = 0; stage.done.load(std::memory_order_acquire) < total; ++spins) {
    if (spins < kSpinsBeforeYield) cpu_relax();
    else std::this_thread::yield();
  }
}

// The fewest weight bytes a thread takes of a product at a time.
constexpr int64_t kSmallestBytes = 1 << 14;

// Rows [first, stop) of a matrix kept as GGUF's packed blocks (blocks.h), all of one kind: a
// fused q/k/v of a Q4_K_M file has Q6_K rows after Q4_K ones in some layers.
struct Segment {
  Packed kind = Packed::q8_0;
  const uint8_t* data = nullptr;  // its first row
  int64_t first = 0, stop = 0, row_bytes = 0;
};
constexpr int kMostSegments = 4;

struct Matrix {
  const void* data = nullptr;
  at::ScalarType type = at::kFloat;
  const float* scales = nullptr;
  const float* panels = nullptr;  // float32 weights packed as panels (panels.h) instead of rows
  int64_t n = 0, k = 0;
  Segment segments[kMostSegments];  // packed blocks: runs of rows of one kind
  int segment_count = 0;

  bool blocks() const { return segment_count > 0; }
  int64_t smallest() const {
    const int64_t row_bytes = blocks() ? segments[0].row_bytes : k * static_cast<int64_t>(at::elementSize(type));
    return std::max<int64_t>(1, kSmallestBytes / std::max<int64_t>(row_bytes, 1));
  }
  // Ranges of a packed matrix start on a panel's edge.
  int64_t align() const { return panels ? kPanel : 1; }
};

// The inputs of a packed weight of `n` rows: its bytes a row, in whole blocks of its first kind.
int64_t packed_inputs(const at::Tensor& w, const std::optional<at::Tensor>& layout, int64_t n) {
  TORCH_CHECK(layout.has_value() && layout->scalar_type() == at::kLong && layout->numel() >= 2 && n > 0,
              "decode_step: packed blocks need their (kind, rows) pairs");
  const int64_t id = layout->data_ptr<int64_t>()[0];
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(sizeof kPackedLayouts / sizeof kPackedLayouts[0]),
              "decode_step: no packed kind ", id);
  const PackedLayout& kind = kPackedLayouts[id];
  return w.numel() / n / kind.bytes * kind.values;
}

// Packed blocks: the bytes (uint8, contiguous, any shape) of `n` rows of k inputs, in runs of
// rows of one kind given by `layout`, int64 (kind, rows) pairs (the kind as its place in
// ml/packed.py's PACKED_TYPES, blocks.h's order).
Matrix packed_matrix_of(const char* what, int64_t layer, const at::Tensor& w, const std::optional<at::Tensor>& layout,
                        int64_t n, int64_t k) {
  TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "decode_step: the blocks of ", what, " of layer ", layer,
              " must be contiguous on the CPU");
  TORCH_CHECK(layout.has_value() && layout->scalar_type() == at::kLong && layout->is_contiguous() &&
                  layout->dim() == 1 && layout->numel() % 2 == 0 && layout->numel() >= 2 &&
                  layout->numel() <= 2 * kMostSegments,
              "decode_step: the blocks of ", what, " of layer ", layer, " need 1 to ", kMostSegments,
              " int64 (kind, rows) pairs");
  Matrix m;
  m.data = w.data_ptr();
  m.type = at::kByte;
  m.n = n;
  m.k = k;
  const int64_t* pairs = layout->data_ptr<int64_t>();
  const uint8_t* at = w.data_ptr<uint8_t>();
  int64_t rows = 0, bytes = 0;
  for (int64_t i = 0; i < layout->numel() / 2; ++i) {
    const int64_t id = pairs[2 * i], count = pairs[2 * i + 1];
    TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(sizeof kPackedLayouts / sizeof kPackedLayouts[0]) && count > 0,
                "decode_step: ", what, " of layer ", layer, " has a run of ", count, " rows of packed kind ", id);
    const Packed kind = static_cast<Packed>(id);
    TORCH_CHECK(k % layout_of(kind).values == 0, "decode_step: ", what, " of layer ", layer, ": ", k,
                " inputs are not whole ", layout_of(kind).name, " blocks");
    Segment& segment = m.segments[m.segment_count++];
    segment.kind = kind;
    segment.data = at + bytes;
    segment.first = rows;
    segment.stop = rows + count;
    segment.row_bytes = packed_row_bytes(kind, k);
    rows += count;
    bytes += count * segment.row_bytes;
  }
  TORCH_CHECK(rows == n && bytes == w.numel(), "decode_step: ", what, " of layer ", layer, " has ", rows,
              " packed rows in ", w.numel(), " bytes, expected ", n, " rows of ", k, " inputs (", bytes, " bytes)");
  return m;
}

// A weight is an (n, k) matrix, or, float32 only, its panels: (ceil(n / 16), k, 16), or packed
// GGUF blocks (uint8) with their layout in place of scales (packed_matrix_of).
Matrix matrix_of(const char* what, int64_t layer, const at::Tensor& w, const std::optional<at::Tensor>& scales,
                 int64_t n, int64_t k) {
  if (w.scalar_type() == at::kByte) return packed_matrix_of(what, layer, w, scales, n, k);
  if (w.dim() == 3) {
    TORCH_CHECK(w.is_contiguous() && w.device().is_cpu() && w.scalar_type() == at::kFloat && !scales.has_value(),
                "decode_step: the panels of ", what, " of layer ", layer, " must be contiguous float32 on the CPU");
    TORCH_CHECK(w.size(0) == (n + kPanel - 1) / kPanel && w.size(1) == k && w.size(2) == kPanel, "decode_step: ",
                what, " of layer ", layer, " has panels ", w.sizes(), ", expected (", (n + kPanel - 1) / kPanel, ", ",
                k, ", ", kPanel, ")");
    Matrix m;
    m.data = m.panels = w.data_ptr<float>();
    m.n = n;
    m.k = k;
    return m;
  }
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "decode_step: ", what, " of layer ", layer,
              " must be a contiguous CPU matrix");
  TORCH_CHECK(w.size(0) == n && w.size(1) == k, "decode_step: ", what, " of layer ", layer, " is ", w.size(0), "x",
              w.size(1), ", expected ", n, "x", k);
  const auto type = w.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf || type == at::kChar,
              "decode_step: ", what, " has weights of type ", type);
  Matrix m;
  m.data = w.data_ptr();
  m.type = type;
  m.n = n;
  m.k = k;
  if (scales.has_value()) {
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->numel() == n,
                "decode_step: ", what, " of layer ", layer, " needs ", n, " float32 scales");
    m.scales = scales->data_ptr<float>();
  }
  TORCH_CHECK(type != at::kChar || m.scales, "decode_step: int8 ", what, " of layer ", layer, " has no scales");
  return m;
}

// Rows that products read: float32 (for panels, several rows interleaved: row r's input i at
// x[i * rows + r]), and for int8 weights rounded to int16 steps as well (one step per row).
struct Inputs {
  const float* x = nullptr;
  const int16_t* rounded = nullptr;
  const float* steps = nullptr;
  // for packed blocks: the rows rounded a step per 32 values, and per 256 (the K-quants')
  const RoundedBlocks* blocks = nullptr;
  const RoundedBlocks* super_blocks = nullptr;
  int64_t rows = 0, k = 0;
};

// Input rows from which float weights are taken three rows at a time (dot3x4).
constexpr int64_t kBlockedRows = 32;

// Weight rows [first, stop) of m against every input row: out[r * row_stride + (j - first)] is
// row j's product with input row r, times j's scale; stored, or with Add added to what is
// there (the residual). The weight type is settled once per range, not once per row: at 288
// weights a row, a call and a switch per row were a good part of a row's time.
template <bool Add, typename W>
void range_of(const W* w, const Matrix& m, const Inputs& in, int64_t first, int64_t stop, float* out,
              int64_t row_stride) {
  const int64_t k = m.k;
  auto put = [&](int64_t r, int64_t j, float v) {
    float& slot = out[r * row_stride + (j - first)];
    if constexpr (Add) slot += v;
    else slot = v;
  };
  int64_t j = first;
  if constexpr (!std::is_same_v<W, int8_t>) {
    // Many rows: three weight rows against four input rows at a time. The first group of input
    // rows reads a block from memory, the others from L1; below 32 rows three rows read at once
    // stream worse than one, from 32 rows on they win (docs/batching.md, "Steps on the CPU"). The
    // rows left over take the loop below, which sums each pair as this does.
    if (in.rows >= kBlockedRows) {
      for (; j + 3 <= stop; j += 3) {
        const W* rows3 = w + j * k;
        float scales[3];
        for (int q = 0; q < 3; ++q) scales[q] = m.scales ? m.scales[j + q] : 1.f;
        int64_t r = 0;
        for (; r + 4 <= in.rows; r += 4) {
          float twelve[12];
          dot3x4(in.x + r * k, k, rows3, k, twelve);
          for (int q = 0; q < 3; ++q)
            for (int t = 0; t < 4; ++t) put(r + t, j + q, twelve[q * 4 + t] * scales[q]);
        }
        for (; r < in.rows; ++r)
          for (int q = 0; q < 3; ++q) put(r, j + q, dot(in.x + r * k, rows3 + q * k, k) * scales[q]);
      }
    }
  }
  for (; j < stop; ++j) {
    const W* row = w + j * k;
    const float scale = m.scales ? m.scales[j] : 1.f;
#ifdef LLAMA_CHAT_AVX2
    if constexpr (std::is_same_v<W, int8_t>) {
      int64_t r = 0;
      for (; r + 4 <= in.rows; r += 4) {  // four input rows share each widened block of weights
        float four[4];
        dot4_int8(in.rounded + r * k, k, row, k, four);
        for (int q = 0; q < 4; ++q) put(r + q, j, four[q] * (in.steps[r + q] * scale));
      }
      for (; r < in.rows; ++r) put(r, j, dot_int8(in.rounded + r * k, row, k) * (in.steps[r] * scale));
      continue;
    }
#endif
    int64_t r = 0;
    for (; r + 4 <= in.rows; r += 4) {  // four input rows share each load of the weights
      float four[4];
      dot4(in.x + r * k, k, row, k, four);
      for (int q = 0; q < 4; ++q) put(r + q, j, four[q] * scale);
    }
    for (; r < in.rows; ++r) put(r, j, dot(in.x + r * k, row, k) * scale);
  }
}

// Rows [first, stop) of packed blocks, run by run.
template <bool Add>
void packed_products(const Matrix& m, const Inputs& in, int64_t first, int64_t stop, float* out, int64_t row_stride) {
  for (int i = 0; i < m.segment_count; ++i) {
    const Segment& s = m.segments[i];
    const int64_t from = std::max(first, s.first), to = std::min(stop, s.stop);
    if (from < to)
      packed_range<Add>(s.kind, s.data, step_span(s.kind) == kQuantBlock ? *in.blocks : *in.super_blocks, 0, in.rows,
                        from - s.first, to - s.first, out + (from - first), row_stride);
  }
}

template <bool Add = false>
void range_products(const Matrix& m, const Inputs& in, int64_t first, int64_t stop, float* out, int64_t row_stride) {
  if (m.panels) return panel_products<Add>(m.panels, m.k, in.x, in.rows, first, stop, out, row_stride);
  if (m.blocks()) return packed_products<Add>(m, in, first, stop, out, row_stride);
  switch (m.type) {
    case at::kFloat:
      range_of<Add>(static_cast<const float*>(m.data), m, in, first, stop, out, row_stride);
      break;
    case at::kBFloat16:
      range_of<Add>(static_cast<const uint16_t*>(m.data), m, in, first, stop, out, row_stride);
      break;
    case at::kHalf:
      range_of<Add>(static_cast<const F16*>(m.data), m, in, first, stop, out, row_stride);
      break;
    default:
      range_of<Add>(static_cast<const int8_t*>(m.data), m, in, first, stop, out, row_stride);
  }
}

// 1 / sqrt(mean(x^2) + eps) of a row of `dim` values.
inline float inverse_rms(const float* x, int64_t dim, double eps) {
  // Eight sums in double, one per lane of eight inputs, added in a fixed order: one sum in a
  // single chain waited on each addition, and every thread normalizes every row, 13 times a
  // step of a stories15M-sized model.
  double lanes[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 8 <= dim; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += static_cast<double>(x[i + j]) * x[i + j];
  for (; i < dim; ++i) lanes[0] += static_cast<double>(x[i]) * x[i];
  const double squares = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  return static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(dim) + eps));
}

// What one thread keeps to itself during a step.
struct Scratch {
  std::vector<float> normed, head, scores, steps, chosen, inverses, turned;
  std::vector<int16_t> rounded;
  RoundedBlocks blocks, super_blocks;

  // x: the rows as `m` reads them (interleaved for panels).
  Inputs inputs(const float* x, int64_t rows, int64_t k, const Matrix& m) {
    Inputs in;
    in.x = x;
    in.rows = rows;
    in.k = k;
#ifdef LLAMA_CHAT_AVX2
    if (m.type == at::kChar) {
      round_rows(x, rows, k, rounded.data(), steps.data());
      in.rounded = rounded.data();
      in.steps = steps.data();
    }
#endif
    bool spans[2] = {false, false};  // a matrix's segments: of 32-value steps, of 256
    for (int i = 0; i < m.segment_count; ++i) spans[step_span(m.segments[i].kind) == kQuantGroup] = true;
    if (spans[0]) {
      round_blocks(x, rows, k, k, blocks);
      in.blocks = &blocks;
    }
    if (spans[1]) {
      round_blocks(x, rows, k, k, super_blocks, kQuantGroup);
      in.super_blocks = &super_blocks;
    }
    return in;
  }

  // The rows of h normalized, as `m` reads them (written interleaved for panels: no second pass).
  Inputs normalized(const float* h, int64_t rows, const float* weight, int64_t dim, double eps, const Matrix& m) {
    inverses.resize(static_cast<size_t>(rows));
    for (int64_t r = 0; r < rows; ++r) inverses[static_cast<size_t>(r)] = inverse_rms(h + r * dim, dim, eps);
    if (m.panels && rows > 1) {
      // Input by input, its rows' values side by side: written row by row, 64 rows (a cache
      // line a value, 288 of them a row, 74 KB in all) went through L1 again and again.
      for (int64_t i = 0; i < dim; ++i) {
        float* out = normed.data() + i * rows;
        for (int64_t r = 0; r < rows; ++r) out[r] = h[r * dim + i] * inverses[static_cast<size_t>(r)] * weight[i];
      }
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        const float* hr = h + r * dim;
        float* out = normed.data() + r * dim;
        const float inverse = inverses[static_cast<size_t>(r)];
        for (int64_t i = 0; i < dim; ++i) out[i] = hr[i] * inverse * weight[i];
      }
    }
    return inputs(normed.data(), rows, dim, m);
  }
};

// A layer's keys or values in pages, (kv_heads, pages, page_size, row): each position's row its
// head_dim values as float32, bfloat16, float16, q8_0 or q4_0 (kv_rows.h), each row of a step
// finding its positions through its block table. A dense cache is one page. Strides in bytes.
struct CacheView {
  uint8_t* data = nullptr;
  KV kind = KV::F32;
  // Hadamard-rotated rows (q4_0): keys meet a query rotated the same way; a weighted sum of
  // values is rotated back once.
  bool rotated = false;
  // Keys kept by the model's measure (model/key_centers.py): (k - shift) / scale per head and
  // channel, (kv_heads, head_dim) each; null where they are kept as they are. The scale is undone
  // on the query (`query_for`); the shift only moves all of a query's scores alike.
  const float* shift = nullptr;
  const float* scale = nullptr;
  int64_t page_size = 0, head_dim = 0, row_bytes = 0, head_stride = 0, page_stride = 0;
  const int64_t* tables = nullptr;
  int64_t width = 0;  // table entries per row

  uint8_t* slot(int64_t row, int64_t head, int64_t position) const {
    const int64_t page = tables[row * width + position / page_size];
    return data + head * head_stride + page * page_stride + (position % page_size) * row_bytes;
  }
  // The first position of a row's page.
  const uint8_t* page_start(int64_t row, int64_t head, int64_t page) const {
    return data + head * head_stride + tables[row * width + page] * page_stride;
  }
  void store(int64_t row, int64_t head, int64_t position, const float* values) const {
    if (rotated || shift != nullptr) {
      float turned[kMaxRotated];
      if (shift != nullptr) {
        // As kv_types.py's store: the difference, then the quotient, so that both write alike.
        const float *by = shift + head * head_dim, *over = scale + head * head_dim;
        for (int64_t i = 0; i < head_dim; ++i) turned[i] = (values[i] - by[i]) / over[i];
      } else {
        std::memcpy(turned, values, sizeof(float) * head_dim);
      }
      if (rotated) hadamard(turned, head_dim);
      kv_store_row(kind, turned, head_dim, slot(row, head, position));
    } else {
      kv_store_row(kind, values, head_dim, slot(row, head, position));
    }
  }
  // The query that meets these keys: scaled and rotated as they were (`turned`, head_dim
  // floats), or `q` itself.
  const float* query_for(int64_t head, const float* q, float* turned) const {
    if (!rotated && scale == nullptr) return q;
    if (scale != nullptr) {
      const float* by = scale + head * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) turned[i] = q[i] * by[i];
    } else {
      std::memcpy(turned, q, sizeof(float) * head_dim);
    }
    if (rotated) hadamard(turned, head_dim);
    return turned;
  }
  // scores[t] = q . key(t) * scale for positions t in [first, count), page by page (q rotated
  // already where the keys are).
  void scores(int64_t row, int64_t head, int64_t first, int64_t count, const float* q, float scale,
              float* out) const {
    for (int64_t t = first, page = first / page_size; t < count; ++page) {
      const uint8_t* at = page_start(row, head, page) + (t % page_size) * row_bytes;
      const int64_t end = std::min(count, (page + 1) * page_size);
      for (; t < end; ++t, at += row_bytes) out[t] = kv_dot(kind, q, at, head_dim) * scale;
    }
  }
  // out += weights[t] * value(t) for positions t in [first, count).
  void weighted_sum(int64_t row, int64_t head, int64_t first, int64_t count, const float* weights,
                    float* out) const {
    switch (kind) {
      case KV::F32: return weighted_sum_of<float>(row, head, first, count, weights, out);
      case KV::BF16: return weighted_sum_of<uint16_t>(row, head, first, count, weights, out);
      case KV::F16: return weighted_sum_of<F16>(row, head, first, count, weights, out);
      default:
        for (int64_t t = first, page = first / page_size; t < count; ++page) {
          const uint8_t* at = page_start(row, head, page) + (t % page_size) * row_bytes;
          const int64_t end = std::min(count, (page + 1) * page_size);
          for (; t < end; ++t, at += row_bytes) kv_add(kind, weights[t], at, head_dim, out);
        }
    }
  }
  static constexpr int64_t kMaxRotated = 1024;

 private:
  template <typename T>
  void weighted_sum_of(int64_t row, int64_t head, int64_t first, int64_t count, const float* weights,
                       float* out) const {
    for (int64_t t = first, page = first / page_size; t < count; ++page) {
      const T* slot = reinterpret_cast<const T*>(page_start(row, head, page)) + (t % page_size) * head_dim;
      const int64_t end = std::min(count, (page + 1) * page_size);
      // Four positions per pass over `out`: a quarter of its loads and stores.
      for (; t + 4 <= end; t += 4, slot += 4 * head_dim) {
        const float w0 = weights[t], w1 = weights[t + 1], w2 = weights[t + 2], w3 = weights[t + 3];
        const T *s1 = slot + head_dim, *s2 = slot + 2 * head_dim, *s3 = slot + 3 * head_dim;
        for (int64_t i = 0; i < head_dim; ++i)
          out[i] += w0 * scalar(slot[i]) + w1 * scalar(s1[i]) + w2 * scalar(s2[i]) + w3 * scalar(s3[i]);
      }
      for (; t < end; ++t, slot += head_dim) {
        const float w = weights[t];
        for (int64_t i = 0; i < head_dim; ++i) out[i] += w * scalar(slot[i]);
      }
    }
  }
};

#ifdef __AVX512F__
// Lane t: the sum of v[t]'s sixteen lanes. Four rounds, each adding the halves of two vectors'
// lane groups side by side (a fixed order of additions for every lane).
inline __m512 sums_of_16(__m512* v) {
  alignas(64) static const int32_t low[4][16] = {
      {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
      {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
      {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
      {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
  alignas(64) static const int32_t high[4][16] = {
      {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
      {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31},
      {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31},
      {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}};
#pragma GCC unroll 4
  for (int round = 0; round < 4; ++round) {
    const __m512i a = _mm512_load_si512(low[round]), b = _mm512_load_si512(high[round]);
#pragma GCC unroll 8
    for (int j = 0; j < (8 >> round); ++j)
      v[j] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * j], a, v[2 * j + 1]),
                           _mm512_permutex2var_ps(v[2 * j], b, v[2 * j + 1]));
  }
  return v[0];
}

// One query head of one row against a cache whose heads are C vectors (head_dim 16 * C), its rows
// of kind Kind read a vector at a time (kv_load16):
// out = softmax(q . keys * scale) . values over positions [first, count), the scores soft-capped
// where `cap` is above zero. Scores are made sixteen
// positions at a time, each position's products summed across vectors together
// (`sums_of_16`); the weighted sum keeps its head in registers, two positions at a time, and is
// scaled by the softmax's sum once at the end: faster than a dot product and a sum across a
// vector a position (`CacheView::scores`; docs/batching.md, "Attention in 512-bit vectors").
template <int C, KV Kind>
void attend_head(const CacheView& keys, const CacheView& values, int64_t row, int64_t head, int64_t first,
                 int64_t count, const float* q, float scale, float cap, float* scores, float* out) {
  const int64_t page_size = keys.page_size, kRow = keys.row_bytes;
  __m512 query[C];
  for (int c = 0; c < C; ++c) query[c] = _mm512_loadu_ps(q + 16 * c);
  __m512 largest = _mm512_set1_ps(-INFINITY);
  for (int64_t t = first, page = first / page_size; t < count; ++page) {
    const uint8_t* slot = keys.page_start(row, head, page) + (t % page_size) * kRow;
    for (int64_t end = std::min(count, (page + 1) * page_size), n = 0; t < end; t += n, slot += n * kRow) {
      n = std::min<int64_t>(16, end - t);
      __m512 v[16];
#pragma GCC unroll 16
      for (int u = 0; u < 16; ++u) {
        if (u < n) {
          __m512 a = _mm512_mul_ps(query[0], kv_load16<Kind>(slot + u * kRow, 0));
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(query[c], kv_load16<Kind>(slot + u * kRow, c), a);
          v[u] = a;
        } else {
          v[u] = _mm512_setzero_ps();
        }
      }
      const __mmask16 taken = static_cast<__mmask16>((1u << n) - 1);
      __m512 block = _mm512_mul_ps(sums_of_16(v), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + t, taken, block);
      if (cap > 0.f) {
        soft_cap(scores + t, n, cap);
        block = _mm512_maskz_loadu_ps(taken, scores + t);
      }
      largest = _mm512_mask_max_ps(largest, taken, largest, block);
    }
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(largest));
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = first; t < count; t += 16) {
    const __mmask16 taken = static_cast<__mmask16>(count - t >= 16 ? 0xffff : (1u << (count - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(taken, exp_of<Floats16>(_mm512_sub_ps(_mm512_maskz_loadu_ps(taken, scores + t), shift)));
    _mm512_mask_storeu_ps(scores + t, taken, e);
    total = _mm512_add_ps(total, e);
  }
  __m512 even[C], odd[C];
  for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm512_setzero_ps();
  for (int64_t t = first, page = first / page_size; t < count; ++page) {
    const uint8_t* slot = values.page_start(row, head, page) + (t % page_size) * kRow;
    const int64_t end = std::min(count, (page + 1) * page_size);
    for (; t + 2 <= end; t += 2, slot += 2 * kRow) {
      const __m512 w0 = _mm512_set1_ps(scores[t]), w1 = _mm512_set1_ps(scores[t + 1]);
      for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(w0, kv_load16<Kind>(slot, c), even[c]);
      for (int c = 0; c < C; ++c) odd[c] = _mm512_fmadd_ps(w1, kv_load16<Kind>(slot + kRow, c), odd[c]);
    }
    if (t < end) {
      const __m512 w0 = _mm512_set1_ps(scores[t]);
      for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(w0, kv_load16<Kind>(slot, c), even[c]);
      ++t;
    }
  }
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), inverse));
}

template <KV Kind>
auto vector_attention_of(int64_t head_dim) -> decltype(&attend_head<1, Kind>) {
  // Blocks are two vectors each: their heads are a whole number of blocks.
  constexpr bool blocks = Kind == KV::Q8_0 || Kind == KV::Q4_0;
  switch (head_dim) {
    case 16: return blocks ? nullptr : attend_head<1, Kind>;
    case 32: return attend_head<2, Kind>;
    case 48: return blocks ? nullptr : attend_head<3, Kind>;
    case 64: return attend_head<4, Kind>;
    case 96: return attend_head<6, Kind>;
    case 128: return attend_head<8, Kind>;
    case 256: return attend_head<16, Kind>;  // Gemma's
    default: return nullptr;
  }
}

// The 512-bit attention of heads of `head_dim` over rows of `kind`, or nullptr: no such vectors.
inline auto vector_attention(KV kind, int64_t head_dim) -> decltype(&attend_head<1, KV::F32>) {
  switch (kind) {
    case KV::F32: return vector_attention_of<KV::F32>(head_dim);
    case KV::BF16: return vector_attention_of<KV::BF16>(head_dim);
    case KV::F16: return vector_attention_of<KV::F16>(head_dim);
    case KV::Q8_0: return vector_attention_of<KV::Q8_0>(head_dim);
    case KV::Q4_0: return vector_attention_of<KV::Q4_0>(head_dim);
  }
  return nullptr;
}
#endif

// The kind of a cache's rows: its dtype, and for bytes, the blocks' row length.
KV kind_of(const at::Tensor& t, int64_t head_dim) {
  switch (t.scalar_type()) {
    case at::kFloat: return KV::F32;
    case at::kBFloat16: return KV::BF16;
    case at::kHalf: return KV::F16;
    case at::kByte:
      if (head_dim % kKVBlock == 0 && t.size(-1) == kv_row_bytes(KV::Q8_0, head_dim)) return KV::Q8_0;
      if (head_dim % kKVBlock == 0 && t.size(-1) == kv_row_bytes(KV::Q4_0, head_dim)) return KV::Q4_0;
      break;
    default: break;
  }
  TORCH_CHECK(false, "decode_step: a cache of ", t.scalar_type(), " rows of ", t.size(-1), " for heads of ", head_dim);
  return KV::F32;
}

CacheView cache_of(const char* what, int64_t layer, const at::Tensor& t, int64_t kv_heads, int64_t head_dim,
                   int64_t page_size) {
  TORCH_CHECK(t.dim() == 4 && t.device().is_cpu() && t.size(0) == kv_heads && t.size(2) == page_size &&
                  t.stride(3) == 1 && t.stride(2) == t.size(3),
              "decode_step: the ", what, " of layer ", layer, " must be a (", kv_heads, ", pages, ", page_size,
              ", row) CPU tensor with contiguous pages");
  CacheView view;
  view.kind = kind_of(t, head_dim);
  view.data = static_cast<uint8_t*>(t.data_ptr());
  view.page_size = page_size;
  view.head_dim = head_dim;
  view.row_bytes = kv_row_bytes(view.kind, head_dim);
  TORCH_CHECK(t.size(3) * t.element_size() == view.row_bytes, "decode_step: the ", what, " of layer ", layer,
              " have rows of ", t.size(3), " for heads of ", head_dim);
  // As model/kv_types.py: q4_0 keys and values are rotated where the head's size is a power of two.
  view.rotated = view.kind == KV::Q4_0 && kv_power_of_two(head_dim);
  TORCH_CHECK(!view.rotated || head_dim <= CacheView::kMaxRotated, "decode_step: heads of ", head_dim,
              " are too long to rotate");
  view.head_stride = t.stride(0) * t.element_size();
  view.page_stride = t.stride(1) * t.element_size();
  return view;
}

// Interleaved pairs (x[2i], x[2i+1]) rotated by the position's angles (cos, sin pairs).
inline void rotate(float* x, const float* cos_sin, int64_t head_dim) {
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    const float c = cos_sin[2 * i], s = cos_sin[2 * i + 1];
    const float x0 = x[2 * i], x1 = x[2 * i + 1];
    x[2 * i] = x0 * c - x1 * s;
    x[2 * i + 1] = x0 * s + x1 * c;
  }
}

// A head's RMSNorm in place: float32 sums, as ops.rms_norm computes it.
inline void normalize_head(float* x, const float* weight, int64_t head_dim, double eps) {
  float squares = 0.f;
  for (int64_t i = 0; i < head_dim; ++i) squares += x[i] * x[i];
  const float scale = 1.f / std::sqrt(squares / static_cast<float>(head_dim) + static_cast<float>(eps));
  for (int64_t i = 0; i < head_dim; ++i) x[i] = x[i] * scale * weight[i];
}

const float* float_vector(const char* what, int64_t layer, const at::Tensor& t, int64_t n) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n && t.device().is_cpu(),
              "decode_step: the ", what, " of layer ", layer, " must be ", n, " contiguous float32 values");
  return t.data_ptr<float>();
}

const float* float_vector_or_none(const char* what, int64_t layer, const std::optional<at::Tensor>& t, int64_t n) {
  return t ? float_vector(what, layer, *t, n) : nullptr;
}

using Named = c10::Dict<std::string, at::Tensor>;

// The names a layer's tensors go by (ml/cpu/decode.py's `LayerWeights.tensors()`, with the
// layer's keys and values added): the one record of a layer that both sides share.
//
// The four products (each an (n, k) float32, bfloat16, float16 or int8 matrix, float32 panels,
// or packed blocks: `matrix_of`), each with its `.scales` where it has them (int8's per output;
// packed blocks' (kind, rows) layout); the attention's and feed-forward's norms; the family's
// parts of a layer where it has them (Qwen's q/k/v biases and q and k heads' norms, Gemma's
// norms of the attention's and feed-forward's outputs), float32; the rotary table, float32
// (positions, head_dim / 2, 2), the cosine and sine of each pair's angle; the keys and values
// (`cache_of`), and q4_0 keys' shift and scale where the cache keeps them.
const std::vector<std::string>& layer_names() {
  static const std::vector<std::string> names = {
      "qkv", "qkv.scales", "out", "out.scales", "gate_up", "gate_up.scales", "down", "down.scales",
      "attention_norm", "ffn_norm", "qkv_bias", "q_norm", "k_norm", "attention_post_norm", "ffn_post_norm",
      "rope", "keys", "values", "key_shift", "key_scale"};
  return names;
}

at::Tensor required(const Named& named, int64_t layer, const char* name) {
  const auto found = named.find(name);
  TORCH_CHECK(found != named.end(), "decode_step: layer ", layer, " lacks its ", name);
  return found->value();
}

std::optional<at::Tensor> optional(const Named& named, const char* name) {
  const auto found = named.find(name);
  if (found == named.end()) return std::nullopt;
  return found->value();
}

// A layer as a step reads it: its products laid out (`Matrix`), its vectors as pointers, its
// cache as views through the step's block tables. Null pointers: parts the model has none of.
struct Layer {
  Matrix qkv, out, gate_up, down;
  const float* attention_norm = nullptr;
  const float* ffn_norm = nullptr;
  const float* qkv_bias = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  const float* attention_post_norm = nullptr;
  const float* ffn_post_norm = nullptr;
  const float* rope = nullptr;
  int64_t window = 0;  // a query at p sees keys p - window + 1 .. p; 0: its whole past
  CacheView keys, values;
};

// The model's shape and the family's switches, by name (ml/cpu/decode.py's `StepWeights.over`):
// heads, kv_heads, eps, page_size, and where the family sets them embedding_scale (Gemma:
// sqrt(dim)), gelu (1: GeGLU with tanh in place of SwiGLU), query_scale (the scores' scale;
// absent: 1 / sqrt(head_dim)), attention_cap and final_cap (soft caps of the scores and the
// logits; absent: none).
using Numbers = c10::Dict<std::string, double>;

double number(const Numbers& numbers, const char* name, std::optional<double> otherwise = std::nullopt) {
  const auto found = numbers.find(name);
  if (found != numbers.end()) return found->value();
  TORCH_CHECK(otherwise.has_value(), "decode_step: the model's ", name, " is not given");
  return *otherwise;
}

int64_t whole_number(const Numbers& numbers, const char* name) {
  const double value = number(numbers, name);
  TORCH_CHECK(value == std::floor(value) && value > 0, "decode_step: ", name, " must be a positive whole number, not ",
              value);
  return static_cast<int64_t>(value);
}

// What a step reads besides its inputs: one model's weights and shape, and the cache its steps
// write (torch.classes.llama_chat_cpu.StepModel). The Python side (ml/cpu/decode.py) makes one per
// model and cache, once. Each layer is laid out (`Layer`) and checked here, from its named
// tensors, once: a step only points its caches at its rows' block tables. The tensors' storages
// are held, so a weight whose storage is later replaced in place is still read where it was.
struct StepModel : torch::CustomClassHolder {
  std::vector<Layer> laid;
  std::vector<c10::Storage> held;
  Matrix classifier;
  const float* final_norm = nullptr;
  int64_t n_layers = 0, dim = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, q_width = 0, kv_width = 0, ffn = 0;
  int64_t vocab = 0, page_size = 0, pages = 0, positions = 0;
  double eps = 0.0;
  float embedding_scale = 1.f, attention_scale = 0.f, attention_cap = 0.f, final_cap = 0.f;  // a cap of 0: none
  bool gelu = false, post_norms = false;

  // `layers`: each layer's named tensors (`layer_names`); `top`: the final `norm`, the
  // classifier's `output` and its `output.scales` where it has them; `numbers`: as `Numbers`
  // says; `windows`: each layer's window (0: its whole past), or none.
  StepModel(std::vector<Named> layers, Named top, Numbers numbers, std::vector<int64_t> windows) {
    n_layers = static_cast<int64_t>(layers.size());
    TORCH_CHECK(n_layers > 0, "decode_step: a model of no layers");
    for (int64_t l = 0; l < n_layers; ++l)
      for (const auto& entry : layers[static_cast<size_t>(l)])
        TORCH_CHECK(std::find(layer_names().begin(), layer_names().end(), entry.key()) != layer_names().end(),
                    "decode_step: layer ", l, " has a part named '", entry.key(), "' that no step reads");
    TORCH_CHECK(windows.empty() || static_cast<int64_t>(windows.size()) == n_layers,
                "decode_step: a window per layer, or none");
    for (const int64_t window : windows) TORCH_CHECK(window >= 0, "decode_step: a window of ", window, " keys");
    for (const auto& entry : top)
      TORCH_CHECK(entry.key() == "norm" || entry.key() == "output" || entry.key() == "output.scales",
                  "decode_step: the model has a part named '", entry.key(), "' that no step reads");
    TORCH_CHECK(top.contains("norm") && top.contains("output"), "decode_step: the final norm and the classifier");

    n_heads = whole_number(numbers, "heads");
    n_kv_heads = whole_number(numbers, "kv_heads");
    page_size = whole_number(numbers, "page_size");
    eps = number(numbers, "eps");
    embedding_scale = static_cast<float>(number(numbers, "embedding_scale", 1.0));
    gelu = number(numbers, "gelu", 0.0) != 0.0;
    attention_cap = static_cast<float>(number(numbers, "attention_cap", 0.0));
    final_cap = static_cast<float>(number(numbers, "final_cap", 0.0));
    const double query_scale = number(numbers, "query_scale", 0.0);
    TORCH_CHECK(attention_cap >= 0.f && final_cap >= 0.f && query_scale >= 0.0 && embedding_scale > 0.f &&
                    (!numbers.contains("attention_cap") || attention_cap > 0.f) &&
                    (!numbers.contains("final_cap") || final_cap > 0.f) &&
                    (!numbers.contains("query_scale") || query_scale > 0.0),
                "decode_step: soft caps and scales must be positive");
    TORCH_CHECK(n_heads % n_kv_heads == 0, "decode_step: ", n_heads, " heads do not group over ", n_kv_heads,
                " key/value heads");

    // The shapes come from the first layer and the final norm; every layer is checked against them.
    const Named& first = layers[0];
    const at::Tensor keys = required(first, 0, "keys"), rope = required(first, 0, "rope");
    const at::Tensor norm = top.at("norm");
    TORCH_CHECK(keys.dim() == 4, "decode_step: keys must be (kv_heads, pages, page_size, head_dim)");
    dim = norm.numel();
    // A row of blocks does not say its head's size: the rotary table does (checked below).
    head_dim = keys.scalar_type() == at::kByte && rope.dim() == 3 ? 2 * rope.size(1) : keys.size(-1);
    pages = keys.size(1);
    TORCH_CHECK(head_dim % 2 == 0, "decode_step: odd head size ", head_dim);
    q_width = n_heads * head_dim;
    kv_width = n_kv_heads * head_dim;
    attention_scale = query_scale > 0.0 ? static_cast<float>(query_scale) : 1.f / std::sqrt(static_cast<float>(head_dim));
    // down is (dim, ffn), or its panels, or packed blocks of dim rows
    const at::Tensor down = required(first, 0, "down");
    ffn = down.scalar_type() == at::kByte ? packed_inputs(down, optional(first, "down.scales"), dim)
                                          : down.size(down.dim() == 3 ? 1 : -1);
    positions = rope.dim() == 3 ? rope.size(0) : 0;
    post_norms = first.contains("attention_post_norm");

    final_norm = float_vector("final norm", n_layers, norm, dim);
    const at::Tensor output = top.at("output");
    const std::optional<at::Tensor> output_scales = optional(top, "output.scales");
    // A classifier given as panels has a multiple of 16 outputs: nothing else says how many.
    const int64_t classes = output.dim() == 3 ? output.size(0) * kPanel : output.size(0);
    classifier = matrix_of("the classifier", n_layers, output, output_scales, classes, dim);
    vocab = classifier.n;
    for (const auto& entry : top) held.push_back(entry.value().storage());
    for (int64_t l = 0; l < n_layers; ++l) {
      const Named& named = layers[static_cast<size_t>(l)];
      laid.push_back(layer_of(named, l, windows.empty() ? 0 : windows[static_cast<size_t>(l)]));
      for (const auto& entry : named) held.push_back(entry.value().storage());
    }
  }

  // One layer laid out from its named tensors, each checked against the model's shape.
  Layer layer_of(const Named& t, int64_t l, int64_t window) const {
    Layer layer;
    layer.qkv = matrix_of("qkv", l, required(t, l, "qkv"), optional(t, "qkv.scales"), q_width + 2 * kv_width, dim);
    layer.out = matrix_of("out", l, required(t, l, "out"), optional(t, "out.scales"), dim, q_width);
    layer.gate_up = matrix_of("gate_up", l, required(t, l, "gate_up"), optional(t, "gate_up.scales"), 2 * ffn, dim);
    layer.down = matrix_of("down", l, required(t, l, "down"), optional(t, "down.scales"), dim, ffn);
    layer.attention_norm = float_vector("attention_norm", l, required(t, l, "attention_norm"), dim);
    layer.ffn_norm = float_vector("ffn_norm", l, required(t, l, "ffn_norm"), dim);
    layer.qkv_bias = float_vector_or_none("qkv_bias", l, optional(t, "qkv_bias"), q_width + 2 * kv_width);
    layer.q_norm = float_vector_or_none("q_norm", l, optional(t, "q_norm"), head_dim);
    layer.k_norm = float_vector_or_none("k_norm", l, optional(t, "k_norm"), head_dim);
    // Every layer has both output norms, or none does: a step's stages are counted by it.
    const auto attention_post_norm = optional(t, "attention_post_norm"), ffn_post_norm = optional(t, "ffn_post_norm");
    TORCH_CHECK(attention_post_norm.has_value() == post_norms && ffn_post_norm.has_value() == post_norms,
                "decode_step: layer ", l, (post_norms ? " lacks" : " has"), " output norms");
    layer.attention_post_norm = float_vector_or_none("attention_post_norm", l, attention_post_norm, dim);
    layer.ffn_post_norm = float_vector_or_none("ffn_post_norm", l, ffn_post_norm, dim);
    const at::Tensor rope = required(t, l, "rope");
    TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.is_contiguous() && rope.dim() == 3 &&
                    rope.size(0) == positions && rope.size(1) == head_dim / 2 && rope.size(2) == 2,
                "decode_step: the rotary table of layer ", l, " must be float32 (", positions, ", ", head_dim / 2,
                ", 2), as long as the first layer's");
    layer.rope = rope.data_ptr<float>();
    layer.window = window;
    layer.keys = cache_of("keys", l, required(t, l, "keys"), n_kv_heads, head_dim, page_size);
    layer.values = cache_of("values", l, required(t, l, "values"), n_kv_heads, head_dim, page_size);
    const auto key_shift = optional(t, "key_shift"), key_scale = optional(t, "key_scale");
    TORCH_CHECK(key_shift.has_value() == key_scale.has_value() &&
                    (!key_shift.has_value() || (layer.keys.kind == KV::Q4_0 && head_dim <= CacheView::kMaxRotated)),
                "decode_step: layer ", l, " has a key shift and scale for q4_0 keys only, both or neither");
    layer.keys.shift = float_vector_or_none("key_shift", l, key_shift, n_kv_heads * head_dim);
    layer.keys.scale = float_vector_or_none("key_scale", l, key_scale, n_kv_heads * head_dim);
    return layer;
  }

  // The layers as a step reads them, each row's cache slots found through its block table
  // (`width` pages a row).
  std::vector<Layer> layers(const int64_t* tables, int64_t width) const {
    std::vector<Layer> step = laid;
    for (Layer& layer : step)
      for (CacheView* view : {&layer.keys, &layer.values}) {
        view->tables = tables;
        view->width = width;
      }
    return step;
  }
};

// One step's inputs, checked against its model: rows of hidden state, each one token at
// positions[row] of the sequence whose cache slots are found through tables[row]; the rows whose
// logits are made, in that order; and where each such row's greedy pick goes, if anywhere.
struct StepInputs {
  const float* hidden = nullptr;
  int64_t rows = 0;
  const int64_t* positions = nullptr;
  const int64_t* tables = nullptr;
  int64_t width = 0;     // table entries per row
  int64_t furthest = 0;  // the furthest position of any row
  std::vector<int64_t> logit_rows;
  bool some_rows = false;  // whether logit_rows were chosen (gathered) rather than all rows
  int64_t* picks = nullptr;
  int64_t picks_below = 0;
};

StepInputs inputs_of(const StepModel& model, const at::Tensor& hidden, const at::Tensor& positions,
                     const at::Tensor& tables, const std::optional<at::Tensor>& picks, int64_t picks_below,
                     const std::optional<at::Tensor>& logit_rows) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous() &&
                  hidden.size(1) == model.dim,
              "decode_step: the hidden state must be a contiguous float32 (rows, ", model.dim, ") matrix");
  StepInputs in;
  in.hidden = hidden.data_ptr<float>();
  in.rows = hidden.size(0);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == in.rows,
              "decode_step: one int64 position per row");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 &&
                  tables.size(0) == in.rows,
              "decode_step: one int64 block table per row");
  in.positions = positions.data_ptr<int64_t>();
  in.tables = tables.data_ptr<int64_t>();
  in.width = tables.size(1);
  const int64_t page_size = model.page_size;
  for (int64_t r = 0; r < in.rows; ++r) {
    const int64_t position = in.positions[r];
    TORCH_CHECK(position >= 0 && position < model.positions && position / page_size < in.width,
                "decode_step: position ", position, " of row ", r, " is past its cache (", in.width * page_size,
                " slots) or the rotary table (", model.positions, ")");
    for (int64_t i = 0; i <= position / page_size; ++i) {
      const int64_t page = in.tables[r * in.width + i];
      TORCH_CHECK(page >= 0 && page < model.pages, "decode_step: row ", r, " names page ", page, " of ", model.pages);
    }
    in.furthest = std::max(in.furthest, position);
  }
  in.some_rows = logit_rows.has_value();
  if (in.some_rows) {
    TORCH_CHECK(logit_rows->scalar_type() == at::kLong && logit_rows->is_contiguous() && logit_rows->dim() == 1,
                "decode_step: logit_rows must be a contiguous int64 vector");
    const int64_t* wanted = logit_rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_rows->numel(); ++i) {
      TORCH_CHECK(wanted[i] >= 0 && wanted[i] < in.rows, "decode_step: logit row ", wanted[i], " of ", in.rows,
                  " rows");
      in.logit_rows.push_back(wanted[i]);
    }
  } else {
    for (int64_t r = 0; r < in.rows; ++r) in.logit_rows.push_back(r);
  }
  const int64_t out_rows = static_cast<int64_t>(in.logit_rows.size());
  TORCH_CHECK(out_rows <= in.rows, "decode_step: ", out_rows, " logit rows of ", in.rows, " rows");
  if (picks.has_value()) {
    TORCH_CHECK(picks->scalar_type() == at::kLong && picks->is_contiguous() && picks->numel() == out_rows &&
                    picks_below > 0 && picks_below <= model.vocab,
                "decode_step: picks need one int64 per row of logits and 0 < picks_below <= ", model.vocab);
    in.picks = picks->data_ptr<int64_t>();
    in.picks_below = picks_below;
  }
  return in;
}

// A head's attention in 512-bit vectors, for caches whose heads are whole vectors (`attend_head`).
using Attend = void (*)(const CacheView&, const CacheView&, int64_t, int64_t, int64_t, int64_t, const float*, float,
                        float, float*, float*);

// What every thread of a step shares: its model and inputs, the residual, the buffers one stage
// hands to the next, and the stages' counters.
struct SharedStep {
  const StepModel& model;
  const StepInputs& step;
  float* logits;
  std::vector<float> h;
  std::vector<float> sublayer;  // a sublayer's output before its norm joins the residual (post norms)
  std::vector<float> q, attended, activated, ups, activated_interleaved;
  std::unique_ptr<Stage[]> stages;
  std::vector<Pick> thread_picks;  // each thread's greedy picks of its classifier ranges
  Attend attend_in_vectors = nullptr;
  bool rotated_values = false;

  SharedStep(const StepModel& m, const StepInputs& s, const std::vector<Layer>& layers, float* out, int threads)
      : model(m), step(s), logits(out), h(s.hidden, s.hidden + s.rows * m.dim) {
    const int64_t rows = s.rows;
    if (m.embedding_scale != 1.f)
      for (float& x : h) x *= m.embedding_scale;
    sublayer.resize(static_cast<size_t>(m.post_norms ? rows * m.dim : 0));
    q.resize(static_cast<size_t>(rows * m.q_width));
    attended.resize(static_cast<size_t>(rows * m.q_width));
    activated.resize(static_cast<size_t>(rows * m.ffn));
    ups.resize(static_cast<size_t>(rows * m.ffn));
    activated_interleaved.resize(static_cast<size_t>(rows > 1 ? rows * m.ffn : 0));
    // Five stages a layer, two more with post norms (each normalizes whole rows), and the classifier.
    stages.reset(new Stage[static_cast<size_t>((m.post_norms ? 7 : 5) * m.n_layers + 1)]);
    if (s.picks != nullptr) thread_picks.resize(static_cast<size_t>(threads) * s.logit_rows.size());
    TORCH_CHECK(layers[0].keys.kind == layers[0].values.kind, "decode_step: keys and values of one kind");
#ifdef __AVX512F__
    attend_in_vectors = vector_attention(layers[0].keys.kind, m.head_dim);
#endif
    rotated_values = layers[0].values.rotated;
  }

  // Whether a matrix reads its rows interleaved (panels.h). The attention's results and the
  // activations are written so by the threads that make them, each its own part.
  bool interleaves(const Matrix& m) const { return m.panels != nullptr && step.rows > 1; }
};

// One thread's part of a step: the stages in the order every thread meets them, each taking
// ranges of its work as they come (`run_stage`) and returning when all of it is done.
class StepThread {
 public:
  StepThread(SharedStep& shared, int team, int thread) : s_(shared), team_(team), thread_(thread) {
    const StepModel& m = s_.model;
    const int64_t rows = s_.step.rows;
    scratch_.normed.resize(static_cast<size_t>(rows * m.dim));
    scratch_.head.resize(static_cast<size_t>(rows * m.head_dim));
    scratch_.turned.resize(static_cast<size_t>(m.head_dim));
    scratch_.scores.resize(static_cast<size_t>(s_.step.furthest + 1));
    scratch_.rounded.resize(static_cast<size_t>(rows * std::max({m.dim, m.ffn, m.q_width})));
    scratch_.steps.resize(static_cast<size_t>(rows));
    picks_.resize(s_.step.picks != nullptr ? s_.step.logit_rows.size() : 0);
    stage_ = s_.stages.get();
  }

  // The attention's norm, then q, k and v by head: biased, heads normalized and rotated where the
  // family does so, q kept for the attention, k and v written into the cache.
  void qkv(const Layer& layer) {
    const StepModel& m = s_.model;
    const int64_t rows = s_.step.rows, head_dim = m.head_dim, n_heads = m.n_heads, n_kv_heads = m.n_kv_heads;
    const int64_t* position = s_.step.positions;
    run_stage(
        *stage_++, n_heads + 2 * n_kv_heads, 1, 1, team_,
        [&] { in_ = scratch_.normalized(s_.h.data(), rows, layer.attention_norm, m.dim, m.eps, layer.qkv); },
        [&](int64_t first, int64_t stop) {
          for (int64_t unit = first; unit < stop; ++unit) {
            float* head = scratch_.head.data();  // (rows, head_dim)
            range_products(layer.qkv, in_, unit * head_dim, (unit + 1) * head_dim, head, head_dim);
            for (int64_t r = 0; r < rows; ++r) {
              float* mine = head + r * head_dim;
              if (layer.qkv_bias != nullptr)
                for (int64_t i = 0; i < head_dim; ++i) mine[i] += layer.qkv_bias[unit * head_dim + i];
              if (unit < n_heads && layer.q_norm != nullptr) normalize_head(mine, layer.q_norm, head_dim, m.eps);
              if (unit >= n_heads && unit < n_heads + n_kv_heads && layer.k_norm != nullptr)
                normalize_head(mine, layer.k_norm, head_dim, m.eps);
              if (unit < n_heads + n_kv_heads) rotate(mine, layer.rope + position[r] * head_dim, head_dim);
              if (unit < n_heads)
                std::memcpy(s_.q.data() + r * m.q_width + unit * head_dim, mine, sizeof(float) * head_dim);
              else if (unit < n_heads + n_kv_heads)
                layer.keys.store(r, unit - n_heads, position[r], mine);
              else
                layer.values.store(r, unit - n_heads - n_kv_heads, position[r], mine);
            }
          }
        });
  }

  // Each row's query heads over the keys it sees (its past, or its window's last ones), by row and
  // head: the scores scaled, capped where the family caps them, softmaxed, and the values summed.
  void attention(const Layer& layer) {
    const StepModel& m = s_.model;
    const int64_t n_heads = m.n_heads, head_dim = m.head_dim, group = m.n_heads / m.n_kv_heads;
    const int64_t rows = s_.step.rows;
    const bool interleaved = s_.interleaves(layer.out);
    run_stage(*stage_++, rows * n_heads, 1, 1, team_, [] {}, [&](int64_t first, int64_t stop) {
      for (int64_t unit = first; unit < stop; ++unit) {
        const int64_t r = unit / n_heads, head = unit % n_heads, kv = head / group, last = s_.step.positions[r];
        const int64_t first_key = layer.window > 0 ? std::max<int64_t>(0, last - layer.window + 1) : 0;
        const float* query = layer.keys.query_for(kv, s_.q.data() + r * m.q_width + head * head_dim,
                                                  scratch_.turned.data());
        float* scores = scratch_.scores.data();  // by position: those before first_key unused
        float* result = interleaved ? scratch_.head.data() : s_.attended.data() + r * m.q_width + head * head_dim;
        if (s_.attend_in_vectors != nullptr) {
          s_.attend_in_vectors(layer.keys, layer.values, r, kv, first_key, last + 1, query, m.attention_scale,
                               m.attention_cap, scores, result);
        } else {
          layer.keys.scores(r, kv, first_key, last + 1, query, m.attention_scale, scores);
          if (m.attention_cap > 0.f) soft_cap(scores + first_key, last + 1 - first_key, m.attention_cap);
          const float largest = *std::max_element(scores + first_key, scores + last + 1);
          const float inverse = 1.f / exp_and_sum(scores + first_key, last + 1 - first_key, largest);
          for (int64_t t = first_key; t <= last; ++t) scores[t] *= inverse;
          std::fill(result, result + head_dim, 0.f);
          layer.values.weighted_sum(r, kv, first_key, last + 1, scores, result);
        }
        // The values are stored rotated (H v), so their weighted sum is H out: H is its own inverse.
        if (s_.rotated_values) hadamard(result, head_dim);
        if (interleaved)
          for (int64_t i = 0; i < head_dim; ++i) s_.attended[(head * head_dim + i) * rows + r] = result[i];
      }
    });
  }

  // The rows of `m` against the rows of `input` (each `width` wide, as `m` reads them), added into
  // the residual; with a post norm, normalized first, a row at a time once all are made.
  void add_to_residual(const Matrix& m, const float* input, int64_t width, const float* post_norm) {
    const int64_t rows = s_.step.rows, dim = s_.model.dim;
    const auto prepare = [&] { in_ = scratch_.inputs(input, rows, width, m); };
    if (post_norm == nullptr) {
      run_stage(*stage_++, dim, m.smallest(), m.align(), team_, prepare, [&](int64_t first, int64_t stop) {
        range_products<true>(m, in_, first, stop, s_.h.data() + first, dim);
      });
      return;
    }
    run_stage(*stage_++, dim, m.smallest(), m.align(), team_, prepare, [&](int64_t first, int64_t stop) {
      range_products(m, in_, first, stop, s_.sublayer.data() + first, dim);
    });
    run_stage(*stage_++, rows, 1, 1, team_, [] {}, [&](int64_t first, int64_t stop) {
      for (int64_t r = first; r < stop; ++r) {
        const float* made = s_.sublayer.data() + r * dim;
        const float inverse = inverse_rms(made, dim, s_.model.eps);
        float* into = s_.h.data() + r * dim;
        for (int64_t i = 0; i < dim; ++i) into[i] += made[i] * inverse * post_norm[i];
      }
    });
  }

  // The attention's output: its product with `out` added into the residual.
  void attention_output(const Layer& layer) {
    add_to_residual(layer.out, s_.attended.data(), s_.model.q_width, layer.attention_post_norm);
  }

  // The feed-forward's norm, then its gate and up rows together with the activation (SwiGLU, or
  // GeGLU), written interleaved where the down product reads panels.
  void gate_up(const Layer& layer) {
    const StepModel& m = s_.model;
    const int64_t rows = s_.step.rows, ffn = m.ffn;
    const bool interleaved = s_.interleaves(layer.down);
    run_stage(
        *stage_++, ffn, std::max<int64_t>(1, layer.gate_up.smallest() / 2), layer.gate_up.align(), team_,
        [&] { in_ = scratch_.normalized(s_.h.data(), rows, layer.ffn_norm, m.dim, m.eps, layer.gate_up); },
        [&](int64_t first, int64_t stop) {
          range_products(layer.gate_up, in_, first, stop, s_.activated.data() + first, ffn);
          range_products(layer.gate_up, in_, ffn + first, ffn + stop, s_.ups.data() + first, ffn);
          for (int64_t r = 0; r < rows; ++r) {
            float* gate = s_.activated.data() + r * ffn + first;
            const float* up = s_.ups.data() + r * ffn + first;
            if (m.gelu) gated<true>(gate, up, stop - first, gate);
            else gated<false>(gate, up, stop - first, gate);
          }
          if (interleaved)
            for (int64_t j = first; j < stop; ++j)
              for (int64_t r = 0; r < rows; ++r) s_.activated_interleaved[j * rows + r] = s_.activated[r * ffn + j];
        });
  }

  // The activations' product with `down` added into the residual.
  void down(const Layer& layer) {
    const bool interleaved = s_.interleaves(layer.down);
    add_to_residual(layer.down, interleaved ? s_.activated_interleaved.data() : s_.activated.data(), s_.model.ffn,
                    layer.ffn_post_norm);
  }

  // The final norm of the logit rows and the classifier, soft-capped where the family caps it;
  // each thread's greedy picks of the ranges it wrote.
  void classifier(const Matrix& classifier) {
    const StepModel& m = s_.model;
    const StepInputs& step = s_.step;
    const int64_t out_rows = static_cast<int64_t>(step.logit_rows.size()), vocab = m.vocab, dim = m.dim;
    if (out_rows == 0) return;  // a prompt's chunk that needs no logits
    float* out = s_.logits;
    run_stage(
        *stage_, vocab, classifier.smallest(), classifier.align(), team_,
        [&] {
          const float* final_rows = s_.h.data();
          if (step.some_rows) {  // the chosen rows, gathered
            scratch_.chosen.resize(static_cast<size_t>(out_rows * dim));
            for (int64_t i = 0; i < out_rows; ++i)
              std::memcpy(scratch_.chosen.data() + i * dim, s_.h.data() + step.logit_rows[static_cast<size_t>(i)] * dim,
                          sizeof(float) * static_cast<size_t>(dim));
            final_rows = scratch_.chosen.data();
          }
          in_ = scratch_.normalized(final_rows, out_rows, m.final_norm, dim, m.eps, classifier);
        },
        [&](int64_t first, int64_t stop) {
          range_products(classifier, in_, first, stop, out + first, vocab);
          if (m.final_cap > 0.f)
            for (int64_t r = 0; r < out_rows; ++r) soft_cap(out + r * vocab + first, stop - first, m.final_cap);
          // Picked here, from the logits this thread has just written and still holds in its
          // cache: picked on the calling thread afterwards, half of them came from the other
          // core's.
          if (step.picks != nullptr && first < step.picks_below) {
            for (int64_t r = 0; r < out_rows; ++r) {
              const Pick found = pick_of(out + r * vocab + first, std::min(stop, step.picks_below) - first, first);
              if (better(found, picks_[static_cast<size_t>(r)])) picks_[static_cast<size_t>(r)] = found;
            }
          }
        });
    if (step.picks != nullptr) std::copy(picks_.begin(), picks_.end(), s_.thread_picks.begin() + thread_ * out_rows);
  }

 private:
  SharedStep& s_;
  const int team_, thread_;
  Scratch scratch_;
  Inputs in_;
  Stage* stage_ = nullptr;
  std::vector<Pick> picks_;
};

// Every row of `step` through every layer of `model`, and its logit rows' logits into out (logit
// rows, vocab); every layer's keys and values of the tokens are written into the cache. Rows may
// be consecutive tokens of one sequence (a prompt's chunk, with the same table): each layer writes
// every row's keys and values before any row attends, and a row attends up to its own position
// (the last `window` positions of a windowed layer). A greedy pick is the first place of the
// largest logit below picks_below, a NaN counting as largest (torch.argmax).
void run_step(const StepModel& model, const StepInputs& step, float* out) {
  const std::vector<Layer> layers = model.layers(step.tables, step.width);
  const Matrix& classifier = model.classifier;
  const int threads = std::max(at::get_num_threads(), 1);
  SharedStep shared(model, step, layers, out, threads);

  auto run = [&](int team, int thread) {
    StepThread mine(shared, team, thread);
    for (const Layer& layer : layers) {
      mine.qkv(layer);
      mine.attention(layer);
      mine.attention_output(layer);
      mine.gate_up(layer);
      mine.down(layer);
    }
    mine.classifier(classifier);
  };

#ifdef _OPENMP
  if (threads > 1 && !at::in_parallel_region()) {
#pragma omp parallel num_threads(threads)
    run(threads, omp_get_thread_num());
  } else {
    run(1, 0);
  }
#else
  run(1, 0);
#endif
  if (step.picks != nullptr) {
    const int64_t out_rows = static_cast<int64_t>(step.logit_rows.size());
    for (int64_t r = 0; r < out_rows; ++r) {
      Pick best;
      for (int t = 0; t < threads; ++t) {
        const Pick& found = shared.thread_picks[static_cast<size_t>(t * out_rows + r)];
        if (better(found, best)) best = found;
      }
      step.picks[r] = best.index;
    }
  }
}

// The logits (logit rows, vocab) of one step of `model` (`run_step`), float32. Without
// `logit_rows`, every row's; with `picks`, each logit row's greedy pick is written there too.
at::Tensor decode_step(const c10::intrusive_ptr<StepModel>& model, const at::Tensor& hidden,
                       const at::Tensor& positions, const at::Tensor& tables, const std::optional<at::Tensor>& picks,
                       int64_t picks_below, const std::optional<at::Tensor>& logit_rows) {
  const StepInputs step = inputs_of(*model, hidden, positions, tables, picks, picks_below, logit_rows);
  at::Tensor logits = at::empty({static_cast<int64_t>(step.logit_rows.size()), model->vocab}, hidden.options());
  if (step.rows > 0) run_step(*model, step, logits.data_ptr<float>());
  return logits;
}

// Rows of float32 values (..., head_dim) as q4_0 blocks (..., head_dim / 32 * 18), Hadamard-
// rotated first where `rotate`: the blocks the step itself writes (CacheView::store), for the
// cache's writes from the model's forward (model/kv_types.py), whose torch search is slower.
at::Tensor q4_0_rows(const at::Tensor& x, bool rotate) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu() && x.dim() >= 1 && x.size(-1) % kKVBlock == 0 &&
                  (!rotate || kv_power_of_two(x.size(-1))),
              "q4_0_rows: float32 CPU rows of a multiple of ", kKVBlock, " values (a power of two to rotate)");
  const at::Tensor rows = x.contiguous();
  const int64_t head_dim = rows.size(-1), n = rows.numel() / std::max<int64_t>(1, head_dim);
  const int64_t row_bytes = kv_row_bytes(KV::Q4_0, head_dim);
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = row_bytes;
  at::Tensor out = at::empty(shape, rows.options().dtype(at::kByte));
  const float* in = rows.data_ptr<float>();
  uint8_t* to = out.data_ptr<uint8_t>();
  at::parallel_for(0, n, 64, [&](int64_t first, int64_t stop) {
    std::vector<float> turned(static_cast<size_t>(rotate ? head_dim : 0));
    for (int64_t r = first; r < stop; ++r) {
      const float* row = in + r * head_dim;
      if (rotate) {
        std::memcpy(turned.data(), row, sizeof(float) * head_dim);
        hadamard(turned.data(), head_dim);
        row = turned.data();
      }
      kv_store_row(KV::Q4_0, row, head_dim, to + r * row_bytes);
    }
  });
  return out;
}

// rotate's arithmetic from `in` into `out`, each product rounded before the sum as torch rounds
// it (no fused multiply-adds, which the compiler would otherwise make of x0 c - x1 s).
__attribute__((optimize("fp-contract=off"))) void rotate_uncontracted(const float* in, const float* cos_sin,
                                                                    int64_t dim, float* out) {
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float c = cos_sin[2 * i], s = cos_sin[2 * i + 1];
    const float x0 = in[2 * i], x1 = in[2 * i + 1];
    out[2 * i] = x0 * c - x1 * s;
    out[2 * i + 1] = x0 * s + x1 * c;
  }
}

// A prompt's rotary embedding: x (batch, seq, heads, head_dim), any strides but contiguous
// channels, its interleaved pairs rotated by each token's angles, cos and sin (batch, seq, 1,
// head_dim / 2) as ops.rope_at gives them (views of the table, strided); the result contiguous.
// One pass, torch's arithmetic bit for bit (x0 c - x1 s, x0 s + x1 c, each product rounded),
// where torch's six operations made copies.
at::Tensor rope_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && x.stride(3) == 1 && x.size(3) % 2 == 0,
              "rope_rows: x is float32 (batch, seq, heads, head_dim) of contiguous channels");
  const int64_t batch = x.size(0), seq = x.size(1), heads = x.size(2), dim = x.size(3), half = dim / 2;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->size(0) == batch && t->size(1) == seq &&
                    t->size(3) == half,
                "rope_rows: cos and sin are float32 (batch, seq, 1, head_dim / 2)");
  at::Tensor out = at::empty({batch, seq, heads, dim}, x.options());
  const float *xd = x.data_ptr<float>(), *cd = cos.data_ptr<float>(), *sd = sin.data_ptr<float>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, batch * seq, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, heads * dim)),
                   [&](int64_t begin, int64_t end) {
    std::vector<float> cos_sin(static_cast<size_t>(dim));
    for (int64_t token = begin; token < end; ++token) {
      const int64_t b = token / seq, t = token % seq;
      const float* c = cd + b * cos.stride(0) + t * cos.stride(1);
      const float* s = sd + b * sin.stride(0) + t * sin.stride(1);
      for (int64_t i = 0; i < half; ++i) {
        cos_sin[2 * i] = c[i * cos.stride(3)];
        cos_sin[2 * i + 1] = s[i * sin.stride(3)];
      }
      for (int64_t h = 0; h < heads; ++h) {
        const float* in = xd + b * x.stride(0) + t * x.stride(1) + h * x.stride(2);
        float* o = od + ((token * heads) + h) * dim;
        int64_t i = 0;
#ifdef __AVX512F__
        // rotate's products and sums sixteen channels at a time, rounded as it rounds them:
        // even channels x0 c - x1 s, odd ones x1 c + x0 s.
        const __m512i pair_swap = _mm512_set_epi32(14, 15, 12, 13, 10, 11, 8, 9, 6, 7, 4, 5, 2, 3, 0, 1);
        const __m512i evens = _mm512_set_epi32(14, 14, 12, 12, 10, 10, 8, 8, 6, 6, 4, 4, 2, 2, 0, 0);
        for (; i < dim; i += 16) {
          const __mmask16 lanes = dim - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (dim - i)) - 1);
          const __m512 v = _mm512_maskz_loadu_ps(lanes, in + i), both = _mm512_maskz_loadu_ps(lanes, cos_sin.data() + i);
          const __m512 c = _mm512_permutexvar_ps(evens, both);
          const __m512 sn = _mm512_permutexvar_ps(_mm512_add_epi32(evens, _mm512_set1_epi32(1)), both);
          const __m512 straight = _mm512_mul_ps(v, c), crossed = _mm512_mul_ps(_mm512_permutexvar_ps(pair_swap, v), sn);
          _mm512_mask_storeu_ps(o + i, lanes,
                                _mm512_mask_sub_ps(_mm512_add_ps(straight, crossed), 0x5555, straight, crossed));
        }
#endif
        if (i < dim) rotate_uncontracted(in + i, cos_sin.data() + i, dim - i, o + i);
      }
    }
  });
  return out;
}

// A prompt's gated activations: gate_up's rows hold the gate, then the up projection; each row of
// the result is gated(gate, up) (SwiGLU, or GeGLU with `gelu`), as the decode step computes them.
at::Tensor gated_rows(const at::Tensor& gate_up, bool gelu) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "gated_rows: a float32 (rows, 2 * hidden) matrix");
  const at::Tensor x = gate_up.contiguous();
  const int64_t rows = x.size(0), hidden = x.size(1) / 2;
  at::Tensor out = kept_empty({rows, hidden}, x.options());
  const float* in = x.data_ptr<float>();
  float* to = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(hidden, 1)), [&](int64_t first, int64_t stop) {
    for (int64_t r = first; r < stop; ++r) {
      const float* row = in + r * 2 * hidden;
      if (gelu) gated<true>(row, row + hidden, hidden, to + r * hidden);
      else gated<false>(row, row + hidden, hidden, to + r * hidden);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llama_chat_cpu, m) {
  m.def("q4_0_rows(Tensor x, bool rotate) -> Tensor");
  m.def("gated_rows(Tensor gate_up, bool gelu) -> Tensor");
  m.def("rope_rows(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.class_<StepModel>("StepModel")
      .def(torch::init<std::vector<Named>, Named, Numbers, std::vector<int64_t>>());
  m.def(
      "decode_step(__torch__.torch.classes.llama_chat_cpu.StepModel model, Tensor hidden, Tensor positions, "
      "Tensor tables, Tensor(a!)? picks=None, int picks_below=0, Tensor? logit_rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_chat_cpu, CPU, m) {
  m.impl("decode_step", &decode_step);
  m.impl("q4_0_rows", &q4_0_rows);
  m.impl("gated_rows", &gated_rows);
  m.impl("rope_rows", &rope_rows);
}
