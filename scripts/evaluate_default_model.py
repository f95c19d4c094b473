"""Judge the default model the way a user meets it: sampled stories through the real engine.

    python scripts/evaluate_default_model.py [--model DIR] [--json out.json]

Prompts go through the command line's own path (``load_model``, the model's chat format via
``cmd.prompt.prompt_ids``, ``Scheduler.stream``, whose responses carry the text), at
temperature 0.8 and top-p 0.95, one fixed seed per sample. Reported:

(a) words: the share of generated words (runs of letters) that are words of the training corpus;
(b) mentions: the share of "Tell me a story about X" answers that name X's species;
(c) emoji: the share of outputs with at least one emoji that arrived whole: a known emoji sequence of
    the corpus, no U+FFFD anywhere, and no streaming commit that ended inside it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from default_model import corpus, vocabulary
from default_model.tokenizer import is_emoji_char
from llama_chat.cmd.prompt import prompt_ids
from llama_chat.inference.scheduler import Scheduler, SchedulerOptions
from llama_chat.inference.types import Request
from llama_chat.ml.sampling import SamplingParams
from llama_chat.model.loader import default_model_dir, load_model

SEED = 0  # the corpus seed the shipped model was trained with
TRAIN_DOCS = 40_000
SAMPLES = 50
MAX_TOKENS = 320
STORY_PROMPT = "Once upon a time"


@dataclass
class Sample:
    prompt: str
    seed: int
    text: str = ""
    chunks: list[str] = field(default_factory=list)
    tokens: int = 0
    byte_tokens: int = 0
    finish: str = ""
    subject: str | None = None  # the X of "Tell me a story about X": its species word


def known_emoji() -> set[str]:
    """Every emoji sequence the corpus uses (what a whole emoji in the output must be one of)."""
    pools = [e for _, e in vocabulary.CREATURES] + [e for _, e in vocabulary.PLACES]
    pools += [e for _, e, _ in vocabulary.CITIES] + [e for _, e in vocabulary.FOODS]
    pools += [e for _, e in vocabulary.OBJECTS] + [e for _, e in vocabulary.WEATHER]
    pools += vocabulary.WAVES + vocabulary.HEARTS + vocabulary.FAMILIES + ["🎂", "🎁", "🌙", "⭐", "☀️", "🌈"]
    return {e for e in pools if e}


def emoji_spans(text: str) -> list[tuple[int, int]]:
    """Maximal runs of emoji characters (symbols, joiners, selectors, modifiers) as (start, end)."""
    spans, i = [], 0
    while i < len(text):
        if is_emoji_char(text[i]):
            j = i
            while j < len(text) and is_emoji_char(text[j]):
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def whole_emoji(sample: Sample, known: set[str]) -> list[str]:
    """The emoji of ``sample`` that are known sequences and that no streamed chunk cut in two."""
    if "\ufffd" in sample.text:
        return []
    cuts, pos = set(), 0
    for chunk in sample.chunks:
        pos += len(chunk)
        cuts.add(pos)
    whole = []
    for start, end in emoji_spans(sample.text):
        run = sample.text[start:end]
        if run in known and not any(start < c < end for c in cuts):
            whole.append(run)
    return whole


async def run(engine: Scheduler, loaded, sample: Sample, temperature: float) -> None:
    ids = prompt_ids(sample.prompt, system=None, tokenizer=loaded.tokenizer, chat_format=loaded.chat_format)
    request = Request(ids, sampling=SamplingParams(temperature=temperature, top_p=0.95), seed=sample.seed,
                      max_tokens=MAX_TOKENS)
    async with engine.stream(request) as events:
        async for event in events:
            sample.tokens += 1
            piece = loaded.tokenizer.token_bytes(event.token_id)
            sample.byte_tokens += len(piece) == 1 and piece[0] >= 0x80
            if event.text:
                sample.chunks.append(event.text)
            sample.finish = str(event.state)
    sample.text = "".join(sample.chunks)


def build_samples(n: int) -> list[Sample]:
    rng = random.Random(1234)
    species = rng.sample([s for s, _ in vocabulary.CREATURES], n)
    stories = [Sample(STORY_PROMPT, seed=1 + i) for i in range(n)]
    requests = [Sample(f"Tell me a story about {'an' if s[0] in 'aeiou' else 'a'} {s}", seed=1001 + i, subject=s)
                for i, s in enumerate(species)]
    return stories + requests


def hero_sentence(text: str) -> str:
    """The story's first sentence, where its hero is introduced."""
    return re.split(r"(?<=[.!?])\s+", text.strip(), maxsplit=1)[0]


