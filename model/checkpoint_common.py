"""What every checkpoint reader returns, and the checks that do not depend on the file format."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llama_chat.model.args import ModelArgs
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.json_files import first_sentence


@dataclass(frozen=True)
class Checkpoint:
    """Weights with Meta names and interleaved rotary layout, plus the architecture they describe.

    Tensors are views of memory-mapped files wherever the format allows, so nothing is read from
    disk until a tensor is used. ``origin`` names the file each tensor came from, for messages.
    """

    args: ModelArgs
    state: dict[str, torch.Tensor]
    origin: dict[str, str] = field(default_factory=dict)
    files: tuple[Path, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


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
        shapes[p + "feed_forward.w3.weight"] = (args.hidden_dim, args.dim)
        shapes[p + "attention_norm.weight"] = (args.dim,)
        shapes[p + "ffn_norm.weight"] = (args.dim,)
    shapes["norm.weight"] = (args.dim,)
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


def check_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """The state dict ``Transformer.load_state_dict(strict=True)`` will accept, or a clear error.

    Checked here rather than left to ``load_state_dict`` so the message is one line naming the
    tensor, its file, and the expected and found shapes.
    """
    want = expected_shapes(ckpt.args)
    state = dict(ckpt.state)
    if ckpt.args.tie_embeddings:
        # Some writers store the tied projection anyway; it is the embedding, so drop it.
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
