"""Write GGUF files from Hugging Face checkpoints the way llama.cpp's converter does, with the
``gguf`` package's writer, so the reader under test meets what real files hold:

* tensor names ``token_embd``, ``blk.N.attn_q`` ...; q/k rows permuted from Hugging Face's
  rotate-half order back to Meta's interleaved order (the converter's ``permute``); norms F32;
* Llama 3.1 rope scaling stored as a ``rope_freqs`` tensor of per-frequency factors;
* a SentencePiece vocabulary as pieces, scores and piece types (``tokenizer.ggml.model = llama``),
  a tiktoken vocabulary as byte-level tokens plus merges derived from the ranks
  (``tokenizer.ggml.model = gpt2``, ``pre = llama-bpe``) with Llama 3's control tokens after it,
  or a ``tokenizers`` byte-level BPE with its merges under any ``pre`` name;
* weights as F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 (the ``gguf`` package's own
  quantizers) or Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS (simple round-to-nearest quantizers
  below: the package only dequantizes those; the bytes they write are read back by the package's
  dequantizer in the tests, so the layout is checked independently).
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch

import gguf
from gguf.quants import quantize

from builders import separate_greedy_choices

from llama_chat.model.tokenizers.hf import byte_level_decoder
from llama_chat.model.tokenizers.tiktoken import llama3_special_tokens

T = gguf.GGMLQuantizationType

_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}


def converter_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: rotate-half q/k rows to interleaved pairs, per head."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}"


def llama3_rope_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """The converter's ``rope_freqs``: 1 for short wavelengths, ``factor`` for long, blended between."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


# -- quantizers ----------------------------------------------------------------------------------


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins per block into the 12-byte layout Q4_K/Q5_K use."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _k_affine(x: np.ndarray, levels: int, subs: int = 8, scale_levels: int = 63) -> tuple[np.ndarray, ...]:
    """Per sub-block min/scale, then super-block scales of ``scale_levels`` (not llama.cpp's search)."""
    n = x.shape[0]
    sub = x.reshape(n, subs, -1)
    lo = np.minimum(sub.min(-1), 0)
    scale = (sub.max(-1) - lo) / levels
    d = scale.max(-1, keepdims=True) / scale_levels
    dmin = (-lo).max(-1, keepdims=True) / scale_levels
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d16, out=np.zeros_like(scale), where=d16 > 0)), 0, scale_levels)
    mn = np.clip(np.round(np.divide(-lo, dmin16, out=np.zeros_like(lo), where=dmin16 > 0)), 0, scale_levels)
    step = (d16 * sc)[..., None]
    q = np.clip(np.round(np.divide(sub + (dmin16 * mn)[..., None], step, out=np.zeros_like(sub), where=step > 0)),
                0, levels).astype(np.uint8)
    return d16, dmin16, sc, mn, q


