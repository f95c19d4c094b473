"""Products on packed GGUF blocks (``ml/packed.py``, ``ml/cpu/blocks.h``) against the operator's
int8 per-row product, one TinyLlama-sized layer at a time.

The layer's projections (q 2048x2048, k and v 256x2048, o 2048x2048, gate and up 5632x2048, down
2048x5632) are made of random blocks of each packed kind, and of int8 rows with float32 scales for
the reference (``torch.ops.llama_chat_cpu.matvec``, the operator's ``--quantize int8`` product).
Each round times every kind's layer once, interleaved, and the fastest round is reported (on a
machine shared with other work the least disturbed; ``--median`` for the median) as GB/s of
weight bytes read (and ms per layer); the reference is measured in the same rounds.
With ``--prefill`` it also times the longer products a prompt takes: the operator (tiles of weight
rows decoded once) against ``dequantized_product`` (weights expanded a tile at a time, then a float32 matrix
product), which is why a prompt takes the operator too.

    python benchmarks/bench_packed.py [--rows 1 4 16] [--rounds 15] [--kinds q8_0 q4_0 ...] [--prefill]

On a machine busy with other processes, wall-clock times of two threads mostly measure when the
second thread got a core; ``--threads 1 --cpu-time`` measures the process's CPU time instead,
which the other processes do not inflate (the kernels' speed per core).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from llama_chat.ml import packed
from llama_chat.ml.cpu import kernels as cpu_kernels

LAYER = {"q": (2048, 2048), "k": (256, 2048), "v": (256, 2048), "o": (2048, 2048),
         "gate": (5632, 2048), "up": (5632, 2048), "down": (2048, 5632)}
# Where each kind keeps its fp16 scales (and mins) in a block: set to sane values, the rest random.
HALF_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
                "q5_k": (0, 2), "q6_k": (208,)}


def random_weight(kind: str, out_features: int, in_features: int, generator: torch.Generator) -> packed.PackedWeight:
    values, size = packed.block_layout(kind)
    blocks = out_features * in_features // values
    raw = torch.randint(0, 256, (blocks, size), dtype=torch.uint8, generator=generator)
    for offset in HALF_OFFSETS[kind]:
        scale = torch.rand(blocks, generator=generator) * 0.01 + 0.001
        raw[:, offset:offset + 2] = scale.to(torch.float16).view(torch.uint8).view(blocks, 2)
    return packed.PackedWeight(kind, raw.view(out_features, -1), in_features)


CLOCK = {"clock": time.perf_counter}


def timed(fn, inner: int) -> float:
    clock = CLOCK["clock"]
    start = clock()
    for _ in range(inner):
        fn()
    return (clock() - start) / inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=5, help="layers timed together in one sample")
    parser.add_argument("--kinds", nargs="+", default=list(packed.PACKED_TYPES), choices=packed.PACKED_TYPES)
    parser.add_argument("--prefill", action="store_true", help="also time 16 to 256 rows both ways")
    parser.add_argument("--median", action="store_true", help="the median round instead of the fastest")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true", help="time the process's CPU time (with --threads 1)")
    args = parser.parse_args()
    if not cpu_kernels.load():
        raise SystemExit(f"the CPU operator did not build: {cpu_kernels.failure()}")
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    pick = statistics.median if args.median else min
    if args.cpu_time:
        CLOCK["clock"] = time.process_time
    generator = torch.Generator().manual_seed(0)
    layers = {kind: [random_weight(kind, n, k, generator) for n, k in LAYER.values()] for kind in args.kinds}
    int8 = [(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator), torch.rand(n) * 0.01)
            for n, k in LAYER.values()]
    int8_bytes = sum(w.numel() + 4 * s.numel() for w, s in int8)
    print(f"threads {torch.get_num_threads()}, {'CPU' if args.cpu_time else 'wall-clock'} time, "
          f"{args.rounds} rounds of {args.inner} layers, "
          f"{'median' if args.median else 'fastest'}; "
          f"GB/s of weight bytes read (ms per layer)")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in LAYER.values()}}
        runs = {kind: (lambda ws=ws: [torch.ops.llama_chat_cpu.packed_product(inputs[w.in_features], w.data, w.kind)
                                      for w in ws]) for kind, ws in layers.items()}
        runs["int8 rows"] = lambda: [cpu_kernels.matvec(inputs[w.shape[1]], w, s) for w, s in int8]
        sizes = {kind: sum(w.nbytes for w in ws) for kind, ws in layers.items()}
        sizes["int8 rows"] = int8_bytes
        samples: dict[str, list[float]] = {name: [] for name in runs}
        for fn in runs.values():
            fn()  # warm
        for _ in range(args.rounds):
            for name, fn in runs.items():
                samples[name].append(timed(fn, args.inner))
        reference = pick(samples["int8 rows"])
        cells = []
        for name, times in samples.items():
            best = pick(times)
            cells.append(f"{name} {sizes[name] / best / 1e9:5.1f} ({best * 1e3:5.2f} ms, {reference / best:4.2f}x int8)")
        print(f"rows {rows:3d}: " + "; ".join(cells))
    if args.prefill:
        prefill(layers, args, generator, pick)


def prefill(layers: dict[str, list[packed.PackedWeight]], args, generator: torch.Generator, pick) -> None:
    """The operator in tiles of 16 rows against the expanded-tile matrix product."""
    print("prefill: ms per layer, the operator / dequantized_product")
    for rows in (16, 32, 64, 256):
        inputs = {k: torch.randn(rows, k, generator=generator) for k in {k for _, k in LAYER.values()}}
        cells = []
        for kind, ws in layers.items():
            op = lambda: [torch.ops.llama_chat_cpu.packed_product(inputs[w.in_features], w.data, w.kind) for w in ws]
            expanded = lambda: [packed.dequantized_product(inputs[w.in_features], w) for w in ws]
            a, b = [], []
            for _ in range(max(3, args.rounds // 3)):
                a.append(timed(op, 1))
                b.append(timed(expanded, 1))
            cells.append(f"{kind} {pick(a) * 1e3:.1f}/{pick(b) * 1e3:.1f}")
        print(f"rows {rows:3d}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
