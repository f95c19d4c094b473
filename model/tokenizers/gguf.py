"""The tokenizer a GGUF file carries in its ``tokenizer.ggml.*`` metadata.

Three kinds, as llama.cpp names them in ``tokenizer.ggml.model``:

* ``llama``: a SentencePiece vocabulary (Llama 1/2, TinyLlama, Mistral): pieces, scores and piece
  types. llama.cpp's converter copies them one for one from ``tokenizer.model``, so the model is
  rebuilt here as a SentencePiece ``ModelProto`` (BPE, byte fallback when there are byte pieces,
  no normalization, the dummy prefix from ``tokenizer.ggml.add_space_prefix``) and run by the
  ``sentencepiece`` library itself: the same ids as the original file.
* ``gpt2``: a byte-level BPE vocabulary (Llama 3, SmolLM, Qwen, DeepSeek, Mistral's Tekken, ...):
  tokens in GPT-2's byte-to-unicode spelling, and the merges. Run by the ``tokenizers`` library
  with the pre-tokenizer that ``tokenizer.ggml.pre`` names (``gguf_pre.py``: llama.cpp's
  expressions for each name, and its defaults for adding a bos and for whole-word lookup);
  llama.cpp ranks merges by their order in the file, and so does this.
* ``bert``: a WordPiece vocabulary (BERT encoders), run by ``wordpiece.py`` (``_wordpiece``).

Token types (``tokenizer.ggml.token_type``) are SentencePiece's numbering: 1 normal, 2 unknown,
3 control, 4 user-defined, 5 unused, 6 byte. Control tokens print nothing and are the specials a
chat template may write.
"""

from __future__ import annotations

import json
import re
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.gguf import GGUFContents, meta_str
from llama_chat.model.tokenizers.base import FIM_ROLES, Tokenizer
from llama_chat.model.tokenizers.gguf_pre import PRE_TOKENIZERS
from llama_chat.model.tokenizers.hf import byte_level_decoder
from llama_chat.model.tokenizers.sentencepiece import STOP_NAMES, ModelProtoInfo, SentencePieceTokenizer
from llama_chat.model.tokenizers.table import ByteTableTokenizer

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_PAD = re.compile(r"\[PAD\d+\]")
# The first FIM roles' keys as files converted before llama.cpp named them fim_* (CodeLlama's:
# ``tokenizer.ggml.prefix_token_id`` ...).
_OLD_FIM_NAMES = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}
# Control tokens that end a generation by their name, as llama.cpp's vocabulary code finds them.
MAX_TOKENS = 1 << 24


def load_gguf_tokenizer(contents: GGUFContents) -> Tokenizer:
    """The tokenizer stored in ``contents``; ModelLoadError naming the field when it cannot be used."""
    name = contents.path.name
    kind = meta_str(contents, "tokenizer.ggml.model")
    if kind is None:
        raise ModelLoadError(f"{name}: no tokenizer in the file (metadata 'tokenizer.ggml.model' is missing)")
    vocab = _Vocab.read(contents)
    if kind == "llama":
        return GGUFSentencePieceTokenizer(contents, vocab)
    if kind == "gpt2":
        return GGUFByteLevelTokenizer(contents, vocab)
    if kind == "bert":
        return _wordpiece(contents, vocab)
    raise ModelLoadError(f"{name}: tokenizer.ggml.model {kind!r:.40} is not supported "
                         "(expected 'llama', 'gpt2' or 'bert')")


def _wordpiece(contents: GGUFContents, vocab: _Vocab) -> Tokenizer:
    """A ``bert`` vocabulary as llama.cpp's converter writes it: whole-word pieces with a leading
    ``▁`` and pieces inside a word bare (BERT's ``##`` taken off), ``[...]`` tokens as they are;
    its ``[CLS]`` the bos token and its ``[SEP]`` the separator. llama.cpp lower-cases and strips
    accents for every such file (the file does not say), and so does this."""
    from llama_chat.model.tokenizers.wordpiece import Normalization, WordPieceTokenizer

    name = contents.path.name

    def bert_piece(token: str) -> str:
        if token.startswith("[") and token.endswith("]"):
            return token
        return token[1:] if token.startswith("\u2581") else "##" + token

    pieces = [bert_piece(t) for t in vocab.tokens]
    roles = {}
    for role, key, default in (("cls", "bos", "[CLS]"), ("sep", "seperator", "[SEP]"), ("unk", "unknown", "[UNK]"),
                               ("pad", "padding", "[PAD]")):
        value = vocab.ids.get(key) if key != "seperator" else contents.metadata.get("tokenizer.ggml.seperator_token_id")
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(pieces)):
            raise ModelLoadError(f"{name}: metadata 'tokenizer.ggml.{key}_token_id' is {value!r:.40}, not a token id")
        roles[role] = pieces[value] if value is not None else default
    specials = [p for p, t in zip(pieces, vocab.types) if t == CONTROL]
    return WordPieceTokenizer({p: i for i, p in enumerate(pieces)}, Normalization(lowercase=True, strip_accents=True),
                              specials=specials, where=name, **roles)


