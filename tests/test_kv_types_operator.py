"""The CPU operator over pages of each KV cache type: it writes the rows the model's forward would
(``kv_types``) and reads them in place, with the same logits as the forward over the same pages."""

from __future__ import annotations

import shutil

import pytest
import torch

from builders import random_model, tiny_args
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.model import cpu_decode
from llama_chat.model.key_centers import KeyCenters
from llama_chat.model.kv_types import TYPES
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedBatch, PagedKVCache

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernels")

PAGE = 4
TABLES = [[3, 7, 1, 10], [5, 2, 11, 12], [6, 4, 8, 9]]
LENGTHS = [10, 6, 15]
# One step of each type, relative to a value (floats) or to a block's largest value (blocks).
STEP = {"f16": 2**-10, "bf16": 2**-7, "q8_0": 1 / 100, "q4_0": 1 / 6}


@pytest.fixture(autouse=True)
def _loaded(cpu_kernels_loaded):
    assert cpu_kernels_loaded, cpu_kernels.failure()


def model_with_heads(head_dim: int, seed: int = 6) -> torch.nn.Module:
    model = random_model(tiny_args(97, dim=2 * head_dim, n_heads=2, n_kv_heads=1, hidden_dim=96), seed=seed)
    model.fuse_projections()
    return model


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in LENGTHS]


def prefill_by_operator(model, cache) -> None:
    for table, prompt in zip(TABLES, prompts()):
        for position, token in enumerate(prompt[:-1]):
            cpu_decode.forward_rows(model, [token], [position], [table], cache)


