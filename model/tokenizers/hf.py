"""Hugging Face ``tokenizers`` backend: ``tokenizer.json`` plus, when present, ``tokenizer_config.json``.

``tokenizer_config.json`` names the bos/eos tokens (a string or ``{"content": ...}``) and says
whether prompts start with bos (``add_bos_token``); without it the tokenizer's own post-processor
is asked. Token bytes:

* ByteLevel vocabularies (GPT-2 style, Llama 3 in Hugging Face layout): each character of a token
  maps back to one byte through the GPT-2 byte-to-unicode table;
* Metaspace / byte-fallback vocabularies (Llama 2 converted from SentencePiece): ``<0xNN>`` gives
  that byte, ``▁`` gives a space;
* added tokens marked special give ``b""``; other added tokens give their text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RawTokenizer

from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.json_files import read_json
from llama_chat.model.tokenizers.sentencepiece import STOP_NAMES
from llama_chat.model.tokenizers.specials import token_name
from llama_chat.model.tokenizers.table import ByteTableTokenizer

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")


@cache
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, reversed: printable Latin-1 bytes stand for themselves and
    every other byte is shifted to a code point from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table: dict[str, int] = {chr(b): b for b in printable}
    shifted = 256
    for b in range(256):
        if b not in table.values():
            table[chr(shifted)] = b
            shifted += 1
    return table


def _uses_byte_level(spec: dict) -> bool:
    """True when the decoder (or pre-tokenizer) is ByteLevel, possibly inside a Sequence."""

    def has(node: Any) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        children = node.get("decoders") or node.get("pretokenizers") or []
        return any(has(child) for child in children)

    return has(spec.get("decoder")) or has(spec.get("pre_tokenizer"))


class HFTokenizer(ByteTableTokenizer):
    """A ``Tokenizer`` over a Hugging Face ``tokenizer.json``."""

    def __init__(self, path: Path, *, extra_stop_ids: Iterable[int] = (), spec: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        spec = read_json(self.path) if spec is None else spec  # the loader may have read it already
        try:
            raw = RawTokenizer.from_str(json.dumps(spec))
        except Exception as exc:  # the Rust side raises a bare Exception on a bad spec
            raise ModelLoadError(f"{self.path}: not a valid tokenizers file ({str(exc).splitlines()[0]})") from None
        config_path = self.path.parent / "tokenizer_config.json"
        self.config = read_json(config_path) if config_path.is_file() else {}

        # Two instances: user text never turns "<|eot_id|>" into the special token, while
        # rendered chat templates must.
        self._raw = raw
        self._plain = RawTokenizer.from_str(raw.to_str())
        self._plain.encode_special_tokens = True

        added = raw.get_added_tokens_decoder()
        self._specials = {tok.content: i for i, tok in added.items() if tok.special}
        n = raw.get_vocab_size(with_added_tokens=True)
        n = max([n, *(i + 1 for i in added)])
        byte_level = _uses_byte_level(spec)
        decoder = byte_level_decoder()
        table: list[bytes] = []
        for i in range(n):
            token = raw.id_to_token(i)
            if token is None or i in added:
                table.append(b"" if token is None or added[i].special else added[i].content.encode())
            elif byte_level and all(c in decoder for c in token):
                table.append(bytes(decoder[c] for c in token))
            elif m := _BYTE_PIECE.fullmatch(token):
                table.append(bytes([int(m.group(1), 16)]))
            else:
                table.append(token.replace("\u2581", " ").encode("utf-8"))
        self._bytes = table

        self._bos = self._find(token_name(self.config.get("bos_token")), _BOS_NAMES)
        self._eos = self._find(token_name(self.config.get("eos_token")), _EOS_NAMES)
        stops = {self._eos} if self._eos is not None else set()
        stops.update(raw.token_to_id(name) for name in STOP_NAMES if name in self._specials)
        stops.update(i for i in extra_stop_ids if 0 <= i < n)
        self._stops = frozenset(stops)

        probe = self._raw.encode("a", add_special_tokens=True).ids
        bare = self._raw.encode("a", add_special_tokens=False).ids
        configured = self.config.get("add_bos_token")
        self._add_bos = bool(configured) if isinstance(configured, bool) else (
            self._bos is not None and probe[:1] == [self._bos] and bare[:1] != [self._bos])
        self._add_eos = self.config.get("add_eos_token") is True and self._eos is not None
        start = next((i for i in range(len(probe) - len(bare) + 1) if probe[i:i + len(bare)] == bare), None)
        self._markers = ((probe[:start], probe[start + len(bare):]) if bare and start is not None else ([], []))
        self._strips = bool(bare) and table[bare[0]].startswith(b" ") and not raw.decode(bare[:1]).startswith(" ")

    def _find(self, configured: str | None, fallbacks: tuple[str, ...]) -> int | None:
        if configured is not None:
            found = self._raw.token_to_id(configured)
            if found is None:
                raise ModelLoadError(f"{self.path.parent / 'tokenizer_config.json'}: token {configured!r} "
                                     f"is not in {self.path.name}")
            return found
        for name in fallbacks:
            if (found := self._raw.token_to_id(name)) is not None:
                return found
        return None

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._plain.encode(text, add_special_tokens=False).ids
        return self._with_markers(ids, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        return self._raw.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def strips_leading_space(self) -> bool:
        """True when ``decode`` drops the prefix space a Metaspace tokenizer prepended."""
        return self._strips

    @property
    def add_bos(self) -> bool:
        """``add_bos_token`` from tokenizer_config.json, else whether the post-processor adds bos."""
        return self._add_bos

    @property
    def markers(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's own post-processor puts before and after a text (transformers'
        ``add_special_tokens=True``, as sentence-transformers tokenizes an input to embed)."""
        return self._markers

    @property
    def add_eos(self) -> bool:
        """``add_eos_token`` from tokenizer_config.json: a plain prompt ends with eos."""
        return self._add_eos

    def encode_allowing_special(self, text: str) -> list[int]:
        """Encode rendered chat-template text the way ``apply_chat_template`` does."""
        return self._raw.encode(text, add_special_tokens=False).ids
