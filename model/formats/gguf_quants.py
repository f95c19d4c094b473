"""GGML block formats to floating point, in torch: the dequantizers the GGUF reader uses.

Each function takes the raw bytes of whole blocks (a uint8 tensor whose length is a multiple of
the block's byte size) and returns float32 values, in the order the tensor stores them. The
layouts are ggml's (``ggml-common.h``); ``tests/test_gguf.py`` checks each one against the
``gguf`` package's numpy dequantizers on random bytes. Torch rather than numpy because it works
on any device (the bytes can go to a GPU and be expanded there) and runs the bit twiddling on
several threads (docs/benchmarks.md, "Loading GGUF files").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256  # values in one K-quant super-block


@dataclass(frozen=True)
class BlockFormat:
    name: str
    block_values: int  # values per block
    block_bytes: int  # bytes per block
    dequantize: Callable[..., torch.Tensor]  # (raw bytes, out=None) -> float32 values


def _f16(column: torch.Tensor) -> torch.Tensor:
    """A (blocks, 2) byte slice read as one float16 per block, as float32 (blocks, 1)."""
    return column.contiguous().view(torch.float16).float()


def _output(out: torch.Tensor | None, blocks: int, values: int, device: torch.device) -> torch.Tensor:
    """Where the values go: ``out`` (float32, contiguous, the right size) or a new tensor."""
    if out is None:
        return torch.empty(blocks, values, dtype=torch.float32, device=device)
    return out.view(blocks, values)


_LOW_NIBBLES = 0x0F0F0F0F0F0F0F0F
_LOW_BITS = 0x0101010101010101
_LOW_PAIRS = 0x0303030303030303


def _words(b: torch.Tensor) -> torch.Tensor:
    """Bytes (..., 8k) as int64 words, so bit twiddling runs on eight bytes per operation (byte-wise
    it is slower than numpy); copied only when the rows are not 8-byte aligned."""
    try:
        return b.view(torch.int64)
    except RuntimeError:
        return b.contiguous().view(torch.int64)


def _nibbles(qs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low and the high nibble of every byte, as two uint8 tensors shaped like ``qs``.

    (Shifting a signed word right drags sign bits into its top nibble only, which the mask drops.)
    """
    w = _words(qs)
    return (w & _LOW_NIBBLES).view(torch.uint8), ((w >> 4) & _LOW_NIBBLES).view(torch.uint8)


def _bits(qh: torch.Tensor, shift: int, mask: int) -> torch.Tensor:
    """``(byte >> shift) & mask`` for every byte of ``qh``, eight at a time."""
    return ((_words(qh) >> shift) & mask).view(torch.uint8)


# Each function writes float32 values into ``out`` when given (a contiguous float32 tensor of
# the blocks' value count): integers are converted on the copy into ``out`` and scaled there in
# place, so the only temporaries are a byte per value.


def q8_0(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: float16 scale d, 32 int8 values; x = d * q
    b = raw.view(-1, 34)
    y = _output(out, b.shape[0], 32, raw.device)
    y.copy_(b[:, 2:].view(torch.int8))
    y.mul_(_f16(b[:, :2]))
    return y.view(-1)


def q4_0(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: float16 scale d, 16 bytes; values 0-15 are the low nibbles, 16-31 the high ones; x = d * (q - 8)
    b = raw.view(-1, 18)
    y = _output(out, b.shape[0], 32, raw.device)
    low, high = _nibbles(b[:, 2:])
    y[:, :16].copy_(low)
    y[:, 16:].copy_(high)
    y.sub_(8.0).mul_(_f16(b[:, :2]))
    return y.view(-1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block, packed into 12 bytes.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def _k_low_bits(b: torch.Tensor, qs: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """(blocks, 8, 32) float32 of the 4-bit parts: each 32 bytes of ``qs`` hold two sub-blocks,
    the first in the low nibbles, the second in the high ones."""
    n = b.shape[0]
    y = _output(out, n, QK_K, b.device)
    low, high = _nibbles(qs.reshape(n, 4, 32))
    pairs = y.view(n, 4, 2, 32)
    pairs[:, :, 0].copy_(low)
    pairs[:, :, 1].copy_(high)
    return y.view(n, 8, 32)


def _k_affine(b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x = d * scale * q - dmin * min over 8 sub-blocks of 32 (Q4_K, Q5_K), in place."""
    sc, mn = _k_scales(b[:, 4:16])
    y.mul_((_f16(b[:, 0:2]) * sc).unsqueeze(-1)).sub_((_f16(b[:, 2:4]) * mn).unsqueeze(-1))
    return y.reshape(-1)


def q4_k(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # super-block: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles; 8 sub-blocks of 32
    b = raw.view(-1, 144)
    return _k_affine(b, _k_low_bits(b, b[:, 16:], out))


def q5_k(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # as Q4_K, plus 32 bytes of fifth bits: bit j of byte l is the high bit of sub-block j's value l
    b = raw.view(-1, 176)
    y = _k_low_bits(b, b[:, 48:], out)
    qh = b[:, 16:48]
    for j in range(8):
        y[:, j].add_(_bits(qh, j, _LOW_BITS), alpha=16)
    return _k_affine(b, y)


def q6_k(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # super-block: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, f16 d;
    # 16 sub-blocks of 16; x = d * scale * (q - 32). Each half of 128 values takes 64 low-nibble
    # bytes (values 0-63 low nibbles, 64-127 high nibbles) and 32 high bytes (bits 2k..2k+1 give
    # values 32k..32k+31).
    b = raw.view(-1, 210)
    n = b.shape[0]
    y = _output(out, n, QK_K, raw.device)
    low, high = _nibbles(b[:, :128])
    halves = y.view(n, 2, 2, 64)
    halves[:, :, 0].copy_(low.view(n, 2, 64))
    halves[:, :, 1].copy_(high.view(n, 2, 64))
    quarters = y.view(n, 2, 4, 32)
    qh = b[:, 128:192]
    for k in range(4):
        quarters[:, :, k].add_(_bits(qh, 2 * k, _LOW_PAIRS).view(n, 2, 32), alpha=16)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    y.view(n, 16, 16).sub_(32.0).mul_((_f16(b[:, 208:210]) * scales).unsqueeze(-1))
    return y.view(-1)


# ggml type ids (ggml.h ``enum ggml_type``) of the formats read here.
F32, F16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 8, 12, 13, 14, 30

PLAIN = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
BLOCKS = {
    Q8_0: BlockFormat("Q8_0", 32, 34, q8_0),
    Q4_0: BlockFormat("Q4_0", 32, 18, q4_0),
    Q4_K: BlockFormat("Q4_K", QK_K, 144, q4_k),
    Q5_K: BlockFormat("Q5_K", QK_K, 176, q5_k),
    Q6_K: BlockFormat("Q6_K", QK_K, 210, q6_k),
}