class _Vocab:
    """The ``tokenizer.ggml.*`` fields every kind uses, checked."""

    def __init__(self, name: str, tokens: list[str], types: list[int], ids: dict[str, int | None],
                 add_bos: bool | None, add_eos: bool | None) -> None:
        self.name, self.ids = name, ids
        self.add_bos, self.add_eos = add_bos, add_eos
        self.file_count = len(tokens)
        # llama.cpp's converter pads a vocabulary to the embedding's rows with unused "[PADn]"
        # tokens. They are left out, as a Hugging Face checkpoint's padding rows are: the command
        # samples only the tokenizer's ids, so a padding row can never be chosen.
        kept = len(tokens)
        last_named = max((i for i in ids.values() if i is not None), default=-1)
        # (Older converters typed them unknown.)
        while kept > last_named + 1 and types[kept - 1] in (UNUSED, UNKNOWN) and _PAD.fullmatch(tokens[kept - 1]):
            kept -= 1
        self.tokens, self.types = tokens[:kept], types[:kept]

    @classmethod
    def read(cls, contents: GGUFContents) -> _Vocab:
        name = contents.path.name
        tokens = contents.metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ModelLoadError(f"{name}: metadata 'tokenizer.ggml.tokens' must be a non-empty list of strings")
        if len(tokens) > MAX_TOKENS:
            raise ModelLoadError(f"{name}: {len(tokens):,} tokens is more than any vocabulary's ({MAX_TOKENS:,})")
        types = contents.metadata.get("tokenizer.ggml.token_type")
        if types is None:
            types = [NORMAL] * len(tokens)
        if not isinstance(types, list) or len(types) != len(tokens):
            raise ModelLoadError(f"{name}: metadata 'tokenizer.ggml.token_type' must list one type per token "
                                 f"({len(tokens)})")
        bad = next((t for t in types if t not in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE)), None)
        if bad is not None:
            raise ModelLoadError(f"{name}: metadata 'tokenizer.ggml.token_type' holds {bad!r:.20}, expected 1 to 6")
        ids: dict[str, int | None] = {}
        for role in ("bos", "eos", "unknown", "padding", "eot", "eom", *FIM_ROLES, *_OLD_FIM_NAMES.values()):
            key = f"tokenizer.ggml.{role}_token_id"
            value = contents.metadata.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < len(tokens)):
                raise ModelLoadError(f"{name}: metadata {key!r} is {value!r:.40}, not a token id "
                                     f"(0 to {len(tokens) - 1})")
            ids[role] = value
        return cls(name, tokens, types, ids, _flag(contents, "tokenizer.ggml.add_bos_token"),
                   _flag(contents, "tokenizer.ggml.add_eos_token"))

    @property
    def fim_ids(self) -> dict[str, int]:
        """The fill-in-the-middle ids the file names, by role (``FIM_ROLES``), under the older
        names where only those are given."""
        found = {role: self.ids[role] if self.ids[role] is not None else self.ids.get(_OLD_FIM_NAMES.get(role, ""))
                 for role in FIM_ROLES}
        return {role: i for role, i in found.items() if i is not None}

    def stop_ids(self, specials: dict[str, int], extra: Iterable[int] = ()) -> frozenset[int]:
        stops = {self.ids[r] for r in ("eos", "eot", "eom") if self.ids[r] is not None}
        stops.update(specials[n] for n in STOP_NAMES if n in specials)
        stops.update(extra)
        return frozenset(i for i in stops if i is not None)


def _flag(contents: GGUFContents, key: str) -> bool | None:
    value = contents.metadata.get(key)
    if value is not None and not isinstance(value, bool):
        raise ModelLoadError(f"{contents.path.name}: metadata {key!r} must be true or false, found {value!r:.40}")
    return value


