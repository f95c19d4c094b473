"""``llama-chat --list``: the shipped model, then the models in the Hugging Face cache and Ollama's
store, one a line.

Reads directories and manifests only: neither torch nor a model is loaded.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from llama_chat.cmd import exit_status
from llama_chat.cmd.startup import silence_stdout
from llama_chat.cmd.sanitize import one_line
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.gguf_header import file_type_name, read_header
from llama_chat.model.stores import StoredModel, hf_cache_dir, list_models, ollama_models_dir


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def short_path(path: Path) -> str:
    """``path`` with the home directory written ``~``, as a shell user would type it."""
    try:
        return "~/" + str(path.relative_to(Path.home()))
    except ValueError:
        return str(path)


def format_of(model: StoredModel) -> str:
    """The model's layout, and for a GGUF file the quantization its header names: ``gguf Q4_K_M``."""
    if model.format != "gguf":
        return model.format
    file = model.path if model.path.is_file() else next(iter(sorted(model.path.glob("*.gguf"))), None)
    try:
        kind = file_type_name(read_header(file).metadata) if file is not None else None
    except ModelLoadError:  # listed all the same; running it says what is wrong
        kind = None
    return f"gguf {kind}" if kind else "gguf"


def print_model_list(out: TextIO, err: TextIO | None = None) -> int:
    """Print the table (the first column is what ``-m`` takes); say on ``err`` where was looked
    when neither store holds a model."""
    models = list_models()
    # Names and paths come from directory and manifest names: shown through one_line like any
    # file-derived text.
    rows = [(one_line(m.name), one_line(format_of(m)), human_size(m.size), one_line(short_path(m.path)))
            for m in models]
    width = max(len("MODEL"), *(len(r[0]) for r in rows))
    kind_width = max(len("FORMAT"), *(len(r[1]) for r in rows))
    try:
        out.write(f"{'MODEL':<{width}}  {'FORMAT':<{kind_width}}  {'SIZE':>8}  PATH\n")
        for name, fmt, size, path in rows:
            out.write(f"{name:<{width}}  {fmt:<{kind_width}}  {size:>8}  {path}\n")
        out.flush()
    except BrokenPipeError:  # `llama-chat --list | head -1`: as one-shot and batch, the status of SIGPIPE
        silence_stdout()
        return exit_status.OUTPUT_CLOSED
    if not any(m.source != "shipped" for m in models):
        (err or sys.stderr).write(
            f"nothing in the Hugging Face cache ({one_line(str(hf_cache_dir()))}) or Ollama's store "
            f"({one_line(str(ollama_models_dir()))})\n")
    return exit_status.OK
