// Memory on 2 MiB pages, for the weights a decode step streams through.
//
// A decode step reads every weight once, tens of megabytes to gigabytes, and on 4 KiB pages each
// new page costs a TLB miss and a page walk on top of the read. On 2 MiB pages (Linux's
// transparent huge pages, asked for with madvise) the one-call step reads its weights faster
// (docs/benchmark-log.md, "Measurements once in the CPU operator's comments").
//
// Large outputs of the operators (a 512-row prompt's gate/up product is 36 MB) come from blocks
// that earlier outputs left behind (kept_empty). A fresh tensor that size, above glibc's largest
// mmap threshold, is fresh memory from the kernel, which faults in and zeroes every page as the
// product first writes it.
//
// Built on first use by llama_chat/ml/cpu/kernels.py, together with the other operators.
#include "memory.h"

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/accumulate.h>

#include <cstdlib>
#include <algorithm>
#include <deque>
#include <mutex>
#include <utility>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace {

constexpr size_t kLargePage = size_t{2} << 20;

// `bytes` of uninitialised memory, aligned to 2 MiB and marked for huge pages before anything
// touches it, so the kernel backs each 2 MiB with one page where it can (with transparent huge
// pages off, ordinary pages). A uint8 tensor that callers cut into weights.
at::Tensor large_pages(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "large_pages: ", bytes, " bytes");
  const size_t size = std::max(kLargePage, (static_cast<size_t>(bytes) + kLargePage - 1) / kLargePage * kLargePage);
  void* memory = nullptr;
  TORCH_CHECK(posix_memalign(&memory, kLargePage, size) == 0, "large_pages: cannot allocate ", size, " bytes");
#ifdef MADV_HUGEPAGE
  madvise(memory, size, MADV_HUGEPAGE);  // advice only: a refusal leaves ordinary pages
#endif
  return at::from_blob(memory, {bytes}, [](void* p) { std::free(p); }, at::TensorOptions().dtype(at::kByte));
}

// Outputs from this size on take kept blocks; smaller ones stay with torch's allocator.
constexpr size_t kKeptFrom = size_t{1} << 20;
// The most memory kept unused between outputs: a prompt's largest outputs of one layer, twice.
constexpr size_t kMostKept = size_t{160} << 20;

// Blocks whose tensors were freed, oldest first, and their bytes. Never destroyed: a tensor may
// be freed after static destructors have run.
struct KeptBlocks {
  std::mutex mutex;
  std::deque<std::pair<size_t, void*>> blocks;
  size_t bytes = 0;
};

KeptBlocks& kept() {
  static auto* blocks = new KeptBlocks;
  return *blocks;
}

void keep(void* memory, size_t size) {
  KeptBlocks& k = kept();
  std::deque<std::pair<size_t, void*>> dropped;
  {
    std::lock_guard<std::mutex> lock(k.mutex);
    k.blocks.emplace_back(size, memory);
    k.bytes += size;
    while (k.bytes > kMostKept) {
      dropped.push_back(k.blocks.front());
      k.bytes -= k.blocks.front().first;
      k.blocks.pop_front();
    }
  }
  for (const auto& block : dropped) std::free(block.second);
}

}  // namespace

namespace llama_chat_cpu {

at::Tensor kept_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  if (bytes < kKeptFrom) return at::empty(sizes, options);
  const size_t size = (bytes + kLargePage - 1) / kLargePage * kLargePage;
  void* memory = nullptr;
  {
    KeptBlocks& k = kept();
    std::lock_guard<std::mutex> lock(k.mutex);
    for (auto it = k.blocks.rbegin(); it != k.blocks.rend(); ++it) {
      if (it->first == size) {
        memory = it->second;
        k.bytes -= size;
        k.blocks.erase(std::next(it).base());
        break;
      }
    }
  }
  if (memory == nullptr) {
    TORCH_CHECK(posix_memalign(&memory, kLargePage, size) == 0, "cannot allocate ", size, " bytes");
#ifdef MADV_HUGEPAGE
    madvise(memory, size, MADV_HUGEPAGE);
#endif
  }
  return at::from_blob(memory, sizes, [size](void* p) { keep(p, size); }, options);
}

}  // namespace llama_chat_cpu

// No tensor comes in to pick a backend by, so the one kernel serves every dispatch.
TORCH_LIBRARY_FRAGMENT(llama_chat_cpu, m) {
  m.def("large_pages(int bytes) -> Tensor", &large_pages);
}
