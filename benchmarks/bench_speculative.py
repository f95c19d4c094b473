"""Speculative decoding by prompt lookup (``--lookup on``) and by a draft model (``--draft``)
against decoding without it, and llama.cpp's own n-gram and draft-model speculation on the same
files, measured in the same run.

    python benchmarks/bench_speculative.py FILE.gguf [--draft DRAFT.gguf] [--tokens 160] [--rounds 3]
    python benchmarks/bench_speculative.py qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --jobs 0 --tasks edit

FILE or DRAFT may name a trained instruct model that packages on the registry ship
(``registry_models.py``: ``smollm2``, ``qwen2.5-coder-1.5b``, ``qwen2.5-coder-0.5b``).

Greedy, on tasks whose answer repeats its input (repeat a passage word for word, change one word
throughout a passage, add a docstring to a given function), on the edits of a 60-line file an
agent asks for (add docstrings, add type hints, rename one function, fix one line: the reply
copies most of the file, with new text between the copied lines), and on open-ended ones (a
story, an explanation), and the open-ended ones again sampled (temperature 0.8, a fixed seed: a
small model's greedy story soon repeats itself, a sampled one much less), each as a one-turn chat
in the file's own template, or as plain text where the file has none (a base model). ``--tasks``
picks some of them by name or kind (``--tasks "edit,story,explain,story t=0.8,explain t=0.8"
--rounds 5 --tokens 200``: the edits and the open-ended ones, in five interleaved rounds):

* llama-chat, one job: decode tok/s (the tokens after the first over their time) without drafts,
  with lookup, and (``--draft``) with the draft model alone (lookup off), in rounds that rotate
  their order, in one process; the replies must be equal token for token. Also the share of
  drafted tokens kept;
* llama-chat, 16 jobs of the same tasks at once (``--batch``'s shape), all tokens over the wall
  time, in the same modes, after a first batch each that is not timed (drafting steps aside above
  four jobs: the ratios should be 1.0);
* llama.cpp's ``llama-server`` (the build of ``llama_cpp_peer.py``) on the same files and token
  ids, one slot, without speculation, with ``--spec-type ngram-simple``, and with ``-md DRAFT``,
  drafts of at most as many tokens as ours (``--draft-max``'s default), its own ``predicted_per_second``.

Targets: at least 1.8x on the repeating tasks and the edits at one job; no more than 3 % slower
on the open-ended ones and at 16 jobs; ahead of llama.cpp's speculative speed on the same file.
``--jobs 0`` leaves the 16 jobs out. ``--step-curve 1,2,4,8,16,33`` times a step by its rows instead
(what a drafted token costs, which bounds what drafts can give).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import anyio
import torch

import llama_cpp_peer as peer_mod
from bench_kv_memory import free_port, wait_ready
from bench_serve import stop
from registry_models import CACHE, MODELS, registry_model

from llama_chat.ml.controls import DEFAULT_DRAFT_MAX

PASSAGE = ("The first commands a new user types are the ones that decide whether a tool is kept. A runner "
           "that starts at once, prints its answer as it is made, and stops cleanly on Ctrl+C earns trust; "
           "one that hangs, prints a traceback or loses half the reply does not. That is why every path in "
           "this program is tested as a user would meet it, with a real terminal, real signals and a real "
           "server, and why a bad input gets one clear line instead of a wall of text.")
CODE = '''def pages_for(tokens, page_size):
    full, rest = divmod(tokens, page_size)
    return full + (1 if rest else 0)


def reserved(prompt_len, max_tokens, context):
    total = context if max_tokens is None else prompt_len + max_tokens
    return min(total, context)
'''
# A 60-line file for the edits an agent asks most (its clamp has a bug for one of them to fix).
FILE60 = '''import os
import time


def pages_for(tokens, page_size):
    full, rest = divmod(tokens, page_size)
    return full + (1 if rest else 0)


def reserved(prompt_len, max_tokens, context):
    total = context if max_tokens is None else prompt_len + max_tokens
    return min(total, context)


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def count_words(lines):
    counts = {}
    for line in lines:
        for word in line.split():
            counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(counts, n):
    ranked = sorted(counts.items(), key=lambda item: item[1], reverse=True)
    return ranked[:n]


def newest_file(folder):
    paths = [os.path.join(folder, name) for name in os.listdir(folder)]
    files = [p for p in paths if os.path.isfile(p)]
    return max(files, key=os.path.getmtime) if files else None


def wait_for(path, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.1)
    return False


def mean(values):
    return sum(values) / len(values) if values else 0.0


def clamp(value, low, high):
    return max(low, min(value, low))


def report(path, n):
    lines = read_lines(path)
    words = top_words(count_words(lines), n)
    for word, count in words:
        print(f"{word}: {count}")
'''
REPEAT = f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"
TASKS = {
    "repeat": ("grounded", REPEAT),
    "edit": ("grounded", f"Rewrite the following text, replacing the word 'user' with 'reader' everywhere, and "
                         f"change nothing else:\n\n{PASSAGE}"),
    "code": ("grounded", f"Add a one-line docstring to each of these Python functions and return the whole "
                         f"code:\n\n{CODE}"),
    "docstrings": ("edit", f"Add a one-line docstring to each function in this file and return the whole "
                           f"file:\n\n```python\n{FILE60}```"),
    "type hints": ("edit", f"Add type hints to every function in this file and return the whole file:\n\n"
                           f"```python\n{FILE60}```"),
    "rename": ("edit", f"Rename the function count_words to word_counts everywhere in this file and return the "
                       f"whole file:\n\n```python\n{FILE60}```"),
    "fix a line": ("edit", f"In this file, clamp returns min(value, low) where it should return min(value, high). "
                           f"Fix that line and return the whole file:\n\n```python\n{FILE60}```"),
    "story": ("open", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    "explain": ("open", "Explain in a few paragraphs why the sky is blue, for a curious ten-year-old."),
    "story t=0.8": ("open, sampled", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    "explain t=0.8": ("open, sampled", "Explain in a few paragraphs why the sky is blue, for a curious ten-year-old."),
}
SAMPLED = 0.8
SEED = 7
def sampling_of(name: str):
    from llama_chat.ml.sampling import SamplingParams

    return SamplingParams(temperature=SAMPLED if "t=" in name else 0.0)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def source(loaded, mode: str, jobs: int, draft: str | None = None):
    """A scheduler of ``jobs`` jobs in ``mode``: off (no drafts), on (lookup), draft (the draft
    model, lookup off)."""
    from llama_chat.cmd.generation_source import make_source
    from llama_chat.cmd.source_settings import BATCH_JOBS, ONE_STREAM, LoadSettings, SourceSettings

    return make_source(loaded, SourceSettings(
        LoadSettings(), jobs=ONE_STREAM if jobs == 1 else BATCH_JOBS, max_batch=jobs, compile=False, cache_type="auto",
        lookup="on" if mode == "on" else "off", draft=draft if mode == "draft" else None, draft_max=DEFAULT_DRAFT_MAX))


def one_job(scheduler, ids: list[int], tokens: int, sampling):
    """The reply, and the process's CPU seconds from its first token to its last (the decode's:
    the prompt's are the same with drafts and without)."""
    from llama_chat.inference.types import Request

    async def main():
        first = None
        async with scheduler.stream(Request(tuple(ids), sampling=sampling, max_tokens=tokens, seed=SEED)) as stream:
            async for _ in stream:
                first = time.process_time() if first is None else first
        return stream.completion(), time.process_time() - first

    return anyio.run(main)


