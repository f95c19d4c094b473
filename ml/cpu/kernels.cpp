// Matrix-vector products for decode steps on the CPU: out = x @ w.T for float32, bfloat16,
// float16 or int8 weights (dot.h states the numerics), times a scale per output row for int8
// ones. A decode step multiplies one row (or a few) by every weight once, so the speed is how
// fast the weight is read. PyTorch's kernels for these shapes read the weights well
// below the memory's speed, bfloat16 ones most of all for several rows, and these come nearer it
// (docs/benchmarks.md, "CPU decode products"): each output row is a dot product over one
// contiguous weight row, with several accumulators, and the rows are split among threads.
//
// Built on first use by llama_chat/ml/cpu/kernels.py with the machine's C++ compiler.
#include "blocks.h"
#include "dot.h"
#include "panels.h"
#include "pick.h"
#include "memory.h"

#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string_view>
#include <vector>

namespace {

using namespace llama_chat_cpu;

// Weight bytes per chunk of output rows that a thread takes at a time; a product of one or two
// chunks runs on the calling thread alone. Smaller chunks balance better and stream worse;
// 256 KiB was as fast as fixed halves or faster, and smaller chunks slower
// (docs/benchmark-log.md, "Measurements once in the CPU operator's comments").
constexpr int64_t kBytesPerChunk = 1 << 18;
// Chunks per thread, at least, of a product of many rows (tiles): see for_rows.
constexpr int64_t kTiledChunksPerThread = 4;

// body(begin, end) over output rows [0, n), in chunks (a multiple of `unit` rows) that threads take
// as they come. torch's
// OpenMP helpers sleep between parallel regions (the command sets OMP_WAIT_POLICY=PASSIVE) and
// are slow to wake: with a fixed half each, the calling thread would finish its half and wait
// for the late helper's; taking chunks, it goes on with the rows the helper has not reached.
// `fewest`: the chunks a product bound by its multiply-adds is cut into at least, per thread, so
// that the last chunks even out (a prompt's 2,048 outputs of Q4_K in 7 chunks of 256 KiB ran 4
// on one thread and 3 on the other).
template <typename Body>
void for_rows(int64_t n, int64_t row_bytes, const Body& body, int64_t unit = 1, int64_t fewest = 0) {
  const int threads = at::get_num_threads();
  int64_t rows = std::max<int64_t>(1, kBytesPerChunk / std::max<int64_t>(row_bytes, 1));
  if (fewest > 0) rows = std::min(rows, (n + fewest * threads - 1) / (fewest * threads));
  const int64_t chunk = (rows + unit - 1) / unit * unit;
  const int64_t chunks = (n + chunk - 1) / chunk;
#ifdef _OPENMP
  if (threads > 1 && chunks > 2 && !at::in_parallel_region()) {
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(threads)
    {
      for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
           c = next.fetch_add(1, std::memory_order_relaxed))
        body(c * chunk, std::min(n, (c + 1) * chunk));
    }
    return;
  }
#endif
  body(0, n);
}

#ifdef LLAMA_CHAT_AVX2
void int8_products(const float* x, const int8_t* w, const float* scales, float* out, int64_t rows, int64_t k,
                   int64_t n) {
  std::vector<int16_t> rounded(static_cast<size_t>(rows * k));
  std::vector<float> steps(static_cast<size_t>(rows));
  round_rows(x, rows, k, rounded.data(), steps.data());
  for_rows(n, k, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* wj = w + j * k;
      const float scale = scales ? scales[j] : 1.f;
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {  // four input rows share each widened block of weights
        float four[4];
        dot4_int8(rounded.data() + r * k, k, wj, k, four);
        for (int q = 0; q < 4; ++q) out[(r + q) * n + j] = four[q] * (steps[r + q] * scale);
      }
      for (; r < rows; ++r) out[r * n + j] = dot_int8(rounded.data() + r * k, wj, k) * (steps[r] * scale);
    }
  });
}
#endif

template <typename W>
void products(const float* x, const W* w, const float* scales, float* out, int64_t rows, int64_t k, int64_t n) {
  for_rows(n, k * static_cast<int64_t>(sizeof(W)), [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const W* wj = w + j * k;
      const float scale = scales ? scales[j] : 1.f;
      // The weight row is read from memory once and from cache for every further input row.
      int64_t r = 0;
      for (; r + 4 <= rows; r += 4) {
        float four[4];
        dot4(x + r * k, k, wj, k, four);
        for (int q = 0; q < 4; ++q) out[(r + q) * n + j] = four[q] * scale;
      }
      for (; r < rows; ++r) out[r * n + j] = dot(x + r * k, wj, k) * scale;
    }
  });
}

