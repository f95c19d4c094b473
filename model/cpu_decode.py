"""Decode steps through the whole model in one call of our CPU operator.

A decode step on the CPU is some 25 (stories15M-sized) to 90 (TinyLlama-sized) products, and each
product's parallel region wakes torch's sleeping OpenMP helper, 30-60 us a time against 20-100 us
for the product itself. ``torch.ops.llama_chat_cpu.decode_step`` (``ml/cpu_decode.cpp``) runs one
token of each of several rows through every layer and the classifier in one parallel region
instead, its threads spinning only while that token is computed. Two ways in:

* ``Transformer.forward`` hands it a forward when ``takes`` says so: one token of one row, on the
  CPU, without gradients, over a ``KVCache``, with fused projections whose weights the operator
  reads (float32, bfloat16, or int8 with per-row scales), the operator loaded (``forward``);
* the scheduler hands it a step of one-token rows over its page pool, each row with its own
  position and block table (``takes_rows``, ``forward_rows``).

The tensors the operator reads are gathered once per model (and per cache) and kept: the norms
as float32 copies, everything else as the model's own tensors, whose weights are first moved into
one block of 2 MiB pages (``gather``). Greedy picks can be made inside the step (``Decoder.pick``,
``RowsDecoder.with_picks``), by the threads that write the logits.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from llama_chat.ml import quantize
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.model.formats.common import in_file_mapping, release_heap, release_pages
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.paged_kv_cache import PagedKVCache

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class DecodeWeights:
    """The operator's view of one model: what it reads besides the token and the cache."""

    key: tuple
    weights: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    norms: list[torch.Tensor]
    final_norm: torch.Tensor
    output: torch.Tensor
    output_scales: torch.Tensor | None
    decoders: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    packed: tuple[list[torch.Tensor], torch.Tensor] | None = None  # ``packed_weights``, once made

    def arguments(self, model: nn.Module, keys: list[torch.Tensor], values: list[torch.Tensor],
                  packed: bool = False) -> tuple:
        """The operator's arguments from its weights on, for a cache of these keys and values;
        with ``packed``, float32 weights as panels where ``packed_weights`` makes them."""
        args = model.args
        weights, output = self.packed_weights() if packed else (self.weights, self.output)
        return (weights, self.scales, self.norms, keys, values, model.rope_table(self.output.device),
                self.final_norm, output, self.output_scales, args.n_heads, args.n_kv_heads, args.norm_eps)

    def packed_weights(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The weights and the classifier for the batched step (and a single stream's, below
        ``PANELS_ALONE_AT_MOST``): float32 ones packed as panels of 16 outputs (``ml/cpu_panels.h``),
        a second copy, made once; the classifier only when its outputs are a multiple of 16, and
        nothing when the copy would pass ``PANELS_AT_MOST``."""
        if self.packed is None:
            chosen = self._packable()
            slots = [_panel_bytes(w) for w in chosen]
            if not chosen or sum(slots) > PANELS_AT_MOST:
                self.packed = (self.weights, self.output)
                return self.packed
            block = cpu_kernels.large_pages_block(sum(slots))
            if block is None:
                block = torch.empty(sum(slots), dtype=torch.uint8)
            made, offset = {}, 0
            for weight, slot in zip(chosen, slots):
                made[id(weight)] = _pack(weight, block[offset:offset + slot])
                offset += slot
            self.packed = ([made.get(id(w), w) for w in self.weights], made.get(id(self.output), self.output))
        return self.packed

    def panel_bytes(self) -> int:
        """The size of the copy ``packed_weights`` makes, or would make below its limit."""
        return sum(_panel_bytes(w) for w in self._packable())

    def packs_for(self, alone: bool) -> bool:
        """Whether a step takes the packed weights: steps of several rows do (up to
        ``PANELS_AT_MOST``); a single stream's only for float32 weights, while the copy is at most
        ``PANELS_ALONE_AT_MOST`` (a row alone is bound by reading the weights, and float32 panels
        of bfloat16 weights are twice the bytes)."""
        if not alone:
            return True
        return self.weights[0].dtype == torch.float32 and self.panel_bytes() <= PANELS_ALONE_AT_MOST

    def _packable(self) -> list[torch.Tensor]:
        return [w for w in (*self.weights, self.output) if _packable(w, w is self.output)]


# Outputs per panel of packed weights (``ml/cpu_panels.h``).
PANEL = 16
# The packed copy of a model's float32 weights is made only up to this size: a 110M-parameter
# model's is 0.4 GiB, a TinyLlama-sized one's 4.1 GiB.
PANELS_AT_MOST = 1 << 30
# A single stream takes the packed copy only up to this size. One row reads panels faster than
# weight rows: a stories15M-sized model (a 60 MB copy) decoded 1.21x as fast, a 110M-parameter one
# (0.4 GiB) 1.09x; a copy that doubles a large model's memory is not worth that much.
PANELS_ALONE_AT_MOST = 1 << 28


def _packable(weight: torch.Tensor, classifier: bool) -> bool:
    # The operator takes a packed classifier's size from its panels: whole ones only.
    return weight.dtype in WEIGHT_DTYPES and not (classifier and weight.shape[0] % PANEL)


def _panel_bytes(weight: torch.Tensor) -> int:
    n, k = weight.shape
    return -(-n // PANEL) * PANEL * k * 4


def _pack(weight: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """``weight`` (n, k) as float32 panels (ceil(n / 16), k, 16) in the bytes ``into``, the last
    panel's missing outputs zero. bfloat16 weights become float32 exactly."""
    weight = weight.detach()
    n, k = weight.shape
    whole = n // PANEL
    panels = into.view(torch.float32).view(-1, k, PANEL)
    panels[:whole].copy_(weight[:whole * PANEL].view(whole, PANEL, k).transpose(1, 2))
    if whole < panels.shape[0]:
        tail = weight.new_zeros(PANEL, k)
        tail[:n - whole * PANEL] = weight[whole * PANEL:]
        panels[whole].copy_(tail.T)
    return panels


def _weight(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if isinstance(layer, quantize.Int8Linear):
        return layer.weight, layer.scales
    if type(layer) is nn.Linear and layer.bias is None and layer.weight.dtype in WEIGHT_DTYPES:
        return layer.weight, None
    return None


def supports(model: nn.Module) -> bool:
    """Whether ``model``'s one-token CPU steps will go to the operator (fused or not yet)."""
    if not cpu_kernels.loaded():
        return False
    for layer in model.layers:
        attention, ffn = layer.attention, layer.feed_forward
        parts = ([attention.wqkv] if attention.wqkv is not None else [attention.wq, attention.wk, attention.wv])
        parts += [attention.wo] + ([ffn.w13] if ffn.w13 is not None else [ffn.w1, ffn.w3]) + [ffn.w2]
        for part in parts:
            found = _weight(part)
            if found is None or found[0].device.type != "cpu":
                return False
        if len({p.weight.dtype for p in parts}) > 1 and not all(isinstance(p, quantize.Int8Linear) for p in parts):
            return False  # fusing needs one dtype
    found = _weight(model.output)
    return found is not None and found[0].device.type == "cpu"


def _key(model: nn.Module) -> tuple:
    # Replacing or casting the parameters changes these; loading in place does not need to.
    first = model.layers[0]
    projection = first.attention.wqkv
    return (model.output.weight.data_ptr(), model.output.weight.dtype,
            projection.weight.data_ptr() if projection is not None else None)


# Values copied at a time when weights move (``_copy_releasing``).
_MOVE_PIECE = 1 << 22


def _to_large_pages(modules: list[nn.Module]) -> None:
    """Move the modules' weights into one block of 2 MiB pages, in place, one at a time."""
    sizes = [m.weight.numel() * m.weight.element_size() for m in modules]
    if any(m.weight.device.type != "cpu" for m in modules):
        return
    slots = [(size + 63) // 64 * 64 for size in sizes]  # each weight at a cache line's start
    block = cpu_kernels.large_pages_block(sum(slots))
    if block is None:
        return
    offset = 0
    for module, size, slot in zip(modules, sizes, slots):
        weight = module.weight
        with torch.inference_mode(False):
            moved = block[offset:offset + size].view(weight.dtype).view(weight.shape)
            _copy_releasing(weight.data, moved)
            # ``.data`` keeps the parameter object, so a weight tied to the embedding moves with it.
            weight.data = moved
        if isinstance(module, quantize.Int8Linear):
            module.repack()
        offset += slot
        # The old weight was freed into the C heap, which keeps what it does not hand back:
        # untrimmed, the old weights would all stay resident beside the block until the end.
        release_heap()


def _copy_releasing(source: torch.Tensor, target: torch.Tensor) -> None:
    """``target.copy_(source)``, a piece at a time; a memory-mapped source's pages are let go as
    they are read. A checkpoint's weight stays mapped while any tensor of its file lives, so its
    pages, just read for the copy, would otherwise count twice in the resident set."""
    mapped = in_file_mapping(source)
    source, target = source.view(-1), target.view(-1)
    for start in range(0, source.numel(), _MOVE_PIECE):
        piece = source[start:start + _MOVE_PIECE]
        target[start:start + _MOVE_PIECE].copy_(piece)
        if mapped:
            release_pages(piece, file_mapped=True)


def gather(model: nn.Module) -> DecodeWeights | None:
    """The tensors the operator reads from ``model``, or None when it cannot read them.

    Before they are gathered, the weights move onto 2 MiB pages (``cpu_kernels.large_pages_block``):
    a step then misses the TLB once per 2 MiB it reads instead of once per 4 KiB, which made the
    stories15M-sized step 8 % faster. A float32 checkpoint's weights thereby stop being its
    memory-mapped file: they are read whole here rather than as the first steps touch them.
    """
    if not _readable(model):
        return None
    _to_large_pages([p for layer in model.layers for p in _projections(layer)] + [model.output])
    weights: list[torch.Tensor] = []
    scales: list[torch.Tensor | None] = []
    norms: list[torch.Tensor] = []
    for layer in model.layers:
        for projection in _projections(layer):
            weight, scale = _weight(projection)
            weights.append(weight)
            scales.append(scale)
        norms += [layer.attention_norm.weight.detach().float().contiguous(),
                  layer.ffn_norm.weight.detach().float().contiguous()]
    output = _weight(model.output)
    return DecodeWeights(_key(model), weights, scales, norms, model.norm.weight.detach().float().contiguous(),
                         output[0], output[1])


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A fused layer's projections, in the operator's order."""
    attention, ffn = layer.attention, layer.feed_forward
    return attention.wqkv, attention.wo, ffn.w13, ffn.w2


def _readable(model: nn.Module) -> bool:
    """Whether every tensor ``gather`` takes is one the operator reads."""
    for layer in model.layers:
        if layer.attention.wqkv is None or layer.feed_forward.w13 is None:
            return False
        for projection in _projections(layer):
            found = _weight(projection)
            if found is None or found[0].device.type != "cpu" or not found[0].is_contiguous():
                return False
    output = _weight(model.output)
    return output is not None and output[0].is_contiguous()


def takes(model: nn.Module, tokens: torch.Tensor, cache) -> bool:
    """Whether ``model(tokens, positions, cache)`` is one the operator computes."""
    if not (tokens.shape == (1, 1) and tokens.device.type == "cpu" and type(cache) is KVCache
            and not torch.is_grad_enabled() and cpu_kernels.loaded()):
        return False
    return _weights_of(model) is not None and cache.keys[0].dtype in WEIGHT_DTYPES


@dataclass
class _Unsupported:
    """What ``_weights_of`` keeps for a model the operator cannot read (until its weights change)."""

    key: tuple


def _weights_of(model: nn.Module) -> DecodeWeights | None:
    """``gather(model)``, kept on the model until its weights are replaced or cast."""
    found = getattr(model, "_cpu_decode", None)
    key = _key(model)
    if found is None or found.key != key:
        found = gather(model)
        model._cpu_decode = found if found is not None else _Unsupported(key)
    return found if isinstance(found, DecodeWeights) else None


def forward(model: nn.Module, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits ``(1, 1, vocab)``, float32, of the token at its position, its keys and values cached."""
    return decoder(model, cache)(int(tokens.reshape(-1)[0]), int(positions.reshape(-1)[0])).view(1, 1, -1)


def decoder(model: nn.Module, cache: KVCache) -> Decoder:
    """The ``Decoder`` of ``model`` over ``cache``, made once (until either's tensors change)."""
    found = _weights_of(model)
    if found is None:
        raise ValueError("the one-call step cannot read this model's weights")
    made = found.decoders.get(cache)
    if made is None or made.keys_ptr != cache.keys[0].data_ptr():
        made = found.decoders[cache] = Decoder(model, found, cache)
    return made


class Decoder:
    """``decoder(token, position)``: the logits ``(1, vocab)`` of one token of the one sequence in
    row 0 of ``cache``, its keys and values written, with everything but the token and the
    position prepared once (row 0 of every layer's keys and values as one page of the cache's
    length). A step on the stories15M-sized model spent a tenth of its time in Python around the
    call before."""

    def __init__(self, model: nn.Module, found: DecodeWeights, cache: KVCache) -> None:
        # Detached: a step needs no inference or no-grad mode around it (``pick`` in the engine),
        # and a plain tensor slices faster than a parameter: with both, the time between two of
        # the engine's steps went from about 70 to 36 us on a stories15M-sized model.
        self.embedding = model.tok_embeddings.weight.detach()
        self.vocab_size = self.embedding.shape[0]
        self.classes = found.output.shape[0]  # logits per step
        self.capacity = cache.max_seq_len
        self.keys_ptr = cache.keys[0].data_ptr()
        keys, values = [k[0].unsqueeze(1) for k in cache.keys], [v[0].unsqueeze(1) for v in cache.values]
        self._run = torch.ops.llama_chat_cpu.decode_step.default
        self._before = (torch.zeros(1, 1, dtype=torch.long), self.capacity,
                        *found.arguments(model, keys, values, packed=found.packs_for(alone=True)))
        # The position goes in through a NumPy view of a kept tensor: a new tensor per token cost
        # twenty times as long.
        self._position = torch.zeros(1, dtype=torch.long)
        self._position_slot = self._position.numpy()
        self._picks = torch.zeros(1, dtype=torch.long)
        self._pick_slot = self._picks.numpy()
        # So does a float32 embedding row (``_EmbeddingRows``).
        self._hidden_row = torch.zeros(1, self.embedding.shape[1])
        self._hidden_bytes = memoryview(self._hidden_row.numpy()).cast("B")
        self._embedding_rows = _EmbeddingRows.of(self.embedding)

    def __call__(self, token: int, position: int) -> torch.Tensor:
        return self._run(self._hidden(token, position), self._position, *self._before)

    def pick(self, token: int, position: int, below: int | None = None) -> int:
        """The greedy pick after the token: the first id of the largest logit among the ids below
        ``below`` (all of them: None), found by the step's own threads as they write the logits."""
        self._run(self._hidden(token, position), self._position, *self._before, self._picks,
                  self.classes if below is None else below)
        return int(self._pick_slot[0])

    def _hidden(self, token: int, position: int) -> torch.Tensor:
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} is past the cache length {self.capacity}")
        if not 0 <= token < self.vocab_size:
            raise IndexError(f"token id {token} is outside the vocabulary ({self.vocab_size})")
        self._position_slot[0] = position
        if self._embedding_rows is None:
            return self.embedding[token:token + 1].float()
        self._embedding_rows.copy((token,), self._hidden_bytes)
        return self._hidden_row


def takes_rows(model: nn.Module, cache) -> bool:
    """Whether ``forward_rows`` can run one-token rows of ``model`` over the paged ``cache``."""
    return (isinstance(cache, PagedKVCache) and cache.device.type == "cpu" and cpu_kernels.loaded()
            and not torch.is_grad_enabled() and cache.keys[0].dtype in WEIGHT_DTYPES
            and _weights_of(model) is not None)


class RowsDecoder:
    """``decoder(tokens, positions, tables)``: logits ``(rows, vocab)``, float32, where row ``r``
    is token ``tokens[r]`` at ``positions[r]`` of the sequence whose pages of ``cache`` are
    ``tables[r]`` (all of the same length); each token's keys and values are written at its
    position's slot of its pages. Rows may be consecutive tokens of one sequence (a prompt's
    chunk): every row's keys are written before any row attends. Everything else is prepared
    once."""

    def __init__(self, model: nn.Module, cache: PagedKVCache) -> None:
        found = _weights_of(model)
        if found is None:
            raise ValueError("the one-call step cannot read this model's weights")
        self.embedding = model.tok_embeddings.weight.detach()  # a plain tensor slices faster
        self.vocab_size = self.embedding.shape[0]
        self.classes = found.output.shape[0]  # logits per row
        self.page_size = cache.page_size
        self._run = torch.ops.llama_chat_cpu.decode_step.default
        # Panels: a tile of rows against a panel takes a batch's classifier at 1.5x the speed of
        # weight rows taken one at a time. A row alone (a job left alone, a chat's turn) takes
        # what a single stream takes (``DecodeWeights.packs_for``).
        self._after_lone = found.arguments(model, cache.keys, cache.values, packed=found.packs_for(alone=True))
        # Made at the first step of several rows: a chat's scheduler never takes one.
        self._after: tuple | None = None
        self._several = lambda: found.arguments(model, cache.keys, cache.values, packed=found.packs_for(alone=False))
        # The inputs go in through NumPy views of kept tensors (``_RowsInputs``), a lone row's too.
        self._embedding_rows = _EmbeddingRows.of(self.embedding)
        self._rows_inputs = _RowsInputs(self.embedding.shape[1])
        # Whether steps of several rows read panels: then prompts' chunks are worth taking as
        # rows too (``BatchCore``), a step of them being as long as a few decode steps.
        self.packs_several = found.packs_for(alone=False) and 0 < found.panel_bytes() <= PANELS_AT_MOST

    def __call__(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        return self._run(*self._inputs(tokens, positions, tables), *self._weights(len(tokens)))

    def with_picks(self, tokens: list[int], positions: list[int], tables: list[list[int]],
                   below: int | None = None, sampled: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits and each row's greedy pick among the ids below ``below`` (all: None), picked
        by the step's own threads as they write the logits (``Decoder.pick``); with ``sampled``,
        of those rows only, in that order (rows of a prompt's chunk but its last need none). The
        picks tensor of a number of rows is the same one every time: read it before the next
        step."""
        kept = self._rows_inputs.of(len(tokens), len(tables[0]))
        picks = kept.picks
        chosen = None
        if sampled is not None and len(sampled) < len(tokens):
            picks = picks[:len(sampled)]
            chosen = torch.tensor(sampled, dtype=torch.long)
        logits = self._run(*self._fill(kept, tokens, positions, tables), *self._weights(len(tokens)), picks,
                           self.classes if below is None else below, chosen)
        return logits, picks

    def pick(self, token: int, position: int, table: list[int], below: int | None = None) -> int:
        """``with_picks`` of one row, its pick as an int, read through a NumPy view: indexing the
        picks tensor let go of the GIL, and a lone job waited some 25 us a step to take it back."""
        kept = self._rows_inputs.of(1, len(table))
        self._run(*self._fill(kept, [token], [position], [table]), *self._weights(1), kept.picks,
                  self.classes if below is None else below)
        return int(kept.picks_slot[0])

    def _weights(self, rows: int) -> tuple:
        if rows == 1:
            return self._after_lone
        if self._after is None:
            self._after = self._several()
        return self._after

    def _inputs(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> tuple:
        return self._fill(self._rows_inputs.of(len(tokens), len(tables[0])), tokens, positions, tables)

    def _fill(self, kept: _KeptRows, tokens: list[int], positions: list[int], tables: list[list[int]]) -> tuple:
        if self._embedding_rows is not None:
            if min(tokens) < 0 or max(tokens) >= self.vocab_size:
                raise IndexError(f"a token id of {tokens} is outside the vocabulary ({self.vocab_size})")
            self._embedding_rows.copy(tokens, kept.hidden_bytes)
            hidden = kept.hidden
        elif len(tokens) == 1:  # a slice, not a gather
            hidden = self.embedding[tokens[0]:tokens[0] + 1].float()
        else:
            hidden = self.embedding.index_select(0, torch.tensor(tokens, dtype=torch.long)).float()
        kept.positions_slot[:] = positions
        kept.tables_slot[:] = tables
        return (hidden, kept.positions, kept.tables, self.page_size)


class _EmbeddingRows:
    """A float32 embedding whose rows are copied as bytes between memoryviews, holding the GIL:
    NumPy's ``take`` let go of it, and taking it back from the event loop's thread cost a lone
    scheduler job 20 us a step. (NumPy cannot view a bfloat16 embedding: torch takes its rows.)"""

    def __init__(self, embedding: torch.Tensor) -> None:
        self.rows = memoryview(embedding.numpy()).cast("B")
        self.size = embedding.shape[1] * embedding.element_size()

    @classmethod
    def of(cls, embedding: torch.Tensor) -> _EmbeddingRows | None:
        return cls(embedding) if embedding.dtype == torch.float32 else None

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
    event loop's thread. Filling NumPy views keeps it: 16 jobs of a stories15M-sized model ran
    1.03x as fast (8 interleaved pairs). The shapes change only when a job joins or leaves or a
    row reaches a new page, so each shape's views are made once."""

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


def forward_rows(model: nn.Module, tokens: list[int], positions: list[int], tables: list[list[int]],
                 cache: PagedKVCache) -> torch.Tensor:
    """``RowsDecoder(model, cache)(tokens, positions, tables)``, for one step."""
    return RowsDecoder(model, cache)(tokens, positions, tables)
