"""Where a model's keys sit, measured once, so that q4_0 pages keep what varies in them.

Trained models' keys are far from centred: after the rotary embedding, Gemma 3's keys have a
common part per channel whose norm is half to four fifths of a key's, and a few channels spread
much wider than the rest. Four bits a value, spent on that, leave little for what tells one key
from another. So a q4_0 page keeps ``(k - shift) / scale`` per channel (then rotated, as
``kv_types`` says), where ``shift`` is the keys' mean and ``scale`` a power of their spread, both
per layer, head and channel, measured from a fixed paragraph at start:

- the shift changes no attention weight: it takes ``q . shift`` from every score of a query, and
  a softmax does not see a constant taken from all its inputs. A model whose scores are capped
  (``c tanh(s / c)``, Gemma 2) does see it, and keeps a zero shift;
- the scale is undone on the query's side, ``q . k = (scale q) . ((k - shift) / scale) + q . shift``,
  as the rotation is.

What each part gains on a trained model: ``benchmarks/bench_kv_memory.py quality`` and
docs/benchmarks.md, "KV cache types". A key written under one measure must be read under the
same: the measure is made before the first key is written and never changes for the pages' life.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llama_chat.model.kv_cache import KVCache

# Any prose does: what is measured is where the model puts its keys, not what the text says.
CALIBRATION_TEXT = (
    "The river ran low that autumn, and the village watched the stones come up one by one. "
    "Mara kept a notebook of them: the flat grey one shaped like a boat, the white one with a "
    "ring around it, the heap of small ones where the old mill had stood. Her brother said it "
    "was a waste of paper. She said that when the rain came back, nobody would remember what "
    "the bottom of the river looked like, and somebody ought to. In November the rain did come "
    "back, for three days without stopping, and the stones went under again. Mara read her "
    "notes aloud at supper. Her brother listened to all of them, and asked for the one about "
    "the boat twice.")
# The scale is the channel's spread to this power: the whole spread (1) divides out the wide
# channels' share of the scores' error too far, none (0) leaves them setting the blocks' scales.
SPREAD_POWER = 0.75


@dataclass(frozen=True)
class KeyCenters:
    """Per layer, ``(kv_heads, head_dim)`` float32: a q4_0 page keeps ``(k - shift) / scale``."""

    shift: list[torch.Tensor]
    scale: list[torch.Tensor]


def of_model(model, tokenizer) -> KeyCenters | None:
    """``measure`` over ``CALIBRATION_TEXT`` as ``tokenizer`` reads it; None for a tokenizer that
    cannot encode text (a test's ids-only stand-in), whose keys are then kept as they are."""
    from llama_chat.model.tokenizers.base import encode_prompt

    if not callable(getattr(tokenizer, "encode", None)):
        return None
    return measure(model, encode_prompt(tokenizer, CALIBRATION_TEXT))


def measure(model, ids: Sequence[int]) -> KeyCenters:
    """``model``'s keys over ``ids`` (their first token left out: a first token's key is often
    an outlier that every later query leans on), one forward into a float32 cache."""
    a = model.args
    ids = list(ids)[:a.max_seq_len]
    if len(ids) < 3:
        raise ValueError(f"measuring where keys sit needs at least 3 tokens, got {len(ids)}")
    device = next(model.parameters()).device
    cache = KVCache.for_model(a, 1, max_seq_len=len(ids), device=device, dtype=torch.float32)
    with torch.inference_mode():
        model(torch.tensor([ids], device=device), torch.arange(len(ids), device=device).unsqueeze(0), cache)
    shifts, scales = [], []
    for keys in cache.keys:
        shift, scale = of_keys(keys[0, :, 1:].float().cpu(), shifted=a.attention_softcap is None)
        shifts.append(shift)
        scales.append(scale)
    return KeyCenters(shifts, scales)


def of_keys(keys: torch.Tensor, *, shifted: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The shift and scale, ``(kv_heads, head_dim)`` each, of keys ``(kv_heads, positions,
    head_dim)``: their mean (zero where not ``shifted``), and their spread about it to
    ``SPREAD_POWER``, a head's scales of geometric mean one."""
    shift = keys.mean(dim=1) if shifted else keys.new_zeros(keys.shape[0], keys.shape[2])
    spread = (keys - shift.unsqueeze(1)).square().mean(dim=1).sqrt()
    spread = spread.clamp_min(spread.amax(dim=-1, keepdim=True).clamp_min(1e-6) * 1e-3)
    scale = spread ** SPREAD_POWER
    scale = scale / scale.log().mean(dim=-1, keepdim=True).exp()
    return shift.contiguous(), scale.contiguous()


__all__ = ["CALIBRATION_TEXT", "KeyCenters", "SPREAD_POWER", "measure", "of_keys", "of_model"]
