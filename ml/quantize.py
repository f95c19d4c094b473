"""Weight-only int8: per-output-channel symmetric scales, made once when the model is loaded.

The API other modules use:

* ``quantize_int8(weight) -> Int8Weight``: a float ``(out, in)`` matrix to int8 values and one
  float32 scale per output row (``scale = max|row| / 127``, ``q = round(w / scale)``).
* ``Int8Linear``: a bias-free linear layer holding an ``Int8Weight`` as buffers (``weight`` int8,
  ``scales`` float). ``Int8Linear.from_float(weight)`` and ``Int8Linear(Int8Weight)`` build one.
  A checkpoint that already holds int8 values with scales (a GGUF ``Q8_0`` tensor, 32 values per
  scale) is dequantized to float and requantized per row: ``Int8Linear.from_float(dequantized)``.
  The extra rounding is below the format's own (one row's largest value sets its scale).
* ``int8_linear(x, weight, scales, row_products=False)``: ``x @ (weight * scales[:, None]).T``.
* ``quantize_model(model)``: every projection of a ``Transformer`` (and its classifier) replaced by
  an ``Int8Linear`` in place; the embedding stays in float (one row of it is read per token).
* ``pack_model(model, kind)``: the same with llama.cpp's Q8_0 or Q4_0 blocks (``ml/packed.py``).
* ``QUANTIZE_MODES``: the values ``--quantize`` accepts.

Decoding reads every weight once per token, so a weight in one byte instead of four (or two) is
read in a quarter (a half) of the time, as long as the kernel that does the product reads the int8
values directly. On x86 without AVX-512 fbgemm's int8 product (``quantized::linear_dynamic``)
does, for one row and for a prefill chunk alike; ``_weight_int8pack_mm`` (tuned for AVX-512 and
AMX) and a compiled multiply-and-sum (the conversion is not vectorised) are slower than float32
there (docs/architecture.md, "On the CPU"). So:

* a product of at most ``cpu_kernels.MAX_INT8_ROWS`` rows on the CPU (a decode step), eager or
  compiled, is our own operator's (``cpu_kernels``) when it is loaded: it multiplies the int8
  values by activations rounded to 2^-14 of their largest, without fbgemm's per-call cost, and
  the compiler can trace it;
* otherwise, on a CPU with fbgemm (x86), every product is fbgemm's, on a copy of the weight
  packed once for it; ``x`` is quantized to 7 bits per call, 64 rows of similar magnitude at most,
  with their own range (``reduce_range``: AVX2's 16-bit accumulation would saturate with 8). The shipped model's
  validation perplexity moves by a few hundredths of a percent with it
  (``scripts/evaluate_quantized.py``);
* elsewhere, by the rows of ``x``: fewer than ``DEQUANTIZE_FROM_ROWS`` (a decode step) on the CPU
  or MPS, ``_weight_int8pack_mm``; more, or on CUDA, the weight converted to ``x``'s dtype and
  the BLAS matrix product (the activations are not rounded at all there);
* ``row_products`` (a compiled step) spells the product out for the compiler; correct everywhere,
  fast only where the compiler vectorises the conversion (the fbgemm product cannot be traced).
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from llama_chat.ml import packed
from llama_chat.ml.controls import QUANTIZE_MODES  # defined with the other choices, torch-free
from llama_chat.ml.cpu import kernels as cpu_kernels

# Rows per fbgemm call (they share one activation range, so rows are sorted by magnitude first):
# fewer calls save fbgemm's per-call cost, similar rows keep the range fine (docs/benchmarks.md,
# "int8 quality").
FBGEMM_BLOCK_ROWS = 64
# Without fbgemm: below this many rows a product is matrix-vector-like and reads the weights once
# either way; the int8 kernel then wins. Above it the float matrix product's blocking pays for the
# conversion.
DEQUANTIZE_FROM_ROWS = 8


@dataclass(frozen=True)
class Int8Weight:
    """int8 values ``(out, in)`` and float32 scales ``(out,)``: ``w ~= values * scales[:, None]``."""

    values: torch.Tensor
    scales: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.values.to(dtype) * self.scales.to(dtype).unsqueeze(1)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-row int8 of a 2-D float weight; an all-zero row gets scale 0 and stays zero."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    values = torch.round(w / scales.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1))
    return Int8Weight(values.clamp(-127, 127).to(torch.int8).contiguous(), scales.contiguous())


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def pack_for_fbgemm(quantized: Int8Weight):
    """The weight as fbgemm's packed int8 operand (the same int8 values and scales)."""
    rows = quantized.values.shape[0]
    # PyTorch warns that quantized tensor types are deprecated; this one only carries the int8
    # values and scales into the packing call and is dropped.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        q = torch._make_per_channel_quantized_tensor(
            quantized.values, quantized.scales.double(), torch.zeros(rows, dtype=torch.long), 0)
    return torch.ops.quantized.linear_prepack(q, None)


