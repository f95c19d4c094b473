"""The default model's corpus: seeded stories and chat exchanges, written as JSON lines.

A document is a list of segments; the trainer wraps each segment in ``<s>`` ... ``</s>``. A story is
one segment; a conversation has one segment per turn, as in Llama 2's chat format. The same seed
always gives the same documents (one ``random.Random``, no set or dict iteration order involved).

    python scripts/default_model/corpus.py --seed 0 --docs 1000 --out /tmp/corpus
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from default_model import exchanges, stories  # noqa: E402

STORY_SHARE = 0.6  # the rest are chat exchanges
WORD = re.compile(r"[^\W\d_]+")


def documents(seed: int, count: int) -> Iterator[list[str]]:
    rng = random.Random(seed)
    for _ in range(count):
        if rng.random() < STORY_SHARE:
            yield [stories.story(rng)]
        else:
            yield exchanges.exchange(rng)


def words(text: str) -> list[str]:
    """The words of a text as the evaluation counts them: runs of letters, lower-cased."""
    return [w.lower() for w in WORD.findall(text)]


def write(seed: int, train_docs: int, val_docs: int, out_dir: Path) -> tuple[Path, Path]:
    """``train.jsonl`` and ``val.jsonl``; validation documents come from a different seed stream."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, sub_seed, count in (("train", seed, train_docs), ("val", seed + 1_000_003, val_docs)):
        path = out_dir / f"{name}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for doc in documents(sub_seed, count):
                f.write(json.dumps(doc, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def read(path: Path) -> Iterator[list[str]]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--val-docs", type=int, default=100)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    print(*write(a.seed, a.docs, a.val_docs, a.out), sep="\n")


if __name__ == "__main__":
    main()
