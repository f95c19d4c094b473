"""16-bit float weights (float16, bfloat16) under float32 arithmetic: how a GGUF file's F16 and BF16
matrices run on the CPU, as the file's own bytes through its memory map.

Expanded to float32 such a file would take twice its size; kept as they are, its weights take what
the file takes and a decode step reads half the bytes. The rest of the model stays float32 (norms,
activations, the KV cache), so a product here multiplies float32 rows by 16-bit weights:

* with the CPU operator loaded, any rows: a decode step's few read the 16-bit weights as they are
  (``ml/cpu/dot.h``), a prompt's many meet panels of them converted to float32 a few at a time in
  each thread's cache (``ml/cpu/kernels.cpp``);
* without it: tiles of ``TILE_VALUES`` weights converted to float32 and one float32 matrix
  product each (as ``packed.dequantized_product`` does with blocks), so the float32 copy is never
  more than a tile.

Numerics, either way: each 16-bit weight is converted exactly to float32 and the products are
summed in float32, so the result is ``x @ w.float().T`` up to the order of the float32 additions.

``HalfLinear`` and ``HalfEmbedding`` keep the weight as a buffer, not a parameter: a model's
parameters are then its float32 norms, which is what the engine reads the activations' dtype from
(as it does for packed layers). ``ops.linear`` sends a product of rows of another dtype here
(``mixed``), which is what a ``HalfLinear`` does too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llama_chat.ml.cpu import kernels as cpu_kernels

DTYPES = cpu_kernels.HALF_DTYPES
# Weight values converted at a time by ``tiled_product`` (32 MiB as float32): wide tiles, since the
# library's float32 product packs the rows again for each tile it is given.
TILE_VALUES = 1 << 23


def mixed(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight.T`` multiplies rows by 16-bit weights of another dtype (this module's)."""
    return weight.dtype in DTYPES and x.dtype != weight.dtype


def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.float().T`` for 16-bit ``weight`` (out, in) and any leading dimensions of ``x``,
    in ``x``'s dtype: through the operator, else ``tiled_product`` (see the module doc)."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {weight.shape[1]}")
    if cpu_kernels.takes(x, weight):
        return cpu_kernels.matvec(x, weight)
    rows = x.reshape(-1, weight.shape[1]).float()
    return tiled_product(rows, weight).to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def tiled_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 ``rows @ weight.float().T``, converting ``TILE_VALUES`` weights at a time. Each tile's
    products are made transposed, straight into whole rows of the result (no copy per tile)."""
    outputs = torch.empty(weight.shape[0], rows.shape[0], dtype=torch.float32, device=rows.device)
    tile = max(1, TILE_VALUES // max(weight.shape[1], 1))
    for start in range(0, weight.shape[0], tile):
        stop = min(weight.shape[0], start + tile)
        torch.mm(weight[start:stop].float(), rows.T, out=outputs[start:stop])
    return outputs.T.contiguous()


class HalfLinear(nn.Linear):
    """A bias-free linear layer over a 16-bit weight kept as it is (a buffer, never written: it may
    be a memory-mapped file's), for float32 inputs. A ``nn.Linear`` to code that replaces linear
    layers (``quantize.quantize_model``, ``quantize.pack_model``), which read its ``weight``."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dtype not in DTYPES or weight.dim() != 2:
            raise ValueError(f"a 16-bit weight is a float16 or bfloat16 matrix, not {weight.dtype} "
                             f"{tuple(weight.shape)}")
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(x, self.weight) if mixed(x, self.weight) else F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"


def fuse(parts: list[HalfLinear]) -> HalfLinear:
    """Layers' outputs side by side, as one layer over their weights' rows (copied once)."""
    return HalfLinear(torch.cat([part.weight for part in parts]))


class HalfEmbedding(nn.Module):
    """A token embedding kept in 16 bits: a lookup converts only the rows it reads, exactly, to
    float32 (the model's activations). A classifier tied to it is a ``HalfLinear`` over the same
    tensor."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.dtype not in DTYPES or weight.dim() != 2:
            raise ValueError(f"a 16-bit embedding is a float16 or bfloat16 matrix, not {weight.dtype} "
                             f"{tuple(weight.shape)}")
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("weight", weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight).float()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, dtype={self.weight.dtype}"
