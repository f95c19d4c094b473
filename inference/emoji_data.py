"""Which code points can still grow into a longer emoji: the table behind the streaming decoder.

Python's ``unicodedata`` has no ``Extended_Pictographic`` property, so the ranges are embedded.
They are the ``Extended_Pictographic`` lines of the Unicode emoji data file ``emoji-data.txt``
(Unicode 15.1.0, https://www.unicode.org/Public/15.1.0/ucd/emoji/emoji-data.txt), adjacent lines
merged: 3,537 code points. The property deliberately covers reserved code points in the emoji
blocks, so that new emoji arrive already inside it and the table does not go stale with each
Unicode release.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Final

# Inclusive (first, last) ranges, sorted and disjoint.
EXTENDED_PICTOGRAPHIC: Final[tuple[tuple[int, int], ...]] = (
    (0x00A9, 0x00A9), (0x00AE, 0x00AE), (0x203C, 0x203C), (0x2049, 0x2049),
    (0x2122, 0x2122), (0x2139, 0x2139), (0x2194, 0x2199), (0x21A9, 0x21AA),
    (0x231A, 0x231B), (0x2328, 0x2328), (0x2388, 0x2388), (0x23CF, 0x23CF),
    (0x23E9, 0x23F3), (0x23F8, 0x23FA), (0x24C2, 0x24C2), (0x25AA, 0x25AB),
    (0x25B6, 0x25B6), (0x25C0, 0x25C0), (0x25FB, 0x25FE), (0x2600, 0x2605),
    (0x2607, 0x2612), (0x2614, 0x2685), (0x2690, 0x2705), (0x2708, 0x2712),
    (0x2714, 0x2714), (0x2716, 0x2716), (0x271D, 0x271D), (0x2721, 0x2721),
    (0x2728, 0x2728), (0x2733, 0x2734), (0x2744, 0x2744), (0x2747, 0x2747),
    (0x274C, 0x274C), (0x274E, 0x274E), (0x2753, 0x2755), (0x2757, 0x2757),
    (0x2763, 0x2767), (0x2795, 0x2797), (0x27A1, 0x27A1), (0x27B0, 0x27B0),
    (0x27BF, 0x27BF), (0x2934, 0x2935), (0x2B05, 0x2B07), (0x2B1B, 0x2B1C),
    (0x2B50, 0x2B50), (0x2B55, 0x2B55), (0x3030, 0x3030), (0x303D, 0x303D),
    (0x3297, 0x3297), (0x3299, 0x3299), (0x1F000, 0x1F0FF), (0x1F10D, 0x1F10F),
    (0x1F12F, 0x1F12F), (0x1F16C, 0x1F171), (0x1F17E, 0x1F17F), (0x1F18E, 0x1F18E),
    (0x1F191, 0x1F19A), (0x1F1AD, 0x1F1E5), (0x1F201, 0x1F20F), (0x1F21A, 0x1F21A),
    (0x1F22F, 0x1F22F), (0x1F232, 0x1F23A), (0x1F23C, 0x1F23F), (0x1F249, 0x1F3FA),
    (0x1F400, 0x1F53D), (0x1F546, 0x1F64F), (0x1F680, 0x1F6FF), (0x1F774, 0x1F77F),
    (0x1F7D5, 0x1F7FF), (0x1F80C, 0x1F80F), (0x1F848, 0x1F84F), (0x1F85A, 0x1F85F),
    (0x1F888, 0x1F88F), (0x1F8AE, 0x1F8FF), (0x1F90C, 0x1F93A), (0x1F93C, 0x1F945),
    (0x1F947, 0x1FAFF), (0x1FC00, 0x1FFFD),
)  # fmt: skip

ZERO_WIDTH_JOINER: Final = 0x200D
VARIATION_SELECTOR_16: Final = 0xFE0F
REGIONAL_INDICATORS: Final = (0x1F1E6, 0x1F1FF)
SKIN_TONE_MODIFIERS: Final = (0x1F3FB, 0x1F3FF)
TAG_CHARACTERS: Final = (0xE0020, 0xE007F)  # tag letters and CANCEL TAG, as in flag subdivisions


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sort and coalesce inclusive ranges; return parallel tuples of starts and ends for bisect."""
    merged: list[list[int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return tuple(r[0] for r in merged), tuple(r[1] for r in merged)


_PICTO_STARTS, _PICTO_ENDS = _merge(list(EXTENDED_PICTOGRAPHIC))

# One merged table for the decoder's question, so a lookup is one bisect. Regional indicators and
# skin tones sit right next to pictographic ranges and fuse with them.
_GROW_STARTS, _GROW_ENDS = _merge(
    [
        *EXTENDED_PICTOGRAPHIC,
        (ZERO_WIDTH_JOINER, ZERO_WIDTH_JOINER),
        (VARIATION_SELECTOR_16, VARIATION_SELECTOR_16),
        REGIONAL_INDICATORS,
        SKIN_TONE_MODIFIERS,
        TAG_CHARACTERS,
    ]
)
_FIRST_GROWABLE: Final = _GROW_STARTS[0]


def is_extended_pictographic(cp: int) -> bool:
    """Whether ``cp`` has the Unicode ``Extended_Pictographic`` property."""
    i = bisect_right(_PICTO_STARTS, cp) - 1
    return i >= 0 and cp <= _PICTO_ENDS[i]


def may_grow_emoji(cp: int) -> bool:
    """Whether a following code point could join ``cp`` into the same emoji.

    True for Extended_Pictographic code points, regional indicators, ZERO WIDTH JOINER, VARIATION
    SELECTOR-16, skin-tone modifiers and tag characters. A keycap base (digit, ``#``, ``*``) is not
    included: holding every digit would delay ordinary numbers for the sake of rare keycaps.
    """
    if cp < _FIRST_GROWABLE:  # all of ASCII and Latin-1 up to U+00A8: the common case
        return False
    i = bisect_right(_GROW_STARTS, cp) - 1
    return i >= 0 and cp <= _GROW_ENDS[i]
