"""GGML block formats to floating point, in torch: the dequantizers the GGUF reader and packed weights use.

Each function takes the raw bytes of whole blocks (a uint8 tensor whose length is a multiple of
the block's byte size) and returns float32 values, in the order the tensor stores them;
``dequantize`` does the same for a ggml type id and a shape. The layouts are ggml's
(``ggml-common.h``); ``tests/test_gguf_quants.py`` checks each one against the ``gguf``
package's numpy dequantizers on random bytes, bit for bit. Torch rather than numpy because it
works on any device (the bytes can go to a GPU and be expanded there) and runs the bit twiddling
on several threads (docs/benchmarks.md, "Loading GGUF files").
"""

from __future__ import annotations

import math
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


def _viewed(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes viewed as ``dtype``, copied first when they do not line up with its size. (A copy,
    not ``contiguous()``: a slice of one block counts as contiguous whatever its offset and strides.)"""
    try:
        return b.view(dtype)
    except RuntimeError:
        return torch.empty(b.shape, dtype=b.dtype, device=b.device).copy_(b).view(dtype)


def _f16(column: torch.Tensor) -> torch.Tensor:
    """A (blocks, 2) byte slice read as one float16 per block, as float32 (blocks, 1)."""
    return _viewed(column, torch.float16).float()


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
    return _viewed(b, torch.int64)


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


# --- the legacy 32-value types with a minimum or a fifth bit ------------------------------------


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """(blocks, 4) bytes as (blocks, 32) bits: bit i % 8 of byte i // 8 is value i's fifth bit."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh.unsqueeze(-1) >> shifts) & 1).view(qh.shape[0], 32)


def _low_then_high(y: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Values 0-15 from the low nibbles of 16 bytes, 16-31 from the high ones, into ``y`` (blocks, 32)."""
    low, high = _nibbles(qs)
    y[:, :16].copy_(low)
    y[:, 16:].copy_(high)
    return y


def q4_1(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: f16 scale d, f16 minimum m, 16 bytes of nibbles (as Q4_0); x = d * q + m
    b = raw.view(-1, 20)
    y = _low_then_high(_output(out, b.shape[0], 32, raw.device), b[:, 4:])
    y.mul_(_f16(b[:, 0:2])).add_(_f16(b[:, 2:4]))
    return y.view(-1)


def q5_0(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: f16 scale d, 4 bytes of fifth bits, 16 bytes of nibbles; x = d * (q - 16)
    b = raw.view(-1, 22)
    y = _low_then_high(_output(out, b.shape[0], 32, raw.device), b[:, 6:])
    y.add_(_fifth_bits(b[:, 2:6]), alpha=16)
    y.sub_(16.0).mul_(_f16(b[:, 0:2]))
    return y.view(-1)


def q5_1(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: f16 scale d, f16 minimum m, 4 bytes of fifth bits, 16 bytes of nibbles; x = d * q + m
    b = raw.view(-1, 24)
    y = _low_then_high(_output(out, b.shape[0], 32, raw.device), b[:, 8:])
    y.add_(_fifth_bits(b[:, 4:8]), alpha=16)
    y.mul_(_f16(b[:, 0:2])).add_(_f16(b[:, 2:4]))
    return y.view(-1)


# --- 2- and 3-bit K-quants ------------------------------------------------------------------------


def _k_crumbs(qs: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """(blocks, 256) float32 of the 2-bit parts of Q2_K/Q3_K: each half of 128 values takes 32
    bytes, bits 2j..2j+1 of byte l giving value 32j + l."""
    n = qs.shape[0]
    y = _output(out, n, QK_K, qs.device)
    quarters = y.view(n, 2, 4, 32)
    for j in range(4):
        quarters[:, :, j].copy_(_bits(qs, 2 * j, _LOW_PAIRS).view(n, 2, 32))
    return y


def q2_k(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # super-block: 16 bytes of 4-bit scale (low) and min (high) per 16 values, 64 bytes of 2-bit
    # values, f16 d, f16 dmin; x = d * scale * q - dmin * min
    b = raw.view(-1, 84)
    n = b.shape[0]
    y = _k_crumbs(b[:, 16:80], out)
    scales = b[:, :16]
    step = _f16(b[:, 80:82]) * (scales & 0x0F).float()
    floor = _f16(b[:, 82:84]) * (scales >> 4).float()
    y.view(n, 16, 16).mul_(step.unsqueeze(-1)).sub_(floor.unsqueeze(-1))
    return y.view(-1)


def q3_k(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # super-block: 32 bytes of high bits (bit i of byte l: value 32i + l), 64 bytes of 2-bit
    # values (as Q2_K), 12 bytes of sixteen 6-bit scales, f16 d; x = d * (scale - 32) * q with
    # q = low bits - 4 where the high bit is clear (a set bit means no offset)
    b = raw.view(-1, 110)
    n = b.shape[0]
    y = _k_crumbs(b[:, 32:96], out)
    rows = y.view(n, 8, 32)
    hmask = b[:, :32]
    for i in range(8):
        rows[:, i].add_(_bits(hmask, i, _LOW_BITS), alpha=4)
    # scales 0-7 take the low nibbles of bytes 0-7 and 8-15 their high nibbles; bits 4-5 of
    # scale 4j + k are bits 2j..2j+1 of byte 8 + k
    packed = b[:, 96:108]
    low = torch.cat((packed[:, :8] & 0x0F, packed[:, :8] >> 4), dim=1)
    high = torch.cat([(packed[:, 8:12] >> (2 * j)) & 0x03 for j in range(4)], dim=1)
    scales = (low | (high << 4)).float().sub_(32.0)
    y.sub_(4.0).view(n, 16, 16).mul_((_f16(b[:, 108:110]) * scales).unsqueeze(-1))
    return y.view(-1)


# --- 4-bit non-linear (IQ4) -------------------------------------------------------------------------

# The sixteen levels a 4-bit IQ4 index stands for (ggml-common.h ``kvalues_iq4nl``).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_levels(y: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``y`` (contiguous float32) filled with the IQ4 level of each 4-bit ``index`` of the same size."""
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=index.device)
    torch.index_select(levels, 0, index.reshape(-1).int(), out=y.view(-1))
    return y


def iq4_nl(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # block: f16 scale d, 16 bytes of 4-bit indexes (as Q4_0's nibbles); x = d * level[q]
    b = raw.view(-1, 18)
    n = b.shape[0]
    low, high = _nibbles(b[:, 2:])
    y = _iq4_levels(_output(out, n, 32, raw.device), torch.cat((low, high), dim=1))
    y.mul_(_f16(b[:, 0:2]))
    return y.view(-1)


def iq4_xs(raw: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    # super-block: f16 d, 16 bits of high scale bits (2 per sub-block), 4 bytes of low scale
    # nibbles, 128 bytes of indexes; 8 sub-blocks of 32, each 16 bytes (low nibbles first);
    # x = d * (scale - 32) * level[q]
    b = raw.view(-1, 136)
    n = b.shape[0]
    low, high = _nibbles(b[:, 8:])
    index = torch.cat((low.view(n, 8, 16), high.view(n, 8, 16)), dim=2)
    y = _iq4_levels(_output(out, n, QK_K, raw.device), index)
    high_bits = b[:, 2].int() | (b[:, 3].int() << 8)
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=raw.device)
    scale_high = (high_bits.unsqueeze(-1) >> shifts) & 0x03
    scale_low = torch.stack((b[:, 4:8] & 0x0F, b[:, 4:8] >> 4), dim=2).view(n, 8).int()
    scales = (scale_low | (scale_high << 4)).float().sub_(32.0)
    y.view(n, 8, 32).mul_((_f16(b[:, 0:2]) * scales).unsqueeze(-1))
    return y.view(-1)


# ggml type ids (ggml.h ``enum ggml_type``) of the formats read here.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16 = 10, 11, 12, 13, 14, 20, 23, 30

PLAIN = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}
BLOCKS = {
    Q8_0: BlockFormat("Q8_0", 32, 34, q8_0),
    Q4_0: BlockFormat("Q4_0", 32, 18, q4_0),
    Q4_1: BlockFormat("Q4_1", 32, 20, q4_1),
    Q5_0: BlockFormat("Q5_0", 32, 22, q5_0),
    Q5_1: BlockFormat("Q5_1", 32, 24, q5_1),
    Q2_K: BlockFormat("Q2_K", QK_K, 84, q2_k),
    Q3_K: BlockFormat("Q3_K", QK_K, 110, q3_k),
    Q4_K: BlockFormat("Q4_K", QK_K, 144, q4_k),
    Q5_K: BlockFormat("Q5_K", QK_K, 176, q5_k),
    Q6_K: BlockFormat("Q6_K", QK_K, 210, q6_k),
    IQ4_NL: BlockFormat("IQ4_NL", 32, 18, iq4_nl),
    IQ4_XS: BlockFormat("IQ4_XS", QK_K, 136, iq4_xs),
}
PLAIN_NAMES = {F32: "F32", F16: "F16", BF16: "BF16"}
# Bytes per value of the most compact type read here: a floor for a file's size given its model.
SMALLEST_BYTES_PER_VALUE = min(f.block_bytes / f.block_values for f in BLOCKS.values())


def supported_type_names() -> str:
    """"F32, F16, ... or IQ4_XS": the types read here, for error messages."""
    names = [PLAIN_NAMES[t] for t in PLAIN] + [BLOCKS[t].name for t in BLOCKS]
    return ", ".join(names[:-1]) + " or " + names[-1]


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 tensor of ``shape`` (torch order, rows last) that whole blocks ``raw`` (uint8)
    of ``ggml_type`` hold; ValueError when the type is not one of ``BLOCKS`` or the sizes differ."""
    fmt = BLOCKS.get(ggml_type)
    if fmt is None:
        raise ValueError(f"ggml type {ggml_type} is not a block type read here")
    values = math.prod(shape)
    if values % fmt.block_values or raw.numel() != values // fmt.block_values * fmt.block_bytes:
        raise ValueError(f"{raw.numel()} bytes of {fmt.name} do not hold a tensor of shape {tuple(shape)}")
    return fmt.dequantize(raw.reshape(-1)).view(shape)
