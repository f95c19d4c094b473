"""llama2.c ``.bin`` checkpoints: a small header, then every weight as raw float32.

Two headers exist. Version 0 (the original ``run.c`` format) is seven int32s: dim, hidden_dim,
n_layers, n_heads, n_kv_heads, vocab_size (negative when the classifier is not shared with the
embedding), seq_len. Version 1 starts with the magic ``"ak42"`` (0x616b3432), a version int32,
the same seven int32s, one byte for the shared classifier, zero padding to 256 bytes. The two
differ in the order of the weights that follow (see ``_order``). llama2.c trains with Meta's
interleaved rotary embedding, so the weights are used as they are.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import torch

from llama_chat.model.args import ModelArgs
from llama_chat.model.formats.common import Checkpoint, parameter_count
from llama_chat.model.errors import ModelLoadError

MAGIC = 0x616B3432
_V0_HEADER = struct.Struct("<7i")
_V1_HEADER = struct.Struct("<Ii7iB")
_V1_HEADER_BYTES = 256


def sniff(path: Path) -> int | None:
    """The llama2.c format version of ``path`` (0 or 1), or None when it does not look like one.

    Version 0 has no magic, so its seven integers must be plausible as an architecture.
    """
    try:
        with path.open("rb") as f:
            head = f.read(_V1_HEADER.size)
    except OSError:
        return None
    if len(head) >= 8 and struct.unpack_from("<I", head)[0] == MAGIC:
        return struct.unpack_from("<i", head, 4)[0]
    if len(head) < _V0_HEADER.size:
        return None
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = _V0_HEADER.unpack_from(head)
    plausible = (
        0 < dim <= 1 << 16 and 0 < hidden <= 1 << 18 and 0 < layers <= 1024 and 0 < heads <= dim
        and 0 < kv_heads <= heads and 0 < abs(vocab) <= 1 << 22 and 0 < seq_len <= 1 << 24
        and dim % heads == 0
    )
    return 0 if plausible else None


def read_llama2c(path: Path) -> Checkpoint:
    """Memory-map ``path`` and view each weight in place; nothing is copied."""
    version = sniff(path)
    if version is None:
        raise ModelLoadError(f"{path.name}: not a llama2.c checkpoint (no 'ak42' magic and no plausible header)")
    if version not in (0, 1):
        raise ModelLoadError(f"{path.name}: llama2.c format version {version} is not supported (only 0 and 1)")
    with path.open("rb") as f:
        head = f.read(_V1_HEADER_BYTES)
    if version == 0:
        dim, hidden, layers, heads, kv_heads, vocab, seq_len = _V0_HEADER.unpack_from(head)
        shared = vocab > 0
        vocab = abs(vocab)
        offset = _V0_HEADER.size
    else:
        if len(head) < _V1_HEADER_BYTES:
            raise ModelLoadError(f"{path.name}: truncated header: {len(head)} of {_V1_HEADER_BYTES} bytes")
        _, _, dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared_byte = _V1_HEADER.unpack_from(head)
        shared = bool(shared_byte)
        offset = _V1_HEADER_BYTES
    try:
        args = ModelArgs.from_llama2c_header(dim, hidden, layers, heads, kv_heads, vocab, seq_len, shared)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path.name}: bad header ({e})") from None

    # The header's sizes are checked against the file's by arithmetic first: listing every
    # layer's weights for a header that claims 2**31-1 layers would exhaust memory.
    rope_floats = args.max_seq_len * args.head_dim if version == 0 else 0
    want_bytes = offset + 4 * (parameter_count(args) + rope_floats)
    size = path.stat().st_size
    if size < want_bytes:
        raise ModelLoadError(
            f"{path.name}: truncated: expected {want_bytes} bytes for its header's model, found {size}"
        )
    if size > want_bytes:
        raise ModelLoadError(
            f"{path.name}: {size - want_bytes} bytes past the last weight; the header does not match the data"
        )

    order = _order(args, version)
    assert offset + 4 * sum(n for _, n, _ in order) == want_bytes
    # One private mapping of the whole file as float32 (both header sizes are multiples of 4);
    # every weight is a view into it, so pages are read only when a weight is first used.
    data = torch.from_file(str(path), shared=False, size=size // 4, dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    pos = offset // 4
    for name, numel, shape in order:
        if name is not None:
            state[name] = data[pos:pos + numel].view(shape)
        pos += numel
    return Checkpoint(args=args, state=state, origin={k: path.name for k in state}, files=(path,))


def _order(args: ModelArgs, version: int) -> list[tuple[str | None, int, tuple[int, ...]]]:
    """(Meta name or None for skipped data, element count, shape) in file order.

    Both versions group each kind of weight across all layers. Version 0 keeps the norms next to
    their layers' weights and stores the old precomputed rotary table (cos, then sin, each
    ``seq_len * head_dim / 2``) after the final norm; version 1 puts all norms first and drops the
    table. An unshared classifier comes last in both.
    """
    a = args
    kv_dim = a.n_kv_heads * a.head_dim

    def per_layer(suffix: str, shape: tuple[int, ...]) -> list[tuple[str | None, int, tuple[int, ...]]]:
        return [(f"layers.{i}.{suffix}", math.prod(shape), shape) for i in range(a.n_layers)]

    def one(name: str | None, shape: tuple[int, ...]) -> list[tuple[str | None, int, tuple[int, ...]]]:
        return [(name, math.prod(shape), shape)]

    emb = one("tok_embeddings.weight", (a.vocab_size, a.dim))
    att_norm = per_layer("attention_norm.weight", (a.dim,))
    ffn_norm = per_layer("ffn_norm.weight", (a.dim,))
    final_norm = one("norm.weight", (a.dim,))
    attention = (per_layer("attention.wq.weight", (a.n_heads * a.head_dim, a.dim))
                 + per_layer("attention.wk.weight", (kv_dim, a.dim))
                 + per_layer("attention.wv.weight", (kv_dim, a.dim))
                 + per_layer("attention.wo.weight", (a.dim, a.n_heads * a.head_dim)))
    ffn = (per_layer("feed_forward.w1.weight", (a.hidden_dim, a.dim))
           + per_layer("feed_forward.w2.weight", (a.dim, a.hidden_dim))
           + per_layer("feed_forward.w3.weight", (a.hidden_dim, a.dim)))
    if version == 0:
        rope_half = a.max_seq_len * a.head_dim // 2
        order = (emb + att_norm + attention + ffn_norm + ffn + final_norm
                 + one(None, (rope_half,)) + one(None, (rope_half,)))
    else:
        order = att_norm + ffn_norm + final_norm + emb + attention + ffn
    if not a.tie_embeddings:
        order += one("output.weight", (a.vocab_size, a.dim))
    return order
