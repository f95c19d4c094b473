"""Beam search with transformers' semantics, one forward of ``num_beams`` rows per step.

Scores are sums of log-probabilities after the logits processors (which see each beam's own
history, so a repetition penalty applies per beam, as in transformers). At each step the
``keep = max(2, 1 + n_eos) * num_beams`` best continuations over all beams are taken (or drawn
without replacement, when sampling: ``sampling.draw_distinct``, with ``keep`` uniforms a step from
the request's seed, so a seeded search draws the same on every device); those of them that end
(an end-of-sequence token, the token budget, the context, the clock) and rank among the first
``num_beams`` become finished hypotheses scored ``sum / length ** length_penalty``, where
``length`` counts generated tokens including the end token; the best ``num_beams`` of the rest
go on. The KV cache has one row per beam and is reordered after each step. The search ends by
``early_stopping``: ``True`` as soon as ``num_beams`` hypotheses have finished; ``False`` when the
best running beam, scored at its current length, cannot beat the worst finished one; ``"never"``
when it cannot even at the longest length allowed (with a positive length penalty).

``BeamSearch`` is blocking: ``prefill`` a chunk at a time, then ``step`` until it returns False,
each call one forward. ``beam_run`` drives it in a step worker thread of its own, so a cancel
lands between two calls; it needs only a ``BeamModel`` (what the scheduler serving the request
knows of its model), and its cache is its own, one row per beam: the caller's pages
or cache and what it records as cached are left as they were. ``result`` gives the best
``num_return`` hypotheses.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import torch

from llama_chat.inference.decoding import stop_cut
from llama_chat.inference.step_worker import StepWorker
from llama_chat.inference.types import BeamCompletion, BeamText, DamagedScores, GenerationState, Request
from llama_chat.ml.constraints import GrammarMask
from llama_chat.ml.controls import BeamParams, SamplingParams
from llama_chat.ml.processors import TokenHistory, make_logits_processors, make_warpers
from llama_chat.ml.sampling import Uniforms, draw_distinct, finite_best
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.transformer import Transformer

# transformers' stand-in for "impossible": added to scores to take a candidate out of a ranking.
_OUT = -1.0e9


@dataclass(frozen=True)
class Beam:
    """One returned hypothesis: its generated ids (the end token included), its score
    (``sum of log-probs / length ** length_penalty``, transformers' ``sequences_scores``) and why
    it ended."""

    token_ids: tuple[int, ...]
    score: float
    finish_reason: GenerationState


@dataclass(frozen=True)
class BeamProgress:
    """After a step: how far the search is, for a progress line."""

    step: int  # tokens generated per beam so far
    finished: int  # hypotheses finished so far (at most num_beams)
    num_beams: int
    elapsed_s: float


@dataclass(frozen=True)
class BeamLimits:
    """Where every hypothesis ends at the latest: ``max_new`` tokens (the reason given then),
    ``max_time`` seconds after ``start`` (a ``time.perf_counter`` value)."""

    max_new: int
    at_max_new: GenerationState
    start: float
    max_time: float | None = None


class BeamSearch:
    def __init__(self, model: Transformer, prompt: Sequence[int], params: SamplingParams, beams: BeamParams, *,
                 limits: BeamLimits, stop_ids: Iterable[int], seed: int, vocab: int,
                 device: torch.device, dtype: torch.dtype, constraint: GrammarMask | None = None) -> None:
        self.model = model
        self.prompt = list(prompt)
        self.params, self.beams, self.limits = params, beams, limits
        self.stop_ids = frozenset(stop_ids)
        self.vocab = vocab
        self.device = device
        n = beams.num_beams
        self.cache = KVCache.for_model(model.args, n, max_seq_len=len(self.prompt) + limits.max_new,
                                       device=device, dtype=dtype)
        self.history = TokenHistory([self.prompt] * n, vocab_size=vocab, device=device, window=params.repeat_last_n)
        # A constraint's matchers follow the history's rows: beams that fork copy them.
        self.constraint = constraint
        self.processors = make_logits_processors(params, eos_ids=self.stop_ids, constraint=constraint)
        # Beam sampling keeps one id more than there are end tokens, so a beam can always go on.
        self.warpers = make_warpers(params, min_keep=1 + len(self.stop_ids))
        self.keep = max(2, 1 + len(self.stop_ids)) * n
        self.uniforms = Uniforms(seed) if not params.greedy else None
        self.fed = 0  # prompt tokens prefilled (into row 0)
        self.length = 0  # tokens generated per running beam
        self.running_scores = torch.full((n,), _OUT, device=device)
        self.running_scores[0] = 0.0  # every beam starts as the prompt: count it once
        self.finished_scores = torch.full((n,), _OUT, device=device)
        self.finished_tokens: list[tuple[int, ...]] = [()] * n
        self.finished_reasons: list[GenerationState] = [GenerationState.CANCELLED] * n
        self.finished = torch.zeros(n, dtype=torch.bool, device=device)
        self.improvable = True  # transformers' "early stop heuristic unsatisfied"
        self.done = False
        self._logits: torch.Tensor | None = None  # the next step's logits, one row per beam

    # -- the calls ---------------------------------------------------------------------------------

    def prefill(self, chunk: int) -> bool:
        """Prefill up to ``chunk`` more prompt tokens into row 0; False when the prompt is in."""
        with torch.inference_mode():
            end = min(self.fed + chunk, len(self.prompt))
            tokens = torch.tensor([self.prompt[self.fed:end]], device=self.device)
            positions = torch.arange(self.fed, end, device=self.device).unsqueeze(0)
            logits = self.model(tokens, positions, self.cache, last_only=True)[:, -1, :self.vocab]
            self.fed = end
            if end < len(self.prompt):
                return True
            # Every beam starts from the prompt: its keys and values go to every row.
            self.cache.reorder([0] * self.beams.num_beams, length=end)
            self._logits = logits.expand(self.beams.num_beams, -1)
            return False

    def step(self) -> bool:
        """Choose the next token of every beam, then run the forward for the step after; False
        when the search is over."""
        if self.done:
            return False
        with torch.inference_mode():
            self._choose()
            if not self.done:
                last = [row[-1] for row in self.history.tokens]
                position = len(self.prompt) + self.length - 1
                tokens = torch.tensor(last, device=self.device).unsqueeze(1)
                positions = torch.full((len(last), 1), position, device=self.device)
                self._logits = self.model(tokens, positions, self.cache, last_only=True)[:, -1, :self.vocab]
        return not self.done

    def progress(self) -> BeamProgress:
        return BeamProgress(self.length, int(self.finished.sum()), self.beams.num_beams,
                            time.perf_counter() - self.limits.start)

    def result(self) -> list[Beam]:
        """The best ``num_return`` hypotheses, best first. Cut short (a cancel), the running beams
        stand in for hypotheses not finished, scored as if they ended now, and end ``cancelled``."""
        scores = self.finished_scores.tolist()
        tokens, reasons = list(self.finished_tokens), list(self.finished_reasons)
        if not self.done and self.length > 0:
            penalty = self.length ** self.beams.length_penalty
            for b, score in enumerate(self.running_scores.tolist()):
                if score > _OUT / 2:
                    scores.append(score / penalty)
                    tokens.append(tuple(self.history.tokens[b][len(self.prompt):]))
                    reasons.append(GenerationState.CANCELLED)
        order = sorted((i for i, s in enumerate(scores) if s > _OUT / 2 and tokens[i]), key=lambda i: -scores[i])
        return [Beam(tokens[i], scores[i], reasons[i]) for i in order[:self.beams.num_return]]

    # -- one step of the search --------------------------------------------------------------------

    def _choose(self) -> None:
        n, beams = self.beams.num_beams, self.beams
        log_probs = torch.log_softmax(self._logits.float(), dim=-1)
        for processor in self.processors:
            log_probs = processor(self.history, log_probs)
        for warper in self.warpers:
            log_probs = warper(self.history, log_probs)
        total = (log_probs + self.running_scores[:, None]).view(-1)
        if self.uniforms is not None:
            if not bool(finite_best(total[None])[0]):  # no draw from them means anything
                raise DamagedScores()
            candidates = draw_distinct(total[None], self.uniforms.take(self.keep, self.device)[None])[0]
            scores = total[candidates]
        else:
            scores, candidates = torch.topk(total, self.keep)
        sources, ids = candidates // self.vocab, candidates % self.vocab

        ends = self._ends(ids.tolist(), sources.tolist())
        hits = torch.tensor([e is not None for e in ends], device=self.device)
        new_length = self.length + 1

        # The best candidates that go on become the running beams.
        going_on = scores + hits.float() * _OUT
        order = torch.topk(going_on, n).indices
        # Candidates that ended and rank among the first num_beams compete for a finished slot.
        finishing = scores / (new_length ** beams.length_penalty)
        if beams.early_stopping is True and bool(self.finished.all()):
            finishing = finishing + _OUT
        if not self.improvable:
            finishing = finishing + _OUT
        eligible = hits & (torch.arange(self.keep, device=self.device) < n)
        finishing = finishing + (~eligible).float() * _OUT
        merged = torch.cat([self.finished_scores, finishing])
        best = torch.topk(merged, n).indices.tolist()
        src_list, id_list = sources.tolist(), ids.tolist()
        old_tokens, old_reasons, old_finished = self.finished_tokens, self.finished_reasons, self.finished.tolist()
        generated = [row[len(self.prompt):] for row in self.history.tokens]
        new_tokens, new_reasons, new_finished = [], [], []
        for j in best:
            if j < n:
                new_tokens.append(old_tokens[j]), new_reasons.append(old_reasons[j])
                new_finished.append(old_finished[j])
            else:
                c = j - n
                new_tokens.append((*generated[src_list[c]], id_list[c]))
                new_reasons.append(ends[c] or GenerationState.CANCELLED)
                new_finished.append(bool(eligible[c]))
        self.finished_scores = merged[best]
        self.finished_tokens, self.finished_reasons = new_tokens, new_reasons
        self.finished = torch.tensor(new_finished, dtype=torch.bool, device=self.device)

        # The running beams take their sources' cache rows and histories, plus their new token.
        chosen = order.tolist()
        beam_sources = [src_list[c] for c in chosen]
        self.running_scores = going_on[order]
        self.cache.reorder(beam_sources, length=len(self.prompt) + self.length)
        self.history.reorder(beam_sources)
        self.history.append([id_list[c] for c in chosen])
        self.length = new_length

        self._update_improvable()
        all_finished_and_enough = bool(self.finished.all()) and beams.early_stopping is True
        self.done = not self.improvable or all_finished_and_enough or bool(hits.all())

    def _ends(self, ids: list[int], sources: list[int]) -> list[GenerationState | None]:
        """Why each candidate token (``ids[c]`` after beam ``sources[c]``) would end its
        hypothesis, or None."""
        limits = self.limits
        if self.length + 1 >= limits.max_new:
            everyone: GenerationState | None = limits.at_max_new
        elif limits.max_time is not None and time.perf_counter() - limits.start >= limits.max_time:
            everyone = GenerationState.MAX_TIME
        else:
            everyone = None
        grammar = self.constraint
        return [GenerationState.EOS if i in self.stop_ids
                else GenerationState.STOP_GRAMMAR if grammar is not None and grammar.would_stop(s, i)
                else everyone for i, s in zip(ids, sources)]

    def _update_improvable(self) -> None:
        """Whether the best running beam might still beat the worst finished hypothesis."""
        lp = self.beams.length_penalty
        if self.beams.early_stopping == "never" and lp > 0.0:
            best_length = self.limits.max_new
        else:
            best_length = self.length
        best_possible = float(self.running_scores[0]) / (best_length ** lp)
        if not bool(self.finished.all()):
            return  # an empty slot: anything that finishes is better than nothing
        self.improvable = self.improvable and best_possible > float(self.finished_scores.min())


@dataclass(frozen=True)
class BeamModel:
    """What a beam search needs of the scheduler whose model it runs."""

    model: Transformer
    max_seq_len: int
    vocab: int  # ids below this are candidates
    device: torch.device
    dtype: torch.dtype
    stop_ids: frozenset[int]
    token_bytes: Callable[[int], bytes]  # b"" for stop tokens
    strips_leading_space: bool  # the tokenizer's word-start space, taken off a chat reply
    prefill_chunk: Callable[[], int]  # prompt tokens per prefill call, asked before each
    constraint_for: Callable[[Request], GrammarMask | None]  # the request's structured output, if any
    report_every_s: float = 0.02


@asynccontextmanager
async def beam_run(source: BeamModel, request: Request) -> AsyncIterator[BeamRun]:
    """``async with beam_run(source, req) as run: async for progress in run: ...``, then
    ``run.completion()``: beam search (``request.beams``), not streamed, one forward per call in
    a step worker thread of its own."""
    async with StepWorker(report_every_s=source.report_every_s) as worker:
        yield BeamRun(source, request, worker)


class BeamRun:
    """One beam search: iterate for ``BeamProgress`` after each step; ``completion`` at the end
    (or after a cancel: the best hypotheses so far, the unfinished ones ``cancelled``)."""

    def __init__(self, source: BeamModel, request: Request, worker: StepWorker) -> None:
        self.source, self.request, self.worker = source, request, worker
        room = source.max_seq_len - len(request.prompt_ids)
        budget = request.max_tokens
        limits = BeamLimits(min(budget, room) if budget is not None else room,
                            GenerationState.MAX_TOKENS if budget is not None and budget <= room
                            else GenerationState.CONTEXT_FULL,
                            time.perf_counter(), request.max_time)
        self.search = BeamSearch(source.model, request.prompt_ids, request.sampling, request.beams, limits=limits,
                                 stop_ids=source.stop_ids, seed=request.seed, vocab=source.vocab,
                                 device=source.device, dtype=source.dtype, constraint=source.constraint_for(request))
        self._prefilled = False

    def __aiter__(self) -> BeamRun:
        return self

    async def __anext__(self) -> BeamProgress:
        search, worker = self.search, self.worker
        while not self._prefilled:
            more = await worker.result(worker.submit(search.prefill, self.source.prefill_chunk()))
            self._prefilled = not more
        if search.done:
            raise StopAsyncIteration
        await worker.result(worker.submit(search.step))
        return search.progress()

    def completion(self) -> BeamCompletion:
        source, request = self.source, self.request
        beams = []
        for beam in self.search.result():
            data = b"".join(source.token_bytes(t) for t in beam.token_ids)
            text = data.decode("utf-8", errors="replace")
            reason = beam.finish_reason
            # Stop strings cut each hypothesis after the search (they are not part of its score).
            cut = stop_cut(text, request.stop)
            if cut is not None:
                text, reason = text[:cut], GenerationState.STOP_STRING
            if request.chat_reply and source.strips_leading_space:
                text = text.removeprefix(" ")
            beams.append(BeamText(text, beam.token_ids, beam.score, reason))
        progress = self.search.progress()
        return BeamCompletion(request.request_id, tuple(beams), len(request.prompt_ids), progress.step,
                              progress.elapsed_s)


__all__ = ["Beam", "BeamLimits", "BeamModel", "BeamProgress", "BeamRun", "BeamSearch", "beam_run"]
