"""The CPU operator's prompt attention (``ml/cpu/attention.cpp``) against attention computed in
float64 from the same bfloat16-rounded queries, keys and values: what is left is its own rounding
of the softmax's weights and its float32 sums. Keys a query must not see never count, whatever
they hold. Where the build has no AVX-512 BF16 these tests are skipped, and ``ml/ops.py`` keeps
PyTorch's kernels (checked here too)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from builders import random_model, tiny_args
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml import ops
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.sampling import SamplingParams



@pytest.fixture(scope="module")
def built(cpu_kernels_loaded) -> None:
    if not (cpu_kernels_loaded and cpu_kernels.attends_prompts()):
        pytest.skip("the CPU operator is not built with AVX-512 BF16 here")



# The operator's e^x of the softmax's weights, relative (attention.cpp, exp_of_nonpositive).
EXP_ERROR = 4e-6


def tolerance(v: torch.Tensor) -> dict:
    """The softmax's weights are made within EXP_ERROR and rounded to bfloat16, each by a factor
    1 + d with |d| <= D = 2^-9 + EXP_ERROR (1 + 2^-9), and normalised by their rounded sum: an
    output moves by sum_j p_j d_j (v_j - out) / sum_j p_j (1 + d_j), at most D / (1 - D) of the
    values' spread. The float32 sums add far less."""
    spread = float(bf16(v).max() - bf16(v).min())
    most = 2**-9 + EXP_ERROR * (1 + 2**-9)
    return {"rtol": 0.0, "atol": spread * most / (1 - most) + 1e-5}


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def reference(q, k, v, past: int, rule: ops.AttentionRule) -> torch.Tensor:
    """float64 attention of the rounded inputs: ``q`` ``(heads, seq, dim)``, ``k``/``v``
    ``(kv_heads, keys, dim)``; query ``i`` at position ``past + i``."""
    heads, seq, dim = q.shape
    rep = heads // k.shape[0]
    scale = rule.scale if rule.scale is not None else 1.0 / math.sqrt(dim)
    cap = rule.softcap
    queries = bf16(q.double() * (scale / cap if cap else scale))
    scores = queries @ bf16(k).repeat_interleave(rep, 0).transpose(1, 2)
    if cap:
        scores = cap * torch.tanh(scores)
    position = torch.arange(past, past + seq).view(seq, 1)
    key = torch.arange(k.shape[1]).view(1, -1)
    seen = key <= position
    if rule.window:
        seen &= key > position - rule.window
    weights = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return (weights @ bf16(v).repeat_interleave(rep, 0)).float()


def operator(q, k, v, past: int, rule: ops.AttentionRule) -> torch.Tensor:
    scale = rule.scale if rule.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.llama_chat_cpu.prompt_attention(q, k, v, past, scale, rule.softcap or 0.0, rule.window or 0)


@settings(max_examples=60, deadline=None)
@given(heads_and_kv=st.sampled_from([(1, 1), (4, 4), (6, 2), (8, 1), (12, 2)]),
       dim=st.sampled_from([64, 128, 256]), seq=st.integers(1, 90), past=st.integers(0, 200),
       window=st.sampled_from([None, 1, 5, 64, 100]), cap=st.sampled_from([None, 30.0]),
       scale=st.sampled_from([None, 0.0625]), seed=st.integers(0, 2**16))
def test_the_operator_is_attention_of_its_rounded_inputs(built, heads_and_kv, dim, seq, past, window, cap, scale, seed):
    heads, kv_heads = heads_and_kv
    g = torch.Generator().manual_seed(seed)
    rule = ops.AttentionRule(window=window, softcap=cap, scale=scale)
    # Queries as the paged view passes them, a slice of a longer step's; scores of a few units.
    q = (torch.randn(heads, seq + 5, dim, generator=g) * 2)[:, 2:2 + seq]
    k = torch.randn(kv_heads, past + seq, dim, generator=g)
    v = torch.randn(kv_heads, past + seq, dim, generator=g)
    torch.testing.assert_close(operator(q, k, v, past, rule), reference(q, k, v, past, rule), **tolerance(v))


@settings(max_examples=40, deadline=None)
@given(dim=st.sampled_from([64, 128, 256]), keys=st.integers(2, 700), data=st.data(),
       window=st.sampled_from([0, 50]), cap=st.sampled_from([0.0, 30.0]), seed=st.integers(0, 2**16))
