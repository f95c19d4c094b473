"""The embedding routes of ``llama-chat serve``: OpenAI's ``POST /v1/embeddings`` and Ollama's
``POST /api/embed``, and the rerank routes in Jina's and Cohere's shape (``POST /v1/rerank``,
``/rerank``, ``/v2/rerank``), translated to and from ``inference/embedding.py``.

OpenAI's shape: ``{model, input, encoding_format, dimensions}`` with ``input`` a string, a list of
strings, a list of token ids or a list of such lists; the answer ``{object: "list", data:
[{object: "embedding", index, embedding}], model, usage}``, each embedding a list of floats or,
with ``encoding_format: "base64"``, the base64 of its little-endian float32 bytes. A text past the
model's length is refused, as OpenAI refuses it. Ollama's: ``{model, input, truncate, dimensions}``
answered ``{model, embeddings, total_duration, load_duration, prompt_eval_count}``; a text past
the length is cut unless ``truncate`` is false, and errors are ``{"error": message}``.

Token ids stand for a text's tokens: the model's markers ([CLS] and [SEP]) go around them as
around a text's, so a text and its ids embed alike.

A model's prompts (Qwen3-Embedding's query instruction, from its sentence-transformers files) are
asked for as text-embeddings-inference and sentence-transformers name them (``prompt_name``), or
by the part the inputs play as Cohere says it (``input_type``: ``search_query``) or Jina
(``task``: ``retrieval.query``); a part the model has no prompt for means none. Texts get the
prompt; token ids are taken as they are.

Rerank: ``{model, query, documents, top_n, return_documents, instruction}``, each document a
string or ``{"text": ...}``, ``instruction`` a decoder reranker's (Qwen3-Reranker's) task; the
answer ``{id, model, results: [{index, relevance_score, document?}], usage}``, the results by
relevance, highest first, ``top_n`` of them.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llama_chat.cmd.openai_api import ApiError, bad
from llama_chat.cmd.serve_app import ServerState, _json_body
from llama_chat.cmd.served import Served, wrong_kind
# Not inference/embedding.py's names at start: it imports torch, which the server imports in the
# thread that loads the model, so that torch's threads start with the signals blocked.
from llama_chat.ml.controls import MAX_EMBEDDING_INPUTS as MAX_INPUTS

if TYPE_CHECKING:
    from llama_chat.inference.embedding import Embedded

ENCODING_FORMATS = ("float", "base64")
EMBEDDING_PATHS = ("/v1/embeddings", "/api/embed")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")

Input = str | tuple[int, ...]


@dataclass(frozen=True)
class EmbeddingRequest:
    """What one request asks for, its fields checked."""

    model: str | None
    inputs: tuple[Input, ...]
    encoding_format: str = "float"
    dimensions: int | None = None
    truncate: bool = False  # cut a text past the model's length instead of refusing it
    prompt: str | None = None  # the name of the model's prompt to put before each text (None: its default)
    strict_prompt: bool = True  # a prompt the model lacks is refused (not: a client's hint, meaning none)


@dataclass(frozen=True)
class RerankRequest:
    model: str | None
    query: str
    documents: tuple[str, ...]
    top_n: int | None = None
    return_documents: bool = False
    instruction: str | None = None


def embedding_routes(state: ServerState, endpoint: Callable) -> list[Route]:
    """The routes, wrapped by the server's ``endpoint`` (the key, OpenAI's error object)."""

    async def json_body(request: HttpRequest) -> dict:
        return await _json_body(state, request)

    async def openai_embeddings(request: HttpRequest) -> Response:
        served = state.require_ready()
        asked = parse_openai(await json_body(request))
        embedded = await _embed(served, asked)
        return JSONResponse(openai_reply(served.model_id, embedded, asked.encoding_format))

    async def ollama_embed(request: HttpRequest) -> Response:
        try:
            served = state.require_ready()
            start = time.perf_counter_ns()
            asked = parse_ollama(await json_body(request))
            embedded = await _embed(served, asked)
        except ApiError as e:  # Ollama's clients read {"error": message}
            return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)
        return JSONResponse({"model": served.model_id, "embeddings": [e.vector.tolist() for e in embedded],
                             "total_duration": time.perf_counter_ns() - start, "load_duration": 0,
                             "prompt_eval_count": sum(e.tokens for e in embedded)})

    async def rerank(request: HttpRequest) -> Response:
        served = state.require_ready()
        asked = parse_rerank(await json_body(request))
        from llama_chat.inference.embedding import EmbeddingInputError, Reranker

        reranker = served.embedder
        if not isinstance(reranker, Reranker):
            raise wrong_kind(served, "ranks no documents; serve a reranker (a cross-encoder or Qwen3-Reranker) "
                                      "for them")
        try:
            scores, tokens = await anyio.to_thread.run_sync(reranker.scores, asked.query, asked.documents,
                                                            asked.instruction)
        except EmbeddingInputError as e:
            raise bad(str(e), e.param) from None
        return JSONResponse(rerank_reply(served.model_id, asked, scores, tokens))

    return [Route("/v1/embeddings", endpoint(openai_embeddings), methods=["POST"]),
            Route("/api/embed", endpoint(ollama_embed), methods=["POST"]),
            *(Route(path, endpoint(rerank), methods=["POST"]) for path in RERANK_PATHS)]


async def _embed(served: Served, asked: EmbeddingRequest) -> list[Embedded]:
    from llama_chat.inference.embedding import Embedder, EmbeddingInputError

    embedder = served.embedder
    if not isinstance(embedder, Embedder):
        raise wrong_kind(served, "makes no embeddings; serve an embedding model (a sentence-transformers or "
                                  "BERT folder) for them")

    def run() -> list[Embedded]:
        embedder.check_dimensions(asked.dimensions)
        prompt = embedder.prompt(asked.prompt, strict=asked.strict_prompt)
        ids = [embedder.text_ids(item, truncate=asked.truncate, where=_where(i, asked), prompt=prompt)
               if isinstance(item, str)
               else embedder.token_ids(item, truncate=asked.truncate, where=_where(i, asked))
               for i, item in enumerate(asked.inputs)]
        return embedder.submit(ids, dimensions=asked.dimensions).result()  # beside other requests' inputs

    try:
        # Tokenizing and the forwards are CPU work: off the event loop.
        return await anyio.to_thread.run_sync(run)
    except EmbeddingInputError as e:
        raise bad(str(e), e.param) from None


def _where(index: int, asked: EmbeddingRequest) -> str:
    return "input" if len(asked.inputs) == 1 else f"input[{index}]"


def openai_reply(model: str, embedded: list[Embedded], encoding_format: str) -> dict[str, Any]:
    tokens = sum(e.tokens for e in embedded)
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(e, encoding_format)}
                     for i, e in enumerate(embedded)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def rerank_reply(model: str, asked: RerankRequest, scores: list[float], tokens: int) -> dict[str, Any]:
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:asked.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if asked.return_documents:
            result["document"] = {"text": asked.documents[i]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex[:24]}", "model": model, "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(embedded: Embedded, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(embedded.vector.float().numpy().astype("<f4").tobytes()).decode("ascii")
    return embedded.vector.tolist()


# -- the requests' fields ---------------------------------------------------------------------------


def parse_openai(body: dict[str, Any]) -> EmbeddingRequest:
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise bad(f"encoding_format must be {' or '.join(ENCODING_FORMATS)}, found {encoding!r:.40}",
                  "encoding_format")
    return EmbeddingRequest(_model(body), _inputs(body), encoding, _dimensions(body), False, *_prompt(body))


def parse_ollama(body: dict[str, Any]) -> EmbeddingRequest:
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad(f"truncate must be true or false, found {truncate!r:.40}", "truncate")
    inputs = _inputs(body)
    if any(not isinstance(item, str) for item in inputs):
        raise bad("input must be a string or a list of strings", "input")
    return EmbeddingRequest(_model(body), inputs, "float", _dimensions(body), truncate, *_prompt(body))


def parse_rerank(body: dict[str, Any]) -> RerankRequest:
    query = body.get("query")
    if not isinstance(query, str):
        raise bad(f"query must be a string, found {query!r:.40}", "query")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise bad("documents must be a non-empty list of strings (or of {\"text\": ...} objects)", "documents")
    if len(documents) > MAX_INPUTS:
        raise bad(f"documents has {len(documents)} items; at most {MAX_INPUTS} are taken at once", "documents")
    texts = []
    for i, document in enumerate(documents):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str):
            raise bad(f"documents[{i}] must be a string or an object with a string 'text'", f"documents[{i}]")
        texts.append(text)
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise bad(f"top_n must be a positive integer, found {top_n!r:.40}", "top_n")
    return_documents = body.get("return_documents", False)
    if not isinstance(return_documents, bool):
        raise bad(f"return_documents must be true or false, found {return_documents!r:.40}", "return_documents")
    instruction = body.get("instruction")
    if instruction is not None and not isinstance(instruction, str):
        raise bad(f"instruction must be a string, found {instruction!r:.40}", "instruction")
    return RerankRequest(_model(body), query, tuple(texts), top_n, return_documents, instruction)


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"model must be a string, found {model!r:.40}", "model")
    return model


# The part an input plays, as Cohere (input_type) and Jina (task) name it, by sentence-transformers'
# prompt names (Qwen3-Embedding's, e5's: "query", "document").
_ROLES = {"search_query": "query", "search_document": "document", "retrieval.query": "query",
          "retrieval.passage": "document"}


def _prompt(body: dict[str, Any]) -> tuple[str | None, bool]:
    """The prompt's name and whether it must be the model's (``EmbeddingRequest``)."""
    for field, strict in (("prompt_name", True), ("input_type", False), ("task", False)):
        value = body.get(field)
        if value is None:
            continue
        if not isinstance(value, str):
            raise bad(f"{field} must be a string, found {value!r:.40}", field)
        return (value, True) if strict else (_ROLES.get(value, value), False)
    return None, True


def _dimensions(body: dict[str, Any]) -> int | None:
    value = body.get("dimensions")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad(f"dimensions must be an integer, found {value!r:.40}", "dimensions")
    return value


_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"


def _inputs(body: dict[str, Any]) -> tuple[Input, ...]:
    if "input" not in body:
        raise bad("input is required: " + _INPUT_SHAPES, "input")
    value = body["input"]
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise bad(f"input must be {_INPUT_SHAPES}, found {type(value).__name__}", "input")
    if not value:
        raise bad("input is an empty list", "input")
    if len(value) > MAX_INPUTS:
        raise bad(f"input has {len(value)} items; at most {MAX_INPUTS} are taken at once", "input")
    if all(isinstance(item, str) for item in value):
        return tuple(value)
    if all(_is_id(item) for item in value):
        return (tuple(value),)
    if all(isinstance(item, list) for item in value):
        for i, item in enumerate(value):
            if not all(_is_id(t) for t in item):
                raise bad(f"input[{i}] must be a list of token ids (non-negative integers)", f"input[{i}]")
        return tuple(tuple(item) for item in value)
    raise bad(f"input must be {_INPUT_SHAPES}, not a mixture", "input")


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
