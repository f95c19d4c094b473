"""Key/value caches indexed by token position, each with the layout its forward attends by.

``KVCache`` is the dense, dynamic one: a preallocated row of slots per sequence, read up to the
furthest position a forward reaches (``DenseLayout``). ``WholeCache`` is one sequence's keys and
values of a fixed length, attended whole under a mask (``WholeCacheLayout``): a static step's, with
no host sync and the same shapes at every position. The paged pool's layout is its ``PagedView``
(``model/paged_kv_cache.py``); a forward without a cache attends among its own tokens
(``model/transformer.py``, ``OwnTokens``).
"""

from __future__ import annotations

import math
import mmap

import torch

from llama_chat.ml import ops
from llama_chat.model import interrupt
from llama_chat.model.kv_types import KVType, of_dtype


def mapped_zeros(shape: tuple[int, ...], *, device: torch.device | str,
                 dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A tensor of zeros that, on the CPU, takes memory only where it is written, and its mapping
    (None where it has none: another device, nothing to map).

    A cache is made for the whole context and a conversation seldom fills it. ``torch.zeros``
    writes every page; a fresh private anonymous mapping reads as zeros and is resident page by
    page as positions are written (like mlx-lm's cache, which grows as the positions come). Reading
    an unwritten page (a static step attends over the whole cache) maps the kernel's zero page.
    The mapping lets a paged cache give written pages back (``PagedKVCache.return_pages``).
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.zeros(shape, device=device, dtype=dtype), None
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    # The tensor holds the mapping: it is unmapped when the last view of it goes.
    return torch.frombuffer(mapping, dtype=dtype).view(shape), mapping


def zeros(shape: tuple[int, ...], *, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """``mapped_zeros``' tensor."""
    return mapped_zeros(shape, device=device, dtype=dtype)[0]


class KVCache:
    """Keys and values for every layer, shaped ``(rows, kv_heads, max_seq_len, row)``: a row is a
    position's ``head_dim`` values as its type keeps them (``kv_types``; ``dtype`` may name a float
    type by its torch dtype).

    Row ``b`` of a forward batch writes its keys at the positions it is given, so sequences of
    different lengths share one cache; reads return the first ``kv_len`` positions, enough for the
    furthest row, and the model's mask keeps each row to its own past. A type other than the
    model's own is read converted, those positions only; the CPU operator reads it in place.
    """

    def __init__(self, n_layers: int, rows: int, n_kv_heads: int, max_seq_len: int, head_dim: int,
                 *, device: torch.device | str = "cpu", dtype: torch.dtype | KVType = torch.float32) -> None:
        self.kv_type = dtype if isinstance(dtype, KVType) else of_dtype(dtype)
        self.kv_type.check(head_dim)
        shape = (rows, n_kv_heads, max_seq_len, self.kv_type.row_size(head_dim))
        storage = self.kv_type.storage
        self.keys = [zeros(shape, device=device, dtype=storage) for _ in range(n_layers)]
        self.values = [zeros(shape, device=device, dtype=storage) for _ in range(n_layers)]
        self.max_seq_len = max_seq_len

    @classmethod
    def for_model(cls, args, rows: int = 1, *, max_seq_len: int | None = None,
                  device: torch.device | str = "cpu", dtype: torch.dtype | KVType = torch.float32) -> KVCache:
        return cls(args.n_layers, rows, args.n_kv_heads, max_seq_len or args.max_seq_len,
                   args.head_dim, device=device, dtype=dtype)

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    def reorder(self, sources, length: int | None = None) -> None:
        """Row ``i`` becomes a copy of row ``sources[i]`` (positions below ``length``; None: all).

        Beam search calls it after every step: the beams that survive, fork into several, or
        replace those dropped take their predecessors' keys and values. ``[0] * rows`` copies
        one prefilled prompt into every row.
        """
        index = torch.as_tensor(sources, dtype=torch.long, device=self.keys[0].device)
        if index.numel() != self.rows:
            raise ValueError(f"reorder needs one source per row ({self.rows}), got {index.numel()}")
        if torch.equal(index, torch.arange(self.rows, device=index.device)):
            return
        end = self.max_seq_len if length is None else length
        for cached in (*self.keys, *self.values):
            cached[:, :, :end] = cached[index, :, :end]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               kv_len: int, contiguous_from: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` (``(batch, kv_heads, seq, head_dim)``) at ``positions`` (``(batch, seq)``).

        ``contiguous_from`` is the common first position when every row holds the same run of
        consecutive positions (the common single-prompt case): a slice write instead of a scatter.
        Returns the cached keys and values of positions ``[0, kv_len)`` for rows ``[0, batch)``.
        """
        batch, seq = positions.shape
        cache_k, cache_v = self.keys[layer], self.values[layer]
        kind = self.kv_type
        if _converted(kind, k.dtype):
            stored_k, stored_v = self._store(cache_k, cache_v, kind.store(k, keys=True), kind.store(v, keys=False),
                                             positions, contiguous_from, kv_len)
            return (kind.load(stored_k, k.dtype, keys=True), kind.load(stored_v, v.dtype, keys=False))
        return self._store(cache_k, cache_v, k, v, positions, contiguous_from, kv_len)

    def layout(self, positions: torch.Tensor) -> DenseLayout:
        """How a forward of rows at ``positions`` (``(batch, seq)``) writes and reads this cache.

        One host sync per forward: the positions decide how much of the cache is read.
        """
        batch, seq = positions.shape
        first = positions[:, 0]
        lo, hi = int(first.min()), int(positions.max())
        if hi >= self.max_seq_len:
            raise IndexError(f"position {hi} is past the cache length {self.max_seq_len}")
        same_run = lo == int(first.max()) and (
            seq == 1 or bool((positions == positions[:1, :1] + torch.arange(seq, device=positions.device)).all())
        )
        kv_len = hi + 1
        if same_run and seq == 1:
            mask = None  # every row is at the last cached position: all keys visible
        elif same_run and lo == 0:
            return DenseLayout(self, positions, None, kv_len, 0, causal=True)  # a fresh prefill
        else:
            keys = torch.arange(kv_len, device=positions.device)
            mask = (keys.view(1, 1, 1, kv_len) <= positions.view(batch, 1, seq, 1))
        return DenseLayout(self, positions, mask, kv_len, lo if same_run else None, causal=False)

    def _store(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, contiguous_from: int | None,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq = positions.shape
        if contiguous_from is not None:
            cache_k[:batch, :, contiguous_from:contiguous_from + seq] = k
            cache_v[:batch, :, contiguous_from:contiguous_from + seq] = v
        elif batch == 1:
            cache_k[0].index_copy_(1, positions[0], k[0])
            cache_v[0].index_copy_(1, positions[0], v[0])
        else:
            rows = torch.arange(batch, device=positions.device).unsqueeze(1).expand(batch, seq)
            # Advanced indices on dims 0 and 2 put (batch, seq) first: (batch, seq, heads, dim).
            cache_k[rows, :, positions] = k.transpose(1, 2)
            cache_v[rows, :, positions] = v.transpose(1, 2)
        return cache_k[:batch, :, :kv_len], cache_v[:batch, :, :kv_len]


def _converted(kind: KVType, dtype: torch.dtype) -> bool:
    """Whether keys of ``dtype`` are stored as another type and read back converted."""
    return kind.quantized or kind.storage != dtype


class DenseLayout:
    """A forward over a ``KVCache``: each row's keys written at its positions, then attention over
    the first ``kv_len`` slots, under ``mask`` (None: every key visible, or ``causal`` for a fresh
    prefill's own keys). ``contiguous_from``: the common first position of rows that all hold the
    same run of positions (a slice write, and a long run may go in pieces), else None."""

    row_products = False

    def __init__(self, cache: KVCache, positions: torch.Tensor, mask: torch.Tensor | None, kv_len: int,
                 contiguous_from: int | None, *, causal: bool) -> None:
        self.cache = cache
        self.positions = positions
        self.mask = mask
        self.kv_len = kv_len
        self.contiguous_from = contiguous_from
        self.causal = causal

    @property
    def one_run(self) -> bool:
        """Whether every row holds the same run of positions (a forward that may go in pieces)."""
        return self.contiguous_from is not None

    def piece(self, start: int, stop: int) -> DenseLayout:
        """The layout of the forward's tokens ``[start, stop)``, once those before are cached."""
        return self.cache.layout(self.positions[:, start:stop])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rule: ops.AttentionRule = ops.PLAIN_ATTENTION) -> torch.Tensor:
        k, v = self.cache.update(layer, k, v, self.positions, self.kv_len, self.contiguous_from)
        if not rule.plain:  # keys sit at their slots' positions, from 0
            seen = ops.visible_keys(self.positions, torch.arange(k.shape[2], device=k.device), rule.window)
            return ops.ruled_attention(q, k, v, seen, rule)
        return ops.attention(q, k, v, self.mask, causal=self.causal)

    def between_layers(self) -> None:
        interrupt.check()  # a long prefill stops soon after a cancel


class WholeCache:
    """One sequence's keys and values, per layer ``(1, kv_heads, length, row)`` (views of another
    store: a lone job's pages, ``PagedKVCache.slice_views``), attended whole under a mask: the
    cache of a step compiled once and replayed at every position (``inference/decode_step.py``).

    ``row_products``: the projections spelled out for the compiler (``ops.linear``).
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], *, row_products: bool = False) -> None:
        self.keys, self.values = keys, values
        self.kv_type = of_dtype(keys[0].dtype)
        self.row_products = row_products

    @property
    def length(self) -> int:
        """The slots attended over; read from the tensors, where a compiler sees a symbolic size."""
        return self.keys[0].shape[2]

    def layout(self, positions: torch.Tensor) -> WholeCacheLayout:
        return WholeCacheLayout(self, positions)


class WholeCacheLayout:
    """A forward over a ``WholeCache``: every row attends over all its slots, masked to its own
    past. Built from device tensors alone, with shapes that do not depend on the positions."""

    def __init__(self, cache: WholeCache, positions: torch.Tensor) -> None:
        batch, seq = positions.shape
        capacity = cache.length
        self.cache = cache
        self.positions = positions
        self.keys = torch.arange(capacity, device=positions.device)
        self.mask = self.keys.view(1, 1, 1, capacity) <= positions.view(batch, 1, seq, 1)
        self.row_products = cache.row_products

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rule: ops.AttentionRule = ops.PLAIN_ATTENTION) -> torch.Tensor:
        cache = self.cache
        cache_k, cache_v = cache.keys[layer], cache.values[layer]
        kind = cache.kv_type
        converted = _converted(kind, k.dtype)
        # Written into the whole buffer at positions held on the device (no host read of them),
        # not into a view of its row: inductor then writes in place, where through a view it
        # copied the layer's whole cache out and back every step.
        cache_k.index_copy_(2, self.positions[0], kind.store(k, keys=True) if converted else k)
        cache_v.index_copy_(2, self.positions[0], kind.store(v, keys=False) if converted else v)
        keys, values = cache_k, cache_v
        if converted:
            keys, values = kind.load(cache_k, k.dtype, keys=True), kind.load(cache_v, v.dtype, keys=False)
        if not rule.plain:
            seen = ops.visible_keys(self.positions, self.keys, rule.window)
            return ops.ruled_attention(q, keys, values, seen, rule)
        return ops.attention_over_cache(q, keys, values, self.mask)

    def between_layers(self) -> None:
        """Nothing: a compiled step makes no host calls."""
