// Greedy picks: where a run of logits is largest, the first place on ties, a NaN counting as
// larger than any number (as torch.argmax has it): the native form of ml/sampling.py's `pick`,
// under the one tie rule of every draw (tests/test_draws.py checks the forms equal). Shared by
// argmax_rows (kernels.cpp) and the one-call decode step (decode.cpp), which picks from each
// range of the classifier's outputs as it writes them.
#pragma once

#include "dot.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace llama_chat_cpu {

struct Pick {
  float value = -INFINITY;
  int64_t index = std::numeric_limits<int64_t>::max();  // none yet: any place beats it
  bool nan = false;
};

// Whether `a` is the pick over `b`. The order does not depend on which ranges were scanned
// first, so picks from ranges that threads took in any order combine into the whole row's.
inline bool better(const Pick& a, const Pick& b) {
  if (a.nan != b.nan) return a.nan;
  if (!a.nan && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

// The pick of v[0, n), its index counted from `offset`.
inline Pick pick_of(const float* v, int64_t n, int64_t offset = 0) {
  // The largest value (and whether there is a NaN) 32 at a time in four independent maxima, then
  // its first place eight at a time.
  float largest = -INFINITY;
  bool nan = false;
  int64_t i = 0;
#ifdef LLAMA_CHAT_AVX2
  __m256 most[4], unordered = _mm256_setzero_ps();
  for (auto& m : most) m = _mm256_set1_ps(-INFINITY);
  for (; i + 32 <= n; i += 32) {
    for (int q = 0; q < 4; ++q) {
      const __m256 x = _mm256_loadu_ps(v + i + 8 * q);
      most[q] = _mm256_max_ps(most[q], x);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    most[0] = _mm256_max_ps(most[0], x);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_max_ps(_mm256_max_ps(most[0], most[1]), _mm256_max_ps(most[2], most[3])));
  for (const float x : lanes) largest = std::max(largest, x);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < n; ++i) {
    nan = nan || std::isnan(v[i]);
    largest = std::max(largest, v[i]);
  }
  Pick pick;
  if (n <= 0) return pick;
  int64_t best = 0;
#ifdef LLAMA_CHAT_AVX2
  if (!nan) {
    const __m256 target = _mm256_set1_ps(largest);
    for (; best + 8 <= n; best += 8) {
      const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + best), target, _CMP_EQ_OQ));
      if (hits != 0) {
        best += __builtin_ctz(static_cast<unsigned>(hits));
        break;
      }
    }
  }
#endif
  while (best + 1 < n && !(nan ? std::isnan(v[best]) : v[best] == largest)) ++best;
  pick.value = v[best];
  pick.index = offset + best;
  pick.nan = nan;
  return pick;
}

}  // namespace llama_chat_cpu
