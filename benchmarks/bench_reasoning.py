"""What a thinking model's split costs ``serve``: decode speed with the thinking kept apart
(``--reasoning-format deepseek``) and left in the text (``--reasoning-format none``).

Two random float32 Llamas of one shape (``--dim``, ``--layers``...: a ~50M-parameter model by
default, so that a decode step costs what a small real model's does and the text path is the
fraction of it that it would be), each with a thinking family's tokenizer and chat template as
``tests/tool_builders.py`` writes them (a byte-level BPE with ``<think>`` and ``</think>`` as added
tokens). The end-of-turn tokens' output rows are zeroed, so that no reply ends before ``--new``
tokens. Two cases, each served by one ``llama-chat serve`` process whose requests name their
``reasoning_format`` (``--switch request``: llama-server's per-request field, the switch that
``--reasoning-format`` sets for a server's requests), or by two processes of the same build that
differ only in ``--reasoning-format`` (``--switch server``; two processes can differ by a few
percent in their own right: where their memory landed, huge pages or not):

* ``qwen3``: Qwen3's template (``tests/data/templates/qwen3.jinja``: the model opens ``<think>``
  itself), with ``--reasoning-budget --budget`` on its server(s), so that every reply is
  ``<think>``, ``--budget`` thinking tokens, ``</think>``, a blank line and an answer (the budget's
  grammar runs for both formats alike: they differ by the split alone);
* ``r1``: an R1 distill's template, which opens the thinking in the generation prompt; no budget,
  no grammar: the reply is thinking from its first token (an answer only where the random model
  draws ``</think>`` itself).

Per round, for each case, the two formats in turns (which goes first alternates from round to
round): ``--clients`` concurrent streaming ``/v1/chat/completions`` requests (greedy,
``max_tokens --new``, ``stream_options.include_usage``; each on a connection of its own, read by
``bench_serve.py``'s small HTTP/1.1 client, which parses the server-sent events itself), then one
request alone. Two figures for each: the client's tok/s (completion tokens over the wall time from
the first request sent to the last response ended), and the server's own CPU time per token (its
``/proc/PID/stat`` user and system time across the requests), which other work on a shared
machine disturbs far less than the wall time. Each is taken as split / no split within a round;
the rounds' values and their median are printed.

Then the text path alone, in this process: the last round's no-split replies encoded again by the
model's tokenizer, each token through ``ReplyText.feed`` and into the server-sent event ``serve``
writes for it, split and not, in alternating passes (best of ``--text-repeats``): microseconds a
token, and the difference over the server's CPU time a token.

Checked on every pair of replies (same prompt, same case): each finishes with ``length`` after
``--new`` tokens; the no-split reply's text, cut at the tags (``cut``), gives the split reply's
``reasoning_content`` and ``content``; ``reasoning_content`` and ``reasoning`` stream the same
text; the split reply's content holds no tag; ``usage.completion_tokens_details.reasoning_tokens``
is counted; and the no-split reply carries no reasoning.

``--tree REV`` runs everything (the servers, the builders) on ``git archive REV`` of this
repository instead of the working tree, so that a run measures one commit.

No package on the registry ships a whole small trained thinking model (a Qwen3 or an R1 distill
GGUF) to put beside llama-server's ``--reasoning-format deepseek``: docs/benchmarks.md, "Thinking
models", says which were looked at.

Prints one JSON line per measurement and two Markdown tables last; exits 1 if a check fails.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_reasoning.py [--rounds 8] [--clients 8] [--new 96] [--budget 48]
        [--tree HEAD]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: idle OpenMP helpers sleep

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import httpx  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# ``--tree REV``: the run re-executes itself on ``git archive REV`` of this repository, exported to a
# temporary folder that comes first on PYTHONPATH (its own and the servers'): the package and the
# tests' builders of that commit, whatever the working tree holds. This variable carries
# ``COMMIT:FOLDER`` to the re-executed run.
TREE_ENV = "BENCH_REASONING_TREE"
TREE = os.environ.get(TREE_ENV, "").partition(":")
sys.path.insert(0, str(Path(TREE[2]) / "llama_chat" / "tests" if TREE[2] else ROOT / "tests"))

from bench_serve import child_env, free_port, llama_chat, post, sse_data, stop  # noqa: E402

START_S = 300.0  # the server's process starting, torch imported, the model loaded
REQUEST_S = 600.0  # one request on a busy machine
WHITESPACE = " \t\r\n"
FORMATS = ("deepseek", "none")  # split, no split
CASES = ("qwen3", "r1")  # tool_builders.THINKING_FAMILIES
TEMPLATES = {"qwen3": "qwen3.jinja", "r1": "r1-distill.jinja"}


@dataclass
class Reply:
    """What one client saw of one streamed chat completion."""

    content: str = ""
    reasoning_content: str = ""
    reasoning: str = ""
    tokens: int = 0
    reasoning_tokens: int | None = None
    finish_reason: str | None = None


# -- the model -------------------------------------------------------------------------------------


def build_model(out: Path, family: str, args: argparse.Namespace) -> Path:
    """A random Llama of the chosen shape with ``family``'s tokenizer and template; no end-of-turn."""
    from builders import random_model, tiny_args
    from builders_formats import write_hf_checkpoint
    from tool_builders import write_tokenizer

    vocab = write_tokenizer(out, family)
    model = random_model(tiny_args(vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                   n_kv_heads=args.kv_heads, hidden_dim=args.hidden, max_seq_len=1024), seed=args.seed)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    with torch.no_grad():
        for name in ("<|im_end|>", "<|endoftext|>"):
            model.output.weight[ids[name]] = 0.0
    write_hf_checkpoint(model, out)
    return out


