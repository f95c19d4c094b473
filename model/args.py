"""``ModelArgs``: the one description of a Llama architecture, built from any checkpoint's config."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from llama_chat.ml.ops import PLAIN_ATTENTION, AttentionRule, LinearRope, LongRope, Rope, RopeScaling
from llama_chat.model.errors import ModelLoadError


class ConfigError(ModelLoadError):
    """A model config (params.json, config.json, a llama2.c header) is missing or has bad fields."""


# No dimension, layer count, vocabulary or context of a real model comes near this (2**24); the
# bound keeps a hostile config from sizing tables by it before the weights are compared with it.
MAX_SIZE = 1 << 24


def _positive_finite(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive finite number, found {value!r}")


def integer(value: Any, name: str) -> int:
    """A config's integer field: an int, or a float with no fractional part; anything else is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be an integer, found {value!r}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name} must be an integer, found {value!r}")
        return int(value)
    return value


def number(value: Any, name: str) -> float:
    """A config's real-valued field: an int or a float (JSON has no other numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, found {value!r}")
    return float(value)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's SwiGLU width: 2/3 of 4*dim, optionally scaled, rounded up to ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    hidden_dim: int
    n_kv_heads: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Rope | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    # The switches of the model families (``model/families.py`` reads them from a Hugging Face
    # config or a GGUF file's metadata); the defaults are Llama's.
    family: str = "llama"
    head_size: int | None = None  # a head's width where it is not dim / n_heads (Qwen3, Gemma)
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head of q and k before the rotary (Qwen3, Gemma 3)
    activation: str = "silu"  # the feed-forward's gate: "silu" or "gelu_tanh" (Gemma)
    embedding_scale: bool = False  # embeddings times sqrt(dim) (Gemma)
    post_norms: bool = False  # norms on the attention's and the feed-forward's outputs (Gemma 2, 3)
    attention_softcap: float | None = None  # scores capped by cap * tanh(s / cap) (Gemma 2)
    final_softcap: float | None = None  # the logits capped likewise (Gemma 2)
    query_scale: float | None = None  # the scores' scale where it is not 1 / sqrt(head_dim) (Gemma)
    sliding_window: int | None = None  # the keys a windowed layer sees (Mistral, Gemma)
    window_layers: tuple[int, ...] = ()  # the layers that attend through the window
    local_rope_theta: float | None = None  # the windowed layers' own rotary base (Gemma 3)
    # The encoders' switches (BERT). An encoder attends in both directions over a padding mask and
    # gives hidden states, not logits (``Transformer.encode``); it has no classifier.
    encoder: bool = False
    position_table: int = 0  # rows of a learned table of absolute positions (BERT); 0: rotary
    type_vocab_size: int = 0  # rows of the token-type table added to the embeddings (BERT)
    layer_norm: bool = False  # LayerNorm with a bias in place of RMSNorm (BERT)
    # Each sublayer's sum with the residual normed (post-LN), the embeddings normed too, no final
    # norm (BERT); otherwise each sublayer's input is normed (pre-LN).
    norm_after_residual: bool = False
    gated_ffn: bool = True  # w2(act(w1 x) * w3 x); False: w2(act(w1 x)) (BERT)
    linear_biases: bool = False  # biases on the attention's output and the feed-forward (BERT)
    # An encoder's head of sequence classification (BERT's pooler and classifier): the scores it
    # gives a text, from its first token's state (a cross-encoder reranker has one); 0: no head.
    labels: int = 0
    # A decoder whose last states are pooled into embeddings (Qwen3-Embedding, from a
    # sentence-transformers folder): it attends causally, as it was trained, and has no classifier.
    pooled: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_size is not None and not isinstance(self.head_size, bool) \
                and isinstance(self.head_size, int) and self.head_size * self.n_heads == self.dim:
            object.__setattr__(self, "head_size", None)  # the usual width: one spelling of it
        names = ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "max_seq_len")
        for name in names + (("head_size",) if self.head_size is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be an integer, found {value!r}")
            if value <= 0:
                raise ConfigError(f"{name} must be positive, found {value}")
            if value > MAX_SIZE:
                raise ConfigError(f"{name} {value} is larger than any model's ({MAX_SIZE})")
        if self.head_size is None and self.dim % self.n_heads:
            raise ConfigError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2 and not self.position_table:
            raise ConfigError(f"head dimension {self.head_dim} (dim / n_heads) must be even for rotary embeddings")
        _positive_finite("norm_eps", self.norm_eps)
        for name in ("position_table", "type_vocab_size", "labels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SIZE:
                raise ConfigError(f"{name} must be an integer from 0 to {MAX_SIZE}, found {value!r}")
        _positive_finite("rope_theta", self.rope_theta)
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} is not supported (expected {' or '.join(ACTIVATIONS)})")
        for name in ("attention_softcap", "final_softcap", "query_scale", "local_rope_theta"):
            if getattr(self, name) is not None:
                _positive_finite(name, getattr(self, name))
        if self.sliding_window is not None:
            if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) \
                    or self.sliding_window <= 0:
                raise ConfigError(f"sliding_window must be a positive integer, found {self.sliding_window!r}")
        if any(not 0 <= i < self.n_layers for i in self.window_layers):
            raise ConfigError(f"window_layers name a layer outside 0..{self.n_layers - 1}")
        if isinstance(self.rope_scaling, LongRope):
            r = self.rope_scaling
            for name in ("short_factors", "long_factors"):
                factors = getattr(r, name)
                if len(factors) != self.head_dim // 2:
                    raise ConfigError(f"rope scaling {name} has {len(factors)} values, expected "
                                      f"head_dim / 2 = {self.head_dim // 2}")
                for value in factors:
                    _positive_finite(f"rope scaling {name}", value)
            _positive_finite("rope scaling original_max_position_embeddings", r.original_max_position_embeddings)
            _positive_finite("rope scaling attention_factor", r.attention_factor)
        elif isinstance(self.rope_scaling, LinearRope):
            _positive_finite("rope scaling factor", self.rope_scaling.factor)
        elif self.rope_scaling is not None:
            s = self.rope_scaling
            for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                _positive_finite(f"rope scaling {name}", getattr(s, name))
            if s.high_freq_factor <= s.low_freq_factor:
                raise ConfigError(f"rope scaling high_freq_factor {s.high_freq_factor} must be above "
                                  f"low_freq_factor {s.low_freq_factor}")

    @property
    def head_dim(self) -> int:
        return self.head_size if self.head_size is not None else self.dim // self.n_heads

    def attention_rule(self, layer: int) -> AttentionRule:
        """What ``layer``'s attention does beyond Llama's (``ops.AttentionRule``). A window that
        the context never passes changes nothing, so it is left out: such a layer keeps the
        plain paths."""
        window = self.sliding_window if layer in self.window_layers else None
        if window is not None and window >= self.max_seq_len:
            window = None
        scale = self.query_scale
        if scale is not None and math.isclose(scale, self.head_dim ** -0.5, rel_tol=1e-9):
            scale = None
        rule = AttentionRule(window, self.attention_softcap, scale)
        return PLAIN_ATTENTION if rule.plain else rule

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` takes the windowed layers' own rotary table (Gemma 3)."""
        return self.local_rope_theta is not None and layer in self.window_layers

    def llama_layout(self) -> list[str]:
        """What of this model differs from a Llama's layer: what a path written for Llama alone
        (the CPU operator's one-call step) must leave to the general one. Empty for a Llama."""
        gaps = [name for name, on in (
            ("qkv bias", self.qkv_bias), ("q/k norms", self.qk_norm), ("head width", self.head_size is not None),
            (self.activation, self.activation != "silu"), ("embedding scale", self.embedding_scale),
            ("post norms", self.post_norms), ("final soft cap", self.final_softcap is not None),
            ("local rotary base", self.local_rope_theta is not None),
            ("LongRoPE", isinstance(self.rope_scaling, LongRope)),
            ("encoder", self.encoder or self.pooled), ("absolute positions", self.position_table > 0),
            ("LayerNorm", self.layer_norm), ("post-LN", self.norm_after_residual),
            ("plain feed-forward", not self.gated_ffn), ("linear biases", self.linear_biases),
            ("linear rotary scaling", isinstance(self.rope_scaling, LinearRope)),
        ) if on]
        windowed = self.window_layers and self.sliding_window is not None and self.sliding_window < self.max_seq_len
        if windowed or not self.attention_rule(-1).plain:
            gaps.append("attention rule")
        return gaps

    def with_max_seq_len(self, max_seq_len: int) -> ModelArgs:
        return replace(self, max_seq_len=max_seq_len)

    @classmethod
    def from_params_json(cls, params: dict[str, Any], *, vocab_size: int | None = None,
                         max_seq_len: int = 2048) -> ModelArgs:
        """From Meta's ``params.json``. Llama 2 files say ``vocab_size: -1``; pass the tokenizer's."""
        try:
            dim = integer(params["dim"], "dim")
            n_heads = integer(params["n_heads"], "n_heads")
            vocab = integer(params.get("vocab_size", -1), "vocab_size")
            if vocab <= 0:
                if vocab_size is None:
                    raise ConfigError("params.json: vocab_size is -1 and no tokenizer size was given")
                vocab = vocab_size
            scaling = None
            if params.get("use_scaled_rope"):
                scaling = RopeScaling(factor=number(params.get("rope_scaling_factor", 8.0), "rope_scaling_factor"))
            multiplier = params.get("ffn_dim_multiplier")
            if multiplier is not None:
                multiplier = number(multiplier, "ffn_dim_multiplier")
                _positive_finite("ffn_dim_multiplier", multiplier)
            multiple_of = integer(params.get("multiple_of", 256), "multiple_of")
            if not 0 < multiple_of <= MAX_SIZE:
                raise ConfigError(f"multiple_of must be positive, found {multiple_of}")
            hidden = params.get("hidden_dim") or ffn_hidden_dim(min(dim, MAX_SIZE), multiple_of, multiplier)
            n_kv_heads = params.get("n_kv_heads")
            return cls(
                dim=dim,
                n_layers=integer(params["n_layers"], "n_layers"),
                n_heads=n_heads,
                n_kv_heads=integer(n_kv_heads, "n_kv_heads") if n_kv_heads is not None else None,
                vocab_size=vocab,
                hidden_dim=integer(hidden, "hidden_dim"),
                norm_eps=number(params.get("norm_eps", 1e-5), "norm_eps"),
                rope_theta=number(params.get("rope_theta", 10000.0), "rope_theta"),
                rope_scaling=scaling,
                max_seq_len=integer(params.get("max_seq_len", max_seq_len), "max_seq_len"),
                tie_embeddings=bool(params.get("tie_embeddings", False)),
            )
        except KeyError as e:
            raise ConfigError(f"params.json: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"params.json: bad field value ({e})") from None

    def to_params_json(self) -> dict[str, Any]:
        """Meta-style ``params.json`` (with our explicit ``hidden_dim`` so it round-trips)."""
        params: dict[str, Any] = {
            "dim": self.dim,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "vocab_size": self.vocab_size,
            "hidden_dim": self.hidden_dim,
            "norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "max_seq_len": self.max_seq_len,
            "tie_embeddings": self.tie_embeddings,
        }
        if self.rope_scaling is not None:
            params["use_scaled_rope"] = True
            params["rope_scaling_factor"] = self.rope_scaling.factor
        return params

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> ModelArgs:
        """From a Hugging Face ``config.json`` of a ``LlamaForCausalLM``."""
        try:
            scaling = None
            # transformers 4.x writes `rope_scaling` + `rope_theta`; 5.x folds both into
            # `rope_parameters`, whose rope_type is "default" when nothing is scaled.
            rope_params = config.get("rope_parameters") or {}
            rs = config.get("rope_scaling") or rope_params
            for name, value in (("rope_parameters", rope_params), ("rope_scaling", rs)):
                if not isinstance(value, dict):
                    raise ConfigError(f"{name} must be an object, found {value!r}")
            scaling = hf_rope(rs, config)
            rope_theta = config.get("rope_theta") or rope_params.get("rope_theta", 10000.0)
            n_heads = integer(config["num_attention_heads"], "num_attention_heads")
            n_kv_heads = config.get("num_key_value_heads")
            return cls(
                dim=integer(config["hidden_size"], "hidden_size"),
                n_layers=integer(config["num_hidden_layers"], "num_hidden_layers"),
                n_heads=n_heads,
                n_kv_heads=integer(n_kv_heads, "num_key_value_heads") if n_kv_heads is not None else n_heads,
                vocab_size=integer(config["vocab_size"], "vocab_size"),
                hidden_dim=integer(config["intermediate_size"], "intermediate_size"),
                norm_eps=number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
                rope_theta=number(rope_theta, "rope_theta"),
                rope_scaling=scaling,
                max_seq_len=integer(config.get("max_position_embeddings", 2048), "max_position_embeddings"),
                tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                head_size=integer(config["head_dim"], "head_dim") if config.get("head_dim") is not None else None,
            )
        except KeyError as e:
            raise ConfigError(f"config.json: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, OverflowError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config.json: bad field value ({e})") from None

    @classmethod
    def from_llama2c_header(cls, dim: int, hidden_dim: int, n_layers: int, n_heads: int,
                            n_kv_heads: int, vocab_size: int, max_seq_len: int,
                            shared_classifier: bool) -> ModelArgs:
        """From the integers of a llama2.c ``.bin`` header (both the v0 and the v1 layout)."""
        return cls(
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            vocab_size=vocab_size,
            hidden_dim=hidden_dim,
            max_seq_len=max_seq_len,
            tie_embeddings=shared_classifier,
        )


def hf_rope(rs: dict[str, Any], config: dict[str, Any]) -> RopeScaling | LinearRope | LongRope | None:
    """A config's rotary scaling (``rope_scaling`` or ``rope_parameters``): Llama 3.1's, linear or
    LongRoPE; another type is refused in one line."""
    kind = rs.get("rope_type", rs.get("type")) if rs else None
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return RopeScaling(
            factor=number(rs["factor"], "rope_scaling factor"),
            low_freq_factor=number(rs["low_freq_factor"], "rope_scaling low_freq_factor"),
            high_freq_factor=number(rs["high_freq_factor"], "rope_scaling high_freq_factor"),
            original_max_position_embeddings=integer(rs["original_max_position_embeddings"],
                                                     "rope_scaling original_max_position_embeddings"),
        )
    if kind == "linear":
        return LinearRope(number(rs["factor"], "rope_scaling factor"))
    if kind in ("longrope", "su"):
        original = rs.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
        original = integer(original, "original_max_position_embeddings")
        factor = rs.get("factor")
        factor = number(factor, "rope_scaling factor") if factor is not None else \
            integer(config.get("max_position_embeddings", original), "max_position_embeddings") / original
        attention = rs.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return LongRope(tuple(number(f, "rope_scaling short_factor") for f in rs["short_factor"]),
                        tuple(number(f, "rope_scaling long_factor") for f in rs["long_factor"]),
                        original, number(attention, "rope_scaling attention_factor"))
    raise ModelLoadError(f"config.json: rope_scaling type {kind!r:.40} is not supported "
                         "(expected llama3, linear or longrope)")
