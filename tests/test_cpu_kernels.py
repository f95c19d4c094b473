"""Our CPU matrix-vector products (``ml/cpu/kernels.cpp``): built, exact, taken where they pay."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import greedy_ids, random_model, single_stream, tiny_args
from cli_support import build_tiny_model, run_cli, run_python
from llama_chat.ml import quantize
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model import cpu_decode

GREEDY = SamplingParams(temperature=0.0)
HAS_COMPILER = shutil.which("c++") is not None

needs_kernels = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler to build the kernels")


def _want(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    w = weight.double() * (scales.double().unsqueeze(1) if scales is not None else 1)
    return x.double() @ w.T


def _weights(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    if kind == "int8":
        q = quantize.quantize_int8(torch.randn(n, k, generator=g))
        return q.values, q.scales
    w = torch.randn(n, k, generator=g)
    return w.to(getattr(torch, kind)), None


@needs_kernels
def test_the_kernels_build_here(cpu_kernels_loaded):
    assert cpu_kernels_loaded, cpu_kernels.failure()
    assert cpu_kernels.library_path().exists()


@needs_kernels
def test_the_kernels_are_built_for_this_cpu_where_the_compiler_can(cpu_kernels_loaded):
    # A source that does not compile with -march=native falls back to a plain build (kernels.py),
    # which passes every other test many times slower.
    listed = subprocess.run([shutil.which(os.environ.get("CXX") or "c++"), "-march=native", "-dM", "-E", "-x", "c++", "-"],
                            input="", capture_output=True, text=True, timeout=60).stdout
    built = torch.ops.llama_chat_cpu.built_for().split()
    if "#define __AVX2__ " in listed:
        assert "avx2" in built, f"the operator was built without -march=native: {built}"
    if "#define __AVX512VNNI__ " in listed:
        assert "vnni" in built and "avx512" in built, built
    if "#define __AVX512BF16__ " in listed:
        assert "bf16" in built, built


@needs_kernels
@given(rows=st.integers(1, cpu_kernels.MAX_ROWS), k=st.integers(1, 300), n=st.integers(1, 70),
       kind=st.sampled_from(["float32", "bfloat16", "float16", "int8"]), seed=st.integers(0, 2**16))
def test_every_product_equals_the_float64_product(rows, k, n, kind, seed):
    # Lengths that are and are not multiples of the 8- and 32-wide loops, any number of rows.
    g = torch.Generator().manual_seed(seed)
    weight, scales = _weights(kind, n, k, g)
    x = torch.randn(rows, k, generator=g)
    got = cpu_kernels.matvec(x, weight, scales)
    want = _want(x, weight, scales)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    size = x.double().abs() @ (weight.double().abs() * (scales.double().unsqueeze(1) if scales is not None else 1)).T
    bound = 1e-5 * size
    if kind == "int8":  # the activations are rounded to 2^-14 of each row's largest (AVX2 build)
        largest = x.abs().amax(dim=1, keepdim=True).double()
        w_sum = (weight.double().abs() * scales.double().unsqueeze(1)).sum(1)
        bound = bound + largest / 16383 / 2 * w_sum
    assert ((got.double() - want).abs() <= bound + 1e-6).all()


@needs_kernels
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_product_split_among_threads_equals_the_float64_product(kind):
    # Large enough for many chunks of rows (256 KiB each) whichever the storage type; the
    # hypothesis test's weights are one chunk, done on the calling thread.
    g = torch.Generator().manual_seed(11)
    weight, scales = _weights(kind, 5000, 700, g)
    x = torch.randn(6, 700, generator=g)  # a block of four rows and two rows alone
    got = cpu_kernels.matvec(x, weight, scales).double()
    want = _want(x, weight, scales)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3 * want.abs().max().item())


@needs_kernels
def test_the_result_has_the_inputs_dtype_and_leading_shape():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=g).bfloat16()
    x = torch.randn(2, 1, 64, generator=g).bfloat16()
    got = cpu_kernels.matvec(x, w)
    assert got.shape == (2, 1, 40) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), (x.float() @ w.float().T), rtol=1e-2, atol=1e-2)


@needs_kernels
def test_bad_operands_are_refused_with_what_was_found():
    with pytest.raises(RuntimeError, match="the weight 64"):
        cpu_kernels.matvec(torch.ones(1, 63), torch.ones(4, 64))
    with pytest.raises(RuntimeError, match="4 rows but 3 scales"):
        cpu_kernels.matvec(torch.ones(1, 64), torch.ones(4, 64, dtype=torch.int8), torch.ones(3))


@needs_kernels
def test_decode_products_take_the_kernels_and_longer_chunks_do_not():
    w = torch.randn(32, 16)
    assert cpu_kernels.takes(torch.ones(1, 1, 16), w)
    assert cpu_kernels.takes(torch.ones(cpu_kernels.MAX_ROWS, 16), w)
    assert not cpu_kernels.takes(torch.ones(cpu_kernels.MAX_ROWS + 1, 16), w)
    assert cpu_kernels.takes(torch.ones(cpu_kernels.MAX_INT8_ROWS, 16), w.to(torch.int8))
    assert not cpu_kernels.takes(torch.ones(cpu_kernels.MAX_INT8_ROWS + 1, 16), w.to(torch.int8))
    assert not cpu_kernels.takes(torch.ones(1, 16), w.t().contiguous().t())  # a transposed view
    assert cpu_kernels.takes(torch.ones(1, 16), w.half())  # float16 weights: a GGUF file's (ml/half.py)


@needs_kernels
def test_pytorchs_products_are_kept_when_the_kernels_are_not_loaded(pytorch_products):
    assert not cpu_kernels.takes(torch.ones(1, 16), torch.randn(32, 16))


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_compiled_step_calls_the_kernels_and_decodes_the_eager_tokens(dtype, monkeypatch):
    """The operator has a shape rule, so a compiled step traces it as one call; inductor
    compiles what lies between the products."""
    # Against the eager model layer by layer, which rounds where the compiled graph does (the
    # one-call step keeps float32 between its products: bfloat16 tokens part after a while).
    monkeypatch.setattr(cpu_decode, "takes_rows", lambda *args: False)
    model = random_model(tiny_args(300, max_seq_len=96), seed=5).to(dtype)
    model.fuse_projections()
    eager = single_stream(model)
    compiled = single_stream(model, static=True, backend="inductor")
    prompt = [5, 17, 42, 7]
    want_ids = greedy_ids(eager, prompt, 30)
    got_ids = greedy_ids(compiled, prompt, 30)
    assert compiled.core.lone_step.failure is None and compiled.core.lone_step.steps >= 29
    graph_ops = torch._dynamo.utils.counters["graph_break"]
    assert not graph_ops, graph_ops
    assert got_ids == want_ids


@needs_kernels
@pytest.mark.parametrize("kind", ["float32", "int8"])
def test_a_model_decodes_the_same_tokens_on_either_product(kind, monkeypatch):
    model = random_model(tiny_args(300, max_seq_len=96), seed=7)
    model.fuse_projections()
    if kind == "int8":
        quantize.quantize_model(model)
        for layer in model.modules():  # PyTorch's int8 products that keep the activations exact,
            if isinstance(layer, quantize.Int8Linear):  # as ours do (fbgemm's round them)
                layer.packed = layer.packed_key = None
    step = single_stream(model)
    prompt = [9, 4, 120, 33, 2]
    runs = {}
    for loaded in (True, False):
        monkeypatch.setitem(cpu_kernels._state, "loaded", loaded)
        runs[loaded] = greedy_ids(step, prompt, 24)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt]))[0, -1]
        runs[f"logits {loaded}"] = logits
    assert runs[True] == runs[False]
    scale = runs["logits False"].abs().max()
    # int8: ours rounds the activations to 2^-14 of their largest (see ml/cpu/kernels.cpp).
    tolerance = 1e-4 if kind == "float32" else 1e-3
    assert (runs["logits True"] - runs["logits False"]).abs().max() <= tolerance * scale


def test_a_compiler_that_fails_is_one_line_and_tried_once(tmp_path):
    """In a fresh process with no usable compiler: ``load`` says why in one line, leaves a note,
    and a second process does not try again."""
    code = ("from llama_chat.ml.cpu import kernels as k; ok = k.load(); "
            "print(ok, k.failure(), k.library_path().with_suffix('.failed').exists(), sep='|')")
    env = {"LLAMA_CHAT_KERNEL_DIR": str(tmp_path), "CXX": "/bin/false", "PATH": "/usr/bin:/bin"}
    runs = [run_python(code, text=True, timeout=300, env={**_base_env(), **env}) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
        ok, why, marker = run.stdout.strip().split("|")
        assert ok == "False" and marker == "True"
        assert why.startswith("/bin/false failed") and "\n" not in why
    assert not list(tmp_path.glob("*.so"))


def test_a_missing_source_file_is_a_one_line_failure_not_a_crash(tmp_path, monkeypatch):
    # A broken install (a source left out of the wheel): PyTorch's kernels, and the reason.
    monkeypatch.setattr(cpu_kernels, "SOURCES", (*cpu_kernels.SOURCES, tmp_path / "cpu_gone.cpp"))
    for key, value in (("loaded", False), ("tried", False), ("failure", None)):
        monkeypatch.setitem(cpu_kernels._state, key, value)
    assert cpu_kernels.cached()  # nothing would be built: the command does not say it builds
    assert not cpu_kernels.load()
    assert cpu_kernels.failure() == "cpu_gone.cpp is missing from the installed package"


def test_the_command_says_once_that_the_kernels_did_not_build_and_still_answers(tmp_path):
    tiny = build_tiny_model(tmp_path)
    env = dict(LLAMA_CHAT_KERNEL_DIR=str(tmp_path / "kernels"), CXX="/bin/false")
    args = ("-m", str(tiny.path), "-p", "hello", "-n", "8", "--seed", "7", "--quantize", "int8", "--no-stdin")
    first = run_cli(*args, **env)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip()
    lines = [line for line in first.stderr.decode().splitlines() if "CPU kernels" in line]
    assert len(lines) == 1 and "/bin/false failed" in lines[0], first.stderr
    again = run_cli(*args, **env)
    assert again.returncode == 0 and "CPU kernels" not in again.stderr.decode(), again.stderr
    assert again.stdout == first.stdout


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k not in ("CXX", "LLAMA_CHAT_KERNEL_DIR")}


@needs_kernels
@given(rows=st.integers(1, cpu_kernels.MAX_ARGMAX_ROWS), n=st.integers(1, 300), seed=st.integers(0, 2**16),
       ties=st.booleans(), nan=st.booleans())
def test_argmax_is_torchs_argmax(rows, n, seed, ties, nan):
    # Ties go to the first index and a NaN counts as the largest, as in torch.argmax.
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-3, 3, (rows, n), generator=g).float() if ties else torch.randn(rows, n, generator=g)
    if nan:
        logits[0, int(torch.randint(0, n, (1,), generator=g))] = float("nan")
    assert torch.equal(cpu_kernels.argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(cpu_kernels.argmax(logits[:, : max(1, n // 2)]), logits[:, : max(1, n // 2)].argmax(dim=-1))


@needs_kernels
@given(rows=st.integers(2, 8), k=st.integers(1, 700), seed=st.integers(0, 2**16))
@settings(max_examples=30, deadline=None)
def test_int8_rows_taken_four_at_a_time_equal_each_row_alone(rows, k, seed):
    # Four input rows share each widened block of weights (dot4_int8); integer sums are exact in
    # any order, so every row is its single-row product to the bit (lengths through the 32- and
    # 16-wide loops and the tail).
    g = torch.Generator().manual_seed(seed)
    weight, scales = _weights("int8", 37, k, g)
    x = torch.randn(rows, k, generator=g)
    together = cpu_kernels.matvec(x, weight, scales)
    alone = torch.cat([cpu_kernels.matvec(x[r:r + 1], weight, scales) for r in range(rows)])
    assert torch.equal(together, alone)


@settings(max_examples=40, deadline=None)
@given(dim=st.sampled_from([2, 40, 64, 80, 128, 256]), seq=st.integers(1, 40), heads=st.integers(1, 6),
       spare=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_rope_rows_rotate_as_torchs_formula_bit_for_bit(cpu_kernels_loaded, dim, seq, heads, spare, seed):
    # The operator's rotary embedding of a prompt (one pass) against the formula it replaces, on
    # strided views (a fused q/k/v's queries and keys) and rows at their own positions.
    from llama_chat.ml import ops

    g = torch.Generator().manual_seed(seed)
    table = ops.rope_table(dim, 200, 10000.0)
    positions = torch.randint(0, 200, (2, seq), generator=g)
    cos, sin = ops.rope_at(table, positions)
    x = torch.randn(2, seq, heads + spare, dim, generator=g)[:, :, :heads]
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    want = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    got = torch.ops.llama_chat_cpu.rope_rows(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(ops.apply_rope(x, (cos, sin)), want)
