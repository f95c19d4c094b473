"""A prompt's memory on the CPU: a long run of tokens goes through the layers in pieces whose
activations hold a share of the weights' bytes (``Transformer.rows_per_forward``), a tied packed
embedding reads the classifier's blocks where they moved, and the KV cache is resident only where
written. Checked against the memory rule of docs/benchmarks.md ("Packed blocks") in real processes:
peak RSS at most 1.1x the file, plus the KV cache, plus a baseline.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from builders import IdsTokenizer, decode_one, random_model, tiny_args, train_sentencepiece  # noqa: E402
from cli_support import run_python  # noqa: E402
from builders_gguf import DEFAULT_ROPE, T, write_gguf  # noqa: E402
from llama_chat.inference.scheduler import SchedulerOptions, build_core  # noqa: E402
from llama_chat.model.formats.common import in_file_mapping  # noqa: E402
from llama_chat.model.kv_cache import KVCache  # noqa: E402
from llama_chat.model.paged_kv_cache import PagedBatch, PagedKVCache  # noqa: E402
from llama_chat.model.loader import load_model  # noqa: E402
from llama_chat.model.transformer import FEWEST_PIECE_ROWS, PIECE_STEP, Transformer  # noqa: E402

needs_linux = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/self/status")
needs_kernels = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to build the kernels")
MEMORY_SLACK = 1.1  # the rule's allowance over the file's bytes
PROMPT = 512
CONTEXT = 1024  # the model's context, as a user runs it: twice the prompt, as in bench_gguf.py's 110M run
FIRST_CHUNK = 64  # the shortest prefill chunk on the CPU


def _layer_calls(model: Transformer) -> list[int]:
    """The token counts of every pass through ``model``'s first layer, as they happen."""
    seen: list[int] = []
    model.layers[0].register_forward_pre_hook(lambda _module, args: seen.append(args[0].shape[1]))
    return seen


def _whole(monkeypatch) -> None:
    monkeypatch.setattr(Transformer, "rows_per_forward", lambda self: 1 << 30)


