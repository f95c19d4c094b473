"""What every checkpoint reader returns, and the checks that do not depend on the file format.

Weights are described, not copied, until the loader asks for them on the target device and dtype:
a reader returns memory-mapped tensors, or ``Deferred`` weights (a tensor split over Meta's
model-parallel shards, a Hugging Face q/k projection whose rows must be reordered) that are built
straight into their final tensor by ``realize``. The loader realises one weight at a time and then
gives the file pages it read back to the kernel (``release_pages``), so the peak is the model in
its target dtype plus one weight, whatever the file's dtype or shard count.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

from llama_chat.model.args import ModelArgs
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.json_files import first_sentence


class Deferred:
    """A weight that exists only as a recipe over memory-mapped source tensors."""

    shape: torch.Size
    dtype: torch.dtype

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    def realize(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def sources(self) -> Sequence[torch.Tensor]:
        raise NotImplementedError


class Concatenated(Deferred):
    """Model-parallel slices of one weight, joined along ``dim`` as they are copied to the target."""

    def __init__(self, name: str, parts: Sequence[torch.Tensor], dim: int, files: Sequence[str]) -> None:
        first = parts[0]
        for part, file in zip(parts[1:], files[1:]):
            same_rank = part.dim() == first.dim()
            if not same_rank or any(part.shape[d] != first.shape[d] for d in range(first.dim()) if d != dim):
                raise ModelLoadError(
                    f"{file}: tensor {name!r} has shape {_shape(part.shape)}, which cannot be joined along "
                    f"dimension {dim} with {files[0]}'s {_shape(first.shape)}"
                )
            if part.dtype != first.dtype:
                raise ModelLoadError(f"{file}: tensor {name!r} is {part.dtype}, {files[0]} has {first.dtype}")
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        self.shape = torch.Size(shape)
        self.dtype = first.dtype
        self.parts = list(parts)
        self.dim = dim

    def realize(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype, device=device)
        offset = 0
        for part in self.parts:
            out.narrow(self.dim, offset, part.shape[self.dim]).copy_(part)
            offset += part.shape[self.dim]
            release_pages(part)
        return out

    def sources(self) -> Sequence[torch.Tensor]:
        return self.parts


class Permuted(Deferred):
    """A q or k projection whose rows go from Hugging Face's rotary layout to Meta's while copied.

    See ``checkpoint_hf.hf_to_interleaved`` for why; this is the same reordering written into the
    target tensor directly, so the file's dtype is never copied on the host first.
    """

    def __init__(self, source: torch.Tensor, n_heads: int) -> None:
        rows, cols = source.shape
        if rows % n_heads or (rows // n_heads) % 2:
            raise ModelLoadError(f"q/k projection of shape ({rows}, {cols}) does not split into {n_heads} heads")
        self.source = source
        self.n_heads = n_heads
        self.shape = source.shape
        self.dtype = source.dtype

    def realize(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = self.shape
        half = rows // self.n_heads // 2
        out = torch.empty(self.shape, dtype=dtype, device=device)
        out.view(self.n_heads, half, 2, cols).copy_(self.source.view(self.n_heads, 2, half, cols).transpose(1, 2))
        return out

    def sources(self) -> Sequence[torch.Tensor]:
        return [self.source]


Weight = Union[torch.Tensor, Deferred]


def realize(weight: Weight, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` on ``device`` in ``dtype``, copied at most once; its file pages released after.

    A tensor already in place (a float32 file loaded as float32 on the CPU) is returned as it is:
    the parameter is then the memory map itself. Otherwise the file's dtype goes to the device
    first and is converted there, so a GPU never waits on a host-side conversion and the host
    never holds a converted copy.
    """
    if isinstance(weight, Deferred):
        out = weight.realize(device, dtype)
        for source in weight.sources():
            release_pages(source)
        return out
    if weight.device == device and weight.dtype == dtype:
        return weight
    out = weight.to(device=device)
    out = out.to(dtype=dtype)
    if out.data_ptr() != weight.data_ptr():
        release_pages(weight)
    return out


# --- giving read file pages back ---------------------------------------------------------------

_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_libc = None


