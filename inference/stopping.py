"""When a generation ends, and why: one function of the token just sampled and the request."""

from __future__ import annotations

from llama_chat.inference.types import GenerationState, Request
from llama_chat.model.tokenizer import Tokenizer

# End markers by name, for tokenizers that declare them as special tokens without listing every
# one of them among their stop ids.
STOP_TOKEN_NAMES = ("</s>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")


def stop_ids_of(tokenizer: Tokenizer) -> frozenset[int]:
    """Every id that ends a generation: the tokenizer's stop ids, its eos, and the known names."""
    ids = set(tokenizer.stop_ids)
    if tokenizer.eos_id is not None:
        ids.add(tokenizer.eos_id)
    specials = tokenizer.special_tokens
    ids.update(specials[name] for name in STOP_TOKEN_NAMES if name in specials)
    return frozenset(ids)


def state_after(token_id: int, *, index: int, request: Request, stop_ids: frozenset[int],
                max_seq_len: int) -> GenerationState:
    """The state after generated token ``index`` (0-based) of ``request`` was sampled.

    The token sits at position ``len(prompt) + index``; when that is the last position of the
    context there is no room to feed it back, so the context is full. A stop token wins over the
    budget, and the budget over the context, so the reason shown is the most specific one.
    """
    if token_id in stop_ids:
        return GenerationState.EOS
    if request.max_tokens is not None and index + 1 >= request.max_tokens:
        return GenerationState.MAX_TOKENS
    if len(request.prompt_ids) + index + 1 >= max_seq_len:
        return GenerationState.CONTEXT_FULL
    return GenerationState.IN_PROGRESS
