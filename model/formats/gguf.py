"""GGUF files (llama.cpp, Ollama, LM Studio): metadata, tensors and their dequantization.

The header is parsed by ``gguf_header.py`` (why not with ``GGUFReader``: see there), with the
``gguf`` package's type tables, imported only when a GGUF file is opened. Metadata values are
plain Python values, checked as they are used; tensor data is mapped once with ``torch.from_file``
(a private mapping: nothing done to a tensor can reach the file) and every weight is a view of
that mapping, so nothing is read until a weight is realised. F32 weights loaded as float32 on the
CPU are the mapping itself; F16/BF16 matrices are either kept as the file's 16-bit values
(``Converted.kept``: the loader's default on the CPU, for ``ml/half.py``'s layers) or converted
per tensor; block-quantized weights are either kept as the file's blocks (``Dequantized.packed``:
the loader's default on the CPU for the kinds ``ml/packed.py`` multiplies) or expanded row chunk
by row chunk straight into their final tensor (``Dequantized.realize``), so the peak beyond the
model is one chunk.

Rotary layout: for ``llama`` files llama.cpp's converter permutes Hugging Face's q/k rows back
into Meta's interleaved order (its ``LlamaModel.permute``), which is the order our model uses, so
those q/k rows need no change. The other families' files keep the halves order that llama.cpp
rotates as NEOX; their q/k rows (biases and head norms too) are put in pairs at load
(``families.interleave_order``). The parity tests write GGUF files as the converter does from a
Hugging Face checkpoint, so a mistake here shows as different logits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llama_chat.ml.ops import LinearRope, LongRope, RopeScaling, rope_frequencies
from llama_chat.ml.packed import PACKED_TYPES, PackedWeight
from llama_chat.model.args import MAX_SIZE, ModelArgs
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.families import GGUF_ARCHITECTURES, FAMILIES, Family, check_fused, interleave_order, rotated_heads
from llama_chat.model.formats.common import (
    Checkpoint,
    Deferred,
    Weight,
    config_error,
    parameter_count,
    release_pages,
)
from llama_chat.model.formats.gguf_header import MAGIC, read_header
from llama_chat.model.tensor_names import GGUF
from llama_chat.model.pooling import Pooling, Ranking
from llama_chat.ml.blocks import (
    BLOCKS,
    PLAIN,
    SMALLEST_BYTES_PER_VALUE,
    BlockFormat,
    supported_type_names,
)

ARCHITECTURES = GGUF_ARCHITECTURES
# Values dequantized at a time (4 Mi: 16 MiB as float32): bounds the temporaries of a large
# embedding, and how much of the file is resident before its pages are given back.
CHUNK_VALUES = 1 << 22

ROPE_FREQS = "rope_freqs.weight"
# Phi-3's LongRoPE divisors, read into args.rope_scaling.
LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"
_READ_INTO_ARGS = (ROPE_FREQS, LONG_FACTORS, SHORT_FACTORS)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: where its bytes are and what they hold."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order (rows first): GGUF lists dimensions innermost first
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFContents:
    """A parsed GGUF file: its metadata as Python values and its tensors' places."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, TensorInfo]
    file_size: int

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else None


