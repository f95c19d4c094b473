"""The scheduler's step thread half: admission, one packed forward for every active job, sampling.

Everything here runs in the step worker thread, one ``step()`` per call; the event loop only
submits jobs, flags cancels and counts what consumers took (``jobs.Job``). A step:

1. releases the pages of jobs cancelled since the last step;
2. admits waiting jobs, first come first served, while a batch slot and enough pages are free:
   the pages of the longest cached prefix of the prompt are shared, and pages for the rest of the
   job (prompt and token budget) are reserved, so a running job never runs out of room;
3. plans the step's tokens: every job decoding gets its one token, then prompts fill the step's
   token budget in chunks;
4. runs one forward over all of them packed into one row, with attention over each job's pages;
5. samples one token for each job whose fed tokens reached the end of what it holds, and makes a
   ``TokenEvent`` of it; full pages are registered under their prefix key as they fill.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from llama_chat.inference.jobs import Job
from llama_chat.inference.page_table import PageTable, page_keys
from llama_chat.inference.paged_step import LoneRowStep
from llama_chat.inference.prefill import PrefillSizer
from llama_chat.inference.types import GenerationState, TokenEvent, state_after
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml.processors import TokenHistory, make_sampler
from llama_chat.ml.sampling import draw_uniforms, sample
from llama_chat.model import cpu_decode
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedBatch, PagedKVCache
from llama_chat.model.transformer import Transformer


@dataclass(frozen=True)
class CoreSettings:
    max_batch: int
    num_pages: int
    page_size: int
    prefill_chunk: int  # most prompt tokens of one job in one step (the first, with a sizer)
    step_tokens: int  # most tokens in one step, all jobs together
    buffer_size: int  # most events of a job not yet taken by its consumer
    static_shapes: bool  # pad one-token rows and tables to fixed sizes (for a compiled step)
    max_seq_len: int


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
    pages_peak: int = 0
    compactions: int = 0  # lone sequences moved onto consecutive pages


@dataclass(frozen=True)
class StepResult:
    events: tuple[tuple[Job, TokenEvent], ...] = ()
    released: tuple[Job, ...] = ()
    idle: bool = False  # nothing could run: wait for a submit, a cancel or a consumer


# Most tokens in a one-call CPU step that feeds prompt chunks (``BatchCore._prompts_in_one_call``),
# or twice the batch: the operator cannot stop between layers for a cancel as the model's forward
# does, so such a step stays as long as a few decode steps (for the largest model whose panels are
# made, some 270M parameters, about 0.2 s on two cores).
ONE_CALL_PROMPT_ROWS = 32


def _consecutive(pages: list[int]) -> bool:
    return pages == list(range(pages[0], pages[0] + len(pages))) if pages else False


def _bucket(n: int) -> int:
    """The next power of two: few distinct shapes for a compiled step, at most twice the work."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class _Packed:
    """One step's tokens as the packed forward takes them (host lists, made tensors there)."""

    tokens: list[int]
    positions: list[int]
    slots: list[int]
    singles: int  # the first ``singles`` tokens are one-token rows
    single_tables: list[list[int]] | None
    runs: tuple[tuple[int, int, torch.Tensor, int], ...]
    single_kv_len: int | None
    first_page: int | None
    sampled_rows: list[int]
    single_key: tuple | None = None  # see PagedBatch
    mirror_slots: list[int] | None = None


@dataclass
class _Plan:
    singles: list[Job] = field(default_factory=list)
    runs: list[tuple[Job, int]] = field(default_factory=list)


