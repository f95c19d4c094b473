"""Where llama-chat keeps what it builds for this machine: compiled steps, CPU kernels."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/llama-chat/<name>``, by default under ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llama-chat" / name
