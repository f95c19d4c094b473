"""Text made safe to write to a terminal or a pipe: model output, and messages quoting model files.

A model can emit any byte, ESC included, and a model's files can hold any string, so either could
move the cursor, recolour the terminal, retitle the window or reorder what is shown. Before text
reaches stdout or stderr:

* C0 controls other than newline and tab, and DEL, become their Unicode "control pictures"
  (ESC as ``␛`` U+241B, DEL as ``␡``);
* C1 controls (U+0080..U+009F), which have no pictures, become an escape such as ``<U+009B>``
  (CSI), so nothing is lost for a reader of ``| tee`` or ``| less``;
* bidirectional formatting controls (U+202A..U+202E embeddings and overrides, U+2066..U+2069
  isolates, U+200E/U+200F/U+061C marks) become the same kind of escape: a right-to-left override
  could otherwise make text read differently from what it is ("Trojan Source").

The JSON output keeps the raw text. ``one_line`` does the same for messages that quote values
from files, and also shows newline and tab as pictures so a message stays one line.
"""

from __future__ import annotations

import re

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_CONTROLS = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")
_CONTROLS_ONE_LINE = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}]")


def _picture(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x20:
        return chr(0x2400 + code)  # U+2400..U+241F: SYMBOL FOR NULL .. SYMBOL FOR UNIT SEPARATOR
    if code == 0x7F:
        return "\u2421"  # SYMBOL FOR DELETE
    return f"<U+{code:04X}>"  # C1 controls and bidi controls have no pictures


def displayable(text: str) -> str:
    """Model output for a terminal or a pipe: newlines and tabs kept, every other control shown."""
    return _CONTROLS.sub(_picture, text) if text else text


def one_line(text: str) -> str:
    """A message for stderr: every control shown, newlines and tabs included."""
    return _CONTROLS_ONE_LINE.sub(_picture, text) if text else text