// Rows of x from which 16-bit weights are multiplied panel by panel (converted_panel_products):
// a prompt's rows. Up to here, a decode step's few rows, weight rows are read one at a time.
constexpr int64_t kMostRowProducts = 16;
// A panel product takes this many inputs at a time, and so many rows that their interleaved
// inputs for them fill this many bytes: what a thread reads again for each panel then stays in
// its cache. Longer runs of inputs and more rows at once (the whole of a 512-token prompt against
// a 5632-input projection) were slower (docs/benchmarks.md, "Packed blocks: GGUF files against
// llama.cpp").
constexpr int64_t kInputsAtOnce = 1024;
constexpr int64_t kInterleavedBytes = 1 << 20;

// One weight row as float32 values, converted exactly.
template <typename W>
void convert_row(const W* w, int64_t k, float* out) {
  int64_t i = 0;
#ifdef LLAMA_CHAT_AVX2
  for (; i + 8 <= k; i += 8) _mm256_storeu_ps(out + i, load8(w + i));
#endif
  for (; i < k; ++i) out[i] = scalar(w[i]);
}

// The weights of one panel, up to 16 rows (`count`, `k` apart) of `inputs` values, in panels.h's
// layout (panel[i * 16 + t]: row t's input i), missing rows zero. Sixteen inputs at a time go
// through a block in L1, converted a row's sixteen at once and then written a panel row (a cache
// line) at once: written straight to the panel, each value was a store to a line of its own.
template <typename W>
void convert_panel(const W* w, int64_t k, int64_t count, int64_t inputs, float* panel) {
  alignas(64) float block[kPanel * kPanel];  // block[t * 16 + j]: row t's input i + j
  for (int64_t i = 0; i < inputs; i += kPanel) {
    const int64_t width = std::min(kPanel, inputs - i);
    for (int64_t t = 0; t < kPanel; ++t) {
      float* values = block + t * kPanel;
      if (t < count && width == kPanel) {
        convert_row(w + t * k + i, kPanel, values);
      } else {
        for (int64_t j = 0; j < width; ++j) values[j] = t < count ? scalar(w[t * k + i + j]) : 0.f;
      }
    }
    for (int64_t j = 0; j < width; ++j)
      for (int64_t t = 0; t < kPanel; ++t) panel[(i + j) * kPanel + t] = block[t * kPanel + j];
  }
}

