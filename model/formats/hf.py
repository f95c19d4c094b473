"""Hugging Face layout: ``config.json`` and safetensors (or ``pytorch_model.bin``) weights."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from llama_chat.model.args import ModelArgs
from llama_chat.model.formats.common import (
    Checkpoint,
    Permuted,
    Weight,
    check_claimed_size,
    config_error,
    torch_load,
    unreadable,
)
from llama_chat.model.families import Family, check_fused, hf_args, interleave_rows, rotated_heads
from llama_chat.model.formats.json_files import read_json
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.tensor_names import HF

# Old exports carry their rotary frequencies as a buffer; we build our own table.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq")

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")


def has_weights(model_dir: Path) -> bool:
    return any((model_dir / name).is_file() for name in WEIGHT_FILES)


def read_hf(model_dir: Path) -> Checkpoint:
    """Read ``config.json`` and the weights; tensors stay memory-mapped except q/k (permuted), a
    fused tensor's parts (views) and a Gemma norm (shifted: ``_shifted``)."""
    config = read_json(model_dir / "config.json")
    family, args = _args(config)
    from llama_chat.model.formats.sentence_transformers import is_sentence_transformers

    if is_sentence_transformers(model_dir) and not args.encoder:
        args = replace(args, pooled=True)  # a decoder embedder (Qwen3-Embedding)
    loaded, origin, files = _read_tensors(model_dir, args)
    names = family.names
    state: dict[str, Weight] = {}
    renamed_origin: dict[str, str] = {}
    for hf_name, tensor in loaded.items():
        short = hf_name.removeprefix(names.hf_name_prefix)
        if _IGNORED.fullmatch(hf_name) or short in names.hf_ignored:
            continue
        name = names.ours(short, HF)
        if name is None and args.pooled:  # a bare decoder's names (``Qwen3Model``): no "model." before them
            name = names.ours(f"model.{short}", HF)
        if name is None:
            raise ModelLoadError(f"{origin[hf_name]}: unexpected tensor {hf_name!r}")
        if name in names.head and not args.labels:
            continue
        parts = check_fused(name, tensor.shape[0], args, origin[hf_name]) if tensor.dim() == 2 else None
        if parts is None:
            pieces = [(name, tensor)]
        else:  # Phi-3's fused q/k/v and gate/up: views of the file's rows, fused again by the model
            layer, _, _ = name.rpartition(".attention.") if ".attention." in name else name.rpartition(".feed_forward.")
            pieces, start = [], 0
            for part, rows in parts:
                pieces.append((f"{layer}.{part}", tensor[start:start + rows]))
                start += rows
        for piece_name, piece in pieces:
            if piece_name in state:  # "layers.1" and "layers.01" name the same layer
                raise ModelLoadError(f"{origin[hf_name]}: tensor {hf_name!r:.80} names {piece_name!r} a second time")
            state[piece_name] = _as_ours(piece_name, piece, args, family.norm_shift, origin[hf_name])
            renamed_origin[piece_name] = origin[hf_name]
    return Checkpoint(args=args, state=state, origin=renamed_origin, files=tuple(files))


def _as_ours(name: str, tensor: torch.Tensor, args: ModelArgs, norm_shift: bool, file: str) -> Weight:
    """A tensor as the model reads it: q/k rows (and their biases and head norms) in pairs, and a
    Gemma norm's ``w`` as ``1 + w`` in float32 (Gemma computes the sum in float32)."""
    heads = rotated_heads(name, args)
    if heads is not None and tensor.dim() == 2:
        # Reordered as they are copied to the target (see hf_to_interleaved).
        return _permuted(tensor, heads, file, name)
    if heads is not None and tensor.dim() == 1 and tensor.shape[0] % (2 * heads) == 0:
        tensor = interleave_rows(tensor, heads)
    if norm_shift and name.endswith("norm.weight"):
        tensor = tensor.float() + 1
    return tensor


