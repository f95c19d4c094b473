"""What the streaming pipeline costs: the full pipeline against a bare loop of forward steps.

Both runs use the same model in the same process and generate the same greedy tokens:

* bare: where our CPU operator reads the model, its one-call step over consecutive pages with
  the greedy pick made inside it, called in a plain loop on the main thread (the prompt fed as
  rows of one call first); under ``--compile``, or where the operator does not read the model,
  ``Scheduler.generate`` with nothing around it;
* pipeline: what ``llama-chat -p`` runs, ``run_one_shot`` over a one-job batch of the scheduler
  (its pages, its step thread fed a few steps ahead, the job's bounded channel), the signal
  watcher, the StreamDecoder, and the plain renderer writing every token to a pipe read by a
  ``cat`` child process. The difference is what the one generation core costs around a step.

Rounds alternate bare and pipeline so that drift in machine load hits both alike; the medians and
the median of the per-round ratios are printed. The default model has the shape of llama2.c's
stories15M (dim 288, 6 layers, 6 heads, vocab 32000, context 256) with random weights.

    python benchmarks/bench_pipeline.py [--compile] [--tokens 200] [--rounds 7] [--dim 288 ...]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import subprocess
import time
from functools import partial
from collections.abc import Sequence

import anyio

# As the command does (cmd/app.py): OpenMP helpers that spin after each parallel region would
# take the cores from the other thread's forward, and the bare loop and the step thread alternate.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from llama_chat.cmd.one_shot import run_one_shot
from llama_chat.cmd.render import PlainRenderer
from llama_chat.model import cpu_decode
from llama_chat.model.paged_kv_cache import PagedKVCache
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model.args import ModelArgs
from llama_chat.model.transformer import Transformer

EOS = 2


class SyntheticTokenizer:
    """A SentencePiece-shaped vocabulary of any size: specials, 256 byte pieces, then words."""

    def __init__(self, vocab_size: int) -> None:
        self._vocab = vocab_size

    vocab_size = property(lambda self: self._vocab)
    bos_id = property(lambda self: 1)
    eos_id = property(lambda self: EOS)
    stop_ids = property(lambda self: frozenset({EOS}))
    special_tokens = property(lambda self: {"<unk>": 0, "<s>": 1, "</s>": EOS})

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = [259 + (sum(map(ord, word)) % (self._vocab - 259)) for word in text.split()]
        return ([1] if bos else []) + ids + ([EOS] if eos else [])

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(map(self.token_bytes, ids)).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < 3:
            return b""
        if token_id < 259:
            return bytes([token_id - 3])
        letters = "abcdefghijklmnopqrstuvwxyzéü"
        return (" " + letters[token_id % 28] * (1 + token_id % 5)).encode()


def build_model(args: ModelArgs, seed: int = 0) -> Transformer:
    model = Transformer(args)
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.output.weight[EOS] = 0.0  # never stop early: both runs make every token asked for
    return model.eval()


def bare_step_loop(source: Scheduler, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """The operator's one-call step over consecutive pages in a plain loop (its pick made
    inside it), after one call of the prompt's rows; ``Scheduler.generate`` where it compiles or
    the operator does not read the model."""
    size = source.page_size
    # A pool of its own: the scheduler's pages keep the prefixes its runs left.
    cache = PagedKVCache.for_model(source.model.args, -(-(len(prompt) + n) // size) + 1, size)
    with torch.inference_mode():
        decoder = None if source.compiles else cpu_decode.operator_for(source.model, cache)
    if decoder is None:
        start = time.perf_counter()
        done = source.generate(Request(tuple(prompt), sampling=SamplingParams(temperature=0.0), max_tokens=n))
        return time.perf_counter() - start, list(done.token_ids)
    pages = list(range(1, cache.num_pages))
    width = -(-(len(prompt) + n) // size)
    start = time.perf_counter()
    with torch.inference_mode():
        _, picks = decoder.with_picks(prompt, list(range(len(prompt))), [pages[:width]] * len(prompt))
        out = [int(picks[-1])]
        for position in range(len(prompt), len(prompt) + n - 1):
            out.append(decoder.pick(out[-1], position, pages[:position // size + 1]))
    return time.perf_counter() - start, out


def pipeline(source: Scheduler, prompt: list[int], n: int) -> tuple[float, list[int]]:
    sink = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    stream = io.TextIOWrapper(sink.stdin, encoding="utf-8", errors="replace", write_through=False)
    request = Request(tuple(prompt), sampling=SamplingParams(temperature=0.0), max_tokens=n)
    try:
        start = time.perf_counter()
        outcome = anyio.run(run_one_shot, source, request, PlainRenderer(stream))
        elapsed = time.perf_counter() - start
    finally:
        stream.close()
        sink.wait()
    return elapsed, list(outcome.completion.token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--dim", type=int, default=288)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--compile", action="store_true",
                        help="both paths on the compiled static step (the bare loop calls it directly)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    opts = parser.parse_args()
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)

    args = ModelArgs(dim=opts.dim, n_layers=opts.layers, n_heads=opts.heads, vocab_size=opts.vocab,
                     hidden_dim=opts.hidden, max_seq_len=opts.context)
    model = build_model(args)
    # As the command makes them (cmd/generation_source.py), the pages in float32 as the dense
    # cache is, so that both make the same tokens.
    source = Scheduler(model, SyntheticTokenizer(opts.vocab), SchedulerOptions(
        max_batch=1, page_size=8, cache_tokens=opts.context, compile=opts.compile, cache_type="f32"))
    source.warm_up(SamplingParams(temperature=0.0))
    bare = partial(bare_step_loop, source)
    prompt = [1] + [259 + (i * 7919) % (opts.vocab - 259) for i in range(opts.prompt_tokens - 1)]
    n = opts.tokens
    assert len(prompt) + n <= opts.context, "prompt plus tokens must fit the context"

    print(f"model: dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads, vocab {args.vocab_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; prompt {len(prompt)} tokens, "
          f"{n} generated; torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}")
    # Warm up both paths (allocator, thread pool, first-call dispatch), and check they agree.
    _, bare_ids = bare(prompt, n)
    _, pipe_ids = pipeline(source, prompt, n)
    assert bare_ids == pipe_ids, "the pipeline and the bare loop generated different tokens"

    bare_rates, pipe_rates, ratios = [], [], []
    for r in range(opts.rounds):
        # Alternate which goes first, so a trend in machine load does not favour either.
        if r % 2:
            pipe_s, _ = pipeline(source, prompt, n)
            bare_s, _ = bare(prompt, n)
        else:
            bare_s, _ = bare(prompt, n)
            pipe_s, _ = pipeline(source, prompt, n)
        bare_rates.append(n / bare_s)
        pipe_rates.append(n / pipe_s)
        ratios.append(bare_s / pipe_s)
        print(f"round {r + 1}: bare {n / bare_s:7.1f} tok/s   pipeline {n / pipe_s:7.1f} tok/s   "
              f"ratio {bare_s / pipe_s:.3f}")
    print(f"median: bare {statistics.median(bare_rates):.1f} tok/s, pipeline {statistics.median(pipe_rates):.1f} "
          f"tok/s, pipeline/bare {statistics.median(ratios):.3f}")
    print(f"best:   bare {max(bare_rates):.1f} tok/s, pipeline {max(pipe_rates):.1f} tok/s, "
          f"pipeline/bare {max(pipe_rates) / max(bare_rates):.3f}")
    forward_ms, gap_ms = step_gaps(source, prompt, n)
    print(f"pipeline per token: forward + sample in the worker {forward_ms:.3f} ms, between two forwards "
          f"{gap_ms:.3f} ms (thread hand-offs, event, channel; medians)")
    idle_ms = anyio.run(handoff_ms, forward_ms / 1e3)
    busy_ms = anyio.run(handoff_ms, 0.0)
    print(f"run_sync round trip alone: {idle_ms:.3f} ms around a {forward_ms:.1f} ms time.sleep, "
          f"{busy_ms:.3f} ms around a no-op (medians): the machine's thread hand-off cost")


async def handoff_ms(sleep_s: float, calls: int = 200) -> float:
    """Median time between consecutive ``run_sync`` calls whose work is only ``time.sleep``."""
    marks: list[tuple[float, float]] = []

    def work() -> None:
        begin = time.perf_counter()
        if sleep_s:
            time.sleep(sleep_s)
        marks.append((begin, time.perf_counter()))

    for _ in range(calls):
        await anyio.to_thread.run_sync(work)
    return statistics.median(marks[i + 1][0] - marks[i][1] for i in range(len(marks) - 1)) * 1e3


def step_gaps(source: Scheduler, prompt: list[int], n: int) -> tuple[float, float]:
    """Median time inside each step of the scheduler's thread and between consecutive steps, in
    one pipeline run."""
    marks: list[tuple[float, float]] = []
    core = source.core
    step = core.step

    def timed():
        begin = time.perf_counter()
        result = step()
        marks.append((begin, time.perf_counter()))
        return result

    core.step = timed
    try:
        pipeline(source, prompt, n)
    finally:
        del core.step
    inside = [end - begin for begin, end in marks[1:]]
    between = [marks[i + 1][0] - marks[i][1] for i in range(1, len(marks) - 1)]
    return statistics.median(inside) * 1e3, statistics.median(between) * 1e3


if __name__ == "__main__":
    main()