// x @ w.T for many rows of x (a prompt's) and 16-bit weight rows w (n, k), read as they are: a
// thread takes two panels of 16 outputs at a time, converts their weights for kInputsAtOnce
// inputs into panels.h's float32 layout in a buffer of its own, and meets them with every tile of
// rows there, from its cache (panel_products), adding each run of inputs to the last. The float32
// copy is never more than those panels a thread: no float32 weight matrix crosses the memory, as
// tiles converted for a library's matrix product do (ml/half.py's fallback, slower at every row
// count measured: docs/benchmarks.md, "Packed blocks: GGUF files against llama.cpp"). Numerics:
// each result is the exact conversions' products summed in float32, input by input in runs of
// kInputsAtOnce, the runs' sums added in order.
template <typename W>
void converted_panel_products(const float* x, const W* w, float* out, int64_t rows, int64_t k, int64_t n) {
  const int64_t span = std::max<int64_t>(1, std::min(k, kInputsAtOnce));
  const int64_t most = std::max<int64_t>(kPanel, kInterleavedBytes / (4 * span) / kPanel * kPanel);
  if (rows > most) {
    for (int64_t r = 0; r < rows; r += most)
      converted_panel_products(x + r * k, w, out + r * n, std::min(most, rows - r), k, n);
    return;
  }
  constexpr int64_t kOutputs = 2 * kPanel;  // two panels: AVX-512 builds pair them for many rows
  // Row r's input i at [i * rows + r], written sixteen rows at a time: a cache line a store.
  std::vector<float> interleaved(static_cast<size_t>(rows * k));
  for (int64_t from = 0; from < rows; from += kPanel)
    for (int64_t i = 0; i < k; ++i)
      for (int64_t r = from; r < std::min(rows, from + kPanel); ++r)
        interleaved[static_cast<size_t>(i * rows + r)] = x[r * k + i];
  const int64_t units = (n + kOutputs - 1) / kOutputs;
  for_rows(units, kOutputs * k * static_cast<int64_t>(sizeof(W)), [&](int64_t begin, int64_t end) {
    std::vector<float> panels(static_cast<size_t>(kOutputs * span));
    for (int64_t u = begin; u < end; ++u) {
      const int64_t first = u * kOutputs, count = std::min(kOutputs, n - first);
      for (int64_t from = 0; from < k; from += span) {
        const int64_t inputs = std::min(span, k - from);
        for (int64_t p = 0; p * kPanel < kOutputs; ++p) {
          const int64_t filled = std::max<int64_t>(0, std::min(kPanel, count - p * kPanel));
          convert_panel(w + (first + p * kPanel) * k + from, k, filled, inputs, panels.data() + p * inputs * kPanel);
        }
        const float* xs = interleaved.data() + from * rows;
        if (from == 0) panel_products<false>(panels.data(), inputs, xs, rows, 0, count, out + first, n);
        else panel_products<true>(panels.data(), inputs, xs, rows, 0, count, out + first, n);
      }
    }
  });
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "matvec: the weight must be a contiguous matrix");
  TORCH_CHECK(x.size(-1) == weight.size(1), "matvec: x has ", x.size(-1), " columns, the weight ", weight.size(1));
  const int64_t k = weight.size(1), n = weight.size(0);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t rows = k ? xf.numel() / k : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, xf.options());
  const float* scale = nullptr;
  at::Tensor scales_f;
  if (scales.has_value()) {
    scales_f = scales->to(at::kFloat).contiguous();
    TORCH_CHECK(scales_f.numel() == n, "matvec: ", n, " rows but ", scales_f.numel(), " scales");
    scale = scales_f.data_ptr<float>();
  }
  const float* xs = xf.data_ptr<float>();
  float* o = out.data_ptr<float>();
  switch (weight.scalar_type()) {
    case at::kFloat:
      products(xs, weight.data_ptr<float>(), scale, o, rows, k, n);
      break;
    case at::kBFloat16:
      if (rows > kMostRowProducts && !scale)
        converted_panel_products(xs, reinterpret_cast<const uint16_t*>(weight.data_ptr()), o, rows, k, n);
      else
        products(xs, reinterpret_cast<const uint16_t*>(weight.data_ptr()), scale, o, rows, k, n);
      break;
    case at::kHalf:
      if (rows > kMostRowProducts && !scale)
        converted_panel_products(xs, reinterpret_cast<const F16*>(weight.data_ptr()), o, rows, k, n);
      else
        products(xs, reinterpret_cast<const F16*>(weight.data_ptr()), scale, o, rows, k, n);
      break;
    case at::kChar:
#ifdef LLAMA_CHAT_AVX2
      int8_products(xs, weight.data_ptr<int8_t>(), scale, o, rows, k, n);
#else
      products(xs, weight.data_ptr<int8_t>(), scale, o, rows, k, n);
#endif
      break;
    default:
      TORCH_CHECK(false, "matvec: no product for weights of type ", weight.scalar_type());
  }
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}

// x's rows rounded into `rounded`, a step per `span` values, on every thread: on one, that was a
// few percent of a prefill.
void round_on_threads(const at::Tensor& x, RoundedBlocks& rounded, int64_t span, bool for_biased_tiles) {
  const int64_t k = x.size(1);
  round_blocks(x.data_ptr<float>(), x.size(0), k, k, rounded, span, [&](int64_t count, const auto& body) {
    at::parallel_for(0, count, std::max<int64_t>(1, (1 << 16) / k), body);
  }, for_biased_tiles);
}

// Outputs [0, n) of packed weight rows w of `kind` against the rounded rows, into out (row r's at
// out + r * row_stride), on the threads.
void packed_outputs(Packed kind, const uint8_t* w, const RoundedBlocks& rounded, int64_t n, float* out,
                    int64_t row_stride) {
  const int64_t rows = rounded.rows;
  for_rows(
      n, packed_row_bytes(kind, rounded.k),
      [&](int64_t begin, int64_t end) { packed_range(kind, w, rounded, 0, rows, begin, end, out + begin, row_stride); },
      packed_split_rows(rows), rows >= kTiledFromRows ? kTiledChunksPerThread : 0);
}

