"""Where a model's keys sit, measured once, so that q4_0 pages keep what varies in them.

Trained models' keys are far from centred: after the rotary embedding, Gemma 3's keys have a
common part per channel whose norm is half to four fifths of a key's, and a few channels spread
much wider than the rest. Four bits a value, spent on that, leave little for what tells one key
from another. So a q4_0 page keeps ``(k - shift) / scale`` per channel (then rotated, as
``kv_types`` says), both per layer, head and channel, measured from a fixed paragraph at start:

- ``shift`` is the keys' mean. It changes no attention weight: it takes ``q . shift`` from every
  score of a query, and a softmax does not see a constant taken from all its inputs. A model whose
  scores are capped (``c tanh(s / c)``, Gemma 2) does see it, and keeps a zero shift;
- ``scale`` is undone on the query's side, ``q . k = (scale q) . ((k - shift) / scale) + q . shift``,
  as the rotation is. What a score loses is ``sum_i q_i scale_i e_i``, where the rotation makes
  the errors ``e_i`` alike over channels, of a size set by ``sum_j K_j / scale_j^2`` (``K_j``: the
  keys' spread squared, ``Q_i`` the queries' mean square). The product of the two sums is least,
  by Cauchy-Schwarz, at ``scale_i = (K_i / Q_i) ** (1 / 4)``: wide keys kept coarser, channels the
  queries lean on kept finer.

What each part gains on a trained model: ``benchmarks/bench_kv_memory.py quality`` and
docs/benchmarks.md, "KV cache types". A key written under one measure must be read under the
same: the measure is made before the first key is written and never changes for the pages' life.
Any measure gives the same attention weights up to the blocks' rounding, so one kept from an
earlier run of the same file (``of_model``'s ``source``, in the user cache) serves as well as a new
one, and saves the start a forward of the paragraph.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from llama_chat.ml.kv_centers import KeyCenters
from llama_chat.ml.user_cache import user_cache_dir
from llama_chat.model.paged_kv_cache import PagedBatch, PagedKVCache

# Any prose does: what is measured is where the model puts its keys and queries, not what the
# text says.
CALIBRATION_TEXT = (
    "The river ran low that autumn, and the village watched the stones come up one by one. "
    "Mara kept a notebook of them: the flat grey one shaped like a boat, the white one with a "
    "ring around it, the heap of small ones where the old mill had stood. Her brother said it "
    "was a waste of paper. She said that when the rain came back, nobody would remember what "
    "the bottom of the river looked like, and somebody ought to. In November the rain did come "
    "back, for three days without stopping, and the stones went under again. Mara read her "
    "notes aloud at supper. Her brother listened to all of them, and asked for the one about "
    "the boat twice.")
_PAGE = 16  # the measuring pass's pages (its own pool, thrown away)
# What a kept measure was made by: a change to the paragraph or the formula changes it, and the
# measures kept before are then not read.
MEASURE_VERSION = 1


def of_model(model, tokenizer, *, source: str | Path | None = None) -> KeyCenters | None:
    """``measure`` over ``CALIBRATION_TEXT`` as ``tokenizer`` reads it; None for a tokenizer that
    cannot encode text (a test's ids-only stand-in), whose keys are then kept as they are. With
    the ``source`` file or folder the model was loaded from, the measure is kept in the user cache
    and read back by later runs of the same files."""
    from llama_chat.model.tokenizers.base import encode_prompt

    if not callable(getattr(tokenizer, "encode", None)):
        return None
    ids = encode_prompt(tokenizer, CALIBRATION_TEXT)
    kept = kept_path(model, ids, source)
    found = None if kept is None else read_kept(kept, model)
    if found is not None:
        return found
    measured = measure(model, ids)
    if kept is not None:
        keep(kept, measured)
    return measured


def kept_path(model, ids: Sequence[int], source: str | Path | None) -> Path | None:
    """Where the measure of ``model`` loaded from ``source`` is kept: named by the files' paths,
    sizes and times, the model's shape, the paragraph's ids and ``MEASURE_VERSION``."""
    if source is None:
        return None
    try:
        root = Path(source).resolve()
        files = sorted(p for p in root.iterdir() if p.is_file()) if root.is_dir() else [root]
        stats = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    except OSError:
        return None
    named = "|".join([str(MEASURE_VERSION), str(root), *stats, repr(model.args), ",".join(map(str, ids))])
    return user_cache_dir("key-centers") / f"{hashlib.sha256(named.encode()).hexdigest()[:32]}.pt"


def read_kept(path: Path, model) -> KeyCenters | None:
    """The measure kept at ``path``, or None where there is none or it does not fit ``model``."""
    try:
        kept = torch.load(path, weights_only=True)
        centers = KeyCenters([t.float().contiguous() for t in kept["shift"]],
                             [t.float().contiguous() for t in kept["scale"]])
    except Exception:  # noqa: BLE001 - a file that is no measure (cut short, another's) means: measure anew
        return None
    a = model.args
    shape = (a.n_kv_heads, a.head_dim)
    fits = (len(centers.shift) == len(centers.scale) == a.n_layers
            and all(t.shape == shape for t in (*centers.shift, *centers.scale))
            and all(bool(torch.isfinite(t).all()) for t in (*centers.shift, *centers.scale))
            and all(bool((t > 0).all()) for t in centers.scale))
    return centers if fits else None


def keep(path: Path, centers: KeyCenters) -> None:
    """Write the measure at ``path`` whole or not at all (a reader never sees half a file); a
    cache that cannot be written costs the next run a measure, nothing else."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.part")
    try:
        torch.save({"shift": centers.shift, "scale": centers.scale}, partial)
        os.replace(partial, path)
    except OSError:
        partial.unlink(missing_ok=True)


