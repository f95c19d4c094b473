"""Lays a model's weights out for the one-call CPU decode step (``ml/cpu/decode.py``) and says when
a forward takes it.

A decode step on the CPU is some 25 (stories15M-sized) to 90 (TinyLlama-sized) products, and each
product's parallel region wakes torch's sleeping OpenMP helper, which costs about as much as the
product itself. ``torch.ops.llama_chat_cpu.decode_step`` (``ml/cpu/decode.cpp``) runs one token of
each of several rows through every layer and the classifier in one parallel region instead, its
threads spinning only while that token is computed.

The operator computes a Llama's layer and the switches of the families (``OPERATOR_PARTS``): Qwen's
parts of a head, Gemma's scaled embedding, GeGLU, output norms, windows, scores' scale and soft
caps, and each layer's rotary table (``step_switches``). A model with a switch it lacks
(``operator_gaps``) keeps the layers.

The scheduler's backends hand it a step of one-token rows over its page pool, each row with its
own position and block table (``takes_rows``, ``operator_for``, ``forward_rows``), where it reads
the model: on the CPU, without gradients, with fused projections whose weights the operator reads
(float32, bfloat16, float16, int8 with per-row scales, or GGUF's packed blocks: ``ml/packed.py``;
a GGUF file's 16-bit weights are ``ml/half.py``'s layers), the operator loaded. The model's own
``forward`` never calls it.

The tensors the operator reads are gathered once per model and kept: the norms as float32 copies,
everything else as the model's own tensors, whose weights are first moved into one block of
2 MiB pages (``gather``); float32 weights are also packed as panels for steps of several rows
(``DecodeWeights.packed_weights``). The decoder that calls the operator with them
(``RowsDecoder``, under ``PagedDecoder``) is ``ml/cpu/decode.py``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from llama_chat.ml import half, packed, quantize
from llama_chat.ml.cpu import decode
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.cpu.decode import PANEL, LayerWeights, Projection, StepWeights, Switches
from llama_chat.model.formats.common import in_file_mapping, release_heap, release_pages
from llama_chat.model.paged_kv_cache import PagedKVCache

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The cache types the operator reads (model/kv_types.py): floats, and q8_0 and q4_0 blocks as bytes.
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.uint8)
# The models whose caches (in their first parameter's dtype) it reads: a float16 model's
# norms are not the float32 the step takes.
MODEL_DTYPES = (torch.float32, torch.bfloat16)
# What of a family's layer the operator computes beyond a Llama's (``ModelArgs.llama_layout``'s
# names): Qwen2's q/k/v biases, Qwen3's head norms and a head width other than dim / heads;
# Gemma's GeGLU, scaled embedding, output norms, soft caps and attention rules (windows, scores'
# scale); and any rotary table, which is only another table (``StepWeights.ropes``).
OPERATOR_PARTS = ("qkv bias", "q/k norms", "head width", "gelu_tanh", "embedding scale", "post norms",
                  "final soft cap", "attention rule", "local rotary base", "LongRoPE", "linear rotary scaling")


def operator_gaps(args) -> list[str]:
    """What of the model ``args`` describes the operator does not compute: empty when it takes it."""
    return [gap for gap in args.llama_layout() if gap not in OPERATOR_PARTS]


def step_switches(args) -> Switches:
    """The family's switches as the step takes them, from the rules the layers follow
    (``ModelArgs.attention_rule``: a window the context never passes is none)."""
    shared = args.attention_rule(-1)  # the scale and cap of every layer, and no window
    return Switches(windows=tuple(args.attention_rule(i).window or 0 for i in range(args.n_layers)),
                    embedding_scale=args.dim ** 0.5 if args.embedding_scale else 1.0,
                    gelu=args.activation == "gelu_tanh", query_scale=shared.scale,
                    attention_cap=shared.softcap, final_cap=args.final_softcap)


@dataclass
class DecodeWeights:
    """What of one model the operator reads besides the token and the cache, kept on the model
    (``_weights_of``): the one record per layer of its weight rows (``rows``, made once by
    ``gather``) and, for steps of several rows, a second one of float32 panels (``packed_weights``),
    made at the first such step."""

    key: tuple
    rows: StepWeights
    packed: StepWeights | None = None  # ``packed_weights``, once made

    def step_weights(self, packed: bool = False) -> StepWeights:
        """What the operator reads; with ``packed``, float32 weights as panels where
        ``packed_weights`` makes them."""
        return self.packed_weights() if packed else self.rows

    def packed_weights(self) -> StepWeights:
        """The weights for the batched step (and a single stream's, below ``PANELS_ALONE_AT_MOST``):
        float32 ones packed as panels of 16 outputs (``ml/cpu/panels.h``), a second copy, made
        once; the classifier only when its outputs are a multiple of 16, and the weight rows
        themselves when the copy would pass ``PANELS_AT_MOST``."""
        if self.packed is None:
            chosen = self._packable()
            slots = [_panel_bytes(w) for w in chosen]
            if not chosen or sum(slots) > PANELS_AT_MOST:
                self.packed = self.rows
                return self.packed
            block = cpu_kernels.large_pages_block(sum(slots))
            if block is None:
                block = torch.empty(sum(slots), dtype=torch.uint8)
            made, offset = {}, 0
            for weight, slot in zip(chosen, slots):
                made[id(weight)] = Projection(_pack(weight, block[offset:offset + slot]))
                offset += slot

            def panels(projection: Projection) -> Projection:
                return made.get(id(projection.weight), projection)

            layers = [dataclasses.replace(layer, qkv=panels(layer.qkv), out=panels(layer.out),
                                          gate_up=panels(layer.gate_up), down=panels(layer.down))
                      for layer in self.rows.layers]
            self.packed = dataclasses.replace(self.rows, layers=layers, output=panels(self.rows.output))
        return self.packed

    def panel_bytes(self) -> int:
        """The size of the copy ``packed_weights`` makes, or would make below its limit."""
        return _panels_size([p.weight for layer in self.rows.layers for p in layer.projections()],
                            self.rows.output.weight)

    def packs_for(self, alone: bool) -> bool:
        """Whether a step takes the packed weights: steps of several rows do (up to
        ``PANELS_AT_MOST``); a single stream's as ``_alone_packs`` says."""
        return not alone or _alone_packs(self.rows.layers[0].qkv.weight.dtype, self.panel_bytes())

    def _packable(self) -> list[torch.Tensor]:
        output = self.rows.output.weight
        weights = [p.weight for layer in self.rows.layers for p in layer.projections()] + [output]
        return [w for w in weights if _packable(w, w is output)]


# The packed copy of a model's float32 weights is made only up to this size: a 110M-parameter
# model's is 0.4 GiB, a TinyLlama-sized one's 4.1 GiB.
PANELS_AT_MOST = 1 << 30
# A single stream takes the packed copy only up to this size. One row reads panels faster than
# weight rows, but not by enough to double a large model's memory (docs/batching.md, "Steps on
# the CPU").
PANELS_ALONE_AT_MOST = 1 << 28


def rows_copy_bytes(model: nn.Module) -> int:
    """The bytes of the float32 panels that steps of several rows of ``model`` make and a lone
    row's steps do not read (``DecodeWeights.packs_for``): 0 for packed blocks and int8, for
    float32 weights a single stream packs anyway, and past ``PANELS_AT_MOST`` (no copy is made).
    What a single stream's drafted steps would add to its memory (``--lookup auto``)."""
    weights = [found.weight for layer in model.layers for part in _parts(layer)
               if (found := _weight(part)) is not None]
    output = _weight(model.output)
    size = _panels_size(weights, None if output is None else output.weight)
    if size > PANELS_AT_MOST or (weights and _alone_packs(weights[0].dtype, size)):
        return 0
    return size


def _panels_size(weights: list[torch.Tensor], output: torch.Tensor | None) -> int:
    """The bytes of the float32 panels of the weights and the classifier that can take them."""
    return (sum(_panel_bytes(w) for w in weights if _packable(w, False))
            + (_panel_bytes(output) if output is not None and _packable(output, True) else 0))


def _alone_packs(dtype: torch.dtype, size: int) -> bool:
    """Whether a single stream reads the panels: float32 weights, the copy at most
    ``PANELS_ALONE_AT_MOST`` (a row alone is bound by reading the weights, and float32 panels of
    bfloat16 weights are twice the bytes)."""
    return dtype == torch.float32 and size <= PANELS_ALONE_AT_MOST


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


def _embedding(model: nn.Module) -> torch.Tensor | packed.PackedWeight:
    """The embedding as the step reads it: the float weight, or a packed one's blocks."""
    layer = model.tok_embeddings
    return layer.packed if isinstance(layer, packed.PackedEmbedding) else layer.weight


def _weight(layer: nn.Module) -> Projection | None:
    """What the operator reads of a projection: its weight and scales (None for float weights),
    or packed blocks and their layout (``packed.step_layout``) in the scales' place; None where it
    cannot read it (a bias, another dtype, another device, not contiguous)."""
    if isinstance(layer, packed.PACKED_LAYERS):
        found = Projection(*packed.step_layout(layer))
    elif isinstance(layer, quantize.Int8Linear):
        found = Projection(layer.weight, layer.scales)
    elif type(layer) in (nn.Linear, half.HalfLinear) and layer.bias is None and layer.weight.dtype in WEIGHT_DTYPES:
        found = Projection(layer.weight)
    else:
        return None
    return found if found.weight.device.type == "cpu" and found.weight.is_contiguous() else None


def supports(model: nn.Module) -> bool:
    """Whether ``model``'s one-token CPU steps will go to the operator (fused or not yet)."""
    if not cpu_kernels.loaded():
        return False
    # Engines make the cache in the dtype of the first parameter (a norm, where the matrices are
    # a file's blocks or 16-bit values): one the step cannot read keeps the layers.
    first = next(model.parameters(), None)
    return first is not None and first.dtype in MODEL_DTYPES and _readable(model, fused=False)


def _tensor(layer: nn.Module) -> torch.Tensor:
    """A projection's weight, or its packed blocks (``ml/packed.py``)."""
    return layer.data if isinstance(layer, packed.PACKED_LAYERS) else layer.weight


def _key(model: nn.Module) -> tuple:
    # Replacing or casting the parameters changes these; loading in place does not need to.
    first = model.layers[0]
    projection = first.attention.wqkv
    output = _tensor(model.output)
    return (output.data_ptr(), output.dtype, _tensor(projection).data_ptr() if projection is not None else None)


# Values copied at a time when weights move (``_copy_releasing``).
_MOVE_PIECE = 1 << 22


def _to_large_pages(modules: list[nn.Module]) -> None:
    """Move the modules' weights (or packed blocks) into one block of 2 MiB pages, in place, one
    at a time."""
    sizes = [_tensor(m).numel() * _tensor(m).element_size() for m in modules]
    if any(_tensor(m).device.type != "cpu" for m in modules):
        return
    slots = [(size + 63) // 64 * 64 for size in sizes]  # each weight at a cache line's start
    block = cpu_kernels.large_pages_block(sum(slots))
    if block is None:
        return
    offset = 0
    for module, size, slot in zip(modules, sizes, slots):
        weight = _tensor(module)
        with torch.inference_mode(False):
            moved = block[offset:offset + size].view(weight.dtype).view(weight.shape)
            _copy_releasing(weight.data, moved)
            if isinstance(module, packed.PACKED_LAYERS):
                module.data = moved  # a buffer: nothing is tied to it
            else:
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
    a step then misses the TLB once per 2 MiB it reads instead of once per 4 KiB (the old
    benchmark log's "Measurements once in the CPU operator's comments", in git:
    ``git show fcfebb0:docs/benchmark-log.md``). A float32 checkpoint's weights thereby stop being its
    memory-mapped file: they are read whole here rather than as the first steps touch them.
    """
    if not _readable(model):
        return None
    _to_large_pages([p for layer in model.layers for p in _projections(layer)] + [model.output])
    model.tie_weights()  # a tied packed embedding reads the moved classifier's blocks
    args = model.args
    final_norm = _float_copy(model.norm.weight)
    layers = []
    for i, layer in enumerate(model.layers):
        attention = layer.attention
        qkv, out, gate_up, down = (_weight(p) for p in _projections(layer))
        layers.append(LayerWeights(
            qkv, out, gate_up, down, _float_copy(layer.attention_norm.weight), _float_copy(layer.ffn_norm.weight),
            model.rope_table(final_norm.device, local=args.local_rope(i)),
            qkv_bias=_float_copy(attention.bqkv), q_norm=_norm_copy(attention.q_norm),
            k_norm=_norm_copy(attention.k_norm), attention_post_norm=_norm_copy(layer.attention_post_norm),
            ffn_post_norm=_norm_copy(layer.ffn_post_norm)))
    rows = StepWeights(_embedding(model), layers, final_norm, _weight(model.output), args.n_heads, args.n_kv_heads,
                       args.norm_eps, step_switches(args))
    return DecodeWeights(_key(model), rows)


def _float_copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().float().contiguous()


def _norm_copy(norm: nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else _float_copy(norm.weight)


def _parts(layer: nn.Module) -> list[nn.Module]:
    """A layer's projections, fused or not yet."""
    attention, ffn = layer.attention, layer.feed_forward
    parts = [attention.wqkv] if attention.wqkv is not None else [attention.wq, attention.wk, attention.wv]
    return parts + [attention.wo] + ([ffn.w13] if ffn.w13 is not None else [ffn.w1, ffn.w3]) + [ffn.w2]


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A fused layer's projections, in the operator's order."""
    attention, ffn = layer.attention, layer.feed_forward
    return attention.wqkv, attention.wo, ffn.w13, ffn.w2


def _readable(model: nn.Module, fused: bool = True) -> bool:
    """Whether every projection ``gather`` takes is one the operator reads (``_weight``); with
    ``fused`` false, of a model whose projections are not fused yet, whether they will be."""
    if operator_gaps(model.args):
        return False  # a family's switch the operator lacks: the layers compute it
    for layer in model.layers:
        if fused:
            parts = _projections(layer)
            if None in parts:
                return False
        else:
            parts = _parts(layer)
            # Fusing needs one dtype (packed layers of several kinds fuse: ``packed.fuse``).
            if len({_tensor(p).dtype for p in parts}) > 1 and not all(isinstance(p, quantize.Int8Linear) for p in parts):
                return False
        if any(_weight(part) is None for part in parts):
            return False
    return _weight(model.output) is not None


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


def operator_for(model: nn.Module, cache: PagedKVCache) -> PagedDecoder | None:
    """The one place the CPU operator is chosen: its decoder of ``model`` over the page pool
    ``cache`` (rows of tokens through their block tables), or None where it does not take them (no
    kernels built, not the CPU, weights or a cache type it cannot read). The model's own forward
    never calls it. In inference mode."""
    return PagedDecoder(model, cache) if takes_rows(model, cache) else None


def takes_rows(model: nn.Module, cache) -> bool:
    """Whether ``forward_rows`` can run one-token rows of ``model`` over the paged ``cache``."""
    return (isinstance(cache, PagedKVCache) and cache.device.type == "cpu" and cpu_kernels.loaded()
            and not torch.is_grad_enabled() and cache.keys[0].dtype in CACHE_DTYPES
            and _weights_of(model) is not None)


class PagedDecoder(decode.RowsDecoder):
    """``decode.RowsDecoder`` of ``model`` over the paged ``cache``: a row alone reads what a single
    stream reads (``DecodeWeights.packs_for``); steps of several rows read panels, with which a
    tile of rows takes a batch's classifier faster than weight rows one at a time
    (docs/batching.md, "Panels")."""

    def __init__(self, model: nn.Module, cache: PagedKVCache) -> None:
        found = _weights_of(model)
        if found is None:
            raise ValueError("the one-call step cannot read this model's weights")
        super().__init__(found.step_weights(packed=found.packs_for(alone=True)),
                         lambda: found.step_weights(packed=found.packs_for(alone=False)),
                         cache.keys, cache.values, cache.page_size, cache.key_centers)
        # Whether steps of several rows read panels: then prompts' chunks are worth taking as
        # rows too (``BatchCore``), a step of them being as long as a few decode steps.
        self.packs_several = found.packs_for(alone=False) and 0 < found.panel_bytes() <= PANELS_AT_MOST


def forward_rows(model: nn.Module, tokens: list[int], positions: list[int], tables: list[list[int]],
                 cache: PagedKVCache) -> torch.Tensor:
    """``PagedDecoder(model, cache)(tokens, positions, tables)``, for one step."""
    return PagedDecoder(model, cache)(tokens, positions, tables)
