"""Load time and peak memory of GGUF files: expanded to float32, or kept packed.

Writes a TinyLlama-1.1B-shaped GGUF (dim 2048, 22 layers, 32 query / 4 kv heads, ffn 5632,
vocab 32000, untied: 1.1 B parameters) with random weights, once per type asked for, then loads
each as float32 on the CPU in a fresh Python process, touches every weight (a sum over each
parameter and an 8-token forward) and reports ``load_model``'s time and the process's peak
resident set, raw and minus the same interpreter's RSS with torch and the loader imported. It
also times the ``gguf`` package's numpy dequantizer on the same tensors, for comparison with the
torch dequantizers the reader uses.

    python benchmarks/bench_gguf_load.py --dir /tmp/bench_gguf                # q4_k_m, q8_0, f16
    python benchmarks/bench_gguf_load.py --dir /tmp/bench_gguf --types q8_0 --layers 4
    python benchmarks/bench_gguf_load.py --kernels     # dequantizers alone: torch against numpy
    python benchmarks/bench_gguf_load.py --dir /tmp/bench_gguf --types q8_0 --quantize int8

``--packed`` loads each file as a user's run does (no ``--dtype``: the quantized matrices stay the
file's blocks, ``ml/packed.py``), then makes the decode step's state (fused projections, a KV cache
of the file's context) and runs an 8-token prompt and 8 decode steps; it reports the peak resident
set against the file's size plus the KV cache plus the baseline (target: at most 1.1x the file).
``--file PATH`` measures that file instead of the written ones.

    python benchmarks/bench_gguf_load.py --dir /tmp/bench_gguf --types q4_k_m q8_0 --packed
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPES = ("q4_k_m", "q8_0", "f16", "f32")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _packed_child(path: str) -> None:
    import torch

    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.ml.cpu import kernels as cpu_kernels
    from llama_chat.model.loader import load_model

    cpu_kernels.load()  # imported before the baseline: the command loads it before the model too
    baseline_kb = _status_kb("VmRSS")
    t0 = time.perf_counter()
    loaded = load_model(path, device="cpu")
    load_s = time.perf_counter() - t0
    after_load_kb = _status_kb("VmHWM")
    summary = loaded.weights()
    # As a prompt's run makes it: projections fused, the paged cache allocated.
    source = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=1))
    cache = source.core.cache
    kv_bytes = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
    t0 = time.perf_counter()
    source.generate(Request(tuple(range(1, 9)), sampling=SamplingParams(temperature=0.0), max_tokens=9))
    decode_s = time.perf_counter() - t0
    print(json.dumps({"format": summary.format, "weight_bytes": loaded.weights().nbytes, "kv_bytes": kv_bytes,
                      "baseline_kb": baseline_kb, "after_load_kb": after_load_kb, "vmhwm_kb": _status_kb("VmHWM"),
                      "load_s": load_s, "steps_s": decode_s, "threads": torch.get_num_threads()}))


def _child(path: str, quantize: str) -> None:
    import torch

    from llama_chat.model.loader import load_model

    baseline_kb = _status_kb("VmRSS")
    t0 = time.perf_counter()
    loaded = load_model(path, device="cpu", dtype="float32", quantize=quantize)
    load_s = time.perf_counter() - t0
    # The float32 model's bytes (what the 1.2x bound is about), whatever is kept: every
    # weight once (a tied one is one tensor), int8 projections counted as their float size.
    seen: set[int] = set()
    weight_bytes = 0
    for name, t in loaded.model.state_dict().items():
        if not name.endswith("scales") and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weight_bytes += 4 * t.numel()
    with torch.inference_mode():
        for p in loaded.model.parameters():
            p.sum()
        loaded.model(torch.arange(8).unsqueeze(0))
    print(json.dumps({"weight_bytes": weight_bytes, "baseline_kb": baseline_kb, "vmhwm_kb": _status_kb("VmHWM"),
                      "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "load_s": load_s,
                      "threads": torch.get_num_threads()}))


def _numpy_child(path: str) -> None:
    """The gguf package's own dequantizer over every tensor of the file, one at a time."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    t0 = time.perf_counter()
    for t in reader.tensors:
        np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).sum()
    print(json.dumps({"numpy_s": time.perf_counter() - t0}))


