"""The Llama transformer, with Meta's parameter names and interleaved rotary embeddings."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llama_chat.ml import half, ops, packed, quantize
from llama_chat.model import interrupt
from llama_chat.model.args import ModelArgs
from llama_chat.model.formats.common import release_pages
from llama_chat.model.kv_cache import DenseLayout, KVCache, WholeCache
from llama_chat.model.paged_kv_cache import PagedView


# A forward over a CPU cache takes a long run of tokens in pieces whose activations hold at most
# this share of the model's weights' bytes (``Transformer.rows_per_forward``): the memory rule's
# slack over a file's size (docs/benchmarks.md, "Packed blocks").
PROMPT_MEMORY_SHARE = 0.1
# Never pieces shorter than this (the CPU engine's first prefill chunk): each reads every weight.
FEWEST_PIECE_ROWS = 64
# Piece lengths are multiples of this (the packed products take sixteen rows at a time).
PIECE_STEP = 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """BERT's norm: mean and variance over the channels, then a scale and a bias."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.layer_norm(x, self.weight, self.bias, self.eps)


def norm_of(args: ModelArgs, dim: int | None = None) -> nn.Module:
    """The family's norm over ``dim`` channels (the model's width by default)."""
    kind = LayerNorm if args.layer_norm else RMSNorm
    return kind(args.dim if dim is None else dim, args.norm_eps)


# The kinds of cache a forward takes; each gives the layout its attention runs by (``layout``).
Cache = KVCache | WholeCache | PagedView


class AttentionLayout(Protocol):
    """How every layer of one forward writes its keys and attends: one per kind of cache
    (``kv_cache.DenseLayout``, ``kv_cache.WholeCacheLayout``, ``paged_kv_cache.PagedView``), and
    ``OwnTokens`` without one. ``row_products``: projections as multiply-and-sum (``ops.linear``)."""

    row_products: bool

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rule: ops.AttentionRule) -> torch.Tensor:
        """``q`` ``(batch, heads, seq, head_dim)``, ``k``/``v`` the tokens' own ``(batch, kv_heads,
        seq, head_dim)``: their keys stored where the layout keeps them, the heads' outputs
        ``(batch, heads, seq, head_dim)``."""

    def between_layers(self) -> None:
        """Called between two layers (``interrupt.check`` where the forward is eager)."""


