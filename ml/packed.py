"""Weights kept as GGUF's packed quant blocks, and the products that read them as they are.

A GGUF tensor of shape (out, in) stores each row of ``in`` values as consecutive blocks
(``ggml-common.h``): 32 values a block for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, 256 a super-block for
Q4_K, Q5_K and Q6_K. A ``PackedWeight`` is those bytes as a uint8 (out, row bytes) tensor, often a
view of the memory-mapped file (never written), so a model takes about its file's memory instead
of four bytes a value. ``PackedLinear`` is the module a model's projections become,
``PackedEmbedding`` its token embedding (a lookup expands only the rows it reads).

Products: with the CPU operator loaded (``ml/cpu/kernels.py``), products on the CPU take
``torch.ops.llama_chat_cpu.packed_product`` (``ml/cpu/blocks.h``): the rows are rounded to int8
steps (step max|x| / 127) per 32 values, and per 256 for the K-quants, as llama.cpp rounds its
activations (Q8_0, Q8_K), and meet the blocks in integer sums, so the result is ``dequantize(w) @ rounded(x)`` up to the order of float32
additions (blocks.h states it exactly). A prompt's many rows take it too, against tiles of weight
rows decoded once for all of them: it was faster than expanding the weights and one float32
matrix product at every row count measured (``benchmarks/bench_packed.py --prefill``). Other
devices, or no operator, take ``dequantized_product``: tiles of weight rows expanded to float32
and multiplied, exact to float32.

``pack`` makes Q8_0 and Q4_0 blocks from float weights with llama.cpp's reference rounding (the
bytes ``gguf.quants.quantize`` gives), for models quantized on load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.blocks import BLOCKS

PACKED_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
# (values, bytes) of a block of each kind, as ggml lays them out (ml/cpu/blocks.h has the same).
BLOCK_LAYOUTS = {
    "q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
    "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210),
}
PACKABLE = ("q8_0", "q4_0")
# Weight values expanded at a time by ``dequantized_product``: a tile of float32 rows that stays
# in the cache while the rows meet it.
TILE_VALUES = 1 << 20

_DEQUANTIZERS = {fmt.name.lower(): fmt.dequantize for fmt in BLOCKS.values()}


def block_layout(kind: str) -> tuple[int, int]:
    """(values, bytes) of one block of ``kind``; ValueError naming the kind if it is not packed."""
    try:
        return BLOCK_LAYOUTS[kind]
    except KeyError:
        raise ValueError(f"no packed weight kind {kind!r} (one of {', '.join(PACKED_TYPES)})") from None


def row_bytes(kind: str, in_features: int) -> int:
    values, size = block_layout(kind)
    if in_features <= 0 or in_features % values:
        raise ValueError(f"{kind} rows hold whole blocks of {values} values, not {in_features}")
    return in_features // values * size


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """An (out_features, in_features) weight as ``kind`` blocks: ``data`` is uint8
    (out_features, row bytes), each row its blocks in order; it may be a memory-mapped file's."""

    kind: str
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        expected = row_bytes(self.kind, self.in_features)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != expected:
            raise ValueError(f"{self.kind} weight of {self.in_features} inputs: expected uint8 (rows, {expected}) "
                             f"blocks, got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out_features, in_features) values."""
        return self.dequantize_rows(0, self.out_features).to(dtype)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as float32 (stop - start, in_features)."""
        raw = self.data[start:stop].contiguous().view(-1)
        return _dequantizer(self.kind)(raw).view(stop - start, self.in_features)


def _dequantizer(kind: str):
    found = _DEQUANTIZERS.get(kind)
    if found is not None:
        return found
    # A kind the torch table does not have (yet): gguf's numpy dequantizer, on a copy.
    import gguf
    import numpy as np

    qtype = gguf.GGMLQuantizationType[kind.upper()]

    def numpy_dequantize(raw: torch.Tensor) -> torch.Tensor:
        values = gguf.quants.dequantize(raw.cpu().numpy().reshape(1, -1), qtype).astype(np.float32)
        return torch.from_numpy(values.reshape(-1)).to(raw.device)

    return numpy_dequantize


def kernel_takes(x: torch.Tensor, weight: PackedWeight) -> bool:
    """Whether the product of ``x``'s rows with ``weight`` goes to the CPU operator."""
    return _kernel_takes(x, weight.data)


def _kernel_takes(x: torch.Tensor, data: torch.Tensor) -> bool:
    return (cpu_kernels.loaded() and x.device.type == "cpu" and data.device.type == "cpu" and data.is_contiguous()
            and x.numel() > 0)


def product(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``x @ dequantize(weight).T`` for any leading dimensions of ``x``, in ``x``'s dtype (the
    operator's rounding of ``x`` when it takes the product; see the module doc)."""
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the {weight.kind} weight {weight.in_features}")
    rows = x.reshape(-1, weight.in_features).float()
    if rows.shape[0] == 0:  # a chunk of a long prompt wants no logits: nothing to expand the weight for
        return x.new_empty(*x.shape[:-1], weight.out_features)
    if _kernel_takes(x, weight.data):
        out = torch.ops.llama_chat_cpu.packed_product(rows, weight.data, weight.kind)
    else:
        out = dequantized_product(rows, weight)
    return out.to(x.dtype).view(*x.shape[:-1], weight.out_features)


def dequantized_product(rows: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """float32 ``rows @ dequantize(weight).T``, expanding ``TILE_VALUES`` weights at a time."""
    out = torch.empty(rows.shape[0], weight.out_features, dtype=torch.float32, device=rows.device)
    tile = max(1, TILE_VALUES // weight.in_features)
    for start in range(0, weight.out_features, tile):
        stop = min(weight.out_features, start + tile)
        out[:, start:stop] = rows @ weight.dequantize_rows(start, stop).T
    return out


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight stays in packed blocks (a buffer, never written)."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.kind = weight.kind
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.register_buffer("data", weight.data)

    @property
    def packed(self) -> PackedWeight:
        """The weight as it is now (the buffer follows the module across devices)."""
        return PackedWeight(self.kind, self.data, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == self.in_features and _kernel_takes(x, self.data):  # no PackedWeight to check per call
            rows = torch.ops.llama_chat_cpu.packed_product(x.reshape(-1, self.in_features).float(), self.data,
                                                           self.kind)
            return rows.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return product(x, self.packed)

    @property
    def segments(self) -> tuple[tuple[str, int], ...]:
        """(kind, rows) of each run of rows of one kind: here all of them."""
        return ((self.kind, self.out_features),)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"


class PackedConcat(nn.Module):
    """Packed layers of different kinds, their outputs side by side: a fused q/k/v of a Q4_K_M file,
    whose v rows are Q6_K in some layers. Their bytes are one buffer (what the one-call decode step
    reads as one matrix), each layer's rows a view of it."""

    def __init__(self, parts: list[PackedWeight]) -> None:
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("layers side by side take the same inputs")
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.segments = tuple((p.kind, p.out_features) for p in parts)
        self.register_buffer("data", torch.cat([p.data.reshape(-1) for p in parts]))
        # (kind, rows) pairs as the operator's one call for all the segments reads them
        self.register_buffer("pairs", segment_pairs(self.segments), persistent=False)

    @property
    def parts(self) -> list[PackedWeight]:
        out, offset = [], 0
        for kind, rows in self.segments:
            size = rows * row_bytes(kind, self.in_features)
            out.append(PackedWeight(kind, self.data[offset:offset + size].view(rows, -1), self.in_features))
            offset += size
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == self.in_features and _kernel_takes(x, self.data):
            # One call: the rows rounded once, each segment's outputs written in place (no cat).
            rows = torch.ops.llama_chat_cpu.packed_segments_product(x.reshape(-1, self.in_features).float(),
                                                                    self.data, self.pairs)
            return rows.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return torch.cat([product(x, part) for part in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, segments={self.segments}"


# The layers whose products read packed blocks (``ml/ops.project`` hands them their input).
PACKED_LAYERS = (PackedLinear, PackedConcat)


def fuse(parts: list[nn.Module]) -> nn.Module:
    """Packed layers' outputs side by side, as one layer: a ``PackedLinear`` of their rows when
    they are of one kind, else a ``PackedConcat`` of runs of one kind (a Q4_K_M q/k/v: q and k one
    run, v another). The parts' bytes are copied once."""
    weights = [w for part in parts for w in (part.parts if isinstance(part, PackedConcat) else [part.packed])]
    runs: list[list[PackedWeight]] = []  # neighbours of one kind become one run of rows
    for w in weights:
        if runs and runs[-1][0].kind == w.kind:
            runs[-1].append(w)
        else:
            runs.append([w])
    joined = [PackedWeight(run[0].kind, torch.cat([w.data for w in run]), run[0].in_features) for run in runs]
    return PackedLinear(joined[0]) if len(joined) == 1 else PackedConcat(joined)


def step_layout(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """What the one-call decode step (``ml/cpu/decode.cpp``) reads of a packed layer: its bytes
    (uint8, a ``PackedLinear``'s as (rows, row bytes), so that its first size counts its outputs
    as a weight's does), and its runs of rows as int64 (kind, rows) pairs, the kind as its place
    in ``PACKED_TYPES`` (the operator's order too)."""
    return layer.data, segment_pairs(layer.segments)


def segment_pairs(segments: tuple[tuple[str, int], ...]) -> torch.Tensor:
    """Runs of rows ``(kind, rows)`` as the operator reads them: int64 pairs, the kind as its place
    in ``PACKED_TYPES``."""
    return torch.tensor([v for kind, rows in segments for v in (PACKED_TYPES.index(kind), rows)], dtype=torch.int64)


class PackedEmbedding(nn.Module):
    """A token embedding kept in packed blocks: a lookup expands only the rows it reads, to float32
    values exactly ``dequantize``'s, so a quantized embedding costs its blocks' bytes rather than four
    bytes a value. A classifier tied to it is a ``PackedLinear`` over the same buffer."""

    def __init__(self, weight: PackedWeight) -> None:
        super().__init__()
        self.kind = weight.kind
        self.num_embeddings = weight.out_features
        self.embedding_dim = weight.in_features
        self.register_buffer("data", weight.data)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(self.kind, self.data, self.embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.data.index_select(0, ids.reshape(-1).to(self.data.device))
        return _dequantizer(self.kind)(rows.view(-1)).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"


def pack(kind: str, weight: torch.Tensor) -> PackedWeight:
    """A float (out, in) weight as ``kind`` blocks (``PACKABLE``), rounded as llama.cpp's reference
    quantizer rounds (``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref``): bit-equal to
    ``gguf.quants.quantize``."""
    if kind not in PACKABLE:
        raise ValueError(f"cannot pack {kind!r} weights (one of {', '.join(PACKABLE)})")
    if weight.dim() != 2:
        raise ValueError(f"a weight to pack is a matrix, not {tuple(weight.shape)}")
    out_features, in_features = weight.shape
    values, size = block_layout(kind)
    row_bytes(kind, in_features)  # whole blocks, or ValueError
    blocks = weight.detach().to(torch.float32).reshape(-1, values)
    if kind == "q8_0":
        d = blocks.abs().amax(dim=1, keepdim=True) / 127
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        codes = _round_half_away(blocks * inverse).to(torch.int8).view(torch.uint8)
    else:  # q4_0: the signed value of largest magnitude (the first such) maps to -8
        largest = torch.gather(blocks, 1, blocks.abs().argmax(dim=1, keepdim=True))
        d = largest / -8
        inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = torch.trunc(blocks * inverse + 8.5).clamp(0, 15).to(torch.uint8)
        codes = q[:, :16] | (q[:, 16:] << 4)
    scales = d.to(torch.float16).view(torch.uint8)
    data = torch.cat((scales, codes), dim=1).reshape(out_features, in_features // values * size)
    return PackedWeight(kind, data.contiguous(), in_features)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """Round to nearest, halves away from zero (C's roundf), as gguf's ``np_roundf`` does it."""
    a = v.abs()
    floored = torch.floor(a)
    return torch.sign(v) * (floored + torch.floor(2 * (a - floored)))
