"""BERT's WordPiece tokenizer: the basic tokenizer (text cleaned, CJK ideographs split, accents
stripped and lower-cased as the model says, words split at whitespace and punctuation), then each
word as the longest vocabulary pieces from its start (``##`` before a piece inside a word).

Read from a ``tokenizer.json`` whose model is ``WordPiece`` (its ``BertNormalizer`` settings), or
from ``vocab.txt`` with ``tokenizer_config.json`` (``do_lower_case``, ``strip_accents``,
``tokenize_chinese_chars``). The ids are those of the ``tokenizers`` library's ``BertTokenizerFast``
(tests compare them); special tokens written in the text (``[MASK]``) are matched as they are.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.json_files import read_json

# The CJK ideograph blocks BERT surrounds with spaces (each ideograph a word of its own).
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))
_ASCII_PUNCTUATION = frozenset(string.punctuation)
SUBWORD_PREFIX = "##"
MAX_WORD_CHARS = 100  # a longer word is one unknown token, as BERT has it


@dataclass(frozen=True)
class Normalization:
    """What the basic tokenizer does to the text before splitting it (BERT's normalizer)."""

    lowercase: bool = True
    strip_accents: bool = True  # BERT strips them whenever it lower-cases, unless told otherwise
    chinese_chars: bool = True
    clean_text: bool = True


class WordPieceTokenizer:
    """A BERT vocabulary: ``encode(text, bos=True, eos=True)`` is ``[CLS] pieces [SEP]``."""

    add_bos = True
    add_eos = True

    def __init__(self, vocab: dict[str, int], normalization: Normalization, *, unk: str = "[UNK]",
                 cls: str = "[CLS]", sep: str = "[SEP]", pad: str = "[PAD]", specials: Sequence[str] = (),
                 prefix: str = SUBWORD_PREFIX, max_word_chars: int = MAX_WORD_CHARS, where: str = "vocabulary") -> None:
        self.vocab = vocab
        self.normalization = normalization
        self.prefix = prefix
        self.max_word_chars = max_word_chars
        for role, token in (("unknown", unk), ("classification", cls), ("separator", sep)):
            if token not in vocab:
                raise ModelLoadError(f"{where}: the {role} token {token!r} is not in the vocabulary")
        self.unk_id, self.cls_id, self.sep_id = vocab[unk], vocab[cls], vocab[sep]
        self.pad_id = vocab.get(pad, 0)
        names = {t for t in (unk, cls, sep, pad, *specials) if t in vocab}
        self._specials = {t: vocab[t] for t in names}
        self._special_split = re.compile("(" + "|".join(re.escape(t) for t in sorted(names, key=len, reverse=True))
                                         + ")") if names else None
        self._pieces = [""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            self._pieces[i] = token
        self._special_ids = frozenset(self._specials.values())

    # -- the Tokenizer protocol --------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._pieces)

    @property
    def bos_id(self) -> int | None:
        return self.cls_id

    @property
    def eos_id(self) -> int | None:
        return self.sep_id

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({self.sep_id})

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = [self.cls_id] if bos else []
        parts = self._special_split.split(text) if self._special_split is not None else [text]
        for i, part in enumerate(parts):
            if i % 2:  # a special token as written
                ids.append(self._specials[part])
            elif part:
                for word in self.words(part):
                    ids.extend(self.word_ids(word))
        if eos:
            ids.append(self.sep_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", "replace").removeprefix(" ")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id in self._special_ids or not 0 <= token_id < len(self._pieces):
            return b""
        piece = self._pieces[token_id]
        return piece[len(self.prefix):].encode() if piece.startswith(self.prefix) else b" " + piece.encode()

    @property
    def markers(self) -> tuple[list[int], list[int]]:
        """What goes around a text to embed: ``[CLS]`` before, ``[SEP]`` after."""
        return [self.cls_id], [self.sep_id]

    # -- BERT's steps ------------------------------------------------------------------------------

    def encode_pair(self, first: str, second: str) -> tuple[list[int], list[int]]:
        """``[CLS] first [SEP] second [SEP]`` and its token types (0 for the first part, 1 after)."""
        a, b = self.encode(first, bos=True, eos=True), self.encode(second, eos=True)
        return a + b, [0] * len(a) + [1] * len(b)

    def words(self, text: str) -> list[str]:
        """The basic tokenizer: normalized ``text`` split at whitespace, each punctuation mark a word."""
        n = self.normalization
        if n.clean_text:
            text = "".join(" " if c.isspace() else c for c in text
                           if c in "\t\n\r" or not (c == "\0" or c == "\ufffd" or unicodedata.category(c)[0] == "C"))
        if n.chinese_chars:
            text = "".join(f" {c} " if _is_cjk(ord(c)) else c for c in text)
        if n.strip_accents:
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        if n.lowercase:
            text = text.lower()
        words: list[str] = []
        for chunk in text.split():
            start = 0
            for i, c in enumerate(chunk):
                if c in _ASCII_PUNCTUATION or unicodedata.category(c)[0] == "P":
                    if start < i:
                        words.append(chunk[start:i])
                    words.append(c)
                    start = i + 1
            if start < len(chunk):
                words.append(chunk[start:])
        return words

    def word_ids(self, word: str) -> list[int]:
        """One word as the longest vocabulary pieces from its start; unknown if any part is not."""
        if len(word) > self.max_word_chars:
            return [self.unk_id]
        ids, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                found = self.vocab.get(piece)
                if found is not None:
                    ids.append(found)
                    break
                end -= 1
            else:
                return [self.unk_id]
            start = end
        return ids


def _is_cjk(code: int) -> bool:
    return any(lo <= code <= hi for lo, hi in _CJK)


def is_wordpiece_json(spec: dict[str, Any]) -> bool:
    model = spec.get("model")
    return isinstance(model, dict) and model.get("type") == "WordPiece"


def wordpiece_from_json(path: Path, spec: dict[str, Any]) -> WordPieceTokenizer:
    """From a ``tokenizer.json`` whose model is WordPiece (``is_wordpiece_json``)."""
    model = spec["model"]
    vocab = model.get("vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                              for i in vocab.values()):
        raise ModelLoadError(f"{path}: model.vocab must map tokens to ids")
    norm = spec.get("normalizer") or {}
    if not isinstance(norm, dict):
        raise ModelLoadError(f"{path}: normalizer must be an object")
    if norm and norm.get("type") != "BertNormalizer":
        raise ModelLoadError(f"{path}: normalizer {norm.get('type')!r:.40} is not supported with WordPiece "
                             "(expected BertNormalizer)")
    lowercase = bool(norm.get("lowercase", False)) if norm else False
    strip = norm.get("strip_accents")
    normalization = Normalization(lowercase=lowercase, strip_accents=lowercase if strip is None else bool(strip),
                                  chinese_chars=bool(norm.get("handle_chinese_chars", True)) if norm else False,
                                  clean_text=bool(norm.get("clean_text", True)) if norm else False)
    specials = [t.get("content") for t in spec.get("added_tokens") or [] if isinstance(t, dict)
                and isinstance(t.get("content"), str) and t.get("special")]
    cls, sep = _post_markers(spec.get("post_processor"))
    return WordPieceTokenizer(
        vocab, normalization, unk=str(model.get("unk_token", "[UNK]")), cls=cls, sep=sep, specials=specials,
        prefix=str(model.get("continuing_subword_prefix", SUBWORD_PREFIX)),
        max_word_chars=int(model.get("max_input_chars_per_word", MAX_WORD_CHARS)), where=str(path))


def _post_markers(post: Any) -> tuple[str, str]:
    """The tokens a BERT post-processor puts around a text (``[CLS]``, ``[SEP]`` by default)."""
    if isinstance(post, dict) and post.get("type") == "BertProcessing":
        cls, sep = post.get("cls"), post.get("sep")
        if isinstance(cls, list) and isinstance(sep, list) and cls and sep:
            return str(cls[0]), str(sep[0])
    if isinstance(post, dict) and post.get("type") == "TemplateProcessing":
        single = [item.get("SpecialToken", {}).get("id") for item in post.get("single") or []
                  if isinstance(item, dict) and "SpecialToken" in item]
        if len(single) == 2 and all(isinstance(t, str) for t in single):
            return single[0], single[1]
    return "[CLS]", "[SEP]"


def wordpiece_from_vocab_txt(model_dir: Path) -> WordPieceTokenizer:
    """From ``vocab.txt`` (one token a line, its id its line number) and ``tokenizer_config.json``."""
    path = model_dir / "vocab.txt"
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read the vocabulary ({e})") from None
    if lines and lines[-1] == "":
        lines.pop()
    vocab: dict[str, int] = {}
    for i, line in enumerate(lines):
        vocab[line.rstrip("\r")] = i  # a repeated token keeps its last line, as transformers reads it
    config_path = model_dir / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    lowercase = bool(config.get("do_lower_case", True))
    strip = config.get("strip_accents")

    def token(name: str, default: str) -> str:
        value = config.get(name, default)
        return value.get("content", default) if isinstance(value, dict) else str(value)

    return WordPieceTokenizer(
        vocab, Normalization(lowercase=lowercase, strip_accents=lowercase if strip is None else bool(strip),
                             chinese_chars=bool(config.get("tokenize_chinese_chars", True))),
        unk=token("unk_token", "[UNK]"), cls=token("cls_token", "[CLS]"), sep=token("sep_token", "[SEP]"),
        pad=token("pad_token", "[PAD]"), specials=[token("mask_token", "[MASK]")], where=str(path))
