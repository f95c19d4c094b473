"""What every tokenizer backend answers from the same few tables, written once."""

from __future__ import annotations


class ByteTableTokenizer:
    """The ``Tokenizer`` properties and ``token_bytes``, for a backend that fills these in.

    ``_bytes`` holds each id's bytes as streaming prints them (``b""`` for control tokens), so its
    length is the vocabulary; ``_specials`` maps special-token names to ids; ``_stops`` holds the
    ids that end a generation.
    """

    _bytes: list[bytes]
    _bos: int | None
    _eos: int | None
    _stops: frozenset[int]
    _specials: dict[str, int]

    @property
    def vocab_size(self) -> int:
        return len(self._bytes)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stops

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    def token_bytes(self, token_id: int) -> bytes:
        return self._bytes[token_id]

    def _with_markers(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        """``ids`` with the begin/end-of-sequence ids around them, where asked for and defined."""
        if bos and self._bos is not None:
            ids.insert(0, self._bos)
        if eos and self._eos is not None:
            ids.append(self._eos)
        return ids
