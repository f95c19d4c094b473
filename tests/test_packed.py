"""Weights kept as GGUF's packed blocks (``ml/packed.py``) and the operator's products on them
(``ml/cpu/blocks.h``): layouts and dequantizers against the ``gguf`` package, ``pack`` bit-equal to
its quantizer, and every product against ``dequantize(w) @ rounded(x)`` in float64, in this
machine's build, in builds without VNNI, without AVX-512 and without AVX, and without the operator.

The operator's tolerance: |got - dequantize(w) @ rounded(x)| <= 1e-5 * (|dequantize(w)| @ |rounded(x)|),
where rounded(x) is x rounded to int8 steps of max|x| / 127, a step per 32 values (per 256 for the
K-quants, as llama.cpp's Q8_K). Each block's integer sum is exact, so what is left is float32
rounding of a few hundred scaled sums (about 1e-7 of the same size, measured); a wrong code, scale,
offset or zero point is far outside it.
"""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from builders import OPERATOR_VARIANT_LOAD, decode_one, skip_where_the_native_build_lacks
from cli_support import run_python
from llama_chat.ml import packed
from llama_chat.ml.cpu import kernels as cpu_kernels

HAS_COMPILER = shutil.which(os.environ.get("CXX") or "c++") is not None
needs_kernels = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler to build the kernels")
RELATIVE_TOLERANCE = 1e-5
# Where each kind keeps its fp16 scales (and mins): drawn from a sane range, the other bytes random.
HALF_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
                "q5_k": (0, 2), "q6_k": (208,)}


def random_weight(kind: str, out_features: int, in_features: int, seed: int) -> packed.PackedWeight:
    g = torch.Generator().manual_seed(seed)
    values, size = packed.block_layout(kind)
    blocks = out_features * in_features // values
    raw = torch.randint(0, 256, (blocks, size), dtype=torch.uint8, generator=g)
    for offset in HALF_OFFSETS[kind]:
        magnitude = torch.exp(torch.empty(blocks).uniform_(-9, -2, generator=g))
        sign = torch.where(torch.rand(blocks, generator=g) < 0.5, -1.0, 1.0)
        raw[:, offset:offset + 2] = (magnitude * sign).to(torch.float16).view(torch.uint8).view(blocks, 2)
    return packed.PackedWeight(kind, raw.view(out_features, -1), in_features)


