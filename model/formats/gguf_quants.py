"""GGML block formats to floating point, in torch: the dequantizers the GGUF reader uses.

Each function takes the raw bytes of whole blocks (a uint8 tensor whose length is a multiple of
the block's byte size) and returns float32 values, in the order the tensor stores them. The
layouts are ggml's (``ggml-common.h``); ``tests/test_gguf.py`` checks each one against the
``gguf`` package's numpy dequantizers on random bytes. Torch rather than numpy because it works
on any device (the bytes can go to a GPU and be expanded there) and runs the bit twiddling on
several threads: see "GGUF" in docs/formats.md for the measured load times.
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
    dequantize: Callable[[torch.Tensor], torch.Tensor]


def _f16(column: torch.Tensor) -> torch.Tensor:
    """A (blocks, 2) byte slice read as one float16 per block, as float32 (blocks, 1)."""
    return column.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Bytes in groups of ``group``: the low nibbles of a group, then its high nibbles."""
    q = qs.reshape(qs.shape[0], -1, 1, group)
    return torch.cat((q & 0x0F, q >> 4), dim=2).reshape(qs.shape[0], -1)


def q8_0(raw: torch.Tensor) -> torch.Tensor:
    # block: float16 scale d, 32 int8 values; x = d * q
    b = raw.view(-1, 34)
    return (_f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()).reshape(-1)


def q4_0(raw: torch.Tensor) -> torch.Tensor:
    # block: float16 scale d, 16 bytes; values 0-15 are the low nibbles, 16-31 the high ones; x = d * (q - 8)
    b = raw.view(-1, 18)
    q = _nibbles(b[:, 2:], 16).float() - 8.0
    return (_f16(b[:, :2]) * q).reshape(-1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K super-block, packed into 12 bytes.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble).
    """
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc.float(), mn.float()


def q4_k(raw: torch.Tensor) -> torch.Tensor:
    # super-block: f16 d, f16 dmin, 12 bytes of scales/mins, 128 bytes of nibbles; 8 sub-blocks of 32:
    # x = d * scale * q - dmin * min
    b = raw.view(-1, 144)
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 16:], 32).view(n, 8, 32).float()
    out = (_f16(b[:, 0:2]) * sc).unsqueeze(-1) * q - (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
    return out.reshape(-1)


def q5_k(raw: torch.Tensor) -> torch.Tensor:
    # as Q4_K, plus 32 bytes of fifth bits: bit j of byte l is the high bit of sub-block j's value l
    b = raw.view(-1, 176)
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]
    low = _nibbles(b[:, 48:], 32).view(n, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device).view(1, 8, 1)
    high = (qh.unsqueeze(1) >> shifts) & 1
    q = (low | (high << 4)).float()
    out = (_f16(b[:, 0:2]) * sc).unsqueeze(-1) * q - (_f16(b[:, 2:4]) * mn).unsqueeze(-1)
    return out.reshape(-1)


def q6_k(raw: torch.Tensor) -> torch.Tensor:
    # super-block: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8 scales, f16 d;
    # 16 sub-blocks of 16; x = d * scale * (q - 32). Each half of 128 values takes 64 low-nibble
    # bytes (values 0-63 low nibbles, 64-127 high nibbles) and 32 high bytes (bits 2k..2k+1 give
    # values 32k..32k+31).
    b = raw.view(-1, 210)
    n = b.shape[0]
    ql = _nibbles(b[:, :128], 64).view(n, 2, 128)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device).view(1, 1, 4, 1)
    high = ((qh >> shifts) & 3).reshape(n, 2, 128)
    q = (ql | (high << 4)).float().view(n, 16, 16) - 32.0
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    out = (_f16(b[:, 208:210]) * scales).unsqueeze(-1) * q
    return out.reshape(-1)


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
