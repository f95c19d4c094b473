"""The one-call CPU decode step (``model/cpu_decode.py``, ``ml/cpu/decode.py``, ``ml/cpu/decode.cpp``)
against the model run layer by layer: the same logits, the same cache, the same greedy tokens."""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import decode_one, greedy_ids, random_model, single_stream, tiny_args
from llama_chat.inference.batch_step import Kind
from llama_chat.inference.scheduler import compiles_lone
from llama_chat.ml import quantize
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.cpu.decode import RowsDecoder
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model import cpu_decode
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.paged_kv_cache import PagedBatch, PagedKVCache

GREEDY = SamplingParams(temperature=0.0)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernels")


@pytest.fixture(autouse=True)
def _loaded(cpu_kernels_loaded):
    assert cpu_kernels_loaded, cpu_kernels.failure()


def _model(kind: str, seed: int = 0, vocab_size: int = 97, **overrides) -> torch.nn.Module:
    model = random_model(tiny_args(vocab_size, **overrides), seed=seed)
    model.fuse_projections()
    if kind == "bfloat16":
        model.to(torch.bfloat16)
    elif kind == "int8":
        quantize.quantize_model(model)
    return model


def _layer_by_layer(monkeypatch):
    monkeypatch.setattr(cpu_decode, "takes_rows", lambda *args: False)


def _takes(model, dtype: torch.dtype = torch.float32) -> bool:
    """Whether the operator reads ``model`` over a cache of ``dtype`` (its weights gathered now)."""
    return cpu_decode.takes_rows(model, PagedKVCache.for_model(model.args, num_pages=2, page_size=16, dtype=dtype))


def _steps(model, cache_dtype, prompt, tokens, monkeypatch, one_call: bool):
    """Logits of each of ``tokens`` fed one at a time after ``prompt``, and the cache after."""
    cache = KVCache.for_model(model.args, 1, dtype=cache_dtype)
    out = []
    with torch.inference_mode():
        model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), cache)
        with monkeypatch.context() as patch:
            if not one_call:
                _layer_by_layer(patch)
            for i, token in enumerate(tokens):
                out.append(decode_one(model, token, len(prompt) + i, cache).float())
    return torch.cat(out), cache


@pytest.mark.parametrize("kind, heads, kv_heads", [("float32", 4, 2), ("float32", 4, 4), ("float32", 4, 1),
                                                   ("bfloat16", 4, 2), ("int8", 4, 2)])
def test_one_call_equals_the_layers(kind, heads, kv_heads, monkeypatch):
    model = _model(kind, n_heads=heads, n_kv_heads=kv_heads)
    dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
    prompt, tokens = [3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26]
    with torch.inference_mode():
        assert _takes(model, dtype)
    got, got_cache = _steps(model, dtype, prompt, tokens, monkeypatch, one_call=True)
    want, want_cache = _steps(model, dtype, prompt, tokens, monkeypatch, one_call=False)
    # float32: the same sums in another order. bfloat16: the layers round every intermediate to
    # bfloat16, the operator keeps float32. int8: the operator rounds activations to 15 bits once
    # per product input, the layers' products do the same on their own inputs.
    tolerance = {"float32": 1e-4, "bfloat16": 0.1, "int8": 2e-2}[kind]
    assert torch.allclose(got, want, atol=tolerance, rtol=0), (got - want).abs().max()
    end = len(prompt) + len(tokens)
    for layer in range(model.args.n_layers):
        for mine, theirs in ((got_cache.keys[layer], want_cache.keys[layer]),
                             (got_cache.values[layer], want_cache.values[layer])):
            assert torch.allclose(mine[:, :, :end].float(), theirs[:, :, :end].float(), atol=tolerance, rtol=0)
            assert not mine[:, :, end:].any()


