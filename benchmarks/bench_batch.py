"""Continuous batching against single-stream decode, measured in one run.

On a stories15M-sized model (dim 288, 6 layers, 6 heads, vocab 32,000, context 256; random
float32 weights, seeded; the end-of-sequence row zeroed so nothing stops early), greedy:

* single-stream decode: one job in the ``Scheduler`` (``max_batch=1``, as a prompt or a chat
  runs), decode tok/s as it reports it;
* 16 and 64 jobs submitted together to the ``Scheduler``: all generated tokens over the wall time
  from submitting the first to the last one finishing (prefill included, so it is a lower bound
  on the decode rate);
* for reference, a bare loop of dense-cache forwards through the model's layers (no sampling, no
  scheduler) of 16 rows at once against 1 row, in tokens per second;
* the compute ceiling: the machine's float32 multiply-add rate (BLAS's GEMM on square matrices,
  the best of five) over one token's multiply-adds. A step of one row is bound by reading the
  weights; a step of many rows reads them once for all and is bound by its multiply-adds, so no
  number of jobs goes past this (docs/benchmarks.md, "Batching on the CPU"). Products of a few
  rows do not reach GEMM's rate, MKL's own included, so it is a bound, not a target.

Each measurement is repeated ``--runs`` times, interleaved (a busy machine slows all of them
alike). A ratio is taken within each run, between measurements made back to back, and the median
of those is printed: on a shared machine whose speed swings from one minute to the next, that
is steadier than a ratio of medians (both are printed). One JSON line per measurement, then
a Markdown table.

With ``--compile`` the single stream is also measured compiled (the lone job's static step,
``inference/decode_step.py``), made and warmed up once.

With ``--baseline DIR`` (a folder holding another tree as ``llama_chat``, e.g. a ``git worktree``
linked there), the single stream, 16 and 64 jobs are measured in child processes, this tree's and
the baseline's alternately in each run, and the table gives this tree over the baseline.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_batch.py [--runs 3] [--new 200] [--threads 2] [--compile]
        [--baseline /tmp/oldpkg]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import anyio
import torch

from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model.args import ModelArgs
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.transformer import Transformer

GREEDY = SamplingParams(temperature=0.0)
PROMPT = 8  # tokens per prompt: short, so that decoding dominates


class ByteTokenizer:
    """Just enough of a tokenizer for the scheduler: every id is one byte of text."""

    vocab_size = 32000
    eos_id = 2
    stop_ids = frozenset({2})
    special_tokens: dict[str, int] = {}
    strips_leading_space = False

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([97 + token_id % 26])


def build_model(seed: int = 0) -> Transformer:
    args = ModelArgs(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, vocab_size=32000, hidden_dim=768, max_seq_len=256)
    model = Transformer(args)
    model.init_weights(std=0.02, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.output.weight[2] = 0.0
    return model.eval()


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 32000, (PROMPT - 1,), generator=g).tolist() for _ in range(n)]


async def _scheduled(model, tokenizer, n: int, new: int, max_batch: int) -> tuple[float, list]:
    async with Scheduler(model, tokenizer, SchedulerOptions(max_batch=max_batch)) as scheduler:
        start = time.perf_counter()
        streams = [scheduler.submit(Request(p, sampling=GREEDY, max_tokens=new)) for p in prompts(n, 2)]
        done = []

        async def consume(stream):
            async for _ in stream:
                pass
            done.append(stream.completion())

        async with anyio.create_task_group() as tg:
            for stream in streams:
                tg.start_soon(consume, stream)
        return time.perf_counter() - start, done


async def _one_job(scheduler: Scheduler, new: int):
    async with scheduler.stream(Request(prompts(1, 1)[0], sampling=GREEDY, max_tokens=new)) as stream:
        async for _ in stream:
            pass
    return stream.completion()


def single_paged(model, tokenizer, new: int) -> float:
    _, done = anyio.run(_scheduled, model, tokenizer, 1, new, 1)
    return done[0].timings.decode_tok_s


def together(model, tokenizer, n: int, new: int) -> float:
    wall, done = anyio.run(_scheduled, model, tokenizer, n, new, n)
    return sum(c.completion_tokens for c in done) / wall


def bare_forward(model, rows: int, steps: int = 30) -> float:
    """Tokens/s of a loop of dense-cache decode forwards of ``rows`` rows at position 100."""
    cache = KVCache.for_model(model.args, rows)
    tokens = torch.randint(3, 32000, (rows, 1))
    positions = torch.full((rows, 1), 100)
    with torch.inference_mode():
        model(tokens, positions, cache, last_only=True)
        start = time.perf_counter()
        for _ in range(steps):
            model(tokens, positions, cache, last_only=True).argmax(-1)
        return rows * steps / (time.perf_counter() - start)


def multiply_adds_per_token(model) -> int:
    """The multiply-adds of one token's products: every linear layer's weights, once each."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def compute_ceiling(model, size: int = 1024, repeats: int = 5) -> tuple[float, float]:
    """The machine's float32 multiply-add rate (the best of ``repeats`` square ``torch.mm`` of
    ``size``: BLAS's GEMM, near the cores' peak) and the tokens/s it allows, however many jobs
    share a step: a step of many rows is bound by its multiply-adds, not by reading the weights."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    rate = size ** 3 / best
    return rate, rate / multiply_adds_per_token(model)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


TREE_MEASURES = ("single_paged", "jobs16", "jobs64")


def child_run(args) -> None:
    """In a child process: warm up, then each of ``TREE_MEASURES`` once, one JSON object."""
    torch.set_num_threads(args.threads)
    model, tokenizer = build_model(), ByteTokenizer()
    measures = {"single_paged": lambda: single_paged(model, tokenizer, args.new),
                "jobs16": lambda: together(model, tokenizer, 16, args.new),
                "jobs64": lambda: together(model, tokenizer, 64, args.new)}
    for fn in measures.values():
        fn()
    print(json.dumps({name: fn() for name, fn in measures.items()}), flush=True)


def against_baseline(args) -> None:
    """This tree and ``--baseline``, each in a child process, alternately in each run."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = {"this": os.path.dirname(here) if os.path.basename(here) == "llama_chat" else None,
             "baseline": args.baseline}
    results: dict[str, dict[str, list[float]]] = {t: {m: [] for m in TREE_MEASURES} for t in trees}
    cpu: dict[str, list[float]] = {t: [] for t in trees}
    for run in range(args.runs):
        for tree in (("this", "baseline") if run % 2 == 0 else ("baseline", "this")):
            env = dict(os.environ)
            if trees[tree]:
                env["PYTHONPATH"] = trees[tree]
            else:
                env.pop("PYTHONPATH", None)
            before = os.times()
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--new", str(args.new),
                                   "--threads", str(args.threads)], env=env, capture_output=True, text=True,
                                  check=True)
            after = os.times()
            cpu[tree].append(after.children_user + after.children_system - before.children_user
                             - before.children_system)
            got = json.loads(done.stdout.strip().splitlines()[-1])
            for name, value in got.items():
                results[tree][name].append(value)
            print(json.dumps({"run": run, "tree": tree, **{k: round(v, 1) for k, v in got.items()},
                              "cpu_s": round(cpu[tree][-1], 1), "load_avg": os.getloadavg()}), flush=True)
    print()
    print(f"this tree against --baseline {args.baseline}, {args.threads} threads, {args.runs} runs alternated")
    print()
    print("| measure | this tree tok/s (median) | baseline tok/s (median) | this / baseline (median of per-run ratios) |")
    print("|---|---|---|---|")
    labels = {"single_paged": "single stream (Scheduler, 1 job)", "jobs16": "16 jobs together",
              "jobs64": "64 jobs together"}
    for name in TREE_MEASURES:
        ours, theirs = results["this"][name], results["baseline"][name]
        ratio = statistics.median(a / b for a, b in zip(ours, theirs))
        print(f"| {labels[name]} | {statistics.median(ours):.0f} | {statistics.median(theirs):.0f} | {ratio:.2f}x |")
    print(f"| child process CPU s (warm-up and all three) | {statistics.median(cpu['this']):.1f} | "
          f"{statistics.median(cpu['baseline']):.1f} | |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new", type=int, default=200, help="tokens generated per job")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--compile", action="store_true",
                        help="also the single stream compiled (the lone job's static step), made and warmed up once")
    parser.add_argument("--baseline", help="a folder holding another tree as llama_chat: measure both, alternately")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_run(args)
    if args.baseline:
        return against_baseline(args)
    torch.set_num_threads(args.threads)
    model, tokenizer = build_model(), ByteTokenizer()

    measures = {
        "single_paged": lambda: single_paged(model, tokenizer, args.new),
        "jobs16": lambda: together(model, tokenizer, 16, args.new),
        "jobs64": lambda: together(model, tokenizer, 64, args.new),
        "bare1": lambda: bare_forward(model, 1),
        "bare16": lambda: bare_forward(model, 16),
        "ceiling": lambda: compute_ceiling(model)[1],
    }
    if args.compile:
        # Room for every run's pages: no run evicts another's, which could leave a job's pages
        # out of order (and a lone job on pages that are not consecutive takes the packed step).
        room = (2 * args.runs + 2) * model.args.max_seq_len
        scheduler = Scheduler(model, tokenizer, SchedulerOptions(max_batch=1, compile=True, cache_tokens=room))
        scheduler.warm_up()
        measures["single_paged_compiled"] = lambda: anyio.run(_one_job, scheduler, args.new).timings.decode_tok_s
    for fn in measures.values():  # warm-up: first-touch of the weights, allocator, kernels
        fn()
    results: dict[str, list[float]] = {k: [] for k in measures}

    def measure(run: int, name: str) -> None:
        value = measures[name]()
        results[name].append(value)
        print(json.dumps({"run": run, "measure": name, "tok_s": round(value, 1)}), flush=True)

    for run in range(args.runs):
        for name in ("single_paged", *(("single_paged_compiled",) if args.compile else ()), "jobs16", "jobs64",
                     "bare1", "bare16", "ceiling"):
            measure(run, name)

    med = {k: statistics.median(v) for k, v in results.items()}
    print(json.dumps({"load_avg": os.getloadavg(), "threads": args.threads, "torch": torch.__version__,
                      "multiply_adds_per_token": multiply_adds_per_token(model)}))
    print()
    print("| measure | tok/s (median) | runs | ratio (median of per-run ratios) | ratio of medians |")
    print("|---|---|---|---|---|")
    rows = [
        ("single stream (Scheduler, 1 job)", "single_paged", None),
        ("single stream compiled (--compile)", "single_paged_compiled", ("single_paged", "x eager")),
        ("16 jobs together", "jobs16", ("single_paged", "x single stream")),
        ("64 jobs together", "jobs64", ("single_paged", "x single stream")),
        ("bare dense forward, 1 row", "bare1", None),
        ("bare dense forward, 16 rows (layer by layer)", "bare16", ("bare1", "x 1 row")),
        ("compute ceiling for any number of jobs (GEMM multiply-adds/s over a token's)", "ceiling",
         ("single_paged", "x single stream")),
    ]
    for label, key, ratio in rows:
        if key not in results:
            continue
        runs = ", ".join(f"{v:.0f}" for v in results[key])
        if ratio:
            per_run = statistics.median(a / b for a, b in zip(results[key], results[ratio[0]]))
            r, m = f"{per_run:.2f}{ratio[1]}", f"{med[key] / med[ratio[0]]:.2f}"
        else:
            r = m = ""
        print(f"| {label} | {med[key]:.0f} | {runs} | {r} | {m} |")


if __name__ == "__main__":
    main()
