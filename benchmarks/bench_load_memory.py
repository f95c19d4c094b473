"""Peak memory of ``load_model`` against the size of the weights it loads.

Writes a checkpoint whose weights are about 1 GB in float32 (Meta layout in one file, Meta layout
in two model-parallel shards, and the same weights as Hugging Face safetensors) to a temporary
directory, stored as float32 or, with ``--source-dtype``, float16 or bfloat16. Then it loads each
as float32 on the CPU in a fresh Python process and reports that process's peak resident set
size: ``ru_maxrss`` and ``VmHWM``, raw and minus the RSS of the same interpreter with torch and the
loader imported (the baseline), against the bytes of the float32 weights. Every weight page is
touched after loading (a sum over each parameter and a short forward), so the figure is the cost
of a model in use, not of an untouched memory map.

    python benchmarks/bench_load_memory.py            # meta, meta2 (two shards), hf; float32 files
    python benchmarks/bench_load_memory.py --source-dtype float16 --dir /tmp/bench_ckpt16
    python benchmarks/bench_load_memory.py --layout meta --gb 0.5 --dir /tmp/bench_ckpt
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _child(path: str) -> None:
    """Runs in the fresh process: baseline, load, touch everything, report."""
    import torch

    from llama_chat.model.loader import load_model

    torch.set_num_threads(1)
    baseline_kb = _status_kb("VmRSS")
    t0 = time.perf_counter()
    loaded = load_model(path, device="cpu", dtype="float32")
    load_s = time.perf_counter() - t0
    after_load_kb = _status_kb("VmRSS")
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    with torch.inference_mode():
        for p in loaded.model.parameters():
            p.sum()
        loaded.model(torch.arange(8).unsqueeze(0))
    print(json.dumps({
        "layout": loaded.layout,
        "weight_bytes": weight_bytes,
        "baseline_kb": baseline_kb,
        "after_load_kb": after_load_kb,
        "after_touch_kb": _status_kb("VmRSS"),
        "vmhwm_kb": _status_kb("VmHWM"),
        "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "load_s": load_s,
    }))


def _write_checkpoints(out: Path, gb: float, layouts: list[str], source_dtype: str = "float32") -> None:
    """A TinyLlama-shaped model (dim 2048, GQA 32/4, ffn 5632, vocab 32000) with enough layers."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "tests"))
    from builders import train_sentencepiece
    from builders_formats import _SPLIT_DIM, hf_config, hf_state

    from llama_chat.model.args import ModelArgs
    from llama_chat.model.formats.common import expected_shapes

    base = dict(dim=2048, n_heads=32, n_kv_heads=4, hidden_dim=5632, vocab_size=32000, max_seq_len=2048)
    per_layer = 4 * (2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632)
    embeddings = 4 * 2 * 32000 * 2048
    n_layers = max(1, round((gb * 1e9 - embeddings) / per_layer))
    args = ModelArgs(n_layers=n_layers, **base)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, source_dtype)
    state = {name: (torch.randn(shape, generator=g) * 0.02).to(dtype)
             for name, shape in expected_shapes(args).items()}
    tok = train_sentencepiece(out / "spm", vocab_size=400)
    if "meta" in layouts:
        meta = out / "meta"
        meta.mkdir()
        (meta / "params.json").write_text(json.dumps(args.to_params_json()))
        torch.save(state, meta / "consolidated.00.pth")
        (meta / "tokenizer.model").write_bytes(tok.read_bytes())
    if "meta2" in layouts:  # two model-parallel shards, split as Meta splits them
        meta2 = out / "meta2"
        meta2.mkdir()
        (meta2 / "params.json").write_text(json.dumps(args.to_params_json()))
        shards: list[dict] = [{}, {}]
        for name, tensor in state.items():
            if tensor.dim() == 1:
                parts = [tensor, tensor]
            else:
                kind = name.split(".")[-2]
                parts = tensor.chunk(2, dim=1 if name == "tok_embeddings.weight" else _SPLIT_DIM[kind])
            for shard, part in zip(shards, parts):
                shard[name] = part.clone()
        for i, shard in enumerate(shards):
            torch.save(shard, meta2 / f"consolidated.{i:02d}.pth")
        (meta2 / "tokenizer.model").write_bytes(tok.read_bytes())
    if "hf" in layouts:

        class _Shim:  # the two builders only read .args and .state_dict()
            def __init__(self) -> None:
                self.args = args

            def state_dict(self) -> dict:
                return state

        hf = out / "hf"
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(hf_config(_Shim())))
        save_file(hf_state(_Shim()), str(hf / "model.safetensors"))
        (hf / "tokenizer.model").write_bytes(tok.read_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["meta", "meta2", "hf", "all"], default="all")
    parser.add_argument("--source-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="dtype the checkpoint is written in (it is always loaded as float32)")
    parser.add_argument("--gb", type=float, default=1.0, help="approximate checkpoint size")
    parser.add_argument("--dir", type=Path, help="keep the checkpoints here (reused when present)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    layouts = ["meta", "meta2", "hf"] if opts.layout == "all" else [opts.layout]
    if opts.child:
        _child(opts.child)
        return
    if opts.write:
        _write_checkpoints(opts.write, opts.gb, layouts, opts.source_dtype)
        return
    # This process stays small and imports no torch: Linux carries the peak RSS (ru_maxrss) of a
    # process across fork and exec, so writing the checkpoints here would inflate the children's.
    with tempfile.TemporaryDirectory() as tmp:
        out = opts.dir or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        missing = [layout for layout in layouts if not (out / layout).is_dir()]
        if missing:
            t0 = time.perf_counter()
            for layout in missing:
                subprocess.run([sys.executable, __file__, "--write", str(out), "--gb", str(opts.gb),
                                "--layout", layout, "--source-dtype", opts.source_dtype], check=True)
            print(f"wrote {', '.join(missing)} checkpoints in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        for layout in layouts:
            run = subprocess.run([sys.executable, __file__, "--child", str(out / layout)],
                                 check=True, capture_output=True, text=True)
            _report(json.loads(run.stdout.strip().splitlines()[-1]), layout, opts.source_dtype)


def _report(r: dict, layout: str, source_dtype: str) -> None:
    weights = r["weight_bytes"]
    base = r["baseline_kb"] * 1024
    hwm = r["vmhwm_kb"] * 1024
    ru = r["ru_maxrss_kb"] * 1024
    print(f"{layout:5s} {source_dtype} file -> float32 weights {weights / 1e6:7.1f} MB | baseline RSS (python+torch) {base / 1e6:5.1f} MB | "
          f"RSS after load_model, untouched {r['after_load_kb'] * 1024 / 1e6:6.1f} MB | "
          f"peak VmHWM {hwm / 1e6:6.1f} MB, ru_maxrss {ru / 1e6:6.1f} MB | "
          f"peak/weights {hwm / weights:.3f} raw, {(hwm - base) / weights:.3f} minus baseline | "
          f"load_model {r['load_s']:.2f} s")


if __name__ == "__main__":
    main()
