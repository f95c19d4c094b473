"""llama-server's ``POST /infill`` as ``llama-chat serve`` speaks it: code completion at a cursor for
the editors' plugins (llama.vim, llama.vscode), read into the same ``Generation`` the OpenAI routes
make, and the objects it sends back.

A body's ``input_prefix`` and ``input_suffix`` are the text before and after the cursor, ``prompt``
the text after the prefix where the middle starts (the cursor's line so far), ``input_extra`` other
files of the project (``[{"filename", "text"}]``), given to a repository-trained model as its
files (``inference/fim.py``). The controls take llama-server's names (``n_predict``,
``repeat_penalty`` ...) and are checked by the one checker every surface uses. The answer is
llama-server's completion object: ``content``, ``stop``, ``stop_type``, ``tokens_predicted``,
``tokens_evaluated``, ``tokens_cached``, ``timings`` (and only the ``response_fields`` asked for,
by path); streamed, its events, each ``data: {...}`` with a piece of ``content``, the last with
``stop: true``. The route and its response build on ``serve_app.py``'s, which imports this module
once it is loaded (``_translated_routes``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Send

from llama_chat.cmd.anthropic_api import matched_stop
from llama_chat.cmd.openai_api import ApiError, Generation, bad, event, read_settings
from llama_chat.cmd.serve_app import SSE_HEADERS, GenerationResponse, _generate
from llama_chat.inference.fim import UNNAMED_FILE, Infill, RepoFile
from llama_chat.inference.types import Completion, GenerationState

if TYPE_CHECKING:
    from llama_chat.cmd.serve_app import ServerState

# llama-server's names for the controls, and ours.
SETTINGS = {"n_predict": "max_tokens", "max_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k",
            "top_p": "top_p", "min_p": "min_p", "typical_p": "typical_p", "seed": "seed", "stop": "stop",
            "repeat_penalty": "repetition_penalty", "repeat_last_n": "repeat_last_n",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "json_schema": "json_schema", "grammar": "grammar", "logit_bias": "logit_bias"}
# Fields that tune llama-server's own slots, caches, samplers' order, time limits and output (the
# indent llama.vim sends, ``cache_prompt`` ...): accepted, and they change nothing here.
IGNORED = ("n_indent", "n_keep", "t_max_prompt_ms", "t_max_predict_ms", "cache_prompt", "samplers", "id_slot",
           "n_probs", "min_keep", "return_tokens", "timings_per_token", "post_sampling_probs", "return_progress")
FIELDS = frozenset(("model", "input_prefix", "input_suffix", "input_extra", "prompt", "stream", "response_fields",
                    *SETTINGS, *IGNORED))
# Our finish reasons in llama-server's words: an end token, a stop word, or a limit.
STOP_TYPES = {
    GenerationState.EOS: "eos",
    GenerationState.STOP_GRAMMAR: "eos",
    GenerationState.STOP_STRING: "word",
    GenerationState.MAX_TOKENS: "limit",
    GenerationState.CONTEXT_FULL: "limit",
    GenerationState.MAX_TIME: "limit",
}


@dataclass(frozen=True)
class InfillGeneration(Generation):
    """An /infill request: a ``Generation`` and the ``response_fields`` its answer keeps."""

    response_fields: tuple[str, ...] | None = None


def parse_infill(body: dict[str, Any]) -> InfillGeneration:
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad(f"unrecognized request argument: {unknown[0]}", unknown[0])
    texts = {}
    for name in ("input_prefix", "input_suffix", "prompt"):
        value = body.get(name, "")
        if value is not None and not isinstance(value, str):
            raise bad(f'"{name}" must be a string', name)
        texts[name] = value or ""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad(f'"stream" must be true or false, got {stream!r}', "stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad('"model" must be a string', "model")
    infill = Infill(texts["input_prefix"], texts["input_suffix"], texts["prompt"], _files(body.get("input_extra")))
    return InfillGeneration(False, (infill,), model=model, stream=stream, settings=_settings(body),
                            response_fields=_response_fields(body.get("response_fields")))


def _files(value: Any) -> tuple[RepoFile, ...]:
    """``input_extra``: ``{"filename", "text"}`` items (llama.vim adds its own ``time``)."""
    if value is None:
        return ()
    shape = '"input_extra" must be an array of {"filename": string, "text": string}'
    if not isinstance(value, list):
        raise bad(shape, "input_extra")
    files = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) \
                or not isinstance(item.get("filename", UNNAMED_FILE), str):
            raise bad(f"{shape}; item {i} is not", "input_extra")
        files.append(RepoFile(item.get("filename", UNNAMED_FILE), item["text"]))
    return tuple(files)


def _response_fields(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad('"response_fields" must be an array of strings', "response_fields")
    return tuple(value)


def _settings(body: dict[str, Any]) -> dict[str, Any]:
    """The controls under their names. llama-server's -1 means none: no limit on ``n_predict``, a
    random ``seed``; its ``n_predict`` 0 (llama.vim's request that only sends context ahead) is
    taken as 1, since a job here makes at least one token."""
    values = dict(body)
    for name in ("n_predict", "max_tokens", "seed"):
        if values.get(name) == -1:
            values[name] = None
    if values.get("n_predict") == 0:
        values["n_predict"] = 1
    return read_settings(values, list(SETTINGS.items()))


@dataclass(frozen=True)
class InfillReply:
    """One answer's objects: the whole completion, or its stream's events."""

    model: str
    prompt_tokens: int
    stops: Sequence[str]  # the request's stop words, to say which one ended it
    fields: Sequence[str] | None = None  # ``response_fields``: the paths kept (None: all)

    def whole(self, completion: Completion, token_bytes: Callable[[int], bytes], *, streamed: bool = False
              ) -> dict[str, Any]:
        c = completion
        body = {"index": 0, "content": "" if streamed else c.text, "tokens": [], "stop": True, "model": self.model,
                "tokens_predicted": c.completion_tokens, "tokens_evaluated": self.prompt_tokens,
                "has_new_line": "\n" in c.text, "stop_type": STOP_TYPES.get(c.finish_reason, "none"),
                "stopping_word": self._stopping_word(c, token_bytes), "tokens_cached": c.cached_tokens,
                "timings": timings(c)}
        return self._kept(body)

    def piece(self, text: str) -> dict[str, Any]:
        return self._kept({"index": 0, "content": text, "tokens": [], "stop": False,
                           "tokens_evaluated": self.prompt_tokens})

    def _stopping_word(self, c: Completion, token_bytes: Callable[[int], bytes]) -> str:
        """The stop word that ended it: in the text of its tokens past the answer's text."""
        if c.finish_reason is not GenerationState.STOP_STRING:
            return ""
        whole = b"".join(token_bytes(t) for t in c.token_ids).decode("utf-8", errors="replace")
        return matched_stop(self.stops, whole[len(c.text):]) or ""

    def _kept(self, body: dict[str, Any]) -> dict[str, Any]:
        """Only the ``response_fields`` paths (``timings/prompt_n``), each under its path, as
        llama-server answers them; a path the body lacks is left out."""
        if self.fields is None:
            return body
        out = {}
        for path in self.fields:
            value: Any = body
            for key in path.split("/"):
                value = value.get(key) if isinstance(value, dict) else None
            if path and value is not None:
                out[path] = value
        return out


def timings(c: Completion) -> dict[str, float]:
    """llama-server's ``timings`` from ours: the prompt's tokens that went through a forward and
    the time to the first token, the answer's tokens and their pace after the first."""
    prompt_n, predicted_n = c.prefilled_tokens, c.completion_tokens
    prompt_ms = (c.timings.ttft_s or 0.0) * 1000
    rate = c.timings.decode_tok_s or 0.0
    predicted_ms = (predicted_n - 1) / rate * 1000 if rate and predicted_n > 1 else 0.0
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": c.timings.prefill_tok_s or 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": 1000 / rate if rate else 0.0, "predicted_per_second": rate}


