"""``llama-chat embed`` and ``llama-chat rerank``: an embedding model's vectors, or a reranker's
ranking, on the command line.

``embed`` takes texts as arguments, from ``--file`` (one a line; ``-``: stdin) or, with neither,
from the lines of stdin, and writes one JSON line per text (``{"index", "tokens", "embedding"}``)
or, with ``-o FILE.npy``, one float32 array of a row per text; on a terminal, a progress line on
stderr while it works. ``rerank --query Q`` ranks the lines of stdin (or of ``--file``) and writes
one JSON line per line, highest relevance first (``{"index", "relevance_score", "document"}``). A
problem is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, get_type_hints

import typer
from rich.console import Console

from llama_chat.cmd import exit_status
from llama_chat.cmd.options import Options
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.typer_command import GroupedHelp, command, new_app

_OPTION = get_type_hints(Options, include_extras=True)
INPUT = "Input"


@dataclass(frozen=True)
class EmbedOptions:
    texts: Annotated[list[str] | None, typer.Argument(
        metavar="TEXT", show_default=False, help="Texts to embed (default: the lines of stdin).")] = None
    model: _OPTION["model"] = None
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", rich_help_panel=INPUT, metavar="FILE",
        help="Read the texts from FILE, one a line ('-': stdin).")] = None
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", rich_help_panel=INPUT, metavar="FILE.npy",
        help="Write the vectors to FILE.npy (float32, a row per text) instead of JSON lines.")] = None
    dimensions: Annotated[int | None, typer.Option(
        "--dimensions", min=1, rich_help_panel=INPUT, metavar="N",
        help="Keep each vector's first N values, renormalized (Matryoshka).")] = None
    pooling: Annotated[str | None, typer.Option(
        "--pooling", rich_help_panel=INPUT, metavar="MODE",
        help="mean, cls or last (default: as the model's files say).")] = None
    truncate: Annotated[bool, typer.Option(
        "--truncate/--no-truncate", rich_help_panel=INPUT,
        help="Cut a text past the model's length (default), or refuse it.")] = True
    prompt_name: Annotated[str | None, typer.Option(
        "--prompt-name", rich_help_panel=INPUT, metavar="NAME",
        help="Put the model's prompt NAME before each text (e.g. query: Qwen3-Embedding's instruction).")] = None
    device: _OPTION["device"] = "auto"
    dtype: _OPTION["dtype"] = "auto"


@dataclass(frozen=True)
class RerankOptions:
    query: Annotated[str, typer.Option("--query", "-q", metavar="TEXT", help="What the lines are ranked for.")]
    model: _OPTION["model"] = None
    file: Annotated[Path | None, typer.Option(
        "--file", "-f", rich_help_panel=INPUT, metavar="FILE",
        help="Read the documents from FILE, one a line (default and '-': stdin).")] = None
    top_n: Annotated[int | None, typer.Option(
        "--top-n", min=1, rich_help_panel=INPUT, metavar="N", help="Write the N most relevant only.")] = None
    instruction: Annotated[str | None, typer.Option(
        "--instruction", rich_help_panel=INPUT, metavar="TEXT",
        help="The task, for a decoder reranker (Qwen3-Reranker; default: its model card's).")] = None
    device: _OPTION["device"] = "auto"
    dtype: _OPTION["dtype"] = "auto"


embed_app = new_app()
embed_app.command(name="embed", cls=GroupedHelp,
                  help="Embed texts with an embedding model: one JSON line per text, or a .npy array.")(
    command(EmbedOptions, lambda opts: run_embed(opts)))
rerank_app = new_app()
rerank_app.command(name="rerank", cls=GroupedHelp,
                   help="Rank the lines of stdin for --query with a reranker: JSON lines, most relevant first.")(
    command(RerankOptions, lambda opts: run_rerank(opts)))


class Refused(Exception):
    """A problem with the input or the model: one line, the usage status."""


def run_embed(opts: EmbedOptions) -> int:
    err = Console(stderr=True, highlight=False)
    try:
        if opts.pooling is not None and opts.pooling not in ("mean", "cls", "last"):
            raise Refused(f"--pooling must be mean, cls or last, found {opts.pooling!r}")
        if opts.output is not None and opts.output.suffix != ".npy":
            raise Refused(f"--output {opts.output}: expected a .npy file name")
        texts = list(opts.texts) if opts.texts else _lines(opts.file)
        from llama_chat.inference.embedding import Embedder, EmbeddingInputError

        loaded = _load(opts.model, opts.device, opts.dtype, err, "embedding")
        embedder = Embedder(loaded, pooling=opts.pooling)
        try:
            prompt = embedder.prompt(opts.prompt_name, param="--prompt-name")
            ids = [embedder.text_ids(t, truncate=opts.truncate, where=f"text {i + 1}", prompt=prompt)
                   for i, t in enumerate(texts)]
            embedder.check_dimensions(opts.dimensions, "--dimensions")
            progress = Progress(err.file, len(ids)) if err.is_terminal else None
            try:
                embedded = embedder.embed(ids, dimensions=opts.dimensions,
                                          on_progress=progress.update if progress is not None else None)
            finally:
                if progress is not None:
                    progress.clear()
        except EmbeddingInputError as e:
            raise Refused(str(e)) from None
    except Refused as e:
        return _refused(err, str(e))
    if opts.output is not None:
        import numpy as np
        import torch

        np.save(opts.output, torch.stack([e.vector for e in embedded]).numpy().astype(np.float32))
        return exit_status.OK
    for i, e in enumerate(embedded):
        sys.stdout.write(json.dumps({"index": i, "tokens": e.tokens, "embedding": e.vector.tolist()}) + "\n")
    sys.stdout.flush()
    return exit_status.OK


def run_rerank(opts: RerankOptions) -> int:
    err = Console(stderr=True, highlight=False)
    try:
        documents = _lines(opts.file)
        from llama_chat.inference.embedding import EmbeddingInputError, Reranker

        reranker = Reranker(_load(opts.model, opts.device, opts.dtype, err, "rerank"))
        try:
            scores, _ = reranker.scores(opts.query, documents, opts.instruction)
        except EmbeddingInputError as e:
            raise Refused(f"--{e}") from None
    except Refused as e:
        return _refused(err, str(e))
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:opts.top_n]
    for i in order:
        sys.stdout.write(json.dumps({"index": i, "relevance_score": scores[i], "document": documents[i]},
                                    ensure_ascii=False) + "\n")
    sys.stdout.flush()
    return exit_status.OK


def _lines(file: Path | None) -> list[str]:
    """The non-empty lines of ``file`` (stdin for None or '-')."""
    try:
        if file is None or str(file) == "-":
            text = sys.stdin.read()
        else:
            text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise Refused(f"{file or 'stdin'}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise Refused(f"{file or 'stdin'}: no text to read (one a line)")
    return lines


def _load(model: str | None, device: str, dtype: str, err: Console, kind: str):
    """The model, loaded as the other commands load one; refused unless it is of ``kind``."""
    from llama_chat.cmd.run_command import load
    from llama_chat.cmd.source_settings import LoadSettings
    from llama_chat.inference.remote import is_remote
    from llama_chat.model.errors import ModelLoadError

    if is_remote(model):
        raise Refused("embed and rerank run a model in this process; -m openai:URL is another server's")
    from llama_chat.cmd.inputs import UsageProblem

    try:
        loaded = load(LoadSettings(model=model, device=device, dtype=dtype), err)
    except (ModelLoadError, UsageProblem) as e:
        raise Refused(str(e)) from None
    if loaded.kind != kind:
        does = {"chat": "a chat model: it generates text", "embedding": "an embedding model: it makes embeddings",
                "rerank": "a reranker: it ranks documents"}[loaded.kind]
        wanted = "an embedding model" if kind == "embedding" else "a reranker (a cross-encoder or Qwen3-Reranker)"
        raise Refused(f"the model {loaded.name!r} is {does}; give -m {wanted}")
    return loaded


# The progress line is redrawn at most this often: a terminal kept busy slows nothing.
PROGRESS_EVERY_S = 0.1


class Progress:
    """One line on stderr, redrawn in place as the forwards end: texts done of all, texts/s."""

    def __init__(self, file, total: int) -> None:
        self.file = file
        self.total = total
        self.start = self.drawn = time.perf_counter()
        self.shown = False

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.drawn < PROGRESS_EVERY_S and done < self.total:
            return
        self.drawn = now
        width = 24
        filled = width * done // max(1, self.total)
        rate = done / max(1e-9, now - self.start)
        self.file.write(f"\r\x1b[K[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} texts  "
                        f"{rate:.0f} texts/s")
        self.file.flush()
        self.shown = True

    def clear(self) -> None:
        if self.shown:
            self.file.write("\r\x1b[K")
            self.file.flush()
            self.shown = False


def _refused(err: Console, message: str) -> int:
    try:
        sys.stderr.write(f"llama-chat: error: {one_line(message)}\n")
    except (OSError, ValueError):
        pass
    return exit_status.USAGE


__all__ = ["embed_app", "rerank_app"]