# --- SentencePiece ------------------------------------------------------------------------------


class GGUFSentencePieceTokenizer(SentencePieceTokenizer):
    """A SentencePiece vocabulary from GGUF metadata, run by the sentencepiece library."""

    def __init__(self, contents: GGUFContents, vocab: _Vocab) -> None:
        scores = contents.metadata.get("tokenizer.ggml.scores")
        if scores is None:
            scores = [0.0] * vocab.file_count
        if not isinstance(scores, list) or len(scores) != vocab.file_count \
                or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
            raise ModelLoadError(f"{vocab.name}: metadata 'tokenizer.ggml.scores' must list one number per token")
        scores = scores[:len(vocab.tokens)]
        add_prefix = _flag(contents, "tokenizer.ggml.add_space_prefix")
        proto = sentencepiece_proto(vocab.tokens, scores, vocab.types, ids=vocab.ids,
                                    add_dummy_prefix=add_prefix is not False)
        add_dummy_prefix = add_prefix is not False
        super().__init__(contents.path, proto=proto,
                         info=ModelProtoInfo(piece_types=list(vocab.types), add_dummy_prefix=add_dummy_prefix))
        self._add_bos_flag = vocab.add_bos
        self._add_eos = bool(vocab.add_eos) and self._eos is not None
        self.fim_ids = vocab.fim_ids
        self._stops = vocab.stop_ids(self._specials, self._stops)

    @property
    def add_bos(self) -> bool:
        if self._add_bos_flag is not None:
            return self._add_bos_flag and self._bos is not None
        return self._bos is not None

    @property
    def add_eos(self) -> bool:
        """``tokenizer.ggml.add_eos_token``: a plain prompt ends with eos (``encode_prompt``)."""
        return self._add_eos


def _varint(value: int) -> bytes:
    if 0 <= value < 0x80:
        return _SMALL[value]  # most keys, lengths and types: one byte
    out = bytearray()
    value &= (1 << 64) - 1  # protobuf writes negative int32 as ten-byte two's complement
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


_SMALL = [bytes((i,)) for i in range(0x80)]


