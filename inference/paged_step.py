"""The scheduler's compiled decode step for a sequence running alone: a chat's reply, the last job.

The packed paged step (``batch_core.py``) runs eagerly: its shapes change with every mix of jobs.
A lone one-token row whose pages are consecutive is different. Its keys are one slice of the page
pool, ``(kv_heads, slots, head_dim)`` from its first page on, and written at its position in that
slice they are exactly the dense cache the static decode step (``decode_step.py``) attends over.
So it gets the same compiled graph: the cache handed to it is a window of views into the pool,
from the sequence's first page for ``WINDOW_STEP``-rounded lengths (a symbolic size: one graph
serves every window and every first page), and the keys it writes land in the sequence's own
pages, where the packed step and the prefix cache find them.

Slots in the window past the sequence's position belong to other pages (another sequence's keys,
or nothing yet); the static step's mask hides them, as it hides a dense cache's unused tail.
"""

from __future__ import annotations

import torch

from llama_chat.inference import decode_step
from llama_chat.inference.decode_step import WINDOW_STEP, compile_failure_text, use_persistent_compile_cache
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedKVCache
from llama_chat.model.transformer import Transformer


class LoneRowStep:
    """``logits(token, position, first_page)``: one compiled step of a lone sequence whose pages
    are consecutive from ``first_page``; ``None`` where the window would run off the pool."""

    def __init__(self, model: Transformer, cache: PagedKVCache, *, row_products: bool,
                 backend: str = "inductor") -> None:
        self.model = model
        self.cache = cache
        self.row_products = row_products
        self.slots = cache.num_pages * cache.page_size
        self.failure: str | None = None  # why compiling failed, once it has
        self._windows: dict[tuple[int, int], KVCache] = {}
        self._compiled = False  # guards are skipped only once there is a graph to run
        self.steps = 0  # steps it has run
        use_persistent_compile_cache()
        options = {"cpp_wrapper": True} if backend == "inductor" and cache.device.type == "cpu" else {}
        extra = {"options": options} if options else {}
        self._run = torch.compile(self._forward, backend=backend, fullgraph=True, dynamic=False, **extra)
        model.rope_tables(cache.device)  # built now, or the first trace would guard on its absence

    def warm_up(self) -> bool:
        """Compile now (at a position of the scratch page); whether the step can be used."""
        if self.failure is None:
            with torch.inference_mode():
                self.logits(0, 0, SCRATCH_PAGE)
        return self.failure is None

    def logits(self, token: int, position: int, first_page: int) -> torch.Tensor | None:
        """``(1, vocab)`` float logits of the token after ``token`` fed at ``position``, or None
        (the window does not fit, or compiling failed: take the packed step)."""
        if self.failure is not None:
            return None
        window = self._window(first_page, position)
        if window is None:
            return None
        device = self.cache.device
        tokens = torch.tensor([[token]], dtype=torch.long, device=device)
        positions = torch.tensor([[position]], dtype=torch.long, device=device)
        try:
            if decode_step.SKIP_GUARDS and self._compiled:
                # As the static step does: the guards cost more than a small model's step.
                with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    logits = self._run(tokens, positions, window)
            else:
                logits = self._run(tokens, positions, window)
                self._compiled = True
            self.steps += 1
            return logits
        except Exception as exc:  # noqa: BLE001 - any compiler failure means the same: go eager
            self.failure = compile_failure_text(exc)
            return None

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, window: KVCache) -> torch.Tensor:
        logits = self.model(tokens, positions, window, last_only=True, static=True,
                            row_products=self.row_products, window=window.keys[0].shape[2])
        return logits[:, -1]

    def _window(self, first_page: int, position: int) -> KVCache | None:
        start = first_page * self.cache.page_size
        length = min((position // WINDOW_STEP + 1) * WINDOW_STEP, self.slots - start)
        if length <= position:
            return None
        key = (start, length)
        window = self._windows.get(key)
        if window is None:
            if len(self._windows) > 64:
                self._windows.clear()
            window = KVCache.over(self.cache.slice_views(start, length))
            self._windows[key] = window
        return window
