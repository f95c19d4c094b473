"""Train the default model's SentencePiece BPE tokenizer (byte fallback, Llama 2's settings).

The emoji are kept out of the vocabulary on purpose: the product's hard case is an emoji that
arrives as four, eight or twenty-five ``<0xNN>`` byte tokens, and the default model must exercise it.
``character_coverage=1.0`` would make every emoji code point a piece, and a coverage below one drops
characters by rarity, which would also drop accented letters. So emoji symbols (and the joiners,
variation selectors and skin-tone modifiers that glue them) are removed from the text the trainer
sees; byte fallback then spells them. Accented, Cyrillic, Greek and CJK letters stay in the
vocabulary as single-character pieces.
"""

from __future__ import annotations

import io
import unicodedata
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

GLUE = {0x200D, 0xFE0F, 0x20E3}  # zero-width joiner, variation selector 16, combining keycap


def is_emoji_char(ch: str) -> bool:
    cp = ord(ch)
    if cp == 0xFFFD:  # the replacement character is a symbol too, but marks broken bytes, not an emoji
        return False
    if cp in GLUE or 0xE0020 <= cp <= 0xE007F:  # tag characters (subdivision flags)
        return True
    # Symbols ("So": animals, food, flags' regional indicators, ☀, ❄) and modifiers ("Sk": skin tones).
    return unicodedata.category(ch) in ("So", "Sk") and cp >= 0x2000


def strip_emoji(text: str) -> str:
    return "".join(ch for ch in text if not is_emoji_char(ch))


def train(sentences: Iterable[str], out: Path, vocab_size: int) -> Path:
    """Writes ``out`` (a ``tokenizer.model``); the same sentences give the same bytes."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=(strip_emoji(s) for s in sentences),
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,  # of the emoji-free text: every letter of every script is kept
        # Llama 2's tokenizer: text kept as is, digits split, ids 0/1/2 = <unk>/<s>/</s>.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        # One thread and no sampling of the input: the same corpus always gives the same model.
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=16384,
        minloglevel=2,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(buf.getvalue())
    return out
