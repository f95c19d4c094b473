"""The decode step with static shapes: compiled once, and on CUDA replayed as a CUDA graph.

One call advances one sequence by one token: it embeds the token held in a device buffer at the
position held in another, writes its keys and values into the KV cache, attends over the whole
cache under a mask, samples the next token (sampler included) and writes it and the next position
back into the same buffers. Nothing in it depends on the position's value for its shapes, and
nothing reads a value back to the host, so one compiled graph serves every position of every
request, and on CUDA the whole step is a single graph replay instead of a thousand kernel launches.

The host learns each token through a small pinned copy made after the replay. Because the next
step reads its input token from the device buffer, the host can queue step ``n + 1`` before it
reads the id of step ``n``: the GPU never waits for Python between two steps.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

import torch

from llama_chat.ml.sampling import SamplingMode, SamplingParams, sample_in_graph
from llama_chat.ml.user_cache import user_cache_dir
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.transformer import Transformer

# Where compiled kernels are kept between runs, so that the second run of a model starts fast.
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
# Steps kept in flight on the GPU ahead of the one whose token the host is reading.
RUN_AHEAD = 1
# Without a CUDA graph the step attends over the cache slots up to its position rounded up to a
# multiple of this, not over the whole cache: one compiled graph serves every such window (its
# length is a symbolic size), and a 1024-slot cache no longer costs each early step a full read.
WINDOW_STEP = 128
# Whether a compiled step skips the guards that cannot tell its graphs apart (see ``advance``).
# Tests turn it off to see every guard, and so every recompile, that the step would cause.
SKIP_GUARDS = True


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


@dataclass(frozen=True)
class StaticStepOptions:
    """How the static step runs: compiled with inductor or not, replayed as a CUDA graph or not."""

    compile: bool = False
    cuda_graph: bool = False
    backend: str = "inductor"  # torch.compile's backend; tests use a cheaper one
    row_products: bool = False  # projections as multiply-and-sum for the compiler (ops.linear)
    # Inductor's freezing: weights become constants of the compiled graph, and on the CPU each
    # projection is packed for oneDNN's matrix product once, at compile time (a second copy).
    freezing: bool = False


class StaticStep:
    """One-token decode steps of batch 1 over a fixed-size KV cache, each one call, no host sync.

    ``begin`` sets a request's sampling settings and random stream; ``load`` puts the token to feed
    next and its position into the device buffers (after a prefill); ``advance`` queues one step;
    ``take`` returns the oldest queued step's token id. The caller keeps positions below the
    cache's capacity: a step writes at its position without checking it.
    """

    def __init__(self, model: Transformer, cache: KVCache, device: torch.device,
                 options: StaticStepOptions = StaticStepOptions(), *, sample_ids: int | None = None) -> None:
        if cache.rows != 1:
            raise ValueError(f"the static step decodes one sequence, the cache has {cache.rows} rows")
        self.model = model
        self.cache = cache
        self.device = device
        self.options = options
        # Without a CUDA graph the cache's last slot is spare (``ModelStep`` allocates it): a
        # window then never spans the whole buffer, which would let the compiler fix its length.
        self.capacity = cache.max_seq_len - 1 if self.windowed_for(options, device) else cache.max_seq_len
        self.sample_ids = sample_ids  # only ids below this are sampled (None: every id)
        # The step's whole state lives in these buffers; a CUDA graph captures their addresses.
        self.token = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.position = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.uniforms = torch.zeros(self.capacity, dtype=torch.float64, device=device)
        self.temperature = torch.ones((), dtype=torch.float32, device=device)
        self.top_p = torch.ones((), dtype=torch.float32, device=device)
        self.mode = SamplingMode.GREEDY
        model.rope_tables(device)  # built now, or the first trace would guard on its absence
        self._run = self._step
        self._host_position = 0  # the position the next queued step feeds its token at
        self._windows: dict[int, torch.Tensor] = {}
        if options.compile:
            use_persistent_compile_cache()
            if device.type == "cuda":
                # Inductor turns a one-row matmul into its own reduction kernel only with this
                # on, and tunes it; cuBLAS reaches a smaller share of the bandwidth at one row.
                import torch._inductor.config as inductor_config

                inductor_config.coordinate_descent_tuning = True
            inductor = {}
            if options.backend == "inductor" and device.type == "cpu":
                # The step's kernels called from generated C++ rather than Python: on a 2-core
                # CPU the stories110M-sized step went from 25 to 31-35 tokens/s.
                inductor["cpp_wrapper"] = True
            if options.freezing and options.backend == "inductor":
                inductor["freezing"] = True
            extra = {"options": inductor} if inductor else {}
            self._run = torch.compile(self._step, backend=options.backend, fullgraph=True, dynamic=False, **extra)
        self._graphs: dict[SamplingMode, torch.cuda.CUDAGraph] = {}
        self._prepared: set[SamplingMode] = set()
        self._in_flight: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self._host = [torch.zeros(1, dtype=torch.long, pin_memory=device.type == "cuda")
                      for _ in range(RUN_AHEAD + 2)]
        self._next_host = 0

    @property
    def cuda_graph(self) -> bool:
        return self.options.cuda_graph and self.device.type == "cuda"

    @staticmethod
    def windowed_for(options: StaticStepOptions, device: torch.device) -> bool:
        """Whether steps attend over a window of the cache (and its last slot is spare)."""
        return not (options.cuda_graph and device.type == "cuda")

    def _step(self, mode: SamplingMode, window: torch.Tensor | None) -> None:
        logits = self.model(self.token, self.position, self.cache, last_only=True, static=True,
                            row_products=self.options.row_products,
                            window=None if window is None else window.shape[0])
        logits = logits[:, -1, :self.sample_ids]
        uniform = self.uniforms[self.position[:, -1]]
        chosen = sample_in_graph(logits, mode, self.temperature, self.top_p, uniform)
        self.token.copy_(chosen.view(1, 1))
        self.position.add_(1)

    # -- per request -----------------------------------------------------------------------------

    def begin(self, params: SamplingParams, uniforms: torch.Tensor) -> None:
        """A new request's settings; compiles or captures its sampling mode's step if needed.

        Warming up runs the step (twice on CUDA, before capture), which writes throwaway keys
        into the last cache slots. That happens here, before the request's prefill, so it never
        overwrites keys a request holds unless its context is full to the last two slots.
        """
        self.discard()
        self.mode = SamplingMode.of(params)
        self.temperature.fill_(params.temperature or 1.0)
        self.top_p.fill_(params.top_p)
        self.uniforms.copy_(uniforms[: self.capacity])
        self.prepare(self.mode)

    def prepare(self, mode: SamplingMode) -> None:
        """Compile (and on CUDA capture) the step for ``mode`` now rather than at its first use."""
        if mode in self._prepared:
            return
        if self.cuda_graph:
            self._graphs[mode] = self._capture(mode)
        elif self.options.compile:
            self._warm_up(mode, runs=1)
        self._prepared.add(mode)

    def load(self, logits: torch.Tensor, position: int) -> None:
        """Sample the first token from a prefill's last logits; it is fed at ``position``."""
        uniform = self.uniforms[position - 1: position]
        chosen = sample_in_graph(logits[:, :self.sample_ids], self.mode, self.temperature, self.top_p, uniform)
        self.token.copy_(chosen.view(1, 1))
        self.position.fill_(position)
        self._host_position = position
        self._queue_read()

    def advance(self) -> None:
        """Queue one step: feed the current token, sample the next into the buffers."""
        graph = self._graphs.get(self.mode) if self.cuda_graph else None
        if graph is not None:
            graph.replay()
        elif self.options.compile and SKIP_GUARDS:
            # Every guard but those that tell the prepared graphs apart is skipped: the step is
            # called with the same objects every time, and checking them all cost a 2-core CPU
            # half a millisecond a step (a tenth of a stories15M-sized step).
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                self._run(self.mode, self._window(self._host_position))
        else:
            self._run(self.mode, self._window(self._host_position))
        self._host_position += 1
        self._queue_read()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def take(self) -> int:
        """The token id of the oldest queued step (waits for that step only)."""
        host, done = self._in_flight.popleft()
        if done is not None:
            done.synchronize()
        return int(host[0])

    def discard(self) -> None:
        """Forget queued steps (their results are not wanted); waits for the device to finish them."""
        while self._in_flight:
            self.take()

    # -- internals -------------------------------------------------------------------------------

    def _window(self, position: int) -> torch.Tensor | None:
        """A tensor whose length is the number of cache slots a step at ``position`` attends over.

        A length marked dynamic for the compiler: one graph serves every window.
        """
        if self.cuda_graph:
            return None  # a replayed graph has the whole cache's shapes
        window = min(self.capacity, (position // WINDOW_STEP + 1) * WINDOW_STEP)
        marker = self._windows.get(window)
        if marker is None:
            marker = torch.empty((window, 0), device=self.device)
            torch._dynamo.mark_dynamic(marker, 0)
            self._windows[window] = marker
        return marker

    def _queue_read(self) -> None:
        host = self._host[self._next_host]
        self._next_host = (self._next_host + 1) % len(self._host)
        host.copy_(self.token.view(1), non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self._in_flight.append((host, done))

    def _warm_up(self, mode: SamplingMode, runs: int) -> None:
        token, position = self.token.clone(), self.position.clone()
        self.position.fill_(self.capacity - runs)
        for i in range(runs):
            self._run(mode, self._window(self.capacity - runs + i))
        self.token.copy_(token)
        self.position.copy_(position)

    def _capture(self, mode: SamplingMode) -> torch.cuda.CUDAGraph:
        # Warm-up on a side stream, as CUDA graph capture requires: it compiles, picks kernels and
        # makes the libraries' lazy allocations outside the graph.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._warm_up(mode, runs=2)
        torch.cuda.current_stream(self.device).wait_stream(side)
        token, position = self.token.clone(), self.position.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._run(mode, None)
        # Capture records without running; the buffers are as they were, but restore to be sure.
        self.token.copy_(token)
        self.position.copy_(position)
        return graph
