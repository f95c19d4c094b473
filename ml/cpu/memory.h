// Memory for the operators' large outputs (memory.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace llama_chat_cpu {

// at::empty(sizes, options), but a tensor of a megabyte or more takes memory that an earlier such
// tensor of the same size left behind, already mapped: see memory.cpp.
at::Tensor kept_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace llama_chat_cpu
