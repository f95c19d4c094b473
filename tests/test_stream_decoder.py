"""StreamDecoder: UTF-8 with replacement semantics, split anywhere, emoji released whole.

The invariants checked after every ``feed`` (``fed`` = all bytes fed so far, ``committed`` = the
concatenation of every ``feed`` result so far):

1. ``pending_bytes`` is a suffix of ``fed`` and a proper prefix of some UTF-8 sequence (1-3 bytes
   that strict decoding rejects only with "unexpected end of data");
2. with ``settled = fed[:len(fed) - len(pending_bytes)]``:
   ``committed + pending_text == settled.decode("utf-8", errors="replace")``;
3. ``committed + pending_text + pending_bytes.decode("utf-8", errors="replace")
   == fed.decode("utf-8", errors="replace")`` (what a flush right now would give);
4. ``committed`` never ends with a code point that may grow an emoji, and ``pending_text`` is made
   only of such code points.

At the end, ``committed + flush()`` equals the full decode. For valid text we also check *when*
each character is committed: a character that cannot grow an emoji in the feed that completes its
bytes; one that can, in the feed that completes the next character that cannot (or at flush).
"""

from __future__ import annotations

import codecs
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_chat.inference.decoding import StreamDecoder
from llama_chat.inference.emoji_data import (
    EXTENDED_PICTOGRAPHIC,
    is_extended_pictographic,
    may_grow_emoji,
)

# Examples per property come from the hypothesis profile (tests/conftest.py): a few hundred by
# default, 10,000 with HYPOTHESIS_PROFILE=long.
PROPERTY = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLUSH = -1  # "feed index" of the final flush


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def check_pending_bytes(pending: bytes) -> None:
    if not pending:
        return
    assert 1 <= len(pending) <= 3
    try:
        pending.decode("utf-8")
    except UnicodeDecodeError as err:  # pytest.raises per feed would dominate the run time
        assert err.reason == "unexpected end of data" and err.start == 0
    else:
        raise AssertionError(f"pending bytes {pending!r} are a complete sequence")


def run_checked(chunks: list[bytes]) -> list[str]:
    """Feed ``chunks`` checking the invariants after each feed; return feed results + flush."""
    dec = StreamDecoder()
    fed = b""
    committed = ""
    outs: list[str] = []
    for chunk in chunks:
        out = dec.feed(chunk)
        outs.append(out)
        fed += chunk
        committed += out
        pending = dec.pending_bytes
        assert fed.endswith(pending)
        check_pending_bytes(pending)
        settled = fed[: len(fed) - len(pending)]
        held = dec.pending_text
        assert committed + held == decode(settled)
        assert committed + held + decode(pending) == decode(fed)
        assert not committed or not may_grow_emoji(ord(committed[-1]))
        assert all(may_grow_emoji(ord(c)) for c in held)
    outs.append(dec.flush())
    assert "".join(outs) == decode(fed)
    assert dec.pending_bytes == b"" and dec.pending_text == ""
    return outs


def split_at_random(data: bytes, seed: int) -> list[bytes]:
    """``data`` cut at random points (chunks of 1-5 bytes, like byte and multi-byte tokens).

    A seeded ``random.Random`` keeps hypothesis' work per example small; the data itself is what
    hypothesis shrinks.
    """
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(data):
        n = rng.randint(1, 5)
        chunks.append(data[i : i + n])
        i += n
    return chunks


seeds = st.integers(0, 2**32 - 1)


