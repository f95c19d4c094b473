"""The model families as switches of the one transformer: what each family's files say, read into
``ModelArgs``, and how each names its tensors.

A family is Llama's layer with some of these: biases on q, k and v (Qwen2), an RMSNorm over each
head of q and k (Qwen3, Gemma 3), GeGLU, a scaled embedding, norms after each sublayer, soft caps
and a query scale (Gemma), sliding windows (Mistral, Gemma, Phi-3), fused q/k/v and gate/up
tensors and LongRoPE (Phi-3). ``transformer.py`` reads only the switches; this module is the one
place that knows which family sets which, from a Hugging Face ``config.json`` (``architectures``,
``model_type``) or a GGUF file's ``general.architecture``.

Rotary layout: the model rotates interleaved pairs (Meta's order). Hugging Face checkpoints of
every family, and GGUF files of the families llama.cpp runs with its NEOX rotary (all but
``llama``), keep q and k rows in the halves order; the readers put them in pairs at load
(``interleave_rows``), biases and q/k norm weights with them, so no path of the model needs a
second rotary.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from llama_chat.model import tensor_names as names
from llama_chat.model.args import ConfigError, ModelArgs, integer, number
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.tensor_names import TensorNames


@dataclass(frozen=True)
class Family:
    name: str
    hf_types: tuple[str, ...]  # config.json's model_type values
    gguf_arch: str | None  # general.architecture
    names: TensorNames  # its tensors' names, ours beside each format's (``tensor_names.py``)
    gguf_halves: bool = True  # the GGUF file's q/k rows are in the halves order (NEOX rotary)
    norm_shift: bool = False  # Hugging Face weights hold w of a (1 + w) norm (Gemma); GGUF's hold 1 + w


FAMILIES = (
    Family("llama", ("llama",), "llama", TensorNames(names.LLAMA), gguf_halves=False),
    Family("mistral", ("mistral",), None, TensorNames(names.LLAMA)),  # Mistral's GGUF files are "llama"
    Family("qwen2", ("qwen2",), "qwen2", TensorNames(names.LLAMA + names.QKV_BIAS)),
    Family("qwen3", ("qwen3",), "qwen3", TensorNames(names.LLAMA + names.QK_NORM)),
    Family("gemma2", ("gemma2",), "gemma2", TensorNames(names.GEMMA), norm_shift=True),
    Family("gemma3", ("gemma3_text", "gemma3"), "gemma3", TensorNames(names.GEMMA + names.QK_NORM), norm_shift=True),
    Family("phi3", ("phi3",), "phi3", TensorNames(names.PHI3)),
    Family("bert", ("bert",), "bert",
           TensorNames(names.BERT, names.BERT_TOP, hf_layer_prefix="encoder.layer.", hf_name_prefix="bert.",
                       head=names.BERT_HEAD, hf_ignored=("embeddings.position_ids",)), gguf_halves=False),
    Family("nomic-bert", (), "nomic-bert", TensorNames(names.NOMIC_BERT, names.NOMIC_BERT_TOP)),
)
GGUF_ARCHITECTURES = tuple(f.gguf_arch for f in FAMILIES if f.gguf_arch is not None)
HF_TYPES = tuple(t for f in FAMILIES for t in f.hf_types)


def family_named(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def hf_family(config: dict[str, Any]) -> Family:
    """The family of a ``config.json``, from ``model_type`` (or ``architectures``); one line naming
    what was found and what is read otherwise."""
    model_type = config.get("model_type")
    if model_type is None:
        architectures = config.get("architectures") or ["LlamaForCausalLM"]
        by_class = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                    "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                    "Phi3ForCausalLM": "phi3", "BertModel": "bert", "BertForSequenceClassification": "bert"}
        model_type = by_class.get(architectures[0] if isinstance(architectures, list) and architectures else None)
        if model_type is None:
            raise ModelLoadError(f"config.json: architecture {architectures!r:.80} is not supported "
                                 f"(expected one of {', '.join(by_class)})")
    for family in FAMILIES:
        if model_type in family.hf_types:
            if model_type == "gemma3" and isinstance(config.get("vision_config"), dict):
                raise ModelLoadError("config.json: a Gemma 3 model with a vision tower is not supported "
                                     "(its text model, model_type 'gemma3_text', is)")
            return family
    raise ModelLoadError(f"config.json: model_type {model_type!r:.60} is not supported "
                         f"(expected one of {', '.join(HF_TYPES)})")


def hf_args(config: dict[str, Any]) -> tuple[Family, ModelArgs]:
    """``ModelArgs`` of a Hugging Face ``config.json`` of any family read here."""
    family = hf_family(config)
    if family.name == "gemma3" and isinstance(config.get("text_config"), dict):
        config = {**config["text_config"], "model_type": "gemma3_text"}
    if family.name == "bert":
        return family, _bert_args(config)
    try:
        config, local_theta = _flat_rope(config)
        args = ModelArgs.from_hf_config(config)
        switches = _hf_switches(family, config, args)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        if isinstance(e, ModelLoadError):
            raise
        detail = f"missing field {e.args[0]!r}" if isinstance(e, KeyError) else f"bad field value ({e})"
        raise ModelLoadError(f"config.json: {detail}") from None
    if local_theta is not None:
        switches["local_rope_theta"] = local_theta
    return family, _replaced(args, switches, "config.json")


def bert_args(*, dim: int, n_layers: int, n_heads: int, vocab_size: int, hidden_dim: int, norm_eps: float,
              positions: int, type_vocab_size: int, labels: int, activation: str = "gelu") -> ModelArgs:
    """BERT's switches of the one model, whichever file names the sizes."""
    if labels not in (0, 1):
        raise ModelLoadError(f"a classifier of {labels} labels is not supported (a reranker scores with one)")
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads, vocab_size=vocab_size,
                     hidden_dim=hidden_dim, norm_eps=norm_eps, max_seq_len=positions, family="bert",
                     activation=activation, qkv_bias=True, encoder=True, position_table=positions,
                     type_vocab_size=type_vocab_size, layer_norm=True, norm_after_residual=True, gated_ffn=False,
                     linear_biases=True, labels=labels)


