"""Continuous batching on a GPU: 64 jobs against one stream and against HF's padded batch.

The batching issue's GPU targets, on a TinyLlama-sized model in bfloat16 (config ``c`` of
``bench_gpu.py``, random weights written once as a Hugging Face checkpoint, ids 0-2 never
winning so nothing stops early), greedy, in one run:

* single-stream decode through a scheduler of one job (``Scheduler.generate``, decode tok/s as it reports);
* 16 and 64 jobs submitted together to the ``Scheduler``: all generated tokens over the wall
  time from the first submit to the last job's end (prefill included);
* Hugging Face eager ``generate`` given the same 64 prompts as one left-padded batch, exactly
  ``--new`` tokens each: 64 x new over its wall time (prefill included).

The prompts are 64 random ones of 16 to 128 tokens (seeded). Ratios printed: 64 jobs against the
single stream (target 20x) and against HF's padded batch (target 10x); 16 jobs against the
single stream. Each measurement is repeated ``--runs`` times, interleaved; medians. The engine
and the scheduler are made and warmed up as the command makes them (``--compile`` as its flag),
and their first runs (compiles, CUDA graphs, allocations) are not timed.

It runs on the CPU too (``--device cpu --configs tiny --dtype float32``), as a check of the
script itself; the targets are for a GPU.

    python benchmarks/bench_batch_gpu.py [--configs c] [--device cuda] [--new 128] [--runs 3] [--bucket-graphs inductor:reduce-overhead]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import anyio
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import CONFIGS, emit, spread, sync, write_checkpoint  # noqa: E402

JOBS = 64
SOME_JOBS = 16


def prompts(vocab: int, n: int = JOBS, seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 129, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, vocab, (length - 1,), generator=g).tolist() for length in lengths]


def single_stream(engine, prompt: list[int], new: int) -> float:
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams

    done = engine.generate(Request(prompt, sampling=SamplingParams(temperature=0.0), max_tokens=new))
    assert len(done.token_ids) == new, done.finish_reason
    return done.timings.decode_tok_s


async def _together(scheduler, jobs: list[list[int]], new: int) -> float:
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    start = time.perf_counter()
    streams = [scheduler.submit(Request(p, sampling=greedy, max_tokens=new)) for p in jobs]
    produced = []

    async def consume(stream):
        async for _ in stream:
            pass
        produced.append(stream.completion().completion_tokens)

    async with anyio.create_task_group() as tg:
        for stream in streams:
            tg.start_soon(consume, stream)
    sync(scheduler.device)
    return sum(produced) / (time.perf_counter() - start)


def together(scheduler, jobs: list[list[int]], new: int) -> float:
    """Tokens/s of ``jobs`` submitted together to ``scheduler`` (entered here, in its own loop)."""

    async def main() -> float:
        async with scheduler:
            return await _together(scheduler, jobs, new)

    return anyio.run(main)


def hf_padded(path: str, device, dtype, jobs: list[list[int]], new: int, runs: int) -> list[float]:
    """Tokens/s of HF eager ``generate`` over ``jobs`` as one left-padded batch."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    width = max(map(len, jobs))
    ids = torch.zeros((len(jobs), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(jobs):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(device), mask.to(device)

    def generate(n: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 num_beams=1, pad_token_id=0, eos_token_id=2)
        sync(device)
        assert out.shape[1] == width + n
        return len(jobs) * n / (time.perf_counter() - start)

    generate(8)
    return [generate(new) for _ in range(runs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="c", help=f"comma-separated, of {', '.join(CONFIGS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--new", type=int, default=128, help="tokens generated per job")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction,
                    help="compile the engine's step (default: as the command does on the device)")
    ap.add_argument("--bucket-graphs", metavar="BACKEND[:MODE]",
                    help="the scheduler's decode steps as one compiled graph per batch bucket "
                         "(inference/bucket_step.py), e.g. inductor:reduce-overhead; default: its eager steps")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "bench-batch-gpu"))
    args = ap.parse_args()

    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.model.loader import load_model

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    emit(system="env", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
         torch=torch.__version__, new=args.new, runs=args.runs, dtype=args.dtype)
    table = []
    for key in args.configs.split(","):
        c = CONFIGS[key]
        path = os.path.join(args.work, f"{key}-{args.dtype}")
        if not os.path.exists(os.path.join(path, "config.json")):
            write_checkpoint(c, path, device, dtype)
        jobs = prompts(c["vocab"])
        loaded = load_model(path, device=device, dtype=args.dtype)
        # As a prompt's run makes it: one job at a time, its decode steps a CUDA graph.
        engine = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=1, compile=args.compile))
        engine.warm_up(SamplingParams(temperature=0.0))
        single_stream(engine, jobs[0], 16)
        # As ``llama-chat --batch`` makes and warms up its scheduler.
        graphs = None
        if args.bucket_graphs:
            backend, _, mode = args.bucket_graphs.partition(":")
            graphs = (backend, mode or None)
        scheduler = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=JOBS, compile=bool(args.compile),
                                                                   static_shapes=True if graphs else None,
                                                                   bucket_graphs=graphs))
        scheduler.warm_up(SamplingParams(temperature=0.0))
        together(scheduler, jobs, 16)  # allocations and the first shapes (every bucket's graph), untimed
        together(scheduler, jobs[:SOME_JOBS], 16)
        single, many, some = [], [], []
        for _ in range(args.runs):  # interleaved, so that a drifting machine slows all alike
            single.append(single_stream(engine, jobs[0], args.new))
            many.append(together(scheduler, jobs, args.new))
            some.append(together(scheduler, jobs[:SOME_JOBS], args.new))
        emit(system="single_stream", config=key, tok_s=spread(single))
        emit(system=f"jobs{JOBS}", config=key, tok_s=spread(many))
        emit(system=f"jobs{SOME_JOBS}", config=key, tok_s=spread(some))
        del engine, scheduler, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf = None if args.skip_hf else hf_padded(path, device, dtype, jobs, args.new, args.runs)
        if hf is not None:
            emit(system="hf_padded_batch", config=key, tok_s=spread(hf))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        s, m, f = statistics.median(single), statistics.median(many), statistics.median(some)
        table.append((c["name"], s, f, m, None if hf is None else statistics.median(hf)))

    print()
    print("| config | single stream tok/s | 16 jobs tok/s | 64 jobs tok/s | HF padded 64 tok/s "
          "| 16 jobs / single | 64 jobs / single (target 20x) | 64 jobs / HF (target 10x) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s, f, m, hf in table:
        hf_cells = ("-", "-") if hf is None else (f"{hf:.0f}", f"{m / hf:.2f}x")
        print(f"| {name} | {s:.0f} | {f:.0f} | {m:.0f} | {hf_cells[0]} | {f / s:.2f}x | {m / s:.2f}x | {hf_cells[1]} |")


if __name__ == "__main__":
    main()
