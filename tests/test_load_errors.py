"""Every kind of bad model input is a ModelLoadError with one line that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from builders import random_model, tiny_args, write_meta_checkpoint
from builders_formats import write_hf_checkpoint, write_llama2c, write_meta_shards
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.loader import load_model


@pytest.fixture(scope="module")
def tokenizer_model(sp_model_path) -> Path:
    return sp_model_path


@pytest.fixture(scope="module")
def vocab(sp_vocab_size) -> int:
    return sp_vocab_size


@pytest.fixture
def meta_dir(tmp_path, tokenizer_model, vocab) -> Path:
    return write_meta_checkpoint(random_model(tiny_args(vocab)), tmp_path / "meta", tokenizer_model)


def _error(path: Path, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(path, **{"device": "cpu", **kwargs})
    message = str(info.value)
    assert "\n" not in message and message
    return message


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _edit_state(path: Path, edit) -> None:
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def _edit_json(path: Path, **fields) -> None:
    data = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def test_missing_path(tmp_path):
    message = _error(tmp_path / "nowhere")
    assert "nowhere" in message and "no such file or directory" in message


def test_unknown_layout(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    assert "unknown model layout" in _error(tmp_path)
    assert "unknown model layout" in _error(tmp_path / "notes.txt")


def test_truncated_meta_checkpoint(meta_dir):
    _truncate(meta_dir / "consolidated.00.pth")
    message = _error(meta_dir)
    assert message.startswith("consolidated.00.pth:") and "truncated or corrupt" in message


def test_truncated_safetensors(tmp_path, tokenizer_model, vocab):
    out = write_hf_checkpoint(random_model(tiny_args(vocab)), tmp_path / "hf", tokenizer_model)
    _truncate(out / "model.safetensors")
    message = _error(out)
    assert message.startswith("model.safetensors:") and "truncated or corrupt" in message


@pytest.mark.parametrize("version", [0, 1])
def test_truncated_llama2c(tmp_path, tokenizer_model, vocab, version):
    path = write_llama2c(random_model(tiny_args(vocab)), tmp_path / "model.bin", version=version)
    (tmp_path / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    size = path.stat().st_size
    _truncate(path, 0.9)
    message = _error(path)
    assert message.startswith("model.bin: truncated") and str(size) in message


def test_llama2c_quantized_version_is_refused(tmp_path, tokenizer_model, vocab):
    path = write_llama2c(random_model(tiny_args(vocab)), tmp_path / "model.bin", version=1)
    data = bytearray(path.read_bytes())
    data[4:8] = (2).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    (tmp_path / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    assert "version 2 is not supported" in _error(path)


def test_shape_mismatch_names_tensor_and_shapes(meta_dir):
    _edit_state(meta_dir / "consolidated.00.pth",
                lambda s: s.__setitem__("layers.1.attention.wq.weight", torch.zeros(64, 32)))
    message = _error(meta_dir)
    assert "'layers.1.attention.wq.weight'" in message
    assert "(64, 32)" in message and "expected (64, 64)" in message
    assert message.startswith("consolidated.00.pth:")


def test_hf_config_that_does_not_match_its_weights(tmp_path, tokenizer_model, vocab):
    out = write_hf_checkpoint(random_model(tiny_args(vocab)), tmp_path / "hf", tokenizer_model)
    _edit_json(out / "config.json", intermediate_size=128)
    message = _error(out)
    assert message.startswith("model.safetensors:") and "'layers.0.feed_forward.w1.weight'" in message
    assert "(160, 64)" in message and "expected (128, 64)" in message


def test_missing_tensor(meta_dir):
    _edit_state(meta_dir / "consolidated.00.pth", lambda s: s.pop("layers.0.ffn_norm.weight"))
    assert _error(meta_dir) == "consolidated.00.pth: missing tensor 'layers.0.ffn_norm.weight'"


def test_unexpected_tensor(meta_dir):
    _edit_state(meta_dir / "consolidated.00.pth", lambda s: s.__setitem__("layers.9.extra.weight", torch.ones(2)))
    assert "unexpected tensor 'layers.9.extra.weight'" in _error(meta_dir)


def test_a_layer_named_twice_in_a_hugging_face_file_is_refused(tmp_path, tokenizer_model, vocab):
    # "model.layers.1" and "model.layers.01" are one layer (model/tensor_names.py): the second is
    # not read over the first.
    from safetensors.torch import load_file, save_file

    out = write_hf_checkpoint(random_model(tiny_args(vocab)), tmp_path / "hf", tokenizer_model)
    state = load_file(out / "model.safetensors")
    state["model.layers.01.input_layernorm.weight"] = state["model.layers.1.input_layernorm.weight"].clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    assert "names 'layers.1.attention_norm.weight' a second time" in _error(out)


def test_missing_shard(tmp_path, tokenizer_model, vocab):
    out = write_meta_shards(random_model(tiny_args(vocab)), tmp_path / "meta", tokenizer_model, n_shards=3)
    (out / "consolidated.01.pth").unlink()
    assert "consolidated.01.pth is missing" in _error(out)


def test_params_json_missing_field(meta_dir):
    _edit_json(meta_dir / "params.json", n_layers=None)
    assert _error(meta_dir) == "params.json: missing field 'n_layers'"


def test_params_json_bad_values(meta_dir):
    _edit_json(meta_dir / "params.json", n_heads=5)
    message = _error(meta_dir)
    assert message.startswith("params.json:") and "n_heads 5" in message
    _edit_json(meta_dir / "params.json", n_heads=4, dim="sixty-four")
    message = _error(meta_dir)
    assert message.startswith("params.json: bad field value") and "sixty-four" in message


def test_params_json_not_json(meta_dir):
    (meta_dir / "params.json").write_text("{dim: 64")
    assert _error(meta_dir).startswith(f"{meta_dir / 'params.json'}: not valid JSON")


@pytest.mark.parametrize(("field", "value", "expect"), [
    ("num_hidden_layers", None, "config.json: missing field 'num_hidden_layers'"),
    ("model_type", "gpt2", "config.json: model_type 'gpt2' is not supported"),
    ("sliding_window", 0, "config.json: sliding_window must be a positive integer, found 0"),
    ("partial_rotary_factor", 0.5, "config.json: partial_rotary_factor 0.5 is not supported"),
    ("mlp_bias", True, "config.json: mlp_bias is true"),
    ("hidden_act", "gelu", "config.json: hidden_act 'gelu' is not supported"),
    ("num_attention_heads", 0, "config.json: n_heads must be positive"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "config.json: rope_scaling type 'yarn'"),
])
def test_hf_config_bad_fields(tmp_path, tokenizer_model, vocab, field, value, expect):
    out = write_hf_checkpoint(random_model(tiny_args(vocab)), tmp_path / "hf", tokenizer_model)
    _edit_json(out / "config.json", **{field: value})
    assert _error(out).startswith(expect)


def test_tokenizer_larger_than_the_embedding(tmp_path, tokenizer_model, vocab):
    out = write_meta_checkpoint(random_model(tiny_args(vocab - 50)), tmp_path / "meta", tokenizer_model)
    message = _error(out)
    assert f"tokenizer has {vocab} tokens" in message and f"vocab_size is {vocab - 50}" in message


def test_bad_dtype_and_device(meta_dir):
    assert "dtype 'float8'" in _error(meta_dir, dtype="float8")
    assert "device 'tpu9'" in _error(meta_dir, device="tpu9")
    if not torch.cuda.is_available():
        assert _error(meta_dir, device="cuda") == "device 'cuda' is not available on this machine"
