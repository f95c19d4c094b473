"""Tensor numerics used by the Llama transformer: RMS norm, rotary embeddings, attention."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llama_chat.ml import half, packed, quantize
from llama_chat.ml.cpu import kernels as cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm computed in float32, cast back to ``x``'s dtype before the scale.

    Half-precision sums of squares overflow and lose digits, so the statistic is always float32;
    the cast back before multiplying by ``weight`` matches what Meta and Hugging Face do.
    """
    # F.rms_norm is one fused kernel on CUDA where the spelled-out form is five.
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x) * weight


def activated(x: torch.Tensor, activation: str) -> torch.Tensor:
    """The feed-forward's activation of ``x``: "silu", "gelu_tanh" (GELU's tanh form) or "gelu"."""
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def gated(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``activated(gate) * up`` of a fused gate/up projection's rows (the gate's half first).

    Float32 rows on the CPU with the operator loaded take its one pass over the rows, the
    arithmetic of its decode step (``gated_rows``, ``ml/cpu/decode.cpp``); torch's silu and
    product took three passes over a prompt's widest rows.
    """
    if (activation in ("silu", "gelu_tanh") and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu"
            and cpu_kernels.loaded()):
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        hidden = torch.ops.llama_chat_cpu.gated_rows(rows, activation == "gelu_tanh")
        return hidden.reshape(*gate_up.shape[:-1], hidden.shape[-1])
    gate, up = gate_up.chunk(2, dim=-1)
    return activated(gate, activation).mul_(up)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (BERT's) computed in float32, as ``rms_norm`` is, and cast back to ``x``'s dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).type_as(x)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency scaling (``rope_scaling.rope_type == "llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LinearRope:
    """Positions divided by ``factor`` (``rope_type == "linear"``: Gemma 3's global layers)."""

    factor: float


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE: a divisor per frequency, the short set for contexts up to the trained one
    and the long set beyond it, and cos/sin scaled by ``attention_factor``. The set is chosen once,
    by the context the table is made for, as llama.cpp chooses it."""

    short_factors: tuple[float, ...]
    long_factors: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float = 1.0


Rope = RopeScaling | LinearRope | LongRope


@dataclass(frozen=True)
class AttentionRule:
    """What a layer's attention does beyond Llama's: a sliding window of keys (a query at
    position p sees keys p - window + 1 .. p), a soft cap on the scores (``cap * tanh(s / cap)``)
    and a score scale other than ``1 / sqrt(head_dim)``. The default rule is Llama's."""

    window: int | None = None
    softcap: float | None = None
    scale: float | None = None

    @property
    def plain(self) -> bool:
        return self.window is None and self.softcap is None and self.scale is None


PLAIN_ATTENTION = AttentionRule()


def linear(x: torch.Tensor, weight: torch.Tensor, row_products: bool = False) -> torch.Tensor:
    """``x @ weight.T`` by the product of the weight's dtype (``_PRODUCTS``: a lookup, not a chain
    of tests); with ``row_products``, spelled as a multiply and a sum over the inputs.

    A product of a few rows on the CPU (a decode step) goes to our matrix-vector operator when it
    is loaded (``cpu_kernels``), eager or compiled: it reads the weights at the memory's speed.
    Without it, the spelled-out form is for a compiled decode step on the CPU, where the compiler
    fuses it into one reduction that reads the weights faster than MKL's one-row ``sgemv``. Run
    eagerly it would materialise ``weight``-sized products: never use it outside a compiled step.
    """
    return _PRODUCTS.get(weight.dtype, _plain_product)(x, weight, row_products)


def _float32_product(x: torch.Tensor, weight: torch.Tensor, row_products: bool) -> torch.Tensor:
    """A float32 weight's: the operator's for few rows, oneDNN's where it beats MKL's, else MKL's."""
    if cpu_kernels.takes(x, weight):
        return cpu_kernels.matvec(x, weight)
    if row_products:
        return (x.unsqueeze(-2) * weight).sum(-1)
    if _onednn_pays(x, weight):
        rows = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, None, "none", [], "")
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight)


