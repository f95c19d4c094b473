"""How an embedding model's hidden states become one vector per text: the pooling, the
normalization and Matryoshka truncation; and how a reranker's score becomes a relevance.

``Pooling`` and ``Ranking`` are what a model's files say (``formats/sentence_transformers.py``
reads them); the functions are the arithmetic, over right-padded rows whose lengths are given.

A decoder reranker (Qwen3-Reranker) is a causal language model asked whether a document meets a
query: its prompt is ``RerankPrompt``, and the relevance is the softmax of its logits for "yes"
and "no" at the last position, as its model card computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from llama_chat.ml.controls import POOLING_MODES


@dataclass(frozen=True)
class Pooling:
    """An embedding model's pooling, as its files say."""

    mode: str = "mean"
    normalize: bool = False  # each vector scaled to length 1 (sentence-transformers' Normalize)
    max_tokens: int = 512  # the longest input the model takes, its special tokens included
    lowercase: bool = False  # texts lower-cased before tokenizing (sentence_bert_config's do_lower_case)
    # Texts put before an input by name (config_sentence_transformers.json's ``prompts``:
    # Qwen3-Embedding's query instruction, e5's "query: "), and the one used when none is named.
    prompts: tuple[tuple[str, str], ...] = ()
    default_prompt: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling {self.mode!r} is not supported (expected {', '.join(POOLING_MODES)})")

    def with_mode(self, mode: str | None) -> Pooling:
        """This pooling with its mode overridden (None: as the model says)."""
        return self if mode is None else replace(self, mode=mode)

    def prompt(self, name: str | None) -> str:
        """The text put before an input for the prompt ``name`` (None: the model's default, if any).
        Raises KeyError for a name the model does not have."""
        name = self.default_prompt if name is None else name
        if name is None:
            return ""
        return dict(self.prompts)[name]


@dataclass(frozen=True)
class RerankPrompt:
    """A decoder reranker's prompt: ``prefix`` and ``suffix`` are template text (its special tokens
    read as such), ``body`` the part with the instruction, query and document (``str.format``
    fields), cut at its end when the whole is past the model's length."""

    prefix: str
    body: str
    suffix: str
    instruction: str  # the default instruction


# Qwen3-Reranker's own form, from its model card (llama.cpp's converter writes the same as the
# file's "rerank" template).
QWEN3_RERANK_PROMPT = RerankPrompt(
    prefix="<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
           "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n",
    body="<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}",
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    instruction="Given a web search query, retrieve relevant passages that answer the query")


@dataclass(frozen=True)
class Ranking:
    """A reranker's scoring, as its files say: a cross-encoder's head, or a decoder's answer."""

    sigmoid: bool = True  # relevance = sigmoid(logit) (sentence-transformers' default for one label)
    max_tokens: int = 512  # the longest query and document together, special tokens included
    # A decoder reranker: the ids of "yes" and "no" (relevance = the softmax of their logits at
    # the last position, "yes"'s share) and its prompt; None: a cross-encoder.
    answers: tuple[int, int] | None = None
    prompt: RerankPrompt | None = None
    # A decoder reranker's file without its output (llama.cpp's converter keeps only the "yes" and
    # "no" rows of it, as ``cls.output``): those rows, ``(2, dim)`` float32.
    head: torch.Tensor | None = None


def pool(hidden: torch.Tensor, lengths: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """One float32 tensor per row of ``hidden`` ``(batch, seq, dim)``: ``(dim,)`` pooled, or
    ``(length, dim)`` for ``none``; each row's first ``lengths[i]`` states are its own."""
    hidden = hidden.float()
    if mode == "mean":
        seq = hidden.shape[1]
        mask = (torch.arange(seq, device=hidden.device).view(1, seq, 1) < lengths.view(-1, 1, 1)).float()
        pooled = (hidden * mask).sum(1) / lengths.view(-1, 1).clamp(min=1).float()
        return list(pooled)
    if mode == "cls":
        return list(hidden[:, 0])
    if mode == "last":
        return list(hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1])
    return [row[:n] for row, n in zip(hidden, lengths.tolist())]


def finished(vector: torch.Tensor, *, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """A pooled vector as it is answered: its first ``dimensions`` values (Matryoshka models are
    trained so that a prefix is itself an embedding), scaled to length 1 where ``normalize`` says
    or where it was cut (a prefix of a unit vector is shorter than one)."""
    if dimensions is not None and dimensions < vector.shape[-1]:
        return F.normalize(vector[..., :dimensions], dim=-1)
    return F.normalize(vector, dim=-1) if normalize else vector