def _prefill(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    with torch.inference_mode():
        return model(tokens, torch.arange(tokens.shape[1]).unsqueeze(0), cache, last_only=True)


def test_a_long_run_goes_in_pieces_that_leave_the_cache_and_logits_of_one_pass(monkeypatch):
    model = random_model(tiny_args(300, max_seq_len=512), seed=4)
    assert model.rows_per_forward() == FEWEST_PIECE_ROWS  # a tiny model: the shortest pieces
    tokens = torch.randint(3, 300, (1, 200), generator=torch.Generator().manual_seed(5))
    calls = _layer_calls(model)
    pieces = KVCache.for_model(model.args, 1, max_seq_len=256)
    got = _prefill(model, tokens, pieces)
    assert calls == [64, 64, 64, 8]
    calls.clear()
    _whole(monkeypatch)
    whole = KVCache.for_model(model.args, 1, max_seq_len=256)
    want = _prefill(model, tokens, whole)
    assert calls == [200]
    assert got.shape == want.shape == (1, 1, 300)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip((*pieces.keys, *pieces.values), (*whole.keys, *whole.values)):
        torch.testing.assert_close(a[:, :, :200], b[:, :, :200], rtol=1e-5, atol=1e-5)
        assert not a[:, :, 200:].any()


def _paged_chunk(model: Transformer, tokens: list[int], start: int, cache: PagedKVCache,
                 logits_at: list[int]) -> torch.Tensor:
    """A prompt's chunk from ``start``, one sequence's run over pages 1, 2, ... as the scheduler
    steps it (``batch_step.PackedForward``)."""
    size = cache.page_size
    positions = list(range(start, start + len(tokens)))
    table = torch.arange(1, -(-(start + len(tokens)) // size) + 1)
    slots = [int(table[p // size]) * size + p % size for p in positions]
    batch = PagedBatch(torch.tensor(slots), torch.tensor(positions), 0, None, ((0, len(tokens), table, start),))
    with torch.inference_mode():
        return model(torch.tensor([tokens]), torch.tensor([positions]), cache.view(batch),
                     logits_at=torch.tensor(logits_at, dtype=torch.long))


def test_a_prompt_chunk_over_pages_goes_in_pieces_that_leave_the_pool_and_logits_of_one_pass(monkeypatch):
    # The scheduler's path: a first chunk, then the rest of the prompt in one step of one run,
    # its last token's logits wanted; and a chunk that wants none.
    model = random_model(tiny_args(300, max_seq_len=512), seed=4)
    ids = torch.randint(3, 300, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = _layer_calls(model)
    pools = [PagedKVCache.for_model(model.args, num_pages=20, page_size=16) for _ in range(2)]
    got = [_paged_chunk(model, ids[:20], 0, pools[0], []), _paged_chunk(model, ids[20:220], 20, pools[0], [199]),
           _paged_chunk(model, ids[220:], 220, pools[0], [])]
    assert calls == [20, 64, 64, 64, 8, 48, 32]
    calls.clear()
    _whole(monkeypatch)
    want = [_paged_chunk(model, ids[:20], 0, pools[1], []), _paged_chunk(model, ids[20:220], 20, pools[1], [199]),
            _paged_chunk(model, ids[220:], 220, pools[1], [])]
    assert calls == [20, 200, 80]
    assert [g.shape for g in got] == [w.shape for w in want] == [(1, 0, 300), (1, 1, 300), (1, 0, 300)]
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for a, b in zip((*pools[0].keys, *pools[0].values), (*pools[1].keys, *pools[1].values)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    calls.clear()
    monkeypatch.undo()
    _paged_chunk(model, ids[20:220], 20, pools[0], [0, 199])  # a logit of the first piece: one pass
    assert calls == [200]


def test_runs_that_want_every_logit_or_have_no_cache_or_rows_of_their_own_go_whole():
    model = random_model(tiny_args(300, max_seq_len=512), seed=4)
    tokens = torch.randint(3, 300, (2, 150), generator=torch.Generator().manual_seed(6))
    calls = _layer_calls(model)
    with torch.inference_mode():
        model(tokens[:1])  # no cache: scoring
        model(tokens[:1], torch.arange(150).unsqueeze(0), KVCache.for_model(model.args, 1), last_only=False)
        starts = torch.tensor([[0], [7]])  # two rows at their own positions
        model(tokens, starts + torch.arange(150), KVCache.for_model(model.args, 2), last_only=True)
    assert calls == [150, 150, 150]


def test_pieces_grow_with_the_weights():
    args = dict(dim=256, hidden_dim=768, n_heads=4, n_kv_heads=4, max_seq_len=512)
    rows = [Transformer(tiny_args(8000, n_layers=layers, **args)).rows_per_forward() for layers in (2, 8)]
    assert FEWEST_PIECE_ROWS < rows[0] < rows[1]
    assert all(r % PIECE_STEP == 0 for r in rows)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm"), vocab_size=400)


def _write_file(path: Path, sp_model: Path, *, dim: int, layers: int, hidden: int, vocab: int, heads: int,
                seed: int = 0) -> Path:
    """A tied Q8_0 GGUF of random weights (the shape of a small Llama, scaled down)."""
    g = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * cols ** -0.5

    state = {"model.embed_tokens.weight": matrix(vocab, dim), "model.norm.weight": torch.ones(dim)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": matrix(dim, dim), p + "self_attn.k_proj.weight": matrix(dim, dim),
                  p + "self_attn.v_proj.weight": matrix(dim, dim), p + "self_attn.o_proj.weight": matrix(dim, dim),
                  p + "mlp.gate_proj.weight": matrix(hidden, dim), p + "mlp.up_proj.weight": matrix(hidden, dim),
                  p + "mlp.down_proj.weight": matrix(dim, hidden), p + "input_layernorm.weight": torch.ones(dim),
                  p + "post_attention_layernorm.weight": torch.ones(dim)}
    config = dict(num_attention_heads=heads, num_key_value_heads=heads, hidden_size=dim, num_hidden_layers=layers,
                  intermediate_size=hidden, rms_norm_eps=1e-5, vocab_size=vocab, max_position_embeddings=CONTEXT,
                  rope_parameters=DEFAULT_ROPE, tie_word_embeddings=True)
    return write_gguf(path, state, config, qtype=T.Q8_0, sp_model=sp_model)


@pytest.fixture(scope="module")
def files(tmp_path_factory, sp_model) -> dict[str, Path]:
    """``small``: stories110M's width and vocabulary share in 4 layers (a 34 MB file); ``tiny``: the
    baseline, the same program on a model of under 1 MB."""
    out = tmp_path_factory.mktemp("prompt_memory")
    return {"tiny": _write_file(out / "tiny.gguf", sp_model, dim=256, layers=1, hidden=512, vocab=512, heads=4),
            "small": _write_file(out / "small.gguf", sp_model, dim=768, layers=4, hidden=2048, vocab=4096, heads=12)}


@needs_kernels
def test_a_tied_packed_embedding_reads_the_classifiers_moved_blocks(files, monkeypatch):
    model = load_model(files["small"], device="cpu").model
    assert model.tok_embeddings.data is model.output.data  # one buffer, the file's
    # The scheduler's state: blocks fused and moved onto large pages.
    build_core(model, IdsTokenizer(), SchedulerOptions(max_batch=1, max_seq_len=CONTEXT))
    assert model.tok_embeddings.data.data_ptr() == model.output.data.data_ptr()
    if not in_file_mapping(model.output.data):  # moved (where the system gives large pages)
        assert not in_file_mapping(model.tok_embeddings.data)
    # Greedy ids after a prompt long enough to go in pieces: those of one pass.
    tokens = torch.randint(3, 4096, (1, 300), generator=torch.Generator().manual_seed(7))
    assert model.rows_per_forward() < 300 - FIRST_CHUNK
    ids = [_greedy(model, tokens, 8)]
    _whole(monkeypatch)
    ids.append(_greedy(model, tokens, 8))
    assert ids[0] == ids[1]


def _greedy(model: Transformer, prompt: torch.Tensor, n: int) -> list[int]:
    cache = KVCache.for_model(model.args, 1, max_seq_len=CONTEXT)
    ids, pos = [], prompt.shape[1]
    with torch.inference_mode():
        logits = model(prompt, torch.arange(pos).unsqueeze(0), cache, last_only=True)
        for _ in range(n):
            ids.append(int(logits[0, -1].argmax()))
            logits = decode_one(model, ids[-1], pos, cache)
            pos += 1
    return ids


# Run in a fresh process: the model loaded as a user's run loads it, and a prompt through a
# single stream's scheduler (its projections fused, its prompt in chunks, a long chunk through the
# layers in pieces) over its page pool, to one token; then the process's peak resident set.
_PREFILL_CHILD = """
import json, sys
from pathlib import Path

def status_bytes(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

path, context, length, tests = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, tests)
from builders import IdsTokenizer
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml.cpu import kernels
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model.loader import load_model

kernels.load()
model = load_model(path, device="cpu").model
vocab = model.args.vocab_size
scheduler = Scheduler(model, IdsTokenizer(vocab), SchedulerOptions(max_batch=1, max_seq_len=context))
prompt = tuple(3 + i * 7919 % (vocab - 3) for i in range(length))
scheduler.generate(Request(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=1))
cache = scheduler.core.cache
kv = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
print(json.dumps({"peak": status_bytes("VmHWM"), "kv": kv, "file": Path(path).stat().st_size,
                  "rows": model.rows_per_forward()}))
"""


def _prefill_peak(path: Path) -> dict:
    done = run_python(_PREFILL_CHILD, str(path), str(CONTEXT), str(PROMPT), str(Path(__file__).parent), text=True,
                      timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@needs_linux
@needs_kernels
def test_a_prompt_peaks_within_the_memory_rule(files):
    """The rule's terms, with the tiny model's run as the baseline: everything but the file and the
    KV cache (the interpreter, torch, the operator, the code a prefill runs) is in both runs."""
    base, small = _prefill_peak(files["tiny"]), _prefill_peak(files["small"])
    allowed = MEMORY_SLACK * (small["file"] - base["file"]) + small["kv"] - base["kv"]
    used = small["peak"] - base["peak"]
    assert used <= allowed, f"peak {used / 1e6:.1f} MB over the baseline's, the rule allows {allowed / 1e6:.1f} MB"
    assert small["rows"] < PROMPT - FIRST_CHUNK  # the rest of the prompt went in pieces


_CACHE_CHILD = """
from pathlib import Path
import torch
from llama_chat.model.kv_cache import KVCache

def anon():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

before = anon()
cache = KVCache(8, 1, 8, 2048, 64)  # 64 MiB of keys and values
made = anon()
for layer in range(8):
    for cached in (cache.keys[layer], cache.values[layer]):
        assert not cached.any()  # zeros, read without being made resident
        cached[:, :, :512] = 1.0  # a quarter of the positions written
print(made - before, anon() - made)
"""


@needs_linux
def test_a_cpu_cache_is_resident_where_it_is_written():
    done = run_python(_CACHE_CHILD, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    made, written = (int(v) for v in done.stdout.split())
    quarter = 64 * 2**20 // 4
    assert made < 4 * 2**20, made
    assert 0.9 * quarter < written < 1.5 * quarter, written
