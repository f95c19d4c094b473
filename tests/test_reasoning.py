"""The thinking splitter (inference/reasoning.py): a reply's thinking apart from its answer, on token
ids or on text cut anywhere, and the grammar that budgets the thinking and constrains the answer."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_chat.inference.reasoning import ReplyText, ThinkSplit, ThinkTags, Thinking, thinking_request
from llama_chat.inference.types import Request
from llama_chat.ml.constraints import Constraints
from llama_chat.ml.controls import ControlError
from llama_chat.ml.grammars import Constraint
from llama_chat.ml.processors import TokenHistory

TEXT_TAGS = ThinkTags()
START, END = 1000, 1001
TOKEN_TAGS = ThinkTags(start_id=START, end_id=END)
WS = " \t\r\n"
# Text with the tags' pieces in it, whole and cut, so that tags split across pieces come often.
words = st.lists(st.sampled_from(["<think>", "<th", "ink>", "</", "think>", "<", "a", "b", " ", "\n", "é", "🙂"]),
                 max_size=12).map("".join)


def expected(reply: str, *, inside: bool) -> tuple[str, str]:
    """What a reply's text comes to, (answer, thinking), as the splitter's docstring says."""
    body = reply
    if not inside:
        bare = reply.lstrip(WS)
        if not bare.startswith("<think>"):
            return bare, ""
        body = bare[len("<think>"):]
    thought, tag, answer = body.partition("</think>")
    # A start tag inside the thinking is dropped (as its token is where the tags are tokens).
    return answer.lstrip(WS), thought.replace("<think>", "").strip(WS)


def run(reply: ReplyText, pieces) -> tuple[str, str, list[tuple[str, str]]]:
    out = [reply.feed(token, data) for token, data in pieces]
    out.append(reply.finish())
    return "".join(a for a, _ in out), "".join(r for _, r in out), out


def cuts(data: bytes, points: list[int]) -> list[bytes]:
    points = sorted({p % (len(data) + 1) for p in points})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:]) if b > a]


@settings(max_examples=400, deadline=None)
@given(before=words, thought=words, answer=words, opened=st.booleans(), closed=st.booleans(),
       points=st.lists(st.integers(0, 200), max_size=12))
def test_text_tags_split_the_same_however_the_bytes_are_cut(before, thought, answer, opened, closed, points):
    reply = (f"{before[:2]}<think>" if opened else "") + thought + ("</think>" + answer if closed else "")
    got_answer, got_thought, _ = run(ReplyText(split=ThinkSplit(TEXT_TAGS, inside=not opened)),
                                     [(7, piece) for piece in cuts(reply.encode(), points)])
    assert (got_answer, got_thought) == expected(reply, inside=not opened)


@settings(max_examples=300, deadline=None)
@given(thought=words, answer=words, points=st.lists(st.integers(0, 200), max_size=12))
def test_token_tags_split_on_ids_and_text_tags_inside_are_thinking(thought, answer, points):
    pieces = [(START, b"<think>"), *((7, p) for p in cuts(thought.encode(), points)), (END, b"</think>"),
              *((7, p) for p in cuts(answer.encode(), points))]
    reply = ReplyText(split=ThinkSplit(TOKEN_TAGS))
    got_answer, got_thought, _ = run(reply, pieces)
    assert got_thought == thought.strip(WS)  # a "</think>" spelled in text pieces is thinking here
    assert got_answer == answer.lstrip(WS)
    assert reply.reasoning_tokens == len(cuts(thought.encode(), points))


def test_control_tag_tokens_that_spell_nothing_still_split():
    reply = ReplyText(split=ThinkSplit(TOKEN_TAGS, inside=True))
    pieces = [(7, b"so "), (7, b"\xf0\x9f"), (7, b"\x99\x82 ok\n"), (END, b""), (7, b"\n\nAnswer")]
    answer, thought, steps = run(reply, pieces)
    assert (answer, thought) == ("Answer", "so 🙂 ok")
    assert reply.reasoning_tokens == 3


def test_a_tag_cut_across_pieces_never_shows_and_the_answer_keeps_its_stop_strings():
    reply = ReplyText(stops=("STOP",), split=ThinkSplit(TEXT_TAGS))
    pieces = [b"<th", b"ink>\nplan", b" it</th", b"in", b"k>\n\nyes STOP no"]
    steps = [reply.feed(7, p) for p in pieces]
    assert all("<" not in a and "<" not in r for a, r in steps)
    assert "".join(a for a, _ in steps) + reply.finish()[0] == "yes "
    assert "".join(r for _, r in steps) == "plan it"
    assert reply.stopped


def test_an_unfinished_thinking_is_kept_as_thinking_on_a_cut_off():
    reply = ReplyText(split=ThinkSplit(TEXT_TAGS, inside=True))
    a1, r1 = reply.feed(7, b"half a tho")
    a2, r2 = reply.feed(7, b"ught </thi")
    tail = reply.finish(cut_off=True)
    assert a1 + a2 + tail[0] == ""
    assert r1 + r2 + tail[1] == "half a thought </thi"


def test_without_a_split_it_is_the_text_makers_text():
    reply = ReplyText(split=None)
    assert run(reply, [(START, b"<think>x"), (END, b"</think>y")])[:2] == ("<think>x</think>y", "")


# -- the budget and the answer's constraint, as a grammar --------------------------------------------


class _Vocab:
    """A vocabulary of single characters, the two tags as tokens, and an end token."""

    def __init__(self) -> None:
        self.pieces = [b""] + [bytes([c]) for c in range(32, 127)] + [b"\n", b"<think>", b"</think>", b"\n\n"]
        self.vocab_size = len(self.pieces)

    special_tokens: dict[str, int] = {}

    def token_bytes(self, token_id: int) -> bytes:
        return self.pieces[token_id]

    def encode(self, text: str) -> list[int]:
        data = text.encode()
        return [self.pieces.index(b"\n\n")] if data == b"\n\n" else [self.pieces.index(bytes([b])) for b in data]


def _allowed(processor, history: TokenHistory) -> set[int]:
    out = processor(history, torch.zeros(1, len(_Vocab().pieces)))
    return set(torch.nonzero(torch.isfinite(out[0])).flatten().tolist())


def test_the_budget_forces_the_end_tag_then_a_blank_line_then_the_answers_schema():
    vocab = _Vocab()
    end_id = vocab.pieces.index(b"</think>")
    schema = Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    tags = ThinkTags(start_id=vocab.pieces.index(b"<think>"), end_id=end_id)
    request = thinking_request(Request((5, tags.start_id), constraint=schema), tags, Thinking(budget=3), vocab)
    assert request.thinking == ThinkSplit(tags, inside=True)
    processor = Constraints(vocab, [0]).processor(request.constraint)
    letter = vocab.pieces.index(b"x")
    history = TokenHistory([list(request.prompt_ids)], vocab_size=vocab.vocab_size)
    for _ in range(3):
        assert letter in _allowed(processor, history)
        history.append([letter])
    assert _allowed(processor, history) == {end_id}
    history.append([end_id])
    blank = vocab.pieces.index(b"\n\n")
    assert _allowed(processor, history) == {blank}
    history.append([blank])
    assert _allowed(processor, history) == {vocab.pieces.index(b"{")}


def test_off_closes_an_opened_thinking_and_writes_an_empty_block_otherwise():
    vocab = _Vocab()
    tags = ThinkTags(start_id=vocab.pieces.index(b"<think>"), end_id=vocab.pieces.index(b"</think>"))
    opened = thinking_request(Request((5, tags.start_id)), tags, Thinking(mode="off"), vocab)
    assert opened.prompt_ids[-2] == tags.end_id and opened.thinking.inside is False
    plain = thinking_request(Request((5, 6)), tags, Thinking(budget=0), vocab)
    assert plain.prompt_ids[2] == tags.start_id and tags.end_id in plain.prompt_ids[3:]
    assert opened.constraint is None and plain.constraint is None


@pytest.mark.parametrize("budget", [-1, 1.5, True, "3"])
def test_a_budget_that_is_not_a_count_is_refused_in_one_line(budget):
    with pytest.raises(ControlError, match="reasoning_budget must be an integer"):
        Thinking(budget=budget)


def test_a_mode_outside_its_choices_is_refused():
    with pytest.raises(ControlError, match="think must be one of auto, on, off"):
        Thinking(mode="maybe")


def test_the_grammar_names_the_answers_constraint_in_its_description():
    vocab = _Vocab()
    tags = ThinkTags(start_id=vocab.pieces.index(b"<think>"), end_id=vocab.pieces.index(b"</think>"))
    schema = Constraint.json_schema({"type": "object"})
    request = thinking_request(Request((5,), constraint=schema), tags, Thinking(), vocab)
    assert request.constraint.describe() == schema.describe()
    assert json.loads(request.constraint.grammar)["grammars"][1]["name"] == "answer"


def test_a_model_left_to_think_as_it_likes_may_answer_at_once_or_think_first():
    vocab = _Vocab()
    tags = ThinkTags(start_id=vocab.pieces.index(b"<think>"), end_id=vocab.pieces.index(b"</think>"))
    schema = Constraint.json_schema({"type": "object"})
    brace = vocab.pieces.index(b"{")
    for mode, first in (("auto", {tags.start_id, brace}), ("on", {tags.start_id})):
        request = thinking_request(Request((5,), constraint=schema), tags, Thinking(mode=mode), vocab)
        processor = Constraints(vocab, [0]).processor(request.constraint)
        history = TokenHistory([list(request.prompt_ids)], vocab_size=vocab.vocab_size)
        assert _allowed(processor, history) & {tags.start_id, brace} == first, mode


def test_a_second_thinking_block_after_the_answer_began_is_thinking_too():
    reply = ReplyText(split=ThinkSplit(TOKEN_TAGS))
    pieces = [(START, b"<think>"), (7, b"a"), (END, b"</think>"), (7, b"\n\nans "), (START, b"<think>"), (7, b"c"),
              (END, b"</think>"), (7, b" end")]
    answer, thought, _ = run(reply, pieces)
    assert (answer, thought) == ("ans  end", "a\n\nc")
