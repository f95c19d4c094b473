"""SentencePiece backend: Llama 1/2, TinyLlama, Mistral ``tokenizer.model`` files.

Token bytes (what the streaming decoder consumes):

* ``<0xNN>`` byte-fallback pieces give that one byte;
* ``▁`` gives a space, and any other normal or user-defined piece gives its UTF-8;
* control pieces (``<s>``, ``</s>``), unused pieces and user-defined pieces that look like special
  tokens (``<|im_end|>``, ``[INST]``) give ``b""``: they are never printed;
* the unknown piece gives ``" ⁇ "``, the surface ``SentencePieceProcessor.decode`` gives it.

SentencePiece prepends a dummy ``▁`` to the text it encodes (``add_dummy_prefix``) and its
``decode`` drops the leading space of the first piece again. ``token_bytes`` keeps that space, so
the concatenated bytes of ``encode(text)`` are ``" " + text`` where ``decode`` returns ``text``.
``strips_leading_space`` says whether this applies; a streaming consumer that wants to match
``decode`` drops one leading space from the very first bytes of a decoded span, never later.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm

from llama_chat.model.errors import ModelLoadError
from llama_chat.model.tokenizers.table import ByteTableTokenizer

# End-of-turn markers of chat fine-tunes that kept a SentencePiece vocabulary; whichever exist
# as pieces stop generation along with ``</s>``.
END_OF_TURN_PIECES = ("<|eot_id|>", "<|im_end|>", "<end_of_turn>")
# Every special token that ends a generation where a vocabulary has it (the families' ends of
# text, turn and message: Llama 3's, Qwen's, Gemma's, Phi-3's, DeepSeek's, SmolLM's).
STOP_NAMES = END_OF_TURN_PIECES + ("<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>", "<EOT>",
                                   "<｜end▁of▁sentence｜>", "<end_of_utterance>")

UNKNOWN_SURFACE = " \u2047 "  # what SentencePiece's decode writes for the unknown piece

# ``SentencePiece.Type`` values in sentencepiece_model.proto.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# User-defined pieces named like markup are chat/control markers, not text.
_SPECIAL_LOOKING = re.compile(r"<[^<>\s]+>|\[[A-Z_/]+\]")


@dataclass(frozen=True)
class ModelProtoInfo:
    """The few fields of a serialized ``ModelProto`` that the Python API does not expose."""

    piece_types: list[int]
    add_dummy_prefix: bool


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes):
    """Yield ``(field_number, wire_type, value)`` of one protobuf message (value: int or bytes)."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, wire, value


def parse_model_proto(proto: bytes) -> ModelProtoInfo:
    """Piece types and ``add_dummy_prefix`` from a serialized SentencePiece model.

    A hand-rolled reader of the protobuf wire format: the Python protobuf package is not a
    dependency, and these two facts are all that is missing from ``SentencePieceProcessor``.
    """
    types: list[int] = []
    add_dummy_prefix = True  # the proto default
    for number, wire, value in _fields(proto):
        if number == 1 and wire == 2:  # repeated SentencePiece pieces
            kind = _NORMAL
            for n, w, v in _fields(value):
                if n == 3 and w == 0:
                    kind = v
            types.append(kind)
        elif number == 3 and wire == 2:  # NormalizerSpec
            for n, w, v in _fields(value):
                if n == 3 and w == 0:
                    add_dummy_prefix = bool(v)
    return ModelProtoInfo(piece_types=types, add_dummy_prefix=add_dummy_prefix)


class SentencePieceTokenizer(ByteTableTokenizer):
    """A ``Tokenizer`` over a SentencePiece model; ``encode``/``decode`` are SentencePiece's own."""

    def __init__(self, path: Path, *, extra_stop_ids: Iterable[int] = (), proto: bytes | None = None,
                 info: ModelProtoInfo | None = None) -> None:
        """``proto``: the serialized model, when it does not come from ``path`` itself (GGUF), and
        ``info`` what ``parse_model_proto`` would read from it, when the caller knows it already."""
        self.path = Path(path)
        try:
            if proto is None:
                proto = self.path.read_bytes()
            sp = spm.SentencePieceProcessor()
            sp.LoadFromSerializedProto(proto)
            info = info or parse_model_proto(proto)
        except OSError as exc:
            raise ModelLoadError(f"{self.path}: cannot read tokenizer ({exc.strerror or exc})") from None
        except (RuntimeError, ValueError, IndexError) as exc:
            raise ModelLoadError(f"{self.path}: not a valid SentencePiece model ({exc})") from None
        n = sp.get_piece_size()
        if len(info.piece_types) != n:
            raise ModelLoadError(f"{self.path}: SentencePiece model lists {len(info.piece_types)} piece types, "
                                 f"expected {n}")
        self._sp = sp
        self._add_dummy_prefix = info.add_dummy_prefix

        pieces = [sp.id_to_piece(i) for i in range(n)]
        specials: dict[str, int] = {}
        table: list[bytes] = []
        for i, (piece, kind) in enumerate(zip(pieces, info.piece_types)):
            if kind in (_CONTROL, _UNUSED) or (kind == _USER_DEFINED and _SPECIAL_LOOKING.fullmatch(piece)):
                specials.setdefault(piece, i)
                table.append(b"")
            elif kind == _UNKNOWN:
                specials.setdefault(piece, i)
                table.append(UNKNOWN_SURFACE.encode())
            elif kind == _BYTE and (m := _BYTE_PIECE.fullmatch(piece)):
                table.append(bytes([int(m.group(1), 16)]))
            else:
                table.append(piece.replace("\u2581", " ").encode("utf-8"))
        self._bytes = table
        self._specials = specials

        bos, eos = sp.bos_id(), sp.eos_id()
        self._bos = bos if bos >= 0 else None
        self._eos = eos if eos >= 0 else None
        stops = {self._eos} if self._eos is not None else set()
        stops.update(specials[p] for p in END_OF_TURN_PIECES if p in specials)
        stops.update(i for i in extra_stop_ids if 0 <= i < n)
        self._stops = frozenset(stops)

    # -- Tokenizer protocol -------------------------------------------------------------------

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        # Text is always plain text: "</s>" typed by a user is spelled out, never the eos id.
        ids = self._sp.encode(text)
        return self._with_markers(ids, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    # -- beyond the protocol ------------------------------------------------------------------

    @property
    def strips_leading_space(self) -> bool:
        """True when ``decode`` drops the dummy-prefix space that ``token_bytes`` keeps."""
        return self._add_dummy_prefix

    @property
    def add_bos(self) -> bool:
        """Whether a prompt for this model starts with ``bos_id`` (Llama's always do)."""
        return self._bos is not None

    def encode_allowing_special(self, text: str) -> list[int]:
        """Encode rendered chat-template text: special-token names become their ids.

        Each stretch of text between special tokens is encoded on its own, so it gets its own
        dummy prefix, as Meta's Llama 2 code and the Hugging Face "legacy" tokenizer do.
        """
        from llama_chat.model.tokenizers.specials import split_on_specials

        ids: list[int] = []
        for chunk, special_id in split_on_specials(text, self._specials):
            ids.extend([special_id] if special_id is not None else self._sp.encode(chunk))
        return ids


def looks_like_sentencepiece(head: bytes) -> bool:
    """A SentencePiece model is a protobuf whose first field is a piece (field 1, length-delimited)."""
    if not head or head[0] != 0x0A:
        return False
    try:
        size, pos = _read_varint(head, 1)
        return pos < len(head) and head[pos] == 0x0A and size > 0
    except IndexError:
        return False
