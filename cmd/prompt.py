"""Prompt text to token ids: through the model's chat format, as plain completion, or as the prefix
of a fill-in-the-middle (``--suffix``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from llama_chat.cmd.inputs import UsageProblem
from llama_chat.inference.fim import FimPrompt, Infill, NoFimTokens, fill_in_the_middle
from llama_chat.inference.reasoning import Thinking, ThinkTags, template_kwargs, think_tags
from llama_chat.model.chat_format import FORMAT_NAMES, ChatFormat, Message, chat_format_from_file
from llama_chat.model.tokenizers.base import Tokenizer, encode_prompt

# The formats a user can name for a model that has none of its own.
NAMED_FORMATS = "|".join(name for name in FORMAT_NAMES if name not in ("auto", "none"))


def with_template_file(loaded: Any, path: str | None) -> Any:
    """``loaded`` with the chat template of ``--chat-template-file``, where one is given."""
    if path is None:
        return loaded
    if not hasattr(loaded, "model"):  # a remote model: its server applies its own template
        raise UsageProblem("--chat-template-file: a remote model's server applies its own template")
    return replace(loaded, chat_format=chat_format_from_file(path, loaded.tokenizer))


def thinking_model(loaded: Any) -> tuple[ThinkTags, Tokenizer] | None:
    """A thinking model's tags and tokenizer (what ``Options.request`` takes as ``think``); None
    for a model that does not think, and for a remote one (its server splits its replies)."""
    if loaded.chat_format is None or not hasattr(loaded, "model"):
        return None
    tags = think_tags(loaded.tokenizer, loaded.chat_format)
    return None if tags is None else (tags, loaded.tokenizer)


def dialog_ids(chat_format: ChatFormat, messages: Sequence[Message], *, thinking: Thinking,
               think: tuple[ThinkTags, Tokenizer] | None, **extra: Any) -> list[int]:
    """A dialog's ids, ending where the reply begins, with what the template is given for the
    thinking (``enable_thinking``) and ``extra`` (tools, a request's own variables)."""
    return chat_format.encode_dialog(messages, add_generation_prompt=True, **_with_variables(extra, thinking, think))


def dialog_text(chat_format: ChatFormat, messages: Sequence[Message], *, thinking: Thinking,
                think: tuple[ThinkTags, Tokenizer] | None, **extra: Any) -> str | None:
    """The text a chat template renders of the dialog that ``dialog_ids`` tokenizes; None for a
    built-in format, which writes ids."""
    render = getattr(chat_format, "render", None)
    if render is None:
        return None
    return render(messages, add_generation_prompt=True, **_with_variables(extra, thinking, think))


def _with_variables(extra: dict[str, Any], thinking: Thinking, think: tuple[ThinkTags, Tokenizer] | None
                    ) -> dict[str, Any]:
    variables = {**(extra.pop("template_kwargs", None) or {}),
                 **template_kwargs(think[0] if think else None, thinking)}
    if variables:
        extra["template_kwargs"] = variables
    return extra


def prompt_ids(text: str, *, system: str | None, tokenizer: Tokenizer, chat_format: ChatFormat | None,
               template: str = "auto", thinking: Thinking = Thinking(),
               think: tuple[ThinkTags, Tokenizer] | None = None) -> list[int]:
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
    return dialog_ids(chat_format, messages, thinking=thinking, think=think)


def fim_prompt_ids(loaded: Any, prefix: str, suffix: str) -> FimPrompt:
    """``--suffix``: the prompt is the code before the cursor, and the model's own FIM tokens frame
    it (no chat template); ``UsageProblem`` naming what a model without them lacks."""
    if not hasattr(loaded, "model"):
        raise UsageProblem("--suffix needs a model loaded here, not a remote one (send suffix to its server)")
    try:
        return fill_in_the_middle(loaded.tokenizer, Infill(prefix, suffix))
    except NoFimTokens as e:
        raise UsageProblem(str(e)) from None
