"""One entry point for every weight format: find the layout, read it, build the model on a device.

``load_model`` reads the tokenizer first (Meta's ``params.json`` may take its vocabulary size from
it), then the checkpoint as memory-mapped tensors with Meta names (the sizes its config claims
checked against the files' sizes first), checks every tensor's shape, converts each tensor
straight to the target device and dtype, one at a time, and assigns them to a Transformer built on
the ``meta`` device (so no memory is spent on random initial weights). Nothing here prints:
progress goes to an optional ``on_progress(done_bytes, total_bytes)`` callback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from llama_chat.ml import controls
from llama_chat.ml.half import HalfEmbedding, HalfLinear
from llama_chat.ml.packed import PACKABLE, PackedEmbedding, PackedLinear, PackedWeight, block_layout, pack, row_bytes
from llama_chat.model.args import ModelArgs
from llama_chat.model.chat_format import ChatFormat
from llama_chat.model.formats.common import Checkpoint, Weight, check_state, realize
from llama_chat.model.pooling import Pooling, Ranking
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.stores import DEFAULT_MODEL_NAME, default_model_dir, is_default_model  # noqa: F401 - re-exported
from llama_chat.model.tokenizers.base import Tokenizer
from llama_chat.model.transformer import Transformer

if TYPE_CHECKING:
    from llama_chat.ml.quantize import Int8Weight
    from llama_chat.model.formats.gguf import GGUFContents

ProgressCallback = Callable[[int, int], None]

META = "meta"
HF = "hf"
LLAMA2C = "llama2c"
GGUF = "gguf"

# Without an explicit max_seq_len the context is the checkpoint's, capped here: Llama 3.1 says
# 131072, whose KV cache alone would be 16 GiB for an 8B model. Ask for more with max_seq_len.
DEFAULT_MAX_SEQ_LEN = controls.DEFAULT_CONTEXT

# Projections whose outputs the model concatenates (``Transformer.fuse_projections``): kept as the
# file's only all together and in one form (blocks, or 16-bit values of one dtype), since a fused
# layer is all blocks, all 16-bit or all float32.
_FUSED_GROUPS = (("attention.wq", "attention.wk", "attention.wv"), ("feed_forward.w1", "feed_forward.w3"))


@dataclass(frozen=True)
class LoadedModel:
    model: Transformer
    args: ModelArgs
    tokenizer: Tokenizer
    chat_format: ChatFormat | None
    path: Path
    name: str
    device: torch.device
    dtype: torch.dtype  # of the float weights (norms, and any matrix not kept as the file's)
    layout: str  # "meta" | "hf" | "llama2c" | "gguf"
    file_type: str | None = None  # a GGUF file's own name for its quantization: "Q4_K_M"
    # How an embedding model pools its hidden states (``model/pooling.py``); None: a model that
    # generates text.
    pooling: Pooling | None = None
    ranking: Ranking | None = None  # a reranker's scoring; None: not a reranker

    @property
    def kind(self) -> str:
        """What the model is for: "embedding", "rerank" or "chat"."""
        return "rerank" if self.ranking is not None else "chat" if self.pooling is None else "embedding"

    def weights(self) -> WeightsSummary:
        """The weights' format and bytes as they are now (after any fusing the scheduler did)."""
        return weights_summary(self)


@dataclass(frozen=True)
class WeightsSummary:
    """What a model's weights are, for reports: ``format`` names the matrices' form ("Q4_K_M,
    packed q4_k+q6_k", "F16, float16", "int8", "float32"; a GGUF file's own type name first),
    ``nbytes`` what its tensors take in memory (a memory-mapped file's counted whole, as its pages
    are once read)."""

    format: str
    nbytes: int
    # What of the model the CPU operator's one-call step does not compute (``ModelArgs.llama_layout``):
    # such a model's steps go through the layers, which ``--stats`` says.
    operator_gaps: tuple[str, ...] = ()


