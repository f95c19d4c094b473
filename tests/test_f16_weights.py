"""16-bit GGUF weights run as they are: on the CPU with no ``--dtype``, a file's F16 (and BF16)
matrices are ``ml/half.py``'s layers over the file's own bytes, and the products read them as
they are (``ml/cpu/dot.h``: each weight converted exactly to float32, float32 sums).

What is compared with what:

* the dot products of ``dot.h`` on float16 weights against the same products on their float32
  conversion, in a build with AVX-512, one without (``-mno-avx512f``: AVX2) and one without AVX
  (``-mno-avx``: the scalar code): equal to the bit where the additions are made in the same
  order (AVX2 and scalar), within the float32 summation bound where they are not (AVX-512's
  sixteen lanes against eight);
* the operator's products and the no-compiler fallback (tiles converted to float32, then a
  matrix product) against float64 products of the converted weights, within that bound;
* a model from an F16 GGUF file against the same file expanded to float32 (``--dtype float32``):
  the same greedy ids (the weights are ``hf_llama``'s, whose greedy choices are well separated)
  and logits within a stated tolerance;
* the peak RSS of the command on an F16 file, in a process of its own, against the memory rule:
  at most 1.1x the file, plus the KV cache, plus the same command's peak on a tiny file.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from builders import (OPERATOR_VARIANT_LOAD, decode_one, skip_where_the_native_build_lacks,  # noqa: E402
                      train_sentencepiece)
from builders_gguf import DEFAULT_ROPE, T, hf_config, hf_llama, write_gguf  # noqa: E402
from cli_support import cli_env, fork_server, llama_chat_command, run_cli, run_python  # noqa: E402
from llama_chat.ml import half, ops  # noqa: E402
from llama_chat.ml.cpu import kernels as cpu_kernels  # noqa: E402
from llama_chat.ml.packed import PackedLinear  # noqa: E402
from llama_chat.model import cpu_decode  # noqa: E402
from llama_chat.model.formats.common import in_file_mapping  # noqa: E402
from llama_chat.model.kv_cache import KVCache  # noqa: E402
from llama_chat.model.paged_kv_cache import PagedKVCache  # noqa: E402
from llama_chat.model.loader import load_model  # noqa: E402

COMPILER = shutil.which(os.environ.get("CXX") or "c++")
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler")
X86 = platform.machine().lower() in ("x86_64", "amd64")
# Builds with x86 instruction sets taken away (the native build runs anywhere).
BUILDS = [pytest.param("", id="native"),
          pytest.param("-mno-avx512f", id="avx2", marks=pytest.mark.skipif(not X86, reason="x86 only")),
          pytest.param("-mno-avx", id="scalar", marks=pytest.mark.skipif(not X86, reason="x86 only"))]
TAKES_AWAY = {"-mno-avx512f": "__AVX512F__", "-mno-avx": "__AVX__"}
CPU_DIR = Path(cpu_kernels.__file__).parent
UNIT = 2.0 ** -24  # float32's unit roundoff
PROMPT_LEN = 40  # more rows than the operator takes: the prompt goes through the tiles
NEW_TOKENS = 16
# |logit difference| of the 16-bit model and the float32 one, relative to the largest logit: the
# same products summed in another order, through two layers.
LOGIT_TOLERANCE = 1e-4


def summation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What float32 sums of ``x @ w.T`` may be off the exact value, in any order of additions:
    (k + 2) unit roundoffs of the sum of the products' magnitudes."""
    return (x.shape[-1] + 2) * UNIT * (x.double().abs() @ w.double().abs().T)


# --- dot.h in three builds ----------------------------------------------------------------------

