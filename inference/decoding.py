"""Streaming UTF-8 decoding of token bytes, holding back emoji that may still grow.

A model spells text as a stream of token byte strings whose boundaries need not fall between
characters (byte-fallback pieces, tiktoken byte tokens), and it spells one visible emoji as several
code points (a family is three faces joined by ZERO WIDTH JOINER). ``StreamDecoder`` turns the bytes
into text that is safe to show: a character is committed once its bytes are complete, and a trailing
run of code points that could still join into a longer emoji is held back until something else
arrives. At the end, ``flush`` releases everything, decoding any dangling bytes the way
``bytes.decode("utf-8", errors="replace")`` does.

The guarantee: for any split of any byte string into chunks,
``"".join(map(feed, chunks)) + flush()`` equals
``b"".join(chunks).decode("utf-8", errors="replace")``. Bytes are held back only while they are a
proper prefix of a well-formed UTF-8 sequence; everything before such a prefix is decoded at once
with ``bytes.decode``. That split is exact because a well-formed prefix starts with a lead byte,
and ``errors="replace"`` always ends the previous (possibly broken) sequence before a lead byte,
emitting the same single U+FFFD whether that sequence was cut by the end of input or by the lead
byte. (``codecs``' incremental decoder gives the same text too, but it also buffers ``ED A0..BF``,
the start of an encoded surrogate that can never complete, which would make ``pending_bytes``
lie.) A ``feed`` costs amortized O(len(data)): each byte is decoded once and each held code
point is joined once when released.

Holding rule, applied after every ``feed``: the committed text never ends with a code point for
which ``may_grow_emoji`` is true (Extended_Pictographic, regional indicator, ZWJ, VS16, skin-tone
modifier, tag character). Such a trailing run waits in ``pending_text`` until a code point outside
that set arrives, which releases the whole run at once. Consequences worth knowing:

- A family emoji, a skin-toned emoji, a flag or a tag-sequence flag appears whole, in one ``feed``.
- A keycap such as "1️⃣" (``1``, U+FE0F, U+20E3) is not held as a unit: the digit is ordinary
  text and is committed at once; U+FE0F is then held, and U+20E3 (not in the set) releases
  "\\ufe0f\\u20e3" together. So the keycap can appear as "1" first and its marks a few tokens
  later; a terminal composes the combining marks onto the digit already on screen.
- A long unbroken run of such code points (a model repeating flags) stays pending until the run
  ends or the stream is flushed. Display code can show ``pending_text`` dimmed meanwhile.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from llama_chat.inference.emoji_data import may_grow_emoji

__all__ = ["StreamDecoder", "TextMaker", "stop_cut"]


def stop_cut(text: str, stops: Sequence[str]) -> int | None:
    """Where a stop string ends ``text``: the start of the first stop string to be complete, as
    OpenAI's API stops as soon as any is; of those complete at the same character, the longest.
    None when ``text`` holds none. With stops ``c`` and ``ac ``, the text ``ac `` ends as ``a``:
    ``c`` is complete one character before ``ac `` is."""
    ends = [(i + len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    return min(ends)[1] if ends else None


def _sequence_length(lead: int) -> int:
    """Length of the UTF-8 sequence a byte starts; 0 for continuation and never-valid bytes."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0  # ASCII is handled by the caller; 0x80..0xC1 and 0xF5..0xFF never start a sequence


# Lead bytes whose second byte is narrower than 0x80..0xBF (RFC 3629): these exclude overlong
# forms (E0, F0), UTF-16 surrogates (ED) and code points above U+10FFFF (F4).
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


def _incomplete_tail(buf: bytes) -> int:
    """Length of the suffix of ``buf`` that is a proper prefix of a well-formed UTF-8 sequence."""
    n = len(buf)
    for k in range(1, min(3, n) + 1):
        b = buf[n - k]
        if 0x80 <= b <= 0xBF:
            continue  # a continuation byte: the lead, if any, is further back
        if _sequence_length(b) <= k:
            return 0  # ASCII, an invalid byte, or a sequence that is already complete
        if k >= 2:
            lo, hi = _SECOND_BYTE.get(b, (0x80, 0xBF))
            if not lo <= buf[n - k + 1] <= hi:
                return 0
        return k
    return 0


def _growable_suffix_start(text: str) -> int:
    """Index where the trailing run of code points that may grow an emoji begins (len if none)."""
    i = len(text)
    while i > 0 and may_grow_emoji(ord(text[i - 1])):
        i -= 1
    return i


