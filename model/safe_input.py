"""Text and JSON from outside the program, bounded and checked before anything else sees them.

Every JSON document llama-chat reads (a model's config and tokenizer files, an Ollama manifest, a
``--batch`` line, a saved conversation) goes through ``loads``, and every string from outside
that reaches a tokenizer (a prompt, a system message) through ``check_text``:

* nesting at most ``MAX_JSON_DEPTH`` deep (deeper input exhausts Python's parser, which then fails
  with a RecursionError in the middle of whatever called it);
* integers of at most ``MAX_INT_DIGITS`` digits (Python refuses more than 4300 only after doing
  the work, and no real value is that large), numbers that are finite (``1e400`` is read as
  infinity), no ``NaN``/``Infinity`` (not JSON);
* UTF-8 only, and no lone surrogate (``"\\ud800"`` is valid JSON but not text: it cannot be
  encoded, so a tokenizer or a writer fails on it far from where it came in).

The files themselves are opened and bounded by ``ml/safe_files.py``. Errors are ``BadInput``,
a ValueError whose message is one line without the file's name: the caller adds it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

MAX_JSON_DEPTH = 64
MAX_INT_DIGITS = 40

_SURROGATE = re.compile("[\ud800-\udfff]")
# A \u escape of a surrogate in JSON text: only then can a parsed string hold one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Strings, whole: applied only to text the parser accepted, where every quote is closed.
_STRINGS = re.compile(r'"(?:[^"\\]++|\\.)*+"', re.S)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class BadInput(ValueError):
    """Input that is not what it must be; the message is one line."""


class NotText(BadInput):
    """A string that is not text: a lone surrogate, or (from the command line) bytes that are not UTF-8.

    From ``loads``: ``path`` is where the string is in the document (``messages[0].content``;
    "" for the top level), and ``in_key`` says whether it is a field's name rather than a value.
    """

    def __init__(self, message: str, path: str = "", in_key: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.in_key = in_key


def surrogate_at(text: str) -> int | None:
    """The index of the first lone surrogate in ``text``, or None."""
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def check_text(text: str, what: str) -> str:
    """``text`` when it holds no lone surrogate; ``BadInput`` naming ``what`` and where otherwise.

    Python gives a surrogate for each byte of a command-line argument that is not UTF-8 (U+DC80
    to U+DCFF); those are reported as the byte they stand for.
    """
    at = surrogate_at(text)
    if at is None:
        return text
    code = ord(text[at])
    if 0xDC80 <= code <= 0xDCFF:
        raise NotText(f"{what} is not valid UTF-8 (byte 0x{code - 0xDC00:02x} at character {at + 1})")
    raise NotText(f"{what} holds a lone surrogate (U+{code:04X} at character {at + 1}), which is not text")


def _no_constant(name: str) -> Any:
    raise BadInput(f"{name} is not a valid JSON value")


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise BadInput(f"an integer of {digits} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise BadInput(f"the number {text[:24]}{'...' if len(text) > 24 else ''} is too large")
    return value


def _depth(text: str) -> int:
    """How deeply valid JSON ``text`` nests (linear: every string in it is closed)."""
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _strings(value: Any) -> Iterator[tuple[str, str, bool]]:
    """Every string in a parsed document, keys included, as ``(path, string, is_key)``; a key is
    given before anything under it (iterative: the depth is bounded anyway)."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            yield path, item, False
        elif isinstance(item, dict):
            for key, inner in item.items():
                yield path, key, True
                stack.append((f"{path}.{key}" if path else key, inner))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", inner) for i, inner in enumerate(item))


def decode_utf8(data: bytes) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark dropped); ``BadInput`` saying where it is not."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"not UTF-8 (byte 0x{data[e.start]:02x} at byte {e.start + 1})") from None


def loads(data: str | bytes, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` with the bounds above. Raises ``json.JSONDecodeError`` for what is not JSON
    (``.msg`` and ``.colno`` say where) and ``BadInput`` for JSON that breaks a bound."""
    text = decode_utf8(bytes(data)) if isinstance(data, (bytes, bytearray, memoryview)) else data
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_int=_bounded_int, parse_float=_finite_float)
    except RecursionError:
        raise BadInput("nested too deeply") from None
    if text.count("[") + text.count("{") > max_depth and _depth(text) > max_depth:
        raise BadInput(f"nested more than {max_depth} deep")
    if _SURROGATE_ESCAPE.search(text) or _SURROGATE.search(text):
        for path, s, is_key in _strings(value):
            at = surrogate_at(s)
            if at is not None:
                raise NotText(f"a string holds a lone surrogate (U+{ord(s[at]):04X}), which is not text", path, is_key)
    return value


def first_sentence(e: BaseException) -> str:
    """The first sentence of an exception's message: enough to say what went wrong, on one line."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return lines[0].split(". ")[0][:200]


def json_problem(e: Exception) -> str:
    """What ``loads`` found wrong, in a few words: a parser's message with its column, or the bound."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at line {e.lineno} column {e.colno}" if e.lineno > 1 else f"{e.msg} at column {e.colno}"
    return first_sentence(e)


__all__ = ["BadInput", "MAX_INT_DIGITS", "MAX_JSON_DEPTH", "NotText", "check_text", "decode_utf8", "first_sentence",
           "json_problem", "loads", "surrogate_at"]
