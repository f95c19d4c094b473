"""One dim marker per token whose bytes are still held back, not one per byte."""

from __future__ import annotations

import io

from rich.console import Console

from llama_chat.cmd.render import LiveRenderer
from llama_chat.inference.decoding import TextMaker


def feed_all(tokens: list[bytes]) -> list[tuple[str, int]]:
    """(committed text, held tokens) after each token, then after the final flush."""
    maker = TextMaker()
    calls = [(maker.feed(data), maker.held_tokens) for data in tokens]
    calls.append((maker.finish(), maker.held_tokens))
    return calls


def test_byte_tokens_count_one_marker_each_until_the_character_completes():
    plane = "✈".encode()  # three byte tokens, then held as an emoji until a new cluster starts
    calls = feed_all([b"a", plane[:1], plane[1:2], plane[2:], b" b"])
    assert calls == [("a", 0), ("", 1), ("", 2), ("", 3), ("✈ b", 0), ("", 0)]


def test_multi_byte_tokens_count_once_each():
    family = "👨‍👩‍👧".encode()  # split into tokens of several bytes, as tiktoken vocabularies do
    tokens = [family[0:3], family[3:7], family[7:12], family[12:18], b" ok"]
    calls = feed_all(tokens)
    assert [n for _, n in calls[:4]] == [1, 2, 3, 4]
    assert calls[4] == ("👨‍👩‍👧 ok", 0)


def test_a_held_character_spanning_two_tokens_counts_both():
    man, woman = "👨".encode(), "👩".encode()
    # Both faces stay held (a pictograph never ends the committed text); the second one's first
    # byte came with the first token, so both tokens hold something.
    calls = feed_all([man + woman[:1], woman[1:], b" x", woman[:2]])
    assert calls[:3] == [("", 1), ("", 2), ("👨👩 x", 0)]
    assert calls[3] == ("", 1)


def test_live_renderer_draws_one_marker_per_pending_token():
    out = io.StringIO()
    renderer = LiveRenderer(Console(file=out, force_terminal=True, width=80), color=False)
    renderer.start()
    renderer.update("", b"\xf0\x9f\x91", "", 1)
    assert out.getvalue().count(".") == 1
    renderer.finish()