def is_gguf(path: Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


def open_gguf(path: Path) -> GGUFContents:
    """Parse ``path``'s header; ModelLoadError (one line, naming the file) if it is not usable GGUF."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    header = read_header(path)
    size = path.stat().st_size
    tensors = {}
    for t in header.tensors:
        try:
            block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{path.name}: tensor {t.name!r:.80} has unknown type {t.ggml_type}") from None
        if t.dims[0] % block_values:
            raise ModelLoadError(f"{path.name}: tensor {t.name!r:.80} has rows of {t.dims[0]} values, not a "
                                 f"multiple of its type's blocks of {block_values}")
        numel = math.prod(t.dims)
        info = TensorInfo(name=t.name, ggml_type=t.ggml_type, shape=tuple(reversed(t.dims)),
                          offset=header.data_offset + t.offset, nbytes=numel // block_values * block_bytes)
        if info.offset + info.nbytes > size:
            raise ModelLoadError(f"{path.name}: truncated: tensor {info.name!r:.80} ends at byte "
                                 f"{info.offset + info.nbytes:,}, the file has {size:,}")
        tensors[t.name] = info
    return GGUFContents(path=path, metadata=header.metadata, tensors=tensors, file_size=size)


# --- typed metadata access ------------------------------------------------------------------


def meta_int(contents: GGUFContents, key: str, default: int | None = None) -> int:
    value = contents.metadata.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{contents.path.name}: missing metadata {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelLoadError(f"{contents.path.name}: metadata {key!r} must be an integer, found {value!r:.60}")
    return value


def meta_float(contents: GGUFContents, key: str, default: float | None = None) -> float:
    value = contents.metadata.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(f"{contents.path.name}: missing metadata {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelLoadError(f"{contents.path.name}: metadata {key!r} must be a finite number, found {value!r:.60}")
    return float(value)


def meta_str(contents: GGUFContents, key: str) -> str | None:
    value = contents.metadata.get(key)
    if value is not None and not isinstance(value, str):
        raise ModelLoadError(f"{contents.path.name}: metadata {key!r} must be a string, found {type(value).__name__}")
    return value


# --- the checkpoint -------------------------------------------------------------------------


def read_gguf(contents: GGUFContents, *, tokenizer_vocab: int | None = None) -> Checkpoint:
    """ModelArgs and Meta-named weights (views of the file mapping, or ``Dequantized``)."""
    name = contents.path.name
    arch = contents.architecture
    family = next((f for f in FAMILIES if f.gguf_arch == arch), None)
    if family is None:
        raise ModelLoadError(f"{name}: architecture {arch!r:.60} is not supported "
                             f"(expected one of {', '.join(ARCHITECTURES)})")
    args = _args(contents, tokenizer_vocab, family)
    for info in contents.tensors.values():
        tensor_format(info, name)  # a type not read here is named before sizes are compared
    # No file can be smaller than its model in the most compact type read here (Q2_K).
    need = int(parameter_count(args) * SMALLEST_BYTES_PER_VALUE)
    if need > contents.file_size:
        raise ModelLoadError(f"{name}: describes a model of {parameter_count(args):,} parameters, but the file "
                             f"holds only {contents.file_size:,} bytes")
    data = torch.from_file(str(contents.path), shared=False, size=contents.file_size, dtype=torch.uint8)
    state: dict[str, Weight] = {}
    for info in contents.tensors.values():
        if info.name in _READ_INTO_ARGS:
            continue  # read into args.rope_scaling by _args
        if info.name == "cls.output.weight" and args.pooled:
            continue  # a decoder reranker's "yes" and "no" rows: read by gguf_decoder_ranking
        meta = family.names.ours(info.name, GGUF)
        if meta is None:
            raise ModelLoadError(f"{name}: unexpected tensor {info.name!r:.80}")
        weight = tensor_view(data, info, name)
        parts = check_fused(meta, info.shape[0], args, name) if len(info.shape) == 2 else None
        pieces = [(meta, weight)] if parts is None else _split_rows(meta, weight, parts)
        for piece_name, piece in pieces:
            if piece_name in state:  # "blk.1" and "blk.01" name the same layer
                raise ModelLoadError(f"{name}: tensor {info.name!r:.80} names {piece_name!r} a second time")
            state[piece_name] = _in_pairs(piece_name, piece, args) if family.gguf_halves else piece
    return Checkpoint(args=args, state=state, origin={k: name for k in state}, files=(contents.path,))


def _split_rows(meta: str, weight: Weight, parts: tuple[tuple[str, int], ...]) -> list[tuple[str, Weight]]:
    """A fused tensor's parts (Phi-3's q/k/v, gate/up), each a view of its rows in the file."""
    layer = meta.split(".attention.")[0] if ".attention." in meta else meta.split(".feed_forward.")[0]
    pieces, start = [], 0
    for part, rows in parts:
        pieces.append((f"{layer}.{part}", _rows(weight, start, start + rows)))
        start += rows
    return pieces


def _rows(weight: Weight, start: int, end: int) -> Weight:
    if isinstance(weight, Dequantized):
        raw = weight.raw[start * weight.row_bytes:end * weight.row_bytes]
        return Dequantized(raw, (end - start, *weight.shape[1:]), weight.fmt)
    if isinstance(weight, Converted):
        return Converted(weight.source[start:end])
    return weight[start:end]


def _in_pairs(meta: str, weight: Weight, args: ModelArgs) -> Weight:
    """A NEOX file's q/k rows, biases and head norms in the pairs our rotary takes (a copy of
    these few tensors; every other weight stays the file's mapping)."""
    n = rotated_heads(meta, args)
    rows = weight.shape[0]
    if n is None or rows % (2 * n):
        return weight  # not rotated, or a shape the check names
    order = interleave_order(rows, n)
    if isinstance(weight, Dequantized):
        raw = weight.raw.view(weight.rows, weight.row_bytes)[order].reshape(-1)
        return Dequantized(raw, tuple(weight.shape), weight.fmt)
    if isinstance(weight, Converted):
        return Converted(weight.source[order])
    return weight[order]