def fbgemm_rows(rows: torch.Tensor, packed) -> torch.Tensor:
    """fbgemm's product of float32 ``rows`` with a packed weight, ``FBGEMM_BLOCK_ROWS`` rows per
    call: each call rounds its rows to 7 bits with one range. Rows go to the calls in the order
    of their largest magnitude, so a row of much larger values (the first token of a prompt often
    is one) shares its range with the rows most like it, not with its neighbours."""
    if rows.shape[0] <= FBGEMM_BLOCK_ROWS:
        return torch.ops.quantized.linear_dynamic(rows, packed, True)
    order = rows.abs().amax(dim=1).argsort()
    products = torch.cat([torch.ops.quantized.linear_dynamic(block, packed, True)
                          for block in rows.index_select(0, order).split(FBGEMM_BLOCK_ROWS)])
    return torch.empty_like(products).index_copy_(0, order, products)


# fbgemm's packed weights by key. A compiled step calls the product through the custom op below,
# which the compiler keeps as one opaque call; the packed object itself cannot be traced, so the
# graph holds the key, a constant.
_PACKED: dict[int, object] = {}
_keys = itertools.count(1)


@torch.library.custom_op("llama_chat::fbgemm_int8_linear", mutates_args=())
def fbgemm_int8_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """fbgemm's int8 product with the weight packed under ``key`` (what the eager path calls)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    out = fbgemm_rows(rows, _PACKED[key]).to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


@fbgemm_int8_linear.register_fake
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                row_products: bool = False, packed=None, packed_key: int | None = None) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T`` for an int8 ``weight`` ``(out, in)``; result in ``x``'s dtype.

    ``packed`` is ``pack_for_fbgemm``'s copy of the same weight, used for every product on the CPU.
    ``row_products`` is for a compiled step only (as ``ops.linear``'s): run eagerly it would
    materialise a weight-sized float product.
    """
    if cpu_kernels.takes(x, weight):
        return cpu_kernels.matvec(x, weight, scales)
    if row_products:
        if packed_key is not None and x.device.type == "cpu":
            return torch.ops.llama_chat.fbgemm_int8_linear(x, packed_key, weight.shape[0])
        return ((x.unsqueeze(-2) * weight).sum(-1) * scales).to(x.dtype)
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)
    if packed is not None and x.device.type == "cpu":
        out = fbgemm_rows(rows.float(), packed).to(x.dtype)
    elif x.device.type in ("cpu", "mps") and rows.shape[0] < DEQUANTIZE_FROM_ROWS:
        out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), weight, scales.to(x.dtype))
    else:
        # Many rows, or a device without the weight-only kernel (CUDA): convert and multiply; a
        # compiled CUDA step fuses the conversion into its one-row reduction.
        out = torch.nn.functional.linear(rows, weight.to(x.dtype)) * scales.to(x.dtype)
    return out.reshape(*lead, weight.shape[0])


