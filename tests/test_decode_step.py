"""The static decode step: same tokens as the eager path, compiled once for every position."""

from __future__ import annotations

import pytest
import torch

from builders import random_model, tiny_args
from llama_chat.inference import decode_step
from llama_chat.inference.decode_step import WINDOW_STEP, StaticStep, StaticStepOptions
from llama_chat.inference.engine import Engine, EngineOptions
from llama_chat.inference.model_step import EagerDecode, ModelStep, StaticDecode, StepOptions
from llama_chat.inference.types import Request
from llama_chat.ml import ops
from llama_chat.ml.sampling import SamplingMode, SamplingParams, draw_uniforms, sample, sample_in_graph
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.transformer import Transformer

VOCAB = 300
GREEDY = SamplingParams(temperature=0.0)
NUCLEUS = SamplingParams(temperature=1.0, top_p=0.9)
FULL = SamplingParams(temperature=0.7, top_p=1.0)


@pytest.fixture(scope="module")
def model() -> Transformer:
    # Small weights keep the logits flat, so sampling has real choices to make.
    m = Transformer(tiny_args(VOCAB, max_seq_len=400))
    m.init_weights(std=0.05, generator=torch.Generator().manual_seed(3))
    return m.eval()


def decode_tokens(step: ModelStep, prompt: list[int], n: int, params: SamplingParams, seed: int) -> list[int]:
    decode = step.decode(prompt, 0, params, seed)
    return [decode.next_token() for _ in range(n)]


def test_grouped_attention_matches_repeated_heads():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 5, 16, generator=g)
    k = torch.randn(2, 2, 11, 16, generator=g)
    v = torch.randn(2, 2, 11, 16, generator=g)
    mask = torch.rand(2, 1, 5, 11, generator=g) > 0.3
    mask[..., 0] = True
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), attn_mask=mask)
    torch.testing.assert_close(ops.attention(q, k, v, mask), expected)


@pytest.mark.parametrize("params", [NUCLEUS, FULL, GREEDY], ids=["nucleus", "full", "greedy"])
def test_sampling_in_graph_picks_what_sample_picks(params):
    g = torch.Generator().manual_seed(1)
    mode = SamplingMode.of(params)
    temperature = torch.tensor(params.temperature or 1.0)
    top_p = torch.tensor(params.top_p)
    for _ in range(200):
        logits = torch.randn(1, 1000, generator=g) * 3
        u = torch.rand(1, dtype=torch.float64, generator=g)
        assert torch.equal(sample(logits, params, u), sample_in_graph(logits, mode, temperature, top_p, u))


@pytest.mark.parametrize("params", [GREEDY, NUCLEUS, FULL], ids=["greedy", "nucleus", "full"])
def test_static_step_gives_the_eager_tokens(model, params):
    eager = ModelStep(model, options=StepOptions())
    static = ModelStep(model, options=StepOptions(static=True))
    prompt = [5, 17, 42, 7, 99]
    assert isinstance(static.decode(prompt, 0, params, 1), StaticDecode)
    assert isinstance(eager.decode(prompt, 0, params, 1), EagerDecode)
    for seed in (1, 2):
        assert decode_tokens(static, prompt, 40, params, seed) == decode_tokens(eager, prompt, 40, params, seed)


def test_static_step_stops_queueing_at_the_end_of_the_cache(model):
    step = ModelStep(model, options=StepOptions(static=True), max_seq_len=24)
    eager = ModelStep(model, options=StepOptions(), max_seq_len=24)
    prompt = list(range(3, 13))
    # Tokens for positions 10..23: the last one is sampled after feeding position 22.
    assert decode_tokens(step, prompt, 14, GREEDY, 0) == decode_tokens(eager, prompt, 14, GREEDY, 0)


def test_compiled_step_compiles_once_across_positions_and_requests(monkeypatch):
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    model = Transformer(tiny_args(VOCAB, max_seq_len=400))  # fresh: no state left by other tests
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(3))
    dynamo.reset()
    counters.clear()
    # Every guard evaluated, so that a step which would not match its graph recompiles and shows.
    monkeypatch.setattr(decode_step, "SKIP_GUARDS", False)
    # Whether dynamo recompiles does not depend on the backend; aot_eager spares a C++ build.
    compiled = ModelStep(model, options=StepOptions(static=True, compile=True, backend="aot_eager"),
                         max_seq_len=400)
    eager = ModelStep(model, options=StepOptions())
    prompt = [5, 17, 42, 7, 99]
    first = decode_tokens(compiled, prompt, 300, GREEDY, 0)
    frames = counters["stats"]["unique_graphs"]
    assert frames == 1, dict(counters["stats"])
    second = decode_tokens(compiled, prompt[:3], 50, GREEDY, 0)
    assert counters["stats"]["unique_graphs"] == frames, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert first == decode_tokens(eager, prompt, 300, GREEDY, 0)
    assert second == decode_tokens(eager, prompt[:3], 50, GREEDY, 0)


def test_compiled_sampling_step_gives_the_eager_tokens(model):
    compiled = ModelStep(model, options=StepOptions(static=True, compile=True), max_seq_len=400)
    eager = ModelStep(model, options=StepOptions())
    prompt = [5, 17, 42]
    assert decode_tokens(compiled, prompt, 60, NUCLEUS, 4) == decode_tokens(eager, prompt, 60, NUCLEUS, 4)