def _file_mappings() -> list[tuple[int, int]]:
    """Address ranges of this process mapped from regular files (Linux), sorted."""
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def in_file_mapping(tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor's bytes lie in one memory-mapped file (Linux; elsewhere False)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return tensor.device.type == "cpu" and any(lo <= start and end <= hi for lo, hi in _file_mappings())


def _c_library() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc


def release_pages(tensor: torch.Tensor, *, file_mapped: bool = False) -> None:
    """Drop the pages of a memory-mapped CPU tensor from this process's resident set.

    Only for tensors that are views of a file mapping, whose pages the kernel can read again if
    they are ever touched; the data cannot change. Anything else (heap memory, other devices,
    systems without ``madvise``) is left alone. A no-op when nothing was resident.
    """
    if tensor.device.type != "cpu" or not sys.platform.startswith("linux") or not tensor.is_contiguous():
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = (start + _PAGE - 1) // _PAGE * _PAGE
    last = end // _PAGE * _PAGE
    if last <= first:
        return
    # ``file_mapped``: the caller made the tensor from a file mapping itself, so the (per call,
    # milliseconds long) look through /proc/self/maps is skipped: a GGUF weight releases its
    # pages once per chunk, hundreds of times per model.
    if not file_mapped and not in_file_mapping(tensor):
        return
    try:
        _c_library().madvise(first, last - first, _MADV_DONTNEED)
    except (OSError, AttributeError):
        pass


def release_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    Large tensors freed after a one-time copy (weights moved, repacked) stay in glibc's heap as
    free memory, and so in the resident set, unless the heap is trimmed.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        _c_library().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


@dataclass(frozen=True)
class Checkpoint:
    """Weights with Meta names and interleaved rotary layout, plus the architecture they describe.

    Tensors are views of memory-mapped files wherever the format allows, so nothing is read from
    disk until a tensor is used. ``origin`` names the file each tensor came from, for messages.
    """

    args: ModelArgs
    state: dict[str, Weight]
    origin: dict[str, str] = field(default_factory=dict)
    files: tuple[Path, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


def parameter_count(args: ModelArgs) -> int:
    """How many weights ``args`` describes, by arithmetic (no per-layer lists: n_layers may be 10**9)."""
    kv_dim = args.n_kv_heads * args.head_dim
    per_layer = (2 * args.dim * args.n_heads * args.head_dim + 2 * kv_dim * args.dim
                 + (3 if args.gated_ffn else 2) * args.hidden_dim * args.dim + 2 * args.dim)
    tables = 1 if args.tie_embeddings or args.encoder or args.pooled else 2
    embeddings = (args.vocab_size * tables + args.position_table + args.type_vocab_size) * args.dim
    return embeddings + args.n_layers * per_layer + args.dim


def check_claimed_size(args: ModelArgs, files: Sequence[Path], config: str) -> None:
    """Refuse a config whose model cannot fit in its weights files, before anything is sized by it.

    Each weight takes at least one byte in any format, so weights files smaller than the
    parameter count cannot hold the model: an absurd ``n_layers`` is caught here, in microseconds,
    instead of after listing a billion layers' shapes.
    """
    have = 0
    for path in files:
        try:
            have += os.stat(path).st_size
        except OSError:
            pass  # the reader reports a missing file with its own message
    need = parameter_count(args)
    if need > have:
        raise ModelLoadError(
            f"{config}: describes a model of {need:,} parameters, but its weights files hold only "
            f"{have:,} bytes"
        )


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must provide for ``args``, with its shape.

    A tied output projection is the embedding itself, so it is not expected separately.
    """
    kv_dim = args.n_kv_heads * args.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention.wq.weight"] = (args.n_heads * args.head_dim, args.dim)
        shapes[p + "attention.wk.weight"] = (kv_dim, args.dim)
        shapes[p + "attention.wv.weight"] = (kv_dim, args.dim)
        shapes[p + "attention.wo.weight"] = (args.dim, args.n_heads * args.head_dim)
        shapes[p + "feed_forward.w1.weight"] = (args.hidden_dim, args.dim)
        shapes[p + "feed_forward.w2.weight"] = (args.dim, args.hidden_dim)
        if args.gated_ffn:
            shapes[p + "feed_forward.w3.weight"] = (args.hidden_dim, args.dim)
        shapes[p + "attention_norm.weight"] = (args.dim,)
        shapes[p + "ffn_norm.weight"] = (args.dim,)
        if args.layer_norm:
            shapes[p + "attention_norm.bias"] = (args.dim,)
            shapes[p + "ffn_norm.bias"] = (args.dim,)
        if args.linear_biases:
            shapes[p + "attention.bo"] = (args.dim,)
            if not args.gated_ffn:
                shapes[p + "feed_forward.b1"] = (args.hidden_dim,)
                shapes[p + "feed_forward.b2"] = (args.dim,)
        if args.qkv_bias:
            shapes[p + "attention.bq"] = (args.n_heads * args.head_dim,)
            shapes[p + "attention.bk"] = (kv_dim,)
            shapes[p + "attention.bv"] = (kv_dim,)
        if args.qk_norm:
            shapes[p + "attention.q_norm.weight"] = (args.head_dim,)
            shapes[p + "attention.k_norm.weight"] = (args.head_dim,)
        if args.post_norms:
            shapes[p + "attention_post_norm.weight"] = (args.dim,)
            shapes[p + "ffn_post_norm.weight"] = (args.dim,)
    if args.position_table:
        shapes["pos_embeddings.weight"] = (args.position_table, args.dim)
    if args.type_vocab_size:
        shapes["type_embeddings.weight"] = (args.type_vocab_size, args.dim)
    norms = ["embedding_norm"] if args.norm_after_residual else ["norm"]
    for norm in norms:
        shapes[f"{norm}.weight"] = (args.dim,)
        if args.layer_norm:
            shapes[f"{norm}.bias"] = (args.dim,)
    if not args.tie_embeddings and not args.encoder and not args.pooled:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    if args.labels:
        shapes.update({"pooler.weight": (args.dim, args.dim), "pooler.bias": (args.dim,),
                       "classifier.weight": (args.labels, args.dim), "classifier.bias": (args.labels,)})
    return shapes


def check_state(ckpt: Checkpoint) -> dict[str, Weight]:
    """The state dict ``Transformer.load_state_dict(strict=True)`` will accept, or a clear error.

    Checked here rather than left to ``load_state_dict`` so the message is one line naming the
    tensor, its file, and the expected and found shapes.
    """
    want = expected_shapes(ckpt.args)
    state = dict(ckpt.state)
    if ckpt.args.tie_embeddings or ckpt.args.pooled:
        # Some writers store the tied projection anyway; it is the embedding, so drop it. A pooled
        # decoder's classifier, where its folder keeps one, is never read.
        state.pop("output.weight", None)
    default_origin = ckpt.files[0].name if ckpt.files else "checkpoint"
    for name, shape in want.items():
        tensor = state.get(name)
        where = ckpt.origin.get(name, default_origin)
        if tensor is None:
            raise ModelLoadError(f"{where}: missing tensor {name!r}")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"{where}: tensor {name!r} has shape {_shape(tensor.shape)}, expected {_shape(shape)}"
            )
        if not tensor.is_floating_point():
            raise ModelLoadError(f"{where}: tensor {name!r} has dtype {tensor.dtype}, expected a float type")
    extra = sorted(set(state) - set(want))
    if extra:
        where = ckpt.origin.get(extra[0], default_origin)
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelLoadError(f"{where}: unexpected tensor {extra[0]!r}{more}")
    return state


def config_error(file: str, e: Exception) -> ModelLoadError:
    """A config file's bad value as a one-line ModelLoadError naming the file."""
    if isinstance(e, ModelLoadError):
        message = str(e)
        return e if message.startswith(file) else ModelLoadError(f"{file}: {message}")
    return ModelLoadError(f"{file}: bad field value ({first_sentence(e)})")


def unreadable(path: Path, e: BaseException) -> ModelLoadError:
    """A weights file that its library refused: truncated, corrupt, or not that format at all."""
    return ModelLoadError(f"{path.name}: cannot read weights, the file is truncated or corrupt ({first_sentence(e)})")


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ")"


def torch_load(path: Path) -> dict[str, torch.Tensor]:
    """A ``torch.save``d dict of tensors, memory-mapped; tensors only, anything else dropped."""
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except RuntimeError as e:
        if "mmap can only be used" not in str(e):
            raise unreadable(path, e) from None
        # Files from before torch's zip format (torch < 1.6) cannot be mapped: read them whole.
        try:
            state = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e2:  # zip reader and unpickler raise assorted types for a damaged file
            raise unreadable(path, e2) from None
    except Exception as e:
        raise unreadable(path, e) from None
    return _as_mapping(state, path)


def _as_mapping(state: Mapping[str, Any], path: Path) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping):
        raise ModelLoadError(f"{path.name}: expected a dict of tensors, found {type(state).__name__}")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