def _half_product(x: torch.Tensor, weight: torch.Tensor, row_products: bool) -> torch.Tensor:
    """A 16-bit weight's: under float32 rows (a GGUF file's 16-bit weights) ``half.product``;
    under rows of its own dtype the operator's for few rows, else the library's, in float32 where
    this CPU's half-precision product is slow."""
    if cpu_kernels.takes(x, weight):
        return cpu_kernels.matvec(x, weight)
    if row_products:
        return (x.unsqueeze(-2) * weight).sum(-1)
    if half.mixed(x, weight):
        return half.product(x, weight)
    if _slow_half_matmul(x, weight):
        # Half-precision matrix products on a CPU without bf16/fp16 instructions run far slower
        # than float32's; converting the weight costs less than that once a chunk has rows.
        return F.linear(x.float(), weight.float()).to(x.dtype)
    return F.linear(x, weight)


def _plain_product(x: torch.Tensor, weight: torch.Tensor, row_products: bool) -> torch.Tensor:
    if row_products:
        return (x.unsqueeze(-2) * weight).sum(-1)
    return F.linear(x, weight)


_PRODUCTS = {torch.float32: _float32_product, torch.bfloat16: _half_product, torch.float16: _half_product}


# Where oneDNN's float32 inner product beats MKL's (``F.linear``) on an x86 CPU: a weight of at
# least this many elements multiplied by at most this many rows. MKL's product of a transposed
# weight with few rows reads the weight at well below the memory's speed; oneDNN's does not, but
# its fixed cost per call loses on small weights, and past this many rows both are compute-bound
# (docs/benchmarks.md, "Products: the operator's, MKL's and oneDNN's").
ONEDNN_MIN_WEIGHT = 1_500_000
ONEDNN_MAX_ROWS = 128


def _onednn_pays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return False
    if weight.numel() < ONEDNN_MIN_WEIGHT or x.numel() // x.shape[-1] > ONEDNN_MAX_ROWS:
        return False
    # A compiled graph keeps its own products (and a traced call would add nothing); a caller
    # that switched oneDNN off (``torch.backends.mkldnn.enabled``) keeps MKL's.
    return (weight.is_contiguous() and not torch.compiler.is_compiling() and torch.backends.mkldnn.enabled
            and _onednn_linear_available())


@functools.cache
def _onednn_linear_available() -> bool:
    """Whether this PyTorch has oneDNN's inner product on this CPU (x86 builds do)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return False
    try:
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), torch.ones(3, 2), None, "none", [], "")
    except (RuntimeError, AttributeError, TypeError):  # a build or version without it
        return False
    return bool(torch.equal(out, torch.full((1, 3), 2.0)))


# Rows from which a half-precision product on such a CPU is done in float32: converting a weight
# costs about as much as a few dozen rows of the slow product, so shorter runs, and a decode
# step's one row (which reads half the bytes), stay in half precision.
HALF_AS_FLOAT_FROM_ROWS = 32


def _slow_half_matmul(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if weight.dtype not in (torch.bfloat16, torch.float16) or weight.device.type != "cpu":
        return False
    if x.numel() // x.shape[-1] < HALF_AS_FLOAT_FROM_ROWS:
        return False
    return not _cpu_has_half_matmul()


@functools.cache
def _cpu_has_half_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX), so oneDNN's product is fast."""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # an older PyTorch without the probes: assume the common, slow case
        return False


def biased_project(x: torch.Tensor, layer: torch.nn.Module, bias: torch.Tensor | None,
                   activation: str | None = None) -> torch.Tensor:
    """``activation(project(x, layer) + bias)``, ``activation`` None or "gelu" (exact).

    A float32 weight on an x86 CPU goes to oneDNN's inner product with the bias and the GELU in
    its epilogue: for an encoder's prompt-sized rows over small weights it beats MKL's product and
    the two passes after it (docs/benchmarks.md, "Embeddings against sentence-transformers").
    """
    weight = getattr(layer, "weight", None)
    if (type(layer) is torch.nn.Linear and bias is not None and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and bias.dtype == torch.float32
            and weight.is_contiguous() and not torch.compiler.is_compiling() and torch.backends.mkldnn.enabled
            and _onednn_linear_available()):
        rows = x.reshape(-1, x.shape[-1])
        gelu = activation == "gelu"
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "gelu" if gelu else "none", [],
                                                 "none" if gelu else "")
        return out.view(*x.shape[:-1], weight.shape[0])
    out = project(x, layer)
    if bias is not None:
        out = out.add_(bias)
    return F.gelu(out) if activation == "gelu" else out