def together(scheduler, prompts: list[list[int]], tokens: int) -> tuple[float, list[tuple[int, ...]]]:
    from llama_chat.inference.types import Request
    from llama_chat.ml.sampling import SamplingParams

    async def main():
        out = {}

        async def one(i, ids):
            request = Request(tuple(ids), sampling=SamplingParams(temperature=0.0), max_tokens=tokens,
                              request_id=f"j{i}")
            async with scheduler.submit(request) as stream:
                async for _ in stream:
                    pass
            out[i] = stream.completion().token_ids

        async with scheduler:
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i, ids in enumerate(prompts):
                    tg.start_soon(one, i, ids)
            return time.perf_counter() - start, [out[i] for i in range(len(prompts))]

    return anyio.run(main)


def llama_server_rates(server: Path, path: Path, prompts: dict[str, list[int]], tokens: int, threads: int,
                       spec: str, rounds: int, draft: str | None = None) -> dict[str, float]:
    """llama-server's own decode rate for each prompt (token ids, as ours), median of ``rounds``;
    ``spec``: off, on (``ngram-simple``) or draft (``-md draft``)."""
    port = free_port()
    cmd = [str(server), "-m", str(path), "--port", str(port), "-np", "1", "-c", "4096", "-t", str(threads),
           "--no-webui", "--temp", "0"]
    if spec == "on":
        cmd += ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(DEFAULT_DRAFT_MAX)]
    elif spec == "draft":
        cmd += ["-md", str(draft), "--spec-draft-n-max", str(DEFAULT_DRAFT_MAX)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        rates: dict[str, list[float]] = {name: [] for name in prompts}
        for _ in range(rounds):
            for name, ids in prompts.items():
                body = json.dumps({"prompt": ids, "n_predict": tokens, "temperature": SAMPLED if "t=" in name else 0,
                                   "seed": SEED, "cache_prompt": False, "ignore_eos": True}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=3600) as r:
                    rates[name].append(json.load(r)["timings"]["predicted_per_second"])
        return {name: statistics.median(v) for name, v in rates.items()}
    finally:
        stop(proc)


def print_table(mode: str, names: tuple[str, str, str], rates: dict, kept: dict, cpp: dict, cpu_s: dict) -> None:
    """One Markdown table: each task's speed in ``mode`` against no drafts, ours and llama.cpp's.
    ``names``: the mode's column, llama.cpp's, and llama.cpp's in the last column's title. "by CPU
    time": the reply's process CPU seconds without drafts over those with them, from its first
    token to its last (the prompt's are the same either way), which other processes on a shared
    machine move much less than the clock."""
    ours, theirs, short = names
    print(f"| task | kind | llama-chat off | {ours} | {ours} / off | by CPU time | drafts kept | llama.cpp off | "
          f"{theirs} | its ratio | ours {ours} / its {short} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (kind, _) in TASKS.items():
        off, on = statistics.median(rates[name]["off"]), statistics.median(rates[name][mode])
        by_cpu = statistics.median(cpu_s[name]["off"]) / statistics.median(cpu_s[name][mode])
        drafted, accepted = kept[mode].get(name, (0, 0))
        share = f"{accepted}/{drafted}" if drafted else "-"
        c_off, c_on = cpp.get("off", {}).get(name), cpp.get(mode, {}).get(name)
        cells = [f"{c_off:.1f}" if c_off else "-", f"{c_on:.1f}" if c_on else "-",
                 f"{c_on / c_off:.2f}x" if c_on and c_off else "-", f"**{on / c_on:.2f}x**" if c_on else "-"]
        print(f"| {name} | {kind} | {off:.1f} | {on:.1f} | **{on / off:.2f}x** | {by_cpu:.2f}x | {share} | "
              + " | ".join(cells) + " |")


def step_curve(loaded, ids: list[int], rows: list[int]) -> None:
    """A decoding step's milliseconds by its rows (a job's last token and its draft), for a job
    alone: the repeat task with lookup made to draft ``rows - 1`` tokens at every step (each kept,
    for the reply copies the passage), medians of the steps timed at each count over two passes."""
    from llama_chat.inference import speculative

    drafted, times = [0], {}
    speculative.DraftCosts.longest = lambda self, pace, jobs=1, share=None: drafted[0]
    speculative.DraftCosts.drafts_now = lambda self, pace, jobs=1: True
    stepped = speculative.DraftCosts.stepped

    def timed(self, n: int, seconds: float) -> None:
        times.setdefault(n, []).append(seconds * 1000)
        stepped(self, n, seconds)

    speculative.DraftCosts.stepped = timed
    scheduler = source(loaded, "on", 1)
    for n in rows * 2:
        drafted[0] = n - 1
        one_job(scheduler, ids, 100, sampling_of("repeat"))
    print(f"\nA step's time by its rows, {machine()}\n\n| rows | steps | ms | ms a token |\n|---|---|---|---|")
    for n in sorted(times):
        ms = statistics.median(times[n])
        print(f"| {n} | {len(times[n])} | {ms:.1f} | {ms / n:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help=f"a GGUF file (llama.cpp reads the same), or one of {', '.join(MODELS)}")
    ap.add_argument("--draft", help="a GGUF file of the same vocabulary: the draft model")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument("--tasks", help="comma-separated task names or kinds (default: all)")
    ap.add_argument("--show", action="store_true", help="print each task's reply (does it copy the file?)")
    ap.add_argument("--step-curve", metavar="ROWS", help="comma-separated row counts: time a step at each "
                    "(step_curve) and stop")
    args = ap.parse_args()
    if args.tasks:
        picked = {t.strip() for t in args.tasks.split(",")}
        unknown = picked - set(TASKS) - {kind for kind, _ in TASKS.values()}
        if unknown:
            ap.error(f"no task or kind named {sorted(unknown)[0]!r}; tasks: {', '.join(TASKS)}")
        for name in [n for n, (kind, _) in TASKS.items() if n not in picked and kind not in picked]:
            del TASKS[name]
    if args.model in MODELS:
        args.model = str(registry_model(args.model))
    if args.draft in MODELS:
        args.draft = str(registry_model(args.draft))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(args.threads)

    from llama_chat.cmd.prompt import prompt_ids
    from llama_chat.ml.cpu import kernels
    from llama_chat.model.loader import load_model

    loaded = load_model(args.model, device="cpu")
    kernels.prepare(loaded.model)
    kernels.load()
    prompts = {name: prompt_ids(text, system=None, tokenizer=loaded.tokenizer, chat_format=loaded.chat_format)
               for name, (_, text) in TASKS.items()}
    if args.step_curve:
        ids = prompt_ids(REPEAT, system=None, tokenizer=loaded.tokenizer, chat_format=loaded.chat_format)
        return step_curve(loaded, list(ids), [int(n) for n in args.step_curve.split(",")])
    modes = ("off", "on", "draft") if args.draft else ("off", "on")
    schedulers = {mode: source(loaded, mode, 1, args.draft) for mode in modes}
    rates: dict[str, dict[str, list[float]]] = {name: {m: [] for m in modes} for name in TASKS}
    kept: dict[str, dict[str, tuple[int, int]]] = {m: {} for m in modes}
    cpu_s: dict[str, dict[str, list[float]]] = {name: {m: [] for m in modes} for name in TASKS}
    for r in range(args.rounds + 1):  # the first round warms up (panels, caches) and is not counted
        for name, ids in prompts.items():
            replies = {}
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                done, cpu = one_job(schedulers[mode], ids, args.tokens, sampling_of(name))
                replies[mode] = done.token_ids
                if r:
                    rates[name][mode].append(done.timings.decode_tok_s)
                    cpu_s[name][mode].append(cpu)
                if done.speculation is not None:
                    kept[mode][name] = done.speculation
            assert all(replies[m] == replies["off"] for m in modes), f"{name}: the replies differ with drafts"
            if args.show and r == args.rounds:
                log(f"--- {name}, the reply:\n{loaded.tokenizer.decode(list(replies['off']))}\n---")
            log(f"round {r} {name}: " + "  ".join(f"{m} {rates[name][m][-1]:.1f}" for m in modes if rates[name][m]))

    server = None if args.no_llama_cpp else peer_mod.ensure_llama_cpp(CACHE, log=log).bench.parent / "llama-server"
    cpp = {}
    if server is not None and server.exists():
        ids = {name: list(p) for name, p in prompts.items()}
        cpp = {mode: llama_server_rates(server, Path(args.model), ids, args.tokens, args.threads, mode, args.rounds,
                                        args.draft) for mode in modes}

    print(f"\nPrompt lookup, {Path(args.model).name}, {args.tokens} tokens, medians of {args.rounds} "
          f"rounds; {machine()}\n")
    print_table("on", ("on", "ngram-simple", "ngram"), rates, kept, cpp, cpu_s)
    if args.draft:
        print(f"\nA draft model, {Path(args.draft).name} for {Path(args.model).name}, lookup off:\n")
        print_table("draft", ("draft", "-md", "draft"), rates, kept, cpp, cpu_s)

    if args.jobs <= 0:
        return
    batch = [list(prompts[name]) for name in TASKS for _ in range(-(-args.jobs // len(TASKS)))][:args.jobs]
    walls: dict[str, list[float]] = {m: [] for m in modes}
    batched = {mode: source(loaded, mode, args.jobs, args.draft) for mode in modes}
    # Replies that part from the same round's without drafts. A batch's greedy replies on packed
    # blocks are the same only while every step's rows are computed alike: where a step's rows are
    # put together otherwise (a prompt found in the pages of an earlier round, a draft verified
    # beside others), a token whose two best logits lie within the 8-bit rounding may differ.
    parted = {m: 0 for m in modes}
    for mode in modes:  # each scheduler's first batch (its buffers, the operator's panels), untimed
        together(batched[mode], batch, 16)
    for r in range(args.rounds):
        outs = {}
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            wall, outs[mode] = together(batched[mode], batch, args.tokens)
            walls[mode].append(sum(len(t) for t in outs[mode]) / wall)
        for m in modes:
            parted[m] += sum(a != b for a, b in zip(outs[m], outs["off"]))
    off = statistics.median(walls["off"])
    print(f"\n{args.jobs} jobs at once: {off:.1f} tok/s without drafts; "
          + "; ".join(f"{statistics.median(walls[m]):.1f} with {'lookup' if m == 'on' else 'the draft model'}: "
                      f"**{statistics.median(walls[m]) / off:.2f}x** ({parted[m]} of {args.jobs * args.rounds} "
                      "replies parted from those without)" for m in modes if m != "off")
          + f"; load {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
