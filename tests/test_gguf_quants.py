"""GGUF block types: every dequantizer bit for bit against the ``gguf`` package's, a tiny model in
each of the newer types (one also through the ``llama-chat`` process), and the bad forms block
data takes.

The files are written with the ``gguf`` package's writer (``builders_gguf.write_gguf``); the
greedy tokens are compared with ``transformers`` running the weights that the
``gguf`` package itself reads from the same file.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from builders import train_sentencepiece  # noqa: E402
from builders_gguf import DEFAULT_ROPE, T, hf_config, hf_llama, hf_with_file_weights, write_gguf  # noqa: E402
from cli_support import run_cli  # noqa: E402
from llama_chat.inference.scheduler import Scheduler  # noqa: E402
from llama_chat.inference.types import GenerationState, Request  # noqa: E402
from llama_chat.ml import blocks as gguf_quants  # noqa: E402
from llama_chat.ml.sampling import SamplingParams  # noqa: E402
from llama_chat.model.formats.gguf import open_gguf  # noqa: E402
from llama_chat.model.loader import load_model  # noqa: E402

# Byte offsets of each type's float16 scales (ggml-common.h): random bytes everywhere else cover
# every bit pattern of every field; these are made finite so that values can be compared.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82),
              "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
NEW_TYPES = [T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS]
PROMPT = "Once upon a time"
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0)
WORKERS = 4  # processes at a time: each spends most of its time importing torch


def _random_blocks(fmt: gguf_quants.BlockFormat, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, fmt.block_bytes), dtype=np.uint8)
    for offset in F16_FIELDS[fmt.name]:
        blocks[:, offset:offset + 2] = np.float16(rng.uniform(-2, 2, size=(n, 1))).view(np.uint8)
    return blocks


def _reference(blocks: np.ndarray, ggml_type: int) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(ggml_type)).reshape(-1).astype(np.float32)


def test_the_block_types_read_are_these():
    assert [f.name for f in gguf_quants.BLOCKS.values()] == list(F16_FIELDS)
    for ggml_type, fmt in gguf_quants.BLOCKS.items():  # ids, names and sizes as the gguf package has them
        qtype = gguf.GGMLQuantizationType(ggml_type)
        assert (qtype.name, *gguf.GGML_QUANT_SIZES[qtype]) == (fmt.name, fmt.block_values, fmt.block_bytes)


@pytest.mark.parametrize("ggml_type", list(gguf_quants.BLOCKS), ids=lambda t: gguf_quants.BLOCKS[t].name)
def test_dequantizers_match_the_gguf_package_on_random_blocks(ggml_type):
    fmt = gguf_quants.BLOCKS[ggml_type]
    blocks = _random_blocks(fmt, 96, ggml_type)
    want = _reference(blocks, ggml_type)
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    got = fmt.dequantize(raw)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)
    into = torch.full((want.size,), float("nan"))  # straight into a float32 tensor, as the loader does
    fmt.dequantize(raw, out=into)
    np.testing.assert_array_equal(into.numpy(), want)
    for blocks_taken in (96, 1):  # bytes that are not 8-byte aligned; a single block (a slice of one row)
        for offset in (1, 2, 8):
            part = raw[:blocks_taken * fmt.block_bytes]
            shifted = torch.empty(part.numel() + offset, dtype=torch.uint8)[offset:]
            shifted.copy_(part)
            np.testing.assert_array_equal(fmt.dequantize(shifted).numpy(), want[:blocks_taken * fmt.block_values])


def test_dequantize_takes_raw_blocks_a_type_and_a_shape():
    fmt = gguf_quants.BLOCKS[gguf_quants.Q3_K]
    blocks = _random_blocks(fmt, 8, 0)
    got = gguf_quants.dequantize(torch.from_numpy(blocks.reshape(-1).copy()), gguf_quants.Q3_K, (4, 512))
    assert got.shape == (4, 512)
    np.testing.assert_array_equal(got.numpy().reshape(-1), _reference(blocks, gguf_quants.Q3_K))
    with pytest.raises(ValueError, match="do not hold a tensor of shape"):
        gguf_quants.dequantize(torch.zeros(110 * 8, dtype=torch.uint8), gguf_quants.Q3_K, (4, 500))
    with pytest.raises(ValueError, match="not a block type"):
        gguf_quants.dequantize(torch.zeros(16, dtype=torch.uint8), gguf_quants.F32, (4,))


# -- whole files through the command -------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), vocab_size=400)


@pytest.fixture(scope="module")
def reference():
    """dim 256 (K and IQ4_XS types cut rows into blocks of 256), grouped-query, untied; the eos
    row of the output is zero, so a greedy run never ends early on its own."""
    hf = hf_llama(416, heads=4, kv_heads=2, tied=False, rope=DEFAULT_ROPE, seed=5)
    with torch.no_grad():
        hf.lm_head.weight[2] = 0.0
    return hf


def test_a_tiny_model_in_each_new_type_generates_transformers_tokens(tmp_path, sp_model, reference):
    # Each type read and run in this process; one of them through the command as well (the command
    # adds nothing per type, and every process spends seconds importing torch).
    paths = [write_gguf(tmp_path / f"{q.name}.gguf", reference.state_dict(), hf_config(reference), qtype=q,
                        sp_model=sp_model) for q in NEW_TYPES]
    tokenizer = load_model(paths[0], device="cpu").tokenizer
    prompt = tokenizer.encode(PROMPT, bos=tokenizer.add_bos)
    # --dtype float32: the weights expanded, so that the tokens are exactly transformers' (the
    # packed products of the default round the activations: tests/test_gguf_packed.py).
    proc = run_cli("-m", str(paths[0]), "-p", PROMPT, "-n", str(NEW_TOKENS), "-t", "0", "--json", "--no-stdin",
                   "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr.decode()
    result = json.loads(proc.stdout)
    assert result["prompt_tokens"] == len(prompt) and result["finish_reason"] == "max_tokens"
    commanded = result["token_ids"]
    for qtype, path in zip(NEW_TYPES, paths):
        loaded = load_model(path, device="cpu", dtype=torch.float32)
        got = Scheduler.from_loaded(loaded).generate(Request(prompt, sampling=GREEDY, max_tokens=NEW_TOKENS))
        same = hf_with_file_weights(reference, path)
        with torch.inference_mode():
            want = same.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert list(got.token_ids) == want, qtype.name
        assert got.finish_reason == GenerationState.MAX_TOKENS
        if path == paths[0]:
            assert commanded == want


def _header_patch(path: Path, tensor: str, row_values: int) -> None:
    """Rewrite the first dimension (the row length) of ``tensor`` in ``path``'s header."""
    data = bytearray(path.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    assert n_dims == 2
    struct.pack_into("<Q", data, at + 4, row_values)
    path.write_bytes(bytes(data))


def _run_all(commands: list[list[str]]) -> list:
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(lambda args: run_cli(*args), commands))