def weights_summary(loaded: LoadedModel) -> WeightsSummary:
    """``loaded``'s weights as they are now (after any fusing or quantizing the scheduler did)."""
    from llama_chat.ml.packed import PACKED_TYPES, PackedConcat
    from llama_chat.ml.quantize import Int8Linear

    kinds: set[str] = set()
    others: set[str] = set()
    for module in loaded.model.modules():
        if isinstance(module, (PackedLinear, PackedConcat)):
            kinds.update(kind for kind, _ in module.segments)
        elif isinstance(module, Int8Linear):
            others.add("int8")
        elif isinstance(module, torch.nn.Linear):
            others.add(str(module.weight.dtype).removeprefix("torch."))
    parts = ([f"packed {'+'.join(k for k in PACKED_TYPES if k in kinds)}"] if kinds else []) + sorted(others)
    if loaded.file_type is not None:
        parts.insert(0, loaded.file_type)
    sizes: dict[tuple[torch.device, int], int] = {}
    for tensor in (*loaded.model.parameters(), *loaded.model.buffers()):
        key = (tensor.device, tensor.data_ptr())
        sizes[key] = max(sizes.get(key, 0), tensor.numel() * tensor.element_size())
    from llama_chat.model.cpu_decode import operator_gaps

    gaps = tuple(operator_gaps(loaded.args)) if loaded.device.type == "cpu" else ()
    return WeightsSummary(", ".join(parts), sum(sizes.values()), gaps)


def detect_layout(path: Path | str) -> str:
    """``"meta"``, ``"hf"``, ``"llama2c"`` or ``"gguf"`` for a model directory or a weights file in one.

    A directory is Meta's when it has ``params.json`` and ``consolidated.*.pth``, Hugging Face's
    when it has ``config.json`` and safetensors or ``pytorch_model.bin`` weights, llama2.c's when
    it holds exactly one llama2.c ``.bin``, GGUF's when it holds exactly one ``.gguf`` file. A file
    is judged by its name and first bytes (a GGUF file by its magic, whatever its name: Ollama's
    blobs have none).
    """
    from llama_chat.model.formats import gguf as checkpoint_gguf, hf as checkpoint_hf, llama2c as checkpoint_llama2c

    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_file():
        if checkpoint_gguf.is_gguf(path):
            return GGUF
        if path.suffix == ".gguf":
            raise ModelLoadError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
        if path.name == "params.json" or (path.name.startswith("consolidated.") and path.suffix == ".pth"):
            return detect_layout(path.parent)
        if _is_hf_file(path):
            return detect_layout(path.parent)
        if checkpoint_llama2c.sniff(path) is not None:
            return LLAMA2C
        raise ModelLoadError(f"{path}: unknown model layout (not a llama2.c .bin, Meta or Hugging Face file)")
    if (path / "params.json").is_file() and any(path.glob("consolidated.*.pth")):
        return META
    if (path / "config.json").is_file() and checkpoint_hf.has_weights(path):
        return HF
    if len(_llama2c_files(path)) == 1:
        return LLAMA2C
    gguf_files = _gguf_files(path)
    if len(gguf_files) == 1:
        return GGUF
    if len(gguf_files) > 1:
        names = ", ".join(p.name for p in gguf_files[:4]) + (", ..." if len(gguf_files) > 4 else "")
        raise ModelLoadError(f"{path}: holds {len(gguf_files)} GGUF files ({names}); name one of them with -m")
    raise ModelLoadError(
        f"{path}: unknown model layout (expected params.json + consolidated.*.pth, "
        "config.json + *.safetensors, one llama2.c .bin or one .gguf file)"
    )


