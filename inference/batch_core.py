"""The scheduler's step thread half: admission, the step's plan, what the step drew, release.

Everything here runs in the step worker thread, one ``step()`` per call; the event loop only
submits jobs, flags cancels and counts what consumers took (``jobs.Job``). A step:

1. releases the pages of jobs cancelled since the last step;
2. admits waiting jobs, first come first served, while a batch slot and enough pages are free:
   the pages of the longest cached prefix of the prompt are shared, and pages for the rest of the
   job (prompt and token budget) are reserved, so a running job never runs out of room;
3. plans the step's tokens: every job decoding gets its one token, then prompts fill the step's
   token budget in chunks;
4. hands the plan to one forward backend (``batch_step.py``), chosen for this plan, which feeds
   the tokens into the jobs' pages and draws a token for each job whose fed tokens reached the
   end of what it holds;
5. records what was fed and drawn: counters, full pages registered under their prefix key, a
   ``TokenEvent`` per drawn token, and the jobs that finished, whose pages are released.

A job decoding alone, with nothing else to do, skips 1 to 4: its lone backend gives its token
straight away, and only 5 remains (``BatchCore.step``).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

import torch

from llama_chat.inference.batch_step import Backend, CoreSettings, StepBackends, StepPlan, consecutive
from llama_chat.inference.draft_model import DraftRunner, guess_share
from llama_chat.inference.decode_step import LoneGraph
from llama_chat.inference.jobs import Draw, Job
from llama_chat.inference.page_table import PageTable, page_keys
from llama_chat.inference.prefill import PrefillSizer
from llama_chat.inference.speculative import DraftCosts, Lookup, ModelDraft, Speculation
from llama_chat.inference.types import GenerationState, TokenEvent, state_after
from llama_chat.ml.constraints import Constraints
from llama_chat.ml.processors import TokenHistory, make_controls
from llama_chat.ml.sampling import draw_uniforms
from llama_chat.model.formats.common import release_heap
from llama_chat.model.key_centers import KeyCenters
from llama_chat.model.paged_kv_cache import PagedKVCache
from llama_chat.model.prompt_cache import PromptCache
from llama_chat.model.transformer import Transformer

__all__ = ["BatchCore", "CoreSettings", "Counters", "StepResult"]

# Most time one step call spends on the steps of a job decoding alone (``BatchCore._alone_again``).
LONE_STEPS_S = 0.01


@dataclass
class Counters:
    """What the scheduler has done so far (read by the event loop for ``SchedulerStats``)."""

    submitted: int = 0
    finished: int = 0
    prefill_tokens: int = 0  # prompt tokens that went through a forward
    cached_tokens: int = 0  # prompt tokens whose pages were found in the cache
    generated_tokens: int = 0
    steps: int = 0
    mixed_steps: int = 0  # steps with both decodes and prompt chunks
    drafted_tokens: int = 0  # tokens drafted by prompt lookup or the draft model and verified (speculative.py)
    accepted_tokens: int = 0  # of those, the ones kept
    pages_peak: int = 0
    compactions: int = 0  # lone sequences moved onto consecutive pages
    disk_tokens: int = 0  # prompt tokens whose pages were read from the prompt cache on disk


@dataclass(frozen=True)
class StepResult:
    events: tuple[tuple[Job, TokenEvent], ...] = ()
    released: tuple[Job, ...] = ()
    idle: bool = False  # nothing could run: wait for a submit, a cancel or a consumer


class BatchCore:
    def __init__(self, model: Transformer, settings: CoreSettings, *, device: torch.device, dtype: torch.dtype,
                 token_bytes, sample_ids: int | None) -> None:
        self.model = model
        self.settings = settings
        self.device = device
        self.cache = PagedKVCache.for_model(model.args, settings.num_pages, settings.page_size,
                                            device=device, dtype=dtype)
        self.pages = PageTable(settings.num_pages, self.cache)
        self._serials = itertools.count(1)
        self.token_bytes = token_bytes
        self.sample_ids = sample_ids
        self.incoming: deque[Job] = deque()  # appended by the event loop, taken here
        self.waiting: list[Job] = []
        self.active: list[Job] = []
        self.claims: dict[bytes, Job] = {}  # prompt pages being prefilled, by prefix key
        self.counters = Counters()
        self.last_written: tuple[int, ...] = ()  # the tokens the last job released had in its pages
        self._lone_step: LoneGraph | None = None
        # Made at the first step, in the step thread: whether the CPU operator takes the model
        # depends on the thread's inference mode.
        self._backends: StepBackends | None = None
        self.sizer: PrefillSizer | None = None  # prompt chunks sized by time, if set (else prefill_chunk)
        self.constraints: Constraints | None = None  # compiles the jobs' structured output (set by the scheduler)
        self.speculation: Speculation | None = None  # how the scheduler drafts, if it does (speculative.py)
        # The draft model's pages and steps, made at its first draft, in the step thread (False:
        # its operator does not take it, and it never drafts).
        self._draft_runner: DraftRunner | None | bool = None
        self.draft_centers: KeyCenters | None = None  # the draft model's key measure, for q4_0 pages
        self.draft_costs = DraftCosts()  # what a drafted token costs here, timed as steps run
        self.prompt_cache: PromptCache | None = None  # full pages on disk, across processes (set by the scheduler)
        self._settled = True  # nothing held since the memory was last handed back (``_settle``)

    @property
    def draft_runner(self) -> DraftRunner | None:
        """The draft model's pages and steps, once a job has drafted with it."""
        return self._draft_runner or None

    @property
    def lone_step(self) -> LoneGraph | None:
        """The static step of a job running alone, if one was made (``decode_step.py``)."""
        return self._lone_step

    @lone_step.setter
    def lone_step(self, step: LoneGraph | None) -> None:
        self._lone_step = step
        self._backends = None  # made again, with it, at the next step

    # -- sizes -----------------------------------------------------------------------------------

    def pages_for(self, job_len: int) -> int:
        return -(-job_len // self.settings.page_size)

    def reserved_len(self, prompt_len: int, max_tokens: int | None) -> int:
        """Positions a job may ever write: its prompt and its budget, within the context."""
        total = self.settings.max_seq_len if max_tokens is None else prompt_len + max_tokens
        return min(total, self.settings.max_seq_len)

    # -- the step --------------------------------------------------------------------------------

    def prepare(self) -> StepBackends:
        """Make the steps' backends, and a draft model's runner, now (in inference mode), or at
        the first step. A caller that times its first request makes them before it: for a model of
        a few GB the operator's record of the weights takes seconds, which that request's first
        token would wait for."""
        with torch.inference_mode():
            if self._backends is None:
                self._backends = StepBackends.make(self.model, self.cache, self.settings, device=self.device,
                                                   sample_ids=self.sample_ids, lone=self._lone_step)
            if self.speculation is not None and self.speculation.draft is not None:
                self._runner()
        return self._backends

    def step(self) -> StepResult:
        """One call of the step thread: the steps of a job decoding alone, straight from its lone
        backend's token to its event (``_lone_job``); else one step of the plan, and those after
        it while a job decodes alone on the operator (``_step``).

        The short path skips what a batch needs and a lone job does not: admission, the plan and
        its lists, the backend's choice, the counters' loop over rows. Its pages were reserved at
        admission; a full page still gets its prefix key (``_fed``). A step for which prompt
        lookup finds a draft is planned as a batch's. It gives way the moment anything else asks
        for a step (``_alone_again``): the next call takes the plan.
        """
        # The scheduler's step thread is in inference mode already (its StepWorker's scope).
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return BatchCore.step(self)  # the method, not a wrapper a caller put on the instance
        job = self._lone_job()
        if job is None:
            return self._step()
        backends = self._backends
        token = backends.lone[job.draw].token
        drafting = job.lookup is not None and backends.verifies_drafts  # as the plan drafts
        drafts: list[tuple[Job, list[int]]] = []
        self.cache.drop_mirrors()  # rows fed past the packed forward's mirror
        events: list[tuple[Job, TokenEvent]] = []
        until = time.perf_counter() + LONE_STEPS_S
        while True:
            if drafting:
                drafts = self._drafts([job])
            if drafts:
                made, done = self._take(StepPlan([], [], False, drafts), backends)[1:]
            else:
                start = time.perf_counter()
                drawn = token(job)
                if self.speculation is not None:  # what a row costs, as the plan's steps time it
                    self.draft_costs.stepped(1, time.perf_counter() - start)
                self._fed(job)
                self.counters.steps += 1
                made, done = self._record(((job, drawn),))
            events += made
            if done:
                self._release(job)
                return StepResult(tuple(events), (job,))
            if not self._alone_again(until):
                return StepResult(tuple(events))

    def _lone_job(self) -> Job | None:
        """The one job, when it decodes alone with nothing else to do and its step needs no plan:
        nothing incoming, waiting or cancelled, no draft model, room in its channel, and a lone
        backend for how it draws (``StepBackends.lone``) that can read its pages as they are."""
        if len(self.active) != 1 or self.incoming or self.waiting or self._backends is None:
            return None
        job = self.active[0]
        lone = self._backends.lone.get(job.draw)
        if (lone is None or job.cancelled or job.model_draft is not None or len(job.tokens) - job.fed != 1
                or job.produced - job.received >= self.settings.buffer_size):
            return None
        return None if lone.wants_consecutive and not consecutive(job.pages) else job

    def _step(self) -> StepResult:
        released = [job for job in self.active if job.cancelled]
        for job in released:
            self._release(job)
        released += self._admit()
        backends = self._backends or self.prepare()
        events: list[tuple[Job, TokenEvent]] = []
        finished: list[Job] = []
        until = time.perf_counter() + LONE_STEPS_S
        while True:
            plan = self._plan(backends.step_tokens, backends.verifies_drafts)
            if not plan.rows and not plan.runs and not plan.drafts:
                if not self.active and not self.waiting and not self.incoming:
                    self._settle()
                return StepResult(tuple(events), tuple(released + finished), idle=not events)
            backend, made, done = self._take(plan, backends)
            events += made
            for job in done:
                self._release(job)
            finished += done
            if plan.runs or backend not in backends.operator or not self._alone_again(until):
                return StepResult(tuple(events), tuple(released + finished))

    def _take(self, plan: StepPlan, backends: StepBackends) -> tuple[Backend, list[tuple[Job, TokenEvent]], list[Job]]:
        """One step of ``plan``: the backend that took it, its events and the jobs it finished."""
        self._settled = False
        backend = backends.choose(plan)
        if backend.wants_consecutive and len(plan.rows) == 1 and not plan.runs:
            # Alone in this step and, with no prompt being prefilled, likely in the next ones.
            job = plan.rows[0]
            if not consecutive(job.pages):
                self._compact(job)
        start = time.perf_counter()
        jobs, tokens = backend.run(plan)
        took = time.perf_counter() - start
        if plan.runs:
            if self.sizer is not None:
                self.sizer.record(sum(n for _, n in plan.runs), took)
        elif self.speculation is not None:  # decoding rows alone: what a row costs
            self.draft_costs.stepped(len(plan.rows) + sum(len(d) + 1 for _, d in plan.drafts), took)
        self._advance(plan)
        return backend, *self._record(zip(jobs, tokens))

    def _alone_again(self, until: float) -> bool:
        """Whether this call goes on to the next step of a job decoding alone, for up to
        ``LONE_STEPS_S``, while nothing else asks for a step: a job arriving, a cancel, a full
        channel. The Python between two of a small model's steps, and the hand-off of each to the
        step thread and of its result to the event loop, were a visible share of its token
        (docs/batching.md, "A job alone"); a reader cannot see 10 ms, and a step longer than that
        is one a call as before."""
        if len(self.active) != 1 or self.incoming or self.waiting:
            return False
        job = self.active[0]
        return (not job.cancelled and job.produced - job.received < self.settings.buffer_size
                and time.perf_counter() < until)

    def _admit(self) -> list[Job]:
        if not self.incoming and not self.waiting:  # most steps: nothing to admit
            return []
        while self.incoming:
            self.waiting.append(self.incoming.popleft())
        dropped = [job for job in self.waiting if job.cancelled]
        self.waiting = [job for job in self.waiting if not job.cancelled]
        for job in dropped:
            job.finished = True
            job.final_state = GenerationState.CANCELLED
        size = self.settings.page_size
        still = []
        blocked = False
        for job in self.waiting:
            if blocked or len(self.active) >= self.settings.max_batch:
                still.append(job)
                continue
            prompt = job.request.prompt_ids
            # Full pages of the prompt that may be shared: at least one prompt token is fed again,
            # for its logits give the first new token.
            keys = page_keys(prompt[:len(prompt) - 1], size)
            hits = self.pages.lookup(keys)
            if len(hits) < len(keys) and keys[len(hits)] in self.claims:
                # Another job is prefilling the next page of this prefix now: wait for it rather
                # than compute it twice.
                still.append(job)
                continue
            need = self.pages_for(self.reserved_len(job.prompt_len, job.request.max_tokens)) - len(hits)
            evictable_hits = sum(1 for p in hits if self.pages.refs[p] == 0)
            if need > self.pages.available - evictable_hits:
                blocked = True  # first come, first served: later jobs do not overtake it
                still.append(job)
                continue
            self.pages.acquire(hits)
            # The pages that follow, where the disk has them, are read there instead of computed.
            read = self._from_disk(keys[len(hits):], most=need)
            hits += read
            # In ascending order: pages taken together are often a run of consecutive ones, and a
            # lone sequence on consecutive pages reads them as one slice (and may take the
            # static step, decode_step.py).
            job.pages = hits + sorted(self.pages.allocate(need - len(read)))
            job.keys = keys[:len(hits)]
            job.tokens = list(prompt)
            job.fed = job.cached_tokens = len(hits) * size
            job.disk_tokens = len(read) * size
            job.admitted = time.perf_counter()  # max_time counts from here, not from the queue
            job.serial = next(self._serials)
            job.claims = [k for k in keys[len(hits):] if k not in self.claims]
            for key in job.claims:
                self.claims[key] = job
            params = job.request.sampling
            self._drafters(job)
            if not params.greedy:
                job.uniforms = draw_uniforms(self.settings.max_seq_len, job.request.seed)
            if job.request.constraint is not None:
                assert self.constraints is not None, "a scheduler's core compiles constraints"
                job.constraint = self.constraints.processor(job.request.constraint,
                                                            extra_stop_ids=job.request.stop_ids)
            if not params.plain or job.constraint is not None:  # penalties, top-k, a schema ...: the processors
                job.controls = make_controls(params, eos_ids=job.stop_ids, constraint=job.constraint)
                job.history = TokenHistory([list(prompt)], vocab_size=self.sample_ids or self.model.args.vocab_size,
                                           device=self.device, window=params.repeat_last_n)
            if job.controls is None and job.request.logprobs is None:
                job.draw = Draw.GREEDY if params.greedy else Draw.SAMPLED
            self.counters.cached_tokens += job.cached_tokens
            self.active.append(job)
        self.waiting = still
        self.counters.pages_peak = max(self.counters.pages_peak, self.pages.in_use)
        return dropped

    def _plan(self, step_tokens: int, drafts_allowed: bool = False) -> StepPlan:
        """Every job decoding with room in its channel gets a row, or its last token and a draft
        where it has one (``_drafts``); then prompts fill what is left of ``step_tokens`` in
        chunks."""
        s = self.settings
        rows = [job for job in self.active
                if len(job.tokens) - job.fed == 1 and job.produced - job.received < s.buffer_size]
        drafts = self._drafts(rows) if drafts_allowed and self.speculation is not None else []
        if drafts:
            drafting = {id(job) for job, _ in drafts}
            rows = [job for job in rows if id(job) not in drafting]
        if len(rows) + len(drafts) == len(self.active):  # every job decoding, no prompt to chunk
            return StepPlan(rows, [], not drafts, drafts)
        decodes = len(rows)
        runs: list[tuple[Job, int]] = []
        budget = step_tokens - decodes
        chunk = s.prefill_chunk if self.sizer is None else self.sizer.next_size()
        for job in self.active:
            todo = len(job.tokens) - job.fed
            if todo <= 1 or budget <= 0:
                continue
            if todo <= chunk and job.produced - job.received >= s.buffer_size:
                continue  # this chunk would sample, and its consumer has no room
            n = min(todo, chunk, budget)
            if n == 1:
                rows.append(job)
            else:
                runs.append((job, n))
            budget -= n
        return StepPlan(rows, runs, not runs and not drafts and len(rows) == decodes, drafts)

    def _drafters(self, job: Job) -> None:
        """A new job's drafters, where drafts keep the reply the same: not under a grammar (its
        matchers follow the history one token at a time), nor where each token's logprobs are
        asked. Prompt lookup as the request or the scheduler says; the draft model where there is
        one and the request does not decline it."""
        s, request = self.speculation, job.request
        if s is None or not request.speculate or request.constraint is not None or request.logprobs is not None:
            return
        most = request.draft_max or s.draft_max
        if s.lookup if request.lookup is None else request.lookup:
            job.lookup = Lookup(most)
        if s.draft is not None and request.draft_model is not False:
            job.model_draft = ModelDraft(most)

    def _drafts(self, decoding: list[Job]) -> list[tuple[Job, list[int]]]:
        """The drafts of the decoding jobs that have one, while few jobs run: prompt lookup's
        (``speculative.Lookup``) where it finds one, else the draft model's (``_model_drafts``);
        a draft never runs past what the job may write. (A job's channel holds ``draft_max + 1``
        events beyond ``buffer_size``, the most a draft's step can add to one that had room for a
        row: ``Scheduler.submit``.)"""
        assert self.speculation is not None
        if len(self.active) > self.speculation.most_jobs:
            return []
        drafts = []
        asks: list[tuple[Job, int]] = []
        costs, jobs = self.draft_costs, len(decoding)
        for job in decoding:
            if job.lookup is None and job.model_draft is None:
                continue
            written = self.reserved_len(job.prompt_len, job.request.max_tokens)
            room = written - job.fed - 1
            if job.request.max_tokens is not None:
                room = min(room, job.prompt_len + job.request.max_tokens - len(job.tokens))
            draft = []
            if job.lookup is not None and costs.drafts_now(job.lookup, jobs):
                draft = job.lookup.draft(job.tokens, room, costs, jobs)
            if draft:
                job.lookup.pending = len(draft)
                job.drafting = job.lookup
                drafts.append((job, draft))
            elif job.model_draft is not None and costs.drafts_now(job.model_draft, jobs):
                runner = self._runner()
                if runner is None:
                    continue
                job.model_draft.pending_cost = costs.per_token(job.model_draft, jobs)
                # The draft model writes up to the position before its last guess.
                want = job.model_draft.want(min(room, runner.max_seq_len - len(job.tokens) + 1),
                                            costs.longest(job.model_draft, jobs))
                if want and runner.place(job.model_draft, written):
                    asks.append((job, want))
        return drafts + self._model_drafts(asks)

    def _model_drafts(self, asks: list[tuple[Job, int]]) -> list[tuple[Job, list[int]]]:
        """The draft model's guesses for ``(job, length)``, all jobs' steps together."""
        if not asks:
            return []
        runner = self._runner()
        assert runner is not None
        # Timed where no job has more than the token after its last draft to catch up on (a
        # first draft catches the draft model up on the prompt: its time says nothing of a guess).
        for job, _ in asks:
            job.model_draft.rollback(job.tokens)
        timed = all(len(job.tokens) - len(job.model_draft.written) <= 2 for job, _ in asks)
        start = time.perf_counter()
        guesses = runner.drafts([(job.model_draft, job.tokens, want) for job, want in asks])
        if timed and any(guesses):
            self.draft_costs.guessed(sum(map(len, guesses)), time.perf_counter() - start)
        for (job, _), guess in zip(asks, guesses):
            job.model_draft.pending = len(guess)
            job.drafting = job.model_draft
        return [(job, guess) for (job, _), guess in zip(asks, guesses)]

    def _runner(self) -> DraftRunner | None:
        """The draft model's runner, made once (``prepare``, or its first use), in inference mode."""
        if self._draft_runner is None:
            assert self.speculation is not None and self.speculation.draft is not None
            made = DraftRunner.make(self.speculation.draft, num_pages=self.settings.num_pages,
                                    page_size=self.settings.page_size, kv_type=self.cache.kv_type,
                                    centers=self.draft_centers,
                                    sample_ids=self.sample_ids)
            self._draft_runner = False if made is None else made
            self.draft_costs.guess_share_untimed = guess_share(self.speculation.draft, self.model)
        return self._draft_runner or None

    def _advance(self, plan: StepPlan) -> None:
        """What the plan fed is now in the pages: count it, and give full pages their prefix keys."""
        c = self.counters
        c.steps += 1
        c.mixed_steps += bool(plan.rows and plan.runs)
        for job in plan.rows:
            c.prefill_tokens += job.fed < job.prompt_len  # a prompt's last token, or one cut by the budget
            self._fed(job)
        for job, n in plan.runs:
            c.prefill_tokens += max(0, min(job.fed + n, job.prompt_len) - job.fed)
            job.fed += n
            self._register(job)

    def _fed(self, job: Job) -> None:
        """One more token of ``job`` is in its pages: a page it filled gets its prefix key."""
        job.fed += 1
        if job.fed // self.settings.page_size > len(job.keys):
            self._register(job)

    def _record(self, sampled) -> tuple[list[tuple[Job, TokenEvent]], list[Job]]:
        """The events of ``(job, token)`` pairs (jobs None skipped; a job that fed a draft has the
        tuple of the tokens it keeps), and the jobs they finished."""
        s, c = self.settings, self.counters
        events: list[tuple[Job, TokenEvent]] = []
        finished: list[Job] = []
        now = time.perf_counter()
        for job, drawn in sampled:
            if job is None:
                continue
            kept = drawn if isinstance(drawn, tuple) else (drawn,)
            for token in kept:
                index = len(job.tokens) - job.prompt_len
                job.tokens.append(token)
                state = state_after(token, index=index, request=job.request, stop_ids=job.stop_ids,
                                    max_seq_len=s.max_seq_len, elapsed_s=now - job.admitted,
                                    grammar_done=job.constraint is not None and job.constraint.stopped(0))
                data = b"" if token in job.stop_ids else self.token_bytes(token)
                events.append((job, TokenEvent(job.request_id, index, token, data, state, now - job.submitted,
                                               job.drawn_logprobs)))
                job.produced += 1
                c.generated_tokens += 1
                if isinstance(drawn, tuple):
                    job.fed += 1  # the token before this one, fed in the draft's row, holds its keys
                if state.finished:
                    job.finished = True
                    finished.append(job)
                    break
            if isinstance(drawn, tuple):
                self._register(job)
                accepted = len(kept) - 1  # the last token kept is the draw where the draft ended
                pace = job.drafting
                pace.taken(pace.pending, accepted, pace.pending_cost)
                self.draft_costs.kept(pace, pace.pending, accepted)
                c.drafted_tokens += pace.pending
                c.accepted_tokens += accepted
        return events, finished

    def _compact(self, job: Job) -> bool:
        """Move a sequence running alone onto consecutive pages, if a run of free ones is there.

        Its keys then read as one slice of the pool (no gather of its pages every layer) and it
        may take the compiled lone step. Pages become scattered when a job starts on a cached
        prefix whose pages lie elsewhere, or when evictions leave the free list in pieces; the
        copy is a few pages once, the gather was every step. A page the job alone held takes its
        prefix key along to the copy; a shared one stays where it is for the others.
        """
        run = self.pages.take_free_run(len(job.pages))
        if run is None:
            return False
        written = -(-job.fed // self.settings.page_size)  # pages holding keys so far
        self.cache.copy_pages(job.pages[:written], run[:written])
        for old, new in zip(job.pages, run):
            if self.pages.refs[old] == 1:
                self.pages.move_key(old, new)
        self.pages.release(job.pages)
        job.pages = run
        self.counters.compactions += 1
        return True

    def _register(self, job: Job) -> None:
        full = job.fed // self.settings.page_size
        if full <= len(job.keys):
            return
        previous = job.keys[-1] if job.keys else b""
        new = page_keys(job.tokens[:full * self.settings.page_size], self.settings.page_size,
                        start=len(job.keys), previous=previous)
        for i, key in enumerate(new, start=len(job.keys)):
            self.pages.register(job.pages[i], key)
            if self.claims.get(key) is job:
                del self.claims[key]
            if self.prompt_cache is not None and not self.prompt_cache.has(key):
                # Copied now: once released, the page may be written over before the disk has it.
                self.prompt_cache.write(key, self.cache.page_payload(job.pages[i]))
        job.keys.extend(new)

    def _from_disk(self, keys: list[bytes], most: int) -> list[int]:
        """Pages for the first of ``keys`` (at most ``most``) that the prompt cache has on disk,
        read into pages of the pool and registered under their keys (each held once, by the job
        being admitted); up to the first it lacks, or whose block is not good, or that another
        job is prefilling now."""
        if self.prompt_cache is None:
            return []
        read: list[int] = []
        for key in keys[:most]:
            if key in self.claims:
                break
            payload = self.prompt_cache.read(key)
            if payload is None:
                break
            page = self.pages.allocate(1)[0]
            self.cache.load_page(page, payload)
            self.pages.register(page, key)
            read.append(page)
        self.counters.disk_tokens += len(read) * self.settings.page_size
        return read

    def abandon(self, state: GenerationState = GenerationState.CANCELLED) -> None:
        """Drop every job, running or waiting, and release its pages: the scheduler has stopped,
        cancelled or failed (``state`` is what a job still open ends as). Only when no step can
        run (the step thread has finished its block)."""
        while self.incoming:
            self.waiting.append(self.incoming.popleft())
        for job in self.waiting:
            job.finished = True
            job.final_state = job.final_state or state
        self.waiting = []
        for job in list(self.active):
            if not job.finished:
                job.finished = True
                job.final_state = job.final_state or state
            self._release(job)

    def _settle(self) -> None:
        """Once no job is left: the buffers a burst of jobs grew (gathered pages, mirrors) go,
        and the C heap hands its free memory back, so that memory falls back to where it was at
        rest. The written pages the pool keeps for the next prompts' prefixes stay."""
        if self._settled:
            return
        self._settled = True
        self.cache.drop_buffers()
        release_heap()

    def _release(self, job: Job) -> None:
        self.last_written = tuple(job.tokens[:job.fed])
        self.pages.release(job.pages)
        job.pages = []
        for key in job.claims:
            if self.claims.get(key) is job:
                del self.claims[key]
        job.claims = []
        if job.model_draft is not None and job.model_draft.pages and self._draft_runner:
            self._draft_runner.release(job.model_draft)
        # Its processors go with its last step: the history and a schema's matchers (megabytes of
        # native memory) refer to each other, and the cycle collector, blind to that memory, could
        # leave them for long.
        job.controls = job.history = job.constraint = None
        self.active.remove(job)
        self.counters.finished += 1
        if not job.finished:
            job.finished = True
            job.final_state = GenerationState.CANCELLED
