"""Prompt text to token ids: through the model's chat format, or as plain completion."""

from __future__ import annotations

from llama_chat.cmd.inputs import UsageProblem
from llama_chat.model.chat_format import ChatFormat, Message
from llama_chat.model.tokenizers.base import Tokenizer


def prompt_ids(text: str, *, system: str | None, tokenizer: Tokenizer, chat_format: ChatFormat | None) -> list[int]:
    """A one-turn dialog (optional system message, then the user's text) or the text itself.

    Without a chat format there is nowhere to put a system message, and silently dropping it
    would hide that the model never saw it, so that is a usage error.
    """
    if chat_format is None:
        if system:
            raise UsageProblem("--system needs a chat template, and this model has none "
                               "(choose one with --template llama2|llama3|hf)")
        return tokenizer.encode(text, bos=True)
    messages = [Message("system", system)] if system else []
    messages.append(Message("user", text))
    return chat_format.encode_dialog(messages, add_generation_prompt=True)
