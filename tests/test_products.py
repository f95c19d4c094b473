"""Which kernel does a float32 projection on the CPU, and that the choice changes no result."""

import platform

import pytest
import torch
import torch.nn.functional as F

from builders import greedy_ids, random_model, single_stream, tiny_args
from llama_chat.ml import ops

X86 = platform.machine().lower() in ("x86_64", "amd64")
# 24,000 x 64: just past ONEDNN_MIN_WEIGHT, and a classifier's shape (many outputs, few inputs).
BIG = (24_000, 64)


@pytest.mark.parametrize("rows", [1, 5, 16, 128])
def test_the_onednn_product_is_the_float64_product(rows):
    g = torch.Generator().manual_seed(rows)
    x, w = torch.randn(1, rows, BIG[1], generator=g), torch.randn(*BIG, generator=g)
    assert ops._onednn_pays(x, w) == (X86 and ops._onednn_linear_available())
    exact = F.linear(x.double(), w.double()).float()
    out = ops.linear(x, w)
    assert out.shape == (1, rows, BIG[0])
    # The same bound as MKL's own product: float32 sums of 64 terms of size about 1.
    torch.testing.assert_close(out, exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_small_weights_long_chunks_and_other_dtypes_keep_the_mkl_product():
    big = torch.randn(*BIG)
    assert not ops._onednn_pays(torch.randn(1, 64), torch.randn(768, 64))  # its fixed cost loses
    assert not ops._onednn_pays(torch.randn(ops.ONEDNN_MAX_ROWS + 1, 64), big)  # compute-bound: even
    assert not ops._onednn_pays(torch.randn(1, 64, dtype=torch.bfloat16), big.bfloat16())
    assert not ops._onednn_pays(torch.randn(1, 24_000), big.t())  # a transposed view
    torch._C._set_mkldnn_enabled(False)  # what torch.backends.mkldnn.flags(enabled=False) sets
    try:
        assert not ops._onednn_pays(torch.randn(1, 64), big)
    finally:
        torch._C._set_mkldnn_enabled(True)


def test_greedy_tokens_and_logits_do_not_depend_on_the_kernel(monkeypatch):
    # The classifier (64 x 32,000) is past the threshold: every decode step and the prompt's
    # last position go through oneDNN where it is available, through MKL with the threshold raised.
    model = random_model(tiny_args(32_000), seed=3)
    step = single_stream(model)
    prompt = [1, 500, 31_000, 42, 7_000]

    def run() -> tuple[list[int], torch.Tensor]:
        ids = greedy_ids(step, prompt, 40)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + ids]))
        return ids, logits

    ids, logits = run()
    monkeypatch.setattr(ops, "ONEDNN_MIN_WEIGHT", 1 << 62)
    mkl_ids, mkl_logits = run()
    assert ids == mkl_ids
    torch.testing.assert_close(logits, mkl_logits, rtol=1e-4, atol=1e-4)