def measure(model, ids: Sequence[int]) -> KeyCenters:
    """``model``'s keys and queries over ``ids`` (their first token left out: a first token's key
    is often an outlier that every later query leans on), one forward into float32 pages."""
    a = model.args
    ids = list(ids)[:a.max_seq_len]
    if len(ids) < 3:
        raise ValueError(f"measuring where keys sit needs at least 3 tokens, got {len(ids)}")
    device = next(model.parameters()).device
    n, pages = len(ids), -(-len(ids) // _PAGE)
    cache = PagedKVCache.for_model(a, pages + 1, _PAGE, device=device, dtype=torch.float32)
    arange = torch.arange(n, device=device)
    view = cache.view(PagedBatch(arange + _PAGE, arange, 0, None,
                                 ((0, n, torch.arange(1, pages + 1, device=device), 0),)))
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    attend = view.attend

    def recording(layer, q, k, v, *rule):
        seen[layer] = (q[0, :, 1:].float().cpu(), k[0, :, 1:].float().cpu())
        return attend(layer, q, k, v, *rule)

    view.attend = recording
    with torch.inference_mode():
        model(torch.tensor([ids], device=device), arange.unsqueeze(0), view)
    shifts, scales = [], []
    for layer in range(a.n_layers):
        queries, keys = seen[layer]
        shift, scale = of_keys(keys, queries, shifted=a.attention_softcap is None)
        shifts.append(shift)
        scales.append(scale)
    return KeyCenters(shifts, scales)


def of_keys(keys: torch.Tensor, queries: torch.Tensor | None = None, *,
            shifted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The shift and scale, ``(kv_heads, head_dim)`` each, of keys ``(kv_heads, positions,
    head_dim)`` met by ``queries`` (``(heads, positions, head_dim)``, a group of heads a key head;
    None: alike in every channel): the keys' mean (zero where not ``shifted``), and
    ``(K / Q) ** (1 / 4)`` with a head's scales of geometric mean one."""
    shift = keys.mean(dim=1) if shifted else keys.new_zeros(keys.shape[0], keys.shape[2])
    spread = (keys - shift.unsqueeze(1)).square().mean(dim=1)
    leaned = torch.ones_like(spread) if queries is None else (
        queries.square().mean(dim=1).view(keys.shape[0], -1, keys.shape[2]).mean(dim=1))
    ratio = at_least_a_millionth(spread) / at_least_a_millionth(leaned)
    scale = ratio ** 0.25
    scale = scale / scale.log().mean(dim=-1, keepdim=True).exp()
    return shift.contiguous(), scale.contiguous()


def at_least_a_millionth(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each head's channels raised to a millionth of its largest: a channel that never
    moves must not make a scale of nothing (nor of infinity)."""
    return x.clamp_min(x.amax(dim=-1, keepdim=True).clamp_min(1e-12) * 1e-6)


__all__ = ["CALIBRATION_TEXT", "KeyCenters", "MEASURE_VERSION", "keep", "kept_path", "measure", "of_keys", "of_model",
           "read_kept"]
