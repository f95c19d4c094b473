"""What a KV cache keeps a key or value row as: float32, 16-bit floats, or llama.cpp's q8_0 and
q4_0 blocks of 32 values with one float16 scale (``--cache-type``, named as llama.cpp's ``-ctk``).

A row of ``head_dim`` values is stored as ``row_size(head_dim)`` elements of ``storage`` (bytes,
for the blocks), so a cache keeps its shape ``(..., positions, row)`` whatever the type and a
position's row stays one contiguous run that the CPU operator reads in place (``ml/cpu/decode.cpp``,
``CacheView``, which lays the blocks out the same way). ``store`` and ``load`` are the torch
side: the model's own forward writes through the first and reads through the second.

q4_0 keys and values are rotated first by a fixed orthonormal Hadamard transform (a head whose
size is a power of two): a row's few outlier values, which would set a block's scale and leave the
others two or three levels, are spread over the whole head. Scores do not change, for
q . k = Hq . Hk, and a weighted sum of rotated values is the rotated sum, sum w Hv = H sum w v;
``load`` turns the rows back, and the operator turns the query instead, and the attention's result
once per head (H is its own inverse).

A q4_0 key is also shifted and scaled per channel before its rotation, where its cache was given
the model's measure (``key_centers``): ``store`` and ``load`` take it as ``center``, a layer's
``(shift, scale)``. ``load`` gives the keys back shifted, ``(k - shift)``: the scores a query
makes of them differ from the keys' own by one constant, which its softmax does not see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llama_chat.ml.controls import CACHE_TYPES
from llama_chat.ml.cpu import kernels as cpu_kernels

BLOCK = 32  # values per block of q8_0 and q4_0, as llama.cpp's
# A layer's key measure, float32 ``(kv_heads, head_dim)`` shaped to broadcast against the rows
# (``(kv_heads, 1, head_dim)`` for ``(kv_heads, positions, head_dim)``): a key is kept as
# (k - shift) / scale.
Center = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVType:
    name: str  # as --cache-type says it
    storage: torch.dtype
    block_bytes: int = 0  # bytes of a block of BLOCK values; 0: a float type, a value an element
    rotate: bool = False  # Hadamard-rotated keys and values (where the head's size is a power of two)
    centers_keys: bool = False  # keys shifted and scaled per channel by the model's measure (key_centers)

    @property
    def quantized(self) -> bool:
        return self.block_bytes > 0

    def row_size(self, head_dim: int) -> int:
        """Elements of ``storage`` a row of ``head_dim`` values takes."""
        return head_dim // BLOCK * self.block_bytes if self.quantized else head_dim

    def token_bytes(self, head_dim: int) -> int:
        """Bytes of one head's row."""
        return self.row_size(head_dim) * self.storage.itemsize

    def check(self, head_dim: int) -> None:
        """``ValueError`` (one line) where rows of ``head_dim`` values cannot be kept as this type."""
        if self.quantized and head_dim % BLOCK:
            raise ValueError(f"--cache-type {self.name} needs a head size that is a multiple of {BLOCK}, "
                             f"and this model's is {head_dim}")

    def rotates(self, head_dim: int) -> bool:
        return self.rotate and head_dim & (head_dim - 1) == 0

    def store(self, x: torch.Tensor, *, keys: bool, center: Center | None = None) -> torch.Tensor:
        """Rows ``(..., kv_heads, positions, head_dim)`` as stored rows ``(..., row_size)``;
        ``center``: the layer's key measure, where this type keeps keys by it."""
        if not self.quantized:
            return x.to(self.storage)
        x = x.float()
        if keys and center is not None and self.centers_keys:
            shift, scale = center
            x = (x - shift) / scale
        if self.name == "q4_0" and x.device.type == "cpu" and cpu_kernels.loaded():
            # The same blocks, by the operator's own code: the torch search is many times slower.
            return torch.ops.llama_chat_cpu.q4_0_rows(x, self.rotates(x.shape[-1]))
        if self.rotates(x.shape[-1]):
            x = hadamard(x)
        blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
        return (_q8_0(blocks) if self.name == "q8_0" else _q4_0(blocks)).reshape(*x.shape[:-1], -1)

    def load(self, stored: torch.Tensor, dtype: torch.dtype, *, keys: bool, center: Center | None = None) -> torch.Tensor:
        """Stored rows ``(..., kv_heads, positions, row_size)`` as values ``(..., head_dim)`` of
        ``dtype`` (keys kept by a ``center``: less its shift)."""
        if not self.quantized:
            return stored.to(dtype)
        blocks = stored.reshape(*stored.shape[:-1], -1, self.block_bytes)
        scale = blocks[..., :2].contiguous().view(torch.float16).float()
        if self.name == "q8_0":
            values = blocks[..., 2:].contiguous().view(torch.int8).float()
        else:
            packed = blocks[..., 2:].to(torch.int16)
            values = (torch.cat((packed & 15, packed >> 4), dim=-1) - 8).float()
        x = (values * scale).reshape(*stored.shape[:-1], -1)
        if self.rotates(x.shape[-1]):
            x = hadamard(x)
        if keys and center is not None and self.centers_keys:
            x = x * center[1]
        return x.to(dtype)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """llama.cpp's quantize_row_q8_0: scale = the largest magnitude / 127, values rounded."""
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    values = torch.round(blocks * inverse).clamp(-127, 127).to(torch.int8)
    return torch.cat((scale.half().view(torch.uint8), values.view(torch.uint8)), dim=-1)


