"""Each family's tensor names: ours (Meta's, the model's parameter names) beside each file format's
spelling, one table a family, read by the Hugging Face and the GGUF readers alike.

A table has rows ``(ours, Hugging Face's, GGUF's)``, None where a format has no such tensor.
Layer rows name a tensor within layer N: ours after ``layers.N.``, Hugging Face's after its
layer prefix (``model.layers.N.``; BERT's ``encoder.layer.N.``), GGUF's after ``blk.N.``. Top
rows name the tensors outside the layers in full.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

HF, GGUF = 1, 2  # a spelling's column in a row
Rows = tuple[tuple[str, str | None, str | None], ...]

GGUF_LAYER_PREFIX = "blk."

LLAMA_TOP: Rows = (
    ("tok_embeddings.weight", "model.embed_tokens.weight", "token_embd.weight"),
    ("norm.weight", "model.norm.weight", "output_norm.weight"),
    ("output.weight", "lm_head.weight", "output.weight"),
)

_ATTENTION: Rows = (
    ("attention.wq.weight", "self_attn.q_proj.weight", "attn_q.weight"),
    ("attention.wk.weight", "self_attn.k_proj.weight", "attn_k.weight"),
    ("attention.wv.weight", "self_attn.v_proj.weight", "attn_v.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight", "attn_output.weight"),
    ("attention_norm.weight", "input_layernorm.weight", "attn_norm.weight"),
)
_FFN: Rows = (
    ("feed_forward.w1.weight", "mlp.gate_proj.weight", "ffn_gate.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight", "ffn_down.weight"),
    ("feed_forward.w3.weight", "mlp.up_proj.weight", "ffn_up.weight"),
)
LLAMA: Rows = _ATTENTION + _FFN + (("ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),)
QKV_BIAS: Rows = (
    ("attention.bq", "self_attn.q_proj.bias", "attn_q.bias"),
    ("attention.bk", "self_attn.k_proj.bias", "attn_k.bias"),
    ("attention.bv", "self_attn.v_proj.bias", "attn_v.bias"),
)
QK_NORM: Rows = (
    ("attention.q_norm.weight", "self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("attention.k_norm.weight", "self_attn.k_norm.weight", "attn_k_norm.weight"),
)
# Gemma's post_attention_layernorm is the attention output's norm, not the feed-forward's input's.
GEMMA: Rows = _ATTENTION + _FFN + (
    ("attention_post_norm.weight", "post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("ffn_norm.weight", "pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("ffn_post_norm.weight", "post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
)
# Phi-3's fused tensors are split by ``families.check_fused``, into these names' parts.
PHI3: Rows = (
    ("attention.wqkv.weight", "self_attn.qkv_proj.weight", "attn_qkv.weight"),
    ("attention.wo.weight", "self_attn.o_proj.weight", "attn_output.weight"),
    ("feed_forward.w13.weight", "mlp.gate_up_proj.weight", "ffn_up.weight"),
    ("feed_forward.w2.weight", "mlp.down_proj.weight", "ffn_down.weight"),
    ("attention_norm.weight", "input_layernorm.weight", "attn_norm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight", "ffn_norm.weight"),
)

# BERT's norms come after each sublayer's sum with the residual (``ModelArgs.norm_after_residual``):
# the attention's output norm is our ``attention_norm``, the feed-forward's our ``ffn_norm``.
BERT: Rows = (
    ("attention.wq.weight", "attention.self.query.weight", "attn_q.weight"),
    ("attention.bq", "attention.self.query.bias", "attn_q.bias"),
    ("attention.wk.weight", "attention.self.key.weight", "attn_k.weight"),
    ("attention.bk", "attention.self.key.bias", "attn_k.bias"),
    ("attention.wv.weight", "attention.self.value.weight", "attn_v.weight"),
    ("attention.bv", "attention.self.value.bias", "attn_v.bias"),
    ("attention.wo.weight", "attention.output.dense.weight", "attn_output.weight"),
    ("attention.bo", "attention.output.dense.bias", "attn_output.bias"),
    ("attention_norm.weight", "attention.output.LayerNorm.weight", "attn_output_norm.weight"),
    ("attention_norm.bias", "attention.output.LayerNorm.bias", "attn_output_norm.bias"),
    ("feed_forward.w1.weight", "intermediate.dense.weight", "ffn_up.weight"),
    ("feed_forward.b1", "intermediate.dense.bias", "ffn_up.bias"),
    ("feed_forward.w2.weight", "output.dense.weight", "ffn_down.weight"),
    ("feed_forward.b2", "output.dense.bias", "ffn_down.bias"),
    ("ffn_norm.weight", "output.LayerNorm.weight", "layer_output_norm.weight"),
    ("ffn_norm.bias", "output.LayerNorm.bias", "layer_output_norm.bias"),
)
# llama.cpp's converter's names for BERT: "cls" is the pooler, "cls.output" the classifier.
BERT_TOP: Rows = (
    ("tok_embeddings.weight", "embeddings.word_embeddings.weight", "token_embd.weight"),
    ("pos_embeddings.weight", "embeddings.position_embeddings.weight", "position_embd.weight"),
    ("type_embeddings.weight", "embeddings.token_type_embeddings.weight", "token_types.weight"),
    ("embedding_norm.weight", "embeddings.LayerNorm.weight", "token_embd_norm.weight"),
    ("embedding_norm.bias", "embeddings.LayerNorm.bias", "token_embd_norm.bias"),
    ("pooler.weight", "pooler.dense.weight", "cls.weight"),
    ("pooler.bias", "pooler.dense.bias", "cls.bias"),
    ("classifier.weight", "classifier.weight", "cls.output.weight"),
    ("classifier.bias", "classifier.bias", "cls.output.bias"),
)
# A classifier's head: left unread from a Hugging Face file without one.
BERT_HEAD = ("pooler.weight", "pooler.bias", "classifier.weight", "classifier.bias")

# nomic-bert (nomic-embed-text) as llama.cpp's converter writes it: BERT's post-LN encoder with
# rotary positions (NEOX halves), q, k and v in one tensor, SwiGLU (``ffn_gate`` the activated
# half) and no biases but the norms'. It has no Hugging Face form without remote code: files only.
NOMIC_BERT: Rows = (
    ("attention.wqkv.weight", None, "attn_qkv.weight"),
    ("attention.wo.weight", None, "attn_output.weight"),
    ("attention_norm.weight", None, "attn_output_norm.weight"),
    ("attention_norm.bias", None, "attn_output_norm.bias"),
    ("feed_forward.w1.weight", None, "ffn_gate.weight"),
    ("feed_forward.w3.weight", None, "ffn_up.weight"),
    ("feed_forward.w2.weight", None, "ffn_down.weight"),
    ("ffn_norm.weight", None, "layer_output_norm.weight"),
    ("ffn_norm.bias", None, "layer_output_norm.bias"),
)
NOMIC_BERT_TOP: Rows = LLAMA_TOP + BERT_TOP[2:5]


@dataclass(frozen=True)
class TensorNames:
    """One family's names (the module's docstring), with where a Hugging Face file puts its layers,
    the prefix some of its files put before every name ("bert." in a classifier's), the tensors
    it reads only for a classifier (``head``) and those none of our paths read (``hf_ignored``)."""

    layer: Rows
    top: Rows = LLAMA_TOP
    hf_layer_prefix: str = "model.layers."
    hf_name_prefix: str = ""
    head: tuple[str, ...] = ()
    hf_ignored: tuple[str, ...] = ()

    def ours(self, name: str, spelling: int) -> str | None:
        """Our name of a file's tensor ``name`` in ``spelling`` (``HF``, after ``hf_name_prefix``,
        or ``GGUF``), or None where the family has no such tensor."""
        top, layer = self._maps[spelling]
        if name in top:
            return top[name]
        prefix = self.hf_layer_prefix if spelling == HF else GGUF_LAYER_PREFIX
        if not name.startswith(prefix):
            return None
        number, _, inner = name[len(prefix):].partition(".")
        # "blk.1" and "blk.01" both name layer 1: a reader refuses the second.
        if not number.isdecimal() or inner not in layer:
            return None
        return f"layers.{int(number)}.{layer[inner]}"

    @cached_property
    def _maps(self) -> dict[int, tuple[dict[str, str], dict[str, str]]]:
        return {spelling: ({row[spelling]: row[0] for row in self.top if row[spelling] is not None},
                           {row[spelling]: row[0] for row in self.layer if row[spelling] is not None})
                for spelling in (HF, GGUF)}
