// Memory on 2 MiB pages, for the weights a decode step streams through.
//
// A decode step reads every weight once, tens of megabytes to gigabytes, and on 4 KiB pages each
// new page costs a TLB miss and a page walk on top of the read. On 2 MiB pages (Linux's
// transparent huge pages, asked for with madvise) the one-call step reads its weights faster
// (docs/benchmark-log.md, "Measurements once in the CPU operator's comments").
//
// Built on first use by llama_chat/ml/cpu/kernels.py, together with the other operators.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>

#include <cstdlib>
#include <algorithm>

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

}  // namespace

// No tensor comes in to pick a backend by, so the one kernel serves every dispatch.
TORCH_LIBRARY_FRAGMENT(llama_chat_cpu, m) {
  m.def("large_pages(int bytes) -> Tensor", &large_pages);
}
