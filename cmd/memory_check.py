"""The options that size a run's caches (``-c``, ``--cache-tokens``, ``--max-batch``), checked
against the memory the machine has left once the model is loaded (``model/memory_budget.py``):
a value that cannot fit is a usage error in one line, before anything is allocated."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_chat.cmd.inputs import UsageProblem
from llama_chat.model import memory_budget

if TYPE_CHECKING:
    from llama_chat.cmd.options import Options


def check_memory(opts: Options, loaded) -> None:
    """``UsageProblem`` naming the first option whose buffers need more than the memory available."""
    model = getattr(loaded, "model", None)
    if model is None:  # a remote model: its server sizes its own caches
        return
    batch = getattr(opts, "batch", None) is not None
    ctx = getattr(opts, "ctx_size", None)
    sizes = memory_budget.CacheSizes(
        ctx_tokens=model.args.max_seq_len if ctx is not None and not batch else None,
        beams=max(1, getattr(opts, "num_beams", 1)),
        cache_tokens=getattr(opts, "cache_tokens", None) if batch else None,
        max_batch=getattr(opts, "max_batch", None) if batch else None)
    try:
        memory_budget.check(model, sizes)
    except memory_budget.TooLarge as e:
        raise UsageProblem(str(e)) from None