def report(samples: list[Sample], vocab: set[str], known: set[str], seconds: float) -> dict:
    words = [w for s in samples for w in corpus.words(s.text)]
    unknown = sorted({w for w in words if w not in vocab})
    in_vocab = sum(w in vocab for w in words)
    requests = [s for s in samples if s.subject]
    mentioned = [s for s in requests if s.subject in corpus.words(s.text)]
    heroes = [s for s in requests if s.subject in corpus.words(hero_sentence(s.text))]
    with_emoji = [s for s in samples if emoji_spans(s.text)]
    whole = [s for s in samples if whole_emoji(s, known)]
    return {
        "samples": len(samples),
        "words": {"in_corpus": in_vocab, "total": len(words), "fraction": in_vocab / max(1, len(words)),
                  "unknown": unknown[:40]},
        "mentions": {"mentioned": len(mentioned), "requests": len(requests),
                     "fraction": len(mentioned) / max(1, len(requests)),
                     "missed": [s.subject for s in requests if s not in mentioned],
                     "hero_is_x": len(heroes)},
        "emoji": {"whole": len(whole), "with_any_emoji": len(with_emoji), "outputs": len(samples),
                  "fraction": len(whole) / len(samples),
                  "broken": sum("\ufffd" in s.text for s in samples)},
        "byte_tokens": sum(s.byte_tokens for s in samples),
        "tokens": sum(s.tokens for s in samples),
        "finish": {r: sum(s.finish == r for s in samples) for r in sorted({s.finish for s in samples})},
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--json", type=Path, default=None, help="also write the report and every output here")
    ap.add_argument("--samples", type=int, default=SAMPLES, help="of each kind (quick checks use fewer)")
    ap.add_argument("--show", type=int, default=3, help="print this many outputs of each kind")
    a = ap.parse_args()

    import torch

    torch.set_num_threads(2)
    vocab = {w for doc in corpus.documents(SEED, TRAIN_DOCS) for seg in doc for w in corpus.words(seg)}
    known = known_emoji()
    loaded = load_model(a.model or default_model_dir(), device="cpu")
    engine = Scheduler.from_loaded(loaded, SchedulerOptions(max_batch=1))
    samples = build_samples(a.samples)
    t0 = time.perf_counter()
    for s in samples:
        anyio.run(run, engine, loaded, s, a.temperature)
    result = report(samples, vocab, known, time.perf_counter() - t0)

    w, m, e = result["words"], result["mentions"], result["emoji"]
    print(f"model: {loaded.path}  temperature {a.temperature}  top_p 0.95  max_tokens {MAX_TOKENS}")
    print(f"(a) words in corpus vocabulary: {w['in_corpus']}/{w['total']} = {w['fraction']:.4f}  (target >= 0.97)")
    print(f"(b) requests that mention X:    {m['mentioned']}/{m['requests']} = {m['fraction']:.2f}  (target >= 0.8)")
    print(f"    (stricter: the story's first sentence names X in {m['hero_is_x']}/{m['requests']})")
    print(f"(c) outputs with a whole emoji: {e['whole']}/{e['outputs']} = {e['fraction']:.2f}  (target >= 0.2)")
    print(f"    outputs with any emoji {e['with_any_emoji']}, with U+FFFD {e['broken']}; "
          f"byte tokens generated {result['byte_tokens']} of {result['tokens']} tokens")
    print(f"    finish reasons {result['finish']}; unknown words {w['unknown']}; missed {m['missed']}")
    print(f"    generation time {result['seconds']} s")
    for s in samples[:a.show] + samples[a.samples:a.samples + a.show]:
        print(f"\n--- {s.prompt!r} seed {s.seed}\n{s.text}")
    if a.json:
        result["outputs"] = [{"prompt": s.prompt, "seed": s.seed, "text": s.text} for s in samples]
        a.json.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    ok = w["fraction"] >= 0.97 and m["fraction"] >= 0.8 and e["fraction"] >= 0.2
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