def load_model(path: Path | str, *, device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
               max_seq_len: int | None = None, tokenizer_file: Path | str | None = None,
               chat_format: str = "auto", on_progress: ProgressCallback | None = None,
               name: str | None = None, quantize: str = "none") -> LoadedModel:
    """Load a model directory (or weights file) in any supported layout, ready for inference.

    ``device``: "auto" (cuda, then mps, then cpu) or any torch device. ``dtype``: "auto" (float32
    on cpu, bfloat16 on cuda, float16 on mps), "float32", "bfloat16" or "float16".
    ``max_seq_len``: the context length the rotary table and caches are sized for, at most the
    checkpoint's (0: the checkpoint's); by default the checkpoint's, at most ``DEFAULT_MAX_SEQ_LEN``. ``tokenizer_file`` overrides the tokenizer
    found beside the weights (for GGUF: the one in the file); ``chat_format`` is a format name or
    "auto". ``name`` is what the model is called in reports (default: the directory's or file's;
    ``default`` for the shipped model).
    ``quantize`` (``controls.QUANTIZE_MODES``): "none"; "int8" to make every projection
    weight-only int8 (``ml/quantize.py``); "q8_0" or "q4_0" to make it llama.cpp's blocks of that
    kind (``ml/packed.py``). Either is done as each tensor is loaded, so the float model never
    exists whole (a GGUF file's blocks are expanded one tensor at a time, and kept as they are
    where they already are of the kind asked for).

    A GGUF file on the CPU with ``dtype`` "auto" and no ``quantize`` keeps its quantized matrices
    as the file's blocks (``PackedLinear``, ``PackedEmbedding`` over views of its memory map: no
    copy), for every kind ``ml/packed.py`` multiplies, and its F16 and BF16 matrices as the file's
    16-bit values (``HalfLinear``, ``HalfEmbedding``: ``ml/half.py``), under float32 norms,
    activations and cache; other kinds are expanded to float32. A ``dtype`` given explicitly
    expands or converts them all.
    Every problem with the files raises ``ModelLoadError`` with a one-line message.
    """
    if quantize not in controls.QUANTIZE_MODES:
        raise ModelLoadError(f"quantization {quantize!r} is not supported (expected "
                             f"{', '.join(controls.QUANTIZE_MODES[:-1])} or {controls.QUANTIZE_MODES[-1]})")
    path = Path(path)
    layout = detect_layout(path)
    weights_file = path if path.is_file() else None
    model_dir = path.parent if path.is_file() else path
    if layout == LLAMA2C and weights_file is None:
        weights_file = _llama2c_files(model_dir)[0]
    if layout == GGUF and weights_file is None:
        weights_file = _gguf_files(model_dir)[0]
    target_device = _resolve_device(device)
    target_dtype = _resolve_dtype(dtype, target_device)

    if layout == GGUF:
        # One file holds the weights, the tokenizer and the chat template: parse its header once.
        from llama_chat.model.formats.gguf import open_gguf, read_gguf

        assert weights_file is not None
        contents = open_gguf(weights_file)
        tokenizer = _gguf_tokenizer(contents, Path(tokenizer_file) if tokenizer_file else None)
        ckpt = read_gguf(contents, tokenizer_vocab=tokenizer.vocab_size)
    else:
        contents = None
        tokenizer = _load_tokenizer(model_dir, Path(tokenizer_file) if tokenizer_file else None)
        ckpt = _read(layout, model_dir, weights_file, tokenizer.vocab_size)
    if tokenizer.vocab_size > ckpt.args.vocab_size:
        raise ModelLoadError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {ckpt.args.vocab_size}: "
            "they do not belong together"
        )
    args = ckpt.args.with_max_seq_len(_context(max_seq_len, ckpt.args.max_seq_len))
    state = check_state(ckpt)
    del ckpt  # `state` holds the only references to the source tensors, released one by one
    keep_blocks = layout == GGUF and dtype == "auto" and target_device.type == "cpu" and quantize == "none"
    model = _build(args, state, target_device, target_dtype, on_progress, quantize=quantize, keep_blocks=keep_blocks)
    pooling = ranking = None
    if args.encoder or args.pooled:  # an embedding model or a reranker: never prompted
        from llama_chat.model.formats.sentence_transformers import read_pooling, read_ranking

        fmt = None
        if contents is not None:
            from llama_chat.model.formats.gguf import (gguf_decoder_ranking, gguf_pooling, gguf_ranking,
                                                       is_decoder_reranker)

            if args.labels:
                ranking = gguf_ranking(contents, args)
            elif is_decoder_reranker(contents):
                ranking = gguf_decoder_ranking(contents, args)
            else:
                pooling = gguf_pooling(contents, args)
        elif args.labels:
            ranking = read_ranking(model_dir, args)
        else:
            pooling = read_pooling(model_dir, args)
    elif contents is not None:
        from llama_chat.model.chat_format import chat_format_from_template
        from llama_chat.model.formats.gguf import meta_str

        fmt = chat_format_from_template(meta_str(contents, "tokenizer.chat_template"), tokenizer, chat_format,
                                        where=f"{contents.path.name}: tokenizer.chat_template")
    else:
        from llama_chat.model.formats.sentence_transformers import decoder_ranking, is_decoder_reranker

        if is_decoder_reranker(model_dir, args):  # asked "yes" or "no", never prompted otherwise
            fmt, ranking = None, decoder_ranking(str(model_dir), args, tokenizer)
        else:
            fmt = _chat_format(model_dir, tokenizer, chat_format)
    if name is None and is_default_model(model_dir):
        name = DEFAULT_MODEL_NAME  # the name -m takes for it
    if name is None:
        name = weights_file.stem if layout in (LLAMA2C, GGUF) else model_dir.resolve().name
    file_type = None
    if contents is not None:
        from llama_chat.model.formats.gguf_header import file_type_name

        file_type = file_type_name(contents.metadata)
    return LoadedModel(model=model, args=args, tokenizer=tokenizer, chat_format=fmt, path=path, name=name,
                       device=target_device, dtype=target_dtype, layout=layout, file_type=file_type,
                       pooling=pooling, ranking=ranking)


