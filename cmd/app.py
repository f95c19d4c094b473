"""The ``llama-chat`` command line."""

from __future__ import annotations

import sys


def main() -> None:
    print("llama-chat: not implemented yet", file=sys.stderr)
    raise SystemExit(1)