def test_a_querys_result_does_not_depend_on_where_its_chunk_starts(built, dim, keys, data, window, cap, seed):
    """A prompt read back from the cache has its last tokens computed in a chunk of their own; the
    cold run computed them inside a longer one. Every chunk of two queries or more takes the
    operator (``MIN_OWN_ATTENTION_QUERIES``), and each query's bits are the same either way."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(h, keys, dim, generator=g) for h in (4, 2, 2))
    first = data.draw(st.integers(0, keys - 2), label="first")
    later = data.draw(st.integers(first, keys - ops.MIN_OWN_ATTENTION_QUERIES), label="later")

    def chunk(start: int) -> torch.Tensor:
        return torch.ops.llama_chat_cpu.prompt_attention(q[:, start:].contiguous(), k, v, start, dim ** -0.5, cap,
                                                         window)

    assert torch.equal(chunk(first)[:, later - first:], chunk(later))


@pytest.mark.parametrize("window", [None, 20])
def test_keys_a_query_does_not_see_never_count(built, window):
    """Keys past a query's position, and before its window, hold huge values: the output is that
    of the keys it sees alone (the last query sees every key)."""
    g = torch.Generator().manual_seed(3)
    past, seq, dim = 70, 40, 64
    q = torch.randn(4, seq, dim, generator=g)
    k = torch.randn(2, past + seq, dim, generator=g)
    v = torch.randn(2, past + seq, dim, generator=g)
    rule = ops.AttentionRule(window=window)
    clean = operator(q, k, v, past, rule)
    for i in (0, 17, seq - 1):
        position = past + i
        first = 0 if window is None else position - window + 1
        loud_k, loud_v = k.clone(), v.clone()
        loud_k[:, position + 1:] = 1e3
        loud_v[:, position + 1:] = 1e4
        loud_k[:, :first] = 1e3
        loud_v[:, :first] = 1e4
        assert torch.equal(operator(q, loud_k, loud_v, past, rule)[:, i], clean[:, i])


def test_the_operators_attention_is_close_to_pytorchs_float32_attention(built):
    g = torch.Generator().manual_seed(4)
    past, seq = 100, 48
    q = torch.randn(1, 12, seq, 128, generator=g)
    k = torch.randn(1, 2, past + seq, 128, generator=g)
    v = torch.randn(1, 2, past + seq, 128, generator=g)
    got = ops.own_prompt_attention(q, k, v, past)
    assert torch.equal(got[0], operator(q[0], k[0], v[0], past, ops.PLAIN_ATTENTION))
    mask = torch.arange(past + seq).view(1, -1) <= torch.arange(past, past + seq).view(-1, 1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(6, dim=1), v.repeat_interleave(6, dim=1), attn_mask=mask.view(1, 1, seq, -1))
    torch.testing.assert_close(got, expected, rtol=0.0, atol=3e-2)


def test_what_the_operator_does_not_take_keeps_pytorchs_attention(monkeypatch):
    """Short chunks, other widths, other dtypes, and builds without it: PyTorch's kernels."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(1, 2, 40, 64, generator=g)
    assert ops.own_prompt_attention(torch.randn(1, 4, ops.MIN_OWN_ATTENTION_QUERIES - 1, 64), k, k, 40 - 15) is None
    assert ops.own_prompt_attention(torch.randn(1, 4, 20, 96), torch.randn(1, 2, 40, 96), torch.randn(1, 2, 40, 96),
                                    20) is None
    assert ops.own_prompt_attention(torch.randn(1, 4, 20, 64).bfloat16(), k.bfloat16(), k.bfloat16(), 20) is None
    monkeypatch.setattr(cpu_kernels, "attends_prompts", lambda: False)
    assert ops.own_prompt_attention(torch.randn(1, 4, 20, 64), k, k, 20) is None


@pytest.mark.parametrize("cache_type, taken", [("f16", True), ("f32", False)])
def test_the_scheduler_takes_the_operator_for_prompts_over_16_bit_pages_only(built, sp_tokenizer, monkeypatch,
                                                                              cache_type, taken):
    """Float16 pages (the CPU's default) already hold fewer bits than float32: their prompt
    chunks take the operator. A float32 cache, asked for, is attended in float32."""
    model = random_model(tiny_args(sp_tokenizer.vocab_size, dim=128, n_heads=2, n_kv_heads=1), seed=3)
    calls = []

    def counted(*args, **kwargs):
        out = own_prompt_attention(*args, **kwargs)
        calls.append(out is not None)
        return out

    own_prompt_attention = ops.own_prompt_attention
    monkeypatch.setattr(ops, "own_prompt_attention", counted)
    scheduler = Scheduler(model, sp_tokenizer, SchedulerOptions(max_batch=1, page_size=8, cache_type=cache_type))
    prompt = [1] + torch.randint(3, sp_tokenizer.vocab_size, (47,), generator=torch.Generator().manual_seed(1)).tolist()
    completion = scheduler.generate(Request(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=4))
    assert len(completion.token_ids) == 4
    if taken:
        assert calls and all(calls), calls  # each layer's chunk of 48 queries
    else:
        assert calls == []
