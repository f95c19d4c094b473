"""What is said after generation: the finish line and stats on stderr, or one JSON object on stdout."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, TextIO

from rich.console import Console
from rich.text import Text

from llama_chat.cmd.model_list import human_size
from llama_chat.inference.types import BeamCompletion, Completion

if TYPE_CHECKING:
    from llama_chat.model.loader import WeightsSummary


def _fmt(value: float | None, unit: str, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} {unit}"


def failure_line(e: BaseException) -> str:
    """The one line an unexpected failure is told in: a remote server's in its own words, any other
    with its kind first (a bare "division by zero" would say too little)."""
    from llama_chat.inference.remote import RemoteError

    message = str(e).splitlines()[0] if str(e) else ""
    if isinstance(e, RemoteError):
        return message
    return f"{type(e).__name__}{': ' + message if message else ''}"


def seed_to_report(seed: int, *, given: int | None, temperature: float) -> int | None:
    """The seed worth telling: the one the user gave, or the one drawn for a sampled run; None for
    a greedy run nobody seeded, whose tokens no seed changes."""
    if given is not None:
        return given
    return None if temperature == 0 else seed


def finish_line(completion: Completion, seed: int | None) -> Text:
    """``finish: REASON`` and the seed (when there is one to report: ``seed_to_report``)."""
    line = Text("finish: ", style="dim")
    line.append(completion.finish_reason.value, style="bold")
    if seed is not None:
        line.append(f"  seed: {seed}", style="dim")
    return line


def weights_text(weights: WeightsSummary) -> str:
    """``weights: Q4_K_M, packed q4_k+q6_k (668.0 MB)``: the matrices' form and the bytes they take;
    for a model whose layer the CPU's one-call step does not compute, what it lacks."""
    text = f"weights: {weights.format} ({human_size(weights.nbytes)})"
    if weights.operator_gaps:
        text += f"  step: the layers (the one-call step has no {', '.join(weights.operator_gaps)})"
    return text


def stats_line(completion: Completion, load_s: float | None = None, weights: WeightsSummary | None = None) -> Text:
    """Token counts and timings; ``load_s``: how long the model took to be ready (read, prepared,
    warmed up) before the prompt was timed, which the time to the first token does not include;
    ``weights``: what the model's weights are (``weights_text``)."""
    t = completion.timings
    load = f"load: {_fmt(load_s, 's', 2)}  " if load_s is not None else ""
    return Text(
        f"tokens: {completion.prompt_tokens} prompt, {completion.completion_tokens} generated"
        + (f" ({completion.reasoning_tokens} thinking)" if completion.reasoning_tokens else "") + "  "
        f"{load}ttft: {_fmt(t.ttft_s, 's', 3)}  prefill: {_fmt(t.prefill_tok_s, 'tok/s')}  "
        f"decode: {_fmt(t.decode_tok_s, 'tok/s')}" + drafts_text(completion)
        + (f"  prompt cache: {completion.disk_tokens} tokens from disk" if completion.disk_tokens else "")
        + (f"  {weights_text(weights)}" if weights is not None else ""),
        style="dim",
    )


def drafts_text(completion: Completion) -> str:
    """What prompt lookup or the draft model drafted and kept for a reply (speculative decoding), or nothing."""
    if completion.speculation is None:
        return ""
    drafted, accepted = completion.speculation
    return f"  drafts: {accepted} of {drafted} tokens kept"


def print_summary(err: Console, completion: Completion, seed: int | None, *, stats: bool,
                  load_s: float | None = None, weights: WeightsSummary | None = None) -> None:
    """The finish line (with the seed once, if any) and, with ``stats``, the stats line."""
    err.print(finish_line(completion, seed), highlight=False, soft_wrap=True)
    if stats:
        err.print(stats_line(completion, load_s, weights), highlight=False, soft_wrap=True)


def json_object(completion: Completion, *, seed: int | None, model: str) -> dict:
    return {
        "text": completion.text,
        **reasoning_fields(completion),
        "token_ids": list(completion.token_ids),
        "finish_reason": completion.finish_reason.value,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "seed": seed,
        "model": model,
        "timings": completion.timings.as_dict(),
        **({} if completion.speculation is None else
           {"speculation": dict(zip(("drafted_tokens", "accepted_tokens"), completion.speculation))}),
    }


def reasoning_fields(completion: Completion) -> dict:
    """A thinking model's thinking beside the text of a --json or --batch record; nothing for a
    reply that did not think."""
    if not completion.reasoning and not completion.reasoning_tokens:
        return {}
    return {"reasoning": completion.reasoning, "reasoning_tokens": completion.reasoning_tokens}


def write_json(out: TextIO, completion: Completion, *, seed: int | None, model: str) -> None:
    out.write(json.dumps(json_object(completion, seed=seed, model=model), ensure_ascii=False) + "\n")
    out.flush()


# -- beam search -------------------------------------------------------------------------------------


def beam_finish_line(completion: BeamCompletion, seed: int) -> Text:
    best = completion.best
    line = Text("finish: ", style="dim")
    line.append(best.finish_reason.value if best else "cancelled", style="bold")
    if best is not None:
        line.append(f"  score: {best.score:.4f}", style="dim")
    line.append(f"  beams returned: {len(completion.beams)}  seed: {seed}", style="dim")
    return line


def beam_stats_line(completion: BeamCompletion) -> Text:
    best = completion.best
    generated = len(best.token_ids) if best else 0
    return Text(f"tokens: {completion.prompt_tokens} prompt, {generated} in the best beam, {completion.steps} "
                f"steps  time: {completion.elapsed_s:.2f} s", style="dim")


def beam_json_object(completion: BeamCompletion, *, seed: int, model: str) -> dict:
    """The best beam's fields as for a plain answer, plus every returned beam with its score."""
    best = completion.best
    return {
        "text": best.text if best else "",
        "token_ids": list(best.token_ids) if best else [],
        "finish_reason": best.finish_reason.value if best else "cancelled",
        "score": best.score if best else None,
        "beams": [beam.as_dict() for beam in completion.beams],
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": len(best.token_ids) if best else 0,
        "seed": seed,
        "model": model,
        "timings": {"elapsed_s": completion.elapsed_s, "steps": completion.steps},
    }