# Fragments that make decoders disagree when they get UTF-8 wrong: lead bytes without their
# continuations, stray continuations, overlong forms, encoded surrogates, bytes never valid in
# UTF-8, code points above U+10FFFF, and the boundaries of every sequence length.
TRICKY = [
    b"\x80", b"\xbf", b"\xc0", b"\xc1", b"\xc0\xaf", b"\xc2", b"\xc2\x80", b"\xdf\xbf",
    b"\xe0", b"\xe0\x80", b"\xe0\x9f\xbf", b"\xe0\xa0\x80", b"\xe2\x82", b"\xe2\x82\xac",
    b"\xed\x9f\xbf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xee\x80\x80", b"\xef\xbf\xbf",
    b"\xf0", b"\xf0\x8f\xbf\xbf", b"\xf0\x90\x80\x80", b"\xf0\x9f", b"\xf0\x9f\x98",
    b"\xf0\x9f\x98\x80", b"\xf4\x8f\xbf\xbf", b"\xf4\x90\x80\x80", b"\xf5", b"\xf8\x88\x80\x80\x80",
    b"\xfe", b"\xff", b"a", b" ", b"\n", b"\xe2\x80\x8d", b"\xef\xb8\x8f", b"\xf0\x9f\x87\xab",
]  # fmt: skip

messy_bytes = st.lists(
    st.one_of(st.binary(min_size=1, max_size=4), st.sampled_from(TRICKY)), max_size=16
).map(b"".join)


@PROPERTY
@given(messy_bytes, seeds)
def test_any_bytes_any_split_matches_bytes_decode(raw, seed):
    chunks = split_at_random(raw, seed)
    run_checked(chunks)
    # The split rule the decoder relies on, seen through CPython's own incremental decoder: it
    # too gives the whole-string text, hence the same replacement count, for every split.
    inc = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = "".join(inc.decode(c) for c in chunks) + inc.decode(b"", final=True)
    assert out == decode(raw)


EMOJI = [
    "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466",  # family: man, woman, girl, boy
    "\U0001F469\u200d\u2764\ufe0f\u200d\U0001F48B\u200d\U0001F468",  # kiss: woman, man
    "\U0001F9D1\U0001F3FD\u200d\U0001F680",  # astronaut, medium skin tone
    "\U0001F44D\U0001F3FF",  # thumbs up, dark skin tone
    "\U0001F3F3\ufe0f\u200d\U0001F308",  # rainbow flag
    "\U0001F3F3\ufe0f\u200d\u26a7\ufe0f",  # transgender flag
    "\U0001F408\u200d\u2b1b",  # black cat
    "\U0001F1EB\U0001F1F7",  # France
    "\U0001F1EF\U0001F1F5",  # Japan
    "\U0001F3F4\U000E0067\U000E0062\U000E0065\U000E006E\U000E0067\U000E007F",  # England
    "\U0001F3F4\U000E0067\U000E0062\U000E0073\U000E0063\U000E0074\U000E007F",  # Scotland
    "\u2764\ufe0f",  # red heart, emoji presentation
    "\u2708\ufe0f",  # airplane
    "\u00a9\ufe0f",  # copyright sign
    "\U0001F600",
    "\U0001FAE0",  # melting face (Unicode 14)
    "\U0001F1FA",  # a lone regional indicator
    "1\ufe0f\u20e3",  # keycaps: the base is ordinary text, see test_keycap_*
    "#\ufe0f\u20e3",
    "*\ufe0f\u20e3",
]
TEXT = [
    "a", " ", "hello", "\n", ", ", "7", "日本語", "中", "한국어", "é", "e\u0301", "Ωß",
    "\u20ac", "\U00020000", "\ufffd", "\u3000", "\t",
]  # fmt: skip

pieces = st.lists(st.sampled_from(EMOJI + TEXT), max_size=10)


def check_commit_timing(text: str, chunks: list[bytes], outs: list[str]) -> None:
    """Each character is committed exactly when the holding rule says, no earlier, no later."""
    # Feed index in which each character's last byte arrives.
    chunk_of_byte = [i for i, c in enumerate(chunks) for _ in c]
    completes, pos = [], 0
    for ch in text:
        pos += len(ch.encode())
        completes.append(chunk_of_byte[pos - 1])
    expected, release = [0] * len(text), FLUSH
    for k in range(len(text) - 1, -1, -1):
        if may_grow_emoji(ord(text[k])):
            expected[k] = release
        else:
            expected[k] = release = completes[k]
    actual = [FLUSH if i == len(outs) - 1 else i for i, out in enumerate(outs) for _ in out]
    assert actual == expected