class StreamDecoder:
    """Incremental UTF-8 decoder for token bytes; one instance per generated answer."""

    __slots__ = ("_partial", "_held")

    def __init__(self) -> None:
        self._partial = b""  # a proper prefix of a well-formed sequence, at most 3 bytes
        # Pieces of held text, joined lazily: a long held run then costs O(piece) per feed
        # instead of O(run) for repeated string concatenation.
        self._held: list[str] = []

    def feed(self, data: bytes) -> str:
        """Decode one token's bytes; return the text this token newly commits (possibly "")."""
        buf = self._partial + data if self._partial else data
        keep = _incomplete_tail(buf)
        self._partial = buf[len(buf) - keep :] if keep else b""
        text = buf[: len(buf) - keep].decode("utf-8", errors="replace")
        if not text:
            return ""
        cut = _growable_suffix_start(text)
        if cut == 0:
            # Everything new may still grow an emoji: it joins the held run, nothing commits.
            self._held.append(text)
            return ""
        committed = text[:cut]
        if self._held:
            # A code point outside the set arrived, so the held run is released before it.
            committed = "".join(self._held) + committed
            self._held.clear()
        if cut < len(text):
            self._held.append(text[cut:])
        return committed

    def flush(self) -> str:
        """Return everything still held; dangling incomplete bytes become U+FFFD. Resets state."""
        out = "".join(self._held) + self._partial.decode("utf-8", errors="replace")
        self._held.clear()
        self._partial = b""
        return out

    @property
    def pending_bytes(self) -> bytes:
        """The start of a UTF-8 sequence still waiting for its remaining bytes (for display)."""
        return self._partial

    @property
    def pending_text(self) -> str:
        """Complete code points held back because they may still grow an emoji (for display)."""
        if len(self._held) > 1:
            self._held[:] = ["".join(self._held)]
        return self._held[0] if self._held else ""


class TextMaker:
    """Token bytes in, text to show out: the one place where generated text is made.

    On top of ``StreamDecoder`` (whole characters, whole emoji) it drops the word-start space
    before a chat reply's first word (``strip_leading_space``) and applies stop strings: text is
    matched across token boundaries, the first stop string to be complete ends the text just
    before it (``stopped`` is then true and everything after is ignored), and text is held back
    only while it could still be the start of a stop string. It also counts how many of the
    latest tokens what is held comes from.

    For any token stream, ``"".join(feed(d) for d in tokens) + finish()`` equals the decoder's
    text without the stripped space, cut where ``stop_cut`` cuts it.
    """

    def __init__(self, stops: Sequence[str] = (), *, strip_leading_space: bool = False) -> None:
        self.decoder = StreamDecoder()
        self.stops = tuple(s for s in stops if s)
        self._strip = strip_leading_space
        self._stop_held = ""  # released by the decoder, but perhaps the start of a stop string
        self._released = 0  # characters the decoder has released so far
        self._committed = 0  # characters handed out so far
        # For each recent token whose bytes are not all committed yet: how many characters there
        # will be once its bytes are decoded. It is held while that is beyond what is committed.
        self._ends: deque[int] = deque()
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """One token's bytes; the text it newly commits (possibly "")."""
        if self.stopped:
            return ""
        if self._strip and data:
            self._strip = False
            if data.startswith(b" "):
                data = data[1:]
        text = self._release(self.decoder.feed(data), final=False)
        if data and not self.stopped:
            d = self.decoder
            self._ends.append(self._released + len(d.pending_text) + (1 if d.pending_bytes else 0))
        while self._ends and self._ends[0] <= self._committed:
            self._ends.popleft()
        if self.stopped:
            self._ends.clear()
        return text

    def finish(self, *, cut_off: bool = False) -> str:
        """Everything still held. ``cut_off`` (a cancelled stream): bytes of an unfinished
        character are dropped instead of shown as U+FFFD; whole held characters are kept."""
        tail = self.decoder.pending_text if cut_off else ""
        flushed = self.decoder.flush()
        self._ends.clear()
        if self.stopped:
            return ""
        return self._release(tail if cut_off else flushed, final=True)

    @property
    def held_bytes(self) -> bytes:
        return b"" if self.stopped else self.decoder.pending_bytes

    @property
    def held_text(self) -> str:
        return "" if self.stopped else self._stop_held + self.decoder.pending_text

    @property
    def held_tokens(self) -> int:
        return len(self._ends)

    def _release(self, new: str, *, final: bool) -> str:
        """Pass text the decoder released through the stop strings; what may be shown now."""
        self._released += len(new)
        if not self.stops:
            self._committed += len(new)
            return new
        buf = self._stop_held + new if self._stop_held else new
        cut = stop_cut(buf, self.stops)
        if cut is not None:
            out, self._stop_held, self.stopped = buf[:cut], "", True
        elif final:
            out, self._stop_held = buf, ""
        else:
            keep = self._possible_start(buf)
            out, self._stop_held = buf[:len(buf) - keep], buf[len(buf) - keep:]
        self._committed += len(out)
        return out

    def _possible_start(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that a stop string starts with."""
        for k in range(min(len(buf), max(map(len, self.stops)) - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
