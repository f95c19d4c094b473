"""llama2.c backend: ``tokenizer.bin``, encoded and decoded the way llama2.c's ``run.c`` does.

File layout (little-endian): ``int32 max_token_length``, then for every token ``float32 score``,
``int32 length``, ``length`` bytes. The vocabulary size is not stored; the file simply ends.
Pieces are stored with ``▁`` already turned into a space; ids 0/1/2 are unk/bos/eos and the 256
byte-fallback pieces ``<0x00>``..``<0xFF>`` sit at ids 3..258, which is why a byte ``b`` that no
piece covers encodes as id ``b + 3``.

Encoding: prepend the dummy-prefix space piece, look up each UTF-8 character (falling back to its
bytes), then repeatedly merge the adjacent pair whose concatenation is a piece with the highest
score (the leftmost on ties) until none is left.
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Sequence
from pathlib import Path

from llama_chat.model.errors import ModelLoadError
from llama_chat.model.tokenizers.table import ByteTableTokenizer

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3  # id of <0x00>

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


def read_tokenizer_bin(path: Path) -> tuple[list[bytes], list[float]]:
    """Pieces and scores of a llama2.c tokenizer file; ModelLoadError when it is truncated."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read tokenizer ({exc.strerror or exc})") from None
    if len(data) < 4:
        raise ModelLoadError(f"{path}: too short for a llama2.c tokenizer ({len(data)} bytes)")
    (max_len,) = struct.unpack_from("<i", data, 0)
    pos, pieces, scores = 4, [], []
    while pos < len(data):
        if pos + 8 > len(data):
            raise ModelLoadError(f"{path}: truncated entry for token {len(pieces)} at byte {pos}")
        score, length = struct.unpack_from("<fi", data, pos)
        pos += 8
        if length < 0 or length > max_len or pos + length > len(data):
            raise ModelLoadError(f"{path}: token {len(pieces)} has length {length}, "
                                 f"expected 0..{max_len} within the file")
        pieces.append(data[pos:pos + length])
        scores.append(score)
        pos += length
    if len(pieces) < BYTE_OFFSET + 256:
        raise ModelLoadError(f"{path}: {len(pieces)} tokens, expected at least {BYTE_OFFSET + 256} "
                             "(unk, bos, eos and 256 byte pieces)")
    return pieces, scores


class Llama2cTokenizer(ByteTableTokenizer):
    """A ``Tokenizer`` over a llama2.c ``tokenizer.bin``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        pieces, scores = read_tokenizer_bin(self.path)
        self._pieces = pieces
        self._scores = scores
        # First id wins on duplicate pieces, as run.c's sorted lookup finds some one of them.
        self._lookup: dict[bytes, int] = {}
        for i, piece in enumerate(pieces):
            self._lookup.setdefault(piece, i)
        table: list[bytes] = []
        for i, piece in enumerate(pieces):
            if i in (UNK_ID, BOS_ID, EOS_ID):
                table.append(b"")
            elif m := _BYTE_PIECE.fullmatch(piece):
                table.append(bytes([int(m.group(1), 16)]))
            else:
                table.append(piece)
        self._bytes = table
        self._specials = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}
        self._bos, self._eos, self._stops = BOS_ID, EOS_ID, frozenset({EOS_ID})

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = [BOS_ID] if bos else []
        if text:
            ids.extend(self._merge(self._initial_symbols(text)))
        if eos:
            ids.append(EOS_ID)
        return ids

    def _initial_symbols(self, text: str) -> list[int]:
        symbols = []
        if (space := self._lookup.get(b" ")) is not None:
            symbols.append(space)  # the dummy prefix
        for char in text:
            encoded = char.encode("utf-8")
            found = self._lookup.get(encoded)
            if found is not None:
                symbols.append(found)
            else:
                symbols.extend(b + BYTE_OFFSET for b in encoded)
        return symbols

    def _merge(self, symbols: list[int]) -> list[int]:
        """Best-score-first pair merging with a heap; equal to run.c's quadratic rescans.

        Heap entries are (-score, left position, left id, right id); positions of surviving
        symbols keep their original order, so the smallest position is run.c's leftmost pair.
        Stale entries (either side already merged) are skipped when popped.
        """
        n = len(symbols)
        ids = list(symbols)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int) -> None:
            right = nxt[left]
            if right < n:
                merged = self._lookup.get(self._pieces[ids[left]] + self._pieces[ids[right]])
                if merged is not None:
                    heapq.heappush(heap, (-self._scores[merged], left, ids[left], ids[right]))

        for i in range(n - 1):
            push(i)
        while heap:
            neg_score, left, left_id, right_id = heapq.heappop(heap)
            right = nxt[left]
            if not alive[left] or right >= n or ids[left] != left_id or ids[right] != right_id:
                continue
            ids[left] = self._lookup[self._pieces[left_id] + self._pieces[right_id]]
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prv[nxt[right]] = left
            if prv[left] >= 0:
                push(prv[left])
            push(left)
        return [ids[i] for i in range(n) if alive[i]]

    def decode(self, ids: Sequence[int]) -> str:
        out = bytearray()
        prev = None
        for i in ids:
            piece = self._bytes[i]
            if prev == BOS_ID and piece.startswith(b" "):
                piece = piece[1:]  # run.c drops the dummy-prefix space right after bos
            out += piece
            prev = i
        return out.decode("utf-8", errors="replace")

    @property
    def strips_leading_space(self) -> bool:
        """decode drops the leading space of the piece right after bos, as run.c prints it."""
        return True

    @property
    def add_bos(self) -> bool:
        return True

    def encode_allowing_special(self, text: str) -> list[int]:
        from llama_chat.model.tokenizers.specials import split_on_specials

        ids: list[int] = []
        for chunk, special_id in split_on_specials(text, self._specials):
            ids.extend([special_id] if special_id is not None else self.encode(chunk))
        return ids
