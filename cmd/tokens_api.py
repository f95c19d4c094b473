"""Counting and templating without generating: Anthropic's ``POST /v1/messages/count_tokens`` and
llama-server's ``POST /tokenize``, ``/detokenize`` and ``/apply-template``.

Each runs what a generation request runs up to its prompt: the body read by its API's parser, the
chat template rendered with the request's tools and thinking settings over the server's
(``serve_app._prompt_ids``), so that a count is the ``input_tokens`` a ``messages.create`` of the
same body reports, and ``/apply-template`` is the text the chat route tokenizes.

``/tokenize``: ``{content, add_special, parse_special, with_pieces}`` answered ``{tokens}``, each an
id or, with pieces, ``{id, piece}`` (the piece a string where its bytes are whole UTF-8, else the
list of its bytes). ``/detokenize``: ``{tokens}`` answered ``{content}``. A special token is
spelled by its name in both, so one's output is the other's input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llama_chat.cmd.anthropic_api import parse_count
from llama_chat.cmd.openai_api import bad, parse_chat
from llama_chat.cmd.prompt import dialog_ids, dialog_text
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.serve_app import (LARGE_BODY_BYTES, ServerState, _check_model, _parse_body, _prompt_ids, _read_body,
                                      dialog_parts, request_thinking)
from llama_chat.cmd.served import Served, refuse_generation
from llama_chat.model.chat_format import encode_allowing_special
from llama_chat.model.tokenizers.base import Tokenizer, encode_prompt


def token_routes(state: ServerState, endpoint: Callable) -> list[Route]:
    """The routes, wrapped by the server's ``endpoint`` (the key, each API's error object)."""

    async def run(request: HttpRequest, work: Callable[[Served, dict[str, Any]], dict[str, Any]]) -> Response:
        served = state.require_ready()
        data = await _read_body(state, request)
        # Parsing, rendering and tokenizing are CPU work: off the event loop, large bodies a few at a time.
        limiter = state.large_bodies if len(data) > LARGE_BODY_BYTES else None
        answer = await anyio.to_thread.run_sync(lambda: work(served, _parse_body(data)), limiter=limiter)
        return JSONResponse(answer)

    async def count_tokens(request: HttpRequest) -> Response:
        return await run(request, count)

    async def tokenize_route(request: HttpRequest) -> Response:
        return await run(request, tokenize)

    async def detokenize_route(request: HttpRequest) -> Response:
        return await run(request, detokenize)

    async def apply_template_route(request: HttpRequest) -> Response:
        return await run(request, apply_template)

    return [Route("/v1/messages/count_tokens", endpoint(count_tokens, anthropic=True), methods=["POST"]),
            Route("/tokenize", endpoint(tokenize_route), methods=["POST"]),
            Route("/detokenize", endpoint(detokenize_route), methods=["POST"]),
            Route("/apply-template", endpoint(apply_template_route), methods=["POST"])]


def count(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    """The prompt tokens of a Messages request: its dialog and tools, as ``_prepare`` makes them."""
    refuse_generation(served)
    generation = parse_count(body)
    _check_model(served, generation.model, any_name=True)
    thinking = request_thinking(served, generation)
    return {"input_tokens": len(_prompt_ids(served, generation, generation.prompts[0], thinking))}


def apply_template(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    """The text the chat template renders of a Chat Completions body (a built-in format's ids,
    spelled out)."""
    refuse_generation(served)
    generation = parse_chat(body)
    _check_model(served, generation.model, any_name=True)
    thinking = request_thinking(served, generation)
    loaded = served.loaded
    messages, extra = dialog_parts(served, generation, generation.prompts[0])
    try:
        text = dialog_text(loaded.chat_format, messages, thinking=thinking, think=served.think, **extra)
        if text is None:
            text = spelled(loaded.tokenizer, dialog_ids(loaded.chat_format, messages, thinking=thinking,
                                                        think=served.think, **extra))
    except ValueError as e:  # roles out of order for the format, a template that failed
        raise bad(one_line(str(e)), "messages") from None
    return {"prompt": text}


def tokenize(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    content = body.get("content")
    if not isinstance(content, str):
        raise bad("content must be a string", "content")
    add_special, parse_special = _flag(body, "add_special", False), _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    tokenizer = served.loaded.tokenizer
    ids = encode_allowing_special(tokenizer, content) if parse_special else tokenizer.encode(content)
    if add_special:
        # The markers a plain prompt gets (``encode_prompt``): bos, and eos where the model's files say so.
        markers = encode_prompt(tokenizer, "")
        start = markers[:1] if markers[:1] == [tokenizer.bos_id] else []
        ids = [*start, *ids, *markers[len(start):]]
    if not with_pieces:
        return {"tokens": ids}
    names = _names(tokenizer)
    return {"tokens": [{"id": i, "piece": _piece(tokenizer, names, i)} for i in ids]}


def detokenize(served: Served, body: dict[str, Any]) -> dict[str, Any]:
    tokens = body.get("tokens")
    vocab = served.loaded.tokenizer.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
        raise bad(f"tokens must be a list of token ids, each in 0 <= id < {vocab}", "tokens")
    return {"content": spelled(served.loaded.tokenizer, tokens)}


def spelled(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """The text of ``ids``, special tokens by their names, bytes decoded whole (a broken character
    replaced)."""
    names = _names(tokenizer)
    return b"".join(_bytes(tokenizer, names, i) for i in ids).decode("utf-8", errors="replace")


def _names(tokenizer: Tokenizer) -> dict[int, str]:
    return {i: name for name, i in tokenizer.special_tokens.items()}


def _bytes(tokenizer: Tokenizer, names: dict[int, str], token: int) -> bytes:
    """A token's bytes; a control token's, which has none in text, its name's."""
    data = tokenizer.token_bytes(token)
    return data if data or token not in names else names[token].encode("utf-8")


def _piece(tokenizer: Tokenizer, names: dict[int, str], token: int) -> str | list[int]:
    data = _bytes(tokenizer, names, token)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {value!r:.40}", name)
    return value


__all__ = ["apply_template", "count", "detokenize", "spelled", "token_routes", "tokenize"]
