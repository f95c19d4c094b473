"""Reading files that anyone could have put there: one rule for every file llama-chat reads.

A path handed to llama-chat (a batch file, a saved conversation, a cache entry, a store's
manifest, a build marker) may name something that is not a file at all. A FIFO blocks a reader
forever, ``/dev/zero`` never ends, a symlink can lead out of the directory it sits in, and a file
can be far larger than what it claims to be. So every read goes through here:

* the file is opened with ``O_NONBLOCK`` (opening a FIFO then returns at once) and ``fstat`` must
  say it is a regular file before a byte is read; devices, FIFOs, sockets and directories are
  refused, by name;
* its size is checked against a bound before it is read, and the read itself stops one byte past
  the bound (a file can grow while it is read);
* where a file must stay inside a directory (a cache entry, a store), its symlinks are resolved
  and the result checked to be under the directory's own resolved path;
* what is written is written to a temporary name beside the target and renamed into place, so a
  reader beside the writer sees all of it or nothing.

Standard library only: the command line, the model stores and the CPU operator's cache all use it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO


class UnsafeFile(OSError):
    """A path that is not a readable file of the expected kind or size; ``strerror`` is the reason,
    one line, so callers that report ``e.strerror`` say it as they say any other OSError."""

    def __init__(self, reason: str, path: str | os.PathLike | None = None, code: int = errno.EINVAL) -> None:
        super().__init__(code, reason, None if path is None else os.fspath(path))


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` is, in words: "a FIFO", "a directory" ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def size_text(n: int) -> str:
    """A byte count as the messages write bounds: ``64 MiB``, ``4 KiB``, ``100 bytes``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n:,} bytes"


def _refuse_unless_regular(st: os.stat_result, path) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"not a regular file ({kind_of(st.st_mode)})", path)


def require_regular(path: str | os.PathLike) -> os.stat_result:
    """``path``'s stat (symlinks followed) when it is a regular file; ``UnsafeFile`` otherwise.
    Nothing is opened, so a FIFO cannot block here."""
    st = os.stat(path)
    _refuse_unless_regular(st, path)
    return st


def open_regular(path: str | os.PathLike, *, max_bytes: int | None = None) -> BinaryIO:
    """``path`` opened for reading (binary), once ``fstat`` has said it is a regular file of at
    most ``max_bytes``; ``UnsafeFile`` (an OSError) otherwise. The caller closes it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        _refuse_unless_regular(st, path)
        if max_bytes is not None and st.st_size > max_bytes:
            raise UnsafeFile(f"larger than {size_text(max_bytes)}", path, errno.EFBIG)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, max_bytes: int) -> bytes:
    """All of regular file ``path``, which must hold at most ``max_bytes``; ``UnsafeFile`` otherwise."""
    with open_regular(path, max_bytes=max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew after fstat
        raise UnsafeFile(f"larger than {size_text(max_bytes)}", path, errno.EFBIG)
    return data


def inside(path: str | os.PathLike, root: str | os.PathLike) -> Path:
    """``path`` with every symlink resolved, when that is ``root`` or under it (``root``'s own
    symlinks resolved too); ``UnsafeFile`` naming where it leads otherwise."""
    real = os.path.realpath(path)
    base = os.path.realpath(root)
    if real != base and not real.startswith(base.rstrip(os.sep) + os.sep):
        raise UnsafeFile(f"leads outside {os.fspath(root)} (to {real})", path)
    return Path(real)


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and a rename: a reader sees
    the old file or the new one, never part of one, and two writers never mix their bytes. A
    FIFO or symlink at ``path`` is replaced, not written through. The file is the user's alone
    (mode 0600, as ``mkstemp`` makes it)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


__all__ = ["UnsafeFile", "inside", "kind_of", "open_regular", "read_regular", "require_regular", "size_text",
           "write_atomic"]