def tensor_view(data: torch.Tensor, info: TensorInfo, file: str) -> Weight:
    """A weight over the file mapping ``data``: a typed view, or a ``Dequantized`` recipe."""
    raw = data[info.offset:info.offset + info.nbytes]
    if not info.shape or any(d <= 0 or d > MAX_SIZE * 16 for d in info.shape):
        raise ModelLoadError(f"{file}: tensor {info.name!r} has shape {info.shape}")
    fmt = tensor_format(info, file)
    if isinstance(fmt, torch.dtype):
        size = torch.empty((), dtype=fmt).element_size()
        if info.offset % size:
            raise ModelLoadError(f"{file}: tensor {info.name!r} is not aligned to its {size}-byte elements")
        view = raw.view(fmt).view(info.shape)
        return view if fmt == torch.float32 else Converted(view)
    if info.shape[-1] % fmt.block_values:
        raise ModelLoadError(f"{file}: tensor {info.name!r} has rows of {info.shape[-1]} values, not a multiple of "
                             f"{fmt.name}'s blocks of {fmt.block_values}")
    return Dequantized(raw, info.shape, fmt)


def tensor_format(info: TensorInfo, file: str) -> torch.dtype | BlockFormat:
    """The dtype of a plain tensor or the block format of a quantized one; ModelLoadError naming the
    tensor and its type when it is neither."""
    if info.ggml_type in PLAIN:
        return PLAIN[info.ggml_type]
    fmt = BLOCKS.get(info.ggml_type)
    if fmt is None:
        raise ModelLoadError(f"{file}: tensor {info.name!r} has type {_type_name(info.ggml_type)}, which is not "
                             f"supported (expected {supported_type_names()})")
    return fmt