def _read(layout: str, model_dir: Path, weights_file: Path | None, tokenizer_vocab: int) -> Checkpoint:
    if layout == META:
        from llama_chat.model.formats.meta import read_meta

        return read_meta(model_dir, tokenizer_vocab=tokenizer_vocab)
    if layout == HF:
        from llama_chat.model.formats.hf import read_hf

        return read_hf(model_dir)
    from llama_chat.model.formats.llama2c import read_llama2c

    assert weights_file is not None
    return read_llama2c(weights_file)


def _context(asked: int | None, trained: int) -> int:
    if asked is None:
        return min(trained, DEFAULT_MAX_SEQ_LEN)
    if asked == 0:
        return trained
    if asked < 0:
        raise ModelLoadError(f"context length must be positive, found {asked}")
    if asked > trained:
        raise ModelLoadError(f"a context of {asked} tokens was asked for, but the model's is {trained}")
    return asked


def _build(args: ModelArgs, state: dict[str, Weight], device: torch.device, dtype: torch.dtype,
           on_progress: ProgressCallback | None, *, quantize: str = "none",
           keep_blocks: bool = False) -> Transformer:
    """Assign the checked tensors to a Transformer built without allocating any weights.

    Each tensor goes from the file to its device and dtype on its own (``realize``), before
    assignment, and the file pages it was read from are released at once; so beyond the model
    itself at most one tensor is in flight, and progress can be reported per tensor. A float32
    checkpoint loaded as float32 on the CPU is not copied at all: the parameters are the
    memory-mapped file, and pages are read as the forward first touches them.

    With ``quantize`` ("int8", "q8_0", "q4_0"), each projection is quantized as soon as it is
    realised and its float copy dropped, exactly as quantizing the loaded float model would,
    but without ever holding that float model: the peak is the quantized model, the float
    embedding and one float projection. With ``keep_blocks`` (a GGUF file on the CPU), the
    matrices ``_kept_blocks`` names are not realised at all: they become packed layers over the
    file's own bytes (quantized blocks as packed layers, 16-bit matrices as ``ml/half.py``'s).
    """
    total = sum(t.numel() * t.element_size() for t in state.values())
    done = 0
    if on_progress is not None:
        on_progress(0, total)
    kept = _kept_blocks(state, quantize) if keep_blocks or quantize in PACKABLE else {}
    moved: dict[str, torch.Tensor] = {}
    # What becomes an Int8Linear, a packed layer or a 16-bit one (a tensor: ``ml/half.py``).
    layers: dict[str, Int8Weight | PackedWeight | torch.Tensor] = {}
    for name in list(state):
        tensor = state.pop(name)
        done += tensor.numel() * tensor.element_size()
        if name in kept:
            layers[name] = kept[name]
        else:
            weight = realize(tensor, device, dtype)
            quantized = _quantized(weight, quantize) if _is_projection(name) else None
            if quantized is not None:
                from llama_chat.model.formats.common import release_pages

                layers[name] = quantized
                release_pages(weight)  # a float32 file's own mapping: its pages are not needed again
            else:
                moved[name] = weight
            del weight
        del tensor
        if on_progress is not None:
            on_progress(done, total)
    if args.tie_embeddings and not args.pooled:  # (a pooled decoder has no classifier)
        # The module lists the tied projection as its own key; it is the embedding itself: the
        # file's blocks or 16-bit values, or the float tensor (quantized, a copy: the lookup
        # reads a row, the classifier reads them all).
        if "tok_embeddings.weight" in layers:
            layers["output.weight"] = layers["tok_embeddings.weight"]
        else:
            embedding = moved["tok_embeddings.weight"]
            quantized = _quantized(embedding, quantize)
            if quantized is not None:
                layers["output.weight"] = quantized
            else:
                moved["output.weight"] = embedding
    with torch.device("meta"), _SkipRandomInit():
        model = Transformer(args)
    model.load_state_dict(moved, assign=True, strict=not layers)
    for name, weight in layers.items():
        parent, attr = _parent_of(model, name)
        setattr(parent, attr, _layer(weight, embedding=name == "tok_embeddings.weight"))
    if "output.weight" not in layers:
        model.tie_weights()
    if any(isinstance(w, torch.Tensor) for w in layers.values()):
        model.to(device=device)  # a cast would expand the 16-bit layers; the rest is in dtype already
    else:
        model.to(device=device, dtype=dtype)  # a no-op for the weights; kept so buffers follow too
    model.requires_grad_(False)
    return model.eval()