// x @ dequantize(data).T for weights kept as GGUF's packed blocks (blocks.h, which states the
// numerics: the rows are rounded per 32 values to int8 steps first). x: float32 (rows, k); data:
// uint8 (n, row bytes), never written (it may be a memory-mapped file). Any number of rows: the
// weights a thread takes are read from memory once and decoded once for all of them.
at::Tensor packed_product(const at::Tensor& x, const at::Tensor& data, c10::string_view kind_name) {
  Packed kind;
  TORCH_CHECK(packed_kind(std::string_view(kind_name.data(), kind_name.size()), kind),
              "packed_product: no packed kind ", kind_name);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "packed_product: x must be a float32 (rows, k) CPU matrix");
  const int64_t rows = x.size(0), k = x.size(1);
  const PackedLayout& layout = layout_of(kind);
  TORCH_CHECK(k % layout.values == 0, "packed_product: ", k, " inputs are not whole ", layout.name, " blocks of ",
              layout.values);
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.is_contiguous() && data.device().is_cpu(),
              "packed_product: the blocks must be a contiguous uint8 (n, row bytes) CPU matrix");
  const int64_t row_bytes = packed_row_bytes(kind, k), n = data.size(0);
  TORCH_CHECK(data.size(1) == row_bytes, "packed_product: ", k, " inputs of ", layout.name, " take ", row_bytes,
              " bytes a row, the blocks have ", data.size(1));
  const at::Tensor xc = x.contiguous();
  at::Tensor out = kept_empty({rows, n}, xc.options());
  if (rows == 0 || n == 0) return out;
  RoundedBlocks rounded;
  round_on_threads(xc, rounded, step_span(kind), biased_tiles(kind));
  packed_outputs(kind, data.data_ptr<uint8_t>(), rounded, n, out.data_ptr<float>(), n);
  return out;
}

// x @ the packed rows of each segment, side by side (a fused q/k/v whose v rows are of another
// kind): data is the segments' bytes one after another (uint8, 1-D), segments (kind, rows) pairs,
// the kind as its place in Packed (ml/packed.py's PACKED_TYPES). The rows are rounded once for
// every segment that takes the same step span, and each segment's outputs go straight into its
// columns.
at::Tensor packed_segments_product(const at::Tensor& x, const at::Tensor& data, const at::Tensor& segments) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "packed_segments_product: x must be a float32 (rows, k) CPU matrix");
  TORCH_CHECK(data.dim() == 1 && data.scalar_type() == at::kByte && data.is_contiguous() && data.device().is_cpu(),
              "packed_segments_product: the blocks must be a contiguous 1-D uint8 CPU buffer");
  TORCH_CHECK(segments.dim() == 1 && segments.scalar_type() == at::kLong && segments.numel() % 2 == 0 &&
                  segments.numel() > 0,
              "packed_segments_product: segments are int64 (kind, rows) pairs");
  const int64_t rows = x.size(0), k = x.size(1), count = segments.numel() / 2;
  const at::Tensor pairs = segments.contiguous();
  const int64_t* pair = pairs.data_ptr<int64_t>();
  constexpr int64_t kinds = sizeof kPackedLayouts / sizeof kPackedLayouts[0];
  int64_t n = 0, bytes = 0;
  bool spans[2] = {false, false}, biased[2] = {false, false};
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(pair[2 * i] >= 0 && pair[2 * i] < kinds && pair[2 * i + 1] >= 0,
                "packed_segments_product: segment ", i, " is no (kind, rows) pair");
    const Packed kind = static_cast<Packed>(pair[2 * i]);
    TORCH_CHECK(k % layout_of(kind).values == 0, "packed_segments_product: ", k, " inputs are not whole ",
                layout_of(kind).name, " blocks of ", layout_of(kind).values);
    const bool super = step_span(kind) == kQuantGroup;
    spans[super] = true;
    biased[super] = biased[super] || biased_tiles(kind);
    n += pair[2 * i + 1];
    bytes += pair[2 * i + 1] * packed_row_bytes(kind, k);
  }
  TORCH_CHECK(data.numel() == bytes, "packed_segments_product: the segments take ", bytes, " bytes, the buffer has ",
              data.numel());
  const at::Tensor xc = x.contiguous();
  at::Tensor out = kept_empty({rows, n}, xc.options());
  if (rows == 0 || n == 0) return out;
  RoundedBlocks rounded[2];
  for (int super = 0; super < 2; ++super)
    if (spans[super]) round_on_threads(xc, rounded[super], super ? kQuantGroup : kQuantBlock, biased[super]);
  const uint8_t* w = data.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0, column = 0; i < count; ++i) {
    const Packed kind = static_cast<Packed>(pair[2 * i]);
    const int64_t outputs = pair[2 * i + 1];
    packed_outputs(kind, w, rounded[step_span(kind) == kQuantGroup], outputs, o + column, n);
    w += outputs * packed_row_bytes(kind, k);
    column += outputs;
  }
  return out;
}