@PROPERTY
@given(pieces)
def test_emoji_and_text_byte_by_byte(parts):
    text = "".join(parts)
    chunks = [bytes([b]) for b in text.encode()]
    outs = run_checked(chunks)
    assert "".join(outs) == text
    check_commit_timing(text, chunks, outs)
    # An emoji made only of code points that may grow is never cut across feeds.
    feed_of_char = [i for i, out in enumerate(outs) for _ in out]
    start = 0
    for part in parts:
        if part in EMOJI and all(may_grow_emoji(ord(c)) for c in part):
            assert len(set(feed_of_char[start : start + len(part)])) == 1, part
        start += len(part)


@PROPERTY
@given(pieces, seeds)
def test_emoji_and_text_random_splits(parts, seed):
    text = "".join(parts)
    chunks = split_at_random(text.encode(), seed)
    outs = run_checked(chunks)
    check_commit_timing(text, chunks, outs)


# --- examples -------------------------------------------------------------------------------------


def feed_bytes(dec: StreamDecoder, data: bytes) -> list[str]:
    return [dec.feed(bytes([b])) for b in data]


def test_family_emoji_appears_whole_in_one_feed():
    family = EMOJI[0]
    dec = StreamDecoder()
    outs = feed_bytes(dec, family.encode())
    assert outs == [""] * len(family.encode())
    assert dec.pending_text == family and dec.pending_bytes == b""
    assert dec.feed(b" ") == family + " "
    assert dec.flush() == ""


def test_pending_state_while_an_emoji_is_spelled_out():
    dec = StreamDecoder()
    assert dec.feed(b"Hi \xf0\x9f") == "Hi "
    assert dec.pending_bytes == b"\xf0\x9f" and dec.pending_text == ""
    assert dec.feed(b"\x91\x8d") == ""  # thumbs up complete, but a skin tone may follow
    assert dec.pending_bytes == b"" and dec.pending_text == "\U0001F44D"
    assert dec.feed("\U0001F3FD".encode()[:3]) == ""
    assert dec.pending_bytes == "\U0001F3FD".encode()[:3]
    assert dec.feed(b"\xbd!") == "\U0001F44D\U0001F3FD!"


def test_cjk_and_accents_are_committed_immediately():
    dec = StreamDecoder()
    assert feed_bytes(dec, "日本".encode()) == ["", "", "日", "", "", "本"]
    assert feed_bytes(dec, "é".encode()) == ["", "é"]
    assert dec.flush() == ""


def test_flags_and_tag_sequences_wait_for_the_next_character():
    england = EMOJI[9]
    dec = StreamDecoder()
    assert dec.feed("\U0001F1EB".encode()) == ""
    assert dec.feed("\U0001F1F7".encode()) == ""
    assert dec.feed(b".") == "\U0001F1EB\U0001F1F7."
    assert feed_bytes(dec, england.encode())[-1] == ""
    assert dec.pending_text == england
    assert dec.flush() == england


def test_keycap_digit_commits_first_then_its_marks():
    # The digit cannot grow an emoji by the rule, so it shows at once; VS16 is held and the
    # combining keycap (not growable itself) releases both marks together.
    dec = StreamDecoder()
    assert dec.feed(b"1") == "1"
    assert dec.feed("\ufe0f".encode()) == ""
    assert dec.pending_text == "\ufe0f"
    assert dec.feed("\u20e3".encode()) == "\ufe0f\u20e3"
    assert dec.pending_text == ""


