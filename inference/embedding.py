"""Embeddings of many inputs at once: texts (or token ids) checked and tokenized, batched by
length into padded forwards of the encoder, pooled, normalized and cut as asked; and a
reranker's relevance scores of documents for a query, batched alike.

Inputs are sorted by length, longest first, and taken in groups whose padded size stays within
``max_batch_tokens`` (and ``max_batch_rows``), so a short text never waits as padding beside a
long one and no forward grows past the bound. ``Embedder.embed`` and ``Reranker.scores`` are
blocking PyTorch code, one call at a time (``lock``). The server's requests go through
``Embedder.submit``: one thread runs rounds, each taking every request waiting when the last
ended, so concurrent requests' inputs share padded forwards as the scheduler's jobs share steps;
beside a chat model that thread runs at a lower priority (``BESIDE_CHAT_NICENESS``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from llama_chat.ml.controls import MAX_EMBEDDING_INPUTS
from llama_chat.model.loader import LoadedModel
from llama_chat.model.pooling import POOLING_MODES, Pooling, finished, pool

# Padded tokens in one forward: bounds the activations (and a row's attention scores) of a batch.
DEFAULT_BATCH_TOKENS = 8192
DEFAULT_BATCH_ROWS = 64
MAX_INPUTS = MAX_EMBEDDING_INPUTS
# A forward's rows are of like length: a row joins a group whose longest is at most this share,
# or this many tokens, longer than it. The rest is padding every product computes for nothing:
# a request's 64 lines of mixed length in one forward were three quarters padding.
PADDING_SHARE = 0.25
PADDING_TOKENS = 8
# The niceness of the rounds' thread (and of the threads its forwards start) beside a chat model:
# a chat stream is read as it comes and an embedding request is read whole, so the decode goes
# first and the embeddings take the cores it leaves. On equal terms the embeddings' forwards, on
# all the cores, took them from the decode (docs/benchmarks.md, "Embeddings beside chat").
BESIDE_CHAT_NICENESS = 10


class EmbeddingInputError(ValueError):
    """An input the model cannot embed: the message is one line; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Embedded:
    """One input's vector (float32, on the CPU) and the tokens it took."""

    vector: torch.Tensor
    tokens: int


