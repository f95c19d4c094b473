"""Meta's original layout: ``params.json`` and ``consolidated.NN.pth`` model-parallel shards."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from llama_chat.model.args import ModelArgs
from llama_chat.model.formats.common import (
    Checkpoint,
    Concatenated,
    Weight,
    check_claimed_size,
    config_error,
    expected_shapes,
    torch_load,
)
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.json_files import read_json

_SHARD = re.compile(r"consolidated\.(\d+)\.pth")

# Meta's model-parallel layers: ColumnParallelLinear splits its output features (dim 0),
# RowParallelLinear its input features (dim 1). Norms are replicated in every shard. The token
# embedding is split on dim 1 in Llama 2 (ParallelEmbedding) and on dim 0 in Llama 3
# (VocabParallelEmbedding), so that one is decided by the shape it must end up with.
_PARALLEL_DIM = {
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "feed_forward.w1.weight": 0,
    "feed_forward.w3.weight": 0,
    "output.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w2.weight": 1,
}

# Precomputed rotary frequencies some Meta checkpoints carry; we build our own table.
_IGNORED = {"rope.freqs"}


def shard_files(model_dir: Path) -> list[Path]:
    """``consolidated.00.pth``, ``consolidated.01.pth``, ... in order; numbering must be complete."""
    found = sorted(
        (int(m.group(1)), p) for p in model_dir.iterdir() if (m := _SHARD.fullmatch(p.name))
    )
    if not found:
        raise ModelLoadError(f"{model_dir}: no consolidated.NN.pth weights next to params.json")
    for want, (got, path) in enumerate(found):
        if got != want:
            raise ModelLoadError(f"{model_dir}: shard consolidated.{want:02d}.pth is missing (found {path.name})")
    return [p for _, p in found]


def read_meta(model_dir: Path, *, tokenizer_vocab: int | None = None) -> Checkpoint:
    """Read ``params.json`` and every shard; the tensors stay memory-mapped for one shard.

    ``tokenizer_vocab`` fills in Llama 2's ``"vocab_size": -1``.
    """
    params_path = model_dir / "params.json"
    params = read_json(params_path)
    try:
        args = ModelArgs.from_params_json(params, vocab_size=tokenizer_vocab)
    except (TypeError, ValueError, ModelLoadError) as e:
        raise config_error("params.json", e) from None

    files = shard_files(model_dir)
    check_claimed_size(args, files, "params.json")
    shards = [_load_shard(path) for path in files]
    if len(shards) == 1:
        state = shards[0]
        origin = {name: files[0].name for name in state}
    else:
        state = _merge(shards, files, expected_shapes(args))
        origin = {name: "consolidated.*.pth" for name in state}
    return Checkpoint(args=args, state=state, origin=origin, files=tuple(files))


def _load_shard(path: Path) -> dict[str, torch.Tensor]:
    state = torch_load(path)
    for name in _IGNORED:
        state.pop(name, None)
    return state


def _merge(shards: list[dict[str, torch.Tensor]], files: list[Path],
           want: dict[str, tuple[int, ...]]) -> dict[str, Weight]:
    """Each weight's slices, to be joined along its model-parallel dimension when it is loaded.

    Nothing is copied here: the loader writes the slices straight into the final tensor, on the
    target device and in the target dtype, one weight at a time (``Concatenated``).
    """
    names = list(shards[0])
    for path, shard in zip(files[1:], shards[1:]):
        if set(shard) != set(names):
            missing = sorted(set(names) ^ set(shard))[0]
            raise ModelLoadError(f"{path.name}: shards disagree on tensor {missing!r}")
    return {name: _merge_one(name, [shard[name] for shard in shards], want.get(name), files) for name in names}


def _merge_one(name: str, parts: list[torch.Tensor], want: tuple[int, ...] | None,
               files: list[Path]) -> Weight:
    if parts[0].dim() < 2:
        return parts[0]  # replicated (norms)
    suffix = name.split(".", 2)[-1] if name.startswith("layers.") else name
    dim = _PARALLEL_DIM.get(suffix)
    if dim is None:
        # The embedding (or anything unknown): whichever split yields the expected shape.
        dim = 1
        if want is not None and len(want) == 2 and all(p.dim() == 2 for p in parts):
            for d in (0, 1):
                if sum(p.shape[d] for p in parts) == want[d] and all(
                    p.shape[1 - d] == want[1 - d] for p in parts
                ):
                    dim = d
                    break
    return Concatenated(name, parts, dim, [f.name for f in files])