class Int8Linear(nn.Module):
    """A bias-free linear layer with int8 weights and per-row scales (kept as buffers)."""

    def __init__(self, quantized: Int8Weight) -> None:
        super().__init__()
        self.out_features, self.in_features = quantized.values.shape
        self.register_buffer("weight", quantized.values)
        # Scales stay float32 whatever dtype the model is cast to: their rounding would add to
        # the int8 rounding, and they are a 1/in_features part of the bytes.
        self.register_buffer("scales", quantized.scales)
        # fbgemm's packed copy (about the int8 bytes again): the fast one-row product on x86.
        self.packed = pack_for_fbgemm(quantized) if quantized.values.device.type == "cpu" and fbgemm_available() else None
        self.packed_key: int | None = None  # its key in _PACKED, for a compiled step
        if self.packed is not None:
            self.packed_key = next(_keys)
            _PACKED[self.packed_key] = self.packed

    def repack(self) -> None:
        """Pack fbgemm's copy again, from the weight as it is now: the packed copy keeps the int8
        values it was made from alive, so after the weight moves (``cpu_decode`` puts it on
        large pages) the old values would stay in memory beside the new."""
        if self.packed is not None:
            self.packed = pack_for_fbgemm(Int8Weight(self.weight, self.scales))
            _PACKED[self.packed_key] = self.packed

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> Int8Linear:
        return cls(quantize_int8(weight))

    def _apply(self, fn, recurse=True):
        scales = self.scales
        out = super()._apply(fn, recurse)
        if out.scales.dtype != torch.float32:  # a cast of the model: keep the scales float32
            out.scales = scales.to(out.scales.device)
        if out.weight.device.type != "cpu":
            out.packed = out.packed_key = None
        return out

    def forward(self, x: torch.Tensor, row_products: bool = False) -> torch.Tensor:
        return int8_linear(x, self.weight, self.scales, row_products, self.packed, self.packed_key)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def fused(parts: list[Int8Linear]) -> Int8Linear:
    """Several int8 layers' outputs side by side: per-row scales make this a concatenation."""
    return Int8Linear(Int8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scales for p in parts])))


def quantize_model(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``model`` by an ``Int8Linear``, in place; returns how many.

    A classifier tied to the embedding gets an int8 copy of it and the embedding stays float: the
    lookup reads one row per token, the classifier reads all of them.
    """
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                if child.bias is not None:
                    raise ValueError(f"{name}: int8 layers have no bias")
                setattr(parent, name, Int8Linear.from_float(child.weight))
                replaced += 1
    return replaced


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model``'s projections are int8 or packed blocks (``ml/packed.py``)."""
    return any(isinstance(m, (Int8Linear, *packed.PACKED_LAYERS)) for m in model.modules())


def apply_quantization(model: nn.Module, mode: str) -> bool:
    """Quantize ``model`` in place as ``mode`` asks (``QUANTIZE_MODES``), once however many
    engines share it; returns whether its projections are int8 or packed now. (The loader
    quantizes as it loads; this is for a model built otherwise.)"""
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"unknown quantization {mode!r}")
    if mode != "none" and not is_quantized(model):
        model.fuse_projections()  # per-row scales, blocks within a row: fusing first costs nothing
        if mode == "int8":
            quantize_model(model)
        else:
            pack_model(model, mode)
    return is_quantized(model)


def pack_model(model: nn.Module, kind: str) -> int:
    """Replace every ``nn.Linear`` under ``model`` whose rows are whole blocks by a ``PackedLinear``
    of ``kind`` (``packed.PACKABLE``), in place, as ``quantize_model`` does for int8; returns how many."""
    values, _ = packed.block_layout(kind)
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None and child.in_features % values == 0:
                setattr(parent, name, packed.PackedLinear(packed.pack(kind, child.weight)))
                replaced += 1
    return replaced
