"""The header of a GGUF file (versions 2 and 3): its metadata and its tensors' places.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every element of every metadata
array, which on a Llama 3 vocabulary (hundreds of thousands of tokens and merges) takes many
seconds. So the header is parsed here, by the layout that reader and
llama.cpp's ``gguf.cpp`` define, with the ``gguf`` package's own tables for the value and tensor
types; ``tests/test_gguf.py`` checks the result against ``GGUFReader`` on the files it writes.

Every count and length is checked against the bytes left in the file before anything is sized by
it, so a hostile header claiming 2^60 tokens fails at once with a one-line error; and the
elements of all metadata arrays together are bounded (``MAX_METADATA_ITEMS``), as Python objects
take many times the bytes of the file's elements.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_chat.ml.safe_files import open_regular
from llama_chat.model.errors import ModelLoadError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_NESTING = 2
# Array elements in all the metadata together. A vocabulary's tokens, scores, types and merges are
# a few hundred thousand each; a numeric element becomes a Python object of tens of bytes, so a
# file of a few hundred MB of one-byte elements would otherwise take tens of GB to parse.
MAX_METADATA_ITEMS = 1 << 23
# Metadata entries (keys): real files have a few dozen.
MAX_METADATA_ENTRIES = 1 << 16
# llama.cpp's GGML_MAX_NAME, less its terminating zero: a longer name is not a tensor of a GGUF file.
MAX_TENSOR_NAME = 63

# GGUF value types (gguf.GGUFValueType): id -> (struct format, size); 8 is a string, 9 an array.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4), 6: ("<f", 4),
            7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class RawTensor:
    name: str
    ggml_type: int
    dims: tuple[int, ...]  # GGUF order: innermost (row length) first
    offset: int  # relative to the start of the data section


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[RawTensor]
    data_offset: int  # absolute


class _Cursor:
    def __init__(self, buf: mmap.mmap | bytes, name: str) -> None:
        self.buf, self.pos, self.name, self.size = buf, 0, name, len(buf)
        self.items_left = MAX_METADATA_ITEMS

    def spend(self, n: int, what: str) -> None:
        """Count ``n`` more metadata array elements against ``MAX_METADATA_ITEMS``."""
        if n > self.items_left:
            raise self.fail(f"{what} would take the metadata past {MAX_METADATA_ITEMS:,} array elements")
        self.items_left -= n

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.name}: not a valid GGUF file ({what} at byte {self.pos:,})")

    def take(self, fmt: str, size: int) -> Any:
        if self.pos + size > self.size:
            raise self.fail("the header runs past the end of the file")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def count(self, what: str, item_size: int) -> int:
        """A u64 count of items of at least ``item_size`` bytes, checked against what is left."""
        n = self.take("<Q", 8)
        if n * item_size > self.size - self.pos:
            raise self.fail(f"{what} claims {n:,} items, more than the {self.size - self.pos:,} bytes left hold")
        return n

    def string(self, what: str, *, most: int | None = None) -> str:
        n = self.count(what, 1)
        if most is not None and n > most:
            raise self.fail(f"{what} of {n:,} bytes is longer than GGUF allows ({most})")
        data = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ModelLoadError(f"{self.name}: {what} is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def read_header(path: Path) -> Header:
    """Parse ``path``'s GGUF header; ModelLoadError naming the file and the problem."""
    name = path.name
    try:
        with open_regular(path) as f:  # a FIFO or a device in a model's place is refused, not read
            size = f.seek(0, 2)
            if size < 24:
                raise ModelLoadError(f"{name}: not a valid GGUF file (only {size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, name))
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read it ({e.strerror or e})") from None


def _parse(c: _Cursor) -> Header:
    if c.buf[:4] != MAGIC:
        raise ModelLoadError(f"{c.name}: not a GGUF file (it does not start with 'GGUF')")
    c.pos = 4
    version = c.take("<I", 4)
    if version & 0xFFFF == 0 and version:
        raise ModelLoadError(f"{c.name}: a big-endian GGUF file, which is not supported")
    if version not in VERSIONS:
        raise ModelLoadError(f"{c.name}: GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors = c.count("the tensor count", 8 + 4 + 4 + 8)
    n_kv = c.count("the metadata count", 8 + 4 + 1)
    if n_kv > MAX_METADATA_ENTRIES:
        raise c.fail(f"the metadata count {n_kv:,} is more than any model's ({MAX_METADATA_ENTRIES:,})")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string("a metadata key")
        kind = c.take("<I", 4)
        if key in metadata:
            raise c.fail(f"metadata key {key!r:.80} appears twice")
        metadata[key] = _value(c, kind, key, 0)
    tensors: list[RawTensor] = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        tname = c.string("a tensor name", most=MAX_TENSOR_NAME)
        n_dims = c.take("<I", 4)
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {tname!r:.80} has {n_dims} dimensions")
        dims = tuple(c.take("<Q", 8) for _ in range(n_dims))
        ggml_type = c.take("<I", 4)
        offset = c.take("<Q", 8)
        if tname in seen:
            raise c.fail(f"tensor {tname!r:.80} appears twice")
        seen.add(tname)
        tensors.append(RawTensor(tname, ggml_type, dims, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{c.name}: metadata 'general.alignment' must be a power of two, found {alignment!r:.40}")
    data_offset = -(-c.pos // alignment) * alignment
    return Header(version=version, metadata=metadata, tensors=tensors, data_offset=data_offset)


def _value(c: _Cursor, kind: int, key: str, depth: int) -> Any:
    if kind in _SCALARS:
        fmt, size = _SCALARS[kind]
        return c.take(fmt, size)
    if kind == STRING:
        return c.string(f"metadata {key!r:.80}")
    if kind != ARRAY:
        raise c.fail(f"metadata {key!r:.80} has unknown value type {kind}")
    if depth >= MAX_NESTING:
        raise c.fail(f"metadata {key!r:.80} nests arrays too deeply")
    item = c.take("<I", 4)
    if item in _SCALARS:
        _, size = _SCALARS[item]
        n = c.count(f"metadata {key!r:.80}", size)
        c.spend(n, f"metadata {key!r:.80}")
        import numpy as np

        # One read for the whole array: token scores and types run to 128k entries.
        values = np.frombuffer(c.buf, dtype=_NUMPY[item], count=n, offset=c.pos).tolist()
        c.pos += n * size
        return values
    if item == STRING:
        n = c.count(f"metadata {key!r:.80}", 8)
        c.spend(n, f"metadata {key!r:.80}")
        return [c.string(f"metadata {key!r:.80}") for _ in range(n)]
    n = c.count(f"metadata {key!r:.80}", 12)
    c.spend(n, f"metadata {key!r:.80}")
    return [_value(c, item, key, depth + 1) for _ in range(n)]


def file_type_name(metadata: dict[str, Any]) -> str | None:
    """A file's own name for its quantization (``general.file_type``, llama.cpp's ``llama_ftype``):
    "Q4_K_M", "F16"; None when the file does not say or says something unknown."""
    from gguf import LlamaFileType

    value = metadata.get("general.file_type")
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    try:
        name = LlamaFileType(value).name
    except ValueError:
        return None
    return None if name == "GUESSED" else name.split("_", 1)[1]
