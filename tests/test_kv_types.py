"""KV cache types: rows stored as 16-bit floats or llama.cpp's q8_0 and q4_0 blocks, and read back."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from builders import random_model, tiny_args
from llama_chat.model import key_centers, kv_types
from llama_chat.model.kv_types import TYPES, for_device, hadamard


def rows(n: int = 12, dim: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    x[:, 5] *= 20  # an outlier channel, as real keys have
    return x


def test_q8_0_blocks_are_llama_cpps_to_the_byte():
    x = rows()
    stored = TYPES["q8_0"].store(x, keys=False)
    assert stored.dtype == torch.uint8 and stored.shape == (12, TYPES["q8_0"].row_size(64))
    reference = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    # Ties may round apart (torch rounds half to even), nowhere else.
    assert (stored.numpy() != reference).mean() < 0.01
    back = TYPES["q8_0"].load(stored, torch.float32, keys=False)
    expected = np.asarray(gguf.quants.dequantize(stored.numpy(), gguf.GGMLQuantizationType.Q8_0), dtype=np.float32)
    assert torch.equal(back, torch.from_numpy(expected).view(12, 64))


def test_q4_0_blocks_are_llama_cpps_blocks_of_rotated_rows_with_scales_of_least_error():
    x = rows(n=64)
    stored = TYPES["q4_0"].store(x, keys=False)
    assert stored.dtype == torch.uint8 and stored.shape == (64, TYPES["q4_0"].row_size(64))
    # llama.cpp reads them as the rotated rows they hold.
    q4 = gguf.GGMLQuantizationType.Q4_0
    read = torch.from_numpy(np.asarray(gguf.quants.dequantize(stored.numpy(), q4), dtype=np.float32)).view(64, 64)
    assert torch.equal(TYPES["q4_0"].load(stored, torch.float32, keys=False), hadamard(read))
    # Each block's scale is chosen for the least error: never more than llama.cpp's own rounding.
    turned = hadamard(x)
    theirs = torch.from_numpy(np.asarray(gguf.quants.dequantize(gguf.quants.quantize(turned.numpy(), q4), q4),
                                         dtype=np.float32)).view(64, 64)
    ours_error = (read - turned).square().view(64, 2, 32).sum(-1)
    theirs_error = (theirs - turned).square().view(64, 2, 32).sum(-1)
    assert (ours_error <= theirs_error * (1 + 1e-3) + 1e-9).all()
    assert ours_error.sum() < 0.95 * theirs_error.sum()


@pytest.mark.parametrize("name, error", [("f32", 0.0), ("f16", 1e-3), ("bf16", 8e-3), ("q8_0", 2e-2),
                                         ("q4_0", 0.2)])
def test_round_trips_lose_at_most_what_the_type_allows(name, error):
    x = rows()
    back = TYPES[name].load(TYPES[name].store(x, keys=True), torch.float32, keys=True)
    relative = ((back - x).norm(dim=-1) / x.norm(dim=-1)).max()
    assert relative <= error + 1e-7
    if name != "f32":
        assert relative > 0


def test_rotating_q4_0_rows_spreads_an_outlier_and_keeps_scores_and_sums():
    x, q = rows(), torch.randn(64)
    w = torch.softmax(torch.randn(12), dim=0)
    assert torch.allclose(hadamard(hadamard(x)), x, atol=1e-5)  # its own inverse
    assert torch.allclose(hadamard(x) @ hadamard(q), x @ q, atol=1e-4)
    assert torch.allclose(w @ hadamard(x), hadamard(w @ x), atol=1e-4)  # a weighted sum turns back once
    rotated = TYPES["q4_0"]
    plain = kv_types.KVType("q4_0", torch.uint8, block_bytes=18)
    keys = {t: t.load(t.store(x, keys=True), torch.float32, keys=True) for t in (rotated, plain)}
    values = {t: t.load(t.store(x, keys=False), torch.float32, keys=False) for t in (rotated, plain)}
    assert (keys[rotated] @ q - x @ q).abs().mean() < (keys[plain] @ q - x @ q).abs().mean()
    # Values are rotated as keys are, read back turned: the same values within q4_0's error,
    # closer than unrotated where a channel stands out.
    assert torch.equal(values[rotated], keys[rotated])
    assert not torch.equal(rotated.store(x, keys=False), plain.store(x, keys=False))
    assert (values[rotated] - x).norm() < (values[plain] - x).norm() < 0.2 * x.norm()
    assert (w @ values[rotated] - w @ x).norm() < (w @ values[plain] - w @ x).norm()
    # A head whose size is not a power of two is not rotated.
    odd = rows(dim=96)
    for keys_ in (True, False):
        assert torch.equal(rotated.store(odd, keys=keys_), plain.store(odd, keys=keys_))


def off_centre_keys(positions: int, seed: int) -> torch.Tensor:
    """Keys ``(kv_heads, positions, head_dim)`` as a trained model's sit: a common part per channel
    larger than what varies, and a few channels spread wider than the rest."""
    g = torch.Generator().manual_seed(100)  # the same model: its channels' bias and spread
    common = 3 * torch.randn(2, 1, 64, generator=g)
    spread = torch.ones(2, 1, 64)
    spread[..., :4] = 6
    return common + spread * torch.randn(2, positions, 64, generator=torch.Generator().manual_seed(seed))


def attention_weights(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ keys.transpose(1, 2) / 8, dim=-1)


def test_q4_0_keys_kept_by_a_measure_give_the_weights_of_the_keys_themselves_more_closely():
    """Kept as (k - shift) / scale and read back as (k - shift): every score of a query moves by
    the same q . shift, which the softmax does not see, and the error of the weights falls."""
    keys, q = off_centre_keys(256, seed=1), torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    center = tuple(t.unsqueeze(1) for t in key_centers.of_keys(off_centre_keys(128, seed=3)))  # other keys
    kind = TYPES["q4_0"]
    plain = kind.load(kind.store(keys, keys=True), torch.float32, keys=True)
    centred = kind.load(kind.store(keys, keys=True, center=center), torch.float32, keys=True, center=center)
    assert torch.allclose(centred + center[0], keys, atol=0.3 * float(keys.abs().max()))

    def error(read: torch.Tensor) -> float:  # the weights' total variation, on average
        return float((attention_weights(q, read) - attention_weights(q, keys)).abs().sum(-1).mean() / 2)

    assert error(centred) < 0.5 * error(plain), (error(centred), error(plain))
    # Values, and the other types, are kept as they are whatever the measure.
    assert torch.equal(kind.store(keys, keys=False, center=center), kind.store(keys, keys=False))
    assert torch.equal(TYPES["q8_0"].store(keys, keys=True, center=center), TYPES["q8_0"].store(keys, keys=True))


def test_a_models_key_measure_keeps_wide_keys_coarser_and_leaned_on_ones_finer_and_no_shift_where_scores_are_capped():
    keys = off_centre_keys(64, seed=4)
    shift, scale = key_centers.of_keys(keys)
    assert torch.allclose(shift, keys.mean(dim=1)) and shift.abs().max() > 1
    assert torch.allclose(scale.log().mean(-1), torch.zeros(2), atol=1e-5)
    assert bool((scale[:, :4] > 2 * scale[:, 4:].max(dim=-1, keepdim=True).values).all())  # the wide channels
    # Channels the queries lean on are kept finer: a query four times wider in a channel halves
    # its key's scale, (K / Q) ** (1 / 4), against the head's others.
    queries = torch.ones(4, 64, 64)
    queries[:, :, 10] = 4
    _, leaned = key_centers.of_keys(keys, queries)
    assert torch.allclose((scale / leaned)[:, 10] / (scale / leaned)[:, 11], torch.full((2,), 2.0), rtol=1e-4)
    unshifted, _ = key_centers.of_keys(keys, shifted=False)
    assert torch.equal(unshifted, torch.zeros(2, 64))
    ids = list(range(3, 40))
    for cap in (None, 50.0):
        model = random_model(tiny_args(64, attention_softcap=cap), seed=2)
        measured = key_centers.measure(model, ids)
        assert len(measured.shift) == len(measured.scale) == model.args.n_layers
        assert measured.shift[0].shape == (model.args.n_kv_heads, model.args.head_dim)
        assert (measured.shift[0].abs().max() == 0) == (cap is not None)


def test_a_zero_block_stays_zero():
    for name in ("q8_0", "q4_0"):
        back = TYPES[name].load(TYPES[name].store(torch.zeros(2, 64), keys=True), torch.float32, keys=True)
        assert torch.equal(back, torch.zeros(2, 64))


def test_the_default_is_f16_on_the_cpu_and_the_models_dtype_elsewhere():
    assert for_device("auto", "cpu", torch.float32).name == "f16"
    assert for_device("auto", "cuda", torch.bfloat16).name == "bf16"
    assert for_device(None, "cpu", torch.float32).name == "f32"  # a library caller's: the model's own
    assert for_device("f32", "cpu", torch.float32).name == "f32"
    with pytest.raises(ValueError, match="q8_0 is read on the CPU only"):
        for_device("q8_0", "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 32"):
        TYPES["q4_0"].check(48)


def paged_step(model, cache, seqs, pages, parts):
    """One forward over ``cache``: each part ``(sequence, first, stop)`` a run of a prompt or, one
    token long, a decode row."""
    from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedBatch

    size = cache.page_size
    tokens, positions, slots, singles, runs = [], [], [], [], []
    for i, lo, hi in parts:
        first = len(tokens)
        for pos in range(lo, hi):
            tokens.append(seqs[i][pos])
            positions.append(pos)
            slots.append(pages[i][pos // size] * size + pos % size)
        if hi - lo == 1:
            singles.append(i)
        else:
            runs.append((first, hi - lo, torch.tensor(pages[i][:-(-hi // size)]), lo))
    width = max((len(pages[i]) for i in singles), default=1)
    tables = torch.tensor([pages[i] + [SCRATCH_PAGE] * (width - len(pages[i])) for i in singles]) if singles else None
    batch = PagedBatch(torch.tensor(slots), torch.tensor(positions), len(singles), tables, tuple(runs))
    with torch.inference_mode():
        return model(torch.tensor([tokens]), torch.tensor([positions]), cache.view(batch))[0]


@pytest.mark.parametrize("name, error", [("f16", 3e-3), ("bf16", 2e-2), ("q8_0", 6e-2), ("q4_0", 0.8)])
def test_the_models_forward_over_pages_of_each_type_is_near_float32_and_alone_as_batched(name, error):
    """Two sequences prefilled into pages of the type, then a step of two decode rows and the
    same rows one at a time: each row's logits are the same batched or alone, and near the
    float32 cache's."""
    from builders import random_model, tiny_args
    from llama_chat.model.paged_kv_cache import PagedKVCache

    model = random_model(tiny_args(300, dim=128, n_heads=4, n_kv_heads=2), seed=3)  # heads of 32
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (13, 9)]
    pages = [[7, 2, 15, 4], [9, 3, 11]]
    out = {}
    for kind in ("f32", name):
        cache = PagedKVCache.for_model(model.args, num_pages=20, page_size=4, dtype=TYPES[kind])
        paged_step(model, cache, seqs, pages, [(0, 0, 12), (1, 0, 8)])
        both = paged_step(model, cache, seqs, pages, [(0, 12, 13), (1, 8, 9)])
        alone = [paged_step(model, cache, seqs, pages, [(0, 12, 13)]),
                 paged_step(model, cache, seqs, pages, [(1, 8, 9)])]
        torch.testing.assert_close(both, torch.cat(alone), rtol=0, atol=1e-5)
        out[kind] = both
    assert cache.keys[0].dtype == TYPES[name].storage
    spread = (out[name] - out["f32"]).norm() / out["f32"].norm()
    assert 0 < spread <= error


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_0"])
def test_the_single_stream_cache_keeps_each_type_and_its_model_decodes_near_float32(name):
    from builders import random_model, tiny_args
    from llama_chat.model.kv_cache import KVCache

    model = random_model(tiny_args(300, dim=128, n_heads=4, n_kv_heads=2), seed=4)
    tokens = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    out = {}
    for kind in ("f32", name):
        cache = KVCache.for_model(model.args, 1, max_seq_len=32, dtype=TYPES[kind])
        assert cache.keys[0].dtype == TYPES[kind].storage
        assert cache.keys[0].shape[-1] == TYPES[kind].row_size(32)
        with torch.inference_mode():
            model(tokens[:, :11], torch.arange(11).view(1, -1), cache)
            out[kind] = model(tokens[:, 11:], torch.tensor([[11]]), cache)[0, -1]
    spread = (out[name] - out["f32"]).norm() / out["f32"].norm()
    assert 0 < spread < {"f16": 3e-3, "q8_0": 6e-2, "q4_0": 0.8}[name]
