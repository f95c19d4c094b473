"""Calls of the one-call decode step (``decode.cpp``): a token of each of several rows through every
layer and the classifier in one call of ``torch.ops.llama_chat_cpu.decode_step``.

What the step reads of a model comes in as ``StepWeights`` (one ``LayerWeights`` record a layer,
which the C++ side reads by name), laid out by the model's side
(``model/cpu_decode.py`` gathers them from a model's modules and packs the panels), with the
family's ``Switches`` (Gemma's embedding scale, GeGLU, windows, scores' scale and soft caps).
Here is the object that calls the operator with them, everything but the tokens, positions and
block tables prepared once: ``RowsDecoder``, for rows over a paged cache. Greedy picks can be made
inside the step (``RowsDecoder.pick``, ``RowsDecoder.with_picks``), by the threads that write the
logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from llama_chat.ml.packed import PackedWeight

if TYPE_CHECKING:
    from llama_chat.ml.kv_centers import KeyCenters

# Outputs per panel of packed float32 weights (``panels.h``).
PANEL = 16


@dataclass(frozen=True)
class Switches:
    """What of a model family's arithmetic the step does beyond a Llama's layer, besides the
    family's parts of a layer (``LayerWeights``); the defaults are Llama's."""

    windows: tuple[int, ...] = ()  # per layer, the keys a query sees (its last ones); 0: its whole past
    embedding_scale: float = 1.0  # the embedding rows' factor, rounded to float32 (Gemma: sqrt(dim))
    gelu: bool = False  # GeGLU with tanh-approximated GELU in place of SwiGLU
    query_scale: float | None = None  # the scores' scale; None: 1 / sqrt(head_dim)
    attention_cap: float | None = None  # scores capped by cap * tanh(s / cap)
    final_cap: float | None = None  # the logits capped likewise, before any greedy pick


LLAMA = Switches()


@dataclass(frozen=True)
class Projection:
    """A product's weight as the step reads it: an (n, k) float32, bfloat16, float16 or int8
    matrix (int8 with float32 ``scales`` per output), float32 panels (ceil(n / 16), k, 16), or
    packed blocks (uint8) with their (kind, rows) layout in the scales' place
    (``packed.step_layout``)."""

    weight: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def panels(self) -> bool:
        return self.weight.dim() == 3


@dataclass(frozen=True)
class LayerWeights:
    """One layer as the step reads it: the one record of a layer, made once per model
    (``model/cpu_decode.py``), which ``decode.cpp`` lays out by these names (``StepModel``). The
    four products in the operator's order, the attention's and feed-forward's norms (float32), the
    layer's rotary table (float32 (positions, head_dim / 2, 2): cos and sin of each pair's angle;
    Gemma 3's windowed layers have a table of their own), and the family's parts of a layer,
    float32, or None where the model has none (Llama's): Qwen2's q/k/v biases, the q and k heads'
    norm weights (Qwen3's and Gemma 3's), and the norms of the attention's and feed-forward's
    outputs (Gemma's)."""

    qkv: Projection
    out: Projection
    gate_up: Projection
    down: Projection
    attention_norm: torch.Tensor
    ffn_norm: torch.Tensor
    rope: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attention_post_norm: torch.Tensor | None = None
    ffn_post_norm: torch.Tensor | None = None

    def projections(self) -> tuple[Projection, Projection, Projection, Projection]:
        return self.qkv, self.out, self.gate_up, self.down

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by the operator's names: a product's scales as ``<name>.scales``; parts the
        model has none of left out."""
        named: dict[str, torch.Tensor] = {}
        for part in fields(self):
            value = getattr(self, part.name)
            if isinstance(value, Projection):
                named[part.name] = value.weight
                if value.scales is not None:
                    named[f"{part.name}.scales"] = value.scales
            elif value is not None:
                named[part.name] = value
        return named


@dataclass(frozen=True)
class StepWeights:
    """What the step reads of one model besides the tokens and the cache: its layers, the final
    norm (float32) and the classifier, with the family's switches."""

    embedding: torch.Tensor | PackedWeight  # float rows, or blocks expanded a row at a time as read
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    output: Projection
    n_heads: int
    n_kv_heads: int
    norm_eps: float
    switches: Switches = LLAMA

    @property
    def classes(self) -> int:
        """Logits per row: a classifier given as panels has whole ones."""
        weight = self.output.weight
        return weight.shape[0] * PANEL if weight.dim() == 3 else weight.shape[0]

    @property
    def packed(self) -> bool:
        """Whether every weight and the classifier are panels."""
        return all(p.panels for layer in self.layers for p in layer.projections()) and self.output.panels

    def over(self, keys: list[torch.Tensor], values: list[torch.Tensor], page_size: int,
             centers: KeyCenters | None = None) -> torch.ScriptObject:
        """The operator's ``StepModel`` of these weights over a cache of these keys and values (per
        layer ``(kv_heads, pages, page_size, head_dim)``, keys kept by ``centers`` where given),
        checked once, for any number of steps."""
        layers = [{**layer.tensors(), "keys": k, "values": v}
                  for layer, k, v in zip(self.layers, keys, values, strict=True)]
        if centers is not None:
            for layer, shift, scale in zip(layers, centers.shift, centers.scale, strict=True):
                layer["key_shift"], layer["key_scale"] = shift, scale
        top = {"norm": self.final_norm, "output": self.output.weight}
        if self.output.scales is not None:
            top["output.scales"] = self.output.scales
        s = self.switches
        numbers = {"heads": float(self.n_heads), "kv_heads": float(self.n_kv_heads), "eps": float(self.norm_eps),
                   "page_size": float(page_size), "embedding_scale": float(s.embedding_scale),
                   "gelu": float(s.gelu)}
        for name in ("query_scale", "attention_cap", "final_cap"):
            if getattr(s, name) is not None:
                numbers[name] = float(getattr(s, name))
        return torch.classes.llama_chat_cpu.StepModel(layers, top, numbers, list(s.windows))


def _decode_step():
    return torch.ops.llama_chat_cpu.decode_step.default


class RowsDecoder:
    """``decoder(tokens, positions, tables)``: logits ``(rows, vocab)``, float32, where row ``r``
    is token ``tokens[r]`` at ``positions[r]`` of the sequence whose pages of the paged cache
    (``keys`` and ``values``: per layer ``(kv_heads, pages, page_size, head_dim)``) are
    ``tables[r]`` (all of the same length); each token's keys and values are written at its
    position's slot of its pages. Rows may be consecutive tokens of one sequence (a prompt's
    chunk): every row's keys are written before any row attends. Everything else is prepared
    once.

    A row alone (a job left alone, a chat's turn) reads ``lone``; steps of several rows read what
    ``several`` makes, made at the first such step (a chat's scheduler never takes one)."""

    def __init__(self, lone: StepWeights, several: Callable[[], StepWeights], keys: list[torch.Tensor],
                 values: list[torch.Tensor], page_size: int, centers: KeyCenters | None = None) -> None:
        self.embedding = _plain(lone.embedding)
        self.vocab_size, dim = _shape(self.embedding)
        self.classes = lone.classes  # logits per row
        self.page_size = page_size
        self._run = _decode_step()
        self._keys, self._values, self._centers = keys, values, centers
        self._lone = lone
        self._several_weights: StepWeights | None = None
        self._make_several = several
        self._lone_model = lone.over(keys, values, page_size, centers)
        self._several_model: torch.ScriptObject | None = None
        # The inputs go in through NumPy views of kept tensors (``_RowsInputs``), a lone row's too.
        self._embedding_rows = _EmbeddingRows.of(self.embedding)
        self._rows_inputs = _RowsInputs(dim)

    def weights_for(self, rows: int) -> StepWeights:
        """What a step of ``rows`` rows reads."""
        if rows == 1:
            return self._lone
        if self._several_weights is None:
            self._several_weights = self._make_several()
        return self._several_weights

    def __call__(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        return self._run(self._model(len(tokens)), *self._inputs(tokens, positions, tables))

    def with_picks(self, tokens: list[int], positions: list[int], tables: list[list[int]],
                   below: int | None = None, sampled: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and each row's greedy pick among the ids below ``below`` (all: None), picked
        by the step's own threads as they write the logits; with ``sampled``,
        of those rows only, in that order (rows of a prompt's chunk but its last need none). The
        picks tensor of a number of rows is the same one every time: read it before the next
        step."""
        kept = self._rows_inputs.of(len(tokens), len(tables[0]))
        picks = kept.picks
        chosen = None
        if sampled is not None and len(sampled) < len(tokens):
            picks = picks[:len(sampled)]
            chosen = torch.tensor(sampled, dtype=torch.long)
        logits = self._run(self._model(len(tokens)), *self._fill(kept, tokens, positions, tables), picks,
                           self.classes if below is None else below, chosen)
        return logits, picks

    def pick(self, token: int, position: int, table: list[int], below: int | None = None) -> int:
        """``with_picks`` of one row, its pick as an int, read through a NumPy view: indexing the
        picks tensor let go of the GIL, and a lone job waited to take it back."""
        kept = self._rows_inputs.of(1, len(table))
        self._run(self._lone_model, *self._fill(kept, [token], [position], [table]), kept.picks,
                  self.classes if below is None else below)
        return int(kept.picks_slot[0])

    def _model(self, rows: int) -> torch.ScriptObject:
        if rows == 1:
            return self._lone_model
        if self._several_model is None:
            self._several_model = self.weights_for(rows).over(self._keys, self._values, self.page_size, self._centers)
        return self._several_model

    def _inputs(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> tuple:
        return self._fill(self._rows_inputs.of(len(tokens), len(tables[0])), tokens, positions, tables)

    def _fill(self, kept: _KeptRows, tokens: list[int], positions: list[int], tables: list[list[int]]) -> tuple:
        if self._embedding_rows is not None:
            if min(tokens) < 0 or max(tokens) >= self.vocab_size:
                raise IndexError(f"a token id of {tokens} is outside the vocabulary ({self.vocab_size})")
            self._embedding_rows.copy(tokens, kept.hidden_bytes)
            hidden = kept.hidden
        else:
            hidden = _rows(self.embedding, tokens)
        kept.positions_slot[:] = positions
        kept.tables_slot[:] = tables
        return (hidden, kept.positions, kept.tables)


def _plain(embedding: torch.Tensor | PackedWeight) -> torch.Tensor | PackedWeight:
    """A float embedding as a plain tensor (it slices faster than a parameter); packed blocks as they are."""
    return embedding if isinstance(embedding, PackedWeight) else embedding.detach()


def _shape(embedding: torch.Tensor | PackedWeight) -> tuple[int, int]:
    if isinstance(embedding, PackedWeight):
        return embedding.out_features, embedding.in_features
    return embedding.shape[0], embedding.shape[1]


def _rows(embedding: torch.Tensor | PackedWeight, tokens: list[int]) -> torch.Tensor:
    """The float32 rows of ``tokens``: a slice for one token (not a gather), packed rows expanded."""
    if isinstance(embedding, PackedWeight):
        picked = embedding.data.index_select(0, torch.tensor(tokens, dtype=torch.long))
        return PackedWeight(embedding.kind, picked, embedding.in_features).dequantize_rows(0, len(tokens))
    if len(tokens) == 1:
        return embedding[tokens[0]:tokens[0] + 1].float()
    return embedding.index_select(0, torch.tensor(tokens, dtype=torch.long)).float()


class _EmbeddingRows:
    """A float32 embedding whose rows are copied as bytes between memoryviews, holding the GIL:
    NumPy's ``take`` let go of it, and taking it back from the event loop's thread made a lone
    scheduler job wait every step. (NumPy cannot view a bfloat16 embedding: torch takes its rows.)"""

    def __init__(self, embedding: torch.Tensor) -> None:
        self.rows = memoryview(embedding.numpy()).cast("B")
        self.size = embedding.shape[1] * embedding.element_size()

    @classmethod
    def of(cls, embedding: torch.Tensor) -> _EmbeddingRows | None:
        return cls(embedding) if isinstance(embedding, torch.Tensor) and embedding.dtype == torch.float32 else None

    def copy(self, tokens, into: memoryview) -> None:
        """Row ``tokens[r]`` into the ``r``-th row of ``into`` (float32 rows, as bytes)."""
        size = self.size
        for r, token in enumerate(tokens):
            into[r * size:(r + 1) * size] = self.rows[token * size:(token + 1) * size]


@dataclass
class _KeptRows:
    """The inputs of a step of ``rows`` rows with block tables ``width`` long: kept tensors and
    NumPy views of them, to be filled in place."""

    hidden: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    picks: torch.Tensor

    def __post_init__(self) -> None:
        self.hidden_bytes = memoryview(self.hidden.numpy()).cast("B")
        self.picks_slot = self.picks.numpy()
        self.positions_slot = self.positions.numpy()
        self.tables_slot = self.tables.numpy()


class _RowsInputs:
    """``_KeptRows`` per shape, cut from buffers that grow as needed.

    A step of 16 rows built its inputs with four torch calls (the embedding's ``index_select``,
    three tensors from lists), each of which let go of the GIL and waited to take it back from the
    event loop's thread. Filling NumPy views keeps it (docs/batching.md). The shapes change only
    when a job joins or leaves or a row reaches a new page, so each shape's views are made once."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.rows = self.width = 0
        self.made: dict[tuple[int, int], _KeptRows] = {}

    def of(self, rows: int, width: int) -> _KeptRows:
        kept = self.made.get((rows, width))
        if kept is None:
            if len(self.made) >= 512:  # shapes of steps long past
                self.made.clear()
            if rows > self.rows or width > self.width:
                self.rows, self.width = max(rows, 2 * self.rows), max(width, 2 * self.width)
                self._hidden = torch.empty(self.rows * self.dim)
                self._positions = torch.empty(self.rows, dtype=torch.long)
                self._tables = torch.empty(self.rows * self.width, dtype=torch.long)
                self._picks = torch.empty(self.rows, dtype=torch.long)
                self.made.clear()
            kept = self.made[rows, width] = _KeptRows(
                self._hidden[:rows * self.dim].view(rows, self.dim), self._positions[:rows],
                self._tables[:rows * width].view(rows, width), self._picks[:rows])
        return kept
