"""Build the tiny models and tokenizers the tests run on (nothing is downloaded)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sentencepiece as spm
import torch

from llama_chat.model.args import ModelArgs
from llama_chat.model.transformer import Transformer

SAMPLE_TEXT = [
    "Once upon a time there was a little fox who lived in the forest.",
    "The fox liked to play with the rabbit and the bird near the river.",
    "One day it rained, and the fox and the rabbit hid under a big tree.",
    "Café au lait, naïve façade, über, señor, déjà vu.",
    "東京は大きな都市です。猫が好きです。",
    "Привет, как дела? Всё хорошо.",
    "The sun is warm ☀️ and the cat 🐱 sleeps. 👨‍👩‍👧 went to the park 🇫🇷.",
    "Hello world! How are you today? I am fine, thank you.",
]


def train_sentencepiece(out_dir: Path, *, vocab_size: int = 400, lines: list[str] | None = None,
                        **options) -> Path:
    """A byte-fallback BPE SentencePiece model; returns the path of ``tokenizer.model``.

    ``options`` are further trainer settings, overriding the defaults below.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    text = (lines or SAMPLE_TEXT) * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(**dict(
        sentence_iterator=iter(text),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        num_threads=1,
        minloglevel=2,
    ) | options)
    path = out_dir / "tokenizer.model"
    path.write_bytes(buf.getvalue())
    return path


# The start of a script that loads a build of the operator's products alone (kernels.cpp), in a
# process whose environment is ``operator_variant_env``'s (tests/conftest.py): the first such
# process builds it.
OPERATOR_VARIANT_LOAD = """
import sys, torch
from llama_chat.ml.cpu import kernels
kernels.SOURCES = (kernels.HERE / "kernels.cpp", kernels.HERE / "memory.cpp")
assert kernels.load(), kernels.failure()
"""


def skip_where_the_native_build_lacks(macro: str) -> None:
    """Skip a variant that takes away an instruction set (``__AVX512F__``, as the compiler
    predefines it) this CPU's own build (``-march=native``) has not: that build is the variant,
    and every other product test checks it; a second build would compile the same code again."""
    compiler = shutil.which(os.environ.get("CXX") or "c++")
    listed = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c++", "-"], input="",
                            capture_output=True, text=True, timeout=60).stdout
    if f"#define {macro} " not in listed:
        pytest.skip(f"this CPU's own build has no {macro.strip('_')}: it is that variant")


def tiny_args(vocab_size: int, **overrides) -> ModelArgs:
    fields = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, hidden_dim=160,
                  max_seq_len=256)
    fields.update(overrides)
    return ModelArgs(**fields)


def random_model(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(std=0.2, generator=torch.Generator().manual_seed(seed))
    return model.eval()


@contextmanager
def weights_only_int8(model: torch.nn.Module) -> Iterator[None]:
    """Inside: the model's int8 layers take the converted weights' float product instead of
    fbgemm's, so only the weights are rounded (fbgemm also rounds the activations to 7 bits)."""
    from llama_chat.ml.quantize import Int8Linear

    packed = {m: m.packed for m in model.modules() if isinstance(m, Int8Linear)}
    for m in packed:
        m.packed = None
    try:
        yield
    finally:
        for m, p in packed.items():
            m.packed = p


def endless_model(vocab_size: int, seed: int, *, eos: int = 2, max_seq_len: int = 1024) -> Transformer:
    """A random float32 model that never ends on its own (its end-of-sequence logit is 0)."""
    model = random_model(tiny_args(vocab_size, max_seq_len=max_seq_len), seed=seed)
    with torch.no_grad():
        model.output.weight[eos] = 0.0
    return model


def write_meta_checkpoint(model: Transformer, out_dir: Path, tokenizer_model: Path | None = None) -> Path:
    """Meta's original layout: ``params.json`` + ``consolidated.00.pth`` (+ ``tokenizer.model``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "params.json").write_text(json.dumps(model.args.to_params_json()))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if model.args.tie_embeddings:
        state.pop("output.weight", None)
    torch.save(state, out_dir / "consolidated.00.pth")
    if tokenizer_model is not None and tokenizer_model != out_dir / "tokenizer.model":
        shutil.copy(tokenizer_model, out_dir / "tokenizer.model")
    return out_dir


def separate_greedy_choices(hf, seed: int, scale) -> None:
    """Give a random ``transformers`` Llama weights whose logits are well separated, so greedy
    choices are not near-ties, and norms away from one, so swapping two norms would show.
    ``scale(p)``: the standard deviation of a weight matrix ``p``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * scale(p))
    hf.generation_config.eos_token_id = None  # always generate all the tokens asked for
    hf.generation_config.pad_token_id = 0


