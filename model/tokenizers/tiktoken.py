"""tiktoken backend: Llama 3.x ``tokenizer.model``, a text file of ``base64(token bytes) rank`` lines.

The file holds only the base vocabulary. Llama 3 appends 256 special tokens right after it, in a
fixed order (Llama 3.1's, a superset of 3.0's at the ids both use): ``<|begin_of_text|>`` is id
``n_base``, ``<|eot_id|>`` is ``n_base + 9``. Every token's bytes are its byte string in the rank
file; special tokens give ``b""``.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import tiktoken

from llama_chat.model.errors import ModelLoadError
from llama_chat.model.tokenizers.specials import split_on_specials
from llama_chat.model.tokenizers.table import ByteTableTokenizer

# Llama 3's pre-tokenizer split (letters, 1-3 digit groups, punctuation runs, newlines, spaces).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_SPECIAL_TOKENS = 256
_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",  # end of message: the model wants a tool result
    "<|eot_id|>",  # end of turn
    "<|python_tag|>",
)
STOP_TOKENS = ("<|end_of_text|>", "<|eot_id|>", "<|eom_id|>")

# tiktoken's Rust core overflows its stack on huge inputs and on very long runs of only
# whitespace or only non-whitespace; encode such text in pieces that stay under both limits.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

_RANK_LINE = re.compile(rb"[A-Za-z0-9+/]+=*[ \t]+\d+")
_RUNS = re.compile(r"\s+|\S+")


def llama3_special_tokens(n_base: int) -> dict[str, int]:
    """Llama 3.1's special tokens and their ids for a base vocabulary of ``n_base`` tokens."""
    names = list(_NAMED_SPECIALS)
    names += [f"<|reserved_special_token_{2 + i}|>" for i in range(NUM_SPECIAL_TOKENS - len(names))]
    return {name: n_base + i for i, name in enumerate(names)}


def read_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken rank file; ModelLoadError naming the file and line when it is malformed."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read tokenizer ({exc.strerror or exc})") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ModelLoadError(f"{path}:{lineno}: expected 'base64 rank', found {line[:40]!r}") from None
    if not ranks:
        raise ModelLoadError(f"{path}: empty tiktoken rank file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelLoadError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps or repeats")
    # Byte-level BPE must be able to spell any byte; tiktoken's Rust core panics (a BaseException,
    # with a traceback) on text that needs a byte the file lacks, so such a file is refused here.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ModelLoadError(f"{path}: no token for the single byte 0x{missing[0]:02x}"
                             f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; "
                             "a byte-level tokenizer needs all 256")
    return ranks


def split_for_encoding(text: str) -> Iterator[str]:
    """Cut ``text`` so no piece is longer than MAX_ENCODE_CHARS or holds a longer same-kind run.

    A run of whitespace (or of non-whitespace) longer than MAX_RUN_CHARS is cut every
    MAX_RUN_CHARS characters; this is where Meta's reference cuts, so ids match it.
    """
    for start in range(0, len(text), MAX_ENCODE_CHARS):
        chunk = text[start:start + MAX_ENCODE_CHARS]
        cut = 0
        for run in _RUNS.finditer(chunk):
            for pos in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield chunk[cut:pos]
                cut = pos
        yield chunk[cut:]


class TiktokenTokenizer(ByteTableTokenizer):
    """A ``Tokenizer`` over a Llama 3 tiktoken rank file."""

    def __init__(self, path: Path, *, extra_stop_ids: Iterable[int] = ()) -> None:
        self.path = Path(path)
        ranks = read_ranks(self.path)
        n_base = len(ranks)
        self._specials = llama3_special_tokens(n_base)
        self._enc = tiktoken.Encoding(
            name=self.path.name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self._specials,
        )
        table = [b""] * (n_base + NUM_SPECIAL_TOKENS)
        for token, rank in ranks.items():
            table[rank] = token
        self._bytes = table
        self._bos = self._specials["<|begin_of_text|>"]
        self._eos = self._specials["<|end_of_text|>"]
        stops = {self._specials[name] for name in STOP_TOKENS}
        stops.update(i for i in extra_stop_ids if 0 <= i < len(table))
        self._stops = frozenset(stops)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        # Special-token names in user text are encoded as the plain text they are.
        ids = [i for piece in split_for_encoding(text)
               for i in self._enc.encode(piece, allowed_special=set(), disallowed_special=())]
        return self._with_markers(ids, bos, eos)

    def decode(self, ids: Sequence[int]) -> str:
        # Special tokens decode to nothing, exactly as token_bytes says.
        return b"".join(self._bytes[i] for i in ids).decode("utf-8", errors="replace")

    @property
    def strips_leading_space(self) -> bool:
        return False

    @property
    def add_bos(self) -> bool:
        return True

    def encode_allowing_special(self, text: str) -> list[int]:
        """Encode rendered chat-template text: special-token names become their ids.

        Specials are split out first so that the long-run cuts can never fall inside a name.
        """
        ids: list[int] = []
        for chunk, special_id in split_on_specials(text, self._specials):
            ids.extend([special_id] if special_id is not None else self.encode(chunk))
        return ids


def looks_like_tiktoken(head: bytes) -> bool:
    """True when the first line of ``head`` reads ``base64 rank``."""
    first = head.split(b"\n", 1)[0].strip()
    return bool(_RANK_LINE.fullmatch(first))
