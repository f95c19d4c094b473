"""The options that size a run's caches (``-c``, ``--cache-tokens``, ``--max-batch``), checked
against the memory the machine has left once the model is loaded (``model/memory_budget.py``):
a value that cannot fit is a usage error in one line, before anything is allocated."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_chat.cmd.inputs import UsageProblem
from llama_chat.model import memory_budget

if TYPE_CHECKING:
    from llama_chat.cmd.source_settings import LoadSettings


def check_memory(settings: LoadSettings, loaded) -> None:
    """``UsageProblem`` naming the first option whose buffers need more than the memory available."""
    model = getattr(loaded, "model", None)
    if model is None:  # a remote model: its server sizes its own caches
        return
    room = settings.room
    sizes = memory_budget.CacheSizes(
        ctx_tokens=model.args.max_seq_len if settings.ctx_size is not None and not room.batch else None,
        beams=max(1, room.beams),
        cache_tokens=room.cache_tokens if room.batch else None,
        max_batch=room.max_batch if room.batch else None)
    try:
        memory_budget.check(model, sizes)
    except memory_budget.TooLarge as e:
        raise UsageProblem(str(e)) from None