def forward_row(model, cache, token: int, position: int, table: list[int], slot: int | None = None):
    """The model's forward of one token over ``table``'s pages, its keys and values written at
    ``slot`` (by default the position's own place)."""
    slot = table[position // PAGE] * PAGE + position % PAGE if slot is None else slot
    batch = PagedBatch(torch.tensor([slot]), torch.tensor([position]), 1,
                       torch.tensor([table[:position // PAGE + 1]]), (), position + 1)
    return model(torch.tensor([[token]]), torch.tensor([[position]]), cache.view(batch),
                 logits_at=torch.tensor([0]))[0]


def some_centers(model, seed: int = 3) -> KeyCenters:
    """A shift and a scale for every key channel, far from none: whatever the operator and the
    forward keep, they keep alike."""
    g = torch.Generator().manual_seed(seed)
    shape = (model.args.n_kv_heads, model.args.head_dim)
    return KeyCenters([torch.randn(shape, generator=g) for _ in model.layers],
                      [torch.rand(shape, generator=g) * 1.5 + 0.5 for _ in model.layers])


@pytest.mark.parametrize("head_dim", [32, 64, 96, 256])  # 512-bit vectors of each size; 96 is not rotated
@pytest.mark.parametrize("name", ["f16", "bf16", "q8_0", "q4_0", "q4_0 centred"])
def test_the_operator_reads_and_writes_pages_as_the_models_forward_does(name, head_dim):
    model = model_with_heads(head_dim)
    name, _, centred = name.partition(" ")
    kind = TYPES[name]
    caches = [PagedKVCache.for_model(model.args, num_pages=13, page_size=PAGE, dtype=kind) for _ in range(2)]
    if centred:
        for cache in caches:
            cache.center_keys_by(some_centers(model))
    with torch.inference_mode():
        prefill_by_operator(model, caches[0])
        assert cpu_decode.takes_rows(model, caches[0])
        tokens = [p[-1] for p in prompts()]
        positions = [n - 1 for n in LENGTHS]
        got = cpu_decode.forward_rows(model, tokens, positions, TABLES, caches[0])
        # The same rows alone: equal to the bit, whatever else is in the step.
        alone = torch.cat([cpu_decode.forward_rows(model, [t], [p], [table], caches[0])
                           for t, p, table in zip(tokens, positions, TABLES)])
        assert torch.equal(got, alone)
        # The model's forward over the same pages, the operator's last rows included: its own rows
        # go to the scratch page, which no table holds.
        want = torch.cat([forward_row(model, caches[0], token, position, table, slot=SCRATCH_PAGE * PAGE)
                          for token, position, table in zip(tokens, positions, TABLES)])
        # Its rows at their places, over pages the operator wrote up to the last token: checked
        # against the operator's rows below.
        prefill_by_operator(model, caches[1])
        for token, position, table in zip(tokens, positions, TABLES):
            forward_row(model, caches[1], token, position, table)
    # Each logit is the end of sums over the model's width, which the operator and the forward add
    # up in their own orders (its vector width and kernel are the CPU's): float32 rounding of at
    # most width * eps of its size. (Over rows each wrote for itself, one element stored a step of
    # the type apart would move the logits by far more than the sums' rounding: a q8_0 step is
    # 1/127 of its block.) Centred keys: the operator scales the query and the forward the keys,
    # and their scores differ by a constant a query (softmax drops it): each rounded at its own size.
    close = model.args.dim * torch.finfo(torch.float32).eps * float(want.abs().max())
    close = max(close, 2e-3) if centred else close
    assert torch.allclose(got, want, atol=close, rtol=0), ((got - want).abs().max(), close)
    written = (slice(None), slice(SCRATCH_PAGE + 1, None))  # the scratch page holds rows in one cache only
    for layer in range(model.args.n_layers):
        for ours, theirs, keys in ((caches[0].keys[layer][written], caches[1].keys[layer][written], True),
                                   (caches[0].values[layer][written], caches[1].values[layer][written], False)):
            # The last token's keys and values are computed by each in its own order of sums:
            # stored, they may round a step of the type apart, nowhere more.
            a, b = kind.load(ours, torch.float32, keys=keys), kind.load(theirs, torch.float32, keys=keys)
            assert torch.allclose(a, b, rtol=STEP[name], atol=STEP[name] * float(b.abs().max())), (a - b).abs().max()


@pytest.mark.parametrize("name, error", [("f16", 3e-3), ("bf16", 3e-2), ("q8_0", 5e-2), ("q4_0", 0.8)])
def test_the_operators_logits_over_each_type_are_near_its_logits_over_float32(name, error):
    model = model_with_heads(64, seed=8)
    out = {}
    with torch.inference_mode():
        for kind in ("f32", name):
            cache = PagedKVCache.for_model(model.args, num_pages=13, page_size=PAGE, dtype=TYPES[kind])
            prefill_by_operator(model, cache)
            out[kind] = cpu_decode.forward_rows(model, [p[-1] for p in prompts()], [n - 1 for n in LENGTHS],
                                                TABLES, cache)
    spread = (out[name] - out["f32"]).norm() / out["f32"].norm()
    assert 0 < spread <= error


def test_the_operators_q4_0_blocks_are_the_torch_ones():
    """The cache's writes from the model's forward take the operator's q4_0 rounding where it is
    loaded; torch's own search of the scales gives the same blocks but where two scales' errors
    tie within a float's rounding of their sums."""
    from llama_chat.model import kv_types

    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 128, generator=g)
    x[:, 7] *= 30
    ours = torch.ops.llama_chat_cpu.q4_0_rows(x, False)
    theirs = kv_types._q4_0(x.view(96, -1, 32)).view(96, -1)
    assert ours.shape == theirs.shape and ours.dtype == torch.uint8
    assert (ours != theirs).float().mean() < 0.01
    turned = torch.ops.llama_chat_cpu.q4_0_rows(x, True)
    assert torch.equal(TYPES["q4_0"].store(x, keys=True), turned)
    from_torch = kv_types._q4_0(kv_types.hadamard(x).view(96, -1, 32)).view(96, -1)
    assert (turned != from_torch).float().mean() < 0.01