def _nibble_pack(q: np.ndarray) -> np.ndarray:
    """(blocks, 8, 32) values 0-15 into 128 bytes: sub-block 2g in the low, 2g+1 in the high nibbles."""
    q = q.reshape(q.shape[0], 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(x.reshape(-1, 256), 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), _nibble_pack(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(x.reshape(-1, 256), 31)
    qh = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for j in range(8):
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn), qh, _nibble_pack(q & 0x0F)],
                          axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    n = x.reshape(-1, 256).shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), -128, 127)
    step = (d * sc)[..., None]
    q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)), -32, 31)
    v = (q + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = ((v[:, :, 0:64] & 0x0F) | ((v[:, :, 64:128] & 0x0F) << 4)).reshape(n, 128)
    qh = np.zeros((n, 2, 32), dtype=np.uint8)
    for k in range(4):
        qh |= (v[:, :, 32 * k:32 * k + 32] >> 4) << (2 * k)
    return np.concatenate([ql, qh.reshape(n, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)


def _crumb_pack(q: np.ndarray) -> np.ndarray:
    """(blocks, 256) values 0-3 into 64 bytes: bits 2j..2j+1 of byte 32h + l hold value 128h + 32j + l."""
    q = q.reshape(q.shape[0], 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(q.shape[0], 64)


def quantize_q2_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, mn, q = _k_affine(x.reshape(-1, 256), 3, subs=16, scale_levels=15)
    scales = sc.astype(np.uint8) | (mn.astype(np.uint8) << 4)
    return np.concatenate([scales, _crumb_pack(q.reshape(-1, 256)), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """Symmetric: q in -4..3 per 16 values, stored as q + 4 (low 2 bits, then a high bit)."""
    n = x.reshape(-1, 256).shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 4
    d = (scale.max(-1, keepdims=True) / 31).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), 0, 31)
    step = (d * sc)[..., None]
    q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step > 0)), -4, 3)
    v = (q + 4).astype(np.uint8).reshape(n, 256)
    hmask = np.zeros((n, 32), dtype=np.uint8)
    for i in range(8):
        hmask |= (v[:, 32 * i:32 * i + 32] >> 2) << i
    s6 = (sc + 32).astype(np.uint8)  # 6-bit, offset by 32
    scales = np.zeros((n, 12), dtype=np.uint8)
    scales[:, 0:8] = (s6[:, 0:8] & 0x0F) | ((s6[:, 8:16] & 0x0F) << 4)
    for j in range(4):
        scales[:, 8:12] |= (s6[:, 4 * j:4 * j + 4] >> 4) << (2 * j)
    return np.concatenate([hmask, _crumb_pack(v & 3), scales, _f16_bytes(d)], axis=1)


IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def _iq4_index(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """The nearest IQ4 level of each ``x / step``."""
    scaled = np.divide(x, step, out=np.zeros_like(x), where=step != 0)
    return np.abs(scaled[..., None] - IQ4_LEVELS).argmin(-1).astype(np.uint8)


def _signed_peak(sub: np.ndarray) -> np.ndarray:
    """Each row's value of largest magnitude, over -127: the scale that makes it the level -127."""
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    return peak / -127


def quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 32)
    d = _signed_peak(blocks).astype(np.float16).astype(np.float32)[:, None]
    q = _iq4_index(blocks, d)
    return np.concatenate([_f16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], axis=1)


def quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    n = x.reshape(-1, 256).shape[0]
    sub = x.reshape(n, 8, 32)
    local = _signed_peak(sub)
    d = (np.abs(local).max(-1, keepdims=True) / 31).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(local, d, out=np.zeros_like(local), where=d > 0)), -32, 31)
    q = _iq4_index(sub, (d * sc)[..., None])
    s6 = (sc + 32).astype(np.uint16)
    scales_h = np.zeros((n, 1), dtype=np.uint16)
    for i in range(8):
        scales_h[:, 0] |= (s6[:, i] >> 4) << (2 * i)
    s6 = s6.astype(np.uint8)
    scales_l = (s6[:, 0::2] & 0x0F) | ((s6[:, 1::2] & 0x0F) << 4)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, 128)
    return np.concatenate([_f16_bytes(d), scales_h.view(np.uint8), scales_l, qs], axis=1)


_OWN_QUANTIZERS = {T.Q2_K: quantize_q2_k, T.Q3_K: quantize_q3_k, T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k,
                   T.Q6_K: quantize_q6_k, T.IQ4_NL: quantize_iq4_nl, T.IQ4_XS: quantize_iq4_xs}


def encode_tensor(x: np.ndarray, qtype: T) -> np.ndarray:
    """``x`` (float32, rows last) in ``qtype``: the array GGUFWriter.add_tensor takes with raw_dtype."""
    if qtype == T.F32:
        return x.astype(np.float32)
    if qtype == T.F16:
        return x.astype(np.float16)
    if qtype in _OWN_QUANTIZERS:
        rows = x.shape[0]
        return _OWN_QUANTIZERS[qtype](x).reshape(rows, -1)
    return quantize(x.astype(np.float32), qtype)


# -- vocabularies --------------------------------------------------------------------------------


