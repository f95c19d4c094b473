"""Reading the JSON files of a model directory, with one-line errors that name the file.

A model's JSON files come from wherever the model came from, so they are read defensively: a
size bound (tokenizer.json files run to tens of MB; a config is a few KB), no ``NaN``/``Infinity``
(not JSON, and never a sensible config value), integers of at most 40 digits (Python refuses
more than 4300 only after doing the work, and no real field is that large), and nesting deep
enough to exhaust the parser is a bad file like any other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llama_chat.model.errors import ModelLoadError

MAX_JSON_BYTES = 256 * 1024 * 1024
MAX_INT_DIGITS = 40


def first_sentence(e: BaseException) -> str:
    """The first sentence of an exception's message: enough to say what went wrong, on one line."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return lines[0].split(". ")[0][:200]


class _BadValue(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _BadValue(f"{name} is not a valid JSON value")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _BadValue(f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def loads(text: str | bytes) -> Any:
    """``json.loads`` with the limits above; ValueError (or RecursionError) when they are broken."""
    return json.loads(text, parse_constant=_no_constant, parse_int=_bounded_int)


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or a one-line ModelLoadError naming the file."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_JSON_BYTES + 1)
        if len(raw) > MAX_JSON_BYTES:
            raise ModelLoadError(f"{path}: larger than {MAX_JSON_BYTES // 2**20} MiB, not a model's JSON file")
        data = loads(raw.decode("utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except RecursionError:
        raise ModelLoadError(f"{path}: not valid JSON (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ModelLoadError(f"{path}: not valid JSON ({first_sentence(e)})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
