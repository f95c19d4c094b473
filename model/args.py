"""``ModelArgs``: the one description of a Llama architecture, built from any checkpoint's config."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from llama_chat.ml.ops import RopeScaling
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
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"{name} must be an integer, found {value!r}")
            if value <= 0:
                raise ConfigError(f"{name} must be positive, found {value}")
            if value > MAX_SIZE:
                raise ConfigError(f"{name} {value} is larger than any model's ({MAX_SIZE})")
        if self.dim % self.n_heads:
            raise ConfigError(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head dimension {self.head_dim} (dim / n_heads) must be even for rotary embeddings")
        _positive_finite("norm_eps", self.norm_eps)
        _positive_finite("rope_theta", self.rope_theta)
        if self.rope_scaling is not None:
            s = self.rope_scaling
            for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                _positive_finite(f"rope scaling {name}", getattr(s, name))
            if s.high_freq_factor <= s.low_freq_factor:
                raise ConfigError(f"rope scaling high_freq_factor {s.high_freq_factor} must be above "
                                  f"low_freq_factor {s.low_freq_factor}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

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
            kind = rs.get("rope_type", rs.get("type")) if rs else None
            if kind not in (None, "default"):
                if kind != "llama3":
                    raise ConfigError(f"rope_scaling type {kind!r} is not supported (expected 'llama3')")
                scaling = RopeScaling(
                    factor=number(rs["factor"], "rope_scaling factor"),
                    low_freq_factor=number(rs["low_freq_factor"], "rope_scaling low_freq_factor"),
                    high_freq_factor=number(rs["high_freq_factor"], "rope_scaling high_freq_factor"),
                    original_max_position_embeddings=integer(rs["original_max_position_embeddings"],
                                                             "rope_scaling original_max_position_embeddings"),
                )
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
