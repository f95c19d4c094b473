import torch

from builders import random_model, tiny_args
from llama_chat.model.kv_cache import KVCache


def test_cached_decode_matches_full_forward():
    model = random_model(tiny_args(300), seed=1)
    tokens = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = model(tokens)
        cache = KVCache.for_model(model.args, 1)
        chunks = [model(tokens[:, i:i + 8], torch.arange(i, i + 8).unsqueeze(0), cache) for i in range(0, 40, 8)]
    assert (torch.cat(chunks, 1) - full).abs().max() < 1e-4


def test_rows_at_different_positions_share_one_cache():
    model = random_model(tiny_args(300), seed=2)
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 300, (1, 12), generator=g), torch.randint(0, 300, (1, 12), generator=g)
    with torch.inference_mode():
        ref_a, ref_b = model(a), model(b)
        cache = KVCache.for_model(model.args, 2)
        model(torch.cat([a[:, :10], b[:, :10]]), None, cache)
        out = model(torch.cat([a[:, 10:12], b[:, 4:6]]), torch.tensor([[10, 11], [4, 5]]), cache)
    assert (out[0] - ref_a[0, 10:12]).abs().max() < 1e-4
    assert (out[1] - ref_b[0, 4:6]).abs().max() < 1e-4
