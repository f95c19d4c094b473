"""What a cache holds, matched against the next prompt: for a chat's turns, one after another.

The scheduler's page table remembers which tokens it last wrote; a chat's next prompt is first
aligned to them here, so that the model's own tokens are reused where they spell the same text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def align_to_cached(ids: Sequence[int], cached: Sequence[int], token_bytes: Callable[[int], bytes]) -> list[int]:
    """``ids``, with its start replaced by the ``cached`` tokens that spell the same bytes.

    A reply's tokens are the ones the model sampled, and encoding the reply's text again for
    the next turn often splits it differently (a small or random model rarely samples the
    tokenizer's own split). Compared id by id, the cache would then match only up to the
    reply, and every turn would prefill the previous reply again. Compared byte by byte at
    token boundaries, the model keeps its own tokens, as a chat that keeps its token history
    does. Tokens without bytes (control and stop tokens) match only by id.
    """
    n = 0
    for a, b in zip(ids, cached):
        if a != b:
            break
        n += 1
    i = j = n
    seen_cached, seen_ids = bytearray(), bytearray()
    best = (n, n)  # the last pair of token boundaries where both sides spell the same bytes
    while True:
        if len(seen_cached) == len(seen_ids):
            best = (i, j)
            if i == len(cached) or j == len(ids):
                break
            if not token_bytes(cached[i]) or not token_bytes(ids[j]):
                if cached[i] != ids[j]:
                    break
                i, j = i + 1, j + 1
                continue
        if len(seen_cached) < len(seen_ids):
            piece = token_bytes(cached[i]) if i < len(cached) else b""
            seen_cached += piece
            i += 1
        else:
            piece = token_bytes(ids[j]) if j < len(ids) else b""
            seen_ids += piece
            j += 1
        common = min(len(seen_cached), len(seen_ids))
        if not piece or seen_cached[:common] != seen_ids[:common]:
            break
    i, j = best
    return list(cached[:i]) + list(ids[j:])

