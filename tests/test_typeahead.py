"""Keys typed during a reply, as the next prompt shows them (``cmd/typeahead.py``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llama_chat.cmd.typeahead import edited

PRINTABLE = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), max_size=40)


@settings(max_examples=300)
@given(PRINTABLE)
def test_plain_text_comes_back_as_typed(text):
    assert edited(text.encode()) == text.strip()


@settings(max_examples=300)
@given(PRINTABLE, st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zl", "Zp")), min_size=1, max_size=10))
def test_backspace_erases_whole_characters(kept, erased):
    typed = kept.encode() + erased.encode() + b"\x7f" * len(erased)
    assert edited(typed) == kept.strip()


def test_line_kill_word_erase_and_line_ends():
    assert edited(b"draft\x15final") == "final"
    assert edited(b"one two\x17three") == "one three"
    assert edited(b"first line\r\nsecond\n") == "first line second"
    assert edited(b"a\x04b\x1b[Ac") == "ab[Ac"  # Ctrl+D and the escape byte dropped
    assert edited(b"\xff ok") == "\ufffd ok"
