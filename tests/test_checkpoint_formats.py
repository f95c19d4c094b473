"""The same weights written in every layout load to the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from builders import random_model, tiny_args, write_meta_checkpoint
from builders_formats import hf_state, write_hf_checkpoint, write_llama2c, write_meta_shards
from llama_chat.model.loader import DEFAULT_MAX_SEQ_LEN, detect_layout, load_model


@pytest.fixture(scope="module")
def tokenizer_model(sp_model_path) -> Path:
    return sp_model_path


@pytest.fixture(scope="module")
def vocab(sp_vocab_size) -> int:
    return sp_vocab_size


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens)


def _write_all(model, root: Path, tok: Path) -> dict[str, tuple[Path, str]]:
    """Every layout of ``model``: name -> (path to load, expected layout)."""
    llama2c_dir = root / "llama2c"
    llama2c_dir.mkdir(parents=True)
    (llama2c_dir / "tokenizer.model").write_bytes(tok.read_bytes())
    return {
        "meta": (write_meta_checkpoint(model, root / "meta", tok), "meta"),
        "meta-2-shards-llama2-embedding": (write_meta_shards(model, root / "meta2", tok, embedding_dim=1), "meta"),
        "meta-2-shards-llama3-embedding": (write_meta_shards(model, root / "meta3", tok, embedding_dim=0), "meta"),
        "hf": (write_hf_checkpoint(model, root / "hf", tok), "hf"),
        "llama2c-v0": (write_llama2c(model, llama2c_dir / "model_v0.bin", version=0), "llama2c"),
        "llama2c-v1": (write_llama2c(model, llama2c_dir / "model_v1.bin", version=1), "llama2c"),
    }


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_every_layout_loads_to_the_same_logits(tmp_path, tokenizer_model, vocab, tie):
    model = random_model(tiny_args(vocab, tie_embeddings=tie), seed=3)
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))
    want = _logits(model, tokens)
    for name, (path, layout) in _write_all(model, tmp_path, tokenizer_model).items():
        assert detect_layout(path) == layout, name
        loaded = load_model(path, device="cpu", dtype="float32")
        assert loaded.layout == layout
        assert loaded.args.tie_embeddings == tie, name
        assert (loaded.model.output.weight is loaded.model.tok_embeddings.weight) == tie, name
        got = _logits(loaded.model, tokens)
        assert (got - want).abs().max().item() <= 1e-5, name


def test_weights_file_paths_load_like_their_directory(tmp_path, tokenizer_model, vocab):
    model = random_model(tiny_args(vocab), seed=4)
    meta = write_meta_checkpoint(model, tmp_path / "meta", tokenizer_model)
    hf = write_hf_checkpoint(model, tmp_path / "hf", tokenizer_model)
    for path in (meta / "consolidated.00.pth", meta / "params.json", hf / "model.safetensors", hf / "config.json"):
        assert load_model(path, device="cpu").layout == detect_layout(path.parent)
    assert load_model(meta, device="cpu").name == "meta"


def test_single_llama2c_bin_in_a_directory_is_found(tmp_path, tokenizer_model, vocab):
    model = random_model(tiny_args(vocab), seed=5)
    write_llama2c(model, tmp_path / "stories.bin", version=1)
    (tmp_path / "tokenizer.model").write_bytes(tokenizer_model.read_bytes())
    loaded = load_model(tmp_path, device="cpu")
    assert (loaded.layout, loaded.name, loaded.args.max_seq_len) == ("llama2c", "stories", 256)


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "pre-zip"])
def test_pytorch_model_bin_is_read_like_safetensors(tmp_path, tokenizer_model, vocab, zip_format):
    model = random_model(tiny_args(vocab), seed=6)
    out = write_hf_checkpoint(model, tmp_path / "hf", tokenizer_model)
    (out / "model.safetensors").unlink()
    # torch < 1.6 wrote a format that cannot be memory-mapped; it is read whole instead.
    torch.save(hf_state(model), out / "pytorch_model.bin", _use_new_zipfile_serialization=zip_format)
    tokens = torch.arange(16).unsqueeze(0)
    got = _logits(load_model(out, device="cpu").model, tokens)
    assert (got - _logits(model, tokens)).abs().max().item() <= 1e-5


def test_params_json_without_vocab_size_takes_the_tokenizers(tmp_path, tokenizer_model, vocab):
    model = random_model(tiny_args(vocab), seed=7)
    out = write_meta_checkpoint(model, tmp_path / "meta", tokenizer_model)
    params = json.loads((out / "params.json").read_text())
    params["vocab_size"] = -1
    (out / "params.json").write_text(json.dumps(params))
    assert load_model(out, device="cpu").args.vocab_size == vocab


def test_padded_vocabulary_is_fine(tmp_path, tokenizer_model, vocab):
    model = random_model(tiny_args(vocab + 112), seed=8)
    loaded = load_model(write_meta_checkpoint(model, tmp_path / "meta", tokenizer_model), device="cpu")
    assert loaded.args.vocab_size == vocab + 112 and loaded.tokenizer.vocab_size == vocab


def test_dtype_context_and_progress(tmp_path, tokenizer_model, vocab):
    model = random_model(tiny_args(vocab, max_seq_len=8192), seed=9)
    out = write_meta_checkpoint(model, tmp_path / "meta", tokenizer_model)
    calls: list[tuple[int, int]] = []
    loaded = load_model(out, device="cpu", dtype="bfloat16", on_progress=lambda d, t: calls.append((d, t)))
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.dtype == torch.bfloat16 and loaded.device == torch.device("cpu")
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.args.max_seq_len == DEFAULT_MAX_SEQ_LEN  # 8192 in the checkpoint, capped
    total = sum(v.numel() * 4 for v in model.state_dict().values())
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))
    assert load_model(out, device="cpu", max_seq_len=100).args.max_seq_len == 100
    tokens = torch.arange(12).unsqueeze(0)
    diff = (_logits(loaded.model, tokens) - _logits(model, tokens)).abs().max().item()
    assert diff < 0.25  # bfloat16 weights: close, not equal


def test_llama2c_with_its_own_tokenizer_bin(tmp_path, tokenizer_model, vocab):
    from tokenizer_builders import write_llama2c_tokenizer

    model = random_model(tiny_args(vocab, tie_embeddings=True), seed=10)
    path = write_llama2c(model, tmp_path / "stories.bin", version=0)
    write_llama2c_tokenizer(tmp_path / "tokenizer.bin", tokenizer_model)
    loaded = load_model(path, device="cpu")
    assert loaded.tokenizer.vocab_size == vocab
    assert type(loaded.tokenizer).__name__ == "Llama2cTokenizer"
    tokens = torch.tensor([loaded.tokenizer.encode("Once upon a time", bos=True)])
    assert (_logits(loaded.model, tokens) - _logits(model, tokens)).abs().max().item() <= 1e-5
