"""Startup of the default model: load it and produce the first token, beyond ``import torch``.

In one run, each measurement repeated in fresh processes (the median is reported):

1. ``python -c "import torch; os._exit(0)"``: wall time of an interpreter that only imports torch
   (the baseline). It leaves with ``os._exit`` because ``llama-chat`` does: a normal interpreter
   exit spends a further while tearing torch down, which the command never pays, so a plain
   ``python -c "import torch"`` (also reported) would flatter the command;
2. a child process that imports torch, then times ``load_model(default_model_dir())``, building
   the engine and a one-token greedy generation of ``"Once upon a time"`` through the chat format,
   and reports where the time went (imports, load, first token);
3. ``llama-chat -p "Once upon a time" -n 1 --temperature 0``: the real command's wall time.

The figure against the 0.7 s target is (3) minus (1): everything a user waits for beyond torch
(interpreter start, the CLI's own imports, loading, tokenizing, the first forward, printing).
(2) splits that time up.

    python benchmarks/bench_startup.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

TARGET_S = 0.7
PROMPT = "Once upon a time"
IMPORT_TORCH = "import torch, os; os._exit(0)"


def _child() -> None:
    """Runs in a fresh process: each stage after ``import torch`` timed on its own."""
    t0 = time.perf_counter()
    import torch

    t_torch = time.perf_counter()
    from llama_chat.cmd.prompt import prompt_ids
    from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams
    from llama_chat.model.loader import default_model_dir, load_model

    t_imports = time.perf_counter()
    loaded = load_model(default_model_dir())
    t_load = time.perf_counter()
    ids = prompt_ids(PROMPT, system=None, tokenizer=loaded.tokenizer, chat_format=loaded.chat_format)
    source = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=1))
    done = source.generate(Request(ids, sampling=SamplingParams(temperature=0.0), max_tokens=1))
    t_first = time.perf_counter()
    assert done.completion_tokens == 1
    print(json.dumps({
        "import_torch_s": t_torch - t0, "imports_s": t_imports - t_torch, "load_s": t_load - t_imports,
        "first_token_s": t_first - t_load, "beyond_torch_s": t_first - t_torch,
        "threads": torch.get_num_threads(),
    }))


def _wall(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child()
        return

    cli = shutil.which("llama-chat")
    if cli is None:
        sys.exit("llama-chat is not on PATH: pip install -e . first")
    torch_wall, plain_wall, cli_wall, stages = [], [], [], []
    _wall([sys.executable, "-c", IMPORT_TORCH])  # warm the page cache once, for every case alike
    _wall([cli, "-p", PROMPT, "-n", "1", "--temperature", "0"])
    # Interleaved, so that load from other processes on a shared machine hits every case alike.
    for _ in range(a.runs):
        torch_wall.append(_wall([sys.executable, "-c", IMPORT_TORCH]))
        plain_wall.append(_wall([sys.executable, "-c", "import torch"]))
        out = subprocess.run([sys.executable, __file__, "--child"], check=True, capture_output=True, text=True)
        stages.append(json.loads(out.stdout))
        cli_wall.append(_wall([cli, "-p", PROMPT, "-n", "1", "--temperature", "0"]))

    med = statistics.median
    base, cmd = med(torch_wall), med(cli_wall)
    print(f"runs: {a.runs} (median of each)")
    print(f"python -c 'import torch' (normal exit)           {med(plain_wall):.3f} s")
    print(f"python -c {IMPORT_TORCH!r}   {base:.3f} s   (the baseline)")
    print(f"llama-chat -p {PROMPT!r} -n 1 --temperature 0   {cmd:.3f} s")
    print(f"  beyond import torch                            {cmd - base:.3f} s   (target < {TARGET_S} s: "
          f"{'met' if cmd - base < TARGET_S else 'NOT met'})")
    print("in-process, after import torch:")
    for key in ("imports_s", "load_s", "first_token_s", "beyond_torch_s"):
        print(f"  {key:<16} {med(s[key] for s in stages):.3f} s")
    print(f"  (import torch inside the child: {med(s['import_torch_s'] for s in stages):.3f} s)")


if __name__ == "__main__":
    main()
