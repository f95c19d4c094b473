"""What tool calls cost: the grammar's work per token, and the time to the first token of a request
that offers 20 tools.

The vocabulary is ``bench_constraints.py``'s 32,000-token byte-fallback BPE (``--tokenizer DIR``
reuses one); the template is Qwen 2.5's (tests/data/templates), so the format is Hermes'
``<tool_call>``. Twenty tools, each with five parameters of every kind (a bounded string, an
integer, a number, an enum, an array of enums, a boolean).

* Per token, as ``bench_constraints.py`` times its schema: the processor alone (its call, and its
  matcher's advance), each mask computed when asked, along a greedy walk of random logits: under
  ``auto`` (the lazy grammar: free text, where a call may start at any token), under ``required``
  (the call itself, from the first token), and ``bench_constraints.py``'s schema beside them.
* Time to first token: a stories15M-sized random float32 model behind a real ``llama-chat serve``
  (``bench_serve.start_server``), one streamed request at a time, greedy, from sending to the
  first event that carries text or a call (the role's event comes before any token). In turns, per
  round: the chat without tools; the chat with the 20 tools (``tool_choice`` auto: the template
  describes them, the grammar is built, each choice's reply read for calls); and the same prompt
  as text on ``/v1/completions`` (the chat's rendering with the tools, so the same tokens are
  prefilled: what the tools cost beyond their words). Medians over ``--rounds``; the first request
  with the tools, which compiles the grammar, is timed alone. Target: the tools at most 1.2x the
  same prompt without them.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/bench_tools.py [--rounds 15] [--mask-steps 400] [--tokenizer DIR]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: idle OpenMP helpers sleep

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import torch  # noqa: E402

from bench_constraints import SCHEMA, VOCAB, mask_walk, train_vocabulary  # noqa: E402
from bench_serve import start_server, stop  # noqa: E402
from llama_chat.inference.tool_calls import ToolChoice, ToolRequest, make_tool  # noqa: E402
from llama_chat.inference.tool_formats import FORMATS, tool_grammar  # noqa: E402
from llama_chat.inference.types import stop_ids_of  # noqa: E402
from llama_chat.ml.constraints import Constraints  # noqa: E402
from llama_chat.ml.grammars import Constraint  # noqa: E402
from llama_chat.model.chat_format import HFTemplateChatFormat, Message  # noqa: E402
from llama_chat.model.tokenizers.hf import HFTokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "tests" / "data" / "templates" / "qwen2.5.jinja"
QUESTION = "Book a table for two in Paris tomorrow at eight, and tell me the weather."
TOOL_COUNT = 20


def tools(count: int = TOOL_COUNT) -> list[dict]:
    """``count`` tools of five parameters each."""
    out = []
    for i in range(count):
        parameters = {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 64, "description": "What to look up"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "score": {"type": "number"},
            "order": {"enum": ["asc", "desc"]},
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
            "exact": {"type": "boolean"}}, "required": ["query", "limit"]}
        out.append({"type": "function", "function": {"name": f"tool_{i:02d}",
                                                     "description": f"Tool number {i}: looks things up",
                                                     "parameters": parameters}})
    return out


def tool_request(choice: str) -> ToolRequest:
    made = tuple(make_tool(t["function"]["name"], t["function"]["description"], t["function"]["parameters"], "t",
                           t["function"]) for t in tools())
    return ToolRequest(made, ToolChoice(choice))


def write_model(folder: Path, vocabulary: Path) -> Path:
    """A stories15M-sized random Llama with the vocabulary and Qwen 2.5's template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes((vocabulary / "tokenizer.json").read_bytes())
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
              "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE.read_text()}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=288, intermediate_size=768,
                                         num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=6,
                                         max_position_embeddings=4096, tie_word_embeddings=False,
                                         bos_token_id=1, eos_token_id=2)).eval()
    with torch.no_grad():
        model.lm_head.weight[:3] = 0.0  # ids 0-2 never win: a reply runs to its max_tokens
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def mask_cost(constraints: Constraints, constraint: Constraint, steps: int) -> dict[str, float]:
    """Microseconds per token of the processor alone (``bench_constraints.mask_walk``)."""
    calls, advances = mask_walk(constraints, constraint, steps)
    return {"tokens": len(calls), "mask_us": statistics.median(calls) * 1e6,
            "advance_us": statistics.median(advances) * 1e6}


