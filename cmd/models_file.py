"""``serve --models FILE``: the models to serve, and each one's settings, in TOML.

::

    [[model]]
    alias = "coder"                      # the name requests use (default: the file's or folder's)
    path = "models/coder-7b.Q4_K_M.gguf" # as -m names a model; relative: to this file's folder
    context = 8192                       # -c
    cache_type = "q8_0"                  # --cache-type
    draft = "models/coder-0.5b.gguf"     # --draft
    template = "auto"                    # --template
    keep_alive = "30m"                   # --keep-alive, this model's
    pinned = true                        # loaded at start, never unloaded for room or idleness

    [[model]]
    alias = "big"
    path = "openai:http://gpu-box:8000/v1#Qwen2.5-72B-Instruct"   # another server's model
    api_key = "..."                      # its server's key (default: $OPENAI_API_KEY)

Every problem is one line naming the file and the model: a key it does not know, a value of the
wrong type or outside its range, a path that is not there, two models under one alias.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llama_chat.cmd.models import ModelEntry, ModelSettings, check_names, keep_alive_seconds, model_entry
from llama_chat.inference.remote import is_remote
from llama_chat.ml.controls import CACHE_TYPES, ControlError, check
from llama_chat.model.chat_format import FORMAT_NAMES


class ModelsFileError(ValueError):
    """A models file that cannot be served; the message is one line."""


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("expected a text")
    return value


def _choice(choices: tuple[str, ...]) -> Callable[[Any], str]:
    def read(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value
    return read


def _context(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("expected a number of tokens")
    try:
        return check("ctx_size", value)
    except ControlError as e:
        raise ValueError(e.reason) from None


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


# Each key a model's table may have, and how its value is read.
KEYS: dict[str, Callable[[Any], Any]] = {
    "path": _text, "alias": _text, "context": _context, "cache_type": _choice(CACHE_TYPES), "draft": _text,
    "template": _choice(FORMAT_NAMES), "keep_alive": keep_alive_seconds, "pinned": _flag, "api_key": _text}


# What only a model of this process takes (another server loads and sizes its own).
LOCAL_KEYS = ("context", "cache_type", "draft", "template", "keep_alive", "pinned")


def read_models_file(file: Path) -> list[ModelEntry]:
    """The models ``file`` lists, in its order; ``ModelsFileError`` (one line) for anything wrong.
    A missing model is ``ModelLoadError``, as for ``-m``, with the file and the model named."""
    from llama_chat.model.errors import ModelLoadError

    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        raise ModelsFileError(f"--models {file}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ModelsFileError(f"--models {file}: not TOML: {e}") from None
    unknown = sorted(set(data) - {"model"})
    if unknown:
        raise ModelsFileError(f"--models {file}: unknown key {unknown[0]!r} (a model is a [[model]] table)")
    tables = data.get("model")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ModelsFileError(f"--models {file}: no [[model]] table in it")
    entries = []
    for number, table in enumerate(tables, 1):
        where = f"--models {file}: model {number}"
        values = _values(table, where)
        if "path" not in values:
            raise ModelsFileError(f"{where}: no path (the model's file or folder, as -m names it, or openai:URL)")
        source = _source(values["path"], file.parent)
        if "api_key" in values and not is_remote(source):
            raise ModelsFileError(f"{where}: api_key is a remote model's (openai:URL)")
        local = [key for key in LOCAL_KEYS if key in values]
        if local and is_remote(source):
            raise ModelsFileError(f"{where}: {local[0]} is a local model's; {source} is another server's")
        settings = ModelSettings(context=values.get("context"), cache_type=values.get("cache_type"),
                                 draft=_source(values["draft"], file.parent) if "draft" in values else None,
                                 template=values.get("template"), keep_alive_s=values.get("keep_alive"),
                                 pinned=values.get("pinned", False), api_key=values.get("api_key"))
        try:
            entries.append(model_entry(values.get("alias"), source, settings))
        except ModelLoadError as e:
            raise ModelLoadError(f"{where}: {e}") from None
    try:
        check_names(entries)
    except ValueError as e:
        raise ModelsFileError(f"--models {file}: {e}") from None
    return entries


def _values(table: dict[str, Any], where: str) -> dict[str, Any]:
    values = {}
    for key, value in table.items():
        read = KEYS.get(key)
        if read is None:
            raise ModelsFileError(f"{where}: unknown key {key!r} (the keys are {', '.join(KEYS)})")
        try:
            values[key] = read(value)
        except ValueError as e:
            raise ModelsFileError(f"{where}: {key}: {str(e).removeprefix('keep_alive: ')}") from None
    return values


def _source(path: str, folder: Path) -> str:
    """A path relative to the models file's folder where something is there, else as -m reads it
    (a name ``--list`` shows, a Hugging Face id, ``ollama:NAME``, ``openai:URL``)."""
    if is_remote(path) or Path(path).expanduser().is_absolute():
        return path
    beside = folder / path
    return str(beside) if beside.exists() else path


__all__ = ["KEYS", "ModelsFileError", "read_models_file"]
