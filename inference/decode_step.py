"""The decode step of a job running alone, with static shapes: compiled, and on CUDA a CUDA graph.

One call advances the job by one token: it embeds the token held in a device buffer at the
position held in another, writes its keys and values into the job's pages, attends over them
under a mask, draws the next token (sampler included) and writes it and the next position back
into the same buffers. Nothing in it depends on the position's value for its shapes, and nothing
reads a value back to the host, so one graph serves every position of every job, and on CUDA the
whole step is a single graph replay instead of a thousand kernel launches.

The job's pages are consecutive (the core moves a lone job onto consecutive pages), so its keys
are one slice of the page pool, ``(kv_heads, slots, head_dim)`` from its first page on: a window
of views into the pool (``PagedKVCache.slice_views``) is the ``WholeCache`` the step attends over,
and the keys it writes land in the job's own pages, where the other backends and the prefix cache
find them. Slots of the window past the job's position belong to other pages; the mask hides them.
On CUDA the window is the whole context from the first page, or what the pool has past it (a
replayed graph keeps its shapes and addresses: one graph per sampling mode and first page);
elsewhere it is the position rounded up to ``WINDOW_STEP``. The length is marked dynamic: one
compiled graph serves every window and first page.

The host learns each token through a small pinned copy made after the step. Because the next
step reads its input token from the device buffer, the host queues step ``n + 1`` before it reads
the id of step ``n`` (``LoneGraph.token``): the GPU never waits for Python between two steps.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence

import torch

from llama_chat.ml.sampling import SamplingMode, SamplingParams, sample_in_graph
from llama_chat.ml.user_cache import user_cache_dir
from llama_chat.model.kv_cache import WholeCache
from llama_chat.model.paged_kv_cache import SCRATCH_PAGE, PagedKVCache
from llama_chat.model.transformer import Transformer

# Where compiled kernels are kept between runs, so that the second run of a model starts fast.
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Without a CUDA graph a step attends over the job's slots up to its position rounded up to a
# multiple of this: one compiled graph serves every such window (its length is a symbolic size),
# and a long context no longer costs each early step a full read.
WINDOW_STEP = 128
# Whether a compiled step skips the guards that cannot tell its graphs apart (see ``_advance``).
# Tests turn it off to see every guard, and so every recompile, that the step would cause.
SKIP_GUARDS = True
# CUDA graphs kept, one per sampling mode and first page: each holds its own memory.
MOST_GRAPHS = 8


def use_persistent_compile_cache() -> str:
    """Point inductor's on-disk cache at a user cache folder (unless the user chose one)."""
    if not os.environ.get(COMPILE_CACHE_ENV):
        os.environ[COMPILE_CACHE_ENV] = str(user_cache_dir("torch-compile"))
    return os.environ[COMPILE_CACHE_ENV]


def compile_failure_text(exc: BaseException) -> str:
    """One line for a failed compile: the compiler's own error, from under dynamo's wrappers."""
    root = exc
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
        root = inner
    first_line = (str(root).strip().splitlines() or [""])[0]
    return f"{type(root).__name__}: {first_line}"[:300]