def _type_name(ggml_type: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"#{ggml_type}"


class Dequantized(Deferred):
    """A block-quantized weight, expanded to its target dtype and device a chunk of rows at a time,
    or kept as the file's blocks (``packed``).

    The bytes of each chunk go to the device first and are expanded there (so on a GPU the work
    is the GPU's, and the host never holds a float copy), then written into the final tensor; the
    chunk's file pages are released after.
    """

    def __init__(self, raw: torch.Tensor, shape: tuple[int, ...], fmt: Any) -> None:
        self.raw = raw
        self.fmt = fmt
        self.shape = torch.Size(shape)
        self.dtype = torch.float32  # what the loader may assume for sizes; the source is smaller
        cols = shape[-1]
        self.rows = math.prod(shape[:-1])
        self.row_bytes = cols // fmt.block_values * fmt.block_bytes
        if self.rows * self.row_bytes != raw.numel():
            raise ModelLoadError(f"tensor of shape {tuple(shape)} needs {self.rows * self.row_bytes} bytes of "
                                 f"{fmt.name}, found {raw.numel()}")

    @property
    def kind(self) -> str:
        """The block type's name as ``ml/packed.py`` spells it: ``q4_k``."""
        return self.fmt.name.lower()

    def packed(self) -> PackedWeight | None:
        """The matrix as its blocks where they lie in the file (a view of the mapping: nothing is
        copied or read until a product touches it), when ``ml/packed.py`` multiplies its kind as
        it is; else None."""
        if len(self.shape) != 2 or self.kind not in PACKED_TYPES:
            return None
        return PackedWeight(self.kind, self.raw.view(self.rows, self.row_bytes), self.shape[1])

    def realize(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=dtype, device=device)
        flat = out.view(self.rows, -1)
        step = max(1, CHUNK_VALUES // self.shape[-1])
        rows = self.raw.view(self.rows, self.row_bytes)
        for start in range(0, self.rows, step):
            chunk = rows[start:start + step]
            target = flat[start:start + chunk.shape[0]]
            if dtype == torch.float32:  # expanded in place: no float temporaries at all
                self.fmt.dequantize(chunk.to(device).reshape(-1), out=target)
            else:
                target.copy_(self.fmt.dequantize(chunk.to(device).reshape(-1)).view(chunk.shape[0], -1))
            release_pages(chunk, file_mapped=True)
        return out

    def sources(self) -> list[torch.Tensor]:
        return []  # realize gave each chunk's pages back already


class Converted(Deferred):
    """An F16/BF16 weight, converted a chunk of rows at a time straight into its final tensor, or
    kept as the file's values (``kept``).

    Like ``Dequantized``: each chunk's file pages are given back once copied, so a float16 file
    loaded as float32 costs the float32 model plus one chunk, not the file as well.
    """

    def __init__(self, source: torch.Tensor) -> None:
        self.source = source
        self.shape = source.shape
        self.dtype = source.dtype

    def kept(self) -> torch.Tensor | None:
        """The matrix as the file's 16-bit values where they lie (a view of the mapping: nothing is
        copied or read until a product touches it), for ``ml/half.py``'s layers; None for a tensor
        that is not a matrix."""
        return self.source if self.source.dim() == 2 else None

    def realize(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if device.type == "cpu" and dtype == self.dtype:
            return self.source  # the file mapping itself, as for float32
        out = torch.empty(self.shape, dtype=dtype, device=device)
        rows = self.source.view(-1, self.shape[-1])
        flat = out.view(rows.shape)
        step = max(1, CHUNK_VALUES // self.shape[-1])
        for start in range(0, rows.shape[0], step):
            chunk = rows[start:start + step]
            flat[start:start + chunk.shape[0]].copy_(chunk.to(device))
            release_pages(chunk, file_mapped=True)
        return out

    def sources(self) -> list[torch.Tensor]:
        return []  # realize gave each chunk's pages back already


def _args(contents: GGUFContents, tokenizer_vocab: int | None, family: Family) -> ModelArgs:
    name = contents.path.name
    arch = contents.architecture
    embedding = contents.tensors.get("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{name}: missing tensor 'token_embd.weight'")
    if family.name == "bert":
        return _bert_args(contents, embedding)
    if family.name == "nomic-bert":
        return _nomic_bert_args(contents, embedding)
    vocab = contents.metadata.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = embedding.shape[0] if len(embedding.shape) == 2 else tokenizer_vocab
    n_heads = meta_int(contents, f"{arch}.attention.head_count")
    try:
        args = ModelArgs(
            dim=meta_int(contents, f"{arch}.embedding_length"),
            n_layers=meta_int(contents, f"{arch}.block_count"),
            n_heads=n_heads,
            n_kv_heads=meta_int(contents, f"{arch}.attention.head_count_kv", n_heads),
            vocab_size=vocab if isinstance(vocab, int) else meta_int(contents, f"{arch}.vocab_size"),
            hidden_dim=meta_int(contents, f"{arch}.feed_forward_length"),
            norm_eps=meta_float(contents, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=meta_float(contents, f"{arch}.rope.freq_base", 10000.0),
            max_seq_len=meta_int(contents, f"{arch}.context_length", 2048),
            tie_embeddings="output.weight" not in contents.tensors,
            head_size=_head_size(contents, arch),
            **_switches(contents, arch, family),
        )
    except ModelLoadError as e:
        raise config_error(name, e) from None
    rope_dims = contents.metadata.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != args.head_dim:
        raise ModelLoadError(f"{name}: metadata '{arch}.rope.dimension_count' is {rope_dims!r:.40}, expected the "
                             f"head dimension {args.head_dim} (partial rotary embeddings are not supported)")
    scaling_type = meta_str(contents, f"{arch}.rope.scaling.type")
    factor = meta_float(contents, f"{arch}.rope.scaling.factor", 1.0)
    scaling: RopeScaling | LinearRope | LongRope | None = None
    if scaling_type == "linear" and factor != 1.0:
        scaling = LinearRope(factor)
    elif scaling_type not in (None, "none", "linear") and factor != 1.0:
        raise ModelLoadError(f"{name}: rope scaling {scaling_type!r:.40} is not supported (expected linear)")
    scaling = scaling or _rope_scaling(contents, args) or _long_rope(contents, args)
    if scaling is not None:
        from dataclasses import replace

        try:
            args = replace(args, rope_scaling=scaling)
        except ModelLoadError as e:
            raise config_error(name, e) from None
    return args


def _head_size(contents: GGUFContents, arch: str) -> int | None:
    value = contents.metadata.get(f"{arch}.attention.key_length")
    return None if value is None else meta_int(contents, f"{arch}.attention.key_length")


# llama.cpp knows a Gemma's query scale by its size: the 27B models scale by dim / heads, the
# others by the head width (their query_pre_attn_scalar, which the file does not keep).
_WIDE_QUERY_SCALE = {("gemma2", 46), ("gemma3", 62)}


def _bert_args(contents: GGUFContents, embedding: TensorInfo) -> ModelArgs:
    """A ``bert`` file's sizes, as llama.cpp's converter writes them: the token types' and the
    classifier's rows from their tensors (``token_types``, ``cls.output``)."""
    from llama_chat.model.families import bert_args

    types, classifier = contents.tensors.get("token_types.weight"), contents.tensors.get("cls.output.weight")
    if meta_flag(contents, "bert.attention.causal") is True:
        raise ModelLoadError(f"{contents.path.name}: metadata 'bert.attention.causal' is true; a BERT encoder "
                             "attends both ways")
    try:
        return bert_args(
            dim=meta_int(contents, "bert.embedding_length"), n_layers=meta_int(contents, "bert.block_count"),
            n_heads=meta_int(contents, "bert.attention.head_count"), vocab_size=embedding.shape[0],
            hidden_dim=meta_int(contents, "bert.feed_forward_length"),
            norm_eps=meta_float(contents, "bert.attention.layer_norm_epsilon", 1e-12),
            positions=meta_int(contents, "bert.context_length"),
            type_vocab_size=types.shape[0] if types is not None else 0,
            labels=classifier.shape[0] if classifier is not None and len(classifier.shape) == 2 else 0)
    except ModelLoadError as e:
        raise config_error(contents.path.name, e) from None


def _nomic_bert_args(contents: GGUFContents, embedding: TensorInfo) -> ModelArgs:
    """A ``nomic-bert`` file's sizes; llama.cpp requires its token types' table, and so do we."""
    from llama_chat.model.families import nomic_bert_args

    arch = contents.architecture
    types = contents.tensors.get("token_types.weight")
    if types is None:
        raise ModelLoadError(f"{contents.path.name}: missing tensor 'token_types.weight'")
    if meta_flag(contents, f"{arch}.attention.causal") is True:
        raise ModelLoadError(f"{contents.path.name}: metadata '{arch}.attention.causal' is true; a nomic-bert "
                             "encoder attends both ways")
    try:
        return nomic_bert_args(
            dim=meta_int(contents, f"{arch}.embedding_length"), n_layers=meta_int(contents, f"{arch}.block_count"),
            n_heads=meta_int(contents, f"{arch}.attention.head_count"), vocab_size=embedding.shape[0],
            hidden_dim=meta_int(contents, f"{arch}.feed_forward_length"),
            norm_eps=meta_float(contents, f"{arch}.attention.layer_norm_epsilon", 1e-12),
            context=meta_int(contents, f"{arch}.context_length"),
            rope_theta=meta_float(contents, f"{arch}.rope.freq_base", 10000.0), type_vocab_size=types.shape[0])
    except ModelLoadError as e:
        raise config_error(contents.path.name, e) from None


# llama.cpp's pooling types (``{arch}.pooling_type``), and ours.
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last"}
RANK_POOLING = 4


def gguf_pooling(contents: GGUFContents, args: ModelArgs) -> Pooling:
    """An encoder file's pooling: ``{arch}.pooling_type`` (mean where it is missing), normalized as
    llama.cpp's server and Ollama normalize by default, up to the file's context."""
    arch = contents.architecture
    kind = meta_int(contents, f"{arch}.pooling_type", 1)
    if kind not in POOLING_TYPES:
        raise ModelLoadError(f"{contents.path.name}: metadata '{arch}.pooling_type' is {kind}, expected "
                             f"{', '.join(f'{k} ({v})' for k, v in POOLING_TYPES.items())}")
    return Pooling(POOLING_TYPES[kind], normalize=True, max_tokens=args.position_table or args.max_seq_len)


def gguf_ranking(contents: GGUFContents, args: ModelArgs) -> Ranking:
    """A reranker file's scoring: the sigmoid of its classifier's logit, as for its Hugging Face folder."""
    return Ranking(sigmoid=True, max_tokens=args.position_table or args.max_seq_len)


def is_decoder_reranker(contents: GGUFContents) -> bool:
    """A decoder's file whose pooling type is rank (llama.cpp's converter writes Qwen3-Reranker so)."""
    arch = contents.architecture
    return arch != "bert" and meta_int(contents, f"{arch}.pooling_type", 0) == RANK_POOLING


def gguf_decoder_ranking(contents: GGUFContents, args: ModelArgs) -> Ranking:
    """Qwen3-Reranker's file as llama.cpp's converter writes it: its output's "yes" and "no" rows
    as ``cls.output`` (``classifier.output_labels`` in that order), scored by their softmax at the
    last token, as llama.cpp scores a qwen3 file of pooling type rank; the model card's prompt."""
    from llama_chat.model.formats.common import realize
    from llama_chat.model.pooling import QWEN3_RERANK_PROMPT

    name, arch = contents.path.name, contents.architecture
    if arch != "qwen3":
        raise ModelLoadError(f"{name}: a {arch} file of pooling type {RANK_POOLING} (rank) is not supported "
                             "(a decoder reranker is a qwen3 file: Qwen3-Reranker)")
    info = contents.tensors.get("cls.output.weight")
    if info is None or tuple(info.shape) != (2, args.dim):
        found = "missing" if info is None else f"of shape {tuple(info.shape)}"
        raise ModelLoadError(f"{name}: tensor 'cls.output.weight' is {found}; a decoder reranker's holds its "
                             f"'yes' and 'no' rows, (2, {args.dim})")
    labels = contents.metadata.get(f"{arch}.classifier.output_labels")
    if labels is not None and list(labels) != ["yes", "no"]:
        raise ModelLoadError(f"{name}: metadata '{arch}.classifier.output_labels' is {labels!r:.60}, expected "
                             "['yes', 'no']")
    data = torch.from_file(str(contents.path), shared=False, size=contents.file_size, dtype=torch.uint8)
    head = realize(tensor_view(data, info, name), torch.device("cpu"), torch.float32).clone()
    return Ranking(sigmoid=False, max_tokens=args.max_seq_len, head=head, prompt=QWEN3_RERANK_PROMPT)


def meta_flag(contents: GGUFContents, key: str) -> bool | None:
    value = contents.metadata.get(key)
    if value is not None and not isinstance(value, bool):
        raise ModelLoadError(f"{contents.path.name}: metadata {key!r} must be true or false, found {value!r:.40}")
    return value


def _switches(contents: GGUFContents, arch: str, family: Family) -> dict[str, Any]:
    """The family's switches from the file's metadata, as llama.cpp reads them."""
    switches: dict[str, Any] = {"family": family.name}
    if contents.metadata.get(f"{arch}.pooling_type") is not None:
        switches["pooled"] = True  # an embedding model's file (Qwen3-Embedding): no classifier read
    if family.name == "qwen2":
        switches["qkv_bias"] = True
    if family.name in ("qwen3", "gemma3"):
        switches["qk_norm"] = True
    if family.name.startswith("gemma"):
        switches.update(activation="gelu_tanh", embedding_scale=True, post_norms=True)
        n_layers = meta_int(contents, f"{arch}.block_count")
        if (family.name, n_layers) in _WIDE_QUERY_SCALE:
            dim, heads = meta_int(contents, f"{arch}.embedding_length"), meta_int(contents, f"{arch}.attention.head_count")
            switches["query_scale"] = (dim / heads) ** -0.5
        for ours, key in (("attention_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping")):
            if contents.metadata.get(f"{arch}.{key}") is not None:
                switches[ours] = meta_float(contents, f"{arch}.{key}")
    window = contents.metadata.get(f"{arch}.attention.sliding_window")
    # llama.cpp's converter writes 0 for a Phi-3 config without a window: none, as llama.cpp reads it.
    if window is not None and window != 0 and family.name in ("gemma2", "gemma3", "phi3"):
        n_layers = meta_int(contents, f"{arch}.block_count")
        switches["sliding_window"] = meta_int(contents, f"{arch}.attention.sliding_window")
        # llama.cpp's patterns: Gemma 2 every other layer from the first, Gemma 3 five of six.
        pattern = {"gemma2": 2, "gemma3": 6}.get(family.name)
        switches["window_layers"] = tuple(i for i in range(n_layers) if pattern is None or i % pattern < pattern - 1)
    if family.name == "gemma3":
        switches["local_rope_theta"] = 10000.0  # llama.cpp's, for every Gemma 3
    return switches


def _long_rope(contents: GGUFContents, args: ModelArgs) -> LongRope | None:
    """Phi-3's LongRoPE from its two factor tensors and the scaling metadata."""
    name, arch = contents.path.name, contents.architecture
    infos = [contents.tensors.get(LONG_FACTORS), contents.tensors.get(SHORT_FACTORS)]
    if infos == [None, None]:
        return None
    factors = []
    for key, info in zip((LONG_FACTORS, SHORT_FACTORS), infos):
        if info is None or info.shape != (args.head_dim // 2,) or info.ggml_type != 0:
            raise ModelLoadError(f"{name}: tensor {key!r} must be F32 of shape ({args.head_dim // 2},)")
        factors.append(_f32_values(contents, info))
    original = meta_int(contents, f"{arch}.rope.scaling.original_context_length", args.max_seq_len)
    attention = meta_float(contents, f"{arch}.rope.scaling.attn_factor", 1.0)
    return LongRope(tuple(factors[1]), tuple(factors[0]), original, attention)


def _f32_values(contents: GGUFContents, info: TensorInfo) -> list[float]:
    with open(contents.path, "rb") as f:
        f.seek(info.offset)
        values = torch.frombuffer(bytearray(f.read(info.nbytes)), dtype=torch.float32)
    if not torch.isfinite(values).all() or (values <= 0).any():
        raise ModelLoadError(f"{contents.path.name}: tensor {info.name!r} holds values that are not positive "
                             "finite numbers")
    return values.tolist()


def _rope_scaling(contents: GGUFContents, args: ModelArgs) -> RopeScaling | None:
    """Llama 3.1's rope scaling, from the frequency factors the converter stores as ``rope_freqs``.

    The file keeps only the resulting per-frequency factors, not the recipe's parameters; the
    factor is their largest value, and the other three are Llama 3.1's own (low 1, high 4, from a
    context of 8192), accepted only when they reproduce every stored factor.
    """
    info = contents.tensors.get(ROPE_FREQS)
    if info is None:
        return None
    name = contents.path.name
    if info.shape != (args.head_dim // 2,) or info.ggml_type != 0:
        raise ModelLoadError(f"{name}: tensor {ROPE_FREQS!r} must be F32 of shape ({args.head_dim // 2},), "
                             f"found shape {info.shape}")
    stored = torch.tensor(_f32_values(contents, info))
    if torch.all(stored == 1):
        return None
    scaling = RopeScaling(factor=float(stored.max()))
    plain = rope_frequencies(args.head_dim, args.rope_theta)
    scaled = rope_frequencies(args.head_dim, args.rope_theta, scaling)
    if not torch.allclose(plain / scaled, stored, rtol=1e-4, atol=1e-6):
        raise ModelLoadError(f"{name}: tensor {ROPE_FREQS!r} holds frequency factors other than Llama 3.1's rope "
                             f"scaling (factor {scaling.factor:g}, low 1, high 4, original context 8192)")
    return scaling
