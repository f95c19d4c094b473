"""The blocking half of generation: one forward over some rows, then one sampled token per row.

These functions run in a worker thread, one call per forward, so that everything between two calls
(cancellation, sending into the channel, rendering) happens in async code. They take and return
plain Python values; the tensors they build never leave the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from llama_chat.ml.sampling import SamplingParams, sample
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.transformer import Transformer

Sampler = Callable[[torch.Tensor, SamplingParams, torch.Generator], torch.Tensor]


class ModelStep:
    """A model with its KV cache: token runs at given positions in, last-position logits out.

    Each row is a run of consecutive tokens starting at its own position, the shape continuous
    batching needs; the single-prompt path uses one row. The cache is preallocated for
    ``max_seq_len`` and reused from one request to the next: a new request starts at position 0
    and the model's mask never reads positions past the ones it has written.
    """

    def __init__(self, model: Transformer, *, rows: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        first = next(model.parameters())
        self.model = model
        self.device = torch.device(device) if device is not None else first.device
        self.dtype = dtype or first.dtype
        self.max_seq_len = model.args.max_seq_len
        self.vocab_size = model.args.vocab_size
        self.cache = KVCache.for_model(model.args, rows, device=self.device, dtype=self.dtype)

    def forward(self, rows: Sequence[Sequence[int]], starts: Sequence[int]) -> torch.Tensor:
        """Logits ``(len(rows), vocab)`` for the last token of each row (rows of equal length)."""
        # inference_mode is thread-local: it must be entered in the thread that runs the forward.
        with torch.inference_mode():
            tokens = torch.tensor(rows, dtype=torch.long, device=self.device)
            offsets = torch.arange(tokens.shape[1], device=self.device)
            positions = torch.tensor(starts, dtype=torch.long, device=self.device).unsqueeze(1) + offsets
            return self.model(tokens, positions, self.cache, last_only=True)[:, -1, :]

    def forward_and_sample(self, rows: Sequence[Sequence[int]], starts: Sequence[int],
                           params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
                           sampler: Sampler = sample) -> list[int]:
        """One forward, then one token per row, each with its own settings and generator.

        Sampling happens in the same worker call as the forward: one thread hop per token, and
        the only host sync is reading the sampled ids back.
        """
        with torch.inference_mode():
            logits = self.forward(rows, starts)
            if len(rows) == 1:
                return [int(sampler(logits, params[0], generators[0])[0])]
            return [int(sampler(logits[i:i + 1], p, g)[0])
                    for i, (p, g) in enumerate(zip(params, generators))]