class InfillResponse(GenerationResponse):
    """The request's one job sent back as llama-server's /infill answers it (``InfillReply``)."""

    def __init__(self, generation: Generation, reply, choices, prompt_lens: list[int],
                 token_bytes: Callable[[int], bytes], *args: Any) -> None:
        super().__init__(generation, reply, choices, prompt_lens, token_bytes, *args)
        assert isinstance(generation, InfillGeneration)
        self.infill = InfillReply(reply.model, prompt_lens[0], generation.settings.get("stop", ()),
                                  generation.response_fields)
        self.token_bytes = token_bytes

    async def _whole(self, send: Send) -> None:
        choice = self.choices[0]
        async for _ in choice.pieces():
            pass
        completion = choice.completion()
        if completion.finish_reason is GenerationState.ERROR:
            status, body = 500, FAILED.body()
        else:
            status, body = 200, self.infill.whole(completion, self.token_bytes)
        await self._send_whole(send, status, body)

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        choice, sent = self.choices[0], 0
        async for text in choice.pieces():
            sent += len(text)
            await self._send(send, event(self.infill.piece(text)))
        completion = choice.completion()
        if completion.finish_reason is GenerationState.ERROR:
            await self._send(send, event(FAILED.body()))
        else:
            if completion.text[sent:]:  # a cancel keeps the whole characters still held back
                await self._send(send, event(self.infill.piece(completion.text[sent:])))
            await self._send(send, event(self.infill.whole(completion, self.token_bytes, streamed=True)))
        self._finished = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})


FAILED = ApiError(500, "generation failed; see the server's log", code="generation_failed")


def infill_routes(state: ServerState, endpoint: Callable) -> list[Route]:
    async def infill(request: HttpRequest) -> Response:
        return await _generate(state, request, parse_infill, InfillResponse)

    return [Route("/infill", endpoint(infill), methods=["POST"])]


__all__ = ["FIELDS", "InfillGeneration", "InfillReply", "InfillResponse", "infill_routes", "parse_infill", "timings"]