def nomic_bert_args(*, dim: int, n_layers: int, n_heads: int, vocab_size: int, hidden_dim: int, norm_eps: float,
                    context: int, rope_theta: float, type_vocab_size: int) -> ModelArgs:
    """nomic-bert's switches of the one model: BERT's but for rotary positions, SwiGLU, no biases."""
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads, vocab_size=vocab_size,
                     hidden_dim=hidden_dim, norm_eps=norm_eps, max_seq_len=context, rope_theta=rope_theta,
                     family="nomic-bert", activation="silu", encoder=True, type_vocab_size=type_vocab_size,
                     layer_norm=True, norm_after_residual=True, gated_ffn=True)


def _bert_args(config: dict[str, Any]) -> ModelArgs:
    """A ``BertModel``'s ``config.json`` as the encoder switches of the one model."""
    try:
        act = config.get("hidden_act", "gelu")
        activations = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
        if act not in activations:
            raise ModelLoadError(f"config.json: hidden_act {act!r:.40} is not supported (expected "
                                 f"{', '.join(activations)})")
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ModelLoadError(f"config.json: position_embedding_type {kind!r:.40} is not supported "
                                 "(expected 'absolute')")
        args = bert_args(
            dim=integer(config["hidden_size"], "hidden_size"),
            n_layers=integer(config["num_hidden_layers"], "num_hidden_layers"),
            n_heads=integer(config["num_attention_heads"], "num_attention_heads"),
            vocab_size=integer(config["vocab_size"], "vocab_size"),
            hidden_dim=integer(config["intermediate_size"], "intermediate_size"),
            norm_eps=number(config.get("layer_norm_eps", 1e-12), "layer_norm_eps"),
            positions=integer(config.get("max_position_embeddings", 512), "max_position_embeddings"),
            type_vocab_size=integer(config.get("type_vocab_size", 2), "type_vocab_size"),
            labels=_bert_labels(config), activation=activations[act])
    except KeyError as e:
        raise ModelLoadError(f"config.json: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"config.json: bad field value ({e})") from None
    return args


def _bert_labels(config: dict[str, Any]) -> int:
    """A ``BertForSequenceClassification``'s scores (one for a reranker); 0 for a ``BertModel``."""
    architectures = config.get("architectures") or []
    if "BertForSequenceClassification" not in architectures:
        return 0
    id2label = config.get("id2label")
    labels = len(id2label) if isinstance(id2label, dict) and id2label else config.get("num_labels", 2)
    labels = integer(labels, "num_labels")
    if labels != 1:
        raise ModelLoadError(f"config.json: a classifier of {labels} labels is not supported "
                             "(a reranker scores with one)")
    return labels


def _flat_rope(config: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """``config`` with one set of rotary parameters, and the windowed layers' own base where the
    config has one (Gemma 3: ``rope_local_base_freq``, or transformers 5's parameters per layer type)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention") or {}
        config = {**config, "rope_parameters": params["full_attention"]}
        return config, number(local["rope_theta"], "rope_theta") if "rope_theta" in local else None
    local = config.get("rope_local_base_freq")
    return config, number(local, "rope_local_base_freq") if local is not None else None


def _hf_switches(family: Family, config: dict[str, Any], args: ModelArgs) -> dict[str, Any]:
    get = config.get
    switches: dict[str, Any] = {"family": family.name}
    act = get("hidden_activation") or get("hidden_act") or "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh") or (family.name.startswith("gemma") and act == "gelu"):
        switches["activation"] = "gelu_tanh"
    elif act != "silu":
        raise ModelLoadError(f"config.json: hidden_act {act!r:.40} is not supported (expected 'silu' or "
                             "'gelu_pytorch_tanh')")
    partial = (get("rope_parameters") or {}).get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"config.json: partial_rotary_factor {partial!r:.20} is not supported "
                             "(rotary embeddings over the whole head only)")
    for flag in ("mlp_bias",):
        if get(flag):
            raise ModelLoadError(f"config.json: {flag} is true; biases on the feed-forward are not supported")
    if family.name == "qwen2":
        switches["qkv_bias"] = True
    elif get("attention_bias"):
        raise ModelLoadError(f"config.json: attention_bias is true for a {family.name} model, which is not supported")
    if family.name in ("qwen3", "gemma3"):
        switches["qk_norm"] = True
    if family.name.startswith("gemma"):
        switches.update(embedding_scale=True, post_norms=True, tie_embeddings=True)
        scalar = get("query_pre_attn_scalar")
        if scalar is not None:
            switches["query_scale"] = number(scalar, "query_pre_attn_scalar") ** -0.5
        for ours, theirs in (("attention_softcap", "attn_logit_softcapping"),
                             ("final_softcap", "final_logit_softcapping")):
            if get(theirs) is not None:
                switches[ours] = number(get(theirs), theirs)
    window = get("sliding_window")
    if family.name == "qwen2" and not get("use_sliding_window"):
        window = None  # written by every Qwen2 config, used by none that sets this false
    if family.name == "qwen2" and window is not None:
        raise ModelLoadError("config.json: use_sliding_window is true; Qwen2's windowed layers are not supported")
    if window is not None:
        switches["sliding_window"] = integer(window, "sliding_window")
        switches["window_layers"] = _window_layers(family, config, args.n_layers)
    return switches


def _window_layers(family: Family, config: dict[str, Any], n_layers: int) -> tuple[int, ...]:
    """The layers that attend through the window: ``layer_types`` where the config lists them,
    else the family's pattern (Gemma 2 every other layer from the first, Gemma 3 five of six)."""
    types = config.get("layer_types")
    if isinstance(types, list) and len(types) == n_layers:
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if family.name == "gemma2":
        return tuple(range(0, n_layers, 2))
    if family.name == "gemma3":
        pattern = integer(config.get("sliding_window_pattern", config.get("_sliding_window_pattern", 6)),
                          "sliding_window_pattern")
        return tuple(i for i in range(n_layers) if (i + 1) % pattern)
    return tuple(range(n_layers))


def _replaced(args: ModelArgs, switches: dict[str, Any], where: str) -> ModelArgs:
    try:
        return replace(args, **switches)
    except ConfigError as e:
        raise ModelLoadError(f"{where}: {e}") from None


# -- the tensors -----------------------------------------------------------------------------------


def interleave_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A q or k projection's rows (or its bias) from the halves order to pairs, head by head: row
    ``j`` of a head's first half and row ``j`` of its second become rows ``2j`` and ``2j + 1``.
    The same reordering as ``hf.hf_to_interleaved``, for any leading dimension."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rotated_heads(name: str, args: ModelArgs) -> int | None:
    """For a tensor whose rows the rotary reads in pairs (the q and k projections, their biases
    and head norms), how many heads its rows split into; None for any other tensor."""
    if args.position_table:
        return None  # no rotary: the rows stay as the file has them
    heads = {"attention.wq.weight": args.n_heads, "attention.wk.weight": args.n_kv_heads,
             "attention.bq": args.n_heads, "attention.bk": args.n_kv_heads,
             "attention.q_norm.weight": 1, "attention.k_norm.weight": 1}
    return next((n for suffix, n in heads.items() if name.endswith("." + suffix)), None)


def interleave_order(rows: int, n_heads: int) -> torch.Tensor:
    """The row indices ``interleave_rows`` takes: ``w[order]`` is the reordered ``w``."""
    return interleave_rows(torch.arange(rows), n_heads)


def split_sizes(args: ModelArgs) -> dict[str, tuple[tuple[str, int], ...]]:
    """Phi-3's fused tensors and the rows of their parts, in order."""
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    return {
        "attention.wqkv.weight": (("attention.wq.weight", q), ("attention.wk.weight", kv),
                                  ("attention.wv.weight", kv)),
        "feed_forward.w13.weight": (("feed_forward.w1.weight", args.hidden_dim),
                                    ("feed_forward.w3.weight", args.hidden_dim)),
    }


def check_fused(name: str, rows: int, args: ModelArgs, where: str) -> tuple[tuple[str, int], ...] | None:
    """The parts of the fused tensor ``name`` (``layers.N.attention.wqkv.weight``), or None when it
    is not one; a fused tensor of the wrong size is refused in one line."""
    for fused, parts in split_sizes(args).items():
        if name.endswith("." + fused):
            want = sum(n for _, n in parts)
            if rows != want:
                raise ModelLoadError(f"{where}: tensor {name!r} has {rows} rows, expected {want} "
                                     f"({' + '.join(str(n) for _, n in parts)})")
            return parts
    return None


def gemma_softcaps(arch: str, metadata: dict[str, Any]) -> dict[str, float]:
    """Gemma 2's caps from a GGUF file's metadata."""
    caps = {}
    for ours, key in (("attention_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping")):
        value = metadata.get(f"{arch}.{key}")
        if value is not None:
            caps[ours] = number(value, key)
    return caps
