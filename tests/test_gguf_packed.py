"""Quantized GGUF files run as they are: on the CPU with no ``--dtype``, their matrices are packed
layers over the file's own bytes (``ml/packed.py``); ``--quantize q8_0|q4_0`` packs a float
checkpoint's as it loads.

Greedy ids of the packed model are compared with the float32 path's on the same dequantized
weights. The packed products round the activations to int8 steps (``ml/packed.py``), so a step
whose two best float32 logits are closer than ``NEAR_TIE`` may go either way: such steps are
excused, and only they (the logits' differences here stay under a third of it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from builders import decode_one, random_model, tiny_args, train_sentencepiece, write_meta_checkpoint  # noqa: E402
from builders_gguf import DEFAULT_ROPE, T, hf_config, hf_llama, write_gguf  # noqa: E402
from cli_support import run_cli  # noqa: E402
from llama_chat.ml.packed import PackedEmbedding, PackedLinear, pack  # noqa: E402
from llama_chat.model.errors import ModelLoadError  # noqa: E402
from llama_chat.model.formats.common import in_file_mapping  # noqa: E402
from llama_chat.model.kv_cache import KVCache  # noqa: E402
from llama_chat.model.loader import load_model  # noqa: E402

KINDS = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k": T.Q4_K}
PROMPT_LEN = 16
NEW_TOKENS = 16
# Logits (float32 path) closer than this at a step: the packed path may pick either token there.
NEAR_TIE = 0.2
PROJECTIONS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
               "feed_forward.w2", "feed_forward.w3")
GGUF_NAMES = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
              "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down",
              "feed_forward.w3": "ffn_up"}


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), vocab_size=400)


@pytest.fixture(scope="module")
def files(tmp_path_factory, sp_model) -> dict[tuple[str, bool], Path]:
    """A tiny model (dim 256: whole Q4_K super-blocks) in each kind, untied and tied."""
    out = tmp_path_factory.mktemp("packed")
    made = {}
    for tied in (False, True):
        hf = hf_llama(416, heads=8, kv_heads=2, tied=tied, rope=DEFAULT_ROPE, seed=3)
        for kind, qtype in KINDS.items():
            made[kind, tied] = write_gguf(out / f"{kind}-{'tied' if tied else 'untied'}.gguf", hf.state_dict(),
                                          hf_config(hf), qtype=qtype, sp_model=sp_model)
    return made


def _layers(model) -> dict[str, torch.nn.Module]:
    found = {"output": model.output}
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            found[f"blk.{i}.{GGUF_NAMES[name]}"] = layer.get_submodule(name)
    return found


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_projections_are_packed_views_of_the_file(files, kind, tied):
    path = files[kind, tied]
    loaded = load_model(path, device="cpu")
    model = loaded.model
    offsets = {t.name: int(t.data_offset) for t in gguf.GGUFReader(path).tensors}
    embedding = model.tok_embeddings
    assert isinstance(embedding, PackedEmbedding) and embedding.kind == kind
    for name, layer in _layers(model).items():
        assert isinstance(layer, PackedLinear) and layer.kind == kind, name
        data = layer.data
        # The file's bytes where the file has them: one storage, the whole file's mapping.
        assert data.untyped_storage().nbytes() == path.stat().st_size, name
        assert in_file_mapping(data), name
        source = "token_embd.weight" if name == "output" and tied else f"{name}.weight"
        assert data.data_ptr() - data.untyped_storage().data_ptr() == offsets[source], name
    if tied:
        assert model.output.data.data_ptr() == embedding.data.data_ptr()  # one buffer for both
    assert embedding.data.data_ptr() - embedding.data.untyped_storage().data_ptr() == offsets["token_embd.weight"]
    for norm in (model.norm, model.layers[0].attention_norm, model.layers[1].ffn_norm):
        assert norm.weight.dtype == torch.float32
    summary = loaded.weights()
    assert summary.format.endswith(f"packed {kind}")
    assert summary.nbytes == sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)  # the file's tensors, once


def _greedy_with_gaps(model, prompt: torch.Tensor, n: int) -> tuple[list[int], list[float]]:
    """Greedy ids and, at each step, the gap between the two best logits."""
    ids, gaps = [], []
    for logits in _steps(model, prompt, n, ids):
        top = logits.topk(2).values
        gaps.append(float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return ids, gaps


def _steps(model, prompt: torch.Tensor, n: int, ids: list[int]):
    """The last logits of ``prompt``, then of each id appended to ``ids`` (by the caller or given)."""
    cache = KVCache.for_model(model.args, 1, max_seq_len=prompt.shape[1] + n)
    pos = prompt.shape[1]
    with torch.inference_mode():
        logits = model(prompt, torch.arange(pos).unsqueeze(0), cache, last_only=True)
        for step in range(n):
            yield logits[0, -1]
            logits = decode_one(model, ids[step], pos, cache)
            pos += 1


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_ids_are_the_float_paths_but_at_near_ties(files, kind, tied):
    path = files[kind, tied]
    packed = load_model(path, device="cpu").model
    expanded = load_model(path, device="cpu", dtype="float32").model
    assert isinstance(expanded.layers[0].attention.wq, torch.nn.Linear)
    prompt = torch.randint(3, 400, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    want, gaps = _greedy_with_gaps(expanded, prompt, NEW_TOKENS)
    # Run freely, the packed model gives the same ids up to the first near tie.
    got, _ = _greedy_with_gaps(packed, prompt, NEW_TOKENS)
    first_tie = next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), NEW_TOKENS)
    assert got[:first_tie] == want[:first_tie], (got, want, gaps)
    # Fed the float path's ids, it picks the same at every step that is not a near tie.
    fed = [int(logits.argmax()) for logits in _steps(packed, prompt, NEW_TOKENS, want)]
    compared = [i for i, gap in enumerate(gaps) if gap >= NEAR_TIE]
    assert len(compared) >= NEW_TOKENS // 2, gaps  # a test of something
    assert [fed[i] for i in compared] == [want[i] for i in compared], (fed, want, gaps)


def test_an_explicit_dtype_expands_every_matrix(files):
    loaded = load_model(files["q4_k", True], device="cpu", dtype="float32")
    model = loaded.model
    assert type(model.tok_embeddings) is torch.nn.Embedding and model.tok_embeddings.weight.dtype == torch.float32
    for name, layer in _layers(model).items():
        assert type(layer) is torch.nn.Linear and layer.weight.dtype == torch.float32, name
    assert loaded.weights().format.endswith("float32")
    half = load_model(files["q8_0", False], device="cpu", dtype="bfloat16").model
    assert half.layers[1].feed_forward.w2.weight.dtype == torch.bfloat16


def test_kinds_not_packed_are_expanded_and_fused_groups_stay_whole(tmp_path, sp_model):
    """Like llama.cpp's Q3_K_M: q/k in Q3_K (not packed), v in Q5_K, ffn_down in Q4_K. The v rows
    are fused with q and k, so they are expanded too; ffn_down stays packed."""
    hf = hf_llama(416, heads=8, kv_heads=2, tied=False, rope=DEFAULT_ROPE, seed=4)
    kinds = {}
    for i in range(2):
        kinds |= {f"model.layers.{i}.self_attn.v_proj.weight": T.Q5_K, f"model.layers.{i}.mlp.down_proj.weight": T.Q4_K}
    path = write_gguf(tmp_path / "q3_k_m.gguf", hf.state_dict(), hf_config(hf), qtype=T.Q3_K, sp_model=sp_model,
                      qtype_for=kinds)
    loaded = load_model(path, device="cpu")
    model = loaded.model
    attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
    assert all(type(p) is torch.nn.Linear for p in (attention.wq, attention.wk, attention.wv, ffn.w1, ffn.w3))
    assert isinstance(ffn.w2, PackedLinear) and ffn.w2.kind == "q4_k"
    assert type(model.tok_embeddings) is torch.nn.Embedding  # Q3_K
    assert loaded.weights().format.endswith("packed q4_k, float32")
    prompt = torch.randint(3, 400, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        before = model(prompt)
        model.fuse_projections()  # as the engine does
        assert type(model.layers[0].attention.wqkv) is torch.nn.Linear
        torch.testing.assert_close(model(prompt), before, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory, sp_model) -> Path:
    """A tiny float32 Meta checkpoint: dim 64, ffn 160 (whole blocks of 32 everywhere)."""
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(sp_model)).vocab_size()
    model = random_model(tiny_args(vocab), seed=5)
    return write_meta_checkpoint(model, tmp_path_factory.mktemp("float") / "tiny", sp_model)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantize_packs_a_float_checkpoint_as_it_loads(float_checkpoint, kind):
    floats = load_model(float_checkpoint, device="cpu").model
    loaded = load_model(float_checkpoint, device="cpu", quantize=kind)
    model = loaded.model
    for name, layer in _layers(model).items():
        assert isinstance(layer, PackedLinear) and layer.kind == kind, name
    assert type(model.tok_embeddings) is torch.nn.Embedding  # one row read per token: it stays float
    # Streamed a chunk of rows at a time, the blocks are those of packing each whole weight.
    want = pack(kind, floats.layers[1].feed_forward.w2.weight)
    assert torch.equal(model.layers[1].feed_forward.w2.data, want.data)
    assert torch.equal(model.output.data, pack(kind, floats.output.weight).data)
    assert loaded.weights().format == f"packed {kind}"
    prompt = torch.randint(3, 400, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        got, reference = model(prompt), floats(prompt)
    # Near the float model: test_gguf.py's bounds for files of these types (random weights, the
    # hardest case for blocks; this model's activations grow through its layers).
    spread = (reference - reference.mean(-1, keepdim=True)).norm()
    assert ((got - reference).norm() / spread).item() < {"q8_0": 0.06, "q4_0": 0.75}[kind]


def test_a_gguf_of_the_kind_asked_for_keeps_its_blocks(files):
    model = load_model(files["q8_0", False], device="cpu", quantize="q8_0").model
    layer = model.layers[0].attention.wq
    assert isinstance(layer, PackedLinear) and in_file_mapping(layer.data)
    assert type(model.tok_embeddings) is torch.nn.Embedding
    requantized = load_model(files["q4_k", False], device="cpu", quantize="q4_0").model.layers[0].attention.wq
    assert isinstance(requantized, PackedLinear) and requantized.kind == "q4_0"
    assert not in_file_mapping(requantized.data)


def test_an_unknown_quantization_is_one_line(files):
    with pytest.raises(ModelLoadError, match=r"^quantization 'q5_0' is not supported \(expected none, int8, q8_0 or "
                                             r"q4_0\)$"):
        load_model(files["q8_0", False], device="cpu", quantize="q5_0")
    run = run_cli("-m", str(files["q8_0", False]), "--quantize", "q5_0", "-p", "hi", "--no-stdin", timeout=120)
    assert run.returncode == 2
    lines = run.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and "--quantize" in lines[0] and "'q5_0'" in lines[0], run.stderr


def _stats_weights(stderr: bytes) -> str:
    stats = stderr.decode().splitlines()[-1]
    found = re.search(r"weights: (.+?) \(([\d.]+) (KB|MB|GB)\)$", stats)
    assert found, stats
    return found.group(1)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_the_command_generates_with_a_packed_float_checkpoint_and_says_so(float_checkpoint, kind):
    base = ("-m", str(float_checkpoint), "-p", "hello there", "-n", "8", "-t", "0", "--no-stdin")
    proc = run_cli(*base, "--quantize", kind, "--stats")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.strip()
    assert _stats_weights(proc.stderr) == f"packed {kind}"
    result = json.loads(run_cli(*base, "--quantize", kind, "--json").stdout)
    assert result["completion_tokens"] == 8 and result["finish_reason"] == "max_tokens"


def test_the_command_runs_a_packed_gguf_and_stats_name_its_format(files):
    path = files["q4_k", True]
    file_type = gguf.GGUFReader(path).fields["general.file_type"].contents()
    proc = run_cli("-m", str(path), "-p", "hello there", "-n", "8", "-t", "0", "--no-stdin", "--stats")
    assert proc.returncode == 0, proc.stderr.decode()
    assert _stats_weights(proc.stderr) == f"{gguf.LlamaFileType(file_type).name.split('_', 1)[1]}, packed q4_k"
    expanded = run_cli("-m", str(path), "-p", "hello there", "-n", "8", "-t", "0", "--no-stdin", "--stats",
                       "--dtype", "float32")
    assert expanded.returncode == 0, expanded.stderr.decode()
    assert _stats_weights(expanded.stderr).endswith(", float32")


def test_the_chats_stats_name_the_weights(files, tmp_path):
    import pexpect

    from cli_support import cli_env, spawn_cli

    child = spawn_cli(["-m", str(files["q4_k", True]), "--template", "llama2", "-n", "4",
                       "-t", "0"], env=cli_env(XDG_STATE_HOME=str(tmp_path)), timeout=120,
                      encoding="utf-8", dimensions=(40, 200))
    child.expect_exact(">>> ")
    child.sendline("hello")
    child.expect_exact(">>> ")
    child.sendline("/stats")
    child.expect(r"weights:\s+\S+,\s+packed\s+q4_k\s+\(\d")  # wrapped at spaces, as the terminal is narrow
    child.expect_exact(">>> ")
    child.sendline("/exit")
    child.expect(pexpect.EOF)
