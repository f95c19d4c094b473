"""Where llama-chat keeps what it builds for this machine: compiled steps, CPU kernels.

A home directory can be read-only, or hold a file where the cache directory should be. Nothing
kept here is needed, only faster: ``user_cache_dir`` then gives a private temporary directory for
this process instead (what is built there is lost at exit), and ``cache_problem`` says why, so
the command can say it in one line; the CPU kernels' builder checks its own directory with
``writable_dir`` and falls back to PyTorch's products instead.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_fallbacks: dict[str, tuple[Path, str]] = {}


def wanted_cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/llama-chat/<name>``, by default under ``~/.cache``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llama-chat" / name


def writable_dir(path: Path) -> Path:
    """``path``, made if missing, when it is a directory this process can write; OSError otherwise."""
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(13, "Permission denied", str(path))
    return path


def user_cache_dir(name: str) -> Path:
    """The cache directory for ``name`` (``wanted_cache_dir``), made if missing; a temporary one
    for this process when it cannot be made or written (``cache_problem`` then says why)."""
    wanted = wanted_cache_dir(name)
    if name in _fallbacks:
        return _fallbacks[name][0]
    try:
        return writable_dir(wanted)
    except OSError as e:
        fallback = Path(tempfile.mkdtemp(prefix=f"llama-chat-{name}-"))
        _fallbacks[name] = (fallback, f"cannot write {wanted} ({e.strerror or e})")
        return fallback


def cache_problem(name: str) -> str | None:
    """Why ``user_cache_dir(name)`` gave a temporary directory, or None."""
    found = _fallbacks.get(name)
    return None if found is None else found[1]