// The index of each row's largest value (the first, on ties; a NaN counts as largest, as in
// torch.argmax), on the calling thread: a greedy decode step's pick. torch's argmax over one
// 32,000-logit row spends most of its 40 us waking a sleeping helper thread.
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "argmax_rows: float32 (rows, n) logits");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n > 0, "argmax_rows: empty rows");
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* picks = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) picks[r] = pick_of(data + r * n, n).index;
  return out;
}

// The places of a row's values within `margin` of its largest, in order of place: the candidates
// of a nucleus (ml/sampling.py), found in one pass where torch.topk sorts a pool. Empty where
// more than `most` are, or the row's largest is not a finite number: the caller takes its pools.
at::Tensor near_largest(const at::Tensor& row, double margin, int64_t most) {
  TORCH_CHECK(row.dim() == 1 && row.scalar_type() == at::kFloat && row.is_contiguous() && row.numel() > 0,
              "near_largest: a contiguous float32 row");
  const float* v = row.data_ptr<float>();
  const int64_t n = row.numel();
  const Pick largest = pick_of(v, n);
  std::vector<int64_t> found;
  if (largest.nan || !std::isfinite(largest.value))
    return at::empty({0}, row.options().dtype(at::kLong));
  const float floor = largest.value - static_cast<float>(margin);
  const auto take = [&](int64_t i) {
    if (static_cast<int64_t>(found.size()) == most) return false;
    found.push_back(i);
    return true;
  };
  int64_t i = 0;
#ifdef LLAMA_CHAT_AVX2
  const __m256 low = _mm256_set1_ps(floor);
  for (; i + 8 <= n; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), low, _CMP_GE_OQ));
    while (mask != 0) {
      if (!take(i + __builtin_ctz(static_cast<unsigned>(mask)))) return at::empty({0}, row.options().dtype(at::kLong));
      mask &= mask - 1;
    }
  }
#endif
  for (; i < n; ++i)
    if (v[i] >= floor && !take(i)) return at::empty({0}, row.options().dtype(at::kLong));
  at::Tensor out = at::empty({static_cast<int64_t>(found.size())}, row.options().dtype(at::kLong));
  std::copy(found.begin(), found.end(), out.data_ptr<int64_t>());
  return out;
}

// The instruction sets this build's products take, by name: a build that fell back from
// -march=native (kernels.py) takes none, and is many times slower.
std::string built_for() {
  std::string sets;
#ifdef LLAMA_CHAT_AVX2
  sets += "avx2 ";
#endif
#ifdef __AVX512F__
  sets += "avx512 ";
#endif
#ifdef LLAMA_CHAT_VNNI
  sets += "vnni ";
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  sets += "bf16 ";  // attention.cpp's prompt attention
#endif
#ifdef _OPENMP
  sets += "openmp ";
#endif
  if (!sets.empty()) sets.pop_back();
  return sets;
}

}  // namespace

TORCH_LIBRARY(llama_chat_cpu, m) {
  m.def("built_for() -> str", &built_for);
  m.def("matvec(Tensor x, Tensor weight, Tensor? scales=None) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("near_largest(Tensor row, float margin, int most) -> Tensor");
  m.def("packed_product(Tensor x, Tensor data, str kind) -> Tensor");
  m.def("packed_segments_product(Tensor x, Tensor data, Tensor segments) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_chat_cpu, CPU, m) {
  m.impl("matvec", &matvec);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("near_largest", &near_largest);
  m.impl("packed_product", &packed_product);
  m.impl("packed_segments_product", &packed_segments_product);
}
