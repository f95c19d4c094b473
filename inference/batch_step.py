"""The forward backends of the scheduler's step, behind one call.

``BatchCore`` (batch_core.py) decides what a step feeds: a ``StepPlan`` of one-token rows and
prompt chunks. A backend's ``run(plan)`` feeds those tokens, writing their keys and values into
their jobs' pages, and returns the token drawn by each row that reached the end of what its job
holds. The backends:

- ``PackedForward``: the model's forward, every token packed into one row over the paged cache
  (the GPU's step, and the CPU's where the operator below does not apply);
- ``OperatorRows``: one call of our CPU operator (``model/cpu_decode.py``), a token a row, prompt
  chunks beside the decodes;
- ``OperatorDecodes``: the same call for the batch's common step, every row decoding, laid out
  without the lists the other plans need;
- ``LoneGreedy``: one row decoding greedily, its token picked inside the operator;
- ``LoneSampled``: one row decoding with temperature and top-p alone, through the operator;
- ``GraphedLone``: one row on consecutive pages through the static step of ``decode_step.py``
  (compiled, and on CUDA a CUDA graph, the next step queued before the token is read); the
  packed forward where its window does not fit;
- ``BucketedDecodes``: one-token rows through their batch bucket's compiled graph
  (``bucket_step.py``), with static shapes.

``StepBackends.make`` builds them once and fixes which one takes each kind of step (``Kind``): a
step looks its kind up, and nothing is chosen again. The three lone ones (``LoneStep``) also give
a job's next token with no plan at all (``token``), for a job decoding alone (``BatchCore.step``).
Nothing here decides who runs or which pages they hold, nor counts what ran: the core does.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from llama_chat.inference.bucket_step import BucketSteps
from llama_chat.inference.decode_step import LoneGraph
from llama_chat.inference.jobs import Draw, Job
from llama_chat.inference.types import DamagedScores, TokenLogprobs
from llama_chat.ml.cpu import kernels as cpu_kernels
from llama_chat.ml import sampling
from llama_chat.ml.sampling import choose, finite_best
from llama_chat.model import cpu_decode
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedBatch, PagedKVCache
from llama_chat.model.transformer import Transformer

# Most tokens in an operator step that feeds prompt chunks, or twice the batch: the operator
# cannot stop between layers for a cancel as the model's forward does, so such a step is kept as
# long as a few decode steps (docs/batching.md, "Inside one step").
ONE_CALL_PROMPT_ROWS = 32


@dataclass(slots=True)
class StepPlan:
    """What one step feeds: ``rows``, jobs feeding one token (the decodes, then any prompt cut to
    one token by the step's budget), ``runs``, prompt chunks of several tokens, and ``drafts``,
    jobs feeding their last token and a draft of the next ones (``speculative.py``), every one of
    those rows drawn from."""

    rows: list[Job]
    runs: list[tuple[Job, int]]
    decodes_only: bool  # no runs, and every row feeds its job's last token: each row draws one
    drafts: list[tuple[Job, list[int]]] = field(default_factory=list)


@dataclass(frozen=True)
class CoreSettings:
    """How a scheduler's core batches (made by ``Scheduler``; read by the core and its backends)."""

    max_batch: int
    num_pages: int
    page_size: int
    prefill_chunk: int  # most prompt tokens of one job in one step (the first, with a sizer)
    step_tokens: int  # most tokens in one step, all jobs together
    buffer_size: int  # most events of a job not yet taken by its consumer
    static_shapes: bool  # pad one-token rows and tables to fixed sizes (for a compiled step)
    max_seq_len: int
    # The torch.compile backend and mode of the decode steps' graphs per batch bucket
    # (``bucket_step.py``), with static shapes; None: those steps stay the packed forward's.
    bucket_graphs: tuple[str, str | None] | None = None


# The jobs whose rows drew a token (None: a padding row) and the tokens, in the same order; a job
# that fed a draft has the tuple of the tokens it keeps (``verify``).
Drawn = tuple[Sequence[Job | None], list[int | tuple[int, ...]]]


class Backend(Protocol):
    # Whether a lone row reads its pages as one slice when they are consecutive: the core then
    # moves a job running alone onto consecutive pages (``BatchCore._compact``).
    wants_consecutive: bool

    def run(self, plan: StepPlan) -> Drawn: ...


class LoneStep(Backend, Protocol):
    """A backend of one row decoding, which also takes the row's job with no plan around it."""

    def token(self, job: Job) -> int:
        """The token after ``job``'s last, fed at ``job.fed`` (the mirrors dropped already)."""
        ...


def consecutive(pages: list[int]) -> bool:
    return pages == list(range(pages[0], pages[0] + len(pages))) if pages else False


def _bucket(n: int) -> int:
    """The next power of two: few distinct shapes for a compiled step, at most twice the work."""
    return 1 << max(0, (n - 1).bit_length())


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """``token``'s log-probability under one row's ``logits`` (before any processor: what the model
    said, ``TokenLogprobs``), and the ``top`` most likely ids with theirs, most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    pairs: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
        pairs = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(float(logprobs[token]), pairs)


# The one row sampler (ml/sampling.py), with this layer's logprobs record and error.
sample_rows = partial(sampling.sample_rows, logprobs=token_logprobs, damaged=DamagedScores)


def verify(logits: torch.Tensor, picks: torch.Tensor | None, job: Job, draft: list[int],
           sample_ids: int | None) -> tuple[int, ...]:
    """What a job keeps of its ``draft``: ``logits`` are its rows' (its last token's, then each
    drafted token's), ``picks`` their greedy picks where the step made them. Row ``i`` is drawn
    from as the job's next token would be without a draft (the one sampler, the uniform of its
    position, the controls over the history so far); the draft is kept while it agrees, and the
    token drawn where it first does not (or after its end) is kept too."""
    start = len(job.tokens) - 1  # the position of the job's last token, row 0
    params = job.request.sampling
    plain_greedy = job.controls is None and params.greedy
    if plain_greedy and picks is None:
        picks = cpu_kernels.argmax(logits[:, :sample_ids])
    damaged = ~finite_best(logits[:, :sample_ids], picks)
    kept: list[int] = []
    for i in range(len(draft) + 1):
        if bool(damaged[i]):
            raise DamagedScores()
        if plain_greedy:
            token = int(picks[i])
        else:
            uniform = None if job.uniforms is None else job.uniforms[start + i:start + i + 1]
            token = int(choose(logits[i:i + 1, :sample_ids], params, uniform, controls=job.controls,
                               history=job.history)[0])
        if job.history is not None:
            job.history.append([token])
        kept.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return tuple(kept)


class PackedForward:
    """The model's forward over the paged cache: the step's tokens packed into one row, the
    one-token rows first (attending together over their gathered pages), then each prompt chunk
    (causal over its own sequence's pages)."""

    def __init__(self, model: Transformer, cache: PagedKVCache, settings: CoreSettings, *, device: torch.device,
                 sample_ids: int | None) -> None:
        # A lone row reads consecutive pages as one slice, except with static shapes.
        self.wants_consecutive = not settings.static_shapes
        self.model = model
        self.cache = cache
        self.settings = settings
        self.device = device
        self.sample_ids = sample_ids
        # Several one-token rows on the CPU read their keys from a mirror of their gathered pages
        # (PagedKVCache.mirror), named by the rows and their whole block tables, which then stay
        # the same from one step to the next. Any other step feeds rows past the mirror: drop it.
        self.mirrors = device.type == "cpu" and not settings.static_shapes

    def run(self, plan: StepPlan) -> Drawn:
        size, static = self.settings.page_size, self.settings.static_shapes
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

        singles = plan.rows
        tables: list[list[int]] | None = None
        first_page = None  # a lone one-token row's first page, when its pages are consecutive
        mirrored = self.mirrors and len(singles) > 1
        single_key = mirror_slots = None
        if not mirrored:
            self.cache.drop_mirrors()
        if singles:
            width = max(len(job.pages) if mirrored else job.fed // size + 1 for job in singles)
            rows = len(singles)
            if mirrored:
                single_key = tuple((job.serial, tuple(job.pages)) for job in singles)
                mirror_slots = [r * width * size + job.fed for r, job in enumerate(singles)]
            if static:
                width, rows = _bucket(width), _bucket(rows)
            tables = []
            for job in singles:
                if job.fed + 1 == len(job.tokens):  # else a prompt's chunk cut to one token by the budget
                    sampled_rows.append(len(tokens))
                    sampled_jobs.append(job)
                feed(job, 1)
                used = job.pages if mirrored else job.pages[:job.fed // size + 1]
                tables.append(used + [SCRATCH_PAGE] * (width - len(used)))
            for _ in range(rows - len(singles)):  # padding rows: scratch page, position 0, ignored
                sampled_rows.append(len(tokens))
                sampled_jobs.append(None)
                tokens.append(0)
                positions.append(0)
                slots.append(SCRATCH_PAGE * size)
                tables.append([SCRATCH_PAGE] * width)
            if len(tables) == 1 and not static and consecutive(tables[0]):
                first_page = tables[0][0]
        n_singles = len(tokens)
        runs = []
        for job, n in plan.runs:
            first = len(tokens)
            feed(job, n)
            runs.append((first, n, self._put(torch.tensor(job.pages[:-(-(job.fed + n) // size)], dtype=torch.long)),
                         job.fed))
            if job.fed + n == len(job.tokens):
                sampled_rows.append(len(tokens) - 1)
                sampled_jobs.append(job)

        kv_len = None if static or not singles else max(job.fed for job in singles) + 1
        batch = PagedBatch(self._tensor(slots), self._tensor(positions), n_singles,
                           None if tables is None else self._tensor(tables), tuple(runs), kv_len, first_page,
                           single_key, None if mirror_slots is None else self._tensor(mirror_slots))
        # A step of prompt chunks only takes no logits at all (``(1, 0, vocab)``).
        logits = self.model(self._tensor(tokens).view(1, -1), batch.positions.view(1, -1), self.cache.view(batch),
                            logits_at=self._tensor(sampled_rows))[0]
        return sampled_jobs, sample_rows(logits, sampled_jobs, None, self.sample_ids) if sampled_rows else []

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device.type == "cpu" else t.to(self.device, non_blocking=True)

    def _tensor(self, values) -> torch.Tensor:
        return self._put(torch.tensor(values, dtype=torch.long))


class OperatorRows:
    """One call of the CPU operator over the plan, a token a row: each row reads its pages
    through its own block table (no gather, no mirror, no mask), and a prompt chunk's rows share
    their sequence's table. Only the rows that draw a token make logits."""

    wants_consecutive = False

    def __init__(self, decoder: cpu_decode.PagedDecoder, cache: PagedKVCache, settings: CoreSettings,
                 sample_ids: int | None) -> None:
        self.decoder = decoder
        self.cache = cache
        self.page_size = settings.page_size
        self.sample_ids = sample_ids

    def run(self, plan: StepPlan) -> Drawn:
        self.cache.drop_mirrors()  # rows fed past the packed forward's mirror
        tokens, positions, tables, sampled, jobs = self._layout(plan)
        logits, picks = self.decoder.with_picks(tokens, positions, tables, self.sample_ids, sampled)
        drawn: list[int | tuple[int, ...]] = sample_rows(logits[:len(jobs)], jobs, picks[:len(jobs)],
                                                         self.sample_ids) if jobs else []
        at = len(jobs)
        for job, draft in plan.drafts:
            n = len(draft) + 1
            drawn.append(verify(logits[at:at + n], picks[at:at + n], job, draft, self.sample_ids))
            at += n
        return [*jobs, *(job for job, _ in plan.drafts)], drawn

    def _layout(self, plan: StepPlan) -> tuple[list[int], list[int], list[list[int]], list[int] | None,
                                               list[Job]]:
        """The rows' tokens, positions and tables (all of one width), the rows that draw and
        their jobs."""
        size = self.page_size
        feeds = [(job, 1) for job in plan.rows] + plan.runs
        width = max((job.fed + n - 1) // size + 1 for job, n in feeds + [(job, len(d) + 1) for job, d in plan.drafts])
        tokens: list[int] = []
        positions: list[int] = []
        tables: list[list[int]] = []
        sampled: list[int] = []
        jobs: list[Job] = []
        for job, n in feeds:
            start = job.fed
            used = job.pages[:(start + n - 1) // size + 1]
            tokens += job.tokens[start:start + n]
            positions += range(start, start + n)
            tables += [used + [SCRATCH_PAGE] * (width - len(used))] * n
            if start + n == len(job.tokens):
                sampled.append(len(tokens) - 1)
                jobs.append(job)
        # Drafts last, every row of each drawn from: after the rows above, in ``run``'s order.
        for job, draft in plan.drafts:
            start, n = job.fed, len(draft) + 1
            used = job.pages[:(start + n - 1) // size + 1]
            sampled += range(len(tokens), len(tokens) + n)
            tokens += [job.tokens[start], *draft]
            positions += range(start, start + n)
            tables += [used + [SCRATCH_PAGE] * (width - len(used))] * n
        return tokens, positions, tables, sampled, jobs


class OperatorDecodes(OperatorRows):
    """``OperatorRows`` for the batch's common step, every row decoding: its tables made in one
    pass over the jobs, without the plan's per-row lists, for this step's Python is a visible
    part of its time (docs/benchmarks.md, "Batching on the CPU")."""

    def _layout(self, plan: StepPlan) -> tuple[list[int], list[int], list[list[int]], None, list[Job]]:
        jobs, size = plan.rows, self.page_size
        positions = [job.fed for job in jobs]
        tokens = [job.tokens[-1] for job in jobs]
        width = max(positions) // size + 1
        # A job's pages past its position are its own, reserved, and never read: a table is its
        # pages, cut or padded to the width.
        tables = [job.pages[:width] if len(job.pages) >= width
                  else job.pages + [SCRATCH_PAGE] * (width - len(job.pages)) for job in jobs]
        return tokens, positions, tables, None, jobs


class LoneGreedy:
    """One row decoding greedily (a chat's turn, a job left alone at a batch's end): the
    operator's pick, read as an int, with no logits taken, for the Python around a lone step is a
    visible part of it (docs/benchmarks.md, "Batching on the CPU", the paged single stream)."""

    wants_consecutive = False

    def __init__(self, decoder: cpu_decode.PagedDecoder, cache: PagedKVCache, settings: CoreSettings,
                 sample_ids: int | None) -> None:
        self.decoder = decoder
        self.cache = cache
        self.page_size = settings.page_size
        self.sample_ids = sample_ids

    def run(self, plan: StepPlan) -> Drawn:
        self.cache.drop_mirrors()  # a row fed past the packed forward's mirror
        return plan.rows, [self.token(plan.rows[0])]

    def token(self, job: Job) -> int:
        position = job.fed
        return self.decoder.pick(job.tokens[position], position, self._pages(job, position), self.sample_ids)

    def _pages(self, job: Job, position: int) -> list[int]:
        return job.pages[:position // self.page_size + 1]


class LoneSampled(LoneGreedy):
    """One row decoding with temperature and top-p alone: the operator's logits, drawn from as
    ``OperatorRows`` draws a row, with the job's uniform of this position."""

    def token(self, job: Job) -> int:
        position = job.fed
        logits, picks = self.decoder.with_picks([job.tokens[position]], [position], [self._pages(job, position)],
                                                self.sample_ids)
        return sample_rows(logits, (job,), picks, self.sample_ids)[0]


class GraphedLone:
    """One row on consecutive pages through the static step (``decode_step.LoneGraph``), which
    draws its token in the step; the packed forward where its window runs off the pool or
    compiling failed."""

    wants_consecutive = True

    def __init__(self, step: LoneGraph, packed: PackedForward) -> None:
        self.step = step
        self.packed = packed

    def run(self, plan: StepPlan) -> Drawn:
        return plan.rows, [self.token(plan.rows[0])]

    def token(self, job: Job) -> int:
        if consecutive(job.pages):
            token = self.step.token(job, job.pages, self.packed.settings.page_size)
            if token is not None:
                self.packed.cache.drop_mirrors()  # a row fed past the packed forward's mirror
                return token
        self.step.discard()
        return self.packed.run(StepPlan([job], [], True))[1][0]


class BucketedDecodes:
    """A step of one-token rows only through its batch bucket's compiled graph
    (``bucket_step.BucketSteps``); the packed forward where there are more rows than the largest
    bucket, or compiling failed."""

    wants_consecutive = False

    def __init__(self, steps: BucketSteps, packed: PackedForward) -> None:
        self.steps = steps
        self.packed = packed

    def run(self, plan: StepPlan) -> Drawn:
        # A row that fed a prompt's last token but one (a chunk cut by the budget) draws nothing.
        jobs = [job if job.fed + 1 == len(job.tokens) else None for job in plan.rows]
        # Sampled with temperature and top-p alone: drawn in the graph, with the job's uniform of
        # this position (as ``sample_rows`` would draw it).
        drawn = [job is not None and job.controls is None and not job.request.sampling.greedy
                 and job.uniforms is not None for job in jobs]
        made = self.steps.logits([(job.tokens[job.fed], job.fed, job.pages,
                                   job.request.sampling if in_graph else None,
                                   float(job.uniforms[job.fed]) if in_graph else 0.0)
                                  for job, in_graph in zip(plan.rows, drawn)])
        if made is None:
            return self.packed.run(plan)
        logits, picks = made
        return jobs, sample_rows(logits, jobs, picks.clone(), self.packed.sample_ids, drawn)


def prompts_as_rows(settings: CoreSettings, decoder: cpu_decode.PagedDecoder) -> bool:
    """Whether prompt chunks go to the operator as rows, beside the decodes: where a batch's
    steps read panels (a chat's scheduler of one job keeps the model's forward, and builds no
    panels for it); docs/batching.md, "Inside one step"."""
    return settings.max_batch > 1 and decoder.packs_several


class Kind(enum.IntEnum):
    """What a step feeds, as far as the choice of its backend goes (``kind_of``)."""

    DRAFTS = 0  # rows with drafts (speculative.py)
    RUNS = 1  # prompt chunks of several tokens
    DECODES = 2  # several rows, every one decoding
    ROWS = 3  # one-token rows of which some feed a prompt
    # One row decoding, by how its job draws (``jobs.Draw``, fixed when it is admitted):
    LONE_GREEDY = 4
    LONE_SAMPLED = 5
    LONE_OTHER = 6


_LONE = {Draw.GREEDY: Kind.LONE_GREEDY, Draw.SAMPLED: Kind.LONE_SAMPLED, Draw.OTHER: Kind.LONE_OTHER}


def kind_of(plan: StepPlan) -> Kind:
    if plan.drafts:
        return Kind.DRAFTS
    if plan.runs:
        return Kind.RUNS
    if len(plan.rows) > 1 or not plan.decodes_only:
        return Kind.DECODES if plan.decodes_only else Kind.ROWS
    return _LONE[plan.rows[0].draw]


@dataclass(frozen=True)
class StepBackends:
    """The backends a core's steps take, made once, and the one fixed for each kind of step."""

    table: tuple[Backend, ...]  # by ``Kind``
    verifies_drafts: bool  # whether a step may feed drafts (the operator's rows take them)
    step_tokens: int  # most tokens a step's plan may feed
    # The operator's steps after which a job decoding alone goes on to its next step in the same
    # call (``BatchCore._alone_again``).
    operator: tuple[Backend, ...] = ()
    buckets: BucketedDecodes | None = None  # with static shapes and ``CoreSettings.bucket_graphs``
    # The table's lone steps that take a job with no plan, by how the job draws.
    lone: dict[Draw, LoneStep] = field(default_factory=dict)

    @classmethod
    def make(cls, model: Transformer, cache: PagedKVCache, settings: CoreSettings, *, device: torch.device,
             sample_ids: int | None, lone: LoneGraph | None) -> StepBackends:
        """In the step thread (in inference mode: the operator's check reads it)."""
        packed = PackedForward(model, cache, settings, device=device, sample_ids=sample_ids)
        graphed = None if lone is None else GraphedLone(lone, packed)
        decoder = None if device.type != "cpu" or settings.static_shapes else cpu_decode.operator_for(model, cache)
        if decoder is None:
            buckets = None
            if settings.static_shapes and settings.bucket_graphs is not None:
                backend, mode = settings.bucket_graphs
                buckets = BucketedDecodes(BucketSteps(model, cache, max_seq_len=settings.max_seq_len,
                                                      sample_ids=sample_ids, backend=backend, mode=mode), packed)
            many: Backend = buckets or packed
            table = {Kind.DRAFTS: packed, Kind.RUNS: packed, Kind.DECODES: many, Kind.ROWS: many,
                     Kind.LONE_GREEDY: graphed or many, Kind.LONE_SAMPLED: graphed or many, Kind.LONE_OTHER: many}
            lone = {} if graphed is None else {Draw.GREEDY: graphed, Draw.SAMPLED: graphed}
            return cls(tuple(table[k] for k in Kind), False, settings.step_tokens, buckets=buckets, lone=lone)
        as_rows = prompts_as_rows(settings, decoder)
        step_tokens = settings.step_tokens
        if as_rows:
            step_tokens = min(step_tokens, max(ONE_CALL_PROMPT_ROWS, 2 * settings.max_batch))
        rows = OperatorRows(decoder, cache, settings, sample_ids)
        lone_greedy = LoneGreedy(decoder, cache, settings, sample_ids)
        lone_sampled = LoneSampled(decoder, cache, settings, sample_ids)
        # With --compile a lone row keeps the compiled graph; one whose draw needs the host (the
        # processors, logprobs) the packed forward, as a compiled run's other steps.
        lone: dict[Draw, LoneStep] = {Draw.GREEDY: graphed or lone_greedy, Draw.SAMPLED: graphed or lone_sampled}
        table = {Kind.DRAFTS: rows, Kind.RUNS: rows if as_rows else packed,
                 Kind.DECODES: OperatorDecodes(decoder, cache, settings, sample_ids),
                 Kind.ROWS: rows,
                 Kind.LONE_GREEDY: lone[Draw.GREEDY], Kind.LONE_SAMPLED: lone[Draw.SAMPLED],
                 Kind.LONE_OTHER: rows if graphed is None else packed}
        return cls(tuple(table[k] for k in Kind), True, step_tokens, (lone_greedy, lone_sampled, rows), lone=lone)

    def choose(self, plan: StepPlan) -> Backend:
        """The backend of a step of ``plan`` (a plan with at least one row or run)."""
        return self.table[kind_of(plan)]