def parameters(args: argparse.Namespace, vocab: int) -> int:
    kv = args.dim // args.heads * args.kv_heads
    per_layer = 2 * args.dim * args.dim + 2 * args.dim * kv + 3 * args.dim * args.hidden + 2 * args.dim
    return args.layers * per_layer + 2 * vocab * args.dim + args.dim


# -- the servers -----------------------------------------------------------------------------------


def start(model: Path, work: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_port()
    cmd = [*llama_chat(), "serve", "-m", str(model), "--port", str(port), *extra]
    log = open(work / f"serve-{name}.log", "wb")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=child_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited {proc.returncode}: {open(log.name, errors='replace').read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return proc, url, cmd
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    sys.exit("the server did not answer /health 200 in time")


def cpu_s(pid: int) -> float:
    """The process's user and system CPU time so far, all its threads (``/proc/PID/stat``)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def questions(n: int) -> list[str]:
    return [f"Question {i}: the weather in Paris is sunny; how warm is it in {1 + 3 * i} days?" for i in range(n)]


async def stream_chat(url: str, question: str, new: int, form: str | None) -> Reply:
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": new, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if form is not None:
        body["reasoning_format"] = form
    seen = Reply()
    reader, writer, headers = await post(url, "/v1/chat/completions", body)
    try:
        async for data in sse_data(reader, headers):
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                seen.tokens = chunk["usage"]["completion_tokens"]
                details = chunk["usage"].get("completion_tokens_details") or {}
                seen.reasoning_tokens = details.get("reasoning_tokens")
            for choice in chunk["choices"]:
                delta = choice.get("delta") or {}
                for name in ("content", "reasoning_content", "reasoning"):
                    if delta.get(name):
                        setattr(seen, name, getattr(seen, name) + delta[name])
                seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
    finally:
        writer.close()
    return seen


async def wave(url: str, prompts: list[str], new: int, form: str | None = None) -> tuple[list[Reply], float]:
    out: list[Reply | None] = [None] * len(prompts)

    async def one(i: int) -> None:
        with anyio.fail_after(REQUEST_S):
            out[i] = await stream_chat(url, prompts[i], new, form)

    begin = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out, time.perf_counter() - begin


# -- the checks ------------------------------------------------------------------------------------


def cut(raw: str, inside: bool) -> tuple[str, str]:
    """The no-split reply's text cut at the tags as llama-chat's splitter cuts a reply whose tags are
    tokens: the reasoning is the text between the start tag (or the prompt's, ``inside``) and the
    first end tag, stripped, less any start tag within it (a ``<think>`` token inside the thinking
    is dropped); the content is the text after that end tag, leading blanks dropped."""
    body = raw
    if not inside:
        bare = raw.lstrip(WHITESPACE)
        if not bare.startswith("<think>"):
            return "", bare
        body = bare[len("<think>"):]
    thought, _, answer = body.partition("</think>")
    return thought.replace("<think>", "").strip(WHITESPACE), answer.lstrip(WHITESPACE)


def divergence(a: str, b: str) -> str:
    """Where two texts first differ, and a few characters of each from there."""
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first differs at character {at}: {a[max(0, at - 8):at + 16]!r} against {b[max(0, at - 8):at + 16]!r}"


def check_pair(case: str, i: int, split: Reply, raw: Reply, new: int) -> list[str]:
    problems = []
    for fmt, r in (("deepseek", split), ("none", raw)):
        if r.finish_reason != "length" or r.tokens != new:
            problems.append(f"{case} {fmt} #{i}: finish {r.finish_reason}, {r.tokens} tokens (want length, {new})")
    if raw.reasoning_content or raw.reasoning:
        problems.append(f"{case} none #{i}: reasoning returned under --reasoning-format none")
    reasoning, content = cut(raw.content, inside=case == "r1")
    if split.reasoning_content != split.reasoning:
        problems.append(f"{case} #{i}: streamed reasoning_content and reasoning differ")
    if split.reasoning_content != reasoning:
        problems.append(f"{case} #{i}: reasoning_content differs from the no-split text between the tags "
                        f"({len(split.reasoning_content)} against {len(reasoning)} characters; "
                        f"{divergence(split.reasoning_content, reasoning)})")
    if split.content != content:
        problems.append(f"{case} #{i}: content differs from the no-split text after the end tag "
                        f"({divergence(split.content, content)})")
    if "<think>" in split.content or "</think>" in split.content:
        problems.append(f"{case} #{i}: a tag in the split reply's content")
    if not split.reasoning_tokens:
        problems.append(f"{case} #{i}: usage.completion_tokens_details.reasoning_tokens is {split.reasoning_tokens}")
    return problems


# -- the text path alone ---------------------------------------------------------------------------


def text_path_us(model: Path, raws: list[str], inside: bool, repeats: int) -> dict[str, float]:
    """Microseconds a token of the server's text path takes, split and not: the no-split replies'
    text encoded again by the model's tokenizer (the tags are its added tokens), each token through
    ``ReplyText.feed`` and into its server-sent event as ``serve`` writes it (the answer's text by
    ``StreamEvents.text``, a piece of thinking by ``event(reply.chunk(..., reasoning=...))``), one
    token a chunk. Passes alternate between the two; the best of ``repeats`` each."""
    from types import SimpleNamespace

    from llama_chat.cmd.openai_api import Reply, StreamEvents, event
    from llama_chat.inference.reasoning import ReplyText, ThinkSplit, think_tags
    from llama_chat.model.tokenizers.hf import HFTokenizer

    tokenizer = HFTokenizer(model / "tokenizer.json")
    template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    tags = think_tags(tokenizer, SimpleNamespace(template=template))
    streams = [[(t, tokenizer.token_bytes(t)) for t in tokenizer.encode(raw)] for raw in raws]
    tokens = sum(map(len, streams))
    reply = Reply(chat=True, id="chatcmpl-bench", model=model.name, created=0)

    def one_pass(split: ThinkSplit | None) -> float:
        begin = time.perf_counter()
        for stream in streams:
            events = StreamEvents(reply)
            maker = ReplyText((), split=split)
            for token_id, data in stream:
                text, thought = maker.feed(token_id, data)
                if thought:
                    event(reply.chunk(0, "", reasoning=thought))
                if text:
                    events.text(0, text)
            maker.finish()
        return (time.perf_counter() - begin) / tokens * 1e6

    best = {"deepseek": float("inf"), "none": float("inf")}
    for _ in range(repeats):
        best["deepseek"] = min(best["deepseek"], one_pass(ThinkSplit(tags, inside)))
        best["none"] = min(best["none"], one_pass(None))
    return {**best, "tokens": tokens}


# -- the run ---------------------------------------------------------------------------------------


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def listed(values: list[float], spec: str = ".3f") -> str:
    return ", ".join(format(v, spec) for v in values)


def run_case(case: str, model: Path, work: Path, args: argparse.Namespace) -> dict:
    extra = ["--max-batch", str(max(args.clients, 1))]
    if case == "qwen3":
        extra += ["--reasoning-budget", str(args.budget)]
    if args.switch == "server":
        servers = {fmt: start(model, work, f"{case}-{fmt}", [*extra, "--reasoning-format", fmt]) for fmt in FORMATS}
        forms = dict.fromkeys(FORMATS)
    else:  # one process: each request names its format
        one = start(model, work, case, extra)
        servers = dict.fromkeys(FORMATS, one)
        forms = {fmt: fmt for fmt in FORMATS}
    prompts = questions(args.clients)
    speed: dict[str, dict[str, list[float]]] = {fmt: {key: [] for key in ("wave", "cpu_ms", "one", "cpu_ms_one", "client_ms")}
                                                 for fmt in FORMATS}
    problems: list[str] = []
    sample: dict[str, Reply] = {}
    try:
        for fmt in FORMATS:  # warm-up: first touch of the weights, the kernels and the grammar
            anyio.run(wave, servers[fmt][1], prompts[:2], 8, forms[fmt])
        for rnd in range(args.rounds):
            order = FORMATS if rnd % 2 == 0 else FORMATS[::-1]
            replies: dict[str, list[Reply]] = {}
            for fmt in order:
                proc, url, _ = servers[fmt]
                for key, cpu_key, jobs in (("wave", "cpu_ms", prompts), ("one", "cpu_ms_one", prompts[:1])):
                    cpu, client = cpu_s(proc.pid), time.process_time()
                    streams, wall = anyio.run(wave, url, jobs, args.new, forms[fmt])
                    tokens = sum(s.tokens for s in streams)
                    speed[fmt][cpu_key].append((cpu_s(proc.pid) - cpu) * 1000 / tokens)
                    if key == "wave":  # the clients' own CPU, taken from the server's two cores
                        speed[fmt]["client_ms"].append((time.process_time() - client) * 1000 / tokens)
                    speed[fmt][key].append(tokens / wall)
                    replies.setdefault(fmt, streams)
                emit(case=case, round=rnd, format=fmt, clients_tok_s=round(speed[fmt]["wave"][-1], 1),
                     server_cpu_ms_per_token=round(speed[fmt]["cpu_ms"][-1], 2),
                     client_cpu_ms_per_token=round(speed[fmt]["client_ms"][-1], 3),
                     one_tok_s=round(speed[fmt]["one"][-1], 1),
                     one_server_cpu_ms_per_token=round(speed[fmt]["cpu_ms_one"][-1], 2))
            for i, (a, b) in enumerate(zip(replies["deepseek"], replies["none"])):
                problems += check_pair(case, i, a, b, args.new)
            sample = {"deepseek": replies["deepseek"][0], "none": replies["none"][0]}
            raws = [r.content for r in replies["none"]]
        commands = {fmt: " ".join(Path(c).name if j == 0 else c for j, c in enumerate(servers[fmt][2]))
                    for fmt in FORMATS}
    finally:
        codes = {fmt: stop(servers[fmt][0]) for fmt in FORMATS}  # a second stop of one process: its code again
    problems += [f"{case} {fmt}: the server exited {code} on SIGTERM" for fmt, code in codes.items() if code]
    split = sample["deepseek"]
    emit(case=case, sample_reasoning_tokens=split.reasoning_tokens, sample_reasoning=split.reasoning_content[:120],
         sample_content=split.content[:120], sample_none=sample["none"].content[:160])
    for p in problems[:10]:
        print("  " + p, flush=True)
    path = text_path_us(model, raws, case == "r1", args.text_repeats)
    emit(case=case, measure="text_path", tokens=path["tokens"], deepseek_us=round(path["deepseek"], 2),
         none_us=round(path["none"], 2))
    return {"speed": speed, "problems": problems, "reasoning_tokens": split.reasoning_tokens, "commands": commands,
            "text_path": path}


def on_tree(rev: str) -> None:
    """Re-execute this run on ``git archive REV`` (``TREE_ENV``); returns only when already on it."""
    if os.environ.get(TREE_ENV):
        return
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{rev}^{{commit}}"],
                            capture_output=True, text=True, check=True).stdout.strip()
    folder = tempfile.mkdtemp(prefix="bench_reasoning_tree_")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--prefix=llama_chat/", commit],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    env = {**os.environ, TREE_ENV: f"{commit}:{folder}",
           "PYTHONPATH": os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)}
    code = subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env).returncode
    shutil.rmtree(folder, ignore_errors=True)
    sys.exit(code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="rounds, each both servers of each case in turns")
    parser.add_argument("--clients", type=int, default=8, help="concurrent streams of a wave")
    parser.add_argument("--new", type=int, default=96, help="max_tokens of each request")
    parser.add_argument("--budget", type=int, default=48, help="the qwen3 case's --reasoning-budget")
    parser.add_argument("--cases", default=",".join(CASES), help="which of qwen3,r1")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--switch", choices=("request", "server"), default="request",
                        help="request: one server per case, each request's reasoning_format; server: two servers "
                        "per case, --reasoning-format deepseek and none")
    parser.add_argument("--text-repeats", type=int, default=50, help="passes of the text path alone, each way")
    parser.add_argument("--tree", metavar="REV", help="run on this commit of the repository (git archive), "
                        "not on the working tree")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if (args.rounds < 1 or args.clients < 1 or not 0 < args.budget < args.new - 4
            or any(c not in CASES for c in cases)):
        parser.error(f"--rounds and --clients at least 1, 0 < --budget < --new - 4, --cases of {','.join(CASES)}")
    if args.tree:
        on_tree(args.tree)
    import llama_chat

    emit(llama_chat=os.path.dirname(llama_chat.__file__), commit=TREE[0] or "working tree")

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_reasoning_") as tmp:
        work = Path(tmp)
        for case in cases:
            model = build_model(work / case, case, args)
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            emit(case=case, model=str(model), template=TEMPLATES[case], vocab=vocab,
                 parameters=parameters(args, vocab))
            results[case] = run_case(case, model, work, args)

    print(json.dumps({"load_avg": os.getloadavg(), "torch": torch.__version__, "cpus": os.cpu_count(),
                      "machine": platform.machine()}))
    for case in cases:
        for fmt, cmd in results[case]["commands"].items():
            each = f' (each request: "reasoning_format": "{fmt}")' if args.switch == "request" else ""
            print(f"# {case} {fmt}: {cmd}{each}")
    print()
    print("| case | streams | client tok/s, split / no split, per round | median | "
          "tokens per server CPU second, split / no split, per round | median |")
    print("|---|---|---|---|---|---|")
    for case in cases:
        speed = results[case]["speed"]
        for load, cpu, label in (("wave", "cpu_ms", str(args.clients)), ("one", "cpu_ms_one", "1")):
            ratios = [x / y for x, y in zip(speed["deepseek"][load], speed["none"][load])]
            per_cpu = [y / x for x, y in zip(speed["deepseek"][cpu], speed["none"][cpu])]
            print(f"| {case} | {label} | {listed(ratios, '.2f')} | **{statistics.median(ratios):.3f}** | "
                  f"{listed(per_cpu, '.2f')} | **{statistics.median(per_cpu):.3f}** |")
    print()
    print("| case | text path per token, no split | split | split - no split | over the server's CPU a token "
          f"({args.clients} streams / 1 stream, no split) |")
    print("|---|---|---|---|---|")
    for case in cases:
        path, speed = results[case]["text_path"], results[case]["speed"]
        extra = path["deepseek"] - path["none"]
        wave_us = statistics.median(speed["none"]["cpu_ms"]) * 1000
        one_us = statistics.median(speed["none"]["cpu_ms_one"]) * 1000
        print(f"| {case} | {path['none']:.1f} µs | {path['deepseek']:.1f} µs | {extra:+.1f} µs | "
              f"{extra / wave_us:+.2%} of {wave_us / 1000:.2f} ms / {extra / one_us:+.2%} of {one_us / 1000:.2f} ms |")
    problems = [p for case in cases for p in results[case]["problems"]]
    checked = len(cases) * args.rounds * args.clients
    print(f"\nreplies checked (split against no split): {checked}, problems: {len(problems)}")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
