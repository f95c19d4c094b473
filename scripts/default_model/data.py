"""Token streams for training: every segment wrapped in ``<s>`` ... ``</s>``, then packed end to end."""

from __future__ import annotations

from collections.abc import Iterable

import sentencepiece as spm
import torch


def encode_documents(sp: spm.SentencePieceProcessor, docs: Iterable[list[str]]) -> torch.Tensor:
    """One flat int64 stream; documents simply follow each other (no padding, nothing wasted)."""
    ids: list[int] = []
    bos, eos = sp.bos_id(), sp.eos_id()
    for doc in docs:
        for segment in doc:
            ids.append(bos)
            ids.extend(sp.encode(segment))
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def random_windows(stream: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """``(batch, seq_len + 1)`` windows at random offsets: inputs are ``[:, :-1]``, targets ``[:, 1:]``."""
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return stream[starts.unsqueeze(1) + offsets]


def fixed_windows(stream: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """Evenly spaced windows, the same every time: the validation set."""
    step = max(1, (stream.numel() - seq_len - 1) // count)
    starts = torch.arange(count) * step
    return stream[starts.unsqueeze(1) + torch.arange(seq_len + 1)]