def project(x: torch.Tensor, layer: torch.nn.Module, row_products: bool = False) -> torch.Tensor:
    """``layer``'s bias-free product with ``x``, by the kind of layer the loader made
    (``_PROJECTIONS``): float weights through ``linear``, int8 ones (``quantize.Int8Linear``)
    through ``quantize.int8_linear``, packed GGUF blocks (``packed.PACKED_LAYERS``) through their
    own product."""
    kind = _PROJECTIONS.get(type(layer))
    if kind is None:
        kind = _PROJECTIONS[type(layer)] = _projection_of(type(layer))
    return kind(x, layer, row_products)


def _float_projection(x: torch.Tensor, layer: torch.nn.Module, row_products: bool) -> torch.Tensor:
    return linear(x, layer.weight, row_products)


def _int8_projection(x: torch.Tensor, layer: torch.nn.Module, row_products: bool) -> torch.Tensor:
    return quantize.int8_linear(x, layer.weight, layer.scales, row_products, layer.packed, layer.packed_key)


def _packed_projection(x: torch.Tensor, layer: torch.nn.Module, row_products: bool) -> torch.Tensor:
    return layer(x)


_PROJECTIONS = {torch.nn.Linear: _float_projection, half.HalfLinear: _float_projection,
                quantize.Int8Linear: _int8_projection, packed.PackedLinear: _packed_projection,
                packed.PackedConcat: _packed_projection}


def _projection_of(kind: type) -> Callable:
    """A layer class's product: that of the first of its bases that has one (a float weight's
    where none does)."""
    return next((_PROJECTIONS[base] for base in kind.__mro__ if base in _PROJECTIONS), _float_projection)


