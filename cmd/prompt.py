"""Prompt text to token ids: through the model's chat format, or as plain completion."""

from __future__ import annotations

from llama_chat.cmd.inputs import UsageProblem
from llama_chat.model.chat_format import FORMAT_NAMES, ChatFormat, Message
from llama_chat.model.tokenizers.base import Tokenizer, encode_prompt

# The formats a user can name for a model that has none of its own.
NAMED_FORMATS = "|".join(name for name in FORMAT_NAMES if name not in ("auto", "none"))


def prompt_ids(text: str, *, system: str | None, tokenizer: Tokenizer, chat_format: ChatFormat | None,
               template: str = "auto") -> list[int]:
    """A one-turn dialog (optional system message, then the user's text) or the text itself.

    Without a chat format there is nowhere to put a system message, and silently dropping it
    would hide that the model never saw it, so that is a usage error. ``template``: what
    ``--template`` asked for, so the error says whose choice the missing format was.
    """
    if chat_format is None:
        if system and template == "none":
            raise UsageProblem(f"--system needs a chat template, and --template none asks for none "
                               f"(leave it out, or choose one with --template {NAMED_FORMATS})")
        if system:
            raise UsageProblem(f"--system needs a chat template, and this model has none "
                               f"(choose one with --template {NAMED_FORMATS})")
        return encode_prompt(tokenizer, text)
    messages = [Message("system", system)] if system else []
    messages.append(Message("user", text))
    return chat_format.encode_dialog(messages, add_generation_prompt=True)
