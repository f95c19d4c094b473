"""Model text made safe to write to a terminal or a pipe.

A model can emit any byte, ESC included, so the raw text could move the cursor, recolour the
terminal or retitle the window. Control characters other than newline and tab are shown as their
Unicode "control pictures" (ESC as U+241B) instead; the JSON output keeps the raw text.
"""

from __future__ import annotations

import re

_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _picture(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x20:
        return chr(0x2400 + code)  # U+2400..U+241F: SYMBOL FOR NULL .. SYMBOL FOR UNIT SEPARATOR
    if code == 0x7F:
        return "\u2421"  # SYMBOL FOR DELETE
    return "\ufffd"  # C1 controls have no pictures


def displayable(text: str) -> str:
    return _CONTROLS.sub(_picture, text) if text else text