@settings(max_examples=25, deadline=None)
@given(dim_heads=st.sampled_from([(32, 2, 1), (64, 4, 2), (48, 3, 3), (80, 5, 1)]), hidden=st.integers(1, 90),
       layers=st.integers(1, 3), prompt=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_any_shape_matches_the_layers(dim_heads, hidden, layers, prompt, seed):
    # Widths that are and are not multiples of the 8- and 32-wide loops, any grouping of heads.
    dim, heads, kv_heads = dim_heads
    model = random_model(tiny_args(61, dim=dim, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=hidden,
                                   n_layers=layers, max_seq_len=32), seed=seed)
    model.fuse_projections()
    ids = torch.randint(0, 61, (1, prompt + 1), generator=torch.Generator().manual_seed(seed))
    caches = [KVCache.for_model(model.args, 1) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(ids[:, :prompt], torch.arange(prompt).unsqueeze(0), cache)
        assert cpu_decode.takes_rows(model, PagedKVCache.of_row(caches[0]))
        got = decode_one(model, int(ids[0, prompt]), prompt, caches[0])
        want = model(ids[:, prompt:], torch.tensor([[prompt]]), caches[1])  # the layers
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


def test_greedy_tokens_are_the_layers_tokens(monkeypatch):
    model = _model("float32", seed=3)
    fast = single_stream(model)
    fast.warm_up()  # its backends made now, with the operator
    _layer_by_layer(monkeypatch)
    layers = single_stream(model)
    layers.warm_up()
    # The fast step picks inside the operator; the other has no operator to pick with.
    assert type(fast.core.prepare().table[Kind.LONE_GREEDY]).__name__ == "LoneGreedy"
    assert type(layers.core.prepare().table[Kind.LONE_GREEDY]).__name__ == "PackedForward"
    assert greedy_ids(fast, [1, 5, 9], 40) == greedy_ids(layers, [1, 5, 9], 40)


def test_the_prepared_call_checks_its_token_and_position():
    model = _model("float32", max_seq_len=8)
    with torch.inference_mode():
        decoder = cpu_decode.PagedDecoder(model, PagedKVCache.of_row(KVCache.for_model(model.args, 1)))
        with pytest.raises(RuntimeError, match="past its cache"):
            decoder([1], [8], [[0]])
        with pytest.raises(IndexError, match="outside the vocabulary"):
            decoder([97], [0], [[0]])


def test_threads_do_not_change_the_result():
    # Each output is one thread's sum in a fixed order, whichever thread takes it.
    model = _model("float32", seed=4, dim=256, hidden_dim=512)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            logits, _ = _steps(model, torch.float32, [1, 2, 3], [4, 5], pytest.MonkeyPatch(), one_call=True)
            results.append(logits)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(*results)


def test_only_a_page_pool_without_gradients_takes_it():
    model = _model("float32")
    dense = KVCache.for_model(model.args, 2)
    paged = PagedKVCache.for_model(model.args, num_pages=4, page_size=16)
    with torch.inference_mode():
        assert cpu_decode.takes_rows(model, paged)
        assert cpu_decode.takes_rows(model, PagedKVCache.of_row(dense, 1))
        assert not cpu_decode.takes_rows(model, dense)
        assert not cpu_decode.takes_rows(model, None)
        assert cpu_decode.operator_for(model, dense) is None
    with torch.enable_grad():
        assert not cpu_decode.takes_rows(model, paged)


def test_models_it_cannot_read_keep_the_layers():
    unfused = random_model(tiny_args(97))
    half = _model("float32").to(torch.float16)
    with torch.inference_mode():
        assert not _takes(unfused)
    assert cpu_decode.supports(unfused) and cpu_decode.supports(_model("int8"))
    assert not cpu_decode.supports(half)


def test_the_step_follows_a_cast_of_the_model():
    model = _model("float32")
    with torch.inference_mode():
        cache = KVCache.for_model(model.args, 1)
        decode_one(model, 1, 0, cache)
        model.to(torch.bfloat16)
        cache = KVCache.for_model(model.args, 1, dtype=torch.bfloat16)
        assert cpu_decode.takes_rows(model, PagedKVCache.of_row(cache))
        assert model._cpu_decode.rows.layers[0].qkv.weight.dtype == torch.bfloat16
        assert decode_one(model, 1, 0, cache).dtype == torch.float32


def _large(**overrides) -> torch.nn.Module:
    """A model whose weights fill more than one 2 MiB page, the embedding tied to the classifier."""
    model = random_model(tiny_args(4096, dim=128, hidden_dim=352, tie_embeddings=True, **overrides))
    model.fuse_projections()
    return model


def _projection_weights(model) -> list[torch.Tensor]:
    return [p.weight for layer in model.layers for p in cpu_decode._projections(layer)] + [model.output.weight]


def test_the_weights_move_onto_large_pages_with_their_values_and_ties(monkeypatch):
    model = _large()
    before = [w.clone() for w in _projection_weights(model)]
    prompt, tokens = [3, 14, 15, 92, 65], [35, 89, 79, 32]
    want, _ = _steps(model, torch.float32, prompt, tokens, monkeypatch, one_call=False)
    with torch.inference_mode():
        assert _takes(model)
    moved = _projection_weights(model)
    if cpu_kernels.large_pages():
        block = moved[0].untyped_storage()
        assert all(w.untyped_storage().data_ptr() == block.data_ptr() for w in moved)
        assert block.data_ptr() % cpu_kernels.LARGE_PAGE == 0
    assert all(torch.equal(a, b) for a, b in zip(moved, before))
    assert model.tok_embeddings.weight is model.output.weight
    assert model._cpu_decode.rows.output.weight.data_ptr() == model.output.weight.data_ptr()
    got, _ = _steps(model, torch.float32, prompt, tokens, monkeypatch, one_call=True)
    assert torch.allclose(got, want, atol=1e-4, rtol=0)


def test_a_memory_mapped_weight_is_copied_out_of_its_file(tmp_path, monkeypatch):
    from llama_chat.model.formats.common import in_file_mapping, torch_load

    monkeypatch.setattr(cpu_decode, "_MOVE_PIECE", 1000)  # several pieces per weight
    saved = random_model(_large().args)  # unfused, as checkpoints are
    torch.save({k: v.clone() for k, v in saved.state_dict().items()}, tmp_path / "weights.pth")
    model = random_model(saved.args, seed=5)
    model.load_state_dict(torch_load(tmp_path / "weights.pth"), assign=True)
    model.tie_weights()
    model.fuse_projections()
    assert in_file_mapping(model.output.weight)
    with torch.inference_mode():
        assert _takes(model)
    assert torch.equal(model.output.weight, saved.output.weight)
    assert model.tok_embeddings.weight is model.output.weight
    assert in_file_mapping(model.output.weight) is not cpu_kernels.large_pages()


def test_without_large_pages_the_weights_stay_where_they_are(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "large_pages", lambda: False)
    model = _large()
    where = [w.data_ptr() for w in _projection_weights(model)]
    with torch.inference_mode():
        assert _takes(model)
    assert [w.data_ptr() for w in _projection_weights(model)] == where


@settings(max_examples=40, deadline=None)
@given(threads=st.sampled_from([1, 2]), tie=st.integers(0, 4095), nan=st.sampled_from([None, 0, 1, 2]),
       below=st.integers(1, 4096), token=st.integers(0, 4095), position=st.integers(0, 20))
def test_the_step_picks_as_argmax_does_whatever_the_threads(threads, tie, nan, below, token, position):
    # Ranges of the classifier's rows go to whichever thread comes first, so ties across ranges and
    # NaN logits are where combining the threads' picks could differ from torch.argmax.
    model = _large()
    with torch.no_grad():
        weight = model.output.weight
        weight[tie] = weight[4000] = weight[7] * 40  # three rows tie for the largest logit
        if nan is not None:
            weight[[3000, 100, 2500][:nan + 1]] = float("nan")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            decoder = cpu_decode.PagedDecoder(model, PagedKVCache.for_model(model.args, num_pages=2, page_size=32))
            logits = decoder([token], [position], [[1]])  # the pick's step writes the same keys again
            picked = decoder.pick(token, position, [1], below)
            assert picked == int(logits[0, :below].argmax())
            assert decoder.pick(token, position, [1]) == int(logits[0].argmax())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("rows", [1, 5, 16])
def test_a_step_of_rows_picks_each_rows_argmax(rows):
    model = _large()
    with torch.no_grad():
        model.output.weight[3001] = model.output.weight[12] = model.output.weight[7] * 40  # ties
    g = torch.Generator().manual_seed(rows)
    tokens = torch.randint(0, 4096, (rows,), generator=g).tolist()
    cache = PagedKVCache.for_model(model.args, num_pages=rows + 1, page_size=4)
    with torch.inference_mode():
        decoder = cpu_decode.PagedDecoder(model, cache)
        logits, picks = decoder.with_picks(tokens, [2] * rows, [[r] for r in range(rows)], below=3000)
        assert torch.equal(picks, logits[:, :3000].argmax(dim=-1))
        logits, picks = decoder.with_picks(tokens, [2] * rows, [[r] for r in range(rows)])
        assert torch.equal(picks, logits.argmax(dim=-1))


def test_a_position_past_the_cache_is_an_error(monkeypatch):
    model = _model("float32", max_seq_len=8)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="past its cache"):
        decode_one(model, 1, 8, KVCache.for_model(model.args, 1))
    _layer_by_layer(monkeypatch)
    with torch.inference_mode(), pytest.raises(IndexError, match="past the cache length 8"):
        decode_one(model, 1, 8, KVCache.for_model(model.args, 1))


def test_a_single_stream_decodes_without_compiling_where_the_operator_reads_the_model():
    model = _model("float32")
    one_call = cpu_decode.supports(model)
    assert not compiles_lone(torch.device("cpu"), 10**9, None, quantized=False, dtype=torch.float32,
                             one_call=one_call)
    assert compiles_lone(torch.device("cpu"), 10**9, None, quantized=False, dtype=torch.float32, one_call=False)


def test_rows_of_a_paged_step_equal_the_packed_step():
    # Three sequences at different positions, on scattered pages shared with nothing else, and a
    # fourth row padded into the scratch page: each row's logits and written keys are the packed
    # step's (model/paged_kv_cache.py) for the same tokens.
    model = _model("float32", seed=6, n_heads=4, n_kv_heads=2)
    page = 4
    tables = [[3, 7, 1, 0], [5, 2, 0, 0], [6, 4, 8, 9]]
    lengths = [10, 6, 15]
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]
    caches = [PagedKVCache.for_model(model.args, num_pages=10, page_size=page) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:  # prefill each sequence's prompt but its last token, one row at a time
            for table, prompt in zip(tables, prompts):
                for position, token in enumerate(prompt[:-1]):
                    cpu_decode.forward_rows(model, [token], [position], [table], cache)
        assert cpu_decode.takes_rows(model, caches[0])
        tokens = [p[-1] for p in prompts]
        positions = [n - 1 for n in lengths]
        got = cpu_decode.forward_rows(model, tokens, positions, tables, caches[0])
        want = []
        for table, token, position in zip(tables, tokens, positions):
            slot = table[position // page] * page + position % page
            batch = PagedBatch(torch.tensor([slot]), torch.tensor([position]), 1,
                               torch.tensor([table[:position // page + 1]]), (), position + 1)
            want.append(model(torch.tensor([[token]]), torch.tensor([[position]]), caches[1].view(batch),
                              logits_at=torch.tensor([0]))[0])
    assert torch.allclose(got, torch.cat(want), atol=1e-4, rtol=0), (got - torch.cat(want)).abs().max()
    for layer in range(model.args.n_layers):
        assert torch.allclose(caches[0].keys[layer], caches[1].keys[layer], atol=1e-5)
        assert torch.allclose(caches[0].values[layer], caches[1].values[layer], atol=1e-5)


def test_rows_of_prompt_chunks_write_the_keys_of_one_row_at_a_time_and_give_their_last_logits():
    # Two prompts fed as rows of one step, every token a row (positions 0..10 and 0..6, on
    # scattered pages), beside a third sequence's decode row, with logits of the last rows only:
    # the keys are those written one token a step, and the logits those of the last token's step.
    model = _model("float32", seed=9, n_heads=4, n_kv_heads=2)
    page = 4
    tables = [[3, 7, 1], [5, 2, 0], [6, 4, 8]]
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (11, 7, 5)]
    caches = [PagedKVCache.for_model(model.args, num_pages=10, page_size=page) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:  # the third sequence's first four tokens, one at a time
            for position, token in enumerate(prompts[2][:-1]):
                cpu_decode.forward_rows(model, [token], [position], [tables[2]], cache)
        tokens = prompts[0] + prompts[1] + prompts[2][-1:]
        positions = list(range(11)) + list(range(7)) + [4]
        rows_tables = [tables[0]] * 11 + [tables[1]] * 7 + [tables[2]]
        decoder = cpu_decode.PagedDecoder(model, caches[0])
        got, picks = decoder.with_picks(tokens, positions, rows_tables, sampled=[10, 17, 18])
        want = []
        for prompt, table in zip(prompts[:2], tables[:2]):
            for position, token in enumerate(prompt):
                last = cpu_decode.forward_rows(model, [token], [position], [table], caches[1])
            want.append(last)
        want.append(cpu_decode.forward_rows(model, prompts[2][-1:], [4], [tables[2]], caches[1]))
    want = torch.cat(want)
    assert got.shape == (3, 97)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert torch.equal(picks, got.argmax(dim=-1))
    for layer in range(model.args.n_layers):
        torch.testing.assert_close(caches[0].keys[layer], caches[1].keys[layer], atol=1e-5, rtol=0)
        torch.testing.assert_close(caches[0].values[layer], caches[1].values[layer], atol=1e-5, rtol=0)
    with torch.inference_mode():  # a chunk that draws nothing makes no logits
        none, _ = decoder.with_picks(prompts[1][:3], [0, 1, 2], [tables[1]] * 3, sampled=[])
        assert none.shape == (0, 97)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_a_step_of_many_rows_equals_each_row_alone_whatever_the_threads(kind):
    # 35 rows: float32 weights are packed as panels, taken by tiles of six rows and one of five
    # (AVX2), or two panels at a time by tiles of 11 and 12 rows, and lone panels by tiles of 16,
    # 10 and 9 (AVX-512); bfloat16 ones too for several rows, but a row alone reads its own; int8
    # ones are taken four input rows at a time, and 35 leaves three over. Every row must be what it is alone (float32
    # and int8: to the bit), and no thread count may change a bit of it.
    model = _model(kind, seed=8, dim=96, hidden_dim=200, vocab_size=96)  # a classifier of whole panels
    rows, page = 35, 4
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, 96, (rows,), generator=g).tolist()
    tables = [[r] for r in range(rows)]
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = PagedKVCache.for_model(model.args, num_pages=rows, page_size=page)
            with torch.inference_mode():
                results.append(cpu_decode.forward_rows(model, tokens, [0] * rows, tables, cache))
        alone = PagedKVCache.for_model(model.args, num_pages=rows, page_size=page)
        with torch.inference_mode():
            each = torch.cat([cpu_decode.forward_rows(model, [t], [0], [table], alone)
                              for t, table in zip(tokens, tables)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
    if kind != "bfloat16":  # panels, and int8's integer sums: a row's do not depend on its neighbours
        assert torch.equal(results[0], each)
    assert torch.allclose(results[0], each, atol=1e-4, rtol=1e-4), (results[0] - each).abs().max()


def _rows_logits(model, tokens: list[int], packed: bool) -> torch.Tensor:
    cache = PagedKVCache.for_model(model.args, num_pages=len(tokens) + 1, page_size=4)
    with torch.inference_mode():
        if packed:
            decoder = cpu_decode.PagedDecoder(model, cache)
        else:
            rows = cpu_decode._weights_of(model).step_weights()
            decoder = RowsDecoder(rows, lambda: rows, cache.keys, cache.values, cache.page_size)
        for position in range(2):  # the second step attends over the first
            logits = decoder(tokens, [position] * len(tokens), [[r] for r in range(len(tokens))])
    return logits


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.sampled_from([97, 160, 256]), dim_heads=st.sampled_from([(64, 4), (40, 2), (96, 3)]),
       hidden=st.integers(20, 90), seed=st.integers(0, 10**6))
def test_packed_weights_give_the_logits_of_weight_rows(rows, vocab, dim_heads, hidden, seed):
    # Panels of 16 outputs, whole or cut short (a head of 20, 2 x 45 gate and up rows), tiles of
    # one to six rows (AVX2) or to sixteen, and from 24 rows on two whole panels at a time
    # (AVX-512), and the classifier packed when its 160 or 256 outputs fill whole panels.
    dim, heads = dim_heads
    model = random_model(tiny_args(vocab, dim=dim, n_heads=heads, n_kv_heads=heads, hidden_dim=hidden), seed=seed)
    model.fuse_projections()
    tokens = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed)).tolist()
    packed = _rows_logits(model, tokens, packed=True)
    panels = cpu_decode._weights_of(model).packed_weights()
    assert all(p.panels for layer in panels.layers for p in layer.projections())
    assert panels.output.weight.dim() == (3 if vocab % 16 == 0 else 2)
    torch.testing.assert_close(packed, _rows_logits(model, tokens, packed=False), atol=1e-4, rtol=1e-4)


def test_weights_are_packed_once_within_the_limit_and_never_int8(monkeypatch):
    model = _model("float32", vocab_size=128)
    found = cpu_decode._weights_of(model)
    panels = found.packed_weights()
    assert found.packed_weights() is panels
    for layer, packed_layer in zip(found.rows.layers, panels.layers):
        for rows, packed in zip(layer.projections(), packed_layer.projections()):
            n, k = rows.weight.shape
            assert packed.weight.shape == (-(-n // 16), k, 16)
            assert torch.equal(packed.weight.transpose(1, 2).reshape(-1, k)[:n], rows.weight)
    assert torch.equal(panels.output.weight.transpose(1, 2).reshape(-1, model.args.dim), found.rows.output.weight)
    monkeypatch.setattr(cpu_decode, "PANELS_AT_MOST", 1000)
    small = cpu_decode._weights_of(_model("float32", seed=1))
    assert small.packed_weights() is small.rows
    quantized = _model("int8")
    quantized_layers = cpu_decode._weights_of(quantized).packed_weights().layers
    assert not any(p.panels for layer in quantized_layers for p in layer.projections())


def test_a_row_past_its_pages_is_an_error():
    model = _model("float32")
    cache = PagedKVCache.for_model(model.args, num_pages=4, page_size=4)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="past its cache"):
        cpu_decode.forward_rows(model, [1], [8], [[1, 2]], cache)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="names page 7 of 4"):
        cpu_decode.forward_rows(model, [1], [1], [[7]], cache)


def test_a_kept_decoder_fills_its_inputs_right_as_rows_and_tables_change():
    # One RowsDecoder through steps whose row counts and table widths change (its inputs are
    # kept tensors filled in place, per shape), against a new decoder every step.
    model = _model("float32", seed=9)
    shapes = [(3, 1), (5, 2), (3, 1), (2, 3), (5, 2), (7, 3)]
    caches = [PagedKVCache.for_model(model.args, num_pages=32, page_size=4) for _ in range(2)]
    g = torch.Generator().manual_seed(9)
    with torch.inference_mode():
        kept = cpu_decode.PagedDecoder(model, caches[0])
        for rows, width in shapes:
            tokens = torch.randint(0, 97, (rows,), generator=g).tolist()
            positions = torch.randint(0, 4 * width, (rows,), generator=g).tolist()
            tables = [torch.randperm(32, generator=g)[:width].tolist() for _ in range(rows)]
            logits, picks = kept.with_picks(tokens, positions, tables)
            fresh, fresh_picks = cpu_decode.PagedDecoder(model, caches[1]).with_picks(tokens, positions, tables)
            assert torch.equal(logits, fresh) and torch.equal(picks, fresh_picks)
        for wrong in ([1, -2], [97, 1], [-1]):
            with pytest.raises(IndexError, match="outside the vocabulary"):
                kept(wrong, [0] * len(wrong), [[0], [1]][:len(wrong)])


def test_a_single_stream_takes_the_panels_only_while_the_copy_is_small(monkeypatch):
    model = _model("float32", vocab_size=128)
    found = cpu_decode._weights_of(model)
    paged = PagedKVCache.for_model(model.args, num_pages=4, page_size=4)
    with torch.inference_mode():
        assert cpu_decode.PagedDecoder(model, paged).weights_for(rows=3).packed
        assert cpu_decode.PagedDecoder(model, paged).weights_for(rows=1).packed
        monkeypatch.setattr(cpu_decode, "PANELS_ALONE_AT_MOST", found.panel_bytes() - 1)
        assert cpu_decode.PagedDecoder(model, paged).weights_for(rows=3).packed
        assert not cpu_decode.PagedDecoder(model, paged).weights_for(rows=1).packed
        # bfloat16 weights: float32 panels for several rows, their own rows for one
        model.to(torch.bfloat16)
        halves = cpu_decode.PagedDecoder(model, paged)
        several, lone = halves.weights_for(rows=3), halves.weights_for(rows=1)
        assert several.packed and several.layers[0].qkv.weight.dtype == torch.float32
        assert not lone.packed and lone.layers[0].qkv.weight.dtype == torch.bfloat16


def test_steps_of_one_row_make_no_packed_copy_the_single_stream_does_not_take(monkeypatch):
    # A chat's scheduler on the CPU steps one row at a time: past the single stream's limit its
    # decoder reads the weight rows and makes no copy; its first step of two rows makes it.
    monkeypatch.setattr(cpu_decode, "PANELS_ALONE_AT_MOST", 0)
    model = _model("float32", vocab_size=128)
    found = cpu_decode._weights_of(model)
    cache = PagedKVCache.for_model(model.args, num_pages=4, page_size=4)
    with torch.inference_mode():
        decoder = cpu_decode.PagedDecoder(model, cache)
        decoder([5], [0], [[0]])
        assert found.packed is None
        decoder([5, 6], [1, 0], [[0], [1]])
        assert found.packed is not None and found.packed.output.panels


def test_the_step_model_is_checked_when_made():
    # The operator's StepModel (ml/cpu/decode.py, decode.cpp) checks a model's tensors once, when a
    # decoder is made, rather than at its first step.
    import dataclasses

    model = _model("float32")
    weights = cpu_decode._weights_of(model).step_weights()
    cache = PagedKVCache.for_model(model.args, num_pages=4, page_size=4)
    assert RowsDecoder(weights, lambda: weights, cache.keys, cache.values, cache.page_size)([1], [0], [[0]]).shape == (
        1, 97)
    layers = weights.layers
    skewed = dataclasses.replace(weights, layers=[dataclasses.replace(layers[0], qkv=layers[0].out), *layers[1:]])
    with pytest.raises(RuntimeError, match="qkv of layer 0 is"):
        RowsDecoder(skewed, lambda: skewed, cache.keys, cache.values, cache.page_size)
    unnormed = dataclasses.replace(layers[-1], ffn_norm=layers[-1].ffn_norm[:-1])
    short = dataclasses.replace(weights, layers=[*layers[:-1], unnormed])
    with pytest.raises(RuntimeError, match=f"ffn_norm of layer {len(layers) - 1} must be"):
        RowsDecoder(short, lambda: short, cache.keys, cache.values, cache.page_size)
    # The step reads a layer's parts by name: one it does not know is refused, not ignored.
    with pytest.raises(RuntimeError, match="layer 0 has a part named 'qkv_bais'"):
        torch.classes.llama_chat_cpu.StepModel(
            [{**layers[0].tensors(), "qkv_bais": layers[0].attention_norm,
              "keys": cache.keys[0], "values": cache.values[0]}],
            {"norm": weights.final_norm, "output": weights.output.weight},
            {"heads": 2.0, "kv_heads": 2.0, "eps": 1e-5, "page_size": 4.0}, [])