def _kept_blocks(state: dict[str, Weight], quantize: str) -> dict[str, PackedWeight | torch.Tensor]:
    """The GGUF matrices kept as the file's: with ``quantize`` "none", the projections, the
    classifier and the embedding, as blocks for every kind ``ml/packed.py`` multiplies and as
    16-bit values for F16 and BF16 (``ml/half.py``); with "q8_0" or "q4_0", the projections and
    classifier already of that kind. Projections the model fuses are kept only all together and
    in one form (a fused layer is all blocks, all 16-bit of one dtype or all float32)."""
    from llama_chat.model.formats.gguf import Converted, Dequantized

    kept: dict[str, PackedWeight | torch.Tensor] = {}
    for name, weight in state.items():
        wanted = _is_projection(name) or (quantize == "none" and name == "tok_embeddings.weight")
        found = None
        if wanted and isinstance(weight, Dequantized) and quantize in ("none", weight.kind):
            found = weight.packed()
        elif wanted and isinstance(weight, Converted) and quantize == "none":
            found = weight.kept()
        if found is not None:
            kept[name] = found
    for name in list(kept):
        for group in _FUSED_GROUPS:
            member = next((m for m in group if name.endswith(f".{m}.weight")), None)
            layer = name[:-len(f"{member}.weight")] if member else ""
            # A family without some of the group (BERT's feed-forward has no w3) fuses none of it.
            names = [f"{layer}{m}.weight" for m in group if f"{layer}{m}.weight" in state]
            if member and (any(n not in kept for n in names) or len({_form(kept[n]) for n in names}) > 1):
                del kept[name]
    return kept


def _form(weight: PackedWeight | torch.Tensor) -> str:
    """What a kept matrix becomes: packed blocks (of any kinds: they fuse), or 16-bit values of a dtype."""
    return "packed" if isinstance(weight, PackedWeight) else str(weight.dtype)


def _quantized(weight: torch.Tensor, quantize: str) -> Int8Weight | PackedWeight | None:
    """``weight`` as ``quantize`` asks: per-row int8, or blocks of 32 (None where its rows are not
    whole blocks: it then stays float, as llama.cpp keeps such tensors in a wider type); None for
    "none"."""
    if quantize == "int8":
        from llama_chat.ml.quantize import quantize_int8

        return quantize_int8(weight)
    if quantize in PACKABLE and weight.shape[-1] % block_layout(quantize)[0] == 0:
        return _pack_rows(quantize, weight)
    return None


# Float values packed at a time (``_pack_rows``): bounds the quantizer's float temporaries.
_PACK_VALUES = 1 << 22


