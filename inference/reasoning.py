"""A thinking model's reply: its thinking kept apart from its answer, switched on and off, and
budgeted.

Qwen3, QwQ and the DeepSeek-R1 distills write ``<think> ... </think>`` before they answer. Where
the tags are tokens of the vocabulary (``ThinkTags.start_id``), the reply is split on those ids;
where they are plain text, on the tags' bytes, with a tag cut across two tokens held back as the
stream decoder holds a character's bytes. ``ReplyText`` is that split, on the core's text path: the
one-shot command, the chat, ``--batch``, ``serve`` and a remote model's stream all read a reply
through it.

::

    tags = think_tags(tokenizer, chat_format)             # None: not a thinking model
    kwargs = template_kwargs(tags, thinking)              # enable_thinking, for the template
    request = thinking_request(request, tags, thinking)   # the prompt closed (off), the split, the grammar
    reply = ReplyText(request.stop, split=request.thinking)
    content, reasoning = reply.feed(token_id, data)

Off is the template's own way where it has one (Qwen3's ``enable_thinking=false`` renders an
empty think block); otherwise the end tag is written into the prompt at once. A budget, or a
constraint on the answer, is a grammar (``ml/grammars.thinking_grammar``): the thinking runs free
for at most the budget's tokens, then the end tag is forced, and the answer's constraint starts
after it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llama_chat.inference.decoding import TextMaker
from llama_chat.ml.controls import THINK_MODES, ControlError, check
from llama_chat.ml.grammars import thinking_grammar

from llama_chat.inference.types import END_TAG, START_TAG, Request, ThinkSplit, ThinkTags

if TYPE_CHECKING:
    from llama_chat.model.tokenizers.base import Tokenizer

# What the families write after the end tag, before the answer (and what off writes for them).
AFTER_END = "\n\n"
# Whitespace around the thinking and before the answer is not part of either: every template and
# every peer's parser drops it. ASCII only, so a UTF-8 character is never cut.
WHITESPACE = b" \t\r\n"
# How many of a prompt's last tokens are read to tell whether it ends inside the thinking.
PROMPT_TAIL_TOKENS = 16


@dataclass(frozen=True)
class Thinking:
    """The thinking settings of one request. ``mode``: ``on``, ``off`` or ``auto`` (as the
    template does by default). ``budget``: the most thinking tokens (None: no limit; 0: off).
    ``split``: keep the thinking apart from the answer (``--reasoning-format none``: no, the
    thinking stays in the text, tags and all)."""

    mode: str = "auto"
    budget: int | None = None
    split: bool = True

    def __post_init__(self) -> None:
        if self.mode not in THINK_MODES:
            raise ControlError("think", f"must be one of {', '.join(THINK_MODES)}, got {self.mode!r}")
        if self.budget is not None:
            check("reasoning_budget", self.budget)

    @property
    def off(self) -> bool:
        return self.mode == "off" or self.budget == 0


def think_tags(tokenizer: Tokenizer, chat_format: Any) -> ThinkTags | None:
    """The thinking tags of a model, or None where it does not think: the tags are tokens of the
    vocabulary (added tokens such as Qwen3's), or the chat template writes them."""
    template = getattr(chat_format, "template", None) or ""
    start_id, end_id = _tag_id(tokenizer, START_TAG), _tag_id(tokenizer, END_TAG)
    if end_id is None and END_TAG not in template:
        return None
    tokens = start_id is not None and end_id is not None
    return ThinkTags(start_id=start_id if tokens else None, end_id=end_id if tokens else None,
                     switch="enable_thinking" in template)


def _tag_id(tokenizer: Tokenizer, tag: str) -> int | None:
    """The id of the one token that is ``tag``: a special token by that name, or a token whose
    bytes are the tag's and which the tokenizer makes of the tag's text."""
    specials = tokenizer.special_tokens
    if tag in specials:
        return specials[tag]
    try:
        ids = tokenizer.encode(tag)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot spell it has no such token
        return None
    if len(ids) == 1 and tokenizer.token_bytes(ids[0]) == tag.encode():
        return ids[0]
    return None


def template_kwargs(tags: ThinkTags | None, thinking: Thinking) -> dict[str, Any]:
    """What the chat template is given for ``thinking``: ``enable_thinking`` where it reads it and
    the request chose."""
    if tags is None or not tags.switch or (thinking.mode == "auto" and not thinking.off):
        return {}
    return {"enable_thinking": not thinking.off}


def prompt_inside(tags: ThinkTags, prompt_ids: tuple[int, ...], tokenizer: Tokenizer) -> bool:
    """Whether the prompt ends inside the thinking: its last start tag comes after its last end tag."""
    tail = prompt_ids[-PROMPT_TAIL_TOKENS:]
    if tags.tokens:
        starts = [i for i, t in enumerate(tail) if t == tags.start_id]
        ends = [i for i, t in enumerate(tail) if t == tags.end_id]
        return bool(starts) and (not ends or starts[-1] > ends[-1])
    text = b"".join(tokenizer.token_bytes(t) for t in tail)
    return text.rfind(tags.start.encode()) > text.rfind(tags.end.encode())


def thinking_request(request: Request, tags: ThinkTags | None, thinking: Thinking, tokenizer: Tokenizer) -> Request:
    """``request`` for a thinking model's reply under ``thinking``. Off: a prompt that opened the
    thinking is closed at once, and one that did not gets an empty think block where the template
    wrote none. On: the reply's splitter, and, where there is a budget or a constraint, the grammar
    that holds the thinking to its budget and the answer to its constraint."""
    if tags is None:
        return request
    ids = request.prompt_ids
    inside = prompt_inside(tags, ids, tokenizer)
    split = ThinkSplit(tags, inside) if thinking.split else None
    if thinking.off:
        if inside:
            ids = (*ids, *_spell(tokenizer, tags.end_id, tags.end), *tokenizer.encode(AFTER_END))
        elif not _closed_block(tags, ids, tokenizer):
            ids = (*ids, *_spell(tokenizer, tags.start_id, tags.start), *tokenizer.encode(AFTER_END),
                   *_spell(tokenizer, tags.end_id, tags.end), *tokenizer.encode(AFTER_END))
        return dataclasses.replace(request, prompt_ids=ids, thinking=dataclasses.replace(split, inside=False)
                                   if split else None)
    constraint = request.constraint
    if thinking.budget is not None or constraint is not None:
        # A model left to think as it likes (auto, nothing opened, no budget) may answer at once: a
        # model that has the tags in its vocabulary but never thinks keeps its answer's constraint
        # from the first token.
        optional = not inside and thinking.mode == "auto" and thinking.budget is None
        constraint = thinking_grammar(constraint, open_tag="" if inside else _lark_tag(tags, tags.start_id, tags.start),
                                      close_tag=_lark_tag(tags, tags.end_id, tags.end), budget=thinking.budget,
                                      tags_are_tokens=tags.tokens, optional=optional)
    return dataclasses.replace(request, thinking=split, constraint=constraint)


def _closed_block(tags: ThinkTags, ids: tuple[int, ...], tokenizer: Tokenizer) -> bool:
    """The prompt ends just after an end tag and blank space (the template wrote an empty block)."""
    tail = ids[-PROMPT_TAIL_TOKENS:]
    if tags.tokens:
        ends = [i for i, t in enumerate(tail) if t == tags.end_id]
        return bool(ends) and not b"".join(tokenizer.token_bytes(t) for t in tail[ends[-1] + 1:]).strip(WHITESPACE)
    text = b"".join(tokenizer.token_bytes(t) for t in tail)
    return text.rstrip(WHITESPACE).endswith(tags.end.encode())


def _spell(tokenizer: Tokenizer, token_id: int | None, text: str) -> list[int]:
    return [token_id] if token_id is not None else tokenizer.encode(text)


def _lark_tag(tags: ThinkTags, token_id: int | None, text: str) -> str:
    """A tag as an item of the grammar: its token by id, or its text as a string literal."""
    return f"<[{token_id}]>" if tags.tokens else json.dumps(text)


# -- the reply, split ------------------------------------------------------------------------------

BEFORE, THINKING, ANSWER = "before", "thinking", "answer"


class ReplyText:
    """One reply's bytes in, its answer's text and its thinking's text out.

    The answer goes through a ``TextMaker`` (whole characters, stop strings, the chat reply's
    word-start space); the thinking through one of its own, without stop strings. Without a split
    (not a thinking model, or ``--reasoning-format none``) it is the answer's maker alone.

    For any reply, the joined answers equal the text after the end tag (whitespace before it
    dropped), and the joined thinking the text between the tags, stripped, however the bytes
    were cut into tokens.
    """

    def __init__(self, stops=(), *, strip_leading_space: bool = False, split: ThinkSplit | None = None) -> None:
        self.content = TextMaker(stops, strip_leading_space=strip_leading_space)
        self.thought = TextMaker()
        self.split = split
        self.state = ANSWER if split is None else THINKING if split.inside else BEFORE
        self.reasoning_tokens = 0
        self._held = b""  # a tag's start, or a reply's first bytes that may open the thinking
        self._space = b""  # the thinking's trailing whitespace, kept until more thinking follows
        self._thought_started = False
        self._another = False  # the thinking was opened again after an answer began
        self._answer_started = split is None

    # -- what TextStream reads -------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self.content.stopped

    @property
    def thinking(self) -> bool:
        return self.state == THINKING

    @property
    def _shown(self) -> TextMaker:
        return self.thought if self.state == THINKING else self.content

    @property
    def held_bytes(self) -> bytes:
        return self._shown.held_bytes

    @property
    def held_text(self) -> str:
        return self._shown.held_text

    @property
    def held_tokens(self) -> int:
        return self._shown.held_tokens

    def feed(self, token_id: int, data: bytes) -> tuple[str, str]:
        """One token; the answer's and the thinking's text it newly commits."""
        if self.state == ANSWER:
            tags = self.split.tags if self.split is not None else None
            if tags is not None and tags.tokens and token_id in (tags.start_id, tags.end_id):
                # A tag token never spells the answer: a start tag opens another thinking block.
                if token_id == tags.start_id:
                    self.state, self._thought_started, self._another = THINKING, False, True
                return "", ""
            return self._answer(data), ""
        tags = self.split.tags
        if self.state == BEFORE:
            return self._before(token_id, data, tags)
        self.reasoning_tokens += 1
        if tags.tokens:
            if token_id == tags.end_id:
                self.reasoning_tokens -= 1
                return "", self._close()
            if token_id == tags.start_id:
                self.reasoning_tokens -= 1
                return "", ""
            return "", self._think(data)
        buf = self._held + data
        start, end = tags.start.encode(), tags.end.encode()
        reasoning = ""
        # A start tag inside the thinking is dropped, as its token is where the tags are tokens.
        while (opened := buf.find(start)) >= 0 and not 0 <= buf.find(end) < opened:
            reasoning += self._think(buf[:opened])
            buf = buf[opened + len(start):]
        at = buf.find(end)
        if at >= 0:
            self._held = b""
            reasoning += self._think(buf[:at]) + self._close()
            return self._answer(buf[at + len(end):]), reasoning
        keep = max(_partial_suffix(buf, end), _partial_suffix(buf, start))
        self._held = buf[len(buf) - keep:]
        return "", reasoning + self._think(buf[:len(buf) - keep])

    def finish(self, *, cut_off: bool = False) -> tuple[str, str]:
        """Everything still held, as ``TextMaker.finish``: the answer's and the thinking's."""
        held, self._held = self._held, b""
        reasoning = ""
        if self.state == BEFORE:
            self.state = ANSWER
            text = self._answer(held)
        elif self.state == THINKING:
            reasoning = self._think(held) + self.thought.finish(cut_off=cut_off)
            text = ""
        else:
            text = ""
        return text + self.content.finish(cut_off=cut_off), reasoning

    # -- internals -------------------------------------------------------------------------------

    def _before(self, token_id: int, data: bytes, tags: ThinkTags) -> tuple[str, str]:
        """The reply's start: the thinking opens, or the answer begins."""
        if tags.tokens:
            if token_id == tags.start_id:
                self.state = THINKING
                return "", ""
            if not data.strip(WHITESPACE) and data:
                self._held += data
                return "", ""
            self.state = ANSWER
            held, self._held = self._held, b""
            return self._answer(held + data), ""
        buf = self._held + data
        start = tags.start.encode()
        bare = buf.lstrip(WHITESPACE)
        if bare.startswith(start):
            self._held = b""
            self.state = THINKING
            return self.feed(token_id, bare[len(start):])
        if start.startswith(bare):
            self._held = buf
            return "", ""
        self._held = b""
        self.state = ANSWER
        return self._answer(buf), ""

    def _think(self, data: bytes) -> str:
        if not self._thought_started:
            data = data.lstrip(WHITESPACE)
            if not data:
                return ""
            self._thought_started = True
            if self._another:  # a later block of thinking, apart from the one before
                self._another = False
                data = AFTER_END.encode() + data
        core = data.rstrip(WHITESPACE)
        if not core:
            self._space += data
            return ""
        text = self.thought.feed(self._space + core)
        self._space = data[len(core):]
        return text

    def _close(self) -> str:
        """The end tag: the thinking is done (its trailing whitespace dropped)."""
        self.state = ANSWER
        self._space = b""
        return self.thought.finish()

    def _answer(self, data: bytes) -> str:
        if not self._answer_started:
            data = data.lstrip(WHITESPACE)
            if not data:
                return ""
            self._answer_started = True
        return self.content.feed(data)


def _partial_suffix(buf: bytes, tag: bytes) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``tag``."""
    for k in range(min(len(buf), len(tag) - 1), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


__all__ = ["AFTER_END", "END_TAG", "ReplyText", "START_TAG", "ThinkSplit", "ThinkTags", "Thinking",
           "prompt_inside", "template_kwargs", "think_tags", "thinking_request"]
