"""Reading the JSON files of a model directory, with one-line errors that name the file.

A model's JSON files come from wherever the model came from, so they are read by the rules every
outside input follows (``model/safe_input.py``: bounded nesting and integers, finite numbers, no
``NaN``/``Infinity``, text that is text) from a regular file of bounded size
(``ml/safe_files.py``: tokenizer.json files run to tens of MB; a config is a few KB).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from llama_chat.ml.safe_files import UnsafeFile, read_regular, size_text
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.safe_input import MAX_INT_DIGITS, BadInput, first_sentence, loads

MAX_JSON_BYTES = 256 * 1024 * 1024


def read_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES, what: str = "a model's JSON file") -> dict[str, Any]:
    """A JSON object from ``path``, or a one-line ModelLoadError naming the file."""
    try:
        data = loads(read_regular(path, max_bytes))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except UnsafeFile as e:
        if e.errno == errno.EFBIG:
            raise ModelLoadError(f"{path}: larger than {size_text(max_bytes)}, not {what}") from None
        raise ModelLoadError(f"{path}: cannot read it ({e.strerror})") from None
    except (OSError, ValueError) as e:  # JSONDecodeError and BadInput are ValueErrors
        raise ModelLoadError(f"{path}: not valid JSON ({first_sentence(e)})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


__all__ = ["MAX_INT_DIGITS", "MAX_JSON_BYTES", "BadInput", "first_sentence", "loads", "read_json"]
