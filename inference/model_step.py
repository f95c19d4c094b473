"""The blocking half of generation: prefill forwards, then one sampled token per decode step.

These run in a worker thread, one call per forward, so that everything between two calls
(cancellation, sending into the channel, rendering) happens in async code. They take and return
plain Python values; the tensors they build never leave the model step.

A request's decode loop is one ``Decode`` behind one call, ``next_token()``, chosen once per
request by ``ModelStep.decode``:

- ``StaticDecode``: the compiled-shape step of ``decode_step.py`` (its sampler in the graph);
- ``PickedDecode``: plain greedy tokens picked inside our CPU operator's call (``model/cpu_decode.py``);
- ``EagerDecode``: logits, then ``sampling.choose`` (the controls over the token history, if any;
  then the draw).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from llama_chat.inference.decode_step import StaticStep, StaticStepOptions, compile_failure_text
from llama_chat.inference.types import DamagedScores
from llama_chat.ml.controls import COMPILE_MIN_PARAMETERS
from llama_chat.ml.processors import Controls, LogitsProcessor, TokenHistory, make_controls
from llama_chat.ml.sampling import Draw, SamplingMode, SamplingParams, choose, draw_uniforms, finite_best, sample
from llama_chat.model import cpu_decode
from llama_chat.model.kv_cache import KVCache
from llama_chat.model.transformer import Transformer



@dataclass(frozen=True)
class StepOptions:
    """How decode steps run. ``static``: the compiled-shape step of ``decode_step``."""

    static: bool = False
    compile: bool = False
    cuda_graph: bool = False
    backend: str = "inductor"
    row_products: bool = False
    freezing: bool = False

    @classmethod
    def for_device(cls, device: torch.device, parameters: int, compile: bool | None = None,
                   *, quantized: bool = False, dtype: torch.dtype = torch.float32,
                   one_call: bool = False) -> StepOptions:
        """The defaults: the static step, compiled when the model is big enough to pay for it,
        in a CUDA graph on CUDA; elsewhere the eager step unless compiling is asked or pays.

        On the CPU the compiled step spells its projections as multiply-and-sum (``row_products``):
        inductor's reductions read the weights faster than MKL's one-row product. It is the
        default there for float32 weights of 50M parameters and more; in bfloat16 it was no
        reliable gain on a CPU without bf16 instructions, so it is not. int8 weights compile when
        asked: fbgemm's product stays one opaque call in the graph
        (``quantize.fbgemm_int8_linear``) and the rest of the step is compiled around it, which
        gained too little on larger models for its cold compile, so it is not the default
        (docs/architecture.md, "Without the operator").

        ``one_call``: the model's CPU decode steps go to our one-call operator
        (``model/cpu_decode.py``), which beats every compiled step there, so nothing compiles
        unless asked (docs/benchmarks.md, "CPU decode against llama2.c and transformers").
        """
        big = parameters >= COMPILE_MIN_PARAMETERS
        if device.type == "cuda":
            return cls(static=True, compile=big if compile is None else compile, cuda_graph=True)
        if compile is None:
            compile = device.type == "cpu" and big and dtype == torch.float32 and not quantized and not one_call
        return cls(static=compile, compile=compile, row_products=compile)


class ModelStep:
    """A model with its KV cache: token runs at given positions in, last-position logits out.

    Each row is a run of consecutive tokens starting at its own position, the shape continuous
    batching needs; the single-prompt path uses one row. The cache is preallocated for
    ``max_seq_len`` and reused from one request to the next: a new request starts at position 0
    and the model's mask never reads positions past the ones it has written.
    """

    def __init__(self, model: Transformer, *, rows: int = 1, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, options: StepOptions | None = None,
                 max_seq_len: int | None = None, sample_ids: int | None = None) -> None:
        first = next(model.parameters())
        self.model = model
        self.device = torch.device(device) if device is not None else first.device
        self.dtype = dtype or first.dtype
        self.max_seq_len = min(max_seq_len or model.args.max_seq_len, model.args.max_seq_len)
        self.vocab_size = model.args.vocab_size
        # Ids the sampler may pick: a checkpoint may pad its vocabulary past the tokenizer's (to a
        # multiple of 64 or 128), and those ids have no text, so their logits are cut off.
        self.sample_ids = sample_ids if sample_ids is not None and sample_ids < self.vocab_size else None
        if options is None:
            options = StepOptions.for_device(self.device, sum(p.numel() for p in model.parameters()),
                                             dtype=first.dtype)
        self.options = options
        static_options = StaticStepOptions(options.compile, options.cuda_graph, options.backend,
                                           options.row_products and options.compile,
                                           options.freezing and options.compile)
        spare = 1 if options.static and StaticStep.windowed_for(static_options, self.device) else 0
        self.cache = KVCache.for_model(model.args, rows, max_seq_len=self.max_seq_len + spare,
                                       device=self.device, dtype=self.dtype)
        self.static: StaticStep | None = None
        self.static_failure: str | None = None  # why the static step was dropped, if it was
        if self.device.type == "cuda":
            # cuDNN's attention builds an execution plan for every new key length, which costs
            # more than the attention itself at every prefill chunk; flash and memory-efficient
            # attention do not.
            torch.backends.cuda.enable_cudnn_sdp(False)
        # One product for q/k/v and one for the SwiGLU inputs: fewer kernels per layer, and on
        # the CPU fewer calls from Python in the eager step.
        model.fuse_projections()
        # One token of the one row through our one-call CPU step, with no model call around it.
        self.one_call: cpu_decode.Decoder | None = None
        if rows == 1:
            with torch.inference_mode():
                self.one_call = cpu_decode.operator_for(model, self.cache)
        if options.static:
            self.static = StaticStep(model, self.cache, self.device, static_options, sample_ids=self.sample_ids)

    def prepare_static(self, params: SamplingParams) -> bool:
        """Compile (or capture) the static step for ``params``; whether decoding will use it.

        A failed compile (no C++ compiler on the machine, an unsupported operation on this
        device) is not the user's problem: the step is dropped, the reason kept in
        ``static_failure``, and decoding goes on eagerly.
        """
        if self.static is None:
            return False
        try:
            with torch.inference_mode():
                self.static.prepare(SamplingMode.of(params))
        except Exception as exc:  # noqa: BLE001 - any compiler failure means the same: go eager
            self.static = None
            self.static_failure = compile_failure_text(exc)
            return False
        return True

    def forward(self, rows: Sequence[Sequence[int]], starts: Sequence[int]) -> torch.Tensor:
        """Logits ``(len(rows), vocab)`` for the last token of each row (rows of equal length).
        One token of the one row takes the operator's call where it reads the model."""
        # inference_mode is thread-local: it must be entered in the thread that runs the forward.
        with torch.inference_mode():
            if self.one_call is not None and len(rows) == 1 and len(rows[0]) == 1:
                return self.one_call(rows[0][0], starts[0])
            tokens = torch.tensor(rows, dtype=torch.long, device=self.device)
            offsets = torch.arange(tokens.shape[1], device=self.device)
            positions = torch.tensor(starts, dtype=torch.long, device=self.device).unsqueeze(1) + offsets
            return self.model(tokens, positions, self.cache, last_only=True)[:, -1, :]

    def decode(self, tail: Sequence[int], start: int, params: SamplingParams, seed: int,
               draw: Draw = sample, *, prompt: Sequence[int] = (), stop_ids: Iterable[int] = (),
               constraint: LogitsProcessor | None = None) -> Decode:
        """A request's decode loop, from the last prompt chunk ``tail`` that begins at ``start``.

        ``prompt``: the whole prompt (``tail`` is its end), the history that penalties and n-gram
        bans read; ``stop_ids``: what ``min_new_tokens`` holds back; ``constraint``: the request's
        structured output (``ml/constraints.py``). Call in the worker thread; the returned
        object's ``next_token`` too.
        """
        uniforms = draw_uniforms(self.max_seq_len, seed, self.device)
        # The compiled step samples in-graph with temperature and top-p only; the other controls
        # read the token history on the host, so they take the eager step.
        plain = params.plain and constraint is None
        if self.static is not None and draw is sample and plain and self.prepare_static(params):
            return StaticDecode(self, self.static, list(tail), start, params, uniforms)
        if not plain:
            history = TokenHistory([list(prompt) or list(tail)], vocab_size=self.sample_ids or self.vocab_size,
                                   device=self.device, window=params.repeat_last_n)
            return EagerDecode(self, list(tail), start, params, uniforms, draw,
                               make_controls(params, eos_ids=stop_ids, constraint=constraint), history)
        if self.one_call is not None and draw is sample and params.greedy:
            return PickedDecode(self, list(tail), start, params, uniforms, draw)
        return EagerDecode(self, list(tail), start, params, uniforms, draw)