class OwnTokens:
    """No cache: the tokens attend among themselves, causally, or (``visible``, ``(batch, 1, 1,
    seq)`` bool) to every token of their row that is not padding (an encoder)."""

    row_products = False

    def __init__(self, positions: torch.Tensor, visible: torch.Tensor | None = None) -> None:
        self.positions = positions
        self.visible = visible

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rule: ops.AttentionRule = ops.PLAIN_ATTENTION) -> torch.Tensor:
        if not rule.plain:  # keys sit at the tokens' own positions
            seen = ops.visible_keys(self.positions, self.positions, rule.window)
            return ops.ruled_attention(q, k, v, seen, rule)
        return ops.attention(q, k, v, self.visible, causal=self.visible is None)

    def between_layers(self) -> None:
        interrupt.check()


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.wqkv: nn.Linear | None = None
        # The biases are their own parameters: the projections stay bias-free layers of any form
        # (float, int8, packed blocks, 16-bit), and the sum is one add after the product.
        self.bq = self.bk = self.bv = self.bqkv = None
        if args.qkv_bias:
            self.bq = nn.Parameter(torch.zeros(args.n_heads * args.head_dim))
            self.bk = nn.Parameter(torch.zeros(args.n_kv_heads * args.head_dim))
            self.bv = nn.Parameter(torch.zeros(args.n_kv_heads * args.head_dim))
        self.bo = nn.Parameter(torch.zeros(args.dim)) if args.linear_biases else None
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.rule = args.attention_rule(layer)

    def fuse(self) -> None:
        """One projection for q, k and v (see ``Transformer.fuse_projections``)."""
        if self.wqkv is None:
            self.wqkv = _fused_linear(self.wq, self.wk, self.wv)
            del self.wq, self.wk, self.wv
            if self.bq is not None:
                self.bqkv = nn.Parameter(torch.cat([self.bq.detach(), self.bk.detach(), self.bv.detach()]),
                                         requires_grad=False)
                del self.bq, self.bk, self.bv
                self.bq = self.bk = self.bv = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None, layout: AttentionLayout,
                layer: int) -> torch.Tensor:
        """``rope`` is None where positions are learned embeddings (BERT): nothing is rotated."""
        batch, seq, _ = x.shape
        if self.wqkv is not None:
            q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            if self.bo is not None:  # BERT's biases everywhere: the bias in the product
                qkv = ops.biased_project(x, self.wqkv, self.bqkv)
            else:
                qkv = ops.project(x, self.wqkv, layout.row_products)
                if self.bqkv is not None:
                    qkv = qkv.add_(self.bqkv)  # the product's own fresh output: no copy of a prompt's rows
            if rope is None:
                q = qkv[..., :q_width].view(batch, seq, self.n_heads, self.head_dim)
                k = qkv[..., q_width:q_width + kv_width].view(batch, seq, self.n_kv_heads, self.head_dim)
            elif self.q_norm is None:
                # Queries and keys side by side are rotated by one call: half the kernels.
                qk = qkv[..., :q_width + kv_width].view(batch, seq, self.n_heads + self.n_kv_heads, self.head_dim)
                q, k = ops.apply_rope(qk, rope).split([self.n_heads, self.n_kv_heads], dim=2)
            else:
                q = self.q_norm(qkv[..., :q_width].view(batch, seq, self.n_heads, self.head_dim))
                k = self.k_norm(qkv[..., q_width:q_width + kv_width].view(batch, seq, self.n_kv_heads, self.head_dim))
                q, k = ops.apply_rope(q, rope), ops.apply_rope(k, rope)
            v = qkv[..., q_width + kv_width:].view(batch, seq, self.n_kv_heads, self.head_dim)
        else:
            q, k, v = (ops.project(x, w, layout.row_products) for w in (self.wq, self.wk, self.wv))
            if self.bq is not None:
                q, k, v = q + self.bq, k + self.bk, v + self.bv
            q = q.view(batch, seq, self.n_heads, self.head_dim)
            k = k.view(batch, seq, self.n_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = ops.apply_rope(q, rope), ops.apply_rope(k, rope)
            v = v.view(batch, seq, self.n_kv_heads, self.head_dim)
        out = layout.attend(layer, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.rule)
        return self._output(out.transpose(1, 2).reshape(batch, seq, -1), layout)

    def _output(self, heads: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        if self.bo is not None:
            return ops.biased_project(heads, self.wo, self.bo)
        return ops.project(heads, self.wo, layout.row_products)


class FeedForward(nn.Module):
    """A gated feed-forward: ``w2(act(w1 x) * w3 x)``, SwiGLU (``silu``) or GeGLU (``gelu_tanh``);
    or, not ``gated``, BERT's ``w2(gelu(w1 x + b1)) + b2`` (``biases``)."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu", *, gated: bool = True,
                 biases: bool = False) -> None:
        super().__init__()
        self.activation = activation
        self.gated = gated
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        if gated:
            self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w13: nn.Linear | None = None
        self.b1 = nn.Parameter(torch.zeros(hidden_dim)) if biases and not gated else None
        self.b2 = nn.Parameter(torch.zeros(dim)) if biases and not gated else None

    def fuse(self) -> None:
        if self.w13 is None and self.gated:
            self.w13 = _fused_linear(self.w1, self.w3)
            del self.w1, self.w3

    def forward(self, x: torch.Tensor, row_products: bool = False) -> torch.Tensor:
        if not self.gated:  # BERT's: the biases (and an exact GELU) in the products
            if self.activation == "gelu":
                hidden = ops.biased_project(x, self.w1, self.b1, "gelu")
            else:
                hidden = ops.activated(ops.biased_project(x, self.w1, self.b1), self.activation)
            return ops.biased_project(hidden, self.w2, self.b2)
        if self.w13 is not None:
            hidden = ops.gated(ops.project(x, self.w13, row_products), self.activation)
        else:
            gate, up = ops.project(x, self.w1, row_products), ops.project(x, self.w3, row_products)
            # The product in place and the gate and up rows let go before the last projection: a
            # prompt's widest moment in a layer holds three hidden rows a token rather than four.
            hidden = ops.activated(gate, self.activation).mul_(up)
            del gate, up
        return ops.project(hidden, self.w2, row_products)


def _fused_linear(*parts: nn.Module) -> nn.Module:
    """One bias-free linear layer whose output is the outputs of ``parts`` side by side."""
    if all(isinstance(p, quantize.Int8Linear) for p in parts):
        return quantize.fused(list(parts))
    if all(isinstance(p, packed.PACKED_LAYERS) for p in parts):
        fused = packed.fuse(list(parts))
        for part in parts:  # a file's blocks, now copied: their pages are not read again
            release_pages(part.data)
        return fused
    if all(isinstance(p, half.HalfLinear) and p.weight.dtype == parts[0].weight.dtype for p in parts):
        fused = half.fuse(list(parts))
        for part in parts:  # as for blocks: a file's 16-bit weights, now copied
            release_pages(part.weight)
        return fused
    weight = torch.cat([p.weight.detach() for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int = 0) -> None:
        super().__init__()
        self.attention = Attention(args, layer)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim, args.activation, gated=args.gated_ffn,
                                        biases=args.linear_biases)
        # Before each sublayer (pre-LN); after its sum with the residual where ``norm_after_residual``.
        self.attention_norm = norm_of(args)
        self.ffn_norm = norm_of(args)
        self.norm_after_residual = args.norm_after_residual
        # Gemma's norms of each sublayer's output, before it joins the residual.
        self.attention_post_norm = RMSNorm(args.dim, args.norm_eps) if args.post_norms else None
        self.ffn_post_norm = RMSNorm(args.dim, args.norm_eps) if args.post_norms else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: AttentionLayout,
                layer: int) -> torch.Tensor:
        if self.norm_after_residual:  # BERT's post-LN; the sublayers' outputs are fresh: summed in place
            h = self.attention_norm(self.attention(x, rope, layout, layer).add_(x))
            return self.ffn_norm(self.feed_forward(h, layout.row_products).add_(h))
        # The sublayers' outputs are fresh here too: the residual is added into them in place.
        out = self.attention(self.attention_norm(x), rope, layout, layer)
        h = (out if self.attention_post_norm is None else self.attention_post_norm(out)).add_(x)
        out = self.feed_forward(self.ffn_norm(h), layout.row_products)
        return (out if self.ffn_post_norm is None else self.ffn_post_norm(out)).add_(h)


class Transformer(nn.Module):
    """Token ids and their positions in, float32 logits out; nothing here knows about generation."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # BERT's learned positions, token types and the norm of their sum with the token's embedding.
        self.pos_embeddings = nn.Embedding(args.position_table, args.dim) if args.position_table else None
        self.type_embeddings = nn.Embedding(args.type_vocab_size, args.dim) if args.type_vocab_size else None
        self.embedding_norm = norm_of(args) if args.norm_after_residual else None
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = None if args.norm_after_residual else norm_of(args)
        self.output = None if args.encoder or args.pooled else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.pooler = nn.Linear(args.dim, args.dim) if args.labels else None
        self.classifier = nn.Linear(args.dim, args.labels) if args.labels else None
        self.tie_weights()
        # The rotary table stays float32 whatever the weights' dtype, so it is kept out of the
        # module's buffers (which .to(dtype) would cast) and built once per device.
        self._rope: dict[tuple[torch.device, bool], torch.Tensor] = {}

    def tie_weights(self) -> None:
        """Share the embedding with the output projection when the checkpoint ties them.

        Called again after loading with ``assign=True``, which replaces the parameters, and after
        a packed classifier's blocks move (``cpu_decode``'s large pages): the lookups then read the
        moved blocks, where the file's would be paged in again beside them, the table resident twice.
        A classifier that is its own copy (quantized at load) stays apart.
        """
        if not self.args.tie_embeddings:
            return
        embedding, output = self.tok_embeddings, self.output
        if isinstance(embedding, packed.PackedEmbedding):
            if (isinstance(output, packed.PackedLinear) and output.kind == embedding.kind
                    and output.data.shape == embedding.data.shape):
                embedding.data = output.data
        elif type(output) is nn.Linear:
            output.weight = embedding.weight

    def fuse_projections(self) -> None:
        """Concatenate q/k/v and the two SwiGLU input projections, layer by layer, in place.

        Decoding one token is a row-vector times every weight matrix; three small products read
        no faster than one of their combined size but cost three kernels, so a decode step on a
        GPU launches fewer kernels. Parameter names change (``wqkv``, ``w13``), so this
        runs after loading, and the separate weights are freed layer by layer as it goes.
        """
        for layer in self.layers:
            layer.attention.fuse()
            layer.feed_forward.fuse()

    def rope_table(self, device: torch.device, local: bool = False) -> torch.Tensor:
        """The rotary table; ``local``: the windowed layers' own (``ModelArgs.local_rope``)."""
        table = self._rope.get((device, local))
        if table is None:
            a = self.args
            if local:
                table = ops.rope_table(a.head_dim, a.max_seq_len, a.local_rope_theta)
            else:
                table = ops.rope_table(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)
            table = self._rope[(device, local)] = table.to(device)
        return table

    def rope_tables(self, device: torch.device) -> None:
        """Build every rotary table the forward reads (a compiled step must find them made)."""
        self.rope_table(device)
        if self.args.local_rope_theta is not None:
            self.rope_table(device, local=True)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random weights (normal, ``std``; norms at one), for tests and training from scratch."""
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):  # also q_norm/k_norm
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None, cache: Cache | None = None, *,
                last_only: bool = False, logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """``tokens`` and ``positions`` are ``(batch, seq)``; returns ``(batch, seq or 1, vocab)``.

        The cache's type picks how attention runs (``cache.layout``). Without a cache the tokens
        attend causally among themselves (training, scoring). Over a ``KVCache`` each row's keys
        are written at its positions and it attends to everything it has stored up to its own
        position. Over a ``WholeCache`` a row attends over every slot, masked: no host sync and
        the same shapes at every position, for a compiled step. A ``PagedView``
        (``model/paged_kv_cache.py``) takes one row of packed sequences; ``logits_at`` then picks
        the tokens whose logits are wanted: ``(1, len(logits_at), vocab)``. ``last_only`` projects
        only the last token of each row.
        """
        batch, seq = tokens.shape
        device = tokens.device
        if positions is None:
            positions = torch.arange(seq, device=device).unsqueeze(0).expand(batch, seq)
        layout = OwnTokens(positions) if cache is None else cache.layout(positions)
        rows, last = self._pieces(layout, seq, device, last_only, logits_at)
        if rows is not None:
            # The earlier pieces leave only their keys and values in the cache.
            for start in range(0, last, rows):
                self._hidden(tokens[:, start:start + rows], positions[:, start:start + rows],
                             layout.piece(start, start + rows))
            tokens, positions, layout = tokens[:, last:], positions[:, last:], layout.piece(last, seq)
            if logits_at is not None:
                logits_at = logits_at - last
        h = self._hidden(tokens, positions, layout)
        if last_only:
            h = h[:, -1:, :]
        elif logits_at is not None:
            h = h[:, logits_at, :]
        logits = ops.project(self.norm(h), self.output, layout.row_products).float()
        cap = self.args.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def encode(self, tokens: torch.Tensor, lengths: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        """The last hidden states (after the final norm, where the family has one) of right-padded
        rows: ``tokens`` ``(batch, seq)``, each row's first ``lengths[i]`` tokens its own.

        An encoder's tokens see every token of their row and none of the padding; a decoder's see
        their past, which right padding never enters. ``types``: BERT's token types (0 where None).
        """
        batch, seq = tokens.shape
        positions = torch.arange(seq, device=tokens.device).unsqueeze(0).expand(batch, seq)
        visible = (positions < lengths.view(batch, 1)).view(batch, 1, 1, seq) if self.args.encoder else None
        h = self._hidden(tokens, positions, OwnTokens(positions, visible), types)
        return h if self.norm is None else self.norm(h)

    @torch.no_grad()
    def classify(self, tokens: torch.Tensor, lengths: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
        """An encoder's float32 scores ``(batch, labels)`` of right-padded rows (as ``encode``):
        BERT's sequence classification, from the first token's state through the pooler's
        ``tanh`` and the classifier."""
        first = self.encode(tokens, lengths, types)[:, 0]
        return self.classifier(torch.tanh(self.pooler(first))).float()

    @torch.no_grad()
    def last_states(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Each right-padded row's state at its last token (as ``encode``), ``(batch, dim)``."""
        hidden = self.encode(tokens, lengths)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]

    @torch.no_grad()
    def answer_logits(self, tokens: torch.Tensor, lengths: torch.Tensor, ids: list[int]) -> torch.Tensor:
        """A decoder's float32 logits of the tokens ``ids`` after each right-padded row (as
        ``encode``) ``(batch, len(ids))``: a reranker scored on its answer (Qwen3-Reranker)."""
        return ops.project(self.last_states(tokens, lengths), self.output).float()[:, ids]

    def _hidden(self, tokens: torch.Tensor, positions: torch.Tensor, layout: AttentionLayout,
                types: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's output for ``tokens``, their keys and values written where ``layout`` keeps them."""
        h = self.tok_embeddings(tokens)
        a = self.args
        if a.embedding_scale:  # Gemma: sqrt(dim) rounded to the activations' dtype, as its own code does
            h = h * torch.tensor(a.dim ** 0.5, dtype=h.dtype)
        if self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions)
        if self.type_embeddings is not None:
            h = h + self.type_embeddings(torch.zeros_like(tokens) if types is None else types)
        if self.embedding_norm is not None:
            h = self.embedding_norm(h)
        rope = local = None
        if not a.position_table:
            rope = ops.rope_at(self.rope_table(tokens.device), positions)
            local = ops.rope_at(self.rope_table(tokens.device, local=True), positions) \
                if a.local_rope_theta is not None else rope
        for i, layer in enumerate(self.layers):
            layout.between_layers()
            h = layer(h, local if a.local_rope(i) else rope, layout, i)
        return h

    def rows_per_forward(self) -> int:
        """The most tokens of a run that one pass over the layers takes on the CPU (``forward``).

        A prompt's activations in a layer do not grow with the weights: a small model's long
        chunk would hold more of them, and of the C heap's free pieces they leave, than its whole
        file's share of the memory rule allows (docs/benchmarks.md, "Packed blocks"). A pass holds
        ``PROMPT_MEMORY_SHARE`` of the weights' bytes at most, in float32 rows of the widest moment
        of a layer (the residual, its norm and the feed-forward's three hidden rows), and never
        fewer than ``FEWEST_PIECE_ROWS`` tokens: every pass reads all the weights.
        """
        weights = sum(t.numel() * t.element_size() for t in (*self.parameters(), *self.buffers()))
        per_token = 4 * (3 * self.args.dim + 3 * self.args.hidden_dim)
        fit = int(weights * PROMPT_MEMORY_SHARE) // per_token // PIECE_STEP * PIECE_STEP
        return max(FEWEST_PIECE_ROWS, fit)

    def _pieces(self, layout: AttentionLayout, seq: int, device: torch.device, last_only: bool,
                logits_at: torch.Tensor | None) -> tuple[int | None, int]:
        """Tokens per pass and the last piece's first token when a run of ``seq`` over a CPU cache
        goes in pieces, else ``(None, 0)``: a dense cache's rows of one run, or a page pool's step
        of one sequence's run (a prompt's chunk), whose wanted logits are all in the last piece."""
        if device.type != "cpu" or seq <= FEWEST_PIECE_ROWS or not (last_only or logits_at is not None):
            return None, 0  # a GPU (the rule is the host's), short, or every token's logits wanted
        if not isinstance(layout, (DenseLayout, PagedView)) or not layout.one_run:
            return None, 0  # no cache, a static step, rows at positions of their own
        most = self.rows_per_forward()
        if seq <= most:
            return None, 0
        pieces = -(-seq // most)
        rows = min(most, -(-seq // pieces) + PIECE_STEP - 1) // PIECE_STEP * PIECE_STEP
        last = (seq - 1) // rows * rows
        if not last_only and logits_at.numel() and int(logits_at.min()) < last:
            return None, 0
        return rows, last