# The divisors of a q4_0 block's largest value that ``_q4_0`` tries as its scale: llama.cpp's -8
# first (the largest value exact, at level -8), then smaller scales, which cut the others' rounding
# at the cost of clipping the largest, and the largest at level +7 or below. Quarter steps are exact
# floats, so every language divides alike (kv_rows.h's kQ4Divisors).
Q4_DIVISORS = tuple(-8 - 0.25 * i for i in range(17)) + (7.0, 7.25, 7.5, 7.75, 8.0)
_Q4_CHUNK = 4096  # blocks whose levels under every divisor are made at once (some 12 MB)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """llama.cpp's q4_0 blocks (scale, then byte j holding value j in its low half and value
    j + 16 in its high one, each ``x / scale + 8`` cut to 0..15), the scale chosen per block
    among ``largest / Q4_DIVISORS`` (rounded to float16 as stored) for the least squared error:
    a tenth less than llama.cpp's one choice, the largest / -8, on normal values."""
    shape = blocks.shape
    flat = blocks.reshape(-1, BLOCK)
    out = torch.empty(flat.shape[0], 2 + BLOCK // 2, dtype=torch.uint8)
    divisors = torch.tensor(Q4_DIVISORS, dtype=torch.float32)
    for first in range(0, flat.shape[0], _Q4_CHUNK):  # every divisor's levels at once, a chunk at a time
        x = flat[first:first + _Q4_CHUNK]
        largest = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
        scales = (largest / divisors).half().float()  # (blocks, divisors)
        inverse = torch.where(scales != 0, 1 / scales, torch.zeros_like(scales))
        # x / scale + 8.5 cut to 0..15, as floats: the floor is the integer part wherever it counts.
        levels = (x.unsqueeze(1) * inverse.unsqueeze(2)).add_(8.5).floor_().clamp_(0, 15)
        error = (levels - 8).mul_(scales.unsqueeze(2)).sub_(x.unsqueeze(1)).square_().sum(dim=-1)
        best = error.argmin(dim=-1, keepdim=True)  # the first of equal errors: the earlier divisor
        scale = scales.gather(1, best)
        values = levels.gather(1, best.unsqueeze(2).expand(-1, 1, BLOCK)).squeeze(1).to(torch.int16)
        half = BLOCK // 2
        out[first:first + _Q4_CHUNK, :2] = scale.half().view(torch.uint8)
        out[first:first + _Q4_CHUNK, 2:] = (values[:, :half] | (values[:, half:] << 4)).to(torch.uint8)
    return out.reshape(*shape[:-1], 2 + BLOCK // 2)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``(..., n)``, n a power of two) times the orthonormal Sylvester Hadamard matrix
    (symmetric, its own inverse), by the fast transform: log2(n) rounds of sums and differences."""
    n = x.shape[-1]
    shape = x.shape
    h = 1
    while h < n:
        pairs = x.reshape(-1, n // (2 * h), 2, h)
        x = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return (x.reshape(shape) * (1 / math.sqrt(n))).to(x.dtype)


TYPES = {
    "f32": KVType("f32", torch.float32),
    "f16": KVType("f16", torch.float16),
    "bf16": KVType("bf16", torch.bfloat16),
    "q8_0": KVType("q8_0", torch.uint8, block_bytes=2 + BLOCK),
    "q4_0": KVType("q4_0", torch.uint8, block_bytes=2 + BLOCK // 2, rotate=True, centers_keys=True),
}
_OF_DTYPE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
assert set(TYPES) | {"auto"} == set(CACHE_TYPES)


def for_device(name: str | None, device: torch.device | str, model_dtype: torch.dtype) -> KVType:
    """The type ``--cache-type name`` means here. auto: float16 on the CPU, as llama.cpp's;
    elsewhere the model's own dtype (bfloat16 on CUDA). None (a library caller that names none):
    the model's own dtype, whose cache gives the model's own logits. Blocks are read by the CPU
    operator only: ``ValueError`` (one line) for them on another device."""
    cpu = torch.device(device).type == "cpu"
    if name is None or (name == "auto" and not cpu):
        return TYPES[_OF_DTYPE.get(model_dtype, "f32")]
    if name == "auto":
        return TYPES["f16"]
    kind = TYPES[name]
    if kind.quantized and not cpu:
        raise ValueError(f"--cache-type {name} is read on the CPU only; on {torch.device(device).type}, "
                         "use f32, f16 or bf16")
    return kind


def of_dtype(dtype: torch.dtype) -> KVType:
    """The float type a tensor of ``dtype`` holds (a cache made with a dtype, not a type)."""
    return TYPES[_OF_DTYPE[dtype]]


__all__ = ["BLOCK", "Center", "KVType", "TYPES", "for_device", "hadamard", "of_dtype"]