def first_token_s(url: str, route: str, body: dict, timeout: float = 120) -> float:
    """Seconds from sending a streamed request to its first event with text or a call (``timeout``:
    the longest silence, which a long prompt's prefill before the first event must fit in)."""
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}{route}", json={**body, "stream": True}, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice.get("delta", {})
            if choice.get("text") or delta.get("content") or delta.get("tool_calls"):
                return time.perf_counter() - start
    raise AssertionError(f"{route}: no token came")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--mask-steps", type=int, default=400)
    parser.add_argument("--tokenizer", type=Path, help="a directory with the vocabulary's tokenizer.json (made "
                                                       "there when missing)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    work = Path(tempfile.mkdtemp(prefix="bench-tools-"))
    vocabulary = args.tokenizer or work / "vocabulary"
    if not (vocabulary / "tokenizer.json").is_file():
        train_vocabulary(vocabulary)
    model_dir = write_model(work / "model", vocabulary)
    tokenizer = HFTokenizer(model_dir / "tokenizer.json")

    constraints = Constraints(tokenizer, stop_ids_of(tokenizer))
    start = time.perf_counter()
    auto = tool_grammar(FORMATS["hermes"], tool_request("auto"), tokenizer.special_tokens)
    constraints.compile(auto)
    compile_s = time.perf_counter() - start
    costs = {"tools, auto (free text)": mask_cost(constraints, auto, args.mask_steps),
             "tools, required (the call)": mask_cost(
                 constraints, tool_grammar(FORMATS["hermes"], tool_request("required"), tokenizer.special_tokens),
                 args.mask_steps),
             "bench_constraints' schema": mask_cost(constraints, Constraint.json_schema(SCHEMA), args.mask_steps)}
    for name, cost in costs.items():
        print(json.dumps({"per_token": name, **cost}), flush=True)

    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    chat_format = HFTemplateChatFormat(template, tokenizer, bos_token="<s>", eos_token="</s>")

    def settings(r: int) -> dict[str, tuple[str, dict]]:
        """Round ``r``'s requests: its own first words, so that no prompt finds another's pages."""
        messages = [{"role": "system", "content": f"Session {r}. You are a helpful assistant."},
                    {"role": "user", "content": QUESTION}]
        rendered = chat_format.render([Message(m["role"], m["content"]) for m in messages], tools=tools())
        chat = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0}
        return {"chat, no tools": ("/v1/chat/completions", chat),
                f"chat, {TOOL_COUNT} tools": ("/v1/chat/completions", {**chat, "tools": tools()}),
                "the same prompt, no tools": ("/v1/completions", {"model": "m", "prompt": rendered, "max_tokens": 4,
                                                                  "temperature": 0})}

    proc, url = start_server(str(model_dir), str(work))
    try:
        first_with_tools = first_token_s(url, *settings(-1)[f"chat, {TOOL_COUNT} tools"])
        first_token_s(url, *settings(-2)["chat, no tools"])  # the server's own first request, untimed
        names = list(settings(0))
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            requests = settings(r)
            for name in names[r % 3:] + names[:r % 3]:  # in turns: a slow moment lands on all
                times[name].append(first_token_s(url, *requests[name]))
        prompt_tokens = {name: httpx.post(f"{url}{route}", json={**body, "max_tokens": 1}, timeout=120).json()
                         ["usage"]["prompt_tokens"] for name, (route, body) in settings(-3).items()}
    finally:
        stop(proc)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(json.dumps({"ttft": name, "median_ms": value * 1e3, "prompt_tokens": prompt_tokens[name]}), flush=True)

    print(f"\nvocabulary of {VOCAB} (byte-fallback BPE), Qwen 2.5's template (hermes), {TOOL_COUNT} tools; "
          f"stories15M-sized random float32 model behind llama-chat serve; torch {torch.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, load average {load_before:.1f} before and "
          f"{os.getloadavg()[0]:.1f} after\n")
    print("| per token, the processor alone | tokens | mask µs (median) | advance µs (median) |")
    print("|---|---:|---:|---:|")
    for name, cost in costs.items():
        print(f"| {name} | {cost['tokens']} | {cost['mask_us']:.0f} | {cost['advance_us']:.0f} |")
    base = medians["the same prompt, no tools"]
    print(f"\n| time to first token, median of {args.rounds} | prompt tokens | ms | vs the same prompt |")
    print("|---|---:|---:|---:|")
    for name, value in medians.items():
        print(f"| {name} | {prompt_tokens[name]} | {value * 1e3:.1f} | {value / base:.2f} |")
    print(f"\nthe first request with the tools (grammar built and compiled): {first_with_tools * 1e3:.0f} ms; "
          f"the grammar alone, against the vocabulary: {compile_s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
