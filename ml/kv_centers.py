"""The record of where a model's keys sit (``model/key_centers.py`` measures it): what a q4_0
page keeps of a key is ``(k - shift) / scale``, per layer, head and channel. The cache's forward
(``model/paged_kv_cache.py``) and the CPU operator (``ml/cpu/decode.py``) both read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KeyCenters:
    """Per layer, ``(kv_heads, head_dim)`` float32: a q4_0 page keeps ``(k - shift) / scale``."""

    shift: list[torch.Tensor]
    scale: list[torch.Tensor]