class Embedder:
    """An embedding model ready for requests: its tokenizer, pooling and batching rule."""

    def __init__(self, loaded: LoadedModel, *, pooling: str | None = None,
                 max_batch_tokens: int = DEFAULT_BATCH_TOKENS, max_batch_rows: int = DEFAULT_BATCH_ROWS,
                 beside_chat: bool = False) -> None:
        if loaded.pooling is None:
            raise ValueError(f"the model {loaded.name!r} generates text; it does not make embeddings")
        if pooling is not None and pooling not in POOLING_MODES:
            raise ValueError(f"pooling {pooling!r} is not supported (expected {', '.join(POOLING_MODES)})")
        self.loaded = loaded
        loaded.model.fuse_projections()  # q, k and v in one product: fewer, larger products
        self.pooling: Pooling = loaded.pooling.with_mode(pooling)
        self.max_batch_tokens = max(max_batch_tokens, self.pooling.max_tokens)
        self.max_batch_rows = max_batch_rows
        self.beside_chat = beside_chat  # the rounds yield the cores to a chat model's decode
        self.lock = threading.Lock()  # one forward at a time: torch's threads are already all busy
        self._rounds: EmbeddingRounds | None = None
        self._rounds_made = threading.Lock()

    def submit(self, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None) -> Future[list[Embedded]]:
        """``embed`` in the rounds' thread, beside other callers' inputs; the vectors come in the future."""
        with self._rounds_made:
            if self._rounds is None:
                self._rounds = EmbeddingRounds(self)
        return self._rounds.submit(inputs, dimensions)

    def close(self) -> None:
        """Stop the rounds' thread (after the rounds asked for) where one was started."""
        if self._rounds is not None:
            self._rounds.close()

    @property
    def width(self) -> int:
        """The length of the model's vectors."""
        return self.loaded.args.dim

    @property
    def max_tokens(self) -> int:
        return self.pooling.max_tokens

    def prompt(self, name: str | None, *, strict: bool = True, param: str = "prompt_name") -> str:
        """The text the model puts before an input for the prompt ``name`` (None: its default).
        A name the model lacks is refused where ``strict``, else means no prompt (a client's hint,
        such as Cohere's ``input_type``, that this model has no instruction for)."""
        try:
            return self.pooling.prompt(name)
        except KeyError:
            if not strict:
                return ""
            names = ", ".join(repr(n) for n, _ in self.pooling.prompts) or "none"
            raise EmbeddingInputError(f"{param} {name!r:.40} is not one of the model's prompts ({names})",
                                      param) from None

    def text_ids(self, text: str, *, truncate: bool, where: str = "input", prompt: str = "") -> list[int]:
        """A text's ids with the model's markers, after ``prompt`` (``self.prompt``'s text) as
        sentence-transformers puts it; past the model's length: cut, or refused."""
        if not text:
            raise EmbeddingInputError(f"{where} is an empty string", where)
        text = prompt + text
        if self.pooling.lowercase:
            text = text.lower()
        return self.token_ids(self.loaded.tokenizer.encode(text), truncate=truncate, where=where)

    def token_ids(self, ids: Sequence[int], *, truncate: bool, where: str = "input") -> list[int]:
        """A text's token ids (no markers) with the model's markers around them (BERT's [CLS]
        and [SEP]), so ids and the text they spell embed alike."""
        tokenizer = self.loaded.tokenizer
        if not ids:
            raise EmbeddingInputError(f"{where} is an empty list of token ids", where)
        vocab = self.loaded.args.vocab_size
        for i in ids:
            if not 0 <= i < vocab:
                raise EmbeddingInputError(f"{where} holds token id {i}, outside the vocabulary (0 to {vocab - 1})",
                                          where)
        bos, eos = _markers(tokenizer)
        room = self.max_tokens - len(bos) - len(eos)
        if len(ids) > room:
            if not truncate:
                raise EmbeddingInputError(
                    f"{where} is {len(ids) + len(bos) + len(eos)} tokens long; the model takes at most "
                    f"{self.max_tokens}", where)
            ids = ids[:room]
        return [*bos, *ids, *eos]

    def check_dimensions(self, dimensions: int | None, param: str = "dimensions") -> None:
        if dimensions is not None and not 1 <= dimensions <= self.width:
            raise EmbeddingInputError(f"{param} must be from 1 to {self.width} (the model's width), "
                                      f"found {dimensions}", param)

    def embed(self, inputs: Sequence[Sequence[int]], *, dimensions: int | None = None,
              on_progress: Callable[[int], None] | None = None) -> list[Embedded]:
        """The vectors of ``inputs`` (token ids with their markers), in order. Blocking.
        ``on_progress`` is told how many inputs are done after each forward."""
        if self.pooling.mode == "none":
            raise EmbeddingInputError("this server pools with 'none' (a vector per token); "
                                      "an embedding per input needs mean, cls or last pooling", "input")
        self.check_dimensions(dimensions)
        return [Embedded(self.finished(v, dimensions), len(ids))
                for v, ids in zip(self.pooled(inputs, on_progress), inputs)]

    def pooled(self, inputs: Sequence[Sequence[int]], on_progress: Callable[[int], None] | None = None
               ) -> list[torch.Tensor]:
        """The pooled vectors of ``inputs``, in order, before normalizing and cutting. Blocking."""
        if self.pooling.mode == "none":
            raise EmbeddingInputError("this server pools with 'none' (a vector per token); "
                                      "an embedding per input needs mean, cls or last pooling", "input")
        vectors: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
        done = 0
        with self.lock, torch.inference_mode():
            for group in self.batches([len(ids) for ids in inputs]):
                for index, vector in zip(group, self._forward([inputs[i] for i in group])):
                    vectors[index] = vector
                done += len(group)
                if on_progress is not None:
                    on_progress(done)
        return vectors

    def finished(self, vector: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        return finished(vector, normalize=self.pooling.normalize, dimensions=dimensions).cpu()

    def batches(self, lengths: Sequence[int]) -> list[list[int]]:
        return length_batches(lengths, self.max_batch_tokens, self.max_batch_rows)

    def _forward(self, rows: list[Sequence[int]]) -> list[torch.Tensor]:
        tokens, lengths, _ = padded(self.loaded, rows)
        hidden = self.loaded.model.encode(tokens, lengths)
        return pool(hidden, lengths, self.pooling.mode)


@dataclass(frozen=True)
class _Waiting:
    inputs: list[Sequence[int]]
    dimensions: int | None
    future: Future


class EmbeddingRounds:
    """Many callers' inputs embedded together, on one thread of its own: each round takes every
    request waiting when the last round ended (whole requests, up to ``MAX_INPUTS`` inputs, one
    at least), sorts all their inputs by length into the embedder's padded forwards, and hands
    each request its vectors. ``rounds`` counts them."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder
        self.rounds = 0
        self._waiting: deque[_Waiting] = deque()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="embedding-rounds", daemon=True)
        self._thread.start()

    def submit(self, inputs: Sequence[Sequence[int]], dimensions: int | None = None) -> Future[list[Embedded]]:
        self.embedder.check_dimensions(dimensions)
        future: Future[list[Embedded]] = Future()
        with self._changed:
            if self._closed:
                raise RuntimeError("the embedding rounds are closed")
            self._waiting.append(_Waiting(list(inputs), dimensions, future))
            self._changed.notify()
        return future

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()

    def _take(self) -> list[_Waiting] | None:
        with self._changed:
            while not self._waiting and not self._closed:
                self._changed.wait()
            if not self._waiting:
                return None
            taken = [self._waiting.popleft()]
            count = len(taken[0].inputs)
            while self._waiting and count + len(self._waiting[0].inputs) <= MAX_INPUTS:
                taken.append(self._waiting.popleft())
                count += len(taken[-1].inputs)
            return taken

    def _run(self) -> None:
        if self.embedder.beside_chat and sys.platform.startswith("linux"):
            # Before the first forward: the threads it starts for torch's products inherit this.
            # Only Linux gives a thread a niceness of its own (elsewhere the call names a process);
            # there, and where it is refused, the rounds share the cores on equal terms.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BESIDE_CHAT_NICENESS)
            except OSError:
                pass
        while (taken := self._take()) is not None:
            try:
                pooled = self.embedder.pooled([ids for request in taken for ids in request.inputs])
            except BaseException as e:  # noqa: BLE001 - each request's caller gets the error
                for request in taken:
                    request.future.set_exception(e)
                continue
            self.rounds += 1
            start = 0
            for request in taken:
                vectors = pooled[start:start + len(request.inputs)]
                start += len(request.inputs)
                request.future.set_result([Embedded(self.embedder.finished(v, request.dimensions), len(ids))
                                           for v, ids in zip(vectors, request.inputs)])


class Reranker:
    """A reranker ready for requests. A cross-encoder reads each document beside the query
    (``[CLS] query [SEP] document [SEP]``, token types 0 then 1), scored by the model's head; a
    decoder reranker (Qwen3-Reranker) reads its prompt around the instruction, query and document,
    scored by its answer (``Ranking.answers``)."""

    def __init__(self, loaded: LoadedModel, *, max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
                 max_batch_rows: int = DEFAULT_BATCH_ROWS) -> None:
        if loaded.ranking is None:
            raise ValueError(f"the model {loaded.name!r} is not a reranker")
        self.loaded = loaded
        loaded.model.fuse_projections()
        self.ranking = loaded.ranking
        self.max_batch_tokens = max(max_batch_tokens, self.ranking.max_tokens)
        self.max_batch_rows = max_batch_rows
        self.lock = threading.Lock()

    @property
    def max_tokens(self) -> int:
        return self.ranking.max_tokens

    @property
    def takes_instruction(self) -> bool:
        return self.ranking.prompt is not None

    def pair_ids(self, query: Sequence[int], document: Sequence[int]) -> tuple[list[int], list[int]]:
        """The ids and token types of a query and a document together, cut to the model's length
        as sentence-transformers cuts a pair: a token off the longer part (the document's on a
        tie) until they fit."""
        tokenizer = self.loaded.tokenizer
        room = self.max_tokens - 3
        first, second = len(query), len(document)
        while first + second > room:
            if first > second:
                first -= 1
            else:
                second -= 1
        a = [tokenizer.bos_id, *query[:first], tokenizer.eos_id]
        b = [*document[:second], tokenizer.eos_id]
        return a + b, [0] * len(a) + [1] * len(b)

    def prompt_ids(self, query: str, document: str, instruction: str | None = None) -> list[int]:
        """A decoder reranker's prompt for one document, its middle cut at its end to fit the
        model's length, as the model card's tokenizing cuts it."""
        prompt = self.ranking.prompt
        assert prompt is not None
        tokenizer = self.loaded.tokenizer
        special = getattr(tokenizer, "encode_allowing_special", tokenizer.encode)
        prefix, suffix = special(prompt.prefix), special(prompt.suffix)
        room = self.max_tokens - len(prefix) - len(suffix)
        if room < 1:
            raise EmbeddingInputError(f"the model's context of {self.max_tokens} tokens is shorter than its rerank "
                                      f"prompt ({len(prefix) + len(suffix)} tokens); serve it with a longer one",
                                      "model")
        body = tokenizer.encode(prompt.body.format(instruction=instruction or prompt.instruction, query=query,
                                                   document=document))
        return [*prefix, *body[:room], *suffix]

    def scores(self, query: str, documents: Sequence[str], instruction: str | None = None) -> tuple[list[float], int]:
        """Each document's relevance to ``query``, in order, and the tokens read. Blocking."""
        if not query:
            raise EmbeddingInputError("query is an empty string", "query")
        if instruction is not None and not self.takes_instruction:
            raise EmbeddingInputError("instruction is for a decoder reranker (Qwen3-Reranker); this model is a "
                                      "cross-encoder, which reads none", "instruction")
        if instruction == "":
            raise EmbeddingInputError("instruction is an empty string", "instruction")
        if self.ranking.prompt is not None:
            rows = [(self.prompt_ids(query, d, instruction), None) for d in documents]
        else:
            encode = self.loaded.tokenizer.encode
            query_ids = encode(query)
            rows = [self.pair_ids(query_ids, encode(d)) for d in documents]
        relevance: list[float] = [0.0] * len(rows)
        with self.lock, torch.inference_mode():
            for group in length_batches([len(ids) for ids, _ in rows], self.max_batch_tokens, self.max_batch_rows):
                types = None if self.ranking.prompt is not None else [rows[i][1] for i in group]
                tokens, lengths, types = padded(self.loaded, [rows[i][0] for i in group], types)
                for i, value in zip(group, self._relevance(tokens, lengths, types).tolist()):
                    relevance[i] = value
        return relevance, sum(len(ids) for ids, _ in rows)

    def _relevance(self, tokens: torch.Tensor, lengths: torch.Tensor, types: torch.Tensor | None) -> torch.Tensor:
        model = self.loaded.model
        if self.ranking.answers is not None or self.ranking.head is not None:
            # The softmax of "yes" and "no", "yes"'s share: the sigmoid of their difference.
            if self.ranking.answers is not None:
                logits = model.answer_logits(tokens, lengths, list(self.ranking.answers))
            else:
                logits = model.last_states(tokens, lengths).float() @ self.ranking.head.to(tokens.device).T
            yes, no = logits.unbind(-1)
            return torch.sigmoid(yes - no)
        logits = model.classify(tokens, lengths, types)[:, 0]
        return torch.sigmoid(logits) if self.ranking.sigmoid else logits


def _markers(tokenizer) -> tuple[list[int], list[int]]:
    """The ids around a text to embed: those the tokenizer's post-processor adds (``markers``:
    BERT's [CLS] and [SEP], Qwen3-Embedding's end of text), else its bos and eos as its files say
    a prompt gets them."""
    markers = getattr(tokenizer, "markers", None)
    if markers is not None:
        return list(markers[0]), list(markers[1])
    bos = [tokenizer.bos_id] if getattr(tokenizer, "add_bos", False) and tokenizer.bos_id is not None else []
    eos = [tokenizer.eos_id] if getattr(tokenizer, "add_eos", False) and tokenizer.eos_id is not None else []
    return bos, eos


def length_batches(lengths: Sequence[int], max_tokens: int, max_rows: int) -> list[list[int]]:
    """Indices of ``lengths`` in groups for one forward each: longest first, each group's rows
    times its longest within ``max_tokens``, at most ``max_rows`` rows, and none shorter than its
    longest by more than ``PADDING_SHARE`` of it (or ``PADDING_TOKENS``)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        longest = lengths[group[0]] if group else 0
        if group is not None and len(group) < max_rows and (len(group) + 1) * longest <= max_tokens \
                and longest - lengths[i] <= max(PADDING_TOKENS, longest * PADDING_SHARE):
            group.append(i)
        else:
            groups.append([i])
    return groups


def padded(loaded: LoadedModel, rows: list[Sequence[int]], types: list[Sequence[int]] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of ids padded on the right into one ``(batch, longest)`` tensor, their lengths, and
    their token types padded alike (None without)."""
    device = loaded.device
    longest = max(len(r) for r in rows)
    pad = getattr(loaded.tokenizer, "pad_id", 0)
    tokens = torch.tensor([list(r) + [pad] * (longest - len(r)) for r in rows], device=device)
    lengths = torch.tensor([len(r) for r in rows], device=device)
    if types is None:
        return tokens, lengths, None
    return tokens, lengths, torch.tensor([list(t) + [0] * (longest - len(t)) for t in types], device=device)
