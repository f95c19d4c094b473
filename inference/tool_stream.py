"""A reply's text read as it arrives into content and tool calls (``tool_formats.ToolFormat``).

``ToolStream.feed`` takes each piece of text and says what it adds: content, a call's start (its
index, id and name, once), and pieces of the call's arguments, which are the model's own JSON text
cut where the pieces fell. So the arguments streamed concatenate, byte for byte, to the whole
reply's arguments, and a whole reply is the same reader fed its text at once. Text that could
still turn out to be a call's start (a ``<tool_call`` not yet closed, the spaces before it) is held
back until it is known, so no call text reaches the content. Under the format's grammar the calls
are exactly where the reader expects them; text that departs from the layout (no grammar held it:
``tool_choice`` none) is content from that point on.

Given the offered tools' ``names``, a hermes reply is also read in the forms small models slip into
(``tool_formats.SLIPPED_FORMS``): a call in a fenced block after any text, a bare call as the
whole reply, and a list of calls inside the tags. A fence or a bare object that does not name a
listed tool is text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llama_chat.inference.tool_calls import NAME, ToolCall
from llama_chat.inference.tool_formats import FENCE_CLOSE, FENCE_OPENS, GENERIC_TEXT, HERMES_TRIGGER, ToolFormat


@dataclass(frozen=True)
class Delta:
    """What one piece of text added: ``content``; or, for call ``index``, its ``id`` and ``name``
    (at its start) and a piece of its ``arguments``."""

    content: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class ToolStream:
    """One reply's reader. ``new_id``: the id of each call it finds; ``names``: the tools offered
    (for the slipped forms)."""

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str], names: Sequence[str] = ()) -> None:
        self.fmt = fmt
        self.new_id = new_id
        slipped = fmt.name == "hermes"
        self._bare_heads = tuple(f'{{"name": "{name}"' for name in names) if slipped else ()
        self._fences = tuple(fence + head for fence in FENCE_OPENS for head in self._bare_heads)
        self._triggers = (HERMES_TRIGGER, *self._fences)
        self._form = "tagged"  # how the call being read is written: tagged, listed, fenced or bare
        self.buffer = ""
        self.state = "start"
        self.content: list[str] = []
        self.calls: list[_Call] = []
        self._depth = 0  # the arguments' JSON: open brackets, and whether inside a string
        self._in_string = False
        self._escaped = False
        self._out: list[Delta] = []

    # -- what the reply came to ----------------------------------------------------------------------

    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(c.id, c.name, "".join(c.arguments)) for c in self.calls]

    def text(self) -> str | None:
        """The content: None where the reply was calls and nothing else but spaces."""
        text = "".join(self.content)
        return None if self.calls and not text.strip() else text

    # -- reading -------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        while self.buffer and self._step(final=False):
            pass
        return self._take()

    def finish(self) -> list[Delta]:
        """The end of the reply: what was held back is content, unless it was part of a call."""
        while self.buffer and self._step(final=True):
            pass
        if self.state in ("start", "text") and self.buffer:
            self._content(self.buffer)
        self.buffer = ""
        return self._take()

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if text:
            self.content.append(text)
            self._out.append(Delta(content=text))

    def _expect(self, literal: str, final: bool) -> bool | None:
        """Take ``literal`` from the buffer: True taken, None not yet known, False not there."""
        if self.buffer.startswith(literal):
            self.buffer = self.buffer[len(literal):]
            return True
        if literal.startswith(self.buffer) and not final:
            return None
        return False

    def _plain(self) -> bool:
        """Departed from the layout: the rest is content."""
        self.state = "plain"
        self._content(self.buffer)
        self.buffer = ""
        return False

    def _step(self, final: bool) -> bool:
        """One move of the reader; False when it needs more text."""
        fmt, state = self.fmt, self.state
        if state == "plain":
            return self._plain()
        if state == "start":
            return self._start(final)
        if state == "text":
            return self._text(final)
        if state == "open":
            taken = self._expect(fmt.open, final)
            if taken is None:
                return False
            self.state = "tag" if taken else "plain"
            return True
        if state == "tag":
            return self._tag(final)
        if state == "head":
            return self._head(final)
        if state == "args":
            return self._args()
        if state == "close":
            closing = {"tagged": fmt.close, "fenced": FENCE_CLOSE}.get(self._form, "")
            taken = self._expect("}" + closing, final)
            if taken is None:
                return False
            after = {"tagged": "between", "listed": "list"}.get(self._form, "after")
            self.state = after if taken else "plain"
            return True
        if state == "list":
            return self._list(final)
        if state == "between":
            return self._between(final)
        if state == "response":
            return self._response()
        self.buffer = ""  # after the calls: only what the grammar allows there, spaces
        return False

    def _start(self, final: bool) -> bool:
        fmt = self.fmt
        if fmt.text_before:
            if any(self.buffer.startswith(head) for head in self._bare_heads):
                self._form, self.state = "bare", "head"
                return True
            if not final and any(head.startswith(self.buffer) for head in self._bare_heads):
                return False  # a bare call's head, perhaps: not known yet
            self.state = "text"
            return True
        if fmt.name == "generic":
            text = self._expect(GENERIC_TEXT + '"', final)
            if text:
                self.state = "response"
                return True
            calls = self._expect(fmt.start, final)
            if text is None or calls is None:
                return False
            self.state = "open" if calls else "plain"
            return True
        # Text may not start with a call's first character (the grammar says so): that decides.
        if self.buffer[0] != (fmt.start[:1] or "{"):
            return self._plain()
        self.buffer = self.buffer[len(fmt.start):]
        self.state = "open"
        return True

    def _text(self, final: bool) -> bool:
        """Free text before a ``<tool_call>`` (or a fenced call): content, less what may be a
        trigger's start or the spaces before one."""
        found = [(at, trigger) for trigger in self._triggers if (at := self.buffer.find(trigger)) >= 0]
        if found:
            at, trigger = min(found)
            self._content(self.buffer[:at].rstrip())
            self.buffer = self.buffer[at:]
            if trigger == HERMES_TRIGGER:
                self.state = "open"
            else:  # a fenced call: its head is read as a tagged call's is
                self.buffer = self.buffer[trigger.index("{"):]
                self._form, self.state = "fenced", "head"
            return True
        if final:
            return False
        keep = len(self.buffer)
        longest = max(map(len, self._triggers))
        for k in range(min(longest - 1, len(self.buffer)), 0, -1):
            if any(trigger.startswith(self.buffer[-k:]) for trigger in self._triggers):
                keep = len(self.buffer) - k
                break
        head = self.buffer[:keep]
        shown = head.rstrip()
        self._content(shown)
        self.buffer = self.buffer[len(shown):]
        return False

    def _tag(self, final: bool) -> bool:
        """Inside the tags: one call, or a list of them."""
        if self.buffer.startswith("["):
            self.buffer = self.buffer[1:]
            self._form = "listed"
        elif not self.buffer and not final:
            return False
        self.state = "head"
        return True

    def _list(self, final: bool) -> bool:
        """After a call of a list: the next one, or the list's end and the closing tag."""
        more = self._expect(", ", final)
        if more:
            self.state = "head"
            return True
        if more is None:
            return False
        end = self._expect("]" + self.fmt.close, final)
        if end is None:
            return False
        self._form = "tagged"
        self.state = "between" if end else "plain"
        return True

    def _head(self, final: bool) -> bool:
        """``{"name": "NAME", "arguments": `` whole: the call starts. A head the reply ended in is
        dropped (it was cut short: its call never began)."""
        prefix, rest = '{"name": "', f'", "{self.fmt.args_key}": '
        text = self.buffer
        if not text.startswith(prefix):
            return self._wait_or_plain(prefix.startswith(text), final)
        end = text.find('"', len(prefix))
        name = text[len(prefix):] if end < 0 else text[len(prefix):end]
        if name and not NAME.fullmatch(name[:64]):
            return self._plain()
        if end < 0:
            return self._wait_or_plain(len(name) < 64, final)
        after = text[end:]
        if not after.startswith(rest):
            return self._wait_or_plain(rest.startswith(after), final)
        self.buffer = after[len(rest):]
        call = _Call(self.new_id(), name)
        self.calls.append(call)
        self._out.append(Delta(index=len(self.calls) - 1, id=call.id, name=name))
        self._depth, self._in_string, self._escaped = 0, False, False
        self.state = "args"
        return True

    def _wait_or_plain(self, may_go_on: bool, final: bool) -> bool:
        if not may_go_on:
            return self._plain()
        if final:
            self.buffer, self.state = "", "after"
        return False

    def _args(self) -> bool:
        """The arguments' JSON as it comes, up to the bracket that closes it."""
        for i, ch in enumerate(self.buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._arguments(self.buffer[:i + 1])
                    self.buffer = self.buffer[i + 1:]
                    self.state = "close"
                    return True
        self._arguments(self.buffer)
        self.buffer = ""
        return False

    def _arguments(self, text: str) -> None:
        if text:
            self.calls[-1].arguments.append(text)
            self._out.append(Delta(index=len(self.calls) - 1, arguments=text))

    def _between(self, final: bool) -> bool:
        """After a call: the next one, or the end of the calls."""
        fmt = self.fmt
        more = self._expect(fmt.sep + fmt.open, final) if fmt.sep + fmt.open else False
        if more:
            self.state = "head"
            return True
        if more is None:
            return False
        end = self._expect(fmt.end, final)
        if end is None:
            return False
        self.state = "after" if end else "plain"
        return True

    def _response(self) -> bool:
        """The generic format's text: a JSON string, decoded as it comes (an escape held whole)."""
        i, out = 0, []
        text = self.buffer
        while i < len(text):
            ch = text[i]
            if ch == '"':
                self._content("".join(out))
                self.buffer = text[i + 1:]
                self.state = "after"
                return True
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            size = 6 if text[i + 1:i + 2] == "u" else 2
            if i + size > len(text):
                break
            piece = text[i:i + size]
            if piece[:4].lower() in ("\\ud8", "\\ud9", "\\uda", "\\udb"):  # a surrogate pair: both halves
                if i + 12 > len(text):
                    break
                piece = text[i:i + 12]
            try:
                out.append(json.loads(f'"{piece}"'))
            except json.JSONDecodeError:
                out.append(piece)
            i += len(piece)
        self._content("".join(out))
        self.buffer = text[i:]
        return False


__all__ = ["Delta", "ToolStream"]