def _pack_rows(kind: str, weight: torch.Tensor) -> PackedWeight:
    """``pack(kind, weight)``, a chunk of rows at a time straight into the final bytes."""
    rows, cols = weight.shape
    out = torch.empty(rows, row_bytes(kind, cols), dtype=torch.uint8, device=weight.device)
    step = max(1, _PACK_VALUES // cols)
    for start in range(0, rows, step):
        out[start:start + step] = pack(kind, weight[start:start + step]).data
    return PackedWeight(kind, out, cols)


def _layer(weight: Int8Weight | PackedWeight | torch.Tensor, *, embedding: bool) -> torch.nn.Module:
    if isinstance(weight, PackedWeight):
        return PackedEmbedding(weight) if embedding else PackedLinear(weight)
    if isinstance(weight, torch.Tensor):  # a file's 16-bit values
        return HalfEmbedding(weight) if embedding else HalfLinear(weight)
    from llama_chat.ml.quantize import Int8Linear

    return Int8Linear(weight)


def _is_projection(name: str) -> bool:
    """The weights quantization makes int8 or packed: every linear layer's, not the embedding."""
    return name == "output.weight" or name.endswith(
        (".wq.weight", ".wk.weight", ".wv.weight", ".wo.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def _parent_of(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """``layers.0.attention.wq.weight`` -> (the attention module, "wq")."""
    module_path = name.rsplit(".", 1)[0]
    parent_path, _, attr = module_path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), attr


class _SkipRandomInit(TorchFunctionMode):
    """Make ``nn.init``'s random fills no-ops while the model is built on the meta device.

    The values would be replaced by the checkpoint's anyway, and the first ``normal_`` on a meta
    tensor imports torch's Python meta kernels (sympy and some 800 modules): 1.5 s and 70 MB of
    resident memory for nothing.
    """

    _SKIPPED = frozenset({"normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self._SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def _gguf_tokenizer(contents: GGUFContents, tokenizer_file: Path | None) -> Tokenizer:
    if tokenizer_file is not None:
        return _load_tokenizer(tokenizer_file.parent, tokenizer_file)
    from llama_chat.model.tokenizers.gguf import load_gguf_tokenizer

    return load_gguf_tokenizer(contents)


def _load_tokenizer(model_dir: Path, tokenizer_file: Path | None) -> Tokenizer:
    from llama_chat.model.tokenizers.loading import load_tokenizer

    return load_tokenizer(model_dir, tokenizer_file=tokenizer_file)


def _chat_format(model_dir: Path, tokenizer: Tokenizer, name: str) -> ChatFormat | None:
    try:
        from llama_chat.model.chat_format import chat_format_for
    except ImportError:  # chat formats land separately; until then a model simply has none
        return None
    return chat_format_for(model_dir, tokenizer, name)


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"device {device!r} is not a valid torch device ({e})") from None
    if resolved.type not in ("cpu", "cuda", "mps"):
        raise ModelLoadError(f"device {str(device)!r} cannot run a model (expected cpu, cuda or mps)")
    if resolved.type == "cuda" and resolved.index is not None and torch.cuda.is_available() \
            and resolved.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {str(device)!r} is not available on this machine "
                             f"({torch.cuda.device_count()} CUDA devices)")
    available = {
        "cuda": torch.cuda.is_available,
        "mps": lambda: getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(),
    }.get(resolved.type)
    if available is not None and not available():
        raise ModelLoadError(f"device {str(device)!r} is not available on this machine")
    return resolved


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if device.type == "mps":
            return torch.float16
        return torch.float32
    if dtype not in controls.DTYPES:
        raise ModelLoadError(f"dtype {dtype!r} is not supported (expected "
                             f"{', '.join(controls.DTYPES[:-1])} or {controls.DTYPES[-1]})")
    return getattr(torch, dtype)


def _is_hf_file(path: Path) -> bool:
    return path.suffix == ".safetensors" or path.name.startswith("pytorch_model") or path.name == "config.json"


def _gguf_files(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.glob("*.gguf") if p.is_file())


def _llama2c_files(model_dir: Path) -> list[Path]:
    from llama_chat.model.formats.llama2c import sniff

    return sorted(
        p for p in model_dir.glob("*.bin")
        if not p.name.startswith(("tokenizer", "tok", "pytorch_model")) and sniff(p) is not None
    )
