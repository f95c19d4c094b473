"""Write one tiny model in every layout we read: Meta shards, Hugging Face, llama2.c v0 and v1.

These writers are independent of the readers under test: they follow the formats' own
descriptions (Meta's model-parallel split, Hugging Face's names and rotary permutation, the
llama2.c export order), so a reader bug shows up as different logits.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import save_file

from llama_chat.model.transformer import Transformer

# Meta's model-parallel split dims (ColumnParallelLinear: 0, RowParallelLinear: 1).
_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1}


def _state(model: Transformer) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        state.pop("output.weight", None)
    return state


def _copy_tokenizer(tokenizer_model: Path | None, out_dir: Path) -> None:
    if tokenizer_model is not None and tokenizer_model != out_dir / "tokenizer.model":
        shutil.copy(tokenizer_model, out_dir / "tokenizer.model")


def write_meta_shards(model: Transformer, out_dir: Path, tokenizer_model: Path | None = None, *,
                      n_shards: int = 2, embedding_dim: int = 1, rope_freqs: bool = True) -> Path:
    """``consolidated.00.pth`` .. ``NN``: each weight split along its parallel dim, norms replicated.

    ``embedding_dim`` 1 is Llama 2's ParallelEmbedding, 0 is Llama 3's VocabParallelEmbedding.
    ``rope_freqs`` adds the ``rope.freqs`` buffer some Meta checkpoints carry.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "params.json").write_text(json.dumps(model.args.to_params_json()))
    state = _state(model)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(n_shards)]
    for name, tensor in state.items():
        if tensor.dim() == 1:
            parts = [tensor.clone() for _ in range(n_shards)]
        else:
            kind = name.split(".")[-2]
            dim = embedding_dim if name == "tok_embeddings.weight" else _SPLIT_DIM[kind]
            parts = [p.clone() for p in tensor.chunk(n_shards, dim=dim)]
        for shard, part in zip(shards, parts):
            shard[name] = part
    for i, shard in enumerate(shards):
        if rope_freqs:
            shard["rope.freqs"] = torch.ones(model.args.head_dim // 2)
        torch.save(shard, out_dir / f"consolidated.{i:02d}.pth")
    _copy_tokenizer(tokenizer_model, out_dir)
    return out_dir


def interleaved_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Hugging Face's conversion-script permutation of q/k rows (Meta -> rotate-half layout)."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.view(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_state(model: Transformer) -> dict[str, torch.Tensor]:
    a = model.args
    state = _state(model)
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    if "output.weight" in state:
        out["lm_head.weight"] = state["output.weight"]
    names = {
        "attention.wv.weight": "self_attn.v_proj.weight",
        "attention.wo.weight": "self_attn.o_proj.weight",
        "feed_forward.w1.weight": "mlp.gate_proj.weight",
        "feed_forward.w2.weight": "mlp.down_proj.weight",
        "feed_forward.w3.weight": "mlp.up_proj.weight",
        "attention_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
    }
    for i in range(a.n_layers):
        p = f"layers.{i}."
        out[f"model.{p}self_attn.q_proj.weight"] = interleaved_to_hf(state[p + "attention.wq.weight"], a.n_heads)
        out[f"model.{p}self_attn.k_proj.weight"] = interleaved_to_hf(state[p + "attention.wk.weight"], a.n_kv_heads)
        for meta, hf in names.items():
            out[f"model.{p}{hf}"] = state[p + meta]
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(model: Transformer) -> dict:
    a = model.args
    rope: dict = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling is not None:
        s = a.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": a.dim, "intermediate_size": a.hidden_dim, "num_hidden_layers": a.n_layers,
        "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "vocab_size": a.vocab_size,
        "rms_norm_eps": a.norm_eps, "max_position_embeddings": a.max_seq_len,
        "tie_word_embeddings": a.tie_embeddings, "rope_parameters": rope,
        "attention_bias": False, "mlp_bias": False,
    }


def write_hf_checkpoint(model: Transformer, out_dir: Path, tokenizer_model: Path | None = None) -> Path:
    """``config.json`` + ``model.safetensors`` with Hugging Face names and q/k permutation."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(hf_config(model)))
    save_file(hf_state(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _copy_tokenizer(tokenizer_model, out_dir)
    return out_dir


def write_llama2c(model: Transformer, path: Path, *, version: int) -> Path:
    """A llama2.c ``.bin`` in the legacy (0) or ``ak42`` (1) layout, weights as raw float32."""
    a = model.args
    path.parent.mkdir(parents=True, exist_ok=True)
    state = _state(model)
    layers = range(a.n_layers)

    def every(suffix: str) -> list[torch.Tensor]:
        return [state[f"layers.{i}.{suffix}"] for i in layers]

    attn = every("attention.wq.weight") + every("attention.wk.weight") + every("attention.wv.weight") + every(
        "attention.wo.weight")
    ffn = every("feed_forward.w1.weight") + every("feed_forward.w2.weight") + every("feed_forward.w3.weight")
    dims = (a.dim, a.hidden_dim, a.n_layers, a.n_heads, a.n_kv_heads)
    if version == 0:
        vocab = a.vocab_size if a.tie_embeddings else -a.vocab_size
        header = struct.pack("<7i", *dims, vocab, a.max_seq_len)
        # The legacy file carries the old precomputed rotary table (cos then sin); readers skip it.
        angles = torch.outer(torch.arange(a.max_seq_len).float(),
                             1.0 / (a.rope_theta ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim)))
        tensors = ([state["tok_embeddings.weight"]] + every("attention_norm.weight") + attn
                   + every("ffn_norm.weight") + ffn + [state["norm.weight"], angles.cos(), angles.sin()])
    elif version == 1:
        header = struct.pack("<Ii7iB", 0x616B3432, 1, *dims, a.vocab_size, a.max_seq_len, int(a.tie_embeddings))
        header += b"\0" * (256 - len(header))
        tensors = (every("attention_norm.weight") + every("ffn_norm.weight") + [state["norm.weight"]]
                   + [state["tok_embeddings.weight"]] + attn + ffn)
    else:
        raise ValueError(f"llama2.c version {version} is not written here")
    if not a.tie_embeddings:
        tensors.append(state["output.weight"])
    with path.open("wb") as f:
        f.write(header)
        for t in tensors:
            f.write(t.float().contiguous().numpy().tobytes())
    return path
