"""Reading the JSON files of a model directory, with one-line errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llama_chat.model.errors import ModelLoadError


def first_sentence(e: BaseException) -> str:
    """The first sentence of an exception's message: enough to say what went wrong, on one line."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__
    return lines[0].split(". ")[0][:200]


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or a one-line ModelLoadError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: not valid JSON ({first_sentence(e)})") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data