def first_scores_finite(logits: torch.Tensor) -> None:
    """``DamagedScores`` when the scores of a request's first token are not numbers (damaged
    weights): the error is said once, instead of a reply drawn from them. Looked at for the first
    token only, where the prompt's logits are on hand anyway; later steps stay free of the check's
    wait for the device."""
    if not bool(finite_best(logits).all()):
        raise DamagedScores()


class Decode:
    """One request's decode loop: each ``next_token`` call returns the next sampled token id."""

    picks_in_step = False  # whether the token is picked inside the operator's call (``PickedDecode``)

    def next_token(self) -> int:
        raise NotImplementedError


class EagerDecode(Decode):
    """A forward over the tokens not yet fed, then ``sampling.choose`` (the request's controls,
    if it has any beyond temperature and top-p, over its token history; then the draw), each
    step."""

    def __init__(self, step: ModelStep, tail: list[int], start: int, params: SamplingParams,
                 uniforms: torch.Tensor, draw: Draw, controls: Controls | None = None,
                 history: TokenHistory | None = None) -> None:
        self.step, self.rows, self.pos = step, [tail], start
        self.params, self.uniforms, self.draw = params, uniforms, draw
        self.controls, self.history = controls, history
        self.first = True

    def next_token(self) -> int:
        with torch.inference_mode():
            fed = len(self.rows[0])
            logits = self.step.forward(self.rows, [self.pos])[:, :self.step.sample_ids]
            if self.first:
                first_scores_finite(logits)
                self.first = False
            # The token after position ``last`` is drawn with uniform ``last``, as the scheduler
            # draws it: a seeded request picks the same tokens on either.
            last = self.pos + fed - 1
            token = int(choose(logits, self.params, self.uniforms[last:last + 1], controls=self.controls,
                               history=self.history, draw=self.draw)[0])
            if self.history is not None:
                self.history.append([token])
        self.pos += fed
        self.rows = [[token]]
        return token


