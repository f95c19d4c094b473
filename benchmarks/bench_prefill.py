"""Prefill speed: llama-chat against llama.cpp's ``llama-bench -p``, and both against this CPU's
int8 multiply-add peak, in one run.

What it does, every step cached under ``--cache`` (default ``~/.cache/llama-chat-bench``), nothing
written into the repository:

1. llama.cpp, checkpoints and files as ``bench_gguf.py`` makes them (``llama_cpp_peer.py`` builds
   llama.cpp from the ``llama-cpp-python`` sdist; a random Hugging Face checkpoint of each shape,
   its context set to 8,192 positions so that a 4,096-token prompt is within it; Q8_0 by
   ``convert_hf_to_gguf.py``, Q4_K_M by ``llama-quantize`` from the F16 file).
2. The peak: ``bench_peak.py``'s loops on ``--threads`` threads, before the runs and after them,
   the best kept. The denominator is the fastest int8 sequence that sums into int32, as a kernel
   must (on AVX2: ``vpmaddubsw`` + ``vpmaddwd``), by the wall clock on all the threads: the
   prefills run under the same load as it.
3. For each file and prompt length, ``--rounds`` times: ``llama-bench -m FILE -t T -p N -n 0 -r 1
   -o json`` (its own warm-up, then one timed prompt), then llama-chat as a user runs it on a prompt
   of exactly N tokens (BOS included), generating one token: ``llama-chat -m FILE -f PROMPT
   --no-stdin -n 1 --min-new-tokens 1 -t 0 --template none -c N+64 --json --lookup off``, whose
   ``timings.prefill_tok_s`` is the figure. Both with T threads (``-t`` and ``OMP_NUM_THREADS``).

With ``--products`` it measures only the operator's products instead, no files and no llama.cpp:
one Qwen2.5-1.5B-shaped layer of random blocks of each kind (q/k/v fused, o, gate/up fused, down)
against ``--product-rows`` rows, on one thread, by the process's CPU time, in G multiply-adds a
second per core against ``bench_peak.py``'s per-core int8 peak (CPU time too): a figure that the
other processes on a shared machine do not move.

"Of peak" is the prompt's weight products (every ``blk.*`` matrix, rows x columns multiply-adds a
token; attention's and the classifier's are left out: fp32 work, and one row) at the measured
speed, over the int8 peak. Printed: one JSON line per measurement, then a Markdown table.

    python benchmarks/bench_prefill.py                                   # 3 shapes x Q4_K_M, Q8_0 x 512, 4096
    python benchmarks/bench_prefill.py --shapes qwen2.5-1.5b --types q4_k_m --tokens 512
    python benchmarks/bench_prefill.py --prepare                         # only make the files
    python benchmarks/bench_prefill.py --products --product-rows 64,512  # the products alone, per core
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import bench_gguf
import bench_peak
import llama_cpp_peer as peer_mod
from bench_gguf import SHAPES, RunFailed, Shape, make_file, prefill_prompt, run_llama_chat, write_checkpoint, write_tokenizer
from llama_cpp_peer import LlamaCpp, PeerError

CTX = 8192
DEFAULT_SHAPES = ("qwen2.5-1.5b", "gemma-2-2b", "1.1b")
DEFAULT_TYPES = ("q4_k_m", "q8_0")
ROWS: list[dict] = []


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def emit(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def long_shape(key: str, ctx: int = CTX) -> tuple[str, Shape]:
    """The shape under its own key, with a context that holds the longest prompt."""
    return f"{key}-ctx{ctx // 1024}k", dataclasses.replace(SHAPES[key], ctx=ctx)


def tokenizer_for(cache: Path, shape: Shape) -> Path:
    name = "tokenizer.model" if shape.vocab == bench_gguf.VOCAB else f"tokenizer-{shape.vocab}.model"
    return write_tokenizer(cache / "tokenizer" / name, shape.vocab)


def prepare(peer: LlamaCpp, cache: Path, shapes: list[str], types: list[str], threads: int, ctx: int = CTX) -> dict:
    files = {}
    for key in shapes:
        name, shape = long_shape(key, ctx)
        tokenizer = tokenizer_for(cache, shape)
        hf = write_checkpoint(shape, cache / "models" / name / "hf", tokenizer)
        for ftype in types:
            files[key, ftype] = make_file(peer, cache, name, hf, ftype, threads)
    return files


def product_macs_per_token(path: Path) -> int:
    """Multiply-adds of the layers' weight matrices for one token: rows x columns of every blk.*
    matrix (the classifier and the embedding are left out)."""
    from gguf import GGUFReader

    total = 0
    for t in GGUFReader(path).tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            total += int(t.shape[0]) * int(t.shape[1])
    return total


def llama_bench(peer: LlamaCpp, path: Path, tokens: int, threads: int, env: dict) -> float | None:
    cmd = [str(peer.bench), "-m", str(path), "-t", str(threads), "-p", str(tokens), "-n", "0", "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode:
        log(f"llama-bench failed on {path.name} -p {tokens}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    for test in json.loads(r.stdout):
        if test.get("n_prompt") == tokens and test.get("n_gen") == 0:
            return float(test["avg_ts"])
    return None


def measure_peak(threads: int) -> dict:
    peaks = bench_peak.run(threads, seconds=0.3, repeats=5)
    info = {"cpu": bench_peak.cpu_model(), "peaks": [dataclasses.asdict(p) for p in peaks]}
    best = bench_peak.int8_peak(info, threads)
    return {"int8_gops": best.gops_total if best else None, "int8_name": best.name if best else None,
            "int8_gops_per_core_cpu": best.gops_per_cpu_second if best else None}


# Qwen2.5-1.5B's projections as llama-chat runs them (q/k/v and gate/up fused): (outputs, inputs).
PRODUCT_LAYER = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
PRODUCT_KINDS = ("q4_k", "q6_k", "q8_0", "q5_k", "q4_0")


def products(rows_list: list[int], rounds: int) -> int:
    """The products alone, per core: G multiply-adds a second of process CPU time, one thread."""
    import torch

    from bench_packed import random_weight
    from llama_chat.ml.cpu import kernels as cpu_kernels

    if not cpu_kernels.load():
        print(f"bench_prefill: the CPU operator did not build: {cpu_kernels.failure()}", file=sys.stderr)
        return 1
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    peaks = bench_peak.run(1, seconds=0.3, repeats=5)
    peak = max((p.gops_per_cpu_second for p in peaks if p.name.startswith("int8") and "add16" not in p.name),
               default=None)
    generator = torch.Generator().manual_seed(0)
    load = os.getloadavg()[0]
    print(f"CPU: {bench_peak.cpu_model()}; one thread, process CPU time, best of {rounds}; int8 peak per core "
          f"{peak and f'{peak:.1f}'} GOPS; load average (1 min) {load:.1f}\n")
    print("| kind | rows | G multiply-adds/s per core | % of int8 peak |")
    print("|---|---:|---:|---:|")
    for kind in PRODUCT_KINDS:
        layer = [random_weight(kind, n, k, generator) for n, k in PRODUCT_LAYER.values()]
        macs_per_row = sum(n * k for n, k in PRODUCT_LAYER.values())
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k, generator=generator) for _, k in PRODUCT_LAYER.values()}
            best = float("inf")
            for _ in range(rounds + 1):  # the first warms up
                start = time.process_time()
                for w in layer:
                    torch.ops.llama_chat_cpu.packed_product(inputs[w.in_features], w.data, w.kind)
                best = min(best, time.process_time() - start)
            gops = rows * macs_per_row / best / 1e9
            print(f"| {kind.upper()} | {rows} | {gops:.1f} | {f'{100 * gops / peak:.0f} %' if peak else '-'} |",
                  flush=True)
    return 0


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def report(rows: list[dict]) -> None:
    peaks = [r["int8_gops"] for r in rows if r.get("int8_gops")]
    peak = max(peaks) if peaks else None
    head = next((r for r in rows if "cpu" in r), {})
    named = next((r["int8_name"] for r in rows if r.get("int8_gops") == peak), "?")
    loads = [r["load_1min"] for r in rows if "load_1min" in r]
    print(f"\nCPU: {head.get('cpu', '?')}, {head.get('threads', '?')} threads; int8 peak "
          f"{peak and f'{peak:.1f}'} GOPS ({named}, all threads, best of the run); "
          f"load average (1 min) {min(loads, default=0):.1f}-{max(loads, default=0):.1f}\n")
    print("| shape | type | tokens | llama-chat tok/s | llama-bench tok/s | ratio | % of int8 peak | 4096 / 512 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    cells: dict[tuple, dict] = {}
    for r in rows:
        if "tokens" in r and "system" in r:
            cells.setdefault((r["shape"], r["type"], r["tokens"]), {}).setdefault(r["system"], []).append(r["tok_s"])
    for (shape, ftype, tokens), by in cells.items():
        ours, peer = _median(by.get("llama-chat", [])), _median(by.get("llama.cpp", []))
        macs = next(r["macs_per_token"] for r in rows if r.get("shape") == shape and r.get("type") == ftype
                    and "macs_per_token" in r)
        of_peak = f"{100 * ours * macs / (peak * 1e9):.0f} %" if ours and peak else "-"
        ratio = f"{ours / peer:.2f}x" if ours and peer else "-"
        short = _median(cells.get((shape, ftype, 512), {}).get("llama-chat", []))
        longer = f"{ours / short:.2f}" if tokens != 512 and ours and short else ""
        print(f"| {shape} | {ftype.upper()} | {tokens} | {ours and f'{ours:.1f}' or '-'} | "
              f"{peer and f'{peer:.1f}' or '-'} | {ratio} | {of_peak} | {longer} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--types", default=",".join(DEFAULT_TYPES), help="of q4_k_m, q8_0, q4_0, f16")
    parser.add_argument("--tokens", default="512,4096", help="prompt lengths (default 512,4096)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2, help="build jobs for llama.cpp")
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/llama-chat-bench"))
    parser.add_argument("--prepare", action="store_true", help="make the files, measure nothing")
    parser.add_argument("--ctx", type=int, default=CTX,
                        help=f"the files' context in tokens, a multiple of 1024 (default {CTX}; the folder says it)")
    parser.add_argument("--report", type=Path, help="print the table from a saved run's output")
    parser.add_argument("--products", action="store_true", help="only the operator's products, per core")
    parser.add_argument("--product-rows", default="64,512", help="rows for --products (default 64,512)")
    args = parser.parse_args(argv)
    if args.products:
        try:
            rows_list = [int(n) for n in args.product_rows.split(",") if n]
        except ValueError:
            print(f"bench_prefill: --product-rows {args.product_rows!r} is not a list of numbers", file=sys.stderr)
            return 2
        return products(rows_list, max(1, args.rounds) * 3)
    if args.report:
        try:
            rows = [json.loads(line) for line in args.report.read_text().splitlines() if line.startswith("{")]
        except (OSError, ValueError) as e:
            print(f"bench_prefill: --report {args.report}: {e}", file=sys.stderr)
            return 2
        report(rows)
        return 0
    shapes = [s for s in args.shapes.split(",") if s]
    types = [t for t in args.types.split(",") if t]
    unknown = [s for s in shapes if s not in SHAPES] + [t for t in types if t not in bench_gguf.TYPES]
    if unknown:
        print(f"bench_prefill: unknown shape or type: {', '.join(unknown)}", file=sys.stderr)
        return 2
    try:
        lengths = [int(n) for n in args.tokens.split(",") if n]
    except ValueError:
        print(f"bench_prefill: --tokens {args.tokens!r} is not a list of numbers", file=sys.stderr)
        return 2
    if args.ctx < max(lengths, default=0) + 64 or args.ctx % 1024:
        print(f"bench_prefill: --ctx {args.ctx} must be a multiple of 1024 that holds the longest prompt", file=sys.stderr)
        return 2
    cache = args.cache.expanduser().resolve()
    try:
        peer = peer_mod.ensure_llama_cpp(cache, jobs=args.jobs, log=log)
        files = prepare(peer, cache, shapes, types, args.threads, args.ctx)
    except PeerError as e:
        print(f"bench_prefill: {e}", file=sys.stderr)
        return 1
    if args.prepare:
        return 0
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    prompts = {}
    for key in shapes:
        (cache / "prompts" / str(SHAPES[key].vocab)).mkdir(parents=True, exist_ok=True)
        _, shape = long_shape(key, args.ctx)
        for n in lengths:
            prompts[key, n] = prefill_prompt(cache / "prompts" / str(shape.vocab), tokenizer_for(cache, shape), n)
    short = cache / "prompt-short.txt"
    short.write_text(bench_gguf.SHORT_PROMPT)
    emit(cpu=bench_peak.cpu_model(), threads=args.threads, llama_cpp=peer.commit, sdist=peer.version,
         command="python benchmarks/bench_prefill.py " + " ".join(sys.argv[1:] if argv is None else argv),
         llama_chat=bench_gguf.llama_chat_revision())
    emit(**measure_peak(args.threads), when="before", load_1min=os.getloadavg()[0])
    for (key, ftype), path in files.items():
        emit(shape=key, type=ftype, macs_per_token=product_macs_per_token(path))
        try:  # untimed: builds the kernels if their cache is cold, and reads the file in
            run_llama_chat(path, short, 1, args.ctx, env, extra=["--lookup", "off"])
        except RunFailed as e:
            log(f"llama-chat failed on {path.name}: {e}")
            continue
        for round_no in range(1, args.rounds + 1):
            for n in lengths:
                emit(round=round_no, shape=key, type=ftype, tokens=n, system="llama.cpp",
                     tok_s=llama_bench(peer, path, n, args.threads, env), load_1min=os.getloadavg()[0])
                try:
                    out, _ = run_llama_chat(path, prompts[key, n], 1, n + 64, env, extra=["--lookup", "off"])
                except RunFailed as e:
                    log(f"llama-chat failed on {path.name} at {n} tokens: {e}")
                    continue
                if out.get("prompt_tokens") not in (None, n):
                    log(f"llama-chat read {out['prompt_tokens']} prompt tokens, not {n}")
                emit(round=round_no, shape=key, type=ftype, tokens=n, system="llama-chat",
                     tok_s=out["timings"]["prefill_tok_s"], load_1min=os.getloadavg()[0])
    emit(**measure_peak(args.threads), when="after", load_1min=os.getloadavg()[0])
    report(ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
