"""The chat's ``/save`` and ``/load`` files: a conversation as JSON, written whole or not at all,
read by the rules every outside file follows.

A file handed to ``/load`` may be anything: a FIFO, ``/dev/zero``, JSON nested ten thousand deep,
a message holding a lone surrogate, a name under a user who does not exist. Whatever it is, the
result is a conversation or one ``ConversationError`` line, after which the chat goes on with the
conversation it had.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_chat.cmd.inputs import MAX_PROMPT_BYTES
from llama_chat.ml.safe_files import UnsafeFile, read_regular, require_regular, write_atomic
from llama_chat.model.safe_input import BadInput, json_problem, loads

SAVE_FORMAT = "llama-chat-conversation/1"
# A saved conversation holds what fitted in a context, many times over at most.
MAX_CONVERSATION_BYTES = MAX_PROMPT_BYTES


class ConversationError(ValueError):
    """A file that cannot be loaded or saved; the message is one line, with the reason."""


@dataclass
class Turn:
    role: str  # "user" | "assistant"
    content: str
    interrupted: bool = False  # an assistant reply stopped by Ctrl+C
    reasoning: str = ""  # an assistant's thinking (a thinking model's), apart from its content

    def as_dict(self) -> dict:
        d = {"role": self.role, "content": self.content}
        if self.reasoning:
            d["reasoning"] = self.reasoning
        if self.interrupted:
            d["interrupted"] = True
        return d


def user_path(text: str) -> Path:
    """``text`` as a path, ``~`` and ``~user`` expanded; ``ConversationError`` for an unknown user
    (``Path.expanduser`` raises a RuntimeError there)."""
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        user = expanded[1:].split("/", 1)[0]
        raise ConversationError(f"no user {user!r} to expand ~{user} for" if user else "no home directory for ~")
    return Path(expanded)


def read_conversation(data: Any) -> tuple[str | None, list[Turn]]:
    """A parsed ``/save`` document as (system message, turns); ValueError saying what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ValueError("no list of messages")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("the system message is not text")
    turns = []
    for i, m in enumerate(data["messages"]):
        expected = "user" if i % 2 == 0 else "assistant"
        if (not isinstance(m, dict) or m.get("role") != expected or not isinstance(m.get("content"), str)
                or not isinstance(m.get("interrupted", False), bool) or not isinstance(m.get("reasoning", ""), str)):
            raise ValueError(f"message {i} is not a {expected} message")
        turns.append(Turn(expected, m["content"], m.get("interrupted", False), m.get("reasoning", "")))
    if turns and turns[-1].role == "user":
        turns.pop()  # an unanswered message: it is asked again by typing it
    return system or None, turns


def parse_conversation(raw: bytes) -> tuple[str | None, list[Turn]]:
    """A ``/save`` file's bytes as (system message, turns); ``ConversationError`` for anything else."""
    try:
        data = loads(raw)
    except json.JSONDecodeError as e:
        raise ConversationError(f"not a saved conversation (not valid JSON: {json_problem(e)})") from None
    except BadInput as e:
        raise ConversationError(f"not a saved conversation ({e})") from None
    try:
        return read_conversation(data)
    except ValueError as e:
        raise ConversationError(f"not a saved conversation ({e})") from None


def load_conversation(name: str) -> tuple[str | None, list[Turn]]:
    """The conversation in file ``name`` (``/load NAME``); ``ConversationError`` in one line."""
    path = user_path(name)
    try:
        raw = read_regular(path, MAX_CONVERSATION_BYTES)
    except UnsafeFile as e:
        raise ConversationError(e.strerror) from None
    except OSError as e:
        raise ConversationError(e.strerror or str(e)) from None
    return parse_conversation(raw)


def save_conversation(name: str, document: dict) -> None:
    """Write ``document`` to file ``name`` (``/save NAME``) through a temporary file: a full disk or
    Ctrl+C leaves the file that was there. ``ConversationError`` in one line."""
    path = user_path(name)
    try:
        if path.exists() or path.is_symlink():
            try:
                require_regular(path)
            except FileNotFoundError:  # a dangling symlink is replaced like a missing file
                pass
        text = json.dumps(document, ensure_ascii=False, indent=2) + "\n"
        write_atomic(path, text.encode("utf-8", errors="replace"))
    except UnsafeFile as e:
        raise ConversationError(e.strerror) from None
    except OSError as e:
        raise ConversationError(e.strerror or str(e)) from None


__all__ = ["ConversationError", "MAX_CONVERSATION_BYTES", "SAVE_FORMAT", "Turn", "load_conversation",
           "parse_conversation", "read_conversation", "save_conversation", "user_path"]
