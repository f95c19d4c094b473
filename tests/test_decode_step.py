"""The static decode step of a job running alone (``decode_step.LoneGraph``), run eagerly here (the
compiled and graphed runs are test_paged_step.py's and the GPU's): the tokens of the other steps,
greedy and sampled in the step, its next step queued ahead, and the model pieces it is made of."""

from __future__ import annotations

import pytest
import torch

from builders import IdsTokenizer, single_stream, tiny_args
from llama_chat.inference.scheduler import Scheduler
from llama_chat.inference.types import GenerationState, Request
from llama_chat.ml import ops
from llama_chat.ml.sampling import SamplingMode, SamplingParams, draw_uniforms, sample, sample_in_graph
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


def single(model, *, static: bool, vocab_size: int | None = None) -> Scheduler:
    """One job at a time; ``static``: its decode steps through the static step, not compiled."""
    return single_stream(model, IdsTokenizer(vocab_size), static=static, backend=None, page_size=8)


def decode_tokens(scheduler: Scheduler, prompt: list[int], n: int | None, params: SamplingParams,
                  seed: int) -> list[int]:
    return list(scheduler.generate(Request(tuple(prompt), sampling=params, seed=seed, max_tokens=n)).token_ids)


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
def test_static_step_gives_the_eager_tokens_with_its_next_step_queued_ahead(model, params):
    static, eager = single(model, static=True), single(model, static=False)
    prompt = [5, 17, 42, 7, 99]
    for seed in (1, 2):
        before = static.core.lone_step.steps
        assert decode_tokens(static, prompt, 40, params, seed) == decode_tokens(eager, prompt, 40, params, seed)
        # Every token but the first (the prompt's) came from the static step, and the step queued
        # after the last one ran too, its keys past the job's end.
        assert static.core.lone_step.steps - before == 40


def test_static_step_stops_queueing_at_the_end_of_the_context(model):
    small = Transformer(tiny_args(VOCAB, max_seq_len=24))
    small.load_state_dict(model.state_dict(), strict=False)
    prompt = list(range(3, 13))
    # Tokens for positions 10..23: the last one is drawn after feeding position 22.
    static = single(small, static=True)
    done = static.generate(Request(tuple(prompt), sampling=GREEDY))
    assert done.finish_reason is GenerationState.CONTEXT_FULL and len(done.token_ids) == 14
    assert list(done.token_ids) == decode_tokens(single(small, static=False), prompt, None, GREEDY, 0)
    # Positions 10..22 gave tokens; the step queued ahead at 23, the context's last slot, drew
    # one nobody took, and none was queued past it.
    assert static.core.lone_step.steps == 14


def test_uniforms_are_the_same_for_a_seed():
    assert torch.equal(draw_uniforms(10, 3), draw_uniforms(10, 3))
    assert not torch.equal(draw_uniforms(10, 3), draw_uniforms(10, 4))


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


@pytest.mark.parametrize("heads,kv_heads,length,past", [(12, 2, 37, 100), (4, 4, 1, 5), (8, 2, 16, 16), (6, 3, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_chunk_after_its_past_attends_as_the_mask_says(heads, kv_heads, length, past, dtype):
    """``chunk_attention`` joins the past's unmasked attention and the chunk's causal one: the same
    as the chunk's mask through SDPA (float32 inputs: to float32 rounding; bf16: to the output's)."""
    g = torch.Generator().manual_seed(length + past)
    # The chunk's queries a slice of the step's, as the paged view passes them.
    q = torch.randn(1, heads, length + 7, 32, generator=g)[:, :, 3:3 + length].to(dtype)
    k = torch.randn(1, kv_heads, past + length, 32, generator=g).to(dtype)
    v = torch.randn(1, kv_heads, past + length, 32, generator=g).to(dtype)
    mask = (torch.arange(past + length).view(1, -1) <= torch.arange(past, past + length).view(-1, 1)).view(
        1, 1, length, -1)
    rep = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(rep, dim=1), v.float().repeat_interleave(rep, dim=1), attn_mask=mask)
    got = ops.chunk_attention(q, k, v, past, mask)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = {} if dtype == torch.float32 else {"rtol": 0.0, "atol": 2e-2}
    torch.testing.assert_close(got.float(), expected, **tolerance)


@pytest.mark.parametrize("rule", [ops.AttentionRule(softcap=50.0), ops.AttentionRule(window=7, softcap=30.0),
                                  ops.AttentionRule(window=40, scale=0.1)], ids=["cap", "window-cap", "window-scale"])
@pytest.mark.parametrize("length,start", [(23, 0), (23, 30), (4, 60)])
def test_a_ruled_run_in_blocks_of_queries_is_the_run_attended_whole(rule, length, start):
    """Blocks of 5 queries, each over the keys it can see, give the whole run's attention under
    the rule's mask: the same products of the same keys, the cut-off keys' weights exactly 0."""
    g = torch.Generator().manual_seed(length + start)
    q = torch.randn(1, 8, length, 16, generator=g)
    k = torch.randn(1, 2, start + length, 16, generator=g)
    v = torch.randn(1, 2, start + length, 16, generator=g)
    seen = ops.visible_keys(torch.arange(start, start + length).view(1, length), torch.arange(start + length), rule.window)
    torch.testing.assert_close(ops.ruled_run_attention(q, k, v, start, rule, rows=5),
                               ops.ruled_attention(q, k, v, seen, rule))


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
    limited = single(model, static=static, vocab_size=250)
    for params in (GREEDY, FULL):
        tokens = decode_tokens(limited, [5, 17, 42], 30, params, 1)
        assert max(tokens) < 250, tokens
    unlimited = single(model, static=static)
    assert max(decode_tokens(unlimited, [5, 17, 42], 30, GREEDY, 1)) >= 250


def test_linear_as_row_products_matches():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(1, 1, 32, generator=g), torch.randn(48, 32, generator=g)
    torch.testing.assert_close(ops.linear(x, w, row_products=True), ops.linear(x, w))