# Reads cases (k, then four rows of k inputs and three rows of k float16 weights) and writes, per
# case, on the float16 weights and then on their float32 conversion: dot of the first rows, dot4
# of each weight row, dot3x4 of the three; then f16_to_float of every bit pattern. The first value
# says whether the build has AVX-512.
_DOT_PROGRAM = r"""
#include "dot.h"
#include <cstdio>
#include <vector>
using namespace llama_chat_cpu;

template <typename W>
void products(const float* x, int64_t k, const W* w, std::vector<float>& out) {
  out.push_back(dot(x, w, k));
  float four[4], twelve[12];
  for (int q = 0; q < 3; ++q) {
    dot4(x, k, w + q * k, k, four);
    out.insert(out.end(), four, four + 4);
  }
  dot3x4(x, k, w, k, twelve);
  out.insert(out.end(), twelve, twelve + 12);
}

int main(int argc, char** argv) {
  FILE* in = std::fopen(argv[1], "rb");
  std::vector<float> out;
#ifdef __AVX512F__
  out.push_back(1.f);
#else
  out.push_back(0.f);
#endif
  int64_t k;
  while (std::fread(&k, sizeof k, 1, in) == 1) {
    std::vector<float> x(4 * k), converted(3 * k);
    std::vector<F16> w(3 * k);
    if (std::fread(x.data(), sizeof(float), x.size(), in) != x.size()) return 1;
    if (std::fread(w.data(), sizeof(F16), w.size(), in) != w.size()) return 1;
    for (int64_t i = 0; i < 3 * k; ++i) converted[i] = f16_to_float(w[i].bits);
    products(x.data(), k, w.data(), out);
    products(x.data(), k, converted.data(), out);
  }
  for (uint32_t h = 0; h < 65536; ++h) out.push_back(f16_to_float(static_cast<uint16_t>(h)));
  FILE* o = std::fopen(argv[2], "wb");
  std::fwrite(out.data(), sizeof(float), out.size(), o);
  return 0;
}
"""
_PER_STORAGE = 1 + 12 + 12
_LENGTHS = (1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 255, 256, 300, 1000)