def test_bad_block_data_is_one_line_and_exit_2(tmp_path, sp_model, reference):
    state, config = reference.state_dict(), hf_config(reference)
    # A file whose last block is cut short.
    cut = write_gguf(tmp_path / "cut.gguf", state, config, qtype=T.Q3_K, sp_model=sp_model)
    last = max(open_gguf(cut).tensors.values(), key=lambda t: t.offset)
    assert last.nbytes % 110 == 0
    end = last.offset + last.nbytes
    with open(cut, "r+b") as f:
        f.truncate(end - 50)
    # A tensor whose rows are not whole blocks.
    rows = write_gguf(tmp_path / "rows.gguf", state, config, qtype=T.Q4_1, sp_model=sp_model)
    _header_patch(rows, "blk.0.ffn_down.weight", 500)
    # A block type that is not read.
    other = write_gguf(tmp_path / "tq.gguf", state, config, qtype=T.Q4_1, sp_model=sp_model,
                       qtype_for={"model.layers.1.mlp.up_proj.weight": T.TQ2_0})
    cases = {
        cut: f"cut.gguf: truncated: tensor {last.name!r} ends at byte {end:,}, the file has {end - 50:,}",
        rows: "rows.gguf: tensor 'blk.0.ffn_down.weight' has rows of 500 values, not a multiple of its type's "
              "blocks of 32",
        other: "tq.gguf: tensor 'blk.1.ffn_up.weight' has type TQ2_0, which is not supported (expected F32, F16, "
               "BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL or IQ4_XS)",
    }
    results = _run_all([["-m", str(p), "-p", "hi", "-n", "2", "--no-stdin"] for p in cases])
    for (path, message), proc in zip(cases.items(), results):
        err = proc.stderr.decode()
        assert proc.returncode == 2, (path.name, err)
        assert err == f"llama-chat: error: {message}\n"