class LoneGraph:
    """``token(job)``: the token a lone job draws after its last one, through the static step, or
    None where it cannot run here (the window runs off the pool, or compiling failed).

    The caller hands it only jobs on consecutive pages, drawn with temperature and top-p alone.
    After each token it queues the step that feeds that token, while the job's pages have room:
    when the caller asks for the same job's next token, that step has run already (or is running).
    """

    def __init__(self, model: Transformer, cache: PagedKVCache, *, max_seq_len: int, sample_ids: int | None,
                 compile: bool, cuda_graph: bool, backend: str = "inductor", row_products: bool = False) -> None:
        self.model = model
        self.cache = cache
        device = cache.device
        self.device = device
        self.cuda_graph = cuda_graph and device.type == "cuda"
        self.compile = compile
        self.row_products = row_products
        self.max_seq_len = max_seq_len
        self.slots = cache.num_pages * cache.page_size
        self.sample_ids = sample_ids  # only ids below this are drawn (None: every id)
        self.failure: str | None = None  # why compiling failed, once it has
        self.steps = 0  # steps run
        # The step's whole state lives in these buffers; a CUDA graph captures their addresses.
        self.token_buffer = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.uniforms = torch.zeros(max_seq_len, dtype=torch.float64, device=device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.mode = SamplingMode.GREEDY
        model.rope_tables(device)  # built now, or the first trace would guard on its absence
        self._run = self._step
        # The sampling modes whose graphs are compiled: guards are skipped only for those, or a
        # new mode's first step would run another mode's graph.
        self._compiled: set[SamplingMode] = set()
        if compile:
            use_persistent_compile_cache()
            inductor = {}
            if device.type == "cuda":
                # Inductor turns a one-row matmul into its own reduction kernel only with this
                # on, and tunes it; cuBLAS reaches a smaller share of the bandwidth at one row.
                import torch._inductor.config as inductor_config

                inductor_config.coordinate_descent_tuning = True
            elif backend == "inductor":
                # The step's kernels called from generated C++ rather than Python: on a 2-core
                # CPU the stories110M-sized step went from 25 to 31-35 tokens/s.
                inductor["cpp_wrapper"] = True
            extra = {"options": inductor} if inductor else {}
            try:
                self._run = torch.compile(self._step, backend=backend, fullgraph=True, dynamic=False, **extra)
            except Exception as exc:  # noqa: BLE001 - a backend unknown here: the other backends
                self.failure = compile_failure_text(exc)
        self._graphs: dict[tuple[SamplingMode, int], torch.cuda.CUDAGraph] = {}
        self._windows: dict[tuple[int, int], WholeCache] = {}
        self._serial = 0  # the job whose settings the buffers hold
        # The step queued ahead: its job, position, token and first page.
        self._ahead: tuple[int, int, int, int] | None = None
        self._in_flight: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self._host = [torch.zeros(1, dtype=torch.long, pin_memory=self.cuda_graph) for _ in range(3)]
        self._next_host = 0

    def warm_up(self) -> bool:
        """Compile now, at the scratch page's first slots; whether the step can be used."""
        if self.failure is None and self.compile and not self.cuda_graph:
            try:
                with torch.inference_mode():
                    self._warm(SamplingMode.GREEDY, self._window(SCRATCH_PAGE, 0), 0)
            except Exception as exc:  # noqa: BLE001 - any compiler failure means the same: the other backends
                self.failure = compile_failure_text(exc)
        return self.failure is None

    def token(self, job, pages: Sequence[int], page_size: int) -> int | None:
        """The token after ``job``'s last, fed at ``job.fed`` into its consecutive ``pages``."""
        if self.failure is not None:
            return None
        position, first = job.fed, pages[0]
        try:
            if self._ahead != (job.serial, position, job.tokens[-1], first):
                self.discard()
                if job.serial != self._serial:
                    self._begin(job)
                if not self._advance(first, position, job.tokens[-1]):
                    return None
            # The step after this one, queued before this one's token is read; kept within the
            # job's own pages, where its keys are thrown away if the job ends here.
            self._ahead = None
            limit = min(len(pages) * page_size, self.max_seq_len)
            ahead = position + 1 < limit and self._advance(first, position + 1)
            token = self._take()
        except Exception as exc:  # noqa: BLE001 - any compiler failure means the same: the other backends
            self.failure = compile_failure_text(exc)
            self._in_flight.clear()
            self._ahead = None
            return None
        if ahead:
            self._ahead = (job.serial, position + 1, token, first)
        return token

    def discard(self) -> None:
        """Forget queued steps (their results are not wanted); waits for the device to finish them."""
        while self._in_flight:
            self._take()
        self._ahead = None

    # -- internals -------------------------------------------------------------------------------

    def _begin(self, job) -> None:
        params: SamplingParams = job.request.sampling
        self._serial = job.serial
        self.mode = SamplingMode.of(params)
        self.temperature.fill_(params.temperature or 1.0)
        self.top_p.fill_(params.top_p)
        if job.uniforms is not None:
            self.uniforms.copy_(job.uniforms[:self.max_seq_len])

    def _step(self, mode: SamplingMode, window: WholeCache) -> None:
        logits = self.model(self.token_buffer, self.position, window, last_only=True)
        logits = logits[:, -1, :self.sample_ids]
        uniform = self.uniforms[self.position[:, -1]]
        chosen = sample_in_graph(logits, mode, self.temperature, self.top_p, uniform)
        self.token_buffer.copy_(chosen.view(1, 1))
        self.position.add_(1)

    def _advance(self, first: int, position: int, token: int | None = None) -> bool:
        """Queue the step at ``position`` (feeding ``token``, or the token the step before drew);
        False where its window does not fit in the pool."""
        window = self._window(first, position)
        if window is None:
            return False
        if token is not None:
            self.token_buffer.fill_(token)
            self.position.fill_(position)
        if self.cuda_graph:
            key = (self.mode, first)
            graph = self._graphs.get(key)
            if graph is None:
                graph = self._capture(window)
                if len(self._graphs) >= MOST_GRAPHS:
                    self._graphs.clear()
                self._graphs[key] = graph
            graph.replay()
        elif self.compile and SKIP_GUARDS and self.mode in self._compiled:
            # Every guard but those that tell the graphs apart is skipped: the step is called with
            # the same objects every time, and checking them all cost a 2-core CPU half a
            # millisecond a step (a tenth of a stories15M-sized step).
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                self._run(self.mode, window)
        else:
            self._run(self.mode, window)
            if self.compile:
                self._compiled.add(self.mode)
        self.steps += 1
        self._queue_read()
        return True

    def _window(self, first: int, position: int) -> WholeCache | None:
        """The slots from page ``first`` that a step at ``position`` attends over (None: past the pool)."""
        start = first * self.cache.page_size
        whole = self.max_seq_len if self.cuda_graph else (position // WINDOW_STEP + 1) * WINDOW_STEP
        length = min(whole, self.slots - start)
        if length <= position:
            return None
        key = (start, length)
        window = self._windows.get(key)
        if window is None:
            if len(self._windows) > 64:
                self._windows.clear()
            window = WholeCache(*self.cache.slice_views(start, length), row_products=self.row_products)
            self._windows[key] = window
        return window

    def _take(self) -> int:
        host, done = self._in_flight.popleft()
        if done is not None:
            done.synchronize()
        return int(host[0])

    def _queue_read(self) -> None:
        host = self._host[self._next_host]
        self._next_host = (self._next_host + 1) % len(self._host)
        host.copy_(self.token_buffer.view(1), non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self._in_flight.append((host, done))

    def _warm(self, mode: SamplingMode, window: WholeCache, position: int, runs: int = 1) -> None:
        """Run the step ``runs`` times from ``position`` of ``window`` (it compiles, picks its
        kernels), leaving the slots it writes and the buffers as they were."""
        saved = [t[:, :, position:position + runs].clone() for t in (*window.keys, *window.values)]
        token, at = self.token_buffer.clone(), self.position.clone()
        self.position.fill_(position)
        for _ in range(runs):
            self._run(mode, window)
        for t, kept in zip((*window.keys, *window.values), saved):
            t[:, :, position:position + runs].copy_(kept)
        self.token_buffer.copy_(token)
        self.position.copy_(at)
        if self.compile:
            self._compiled.add(mode)

    def _capture(self, window: WholeCache) -> torch.cuda.CUDAGraph:
        # Warm-up on a side stream, as CUDA graph capture requires: it compiles, picks kernels and
        # makes the libraries' lazy allocations outside the graph.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._warm(self.mode, window, window.length - 2, runs=2)
        torch.cuda.current_stream(self.device).wait_stream(side)
        token, position = self.token_buffer.clone(), self.position.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._run(self.mode, window)
        # Capture records without running; the buffers are as they were, but restore to be sure.
        self.token_buffer.copy_(token)
        self.position.copy_(position)
        return graph


__all__ = ["COMPILE_CACHE_ENV", "LoneGraph", "WINDOW_STEP", "compile_failure_text", "use_persistent_compile_cache"]