def _dot_cases(rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    cases = []
    for k in _LENGTHS:
        x = rng.standard_normal((4, k)).astype(np.float32)
        w = (rng.standard_normal((3, k)) * 0.5).astype(np.float16)
        # float16's edges among them: subnormals, a negative zero, the largest finite value
        flat = w.reshape(-1)
        flat[rng.integers(0, flat.size, size=min(4, flat.size))] = np.float16(3e-6)
        flat[0] = np.float16(-0.0)
        flat[-1] = np.float16(65504.0)
        cases.append((x, w))
    return cases


@needs_compiler
@pytest.mark.parametrize("flags", BUILDS)
def test_float16_dot_products_are_the_float32_ones_on_the_converted_weights(tmp_path, flags):
    source = tmp_path / "dots.cpp"
    source.write_text(_DOT_PROGRAM)
    binary = tmp_path / "dots"
    build = subprocess.run([COMPILER, "-O3", "-std=c++17", "-march=native", *flags.split(), f"-I{CPU_DIR}",
                            str(source), "-o", str(binary)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    cases = _dot_cases(np.random.default_rng(7))
    with open(tmp_path / "in.bin", "wb") as f:
        for x, w in cases:
            f.write(np.int64(x.shape[1]).tobytes() + x.tobytes() + w.tobytes())
    run = subprocess.run([str(binary), str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], capture_output=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    out = np.fromfile(tmp_path / "out.bin", dtype=np.float32)
    wide, out = bool(out[0]), out[1:]
    if X86 and Path("/proc/cpuinfo").is_file():
        assert wide == (flags == "" and "avx512f" in Path("/proc/cpuinfo").read_text())
    # The conversion: every float16 bit pattern to the float32 of the same value (NaNs stay NaNs).
    converted, want = out[-65536:], np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert (np.isnan(converted) == nan).all()
    assert (converted[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()
    results = out[:-65536].reshape(len(cases), 2, _PER_STORAGE)
    for (x, w), (halves, floats) in zip(cases, results):
        k = x.shape[1]
        for got in (halves, floats):
            # dot3x4's sums are dot4's to the bit (a range of weight rows takes them three at a
            # time and its last one or two alone, wherever the range ends).
            assert got[13:25].view(np.uint32).tolist() == got[1:13].view(np.uint32).tolist(), k
        if not wide:  # the same order of additions: the same bits
            assert halves.view(np.uint32).tolist() == floats.view(np.uint32).tolist(), k
        xs, ws = torch.from_numpy(x), torch.from_numpy(w.astype(np.float32))
        exact, bound = (xs.double() @ ws.double().T).T, summation_bound(xs, ws).T  # (weight row, input row)
        for got in (halves, floats):
            values = np.concatenate([got[:1], got[1:13]])
            wanted = np.concatenate([exact[0, :1].numpy(), exact.reshape(-1).numpy()])
            bounds = np.concatenate([bound[0, :1].numpy(), bound.reshape(-1).numpy()])
            assert (np.abs(values - wanted) <= bounds).all(), k


# --- the products ---------------------------------------------------------------------------------


def _half_case(dtype: torch.dtype, rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g), (torch.randn(n, k, generator=g) * 0.3).to(dtype)


def _assert_product(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    converted = weight.float()
    want = x.double() @ converted.double().T
    assert got.dtype == x.dtype and got.shape == want.shape
    assert ((got.double() - want).abs() <= summation_bound(x, converted)).all()


# (rows, outputs, inputs): a decode step's few rows (weight rows one at a time), and a prompt's
# (panels converted a few at a time): panels cut short, runs of inputs past kernels.cpp's 1,024
# at a time, rows past what it interleaves at once.
SHAPES = [(1, 37, 300), (3, 37, 300), (4, 37, 300), (9, 37, 300), (16, 37, 300), (17, 37, 300), (40, 45, 300),
          (33, 64, 1100), (300, 45, 1100)]


@pytest.mark.parametrize("dtype", half.DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["x".join(map(str, s)) for s in SHAPES])
def test_products_of_16_bit_weights_are_those_of_their_float32_conversion(cpu_kernels_loaded, dtype, shape):
    rows, n, k = shape
    x, weight = _half_case(dtype, rows, n, k, seed=rows)
    assert half.mixed(x, weight) and not half.mixed(x.to(dtype), weight)
    assert cpu_kernels.takes(x, weight) == bool(cpu_kernels_loaded)  # any rows: see kernels.takes
    _assert_product(half.product(x, weight), x, weight)
    _assert_product(ops.linear(x, weight), x, weight)  # how a model's projections reach it
    layer = half.HalfLinear(weight)
    assert list(layer.parameters()) == [] and layer.weight is weight
    _assert_product(layer(x.view(1, rows, k)).view(rows, n), x, weight)
    # Rows of the weights' own dtype (``--dtype bfloat16``) keep the operator for few rows only
    # (float16 rows never had it).
    few = bool(cpu_kernels_loaded) and rows <= cpu_kernels.MAX_ROWS and dtype == torch.bfloat16
    assert cpu_kernels.takes(x.to(dtype), weight) == few


@pytest.mark.parametrize("dtype", half.DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_without_the_operator_products_are_tiles_converted_to_float32(pytorch_products, monkeypatch, dtype, rows):
    # The no-compiler path.
    x, weight = _half_case(dtype, rows, 37, 300, seed=rows)
    assert not cpu_kernels.takes(x, weight)
    _assert_product(half.product(x, weight), x, weight)
    monkeypatch.setattr(half, "TILE_VALUES", 300 * 5)  # eight tiles, the last one of two rows
    _assert_product(half.product(x, weight), x, weight)
    _assert_product(ops.linear(x.view(rows, 1, 300), weight).view(rows, 37), x, weight)
    # Rows of the weights' own dtype are that dtype's product, as before.
    assert ops.linear(x.to(dtype), weight).dtype == dtype


@needs_compiler
def test_the_operator_multiplies_float16_weights_as_their_float32_conversion(cpu_kernels_loaded):
    # In this build: within the summation bound (AVX-512 sums sixteen lanes, float32 rows eight;
    # a prompt's rows take panels); bit-equal builds are checked with dot.h above and, for the
    # operator, in the slow test below.
    assert cpu_kernels_loaded, cpu_kernels.failure()
    for rows in (*range(1, cpu_kernels.MAX_ROWS + 1), 17, 31, 64):
        x, weight = _half_case(torch.float16, rows, 29 + rows, 7 + 37 * rows, seed=rows)
        _assert_product(cpu_kernels.matvec(x, weight), x, weight)


# A build of the operator's products alone (kernels.cpp) with instruction sets taken away, in a
# process of its own: it writes each case's product on the float16 weights and on their float32
# conversion: a decode step's rows read both as weight rows, in the same order of additions.
_VARIANT_SCRIPT = OPERATOR_VARIANT_LOAD + """
cases = torch.load(sys.argv[1])
torch.save([(kernels.matvec(x, w), kernels.matvec(x, w.float())) for x, w in cases], sys.argv[2])
"""


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("flags", BUILDS[1:])
def test_the_operator_built_without_avx512_gives_float16_products_equal_to_float32_ones(tmp_path, flags,
                                                                                        operator_variant_env):
    skip_where_the_native_build_lacks(TAKES_AWAY[flags])
    cases = [_half_case(torch.float16, rows, 29, k, seed=rows) for rows in range(1, 17) for k in (5, 64, 300)]
    prompts = [_half_case(torch.float16, rows, n, k, seed=rows) for rows, n, k in SHAPES if rows > 16]
    torch.save(cases + prompts, tmp_path / "cases.pt")
    run = run_python(_VARIANT_SCRIPT, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt"),
                     env=operator_variant_env(flags), cwd=tmp_path, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    for i, ((x, weight), (halves, floats)) in enumerate(zip(cases + prompts, torch.load(tmp_path / "out.pt"))):
        if i < len(cases):
            assert torch.equal(halves, floats), (x.shape, weight.shape)
        _assert_product(halves, x, weight)  # a prompt's rows: panels, summed in another order


def test_a_16_bit_embedding_gives_float32_rows_exactly():
    weight = (torch.randn(50, 8) * 3).half()
    layer = half.HalfEmbedding(weight)
    ids = torch.tensor([[3, 0, 49, 3]])
    got = layer(ids)
    assert got.dtype == torch.float32 and torch.equal(got, weight.float()[ids])
    assert list(layer.parameters()) == []
    with pytest.raises(ValueError, match="float16 or bfloat16 matrix"):
        half.HalfEmbedding(weight.float())


# --- F16 GGUF files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), vocab_size=400)


@pytest.fixture(scope="module")
def files(tmp_path_factory, sp_model) -> dict[tuple[str, bool], Path]:
    """A tiny model (vocabulary 416: its classifier is no whole number of 16-output panels) as F16
    and BF16, untied and tied."""
    out = tmp_path_factory.mktemp("half")
    made = {}
    for tied in (False, True):
        hf = hf_llama(416, heads=8, kv_heads=2, tied=tied, rope=DEFAULT_ROPE, seed=3)
        for name, qtype in (("f16", T.F16), ("bf16", T.BF16)):
            made[name, tied] = write_gguf(out / f"{name}-{'tied' if tied else 'untied'}.gguf", hf.state_dict(),
                                          hf_config(hf), qtype=qtype, sp_model=sp_model)
    return made


PROJECTIONS = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v",
               "attention.wo": "attn_output", "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down",
               "feed_forward.w3": "ffn_up"}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_16_bit_matrices_stay_the_files_own_bytes(files, kind, tied):
    path = files[kind, tied]
    loaded = load_model(path, device="cpu")
    model, dtype = loaded.model, torch.float16 if kind == "f16" else torch.bfloat16
    offsets = {t.name: int(t.data_offset) for t in gguf.GGUFReader(path).tensors}
    layers = {"output": model.output}
    for i, layer in enumerate(model.layers):
        layers.update({f"blk.{i}.{gguf_name}": layer.get_submodule(name) for name, gguf_name in PROJECTIONS.items()})
    for name, layer in layers.items():
        assert isinstance(layer, half.HalfLinear) and layer.weight.dtype == dtype, name
        weight = layer.weight
        assert weight.untyped_storage().nbytes() == path.stat().st_size and in_file_mapping(weight), name
        source = "token_embd.weight" if name == "output" and tied else f"{name}.weight"
        assert weight.data_ptr() - weight.untyped_storage().data_ptr() == offsets[source], name
    embedding = model.tok_embeddings
    assert isinstance(embedding, half.HalfEmbedding) and in_file_mapping(embedding.weight)
    if tied:
        assert model.output.weight is embedding.weight
    # The model's parameters are its float32 norms: what engines read the activations' dtype from.
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert next(model.parameters()).dtype == torch.float32 and loaded.dtype == torch.float32
    summary = loaded.weights()
    assert summary.format == ("F16, float16" if kind == "f16" else "BF16, bfloat16")
    assert summary.nbytes == sum(t.n_bytes for t in gguf.GGUFReader(path).tensors)
    # Asked for a dtype, every matrix is converted to it, as before.
    expanded = load_model(path, device="cpu", dtype="float32").model
    assert type(expanded.layers[0].attention.wq) is torch.nn.Linear
    assert expanded.layers[0].attention.wq.weight.dtype == torch.float32


def _greedy(model, prompt: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy ids after ``prompt`` (its rows through the layers at once) and each step's logits."""
    cache = KVCache.for_model(model.args, 1, max_seq_len=prompt.shape[1] + n)
    pos = prompt.shape[1]
    ids, steps = [], []
    with torch.inference_mode():
        logits = model(prompt, torch.arange(pos).unsqueeze(0), cache, last_only=True)[0, -1]
        for _ in range(n):
            steps.append(logits.float())
            ids.append(int(logits.argmax()))
            logits = decode_one(model, ids[-1], pos, cache)[0, -1]
            pos += 1
    return ids, torch.stack(steps)


def _assert_same_greedy_run(model, reference, one_call: bool) -> None:
    model.fuse_projections()
    reference.fuse_projections()
    cache = KVCache.for_model(model.args, 1)
    with torch.inference_mode():
        assert cpu_decode.takes_rows(model, PagedKVCache.of_row(cache)) == one_call
        assert cpu_decode.takes_rows(reference, PagedKVCache.of_row(cache)) == one_call
    prompt = torch.randint(3, 400, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    ids, logits = _greedy(model, prompt, NEW_TOKENS)
    want_ids, want_logits = _greedy(reference, prompt, NEW_TOKENS)
    assert ids == want_ids
    assert (logits - want_logits).abs().max() <= LOGIT_TOLERANCE * want_logits.abs().max()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_greedy_ids_of_a_16_bit_file_are_the_float32_paths(files, cpu_kernels_loaded, kind, tied):
    # Prompt rows through the tiles, decode steps through the one-call step (with the operator).
    path = files[kind, tied]
    model = load_model(path, device="cpu").model
    assert isinstance(model.layers[0].attention.wq, half.HalfLinear)
    _assert_same_greedy_run(model, load_model(path, device="cpu", dtype="float32").model, bool(cpu_kernels_loaded))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_without_the_operator_an_f16_file_gives_the_float32_paths_ids(files, pytorch_products, tied):
    path = files["f16", tied]
    _assert_same_greedy_run(load_model(path, device="cpu").model,
                            load_model(path, device="cpu", dtype="float32").model, one_call=False)


def test_fused_groups_keep_one_form_and_f16_sits_beside_packed_blocks(tmp_path, sp_model):
    # A Q8_0 file with some F16 matrices (llama.cpp keeps tensors it cannot quantize in F16): v
    # in F16 beside q8_0 q and k cannot fuse as one form, so the three are expanded; the down
    # projection's F16 stays 16-bit beside packed layers.
    hf = hf_llama(416, heads=8, kv_heads=2, tied=False, rope=DEFAULT_ROPE, seed=4)
    f16 = {f"model.layers.{i}.{name}": T.F16 for i in range(2) for name in
           ("self_attn.v_proj.weight", "mlp.down_proj.weight")}
    path = write_gguf(tmp_path / "mixed.gguf", hf.state_dict(), hf_config(hf), qtype=T.Q8_0, sp_model=sp_model,
                      qtype_for=f16)
    loaded = load_model(path, device="cpu")
    layer = loaded.model.layers[0]
    assert {type(layer.attention.get_submodule(n)) for n in ("wq", "wk", "wv")} == {torch.nn.Linear}
    assert layer.attention.wq.weight.dtype == torch.float32
    assert isinstance(layer.feed_forward.w2, half.HalfLinear) and layer.feed_forward.w2.weight.dtype == torch.float16
    assert isinstance(layer.feed_forward.w1, PackedLinear) and isinstance(layer.attention.wo, PackedLinear)
    assert loaded.weights().format == "Q8_0, packed q8_0, float16, float32"
    prompt = torch.randint(3, 400, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        got = loaded.model(prompt)
        want = load_model(path, device="cpu", dtype="float32").model(prompt)
    # Packed products round their inputs to int8 steps (ml/packed.py): near, not equal.
    assert ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt() < 0.08


def test_the_command_runs_an_f16_file_as_it_is_and_says_so(files):
    path = str(files["f16", False])
    args = ("-m", path, "-p", "Once upon a time", "--no-stdin", "-n", "12", "--min-new-tokens", "12", "-t", "0",
            "--template", "none", "--json", "--stats")
    half_run = run_cli(*args)
    float_run = run_cli(*args, "--dtype", "float32")
    bare_run = run_cli(*args, LLAMA_CHAT_CPU_KERNELS="0")
    for proc in (half_run, float_run, bare_run):
        assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    import json

    texts = [json.loads(proc.stdout)["text"] for proc in (half_run, float_run, bare_run)]
    assert texts[0] == texts[1] == texts[2] and texts[0]
    assert "weights: F16, float16 (" in half_run.stderr.decode()
    assert "weights: F16, float32 (" in float_run.stderr.decode()


# --- memory ------------------------------------------------------------------------------------------

# Where runs are not forked from the fork server, which reports each run's own peak: a launcher
# without torch forks the command and reports its peak RSS (``ru_maxrss`` of that child alone, in
# KiB); a child forked from the test process would start with the test's peak as its own.
_LAUNCHER = """import os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""
CONTEXT = 256


def _peak_rss(tmp_path: Path, *args: str) -> int:
    """The command's peak RSS in bytes, run to completion in a process of its own. A forked run's
    counts the pages it was forked with (the interpreter, torch and the command imported), as a
    run started alone has them; the baseline below is measured the same way as the run."""
    if fork_server() is not None:  # the run's environment is the server's: forked
        forked = run_cli(*args, timeout=600)
        assert forked.returncode == 0, forked.stderr.decode()[-2000:]
        return forked.max_rss
    report = tmp_path / "peak"
    proc = subprocess.run([sys.executable, "-c", _LAUNCHER, str(report), *llama_chat_command(), *args],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=600, env=cli_env())
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return int(report.read_text()) * 1024


def _random_f16_file(path: Path, sp_model: Path, *, vocab: int, dim: int, layers: int, ffn: int) -> Path:
    """An F16 GGUF of random weights (no ``transformers`` model behind it: only its size matters)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (vocab, dim), "lm_head.weight": (vocab, dim), "model.norm.weight": (dim,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (dim, dim), p + "self_attn.k_proj.weight": (dim, dim),
                       p + "self_attn.v_proj.weight": (dim, dim), p + "self_attn.o_proj.weight": (dim, dim),
                       p + "mlp.gate_proj.weight": (ffn, dim), p + "mlp.up_proj.weight": (ffn, dim),
                       p + "mlp.down_proj.weight": (dim, ffn), p + "input_layernorm.weight": (dim,),
                       p + "post_attention_layernorm.weight": (dim,)})
    # One uniform pass a weight, cheaper than a scaled normal draw: only the file's size matters.
    state = {name: torch.empty(shape).uniform_(-0.035, 0.035, generator=g) if len(shape) == 2 else torch.ones(shape)
             for name, shape in shapes.items()}
    config = {"num_attention_heads": 12, "num_key_value_heads": 12, "hidden_size": dim, "max_position_embeddings":
              CONTEXT, "num_hidden_layers": layers, "intermediate_size": ffn, "rms_norm_eps": 1e-5,
              "vocab_size": vocab, "tie_word_embeddings": False, "rope_parameters": DEFAULT_ROPE}
    return write_gguf(path, state, config, qtype=T.F16, sp_model=sp_model)


@pytest.mark.slow
def test_an_f16_files_peak_memory_keeps_the_rule(tmp_path, sp_model, files):
    # The rule: peak RSS <= 1.1 x the file + the KV cache + the baseline, here the same command's
    # peak on the tiny F16 file (Python, torch, the operator, a tokenizer: everything but weights).
    big = _random_f16_file(tmp_path / "big.gguf", sp_model, vocab=32000, dim=768, layers=8, ffn=2048)
    size = big.stat().st_size
    assert size > 200e6
    kv_cache = 2 * 8 * 768 * CONTEXT * 4  # keys and values, float32, per layer and position
    args = ("-p", "Once upon a time", "--no-stdin", "-n", "8", "--min-new-tokens", "8", "-t", "0", "--template",
            "none", "-c", str(CONTEXT))
    baseline = _peak_rss(tmp_path, "-m", str(files["f16", False]), *args)
    rule = 1.1 * size + kv_cache + baseline
    peak = _peak_rss(tmp_path, "-m", str(big), *args)
    assert peak <= rule, f"peak {peak / 1e6:.0f} MB, the rule {rule / 1e6:.0f} MB (file {size / 1e6:.0f} MB)"
    # What the rule catches: the same file expanded to float32 takes about twice its size.
    expanded = _peak_rss(tmp_path, "-m", str(big), *args, "--dtype", "float32")
    assert expanded > rule + 0.5 * size
