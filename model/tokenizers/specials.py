"""Special-token helpers shared by the backends and chat formats."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any


def split_on_specials(text: str, specials: Mapping[str, int]) -> Iterator[tuple[str, int | None]]:
    """Yield ``(text, None)`` for plain stretches and ``(name, id)`` for each special token.

    Longer names are tried first so that ``<|eot_id|>`` never matches as a shorter prefix token.
    """
    if not specials:
        if text:
            yield text, None
        return
    pattern = _alternation(tuple(sorted(specials, key=len, reverse=True)))
    pos = 0
    for match in pattern.finditer(text):
        if match.start() > pos:
            yield text[pos:match.start()], None
        yield match.group(), specials[match.group()]
        pos = match.end()
    if pos < len(text):
        yield text[pos:], None


@lru_cache(maxsize=8)
def _alternation(names: tuple[str, ...]) -> re.Pattern[str]:
    # Compiled once per vocabulary: chat templates are tokenized on every turn.
    return re.compile("|".join(re.escape(name) for name in names))


def token_name(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, ``{"content": ...}`` or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