class BatchCore:
    def __init__(self, model: Transformer, settings: CoreSettings, *, device: torch.device, dtype: torch.dtype,
                 token_bytes, sample_ids: int | None) -> None:
        self.model = model
        self.settings = settings
        self.device = device
        self.cache = PagedKVCache.for_model(model.args, settings.num_pages, settings.page_size,
                                            device=device, dtype=dtype)
        self.pages = PageTable(settings.num_pages)
        self._serials = itertools.count(1)
        self.token_bytes = token_bytes
        self.sample_ids = sample_ids
        self.incoming: deque[Job] = deque()  # appended by the event loop, taken here
        self.waiting: list[Job] = []
        self.active: list[Job] = []
        self.claims: dict[bytes, Job] = {}  # prompt pages being prefilled, by prefix key
        self.counters = Counters()
        self.last_written: tuple[int, ...] = ()  # the tokens the last job released had in its pages
        self.lone_step: LoneRowStep | None = None  # a compiled step for a lone sequence, if one was made
        self._one_call_ok: bool | None = None  # whether one-token steps take the one-call CPU step
        self._rows_decoder: cpu_decode.RowsDecoder | None = None
        self.sizer: PrefillSizer | None = None  # prompt chunks sized by time, if set (else prefill_chunk)

    # -- sizes -----------------------------------------------------------------------------------

    def pages_for(self, job_len: int) -> int:
        return -(-job_len // self.settings.page_size)

    def reserved_len(self, prompt_len: int, max_tokens: int | None) -> int:
        """Positions a job may ever write: its prompt and its budget, within the context."""
        total = self.settings.max_seq_len if max_tokens is None else prompt_len + max_tokens
        return min(total, self.settings.max_seq_len)

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> StepResult:
        # The scheduler's step thread is in inference mode already (its StepWorker's scope).
        if torch.is_inference_mode_enabled():
            return self._step()
        with torch.inference_mode():
            return self._step()

    def _step(self) -> StepResult:
        released = [job for job in self.active if job.cancelled]
        for job in released:
            self._release(job)
        released += self._admit()
        lone = self._lone_greedy()
        if lone is not None:
            events, finished = self._run_lone(lone)
        else:
            plan = self._plan()
            if not plan.singles and not plan.runs:
                return StepResult(released=tuple(released), idle=True)
            start = time.perf_counter()
            if self._decodes_in_one_call(plan):
                events, finished = self._run_decodes(plan.singles)
            else:
                events, finished = self._run(plan)
            if self.sizer is not None and plan.runs:
                self.sizer.record(sum(n for _, n in plan.runs), time.perf_counter() - start)
        for job in finished:
            self._release(job)
        return StepResult(tuple(events), tuple(released + finished))

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
            # In ascending order: pages taken together are often a run of consecutive ones, and a
            # lone sequence on consecutive pages reads them as one slice (and may take the
            # compiled step, paged_step.py).
            job.pages = hits + sorted(self.pages.allocate(need))
            job.keys = keys[:len(hits)]
            job.tokens = list(prompt)
            job.fed = job.cached_tokens = len(hits) * size
            job.admitted = time.perf_counter()  # max_time counts from here, not from the queue
            job.serial = next(self._serials)
            job.claims = [k for k in keys[len(hits):] if k not in self.claims]
            for key in job.claims:
                self.claims[key] = job
            params = job.request.sampling
            if not params.greedy:
                job.uniforms = draw_uniforms(self.settings.max_seq_len, job.request.seed)
            if not params.plain:  # penalties, top-k, min-p ...: the processors, with the job's history
                job.controls = make_sampler(params, eos_ids=job.stop_ids)
                job.history = TokenHistory([list(prompt)], vocab_size=self.sample_ids or self.model.args.vocab_size,
                                           device=self.device, window=params.repeat_last_n)
            self.counters.cached_tokens += job.cached_tokens
            self.active.append(job)
        self.waiting = still
        self.counters.pages_peak = max(self.counters.pages_peak, self.pages.in_use)
        return dropped

    def _plan(self) -> _Plan:
        s = self.settings
        plan = _Plan()
        budget = s.step_tokens
        if self._prompts_in_one_call():
            budget = min(budget, max(ONE_CALL_PROMPT_ROWS, 2 * s.max_batch))
        chunk = s.prefill_chunk if self.sizer is None else self.sizer.next_size()
        for job in self.active:
            if len(job.tokens) - job.fed == 1 and job.produced - job.received < s.buffer_size:
                plan.singles.append(job)
                budget -= 1
        for job in self.active:
            todo = len(job.tokens) - job.fed
            if todo <= 1 or budget <= 0:
                continue
            if todo <= chunk and job.produced - job.received >= s.buffer_size:
                continue  # this chunk would sample, and its consumer has no room
            n = min(todo, chunk, budget)
            if n == 1:
                plan.singles.append(job)
            else:
                plan.runs.append((job, n))
            budget -= n
        return plan

    def _run(self, plan: _Plan) -> tuple[list[tuple[Job, TokenEvent]], list[Job]]:
        s = self.settings
        size = s.page_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sampled_rows: list[int] = []  # token index of each row whose logits are taken
        sampled_jobs: list[Job | None] = []

        def feed(job: Job, n: int) -> None:
            for pos in range(job.fed, job.fed + n):
                tokens.append(job.tokens[pos])
                positions.append(pos)
                slots.append(job.pages[pos // size] * size + pos % size)

        singles = plan.singles
        single_tables: list[list[int]] | None = None
        first_page = None  # a lone one-token row's first page, when its pages are consecutive
        # Several one-token rows on the CPU read their keys from a mirror of their gathered pages
        # (PagedKVCache.mirror), named by the rows and their whole block tables, which then stay
        # the same from one step to the next. Any other step feeds rows past the mirror: drop it.
        # One-token rows alone in a step go to our one-call CPU step (model/cpu_decode.py), which
        # reads each row's pages through its block table itself; unless a compiled step for a lone
        # row was asked for.
        # Prompt chunks join them as rows, a token a row, where ``_prompts_in_one_call``.
        prompts_in_one_call = bool(plan.runs) and self._prompts_in_one_call()
        one_call = prompts_in_one_call or (bool(singles) and not plan.runs and not s.static_shapes
                                           and self._one_call() and (self.lone_step is None or len(singles) > 1))
        run_width = max(((job.fed + n - 1) // size + 1 for job, n in plan.runs), default=0) if one_call else 0
        mirrored = self.device.type == "cpu" and not s.static_shapes and len(singles) > 1 and not one_call
        single_key = mirror_slots = None
        if not mirrored:
            self.cache.drop_mirrors()
        if singles:
            widths = [len(job.pages) if mirrored else job.fed // size + 1 for job in singles]
            width = max(*widths, run_width)
            rows = len(singles)
            if mirrored:
                single_key = tuple((job.serial, tuple(job.pages)) for job in singles)
                mirror_slots = [r * width * size + job.fed for r, job in enumerate(singles)]
            if s.static_shapes:
                width, rows = _bucket(width), _bucket(rows)
            table = []
            for job in singles:
                if job.fed + 1 == len(job.tokens):  # else a prompt's chunk cut to one token by the budget
                    sampled_rows.append(len(tokens))
                    sampled_jobs.append(job)
                feed(job, 1)
                used = job.pages if mirrored else job.pages[:job.fed // size + 1]
                table.append(used + [SCRATCH_PAGE] * (width - len(used)))
            for _ in range(rows - len(singles)):  # padding rows: scratch page, position 0, ignored
                sampled_rows.append(len(tokens))
                sampled_jobs.append(None)
                tokens.append(0)
                positions.append(0)
                slots.append(SCRATCH_PAGE * size)
                table.append([SCRATCH_PAGE] * width)
            single_tables = table
            if len(table) == 1 and not s.static_shapes and not one_call:
                # Alone in this step and, with no prompt being prefilled, likely in the next ones.
                if not plan.runs and not _consecutive(singles[0].pages) and self._compact(singles[0]):
                    table = single_tables = [singles[0].pages[:len(table[0])]]
                    slots[-1] = singles[0].pages[positions[-1] // size] * size + positions[-1] % size
                used = table[0]
                if _consecutive(used):
                    first_page = used[0]
        n_singles = len(tokens)
        runs = []
        row_tables = list(single_tables or [])  # every row's, for the one-call step
        row_width = width if singles else run_width
        for job, n in plan.runs:
            first = len(tokens)
            feed(job, n)
            if one_call:
                used = job.pages[:self.pages_for(job.fed + n)]
                row_tables += [used + [SCRATCH_PAGE] * (row_width - len(used))] * n
            else:
                runs.append((first, n, torch.tensor(job.pages[:self.pages_for(job.fed + n)], dtype=torch.long),
                             job.fed))
            if job.fed + n == len(job.tokens):
                sampled_rows.append(len(tokens) - 1)
                sampled_jobs.append(job)

        logits = picks = None
        lone = singles[0] if len(singles) == 1 and not plan.runs and first_page is not None else None
        if self.lone_step is not None and lone is not None and sampled_jobs == [lone] and lone.controls is None:
            logits = self.lone_step.logits(tokens[0], positions[0], first_page)
        if logits is None and one_call:
            # Only the rows that draw a token need logits: not a prompt's chunk before its last
            # token, nor a prompt cut to one token short of its end.
            logits, picks = self._rows_decoder.with_picks(tokens, positions, row_tables, self.sample_ids,
                                                          sampled_rows)
        if logits is None:
            kv_len = None if s.static_shapes or not singles else max(job.fed for job in singles) + 1
            logits = self._packed_forward(_Packed(tokens, positions, slots, n_singles, single_tables, tuple(runs),
                                                  kv_len, first_page, sampled_rows, single_key, mirror_slots))
        chosen = self._sample(logits, sampled_jobs, picks) if sampled_rows else []

        # Bookkeeping: what was fed is now in the pages; full pages get their prefix keys.
        c = self.counters
        c.steps += 1
        c.mixed_steps += bool(plan.singles and plan.runs)
        for job, n in [(job, 1) for job in singles] + plan.runs:
            c.prefill_tokens += max(0, min(job.fed + n, job.prompt_len) - job.fed)
            job.fed += n
            self._register(job)
        return self._record(zip(sampled_jobs, chosen))

    def _decodes_in_one_call(self, plan: _Plan) -> bool:
        """Whether the step is the batch's common one: several jobs, each feeding its last token
        to draw the next, no prompt chunk, through the one-call CPU step (``_run_decodes``)."""
        return (not plan.runs and len(plan.singles) > 1 and not self.settings.static_shapes and self._one_call()
                and all(len(job.tokens) - job.fed == 1 for job in plan.singles))

    def _run_decodes(self, jobs: list[Job]) -> tuple[list[tuple[Job, TokenEvent]], list[Job]]:
        """``_run`` of a plan of ``jobs`` decoding, without the lists other plans need: those cost
        a 16-job step 30-50 us more of Python, 1-1.5 % of it (stories15M-sized model, 2-core Xeon)."""
        size = self.settings.page_size
        self.cache.drop_mirrors()  # fed without them (``_run``)
        positions = [job.fed for job in jobs]
        tokens = [job.tokens[-1] for job in jobs]
        width = max(positions) // size + 1
        # A job's pages past its position are its own, reserved, and never read: a table is its
        # pages, cut or padded to the width.
        tables = [job.pages[:width] if len(job.pages) >= width
                  else job.pages + [SCRATCH_PAGE] * (width - len(job.pages)) for job in jobs]
        logits, picks = self._rows_decoder.with_picks(tokens, positions, tables, self.sample_ids)
        chosen = self._sample(logits, jobs, picks)
        c = self.counters
        c.steps += 1
        for job in jobs:
            c.prefill_tokens += job.fed < job.prompt_len  # a prompt's last token, fed now
            job.fed += 1
            if job.fed // size > len(job.keys):
                self._register(job)
        return self._record(zip(jobs, chosen))

    def _lone_greedy(self) -> Job | None:
        """The one job running, when all this step does is decode its next token greedily through
        the one-call CPU step: a chat's turn, a job left alone at a batch's end."""
        if len(self.active) != 1 or self.settings.static_shapes or self.lone_step is not None:
            return None
        job = self.active[0]
        if (len(job.tokens) - job.fed != 1 or job.produced - job.received >= self.settings.buffer_size
                or job.controls is not None or not job.request.sampling.greedy or not self._one_call()):
            return None
        return job

    def _run_lone(self, job: Job) -> tuple[list[tuple[Job, TokenEvent]], list[Job]]:
        """``_run`` of a plan of ``job`` alone, without the plan: that spent 45 us of Python a step
        on one row, 3 % of a stories15M-sized token."""
        size, position = self.settings.page_size, job.fed
        self.cache.drop_mirrors()  # fed without them (``_run``)
        token = self._rows_decoder.pick(job.tokens[position], position, job.pages[:position // size + 1],
                                        self.sample_ids)
        c = self.counters
        c.steps += 1
        c.prefill_tokens += max(0, min(position + 1, job.prompt_len) - position)
        job.fed += 1
        self._register(job)
        return self._record(((job, token),))

    def _record(self, sampled) -> tuple[list[tuple[Job, TokenEvent]], list[Job]]:
        """The events of ``(job, token)`` pairs (jobs None skipped), and the jobs they finished."""
        s, c = self.settings, self.counters
        events: list[tuple[Job, TokenEvent]] = []
        finished: list[Job] = []
        now = time.perf_counter()
        for job, token in sampled:
            if job is None:
                continue
            index = len(job.tokens) - job.prompt_len
            job.tokens.append(token)
            state = state_after(token, index=index, request=job.request, stop_ids=job.stop_ids,
                                max_seq_len=s.max_seq_len, elapsed_s=now - job.admitted)
            data = b"" if token in job.stop_ids else self.token_bytes(token)
            events.append((job, TokenEvent(job.request_id, index, token, data, state, now - job.submitted)))
            job.produced += 1
            c.generated_tokens += 1
            if state.finished:
                job.finished = True
                finished.append(job)
        return events, finished

    def _prompts_in_one_call(self) -> bool:
        """Whether prompt chunks go to the one-call CPU step as rows, a token a row, beside the
        decodes: where a batch's steps read panels (a chat's scheduler of one job keeps the
        model's forward, and builds no panels for it). 16 prompts of 8 tokens were prefilled in
        11 ms instead of the forward's 48 (stories15M-sized model, 2-core Xeon)."""
        s = self.settings
        return s.max_batch > 1 and not s.static_shapes and self._one_call() and self._rows_decoder.packs_several

    def _one_call(self) -> bool:
        if self._one_call_ok is None:
            self._one_call_ok = self.device.type == "cpu" and cpu_decode.takes_rows(self.model, self.cache)
            if self._one_call_ok:
                self._rows_decoder = cpu_decode.RowsDecoder(self.model, self.cache)
        return self._one_call_ok

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

    def _packed_forward(self, step: _Packed) -> torch.Tensor:
        """The step's tokens packed into one row over the paged cache: logits of its sampled rows."""
        device = self.device
        put = (lambda t: t.to(device, non_blocking=True)) if device.type != "cpu" else (lambda t: t)

        def tensor(values) -> torch.Tensor:
            return put(torch.tensor(values, dtype=torch.long))

        batch = PagedBatch(tensor(step.slots), tensor(step.positions), step.singles,
                           None if step.single_tables is None else tensor(step.single_tables),
                           tuple((f, n, put(t), start) for f, n, t, start in step.runs),
                           step.single_kv_len, step.first_page, step.single_key,
                           None if step.mirror_slots is None else tensor(step.mirror_slots))
        # A step of prompt chunks only takes no logits at all (``(1, 0, vocab)``).
        return self.model(tensor(step.tokens).view(1, -1), batch.positions.view(1, -1), self.cache.view(batch),
                          logits_at=tensor(step.sampled_rows))[0]

    def _sample(self, logits: torch.Tensor, jobs: list[Job | None], picks: torch.Tensor | None = None) -> list[int]:
        """One token per row: argmax for greedy rows, the job's own settings and seed otherwise.

        ``picks``: the rows' argmax where the step made them already (the one-call CPU step).
        Only the first ``sample_ids`` logits are candidates. The token after position ``p`` is
        drawn with the job's uniform ``p``, as the one-request engine does, so a seeded job picks
        the same tokens batched or alone.
        """
        if picks is None:
            picks = cpu_kernels.argmax(logits[:, :self.sample_ids])
        for i, job in enumerate(jobs):
            if job is None or (job.controls is None and job.request.sampling.greedy):
                continue
            row, params = logits[i:i + 1, :self.sample_ids], job.request.sampling
            if job.controls is not None:
                row, params = job.controls.prepare(job.history, row)
            if params.greedy:
                picks[i] = row.argmax(dim=-1)[0]
            else:
                last = len(job.tokens) - 1
                assert job.uniforms is not None
                picks[i] = sample(row, params, job.uniforms[last:last + 1])[0]
        chosen = picks.tolist()  # the one value that crosses back to the host per step
        for job, token in zip(jobs, chosen):
            if job is not None and job.history is not None:
                job.history.append([token])
        return chosen

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
        job.keys.extend(new)

    def abandon(self) -> None:
        """Drop every job, running or waiting, and release its pages: the scheduler has stopped.
        Only when no step can run (the step thread has finished its block)."""
        while self.incoming:
            self.waiting.append(self.incoming.popleft())
        for job in self.waiting:
            job.finished = True
            job.final_state = job.final_state or GenerationState.CANCELLED
        self.waiting = []
        for job in list(self.active):
            self._release(job)

    def _release(self, job: Job) -> None:
        self.last_written = tuple(job.tokens[:job.fed])
        self.pages.release(job.pages)
        job.pages = []
        for key in job.claims:
            if self.claims.get(key) is job:
                del self.claims[key]
        job.claims = []
        self.active.remove(job)
        self.counters.finished += 1
        if not job.finished:
            job.finished = True
            job.final_state = GenerationState.CANCELLED
