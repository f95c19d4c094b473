"""``llama-chat --list``: the models in the Hugging Face cache and Ollama's store, one a line.

Reads directories and manifests only: neither torch nor a model is loaded.
"""

from __future__ import annotations

from typing import TextIO

from llama_chat.cmd import exit_status
from llama_chat.cmd.sanitize import one_line
from llama_chat.model.stores import hf_cache_dir, list_models, ollama_models_dir


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def print_model_list(out: TextIO) -> int:
    """Print the table (the first column is what ``-m`` takes); say where was looked when empty."""
    models = list_models()
    if not models:
        out.write(f"no models found in the Hugging Face cache ({one_line(str(hf_cache_dir()))}) or Ollama's "
                  f"store ({one_line(str(ollama_models_dir()))})\n")
        return exit_status.OK
    # Names come from directory and manifest names: shown through one_line like any file-derived text.
    rows = [(one_line(m.name), m.format, human_size(m.size)) for m in models]
    width = max(len("MODEL"), *(len(r[0]) for r in rows))
    out.write(f"{'MODEL':<{width}}  FORMAT  SIZE\n")
    for name, fmt, size in rows:
        out.write(f"{name:<{width}}  {fmt:<6}  {size:>8}\n")
    return exit_status.OK