def test_invalid_bytes_become_replacement_characters_in_place():
    raw = b"a\x80b\xe2\x82c\xed\xa0\x80d\xf5\xff\xc0\xafe\xf0\x9f"
    expected = "a\ufffdb\ufffdc\ufffd\ufffd\ufffdd\ufffd\ufffd\ufffd\ufffde\ufffd"
    assert decode(raw) == expected
    dec = StreamDecoder()
    assert "".join(feed_bytes(dec, raw)) + dec.flush() == expected
    dec = StreamDecoder()
    assert dec.feed(raw) + dec.flush() == expected


def test_truncated_sequence_followed_by_ascii():
    dec = StreamDecoder()
    assert dec.feed(b"\xf0\x9f\x98") == ""
    assert dec.pending_bytes == b"\xf0\x9f\x98"
    assert dec.feed(b"x") == "\ufffdx"
    assert dec.pending_bytes == b""


def test_encoded_surrogate_prefix_is_not_held():
    # ED A0 can never complete (it starts an encoded surrogate), so it is replaced at once rather
    # than shown as pending; codecs' incremental decoder would keep it buffered.
    dec = StreamDecoder()
    assert dec.feed(b"\xed\xa0") == "\ufffd\ufffd"
    assert dec.pending_bytes == b""
    assert dec.feed(b"\xed\x9f") == ""
    assert dec.pending_bytes == b"\xed\x9f"


def test_flush_replaces_dangling_bytes_and_resets():
    dec = StreamDecoder()
    assert dec.feed("\U0001F600".encode()[:2]) == ""
    assert dec.flush() == "\ufffd"
    assert dec.flush() == ""
    assert dec.pending_bytes == b"" and dec.pending_text == ""
    assert dec.feed(b"ok") == "ok"


def test_empty_feed_commits_nothing():
    dec = StreamDecoder()
    assert dec.feed(b"") == ""
    dec.feed(b"\xe2")
    assert dec.feed(b"") == "" and dec.pending_bytes == b"\xe2"


def test_one_token_carrying_several_characters_commits_them_all():
    # The seed engine released one code point per token; here a token commits everything whole.
    dec = StreamDecoder()
    assert dec.feed("ab中".encode()) == "ab中"
    dec.feed("\U0001F600".encode()[:1])
    assert dec.feed("\U0001F600".encode()[1:] + "日本".encode()) == "\U0001F600日本"


# --- the emoji table ------------------------------------------------------------------------------


def test_extended_pictographic_table_is_sorted_disjoint_and_complete():
    for (a, b), (c, _) in zip(EXTENDED_PICTOGRAPHIC, EXTENDED_PICTOGRAPHIC[1:]):
        assert a <= b < c - 1  # sorted, disjoint, and adjacent lines merged
    assert sum(b - a + 1 for a, b in EXTENDED_PICTOGRAPHIC) == 3537  # total in emoji-data.txt


@pytest.mark.parametrize(
    ("cp", "pictographic", "grows"),
    [
        (ord("A"), False, False),
        (ord("#"), False, False),
        (ord("1"), False, False),
        (0x00A8, False, False),
        (0x00A9, True, True),  # copyright sign
        (0x200D, False, True),  # ZWJ
        (0xFE0F, False, True),  # VS16
        (0x20E3, False, False),  # combining keycap
        (0x2764, True, True),  # heavy black heart
        (0x4E2D, False, False),  # CJK
        (0x1F1E5, True, True),  # reserved, just below the regional indicators
        (0x1F1E6, False, True),  # regional indicator A
        (0x1F3FA, True, True),
        (0x1F3FB, False, True),  # skin tone 1-2
        (0x1F600, True, True),
        (0x1FAFF, True, True),
        (0x1FB00, False, False),  # legacy computing symbols
        (0x1FFFD, True, True),
        (0xE0020, False, True),  # TAG SPACE
        (0xE007F, False, True),  # CANCEL TAG
        (0xE0080, False, False),
        (0x10FFFF, False, False),
    ],
)
def test_emoji_properties(cp, pictographic, grows):
    assert is_extended_pictographic(cp) is pictographic
    assert may_grow_emoji(cp) is grows