class PickedDecode(EagerDecode):
    """Plain greedy decoding where our CPU operator reads the model: after the prompt's tail, each
    token is picked inside the operator's call, by the threads that write its logits, and no
    logits leave it."""

    picks_in_step = True

    def __init__(self, step: ModelStep, tail: list[int], start: int, params: SamplingParams,
                 uniforms: torch.Tensor, draw: Draw) -> None:
        super().__init__(step, tail, start, params, uniforms, draw)
        assert step.one_call is not None
        self._pick = step.one_call.pick

    def next_token(self) -> int:
        if len(self.rows[0]) > 1:  # the prompt's tail: through the forward
            return super().next_token()
        token = self._pick(self.rows[0][0], self.pos, self.step.sample_ids)
        self.pos += 1
        self.rows = [[token]]
        return token


class StaticDecode(Decode):
    """The prompt's last chunk through the eager forward, then static steps, one queued ahead
    (from the second token on).

    A step is queued ahead only while its position fits in the cache; the one computed after the
    request's last token is thrown away (its keys sit past the request's end, masked).
    """

    def __init__(self, step: ModelStep, static: StaticStep, tail: list[int], start: int,
                 params: SamplingParams, uniforms: torch.Tensor) -> None:
        self.step, self.static = step, static
        self.tail, self.start = tail, start
        self.params, self.uniforms = params, uniforms
        self.next_position = 0  # the position the next queued step feeds its token at

    def next_token(self) -> int:
        with torch.inference_mode():
            static = self.static
            if self.tail:
                static.begin(self.params, self.uniforms)
                logits = self.step.forward([self.tail], [self.start])
                first_scores_finite(logits[:, :self.step.sample_ids])
                self.next_position = self.start + len(self.tail)
                static.load(logits, self.next_position)
                self.tail = []
                # The first token comes from the prefill's logits: hand it over before queueing
                # steps ahead, or the time to first token would include two decode steps.
                return static.take()
            while static.in_flight < 2 and self.next_position < self.step.max_seq_len:
                static.advance()
                self.next_position += 1
            return static.take()
