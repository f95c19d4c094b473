"""Tiny random models of each family, from ``transformers``, and their GGUF files written as
llama.cpp's ``convert_hf_to_gguf.py`` writes them.

What the converter does per family, as these writers do it (learned from llama.cpp's converter
and ``llama-model.cpp``): ``qwen2``/``qwen3``/``gemma2``/``gemma3``/``phi3`` files keep Hugging
Face's q/k row order (llama.cpp rotates them NEOX-style; only ``llama`` files are permuted);
Gemma's norms are stored as ``1 + w``; Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` stay fused
(``attn_qkv``, ``ffn_up``) and its LongRoPE factors are two F32 tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from builders import separate_greedy_choices
from builders_gguf import T, add_sentencepiece_vocab, encode_tensor, quantize

# Per family: the transformers classes (by name: importing them all costs every test worker a
# second at collection), the config beyond the shared one, and the GGUF architecture.
WINDOW = 16  # shorter than the tests' prompts, so the windows bite
SPECS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(sliding_window=WINDOW, head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=6, head_dim=32, sliding_window=WINDOW,  # five windowed layers, then a global one
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        max_position_embeddings=128, original_max_position_embeddings=32, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                         "factor": 4.0,
                         "short_factor": [1.0 + 0.1 * i for i in range(8)],
                         "long_factor": [1.0 + 0.5 * i for i in range(8)]})),
}
FAMILY_NAMES = tuple(SPECS)
ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "gemma2": "gemma2", "gemma3": "gemma3",
        "phi3": "phi3"}


def hf_family_model(family: str, vocab: int, seed: int = 0, **overrides):
    """A random 2-layer (Gemma 3: 6) model of ``family`` whose greedy choices are well apart."""
    import transformers

    config_name, model_name, extra = SPECS[family]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    fields = dict(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2)
    fields.update(extra)
    fields.update(overrides)
    config = config_class(**fields)
    if family.startswith("gemma"):
        config._attn_implementation = "eager"  # the soft cap is the eager kernel's alone
    torch.manual_seed(seed)
    hf = model_class(config)
    separate_greedy_choices(hf, seed, lambda p: 0.2)
    return hf.eval()


def _converter_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
    "input_layernorm.weight": "attn_norm.weight",
}
_GEMMA_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}


def _tensor_name(family: str, hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    names = {**_NAMES, **(_GEMMA_NAMES if family.startswith("gemma") else
                          {"post_attention_layernorm.weight": "ffn_norm.weight"})}
    return f"blk.{layer}.{names[rest]}"


def write_family_gguf(path: Path, hf, family: str, sp_model: Path, *, qtype: T = T.F32,
                      leave_out: tuple[str, ...] = (), pooling_type: int | None = None,
                      more: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """``hf`` as llama.cpp's converter writes a file of its family; matrices in ``qtype``; the
    tensors named in ``leave_out`` (GGUF names) left out, as a broken file would; with
    ``pooling_type``, an embedding model's file (the converter's for a sentence-transformers folder);
    ``more`` adds what a kind of file has beyond its family's (a reranker's head)."""
    c = hf.config
    arch = ARCH[family]
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = c.rope_parameters
    full = rope.get("full_attention", rope)
    writer.add_rope_freq_base(full["rope_theta"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type({T.F32: 0, T.F16: 1}.get(qtype, 7))
    if pooling_type is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling_type))
    if family.startswith("gemma"):
        writer.add_sliding_window(c.sliding_window)
    if family == "phi3":  # the converter writes 0 for a config without a window
        writer.add_sliding_window(c.sliding_window or 0)
    if family == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if family == "gemma3" and full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if family == "phi3":
        original = rope["original_max_position_embeddings"]
        factor = c.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(factor) / np.log(original))))
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    add_sentencepiece_vocab(writer, sp_model, c.vocab_size)
    if more is not None:
        more(writer)
    for hf_name, tensor in hf.state_dict().items():
        if "rotary_emb" in hf_name or (hf_name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        if _tensor_name(family, hf_name) in leave_out:
            continue
        w = tensor.detach().float()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = _converter_permute(w, c.num_attention_heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = _converter_permute(w, c.num_key_value_heads)
        if family.startswith("gemma") and hf_name.endswith("norm.weight"):
            w = w + 1
        x = w.numpy()
        if x.ndim == 1:
            writer.add_tensor(_tensor_name(family, hf_name), x.astype(np.float32))
            continue
        data = quantize(x, T.BF16) if qtype == T.BF16 else encode_tensor(x, qtype)
        writer.add_tensor(_tensor_name(family, hf_name), data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def round_trip(hf, qtype: T) -> None:
    """Give ``hf``'s matrices the values a ``qtype`` file holds: the reference for such a file."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 2:
                data = encode_tensor(p.detach().float().numpy(), qtype)
                back = gguf.quants.dequantize(data, qtype)
                p.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32)).reshape(p.shape))