def hf_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder a q or k projection's output rows from Hugging Face's rotary layout to Meta's.

    Why: Meta's Llama rotates interleaved channel pairs ``(2i, 2i+1)`` of each head; Hugging Face's
    conversion script permuted the q/k rows so that its ``rotate_half`` can rotate the pairs
    ``(i, i + head_dim/2)`` instead (and the other families were trained in that order). Our model
    keeps Meta's convention everywhere (the llama2.c and Meta checkpoints need no change), so this
    is the one place that undoes it: rows ``[pair-halves..., head_dim/2]`` per head go back to
    ``[pairs, 2]``. Rows are reordered, never mixed, and q and k get the same order, so ``q . k``
    and the attention scores are unchanged. It copies the tensor (the only weights that leave
    their memory map when loading HF files).
    """
    rows, cols = w.shape
    head_dim = rows // n_heads
    if rows % n_heads or head_dim % 2:
        raise ModelLoadError(f"q/k projection of shape ({rows}, {cols}) does not split into {n_heads} heads")
    return interleave_rows(w, n_heads)


def _permuted(tensor: torch.Tensor, n_heads: int, file: str, name: str) -> Weight:
    if tensor.dim() != 2:
        return tensor  # the shape check names it
    try:
        return Permuted(tensor, n_heads)
    except ModelLoadError as e:
        raise ModelLoadError(f"{file}: tensor {name!r}: {e}") from None


def _args(config: dict) -> tuple[Family, ModelArgs]:
    try:
        return hf_args(config)
    except (TypeError, ValueError, ModelLoadError) as e:
        raise config_error("config.json", e) from None


def _read_tensors(model_dir: Path, args: ModelArgs) -> tuple[dict[str, torch.Tensor], dict[str, str], list[Path]]:
    """All tensors by their HF name, the file each came from, and the files read."""
    for index_name, single_name in (("model.safetensors.index.json", "model.safetensors"),
                                    ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index_path = model_dir / index_name
        if index_path.is_file():
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelLoadError(f"{index_name}: missing or empty 'weight_map'")
            files = sorted({_shard_name(index_name, tensor, file) for tensor, file in weight_map.items()})
            break
        if (model_dir / single_name).is_file():
            files = [single_name]
            break
    else:
        raise ModelLoadError(f"{model_dir}: no model.safetensors or pytorch_model.bin next to config.json")

    paths = [model_dir / name for name in files]
    for path in paths:
        if not path.is_file():
            raise ModelLoadError(f"{path.name}: weights file listed in the index is missing")
    check_claimed_size(args, paths, "config.json")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for path in paths:
        part = _read_safetensors(path) if path.suffix == ".safetensors" else _read_torch(path)
        for name, tensor in part.items():
            tensors[name] = tensor
            origin[name] = path.name
    return tensors, origin, paths


def _shard_name(index_name: str, tensor: object, file: object) -> str:
    """A ``weight_map`` value: the name of a weights file in the model directory itself.

    An index could name any path (``../../home/user/secret.bin``, ``/dev/zero``); only plain file
    names are accepted. The file itself may be a symbolic link, as in the Hugging Face cache.
    """
    if not isinstance(file, str) or not isinstance(tensor, str):
        raise ModelLoadError(f"{index_name}: weight_map must map tensor names to file names, "
                             f"found {tensor!r}: {file!r}")
    if not file or "/" in file or "\\" in file or file in (".", "..") or "\0" in file:
        raise ModelLoadError(f"{index_name}: weight_map names {file!r}, which is not a file in the model directory")
    if not file.endswith((".safetensors", ".bin")):
        raise ModelLoadError(f"{index_name}: weight_map names {file!r}, not a .safetensors or .bin file")
    return file


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    try:
        # safe_open maps the file; get_tensor returns views of that mapping, read on first touch.
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # SafetensorError, OSError: truncated header or data
        raise unreadable(path, e) from None


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    return torch_load(path)