def _field_varint(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _field_bytes(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _field_float(number: int, value: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def sentencepiece_proto(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], *,
                        ids: dict[str, int | None], add_dummy_prefix: bool) -> bytes:
    """A serialized SentencePiece ``ModelProto`` (BPE) holding these pieces.

    Written by hand in protobuf's wire format, the way ``sentencepiece.parse_model_proto`` reads
    one: the protobuf package is not a dependency. Field numbers are sentencepiece_model.proto's.
    """
    out = bytearray()
    for piece, score, kind in zip(tokens, scores, types):
        if kind == USER_DEFINED:
            # A user-defined piece is matched whole in the text (llama.cpp splits the text on them
            # first; Hugging Face's files list them as added tokens). SentencePiece matches them
            # after its normalizer has escaped the spaces, so a piece of spaces (Gemma's runs of
            # indentation) must be spelled with the escape to be found at all.
            piece = piece.replace(" ", "\u2581")
        body = _field_bytes(1, piece.encode("utf-8")) + _field_float(2, float(score)) + _field_varint(3, kind)
        out += _field_bytes(1, body)
    trainer = _field_varint(3, 2) + _field_varint(4, len(tokens))  # model_type BPE, vocab_size
    if BYTE in types:
        trainer += _field_varint(35, 1)  # byte_fallback
    # Special pieces by id and name; -1 says "none", as in SentencePiece's own files.
    unk = ids.get("unknown")
    if unk is None:
        unk = next((i for i, t in enumerate(types) if t == UNKNOWN), None)
    for number, piece_number, value in ((40, 45, unk), (41, 46, ids.get("bos")), (42, 47, ids.get("eos")),
                                        (43, 48, ids.get("padding"))):
        trainer += _field_varint(number, -1 if value is None else value)
        if value is not None:
            trainer += _field_bytes(piece_number, tokens[value].encode("utf-8"))
    out += _field_bytes(2, trainer)
    normalizer = (_field_bytes(1, b"identity") + _field_varint(3, int(add_dummy_prefix))
                  + _field_varint(4, 0) + _field_varint(5, 1))
    out += _field_bytes(3, normalizer)
    return bytes(out)


# --- byte-level BPE -----------------------------------------------------------------------------


class GGUFByteLevelTokenizer(ByteTableTokenizer):
    """A byte-level BPE vocabulary (Llama 3) from GGUF metadata, run by the tokenizers library."""

    def __init__(self, contents: GGUFContents, vocab: _Vocab) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        name = vocab.name
        pre_name = meta_str(contents, "tokenizer.ggml.pre") or "default"  # llama.cpp's fallback too
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise ModelLoadError(f"{name}: tokenizer.ggml.pre {pre_name!r:.40} is not supported (not one of the "
                                 f"{len(PRE_TOKENIZERS)} byte-level splits llama.cpp names; see docs/tokenizers.md)")
        merges = contents.metadata.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
            raise ModelLoadError(f"{name}: metadata 'tokenizer.ggml.merges' must be a list of 'left right' strings")

        decoder = byte_level_decoder()
        table: list[bytes] = []
        specials: dict[str, int] = {}
        added: list[dict[str, Any]] = []
        model_vocab: dict[str, int] = {}
        for i, (token, kind) in enumerate(zip(vocab.tokens, vocab.types)):
            # Every token is in the model's vocabulary, as in Hugging Face's files: the tokenizers
            # library takes an added token's id from there, and numbers one it does not find after
            # the vocabulary instead (wrong wherever the specials come first, as in SmolLM's).
            model_vocab.setdefault(token, i)
            if kind in (CONTROL, UNUSED, UNKNOWN):
                table.append(b"")
                if kind == CONTROL:
                    specials.setdefault(token, i)
                    added.append(_added(i, token, special=True))
            elif kind == USER_DEFINED:
                table.append(token.encode("utf-8"))
                added.append(_added(i, token, special=False))
            else:
                # A token outside GPT-2's byte alphabet (Command R has a few, such as a bare zero-width
                # joiner) stands for its own UTF-8, as Hugging Face's byte-level decoder reads it.
                if all(c in decoder for c in token):
                    table.append(bytes(map(decoder.__getitem__, token)))
                else:
                    table.append(token.encode("utf-8"))
        # Real vocabularies lack the bytes no UTF-8 text holds (0xC0, 0xF5, ...) and now and then a
        # control character; text with such a byte loses it, in Hugging Face's tokenizer and in
        # llama.cpp alike. Printable ASCII and line ends must be there, or this is no byte-level BPE.
        present = set(table)
        missing = [b for b in (0x09, 0x0A, 0x0D, *range(0x20, 0x7F)) if bytes([b]) not in present]
        if missing:
            raise ModelLoadError(f"{name}: no token for the single byte 0x{missing[0]:02x}; a byte-level "
                                 "tokenizer needs one for every printable ASCII character and line end")
        spec = {
            "version": "1.0",
            "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": pre.spec(),
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": pre.ignore_merges, "vocab": model_vocab,
                      "merges": merges},  # "left right" strings, a form every tokenizers version reads
        }
        try:
            text = json.dumps(spec)
            raw = RawTokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception on a bad vocabulary
            raise ModelLoadError(f"{name}: the file's BPE vocabulary cannot be used "
                                 f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
        # One instance (building a second costs a second for a Llama 3 vocabulary): user text is
        # encoded with control-token names as plain text, rendered chat templates without; the
        # switch is a flag on the instance, so it is held only for the call.
        self._raw = raw
        self._switch = threading.Lock()
        self.path = contents.path
        self._bytes = table
        self._specials = specials
        self._bos = vocab.ids["bos"]
        self._eos = vocab.ids["eos"]
        self._stops = vocab.stop_ids(specials)
        self._add_bos = vocab.add_bos if vocab.add_bos is not None else pre.add_bos
        self._add_eos = bool(vocab.add_eos) and self._eos is not None
        self.fim_ids = vocab.fim_ids

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        with self._switch:
            self._raw.encode_special_tokens = True
            try:
                ids = self._raw.encode(text, add_special_tokens=False).ids
            finally:
                self._raw.encode_special_tokens = False
        return self._with_markers(ids, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    @property
    def strips_leading_space(self) -> bool:
        return False

    @property
    def add_bos(self) -> bool:
        return bool(self._add_bos) and self._bos is not None

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    def encode_allowing_special(self, text: str) -> list[int]:
        with self._switch:
            return self._raw.encode(text, add_special_tokens=False).ids


def _added(i: int, token: str, *, special: bool) -> dict[str, Any]:
    return {"id": i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}