def test_a_compile_that_fails_leaves_the_eager_step(model):
    def broken_compiler(graph, inputs):
        raise RuntimeError("no C++ compiler found\nmore detail")

    step = ModelStep(model, options=StepOptions(static=True, compile=True, backend=broken_compiler))
    eager = ModelStep(model, options=StepOptions())
    prompt = [5, 17, 42]
    decode = step.decode(prompt, 0, GREEDY, 0)
    assert isinstance(decode, EagerDecode) and step.static is None
    assert "no C++ compiler found" in step.static_failure and "more detail" not in step.static_failure
    assert [decode.next_token() for _ in range(20)] == decode_tokens(eager, prompt, 20, GREEDY, 0)
    engine = Engine(model, _NoTokenizer(), options=EngineOptions(compile=False))
    engine.step = ModelStep(model, options=StepOptions(static=True, compile=True, backend=broken_compiler))
    engine.warm_up(GREEDY)
    assert not engine.compiles and "no C++ compiler found" in engine.compile_failure


def test_the_step_attends_over_a_window_that_grows_with_the_position(model):
    step = ModelStep(model, options=StepOptions(static=True), max_seq_len=400)
    static = step.static
    assert static.capacity == 400 and step.cache.max_seq_len == 401  # one spare slot
    assert static._window(0).shape[0] == WINDOW_STEP
    assert static._window(WINDOW_STEP - 1).shape[0] == WINDOW_STEP
    assert static._window(WINDOW_STEP).shape[0] == 2 * WINDOW_STEP
    assert static._window(399).shape[0] == 400
    # Across every window boundary the tokens stay the eager path's.
    eager = ModelStep(model, options=StepOptions())
    assert decode_tokens(step, [5, 17], 395, GREEDY, 0) == decode_tokens(eager, [5, 17], 395, GREEDY, 0)


def test_engine_static_path_end_to_end(model):
    engine = Engine(model, _NoTokenizer(), options=EngineOptions(compile=False))
    engine.step = ModelStep(model, options=StepOptions(static=True))
    reference = Engine(model, _NoTokenizer())
    request = Request((5, 17, 42), sampling=NUCLEUS, seed=9, max_tokens=30)
    assert engine.generate(request).token_ids == reference.generate(request).token_ids


def test_static_step_refuses_a_batched_cache(model):
    cache = KVCache.for_model(model.args, rows=2)
    with pytest.raises(ValueError, match="one sequence"):
        StaticStep(model, cache, torch.device("cpu"), StaticStepOptions())


def test_uniforms_are_the_same_for_a_seed():
    assert torch.equal(draw_uniforms(10, 3), draw_uniforms(10, 3))
    assert not torch.equal(draw_uniforms(10, 3), draw_uniforms(10, 4))


class _NoTokenizer:
    """Token ids only: no stop tokens, every token one byte."""

    stop_ids: frozenset[int] = frozenset()
    eos_id = None
    special_tokens: dict[str, int] = {}

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"


def test_fused_projections_give_the_same_logits():
    model = Transformer(tiny_args(VOCAB, max_seq_len=64))
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(5))
    tokens = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.inference_mode():
        before = model(tokens)
        model.fuse_projections()
        model.fuse_projections()  # idempotent
        after = model(tokens)
    assert not hasattr(model.layers[0].attention, "wq")
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_attention_over_the_cache_matches_sdpa():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 1, 16, generator=g)
    k = torch.randn(1, 2, 40, 16, generator=g)
    v = torch.randn(1, 2, 40, 16, generator=g)
    mask = (torch.arange(40) <= 23).view(1, 1, 1, 40)
    torch.testing.assert_close(ops.attention_over_cache(q, k, v, mask), ops.attention(q, k, v, mask))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_ids_past_the_tokenizer_are_never_sampled(static):
    model = Transformer(tiny_args(VOCAB, max_seq_len=64))
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():  # the padding rows would win every draw if they could
        model.output.weight[250:] = model.output.weight[250:].sign() * 5
    step = ModelStep(model, options=StepOptions(static=static), sample_ids=250)
    for params in (GREEDY, FULL):
        tokens = decode_tokens(step, [5, 17, 42], 30, params, 1)
        assert max(tokens) < 250, tokens
    unlimited = ModelStep(model, options=StepOptions(static=static))
    assert max(decode_tokens(unlimited, [5, 17, 42], 30, GREEDY, 1)) >= 250


def test_compiled_row_products_give_the_eager_tokens(model):
    # Projections as multiply-and-sum, compiled: another summation order, the same greedy tokens.
    compiled = ModelStep(model, options=StepOptions(static=True, compile=True, row_products=True),
                         max_seq_len=400)
    eager = ModelStep(model, options=StepOptions())
    prompt = [5, 17, 42]
    assert decode_tokens(compiled, prompt, 40, GREEDY, 0) == decode_tokens(eager, prompt, 40, GREEDY, 0)


def test_linear_as_row_products_matches():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(1, 1, 32, generator=g), torch.randn(48, 32, generator=g)
    torch.testing.assert_close(ops.linear(x, w, row_products=True), ops.linear(x, w))