def _kernels() -> None:
    """Best of 5 over 4 Mi values per type, random blocks, into a warm buffer: torch (1 and 2
    threads) against the gguf package's numpy dequantizer (single-threaded)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from llama_chat.ml.blocks import BLOCKS

    def best(f) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            f()
            times.append(time.perf_counter() - t0)
        return min(times)

    np.seterr(all="ignore")  # random blocks overflow the float16 scales now and then
    values = 1 << 22
    for ggml_type, fmt in BLOCKS.items():
        n = values // fmt.block_values
        raw = torch.randint(0, 256, (n, fmt.block_bytes), dtype=torch.uint8)
        raw[:, :2] = 0x00  # finite float16 scales (a zero high byte) wherever the type keeps them
        raw[:, -2:] = 0x00
        out = torch.empty(values)
        flat = raw.reshape(-1)
        row = [f"{fmt.name:5s}"]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            row.append(f"torch {threads} thread(s) {best(lambda: fmt.dequantize(flat, out=out)) * 1e3:6.1f} ms")
        blocks = raw.numpy()
        row.append(f"numpy {best(lambda: dequantize(blocks, GGMLQuantizationType(ggml_type))) * 1e3:6.1f} ms")
        print(" | ".join(row))


def _write(path: Path, kind: str, n_layers: int) -> None:
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import gguf
    from builders import train_sentencepiece
    from builders_gguf import T, add_sentencepiece_vocab, encode_tensor

    dim, hidden, heads, kv, vocab = 2048, 5632, 32, 4, 32000
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(dim)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(vocab)
    add_sentencepiece_vocab(writer, train_sentencepiece(path.parent / "spm", vocab_size=400), vocab)
    base = {"q4_k_m": T.Q4_K, "q8_0": T.Q8_0, "f16": T.F16, "f32": T.F32}[kind]
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, dim), "output_norm.weight": (dim,), "output.weight": (vocab, dim)}
    for i in range(n_layers):
        shapes.update({f"blk.{i}.attn_q.weight": (dim, dim), f"blk.{i}.attn_k.weight": (kv * 64, dim),
                       f"blk.{i}.attn_v.weight": (kv * 64, dim), f"blk.{i}.attn_output.weight": (dim, dim),
                       f"blk.{i}.ffn_gate.weight": (hidden, dim), f"blk.{i}.ffn_down.weight": (dim, hidden),
                       f"blk.{i}.ffn_up.weight": (hidden, dim), f"blk.{i}.attn_norm.weight": (dim,),
                       f"blk.{i}.ffn_norm.weight": (dim,)})
    for name, shape in shapes.items():
        x = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
        if len(shape) == 1:
            writer.add_tensor(name, x + 1)
            continue
        # llama.cpp's Q4_K_M keeps the output, and v and ffn_down of some layers, in Q6_K.
        kind_here = T.Q6_K if base == T.Q4_K and (name == "output.weight" or name.endswith(
            ("attn_v.weight", "ffn_down.weight")) and int(name.split(".")[1]) % 2 == 0) else base
        data = encode_tensor(x, kind_here)
        writer.add_tensor(name, data, raw_dtype=None if kind_here in (T.F32, T.F16) else kind_here)
        del x
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    del torch


def _written(opts: argparse.Namespace, kind: str) -> Path:
    """The TinyLlama-shaped file of ``kind``, written first when it is not there yet."""
    opts.dir.mkdir(parents=True, exist_ok=True)
    path = opts.dir / f"tinyllama-{opts.layers}l-{kind}.gguf"
    if not path.is_file():
        t0 = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--write", str(path), "--types", kind,
                        "--layers", str(opts.layers)], check=True)
        print(f"wrote {path.name} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return path


def _report_packed(path: Path) -> None:
    r = json.loads(subprocess.run([sys.executable, __file__, "--packed-child", str(path)], check=True,
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1])
    size, kv, base = path.stat().st_size, r["kv_bytes"], r["baseline_kb"] * 1024
    hwm, loaded = r["vmhwm_kb"] * 1024, r["after_load_kb"] * 1024
    print(f"{path.name}: {r['format']} | file {size / 1e9:.3f} GB, weights in memory {r['weight_bytes'] / 1e9:.3f} GB, "
          f"KV cache {kv / 1e9:.3f} GB | load_model {r['load_s']:.2f} s, 8 + 8 tokens {r['steps_s']:.1f} s "
          f"({r['threads']} threads) | baseline {base / 1e9:.3f} GB, peak after load {loaded / 1e9:.3f} GB, "
          f"peak {hwm / 1e9:.3f} GB | (peak - baseline - KV) / file {(hwm - base - kv) / size:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_gguf"), help="where the files are written (reused when present)")
    parser.add_argument("--types", nargs="+", choices=TYPES, default=["q4_k_m", "q8_0", "f16"])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--kernels", action="store_true", help="time the dequantizers alone")
    parser.add_argument("--quantize", choices=["none", "int8"], default="none",
                        help="load with load_model(quantize=...): int8 keeps the projections in int8")
    parser.add_argument("--packed", action="store_true", help="load packed (no dtype) and decode; see above")
    parser.add_argument("--file", type=Path, help="measure this GGUF file instead of writing one per type")
    parser.add_argument("--packed-child", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--numpy-child", help=argparse.SUPPRESS)
    parser.add_argument("--write", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.kernels:
        return _kernels()
    if opts.child:
        return _child(opts.child, opts.quantize)
    if opts.numpy_child:
        return _numpy_child(opts.numpy_child)
    if opts.packed_child:
        return _packed_child(opts.packed_child)
    if opts.write:
        return _write(Path(opts.write), opts.types[0], opts.layers)
    # This process imports no torch: a child's ru_maxrss would carry this process's peak over.
    if opts.packed:
        for path in [opts.file] if opts.file else [_written(opts, kind) for kind in opts.types]:
            _report_packed(path)
        return
    opts.dir.mkdir(parents=True, exist_ok=True)
    for kind in opts.types:
        path = _written(opts, kind)
        r = json.loads(subprocess.run([sys.executable, __file__, "--child", str(path), "--quantize", opts.quantize],
                                      check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
        n = json.loads(subprocess.run([sys.executable, __file__, "--numpy-child", str(path)], check=True,
                                      capture_output=True, text=True).stdout.strip().splitlines()[-1])
        weights, base, hwm = r["weight_bytes"], r["baseline_kb"] * 1024, r["vmhwm_kb"] * 1024
        print(f"{kind:7s}{' int8' if opts.quantize == 'int8' else ''} file {path.stat().st_size / 1e9:.2f} GB -> float32 weights {weights / 1e9:.2f} GB | "
              f"load_model {r['load_s']:.1f} s ({r['threads']} threads); gguf numpy dequantize {n['numpy_s']:.1f} s | "
              f"peak VmHWM {hwm / 1e9:.2f} GB, baseline {base / 1e9:.2f} GB | peak/weights {hwm / weights:.3f} raw, "
              f"{(hwm - base) / weights:.3f} minus baseline")


if __name__ == "__main__":
    main()