def add_sentencepiece_vocab(writer: gguf.GGUFWriter, sp_model: Path, n_vocab: int) -> None:
    """Pieces, scores and types as the converter reads them from ``tokenizer.model``; ``[PADn]``
    pieces of type unused fill the vocabulary up to the embedding's rows."""
    from llama_chat.model.tokenizers.sentencepiece import parse_model_proto

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    # User-defined pieces: the converter marks the tokenizer's added tokens as such.
    piece_types = parse_model_proto(sp_model.read_bytes()).piece_types
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores = [-10000.0] * n_vocab
    types = [gguf.TokenType.UNUSED] * n_vocab
    for i in range(sp.vocab_size()):
        tokens[i] = sp.id_to_piece(i)
        scores[i] = sp.get_score(i)
        if sp.is_unknown(i):
            types[i] = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            types[i] = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            types[i] = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            types[i] = gguf.TokenType.BYTE
        elif piece_types[i] == gguf.TokenType.USER_DEFINED:
            types[i] = gguf.TokenType.USER_DEFINED
        else:
            types[i] = gguf.TokenType.NORMAL
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_add_bos_token(True)


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of each multi-byte token into two tokens, ordered by the merged token's rank
    (then by the parts' ranks): how a tiktoken vocabulary becomes a ranked merge list."""
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def add_tiktoken_vocab(writer: gguf.GGUFWriter, rank_file: Path, n_vocab: int) -> None:
    """A Llama 3 style vocabulary: ranks as byte-level tokens, merges, then the 256 control tokens."""
    ranks = {}
    for line in rank_file.read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    to_unicode = {b: c for c, b in byte_level_decoder().items()}

    def spell(b: bytes) -> str:
        return "".join(to_unicode[x] for x in b)

    specials = llama3_special_tokens(len(ranks))
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for token, rank in ranks.items():
        tokens[rank], types[rank] = spell(token), gguf.TokenType.NORMAL
    for name, i in specials.items():
        tokens[i], types[i] = name, gguf.TokenType.CONTROL
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{spell(a)} {spell(b)}" for a, b in merges_from_ranks(ranks)])
    writer.add_bos_token_id(specials["<|begin_of_text|>"])
    writer.add_eos_token_id(specials["<|eot_id|>"])
    writer.add_add_bos_token(True)


def add_bpe_vocab(writer: gguf.GGUFWriter, tokenizer, pre: str, *, n_vocab: int | None = None,
                  bos: str | None = None, eos: str | None = None, unk: str | None = None,
                  pad: str | None = None, add_bos: bool | None = None, add_eos: bool | None = None) -> None:
    """A ``tokenizers`` byte-level BPE as the converter writes it (``_set_vocab_gpt2``): every id's
    token, added special tokens as control and other added tokens as user-defined (their text, not
    GPT-2's spelling of it), ``[PADn]`` up to ``n_vocab``, the merges in rank order, the special
    ids by name and the add_bos/add_eos flags only when given."""
    spec = json.loads(tokenizer.to_str())
    added = {t["id"]: t for t in spec["added_tokens"]}
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    by_id = {i: token for token, i in vocab.items()}
    n = n_vocab or len(by_id)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for i, token in by_id.items():
        tokens[i] = token
        if i in added:
            types[i] = gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED
        else:
            types[i] = gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, add in ((bos, writer.add_bos_token_id), (eos, writer.add_eos_token_id),
                      (unk, writer.add_unk_token_id), (pad, writer.add_pad_token_id)):
        if name is not None:
            add(vocab[name])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if add_eos is not None:
        writer.add_add_eos_token(add_eos)


def write_vocab_gguf(path: Path, tokenizer, pre: str, **specials) -> Path:
    """A GGUF holding only a byte-level vocabulary (``add_bpe_vocab``), as llama.cpp's test vocabularies are."""
    writer = gguf.GGUFWriter(str(path), "llama")
    add_bpe_vocab(writer, tokenizer, pre, **specials)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# -- Hugging Face reference models ---------------------------------------------------------------

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def hf_llama(vocab: int, *, heads: int, kv_heads: int, tied: bool, rope: dict, seed: int, dim: int = 256,
             context: int = 2048):
    """A random 2-layer ``transformers.LlamaForCausalLM`` (ffn 512) that greedy decoding separates well."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=512, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=kv_heads, rms_norm_eps=1e-5, max_position_embeddings=context,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, rope_parameters=rope,
    )
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config)
    # Scaled by the inputs, so that activations stay near one through the layers.
    separate_greedy_choices(hf, seed, lambda p: 1.5 / p.shape[-1] ** 0.5)
    return hf.eval()


def hf_config(hf) -> dict:
    """``hf``'s ``config.json`` as a dict, with the rope parameters ``write_gguf`` reads."""
    config = json.loads(hf.config.to_json_string())
    config.setdefault("rope_parameters", DEFAULT_ROPE)
    return config


def hf_with_file_weights(hf, path: Path):
    """A copy of ``hf`` holding the weights the ``gguf`` package's own reader and numpy dequantizer
    take from ``path`` (q/k rows back in Hugging Face's order): the reference for a quantized file."""
    import transformers

    config = hf.config
    copy = transformers.LlamaForCausalLM(config).eval()
    by_name = {t.name: t for t in gguf.GGUFReader(path).tensors}
    state = {}
    for hf_name in hf.state_dict():
        t = by_name[gguf_name(hf_name)]
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(tuple(reversed([int(d) for d in t.shape])))
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for key, n in heads.items():
            if f"{key}.weight" in hf_name:
                w = inverse_permute(w, n)
        state[hf_name] = w
    copy.load_state_dict(state)
    return copy


def inverse_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    out = w.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(converter_permute(out, n_heads), w)
    return out


# -- the file ------------------------------------------------------------------------------------


def write_gguf(path: Path, hf_state: dict[str, torch.Tensor], config: dict, *, qtype: T = T.F32,
               sp_model: Path | None = None, tiktoken_file: Path | None = None,
               bpe: dict | None = None, chat_template: str | None = None, name: str = "tiny",
               qtype_for: dict[str, T] | None = None) -> Path:
    """A llama GGUF from a Hugging Face state dict and its ``config.json`` dict.

    The vocabulary: a SentencePiece model, a tiktoken rank file, or ``bpe``, the arguments of
    ``add_bpe_vocab`` (a ``tokenizers`` BPE, its ``pre`` name and its special tokens).

    Every 2-D weight is written as ``qtype`` (or as ``qtype_for[hf_name]``, for mixed files like
    llama.cpp's Q4_K_M); norms (and ``rope_freqs``) as F32, as the converter does.
    """
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    dim = config["hidden_size"]
    head_dim = dim // n_heads
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 1e4)}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(dim)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type({T.F32: 0, T.F16: 1, T.BF16: 32}.get(qtype, 7))  # llama_ftype: MOSTLY_BF16 is 32
    if sp_model is not None:
        add_sentencepiece_vocab(writer, sp_model, config["vocab_size"])
    if tiktoken_file is not None:
        add_tiktoken_vocab(writer, tiktoken_file, config["vocab_size"])
    if bpe is not None:
        add_bpe_vocab(writer, **bpe, n_vocab=config["vocab_size"])
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope["rope_theta"], rope))
    for hf_name, tensor in hf_state.items():
        if "rotary_emb" in hf_name or (hf_name == "lm_head.weight" and config.get("tie_word_embeddings")):
            continue  # a tied output is the embedding: the file has no output.weight
        w = tensor.detach().float()
        if hf_name.endswith("q_proj.weight"):
            w = converter_permute(w, n_heads)
        elif hf_name.endswith("k_proj.weight"):
            w = converter_permute(w, n_kv)
        x = w.numpy()
        if x.ndim == 1:
            writer.add_tensor(gguf_name(hf_name), x.astype(np.float32))
            continue
        kind = (qtype_for or {}).get(hf_name, qtype)
        data = quantize(x, T.BF16) if kind == T.BF16 else encode_tensor(x, kind)
        writer.add_tensor(gguf_name(hf_name), data, raw_dtype=None if kind in (T.F32, T.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