def rope_frequencies(head_dim: int, theta: float, scaling: Rope | None = None,
                     max_seq_len: int = 0) -> torch.Tensor:
    """Inverse frequencies, one per pair of channels, in float32 (optionally scaled: Llama 3.1's,
    linear, or LongRoPE's set for a context of ``max_seq_len``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if isinstance(scaling, LongRope):
        long = max_seq_len > scaling.original_max_position_embeddings
        factors = torch.tensor(scaling.long_factors if long else scaling.short_factors, dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRope):
        return inv_freq / scaling.factor
    # Long wavelengths are stretched by `factor`, short ones kept, the band between blended
    # smoothly: the published Llama 3.1 recipe.
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_table(
    head_dim: int, max_seq_len: int, theta: float, scaling: Rope | None = None
) -> torch.Tensor:
    """``(max_seq_len, head_dim // 2, 2)`` float32 table of (cos, sin) for every position."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, max_seq_len)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    table = torch.stack((angles.cos(), angles.sin()), dim=-1)
    if isinstance(scaling, LongRope) and scaling.attention_factor != 1.0:
        table *= scaling.attention_factor
    return table


def rope_at(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (cos, sin) from ``rope_table``, each ``(batch, seq, 1, head_dim // 2)``.

    Looked up once per forward and shared by every layer's queries and keys.
    """
    cos_sin = table[positions]
    return cos_sin[..., 0].unsqueeze(2), cos_sin[..., 1].unsqueeze(2)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate interleaved channel pairs ``(x[2i], x[2i+1])`` of ``x`` by each token's position.

    ``x`` is ``(batch, seq, heads, head_dim)`` and ``rope`` comes from ``rope_at`` for the same
    positions, so every row of a batch may sit at its own offset. The rotation is done in float32.
    """
    cos, sin = rope
    if (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 4 and cos.dtype == torch.float32
            and cpu_kernels.loaded() and not torch.compiler.is_compiling()):
        return torch.ops.llama_chat_cpu.rope_rows(x, cos, sin)  # one pass, the same arithmetic
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    *, causal: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped-query heads.

    ``q`` is ``(batch, heads, seq, head_dim)``; ``k`` and ``v`` are ``(batch, kv_heads, kv_len,
    head_dim)`` with ``heads`` a multiple of ``kv_heads``; ``mask`` is a boolean
    ``(batch, 1, seq, kv_len)`` (True = may attend) or None when every query sees every key;
    ``causal`` (with no mask) means query ``i`` sees keys ``0..i``, queries and keys aligned at 0.
    """
    if q.shape[2] == 1 and mask is None and q.device.type == "cpu":
        # One query against the cache (an eager decode step): PyTorch's CPU flash kernel opens a
        # parallel region that waits for sleeping helper threads, which on a busy machine costs
        # more than two small products and a softmax do.
        return attention_over_cache(q, k, v, None)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    if causal and mask is None:
        # Only a fresh prefill gets here, where the keys are the chunk's own. CUDA's flash kernel
        # reads grouped heads itself; elsewhere copying them per query head is cheaper.
        if q.is_cuda:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # The query heads that share a key head become extra query rows of that head, so the cached
    # keys are read once per key head instead of being copied n_rep times: in a decode step over
    # the whole cache that copy would cost more memory traffic than the attention itself.
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    grouped = q.reshape(batch, kv_heads, n_rep * seq, head_dim)
    if mask is not None:
        mask = mask.unsqueeze(2).expand(batch, mask.shape[1], n_rep, seq, mask.shape[-1])
        mask = mask.reshape(batch, mask.shape[1], n_rep * seq, mask.shape[-1])
    out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask)
    return out.reshape(batch, heads, seq, head_dim)  # some kernels return another layout


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """``attention`` of a prompt's chunk that follows ``past`` positions of its sequence: ``k`` and
    ``v`` hold those and the chunk's own (``past + q.shape[2]`` keys), and query ``i`` sees keys
    ``0 .. past + i``; ``mask`` says so as ``attention`` takes it (None where ``past`` is 0), for
    where the way below is not taken.

    Eager on the CPU, the past keys are attended with no mask and the chunk's own causally, and
    the two are joined by their log-sum-exps: the mask (which SDPA turns into a float matrix of
    every query head's rows) is never made, and the masked half of the chunk's own square is never
    computed, which at a long prompt's last chunks is a visible share of the attention.
    """
    if past == 0 or q.device.type != "cpu" or torch.compiler.is_compiling():
        return attention(q, k, v, mask, causal=mask is None)
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    n_rep = heads // kv_heads
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # The query heads that share a key head as extra rows of it, as ``attention`` groups them.
    grouped = q.reshape(batch, kv_heads, n_rep * seq, head_dim)
    before, before_lse = flash(grouped, k[:, :, :past], v[:, :, :past], 0.0, False)
    own_k, own_v = k[:, :, past:], v[:, :, past:]
    if n_rep > 1:
        own_k, own_v = own_k.repeat_interleave(n_rep, dim=1), own_v.repeat_interleave(n_rep, dim=1)
    own, own_lse = flash(q, own_k, own_v, 0.0, True)
    own, own_lse = own.reshape(before.shape), own_lse.reshape(before_lse.shape)
    top = torch.maximum(before_lse, own_lse)
    w_before, w_own = (before_lse - top).exp_(), (own_lse - top).exp_()
    total = w_before + w_own
    out = before.float() * (w_before / total).unsqueeze(-1) + own.float() * (w_own / total).unsqueeze(-1)
    return out.to(q.dtype).reshape(batch, heads, seq, head_dim)


# Queries of a chunk from which the CPU operator's prompt attention is taken: every chunk (one
# token goes as a decode row). A query's result does not depend on the chunk it comes in, so a
# prompt read back from the prefix cache or from disk, whose last tokens come as a chunk of their
# own, gives the logits its cold run gave; the float path joins the past and the chunk's own keys
# at the chunk's start, and would round otherwise (a few queries repay the keys' conversion less).
MIN_OWN_ATTENTION_QUERIES = 2


def own_prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int,
                         rule: AttentionRule = PLAIN_ATTENTION) -> torch.Tensor | None:
    """A chunk's attention by the CPU operator (``ml/cpu/attention.cpp``: bfloat16 products,
    float32 scores and an online softmax; docs/benchmarks.md, "Prompt attention"), or None
    where it does not take it. Shapes as ``chunk_attention``'s, under ``rule``; query ``i`` sits
    at position ``past + i`` and sees keys ``0 .. past + i`` (within the rule's window)."""
    head_dim = q.shape[-1]
    if not (q.shape[0] == 1 and q.shape[2] >= MIN_OWN_ATTENTION_QUERIES and head_dim % 64 == 0 and head_dim <= 256
            and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype == torch.float32
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and not torch.compiler.is_compiling() and cpu_kernels.attends_prompts()):
        return None
    scale = rule.scale if rule.scale is not None else 1.0 / math.sqrt(head_dim)
    out = torch.ops.llama_chat_cpu.prompt_attention(q[0], k[0], v[0], past, scale, rule.softcap or 0.0,
                                                    rule.window or 0)
    return out.unsqueeze(0)


def visible_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """``(batch, 1, seq, kv_len)`` bool: which keys each query sees (its own past, and with a
    ``window`` only the last ``window`` positions of it). ``query_positions`` is ``(batch, seq)``,
    ``key_positions`` ``(kv_len,)`` or ``(batch, kv_len)``."""
    q = query_positions.unsqueeze(-1)
    k = key_positions.view(-1, 1, key_positions.shape[-1]) if key_positions.dim() == 2 else key_positions
    seen = k <= q
    if window is not None:
        seen &= k > q - window
    return seen.unsqueeze(1)


def ruled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    rule: AttentionRule) -> torch.Tensor:
    """Attention under ``rule`` (see ``AttentionRule``): two products, the scale, the cap and a
    float32 softmax, grouped heads as in ``attention_over_cache``. ``mask`` is ``visible_keys``'s."""
    batch, heads, seq, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    n_rep = heads // kv_heads
    scale = rule.scale if rule.scale is not None else 1.0 / math.sqrt(head_dim)
    # The scale, and the cap's division, go on the queries: the scores are the largest tensor of a
    # long prompt's step, and each pass over them costs more than the queries' one. In place too.
    if rule.softcap is not None:
        scale /= rule.softcap
    grouped = (q * scale).reshape(batch, kv_heads, n_rep * seq, head_dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float()
    if rule.softcap is not None:
        scores.tanh_().mul_(rule.softcap)
    mask = mask.unsqueeze(2).expand(batch, mask.shape[1], n_rep, seq, kv_len)
    scores.masked_fill_(~mask.reshape(batch, mask.shape[1], n_rep * seq, kv_len), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, heads, seq, head_dim)


# Queries a block in ``ruled_run_attention``: a block's scores at 4,096 keys (8 query heads) are
# 16 MB, within a last-level cache; a 512-token chunk's whole were 64 MB, written and read again
# by each step of the rule.
RULED_BLOCK_ROWS = 128


def ruled_run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, rule: AttentionRule,
                        rows: int = RULED_BLOCK_ROWS) -> torch.Tensor:
    """``ruled_attention`` of one sequence's run of queries at positions ``start, start + 1, ...``
    over its keys at positions ``0 .. k.shape[2] - 1``, ``rows`` queries at a time, each block
    against only the keys it can see (none past its last query, none before its first query's
    window): a long prompt's scores are never made whole, and the keys no query of a block sees
    are not multiplied."""
    seq = q.shape[2]
    if seq <= rows:
        seen = visible_keys(torch.arange(start, start + seq, device=q.device).view(1, seq),
                            torch.arange(k.shape[2], device=q.device), rule.window)
        return ruled_attention(q, k, v, seen, rule)
    parts = []
    for first in range(0, seq, rows):
        stop = min(seq, first + rows)
        low = 0 if rule.window is None else max(0, start + first - rule.window + 1)
        high = start + stop
        seen = visible_keys(torch.arange(start + first, start + stop, device=q.device).view(1, stop - first),
                            torch.arange(low, high, device=q.device), rule.window)
        parts.append(ruled_attention(q[:, :, first:stop], k[:, :, low:high], v[:, :, low:high], seen, rule))
    return torch.cat(parts, dim=2)


def attention_over_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         mask: torch.Tensor | None) -> torch.Tensor:
    """A few queries against a whole fixed-size KV cache, under a boolean mask: a decode step.

    ``mask`` None: every key is visible (an eager CPU decode step over the part of the cache
    in use, see ``attention``).

    Plain products and a float32 softmax rather than a fused attention kernel: the fused kernels
    spread their work over batch, heads and queries, which at batch 1 of a grouped-query model
    is four thread blocks for a GPU of over a hundred multiprocessors; two batched products
    spread over the keys, and a compiler fuses the mask and softmax between them. Shapes as in
    ``attention``; grouped heads are handled as there, without copying the cache.
    """
    batch, heads, seq, head_dim = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    n_rep = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, n_rep * seq, head_dim)
    scores = torch.matmul(grouped, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(head_dim))
    if mask is not None:  # None: every key is visible
        mask = mask.unsqueeze(2).expand(batch, mask.shape[1], n_rep, seq, kv_len)
        mask = mask.reshape(batch, mask.shape[1], n_rep * seq, kv_len)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, heads, seq, head_dim)