def rounded(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x rounded as the operator rounds it for ``kind``: step max|x| / 127 per 32 values (per 256 for
    the K-quants), nearest, ties to even."""
    blocks = x.reshape(x.shape[0], -1, 256 if kind.endswith("_k") else 32)
    step = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(step != 0, 1 / step, torch.zeros_like(step))
    return (torch.round(blocks * inverse) * step).reshape(x.shape)


def assert_operator_result(got: torch.Tensor, x: torch.Tensor, weight: packed.PackedWeight) -> None:
    w = weight.dequantize().double()
    xr = rounded(x, weight.kind).double()
    want = xr @ w.T
    bound = RELATIVE_TOLERANCE * (xr.abs() @ w.abs().T)
    assert got.shape == want.shape and got.dtype == torch.float32
    error = (got.double() - want).abs()
    assert (error <= bound).all(), f"{weight.kind}: worst error {(error / bound.clamp_min(1e-300)).max():.3g} x the bound"


def in_features_for(kind: str, blocks: int) -> int:
    return blocks * packed.block_layout(kind)[0]


def test_block_layouts_are_gguf_s():
    for kind, layout in packed.BLOCK_LAYOUTS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind.upper()]] == layout
    assert tuple(packed.BLOCK_LAYOUTS) == packed.PACKED_TYPES


@pytest.mark.parametrize("kind", packed.PACKED_TYPES)
def test_dequantize_is_gguf_s_bit_for_bit(kind):
    weight = random_weight(kind, 7, in_features_for(kind, 3), seed=1)
    want = gguf.quants.dequantize(weight.data.numpy(), gguf.GGMLQuantizationType[kind.upper()])
    got = weight.dequantize()
    assert got.shape == (7, weight.in_features)
    assert np.array_equal(got.numpy(), want.astype(np.float32))
    assert torch.equal(weight.dequantize_rows(2, 5), got[2:5])
    assert weight.dequantize(torch.bfloat16).dtype == torch.bfloat16


@settings(max_examples=150)
@given(kind=st.sampled_from(packed.PACKABLE), rows=st.integers(1, 5), blocks=st.integers(1, 4), data=st.data())
def test_pack_is_bit_equal_to_gguf_s_quantizer(kind, rows, blocks, data):
    # Floats of every size hypothesis likes (zeros, ties, equal magnitudes of both signs), whole
    # blocks of zeros among them; none so small that 1 / step overflows (a cast of infinity to
    # an integer, undefined in llama.cpp's C and different in numpy and torch).
    magnitudes = st.floats(2.0**-100, 1e4, width=32)
    elements = st.one_of(st.just(0.0), magnitudes, magnitudes.map(lambda v: -v))
    values = data.draw(hnp.arrays(np.float32, (rows, 32 * blocks), elements=elements))
    if data.draw(st.booleans()):
        values[0, :32] = 0
    weight = packed.pack(kind, torch.from_numpy(values))
    want = gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind.upper()])
    assert weight.kind == kind and weight.in_features == 32 * blocks and weight.out_features == rows
    assert np.array_equal(weight.data.numpy(), want)


def test_pack_and_packed_weight_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="cannot pack 'q4_k'"):
        packed.pack("q4_k", torch.zeros(2, 256))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        packed.pack("q8_0", torch.zeros(2, 40))
    with pytest.raises(ValueError, match="no packed weight kind 'q3_k'"):
        packed.PackedWeight("q3_k", torch.zeros(2, 110, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match=r"expected uint8 \(rows, 18\)"):
        packed.PackedWeight("q4_0", torch.zeros(2, 17, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="features"):
        packed.PackedLinear(random_weight("q4_0", 3, 64, seed=0))(torch.zeros(2, 32))


@needs_kernels
@given(kind=st.sampled_from(packed.PACKED_TYPES), rows=st.integers(1, 16),
       out_features=st.integers(1, 41), blocks=st.integers(1, 11), seed=st.integers(0, 2**16))
def test_the_operator_equals_the_dequantized_product_of_the_rounded_rows(cpu_kernels_loaded, kind, rows,
                                                                         out_features, blocks, seed):
    # Block counts that are and are not multiples of the eight a vector step takes; rows that are
    # and are not multiples of the four that share a decoded group.
    assert cpu_kernels_loaded, cpu_kernels.failure()
    if kind.endswith("_k"):
        blocks = 1 + blocks % 3
    weight = random_weight(kind, out_features, in_features_for(kind, blocks), seed)
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0  # a block of zeros: step 0
    got = torch.ops.llama_chat_cpu.packed_product(x, weight.data, kind)
    assert_operator_result(got, x, weight)


@needs_kernels
@pytest.mark.parametrize("kind", packed.PACKED_TYPES)
def test_a_row_s_result_depends_on_nothing_but_the_row(cpu_kernels_loaded, kind):
    # Enough weight rows for many chunks among threads, more rows than a tile of 16: each result is
    # still one sum in a fixed order, the same bits alone or in a batch.
    weight = random_weight(kind, 700, 2048, seed=3)
    x = torch.randn(19, 2048, generator=torch.Generator().manual_seed(4))
    together = torch.ops.llama_chat_cpu.packed_product(x, weight.data, kind)
    assert_operator_result(together, x, weight)
    for r in (0, 5, 18):
        assert torch.equal(torch.ops.llama_chat_cpu.packed_product(x[r:r + 1], weight.data, kind), together[r:r + 1])
    assert torch.ops.llama_chat_cpu.packed_product(x[:0], weight.data, kind).shape == (0, 700)


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_k", "q5_k", "q6_k", "q4_0", "q8_0"])
def test_a_row_alone_gives_the_bits_it_gives_beside_three_others(cpu_kernels_loaded, kind):
    # A row alone takes a vector path of its own (with AVX-512 VNNI, two K-quant blocks a 512-bit
    # vector), four rows another: the same block sums, summed in the same order. Five rows: four
    # together and the fifth alone; eight groups of 256 a row, the zero block's step 0 included.
    weight = random_weight(kind, 37, 2048, seed=11)
    x = torch.randn(5, 2048, generator=torch.Generator().manual_seed(12))
    x[2, 256:288] = 0
    together = torch.ops.llama_chat_cpu.packed_product(x, weight.data, kind)
    assert_operator_result(together, x, weight)
    for r in range(5):
        assert torch.equal(torch.ops.llama_chat_cpu.packed_product(x[r:r + 1], weight.data, kind), together[r:r + 1])


@needs_kernels
def test_the_operator_refuses_blocks_that_do_not_fit(cpu_kernels_loaded):
    weight = random_weight("q4_0", 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="no packed kind q9_0"):
        torch.ops.llama_chat_cpu.packed_product(torch.zeros(1, 64), weight.data, "q9_0")
    with pytest.raises(RuntimeError, match="take 36 bytes a row"):
        torch.ops.llama_chat_cpu.packed_product(torch.zeros(1, 64), weight.data[:, :30].contiguous(), "q4_0")
    with pytest.raises(RuntimeError, match="not whole q4_0 blocks"):
        torch.ops.llama_chat_cpu.packed_product(torch.zeros(1, 40), weight.data, "q4_0")


@needs_kernels
@pytest.mark.parametrize("kind", ["q4_0", "q4_k", "q6_k"])
def test_packed_linear_takes_the_operator_for_any_rows(cpu_kernels_loaded, kind):
    weight = random_weight(kind, 300, 512, seed=5)
    layer = packed.PackedLinear(weight)
    before = weight.data.clone()
    for shape in ((2, 3, 512), (40, 512)):  # a step's rows, a prompt's
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(6))
        assert packed.kernel_takes(x, weight)
        got = layer(x)
        assert got.shape == (*shape[:-1], 300)
        assert_operator_result(got.reshape(-1, 300), x.reshape(-1, 512), weight)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    assert layer(x[:0]).shape == (0, 300)
    assert torch.equal(weight.data, before)  # the blocks (maybe a file's) are never written


@pytest.mark.parametrize("kind", packed.PACKED_TYPES)
def test_without_the_operator_a_product_is_the_dequantized_one(pytorch_products, kind, monkeypatch):
    weight = random_weight(kind, 37, in_features_for(kind, 2), seed=8)
    layer = packed.PackedLinear(weight)
    assert "kind=" + kind in repr(layer)
    x = torch.randn(3, weight.in_features, generator=torch.Generator().manual_seed(9))
    assert not packed.kernel_takes(x, weight)
    want = x.double() @ weight.dequantize().double().T
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    monkeypatch.setattr(packed, "TILE_VALUES", weight.in_features * 5)  # several tiles of weight rows
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert layer.packed.nbytes == weight.data.numel() and layer.packed.out_features == 37


def test_a_large_output_takes_memory_already_mapped_and_is_written_whole(cpu_kernels_loaded):
    """A prompt's outputs of a megabyte or more reuse the blocks earlier ones freed (memory.cpp):
    a fresh tensor of this one's 38 MB, above glibc's largest mmap threshold, is fresh memory that
    each product faulted in, 4 KiB at a time where transparent huge pages are on request only."""
    weight = random_weight("q8_0", 18432, 32, seed=2)
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(3))
    first = torch.ops.llama_chat_cpu.packed_product(x, weight.data, "q8_0")
    expected = first.clone()
    first.fill_(float("nan"))
    del first
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = torch.ops.llama_chat_cpu.packed_product(x, weight.data, "q8_0")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 1000
    assert torch.equal(second, expected)


def test_no_rows_expand_no_weight(monkeypatch):
    """A long prompt's chunks before its last want no logits: the output layer, a vocabulary of
    packed rows, is not expanded for nothing."""
    weight = random_weight("q6_k", 8, 256, seed=1)
    monkeypatch.setattr(packed.PackedWeight, "dequantize_rows", lambda *a: pytest.fail("expanded"))
    layer = packed.PackedLinear(weight)
    assert layer(torch.empty(1, 0, 256)).shape == (1, 0, 8)


# A build of the operator's products alone (kernels.cpp) with some instruction sets taken away,
# in a process of its own: it writes each case's product, and each row's alone, for the test to check.
_VARIANT_SCRIPT = OPERATOR_VARIANT_LOAD + """
cases = torch.load(sys.argv[1])
product = torch.ops.llama_chat_cpu.packed_product
torch.save([(product(x, data, kind), torch.cat([product(x[r:r + 1], data, kind) for r in range(len(x))]))
            for kind, x, data in cases], sys.argv[2])
"""


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("flags, takes_away", [("-mno-avx512vnni", "__AVX512VNNI__"), ("-mno-avx512f", "__AVX512F__"),
                                               ("-mno-avx", "__AVX__")],
                         ids=["avx512-without-vnni", "avx2", "scalar"])
def test_builds_without_vnni_avx512_or_avx_give_the_same_products(tmp_path, flags, takes_away, operator_variant_env):
    skip_where_the_native_build_lacks(takes_away)
    cases, weights = [], []
    for i, kind in enumerate(packed.PACKED_TYPES):
        for rows, blocks in ((1, 9), (6, 2), (16, 17)):
            blocks = blocks if not kind.endswith("_k") else 1 + blocks % 3
            weight = random_weight(kind, 29, in_features_for(kind, blocks), seed=100 + i)
            x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(i))
            cases.append((kind, x, weight.data))
            weights.append(weight)
    torch.save(cases, tmp_path / "cases.pt")
    run = run_python(_VARIANT_SCRIPT, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt"),
                     env=operator_variant_env(flags), cwd=tmp_path, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    for (kind, x, _), weight, (got, alone) in zip(cases, weights, torch.load(tmp_path / "out.pt")):
        assert_operator_result(got, x, weight)
        # Each path of the build (a row alone, four rows, the tiles of 16) gives a row the same bits.
        assert torch.equal(alone, got), kind


# --- a model of packed layers -----------------------------------------------------------------

# The projections' kinds: v (and so the fused q/k/v) and the down projection of another kind.
_MODEL_KINDS = {("attention", "wq"): "q4_0", ("attention", "wk"): "q4_0", ("attention", "wv"): "q8_0",
                ("attention", "wo"): "q4_0", ("feed_forward", "w1"): "q4_0", ("feed_forward", "w3"): "q4_0",
                ("feed_forward", "w2"): "q8_0"}


def packed_model(seed: int = 1, vocab_size: int = 97):
    """A tiny random model whose projections and classifier are packed (``pack``), fused, and the
    same model with the packed weights dequantized into float32 ``nn.Linear`` layers."""
    from builders import random_model, tiny_args

    reference, model = (random_model(tiny_args(vocab_size), seed=seed) for _ in range(2))
    for mine, theirs in zip(model.layers, reference.layers):
        for (part, name), kind in _MODEL_KINDS.items():
            weight = packed.pack(kind, getattr(getattr(theirs, part), name).weight.detach())
            getattr(getattr(theirs, part), name).weight.data = weight.dequantize()
            setattr(getattr(mine, part), name, packed.PackedLinear(weight))
    weight = packed.pack("q8_0", reference.output.weight.detach())
    reference.output.weight.data = weight.dequantize()
    model.output = packed.PackedLinear(weight)
    reference.fuse_projections()
    model.fuse_projections()
    return model.eval(), reference.eval()


def test_fusing_packed_layers_keeps_their_blocks_and_products():
    model, _ = packed_model()
    attention, ffn = model.layers[0].attention, model.layers[0].feed_forward
    assert isinstance(attention.wqkv, packed.PackedConcat)  # q4_0 q and k (one run), q8_0 v
    assert attention.wqkv.segments == (("q4_0", 96), ("q8_0", 32))
    assert isinstance(ffn.w13, packed.PackedLinear) and ffn.w13.kind == "q4_0" and ffn.w13.out_features == 320
    data, layout = packed.step_layout(attention.wqkv)
    assert data.dtype == torch.uint8 and data.numel() == attention.wqkv.data.numel()
    assert packed.step_layout(model.output)[0].shape[0] == 97  # the classifier's outputs
    assert layout.tolist() == [1, 96, 0, 32]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    parts = attention.wqkv.parts
    want = torch.cat([x.double() @ p.dequantize().double().T for p in parts], dim=1)
    torch.testing.assert_close(packed.dequantized_product(x, parts[0]).double(), want[:, :96], rtol=1e-5, atol=1e-5)
    assert attention.wqkv(x).shape == (3, 128)


@pytest.mark.parametrize("kinds", [("q4_k", "q6_k"), ("q8_0", "q4_0", "q8_0"), ("q4_0", "q6_k", "q4_1")],
                         ids=["q4_k-q6_k", "q8_0-q4_0-q8_0", "spans-mixed"])
@pytest.mark.parametrize("rows", [1, 5, 12, 40])
def test_segments_in_one_call_give_each_segments_product_bit_for_bit(cpu_kernels_loaded, kinds, rows):
    # The operator's one call for a PackedConcat rounds the rows once per step span and writes each
    # segment's outputs in place: the same bits as each segment's own product.
    weights = [random_weight(kind, 16 * (i + 1), 512, rows + i) for i, kind in enumerate(kinds)]
    layer = packed.PackedConcat(weights)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
    want = torch.cat([torch.ops.llama_chat_cpu.packed_product(x, w.data, w.kind) for w in weights], dim=1)
    assert torch.equal(layer(x), want)
    assert torch.equal(layer(x.view(1, rows, 512)), want.view(1, rows, -1))


def test_segments_that_do_not_match_their_bytes_are_refused(cpu_kernels_loaded):
    weight = packed.pack("q8_0", torch.randn(32, 64))
    data = weight.data.reshape(-1)
    x = torch.randn(2, 64)
    for pairs, words in (([0, 31], "bytes"), ([9, 32], "no \\(kind, rows\\) pair"), ([0], "int64 \\(kind, rows\\) pairs")):
        with pytest.raises(RuntimeError, match=words):
            torch.ops.llama_chat_cpu.packed_segments_product(x, data, torch.tensor(pairs, dtype=torch.int64))


def _greedy(model, prompt: list[int], count: int) -> tuple[list[int], torch.Tensor]:
    from llama_chat.model.kv_cache import KVCache

    cache = KVCache.for_model(model.args, 1)
    ids, steps = [], []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), cache)[0, -1]
        for position in range(len(prompt), len(prompt) + count):
            steps.append(logits.float())
            ids.append(int(logits.argmax()))
            logits = decode_one(model, ids[-1], position, cache)[0, -1]
    return ids, torch.stack(steps)


def test_a_model_of_packed_layers_computes_what_its_dequantized_weights_do():
    # The products round their inputs to int8 steps per 32 values, as llama.cpp's do; through two
    # layers and the classifier that moves the logits by 2-4 % of their size (relative RMS, over
    # seeds), where a wrong block, kind or layout gives logits unrelated to these.
    model, reference = packed_model()
    prompt = [3, 14, 15, 92, 65, 35, 89]
    with torch.inference_mode():
        got = model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0)).float()
        want = reference(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0)).float()
    assert ((got - want).pow(2).mean() / want.pow(2).mean()).sqrt() < 0.08


@needs_kernels
def test_the_one_call_step_reads_packed_blocks_and_picks_the_layers_tokens(cpu_kernels_loaded, monkeypatch):
    # Through the operator (model/cpu_decode.py, ml/cpu/decode.cpp) and through the layers, the
    # products are the same rounded-input sums; only the float order of norms and attention
    # differs, so the logits agree far below the gaps between the ids picked.
    from llama_chat.model import cpu_decode
    from llama_chat.model.kv_cache import KVCache
    from llama_chat.model.paged_kv_cache import PagedKVCache

    model, _ = packed_model()
    with torch.inference_mode():
        assert cpu_decode.takes_rows(model, PagedKVCache.of_row(KVCache.for_model(model.args, 1)))
    prompt = [3, 14, 15, 92, 65]
    ids, logits = _greedy(model, prompt, 12)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_decode, "takes_rows", lambda *args: False)
        layer_ids, layer_logits = _greedy(model, prompt, 12)
    assert ids == layer_ids
    assert (logits - layer_logits).abs().max() < 1e-3


@needs_kernels
def test_rows_of_a_paged_step_read_packed_blocks_each_as_it_would_alone(cpu_kernels_loaded):
    # The scheduler's rows: each row's logits are, to the bit, what the row gives alone.
    from llama_chat.model import cpu_decode
    from llama_chat.model.paged_kv_cache import PagedKVCache

    model, _ = packed_model()
    tokens = [3, 9, 27, 81, 50, 4, 12]
    tables = [[r] for r in range(len(tokens))]
    together_cache, alone_cache = (PagedKVCache.for_model(model.args, num_pages=len(tokens), page_size=4)
                                   for _ in range(2))
    with torch.inference_mode():
        assert cpu_decode.takes_rows(model, together_cache)
        together = cpu_decode.forward_rows(model, tokens, [0] * len(tokens), tables, together_cache)
        alone = torch.cat([cpu_decode.forward_rows(model, [token], [0], [table], alone_cache)
                           for token, table in zip(tokens, tables)])
    assert torch.equal(together, alone)


@needs_kernels
def test_packed_blocks_of_a_mapped_file_move_onto_large_pages_with_their_bytes(cpu_kernels_loaded, tmp_path):
    # The classifier's blocks as a GGUF loader leaves them, a view of the memory-mapped file; the
    # one-call step's weights move onto 2 MiB pages (where the kernel has them) byte for byte.
    from llama_chat.model import cpu_decode
    from llama_chat.model.formats.common import in_file_mapping
    from llama_chat.model.kv_cache import KVCache
    from llama_chat.model.paged_kv_cache import PagedKVCache

    model, _ = packed_model(vocab_size=32768)  # a classifier of more than one 2 MiB page
    path = tmp_path / "blocks.bin"
    model.output.data.numpy().tofile(path)
    mapped = torch.from_file(str(path), shared=False, size=model.output.data.numel(), dtype=torch.uint8)
    model.output = packed.PackedLinear(packed.PackedWeight("q8_0", mapped.view(32768, -1), 64))
    assert in_file_mapping(model.output.data)
    layers = [p for layer in model.layers for p in cpu_decode._projections(layer)] + [model.output]
    before = [layer.data.clone() for layer in layers]
    prompt = [3, 14, 15, 92, 65]
    want, _ = _greedy(model, prompt, 4)  # the prompt through the layers, then one-call steps
    with torch.inference_mode():
        assert cpu_decode.takes_rows(model, PagedKVCache.of_row(KVCache.for_model(model.args, 1)))
    assert all(torch.equal(layer.data, bytes_) for layer, bytes_ in zip(layers, before))
    if cpu_kernels.large_pages():
        storage = model.output.data.untyped_storage().data_ptr()
        assert all(layer.data.untyped_storage().data_ptr() == storage for layer in layers)
        assert storage % cpu_kernels.LARGE_PAGE == 0
        assert not in_file_mapping(model.output.data)
    got, _ = _greedy(model, prompt, 4)
    assert got == want


def random_packed_model(kind: str, seed: int = 0):
    """A tiny model (256 wide, so K-quant rows are whole super-blocks) whose projections and
    classifier are random blocks of ``kind`` (scales small enough for sane activations), its v rows
    Q6_K (a fused q/k/v of two kinds where ``kind`` is not Q6_K), fused."""
    from builders import random_model, tiny_args

    model = random_model(tiny_args(128, dim=256, hidden_dim=512, n_heads=4, n_kv_heads=2), seed=seed)
    g = torch.Generator().manual_seed(seed)

    def blocks(layer_kind: str, out_features: int, in_features: int) -> packed.PackedLinear:
        weight = random_weight(layer_kind, out_features, in_features, int(torch.randint(0, 2**16, (1,), generator=g)))
        for offset in HALF_OFFSETS[layer_kind]:  # scales (and mins) of +-2^-14 to 2^-10: small sane weights
            values, size = packed.block_layout(layer_kind)
            raw = weight.data.view(-1, size)
            scale = torch.exp2(torch.empty(raw.shape[0]).uniform_(-14, -10, generator=g))
            scale = scale * torch.where(torch.rand(raw.shape[0], generator=g) < 0.5, -1.0, 1.0)
            raw[:, offset:offset + 2] = scale.to(torch.float16).view(torch.uint8).view(-1, 2)
        return packed.PackedLinear(weight)

    for layer in model.layers:
        for part, name in _MODEL_KINDS:
            linear = getattr(getattr(layer, part), name)
            layer_kind = "q6_k" if name == "wv" else kind
            setattr(getattr(layer, part), name, blocks(layer_kind, linear.out_features, linear.in_features))
    model.output = blocks(kind, 128, 256)
    model.fuse_projections()
    return model.eval()


@needs_kernels
@pytest.mark.parametrize("kind", packed.PACKED_TYPES)
def test_the_one_call_step_reads_every_kind(cpu_kernels_loaded, kind, monkeypatch):
    from llama_chat.model import cpu_decode

    model = random_packed_model(kind)
    prompt = [3, 14, 15, 92, 65]
    ids, logits = _greedy(model, prompt, 6)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_decode, "takes_rows", lambda *args: False)
        layer_ids, layer_logits = _greedy(model, prompt, 6)
    assert cpu_decode._weights_of(model) is not None  # the steps after the prompt took the operator
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert ids == layer_ids
    # The two paths' norms and attention sum in other orders, which can move an input across a
    # rounding boundary of its int8 step: a logit then moves by about a step times a weight.
    assert (logits - layer_logits).abs().max() <= 1e-2 * logits.abs().max()
