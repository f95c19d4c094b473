"""Chat formats: a dialog of messages in, the exact token ids a model was trained on out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str


class ChatFormat(Protocol):
    name: str

    def encode_dialog(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        """Token ids for the dialog, ending (when asked) where the assistant's reply begins."""
        ...
