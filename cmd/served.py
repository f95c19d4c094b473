"""A loaded model as the server's routes use it (``Served``), and the refusal of a route the
model is not for. Its own module, so that the registry of several models (``models.py``) and the
routes (``serve_app.py``, ``embeddings_api.py``) all name it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llama_chat.cmd.openai_api import ApiError, bad
from llama_chat.cmd.prompt import thinking_model
from llama_chat.inference.tool_formats import FORMATS, ToolFormat
from llama_chat.inference.types import ThinkTags

if TYPE_CHECKING:
    from llama_chat.cmd.options import Options
    from llama_chat.inference.embedding import Embedder, Reranker
    from llama_chat.inference.serving import Serving
    from llama_chat.model.loader import LoadedModel


@dataclass(frozen=True)
class Served:
    """The loaded model as the routes use it."""

    loaded: LoadedModel
    serving: Serving
    opts: Options  # the command's options: the base of every request (``Options.request``)
    names: frozenset[str]  # the names it answers to; ``loaded.name`` is the one listed and reported
    created: int
    tool_format: ToolFormat = FORMATS["generic"]  # how its replies write tool calls (--tool-format)
    # An embedding model's or a reranker's (then ``serving`` is None: no generation).
    embedder: Embedder | Reranker | None = None
    # A thinking model's tags and tokenizer (``cmd/prompt.thinking_model``); None: it does not think.
    think: tuple[ThinkTags, Any] | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "think", thinking_model(self.loaded) if self.loaded.kind == "chat" else None)

    @property
    def model_id(self) -> str:
        return self.loaded.name


_DOES = {"chat": "generates text", "embedding": "makes embeddings (POST /v1/embeddings)",
         "rerank": "ranks documents (POST /v1/rerank)"}


def wrong_kind(served: Served, what_not: str) -> ApiError:
    kind = served.loaded.kind
    article = "an" if kind == "embedding" else "a"
    name = {"rerank": "reranker", "embedding": "embedding model", "chat": "chat model"}[kind]
    return bad(f"the model {served.model_id!r} is {article} {name}: it {_DOES[kind]} and {what_not}", "model",
               code="unsupported_model")


def refuse_generation(served: Served) -> None:
    """A chat or completion asked of an embedding model or a reranker: a 400 naming what it is for."""
    if served.embedder is not None:
        raise wrong_kind(served, "generates no text")
