// Matrix-vector products for decode steps on the CPU: out = x @ w.T, times a scale per output row
// for int8 weights. A decode step multiplies one row (or a few) by every weight once, so the
// speed is how fast the weight is read. PyTorch's kernels for these shapes read the weights at
// 55-80 % of the memory's speed on a 2-core AVX2 machine, bfloat16 ones at a quarter of that
// for several rows, where these reach 70-90 % (benchmarks/bench_cpu_kernels.py): each output row
// is a dot product over one contiguous weight row, with several accumulators, and the rows are
// split among threads.
//
// Built on first use by llama_chat/ml/cpu_kernels.py with the machine's C++ compiler.
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LLAMA_CHAT_AVX2 1
#endif

namespace {

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
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
#endif

// Weight bytes per chunk of output rows that a thread takes at a time; a product of one or two
// chunks runs on the calling thread alone. Smaller chunks balance better and stream worse: in
// one process, interleaved, all of a model's products at once, 256 KiB was as fast as fixed
// halves or faster (TinyLlama-sized int8 58 against 64 ms), 16 Ki weights slower (72 ms).
constexpr int64_t kBytesPerChunk = 1 << 18;

// body(begin, end) over output rows [0, n), in chunks that threads take as they come. torch's
// OpenMP helpers sleep between parallel regions (the command sets OMP_WAIT_POLICY=PASSIVE) and
// take 30-60 us to wake: with a fixed half each, the calling thread would finish its half and
// wait for the late helper's; taking chunks, it goes on with the rows the helper has not reached.
template <typename Body>
void for_rows(int64_t n, int64_t row_bytes, const Body& body) {
  const int64_t chunk = std::max<int64_t>(1, kBytesPerChunk / std::max<int64_t>(row_bytes, 1));
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int threads = at::get_num_threads();
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

inline float scalar(float w) { return w; }
inline float scalar(uint16_t w) { return bf16_to_float(w); }
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
  for (; i < k; ++i) sum += x[i] * scalar(w[i]);
  return sum;
}

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

// Each row of x as int16 steps of (largest magnitude / kActivationSteps); the step per row.
void round_rows(const float* x, int64_t rows, int64_t k, int16_t* out, float* steps) {
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

void int8_products(const float* x, const int8_t* w, const float* scales, float* out, int64_t rows, int64_t k,
                   int64_t n) {
  std::vector<int16_t> rounded(static_cast<size_t>(rows * k));
  std::vector<float> steps(static_cast<size_t>(rows));
  round_rows(x, rows, k, rounded.data(), steps.data());
  for_rows(n, k, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* wj = w + j * k;
      const float scale = scales ? scales[j] : 1.f;
      for (int64_t r = 0; r < rows; ++r)
        out[r * n + j] = dot_int8(rounded.data() + r * k, wj, k) * (steps[r] * scale);
    }
  });
}
#endif


// Four input rows against one weight row: the weights are loaded (and converted) once for all
// four, so a packed step of several jobs costs little more than one row's product per row read.
template <typename W>
inline void dot4(const float* x, int64_t stride, const W* w, int64_t k, float* out) {
  int64_t i = 0;
  float sums[4] = {0.f, 0.f, 0.f, 0.f};
#ifdef LLAMA_CHAT_AVX2
  __m256 a[8];
  for (auto& v : a) v = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m256 w0 = load8(w + i), w1 = load8(w + i + 8);
    for (int r = 0; r < 4; ++r) {
      a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * stride + i), w0, a[r]);
      a[r + 4] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * stride + i + 8), w1, a[r + 4]);
    }
  }
  for (int r = 0; r < 4; ++r) sums[r] = horizontal_sum(_mm256_add_ps(a[r], a[r + 4]));
#endif
  for (; i < k; ++i) {
    const float wi = scalar(w[i]);
    for (int r = 0; r < 4; ++r) sums[r] += x[r * stride + i] * wi;
  }
  for (int r = 0; r < 4; ++r) out[r] = sums[r];
}

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
      products(xs, reinterpret_cast<const uint16_t*>(weight.data_ptr()), scale, o, rows, k, n);
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

}  // namespace

TORCH_LIBRARY(llama_chat_cpu, m) {
  m.def("matvec(Tensor x, Tensor weight, Tensor? scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llama_chat_cpu, CPU, m) {
  m.impl("matvec", &matvec);
}
