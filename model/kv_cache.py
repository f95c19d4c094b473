"""A preallocated key/value cache indexed by token position, one slot of rows per sequence."""

from __future__ import annotations

import math
import mmap

import torch

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

    @classmethod
    def over(cls, tensors: tuple[list[torch.Tensor], list[torch.Tensor]]) -> KVCache:
        """A cache whose keys and values are the given tensors (views of another store)."""
        cache = cls.__new__(cls)
        cache.keys, cache.values = tensors
        cache.kv_type = of_dtype(cache.keys[0].dtype)
        cache.max_seq_len = cache.keys[0].shape[2]
        return cache

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
        if kind.quantized or kind.storage != k.dtype:
            stored_k, stored_v = self._store(cache_k, cache_v, kind.store(k, keys=True), kind.store(v, keys=False),
                                             positions, contiguous_from, kv_len)
            return (kind.load(stored_k, k.dtype, keys=True), kind.load(stored_v, v.dtype, keys=False))
        return self._store(cache_k, cache_v, k, v, positions, contiguous_from, kv_len)

    def _store(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, contiguous_from: int | None,
               kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq = positions.shape
        if contiguous_from is not None:
            cache_k[:batch, :, contiguous_from:contiguous_from + seq] = k
            cache_v[:batch, :, contiguous_from:contiguous_from + seq] = v
        elif batch == 1 and self.rows == 1:
            # One row at positions held on the device (a static step): no host read of them.
            # Written into the whole buffer, not a view of its row: inductor then writes in place,
            # where through a view it copied the layer's whole cache out and back every step.
            cache_k.index_copy_(2, positions[0], k)
            cache_v.index_copy_(2, positions[0], v)
        elif batch == 1:
            cache_k[0].index_copy_(1, positions[0], k[0])
            cache_v[0].index_copy_(1, positions[0], v[0])
        else:
            rows = torch.arange(batch, device=positions.device).unsqueeze(1).expand(batch, seq)
            # Advanced indices on dims 0 and 2 put (batch, seq) first: (batch, seq, heads, dim).
            cache_k[rows, :, positions] = k.transpose(1, 2)
            cache_v[rows, :, positions] = v.transpose(1, 2)
        return cache_k[:batch, :, :kv_len], cache_v[:batch, :, :kv_len]