def decode_one(model, token: int, position: int, cache) -> torch.Tensor:
    """``(1, 1, vocab)`` logits of one token at ``position`` over row 0 of a dense ``cache``: through
    the paged CPU operator, the row seen as one page (``PagedKVCache.of_row``), where it takes the
    model and the cache (``cpu_decode.takes_rows``, as a generation step chooses it), else through
    the model's layers. Patching ``takes_rows`` to False compares the two."""
    from llama_chat.model import cpu_decode
    from llama_chat.model.paged_kv_cache import PagedKVCache

    pool = PagedKVCache.of_row(cache)
    if cpu_decode.takes_rows(model, pool):
        return cpu_decode.forward_rows(model, [token], [position], [[0]], pool).view(1, 1, -1)
    return model(torch.tensor([[token]]), torch.tensor([[position]]), cache)


def cached_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """``n`` greedy ids after ``prompt`` (``(1, seq)``): prefilled once, then one token per step
    over a dense KV cache (``decode_one``: the operator where it takes the model), as the parity
    tests decode."""
    from llama_chat.model.kv_cache import KVCache

    cache = KVCache.for_model(model.args, 1, max_seq_len=prompt.shape[1] + n)
    pos = prompt.shape[1]
    with torch.inference_mode():
        logits = model(prompt, torch.arange(pos).unsqueeze(0), cache, last_only=True)
        out: list[int] = []
        for _ in range(n):
            token = int(logits[0, -1].argmax())
            out.append(token)
            logits = decode_one(model, token, pos, cache)
            pos += 1
    return out


class IdsTokenizer:
    """Token ids only: no stop tokens, every token one byte; ``vocab_size`` ids have text."""

    stop_ids: frozenset[int] = frozenset()
    eos_id = None
    special_tokens: dict[str, int] = {}

    def __init__(self, vocab_size: int | None = None) -> None:
        self.vocab_size = vocab_size

    def token_bytes(self, token_id: int) -> bytes:
        return b"x"


def single_stream(model: Transformer, tokenizer=None, *, static: bool = False, backend="aot_eager", **options):
    """A scheduler of one job at a time, as a prompt or a chat runs (``SchedulerOptions`` from
    ``options``). ``static``: a lone job's decode steps through the static step
    (``decode_step.LoneGraph``), compiled by ``backend`` (aot_eager: the same graph as inductor's
    without a C++ build; None: not compiled)."""
    from llama_chat.inference.decode_step import LoneGraph
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions

    scheduler = Scheduler(model, tokenizer or IdsTokenizer(), SchedulerOptions(**{"max_batch": 1, **options}))
    if static:
        core = scheduler.core
        core.lone_step = LoneGraph(model, core.cache, max_seq_len=core.settings.max_seq_len,
                                   sample_ids=core.sample_ids, compile=backend is not None, cuda_graph=False,
                                   backend=backend or "inductor", row_products=backend is not None)
    return scheduler


def greedy_ids(scheduler, prompt, n: int) -> list[int]:
    """The greedy tokens of one job of ``prompt``, ``n`` of them (None: until it ends)."""
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams

    return list(scheduler.generate(Request(tuple(prompt), sampling=SamplingParams(temperature=0.0),
                                           max_tokens=n)).token_ids)
