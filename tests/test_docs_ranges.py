"""The ranges docs/usage.md gives the generation controls are the ones the options table checks
(``ml/controls.RULES``): each documented bound is probed on the rule, inside and just outside."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from llama_chat.ml.controls import RULES, SERVER_RULES

USAGE = Path(__file__).resolve().parent.parent / "docs" / "usage.md"
# Hugging Face names in the docs' table whose rule has another name.
RULE_OF = {"max_new_tokens": "max_tokens", "num_return_sequences": "num_return"}
BOUND = r"(-?[0-9.]+(?:\*\*[0-9]+)?)"
BETWEEN = re.compile(rf"^{BOUND} (<=?) [A-Z]+ (<=?) {BOUND}$")
ABOVE = re.compile(rf"^[A-Z]+ (>=?) {BOUND}$")


def documented() -> dict[str, str]:
    """Rule name -> the range the Generation controls table gives (without its default)."""
    text = USAGE.read_text()
    table = text[text.index("| option | Hugging Face name |"):]
    found = {}
    for row in table.splitlines()[2:]:
        if not row.startswith("|"):
            break
        cells = [c.strip() for c in row.strip("|").split("|")]
        name = re.search(r"`(\w+)`", cells[1]) or re.search(r"`--([\w-]+)", cells[0])
        rule = RULE_OF.get(name.group(1), name.group(1).replace("-", "_"))
        if rule in RULES:
            found[rule] = re.sub(r" \(.*\)$", "", cells[3])
    return found


def value(bound: str) -> float:
    """A bound as written (2**64 too), exact where it is a whole number."""
    base, _, power = bound.partition("**")
    number = float(base) if "." in base else int(base)
    return number ** int(power) if power else number


def probes(kind: type, bound: float, inclusive: bool, below: bool) -> list[tuple[float, bool]]:
    """Values on and just past ``bound``, with whether each is in the range. ``below``: the range
    lies below the bound (an upper one)."""
    step = 1 if kind is int else max(abs(bound) * 1e-9, 1e-9)
    past = bound + step if below else bound - step
    inside = bound - step if below else bound + step
    return [(bound, inclusive), (past, False), (inside, True)]


def test_every_ranged_control_in_the_table_is_documented():
    assert {"temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "repetition_penalty", "num_beams",
            "length_penalty", "max_time", "max_tokens"} <= set(documented())


@pytest.mark.parametrize("name", sorted(n for n, text in documented().items() if BETWEEN.match(text) or ABOVE.match(text)))
def test_the_documented_range_is_the_rules(name):
    rule, text = RULES[name], documented()[name]
    if m := BETWEEN.match(text):
        low, low_op, high_op, high = m.groups()
        cases = probes(rule.kind, value(low), low_op == "<=", below=False) + \
            probes(rule.kind, value(high) - (1 if high_op == "<" else 0), True, below=True)
    elif m := ABOVE.match(text):
        op, low = m.groups()
        cases = probes(rule.kind, value(low), op == ">=", below=False) + [(rule.kind(10**6), True)]
    else:
        raise AssertionError(f"{name}: {text!r}")
    for probe, allowed in cases:
        probe = rule.kind(probe) if rule.kind is int else probe
        assert rule.test(probe) is allowed, f"{name}: docs say {text!r}; the rule says {rule.test(probe)} for {probe}"


SERVER_DOCS = {
    # (file, a pattern whose two groups are the documented least and most, the rule)
    "top_logprobs": (r"`top_logprobs`[^0-9`]*\(?(\d+) to (\d+)", ("usage.md", "serve.md")),
    "logprobs": (r"completion's `logprobs` \((\d+) to (\d+)\)", ("usage.md", "serve.md")),
    "n": (r"\| `n` \| choices per prompt, (\d+) to (\d+)", ("serve.md",)),
}


@pytest.mark.parametrize("name", sorted(SERVER_DOCS))
def test_the_servers_documented_ranges_are_its_rules(name):
    pattern, files = SERVER_DOCS[name]
    rule = SERVER_RULES[name]
    for file in files:
        found = re.search(pattern, (USAGE.parent / file).read_text())
        assert found, f"{file} does not give {name}'s range"
        least, most = map(int, found.groups())
        assert rule.test(least) and rule.test(most) and not rule.test(least - 1) and not rule.test(most + 1), \
            f"{file}: {name} {least} to {most}; the rule allows {rule.allowed}"
