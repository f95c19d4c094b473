"""Structured output as one more logits processor: a ``Constraint`` (``ml/grammars.py``) enforced
token by token against the model's vocabulary.

The constraint engine is llguidance. It was chosen over xgrammar, the other maintained engine
that works from a tokenizer's vocabulary, because it is one self-contained wheel (Rust, abi3, no
Python dependencies: xgrammar brings triton, transformers and pydantic), because it compiles a
schema or grammar far faster (a ``--batch`` run may carry a different schema on every line), and
because it reads Lark grammars natively and llama.cpp's GBNF by conversion. Its masks cost about
what xgrammar's do; both are a small part of a decode step (docs/benchmarks.md, "Structured
output"). It is imported only when a constraint is used.

Three parts:

* ``Vocabulary``: the tokenizer as the engine sees it, built from llama-chat's own token bytes
  (``Tokenizer.token_bytes``) and stop ids, so every backend works the same way (SentencePiece
  with byte fallback, tiktoken, ``tokenizer.json``, GGUF, llama2.c's ``tokenizer.bin``); stop
  tokens are the engine's end-of-sequence tokens, allowed exactly where the grammar accepts;
* ``Constraints``: one tokenizer's vocabulary (built at the first constraint) and its compiled
  constraints, each kept once;
* ``GrammarMask``: the processor. It keeps one matcher per row of the ``TokenHistory`` it is
  given, and follows the history (``TokenHistory.follow``): a sampled token advances the row's
  matcher, beams that fork copy it, rows that join get a fresh one. Each call sets every token the
  row's matcher refuses to ``-inf``. As soon as a token is taken, the next step's masks are
  computed in a background thread while the step's forward runs (llguidance lets go of the GIL
  for it), so that the step finds them ready (docs/benchmarks.md, "Structured output").

A row's matcher is *stopped* when its grammar can take nothing more but an end token (the closing
brace of a JSON object, the last character a pattern allows): the reply then ends there, with
finish reason ``stop_grammar``. Where the grammar accepts but could go on (a number's digits, a
pattern's ``+``), the end tokens are allowed along with the rest and the model decides; if it ends
there, the reason is ``eos``.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch

from llama_chat.ml.controls import KEPT_CONSTRAINTS, ControlError
from llama_chat.ml.grammar_compile import KeptCompiles, compiled
from llama_chat.ml.grammars import Constraint

__all__ = ["Compiled", "Constraints", "GrammarMask", "TokenSource", "Vocabulary"]

NEG_INF = float("-inf")
# What each byte of a mask adds to its 8 tokens' logits: 0 where its bit allows the token, -inf
# where it does not. A lookup in this table and an addition cost less than torch's fill of the
# vocabulary through a boolean mask, which does not vectorize.
_BYTE_BIAS = torch.tensor([[0.0 if byte >> bit & 1 else NEG_INF for bit in range(8)] for byte in range(256)])


class TokenSource(Protocol):
    """What a vocabulary is built from: ``model.tokenizers.base.Tokenizer`` (ml does not import model)."""

    @property
    def vocab_size(self) -> int: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class Vocabulary:
    """Every token's bytes and the ids that end a reply, as llguidance's tokenizer.

    Stop tokens and tokens without bytes (control tokens) can never spell text: the grammar allows
    the stop tokens where it accepts, and the others never. Nor can a token that starts with the
    byte 0xFF (the byte piece ``<0xFF>``), which is how llguidance marks special tokens; no UTF-8
    text holds that byte, so no grammar loses anything. The engine also asks for a
    tokenization of some bytes now and then (forced bytes); it gets an exact one, longest token
    first, for the tokenizers' own ``encode`` may add a word-start space the bytes do not have.
    """

    def __init__(self, tokens: Sequence[bytes], stop_ids: Iterable[int]) -> None:
        import llguidance

        self.size = len(tokens)
        self.stop_ids = tuple(sorted({int(i) for i in stop_ids if 0 <= int(i) < len(tokens)}))
        stops = set(self.stop_ids)
        self.tokens = [b"" if i in stops else bytes(t) for i, t in enumerate(tokens)]
        if not self.stop_ids:
            raise ControlError("constraint", "needs a tokenizer with an end-of-sequence token")
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Described(self)), eos_token=list(self.stop_ids))

    @classmethod
    def of(cls, tokenizer: TokenSource, stop_ids: Iterable[int]) -> Vocabulary:
        return cls([tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)], stop_ids)


class _Described:
    """The object llguidance's ``TokenizerWrapper`` reads a tokenizer from."""

    def __init__(self, vocabulary: Vocabulary) -> None:
        self.tokens = vocabulary.tokens
        self.eos_token_id = vocabulary.stop_ids[0]
        self.bos_token_id = None
        self.special_token_ids = [i for i, t in enumerate(vocabulary.tokens) if not t]
        self._ids: dict[bytes, int] = {}
        for i, t in enumerate(vocabulary.tokens):
            if t and t not in self._ids:
                self._ids[t] = i
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text: bytes | str) -> list[int]:
        """``text`` as tokens whose bytes are exactly its own, longest match first."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        out, i = [], 0
        while i < len(data):
            for j in range(min(len(data), i + self._longest), i, -1):
                token = self._ids.get(data[i:j])
                if token is not None:
                    out.append(token)
                    i = j
                    break
            else:
                i += 1  # a byte no token spells (a vocabulary without byte tokens): left out
        return out


# A grammar's reference to tokens by id: ``<[128010]>``, ``<[5-9,12]>`` (llguidance's Lark).
_TOKEN_IDS = re.compile(r"<\[([0-9,\- ]+)\]>")


def _named_silent_tokens(constraint: Constraint, vocabulary: Vocabulary, words: int
                         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Where a grammar names tokens by id: the bits a mask may keep (every token but those that
    spell nothing, control tokens and the byte 0xFF, that the grammar does not name), and the bits
    of the end tokens, which a row takes back where its grammar accepts. Where a named token is
    one way on and text another, the engine's mask lets every such token through, the end tokens
    too, and the first of them a model took would break the matcher or end the reply early. None
    for a constraint that names no token (its masks never do that)."""
    found = [group for source in constraint.sources() for group in _TOKEN_IDS.findall(source)] \
        if constraint.kind == "grammar" else []
    if not found:
        return None
    named: set[int] = set()
    for group in found:
        for part in group.replace(" ", "").split(","):
            first, _, last = part.partition("-")
            if first.isdigit() and (not last or last.isdigit()):
                named.update(range(int(first), int(last or first) + 1))
    keep = torch.ones(words * 32, dtype=torch.bool)
    for i, token in enumerate(vocabulary.tokens):
        if (not token or token[:1] == b"\xff") and i not in named:
            keep[i] = False
    stops = torch.zeros(words * 32, dtype=torch.bool)
    stops[list(vocabulary.stop_ids)] = True
    return _packed(keep), _packed(stops)


def _packed(bits: torch.Tensor) -> torch.Tensor:
    """One bit a token into int32 words, token ``32w + b`` at bit ``b`` of word ``w``."""
    words = (bits.view(-1, 32).to(torch.int64) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Compiled:
    """One constraint against one vocabulary: a matcher in its first state, copied for every row,
    and the mask of that first state (the same for every reply)."""

    def __init__(self, constraint: Constraint, vocabulary: Vocabulary) -> None:
        self.kind = constraint.kind  # not the constraint itself: ``Constraints`` keeps this while it lives
        self.vocabulary = vocabulary
        self.words = (vocabulary.size + 31) // 32
        self.first_mask = torch.zeros(self.words, dtype=torch.int32)
        self.keep = _named_silent_tokens(constraint, vocabulary, self.words)  # (keep, end tokens) or None
        # The matcher is built by the same recursion as the grammar was (ml/grammar_compile.py).
        self._start = compiled(len(constraint.grammar), self._first_state, constraint.grammar)
        if self._start.is_error():  # no token of the vocabulary starts what the grammar asks for
            raise ControlError(self.kind, "allows no token of this model's vocabulary")

    def _first_state(self, grammar: str):
        import llguidance

        start = llguidance.LLMatcher(self.vocabulary.ll, grammar, log_level=0)
        if start.is_error():
            raise ControlError(self.kind, f"cannot be used with this model's vocabulary: "
                                          f"{start.get_error().splitlines()[0]}")
        self.fill_mask(start, self.first_mask)
        return start

    def fill_mask(self, matcher, words: torch.Tensor) -> None:
        """``matcher``'s mask in its present state into ``words`` (int32, a bit a token)."""
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), self.words * 4)
        if self.keep is not None:
            keep, stops = self.keep
            # In the buffer's own inference mode (the background thread is in neither).
            with torch.inference_mode(torch.is_inference(words)):
                words &= keep
                if matcher.is_accepting():
                    words |= stops

    def matcher(self):
        return self._start.deep_copy()


class Constraints:
    """Constraints compiled against one tokenizer, each once: while its ``Constraint`` lives (a
    request in flight holds it), and the latest ``KEPT_CONSTRAINTS`` within
    ``KEPT_CONSTRAINT_BYTES`` of text beyond that (``KeptCompiles``).

    The vocabulary is built at the first constraint, not before: a model that is never asked for
    structured output never pays for it. Safe to use from the event loop and the step thread.
    """

    def __init__(self, tokenizer: TokenSource, stop_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._stop_ids = frozenset(stop_ids)
        self._vocabulary: Vocabulary | None = None
        self._compiled: KeptCompiles[Compiled] = KeptCompiles(KEPT_CONSTRAINTS)
        self._alive: weakref.WeakKeyDictionary[Constraint, Compiled] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @property
    def vocabulary(self) -> Vocabulary:
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = Vocabulary.of(self._tokenizer, self._stop_ids)
            return self._vocabulary

    def compile(self, constraint: Constraint) -> Compiled:
        """``constraint`` against this vocabulary; ``ControlError`` when the vocabulary cannot
        spell it."""
        vocabulary = self.vocabulary
        with self._lock:
            compiled = self._alive.get(constraint)
        if compiled is None:
            compiled = Compiled(constraint, vocabulary)
            with self._lock:
                self._alive[constraint] = compiled
        return self._compiled.put(constraint, compiled, len(constraint.source))

    def processor(self, constraint: Constraint, *, extra_stop_ids: Iterable[int] = ()) -> GrammarMask:
        """A fresh processor for one request. ``extra_stop_ids``: the request's own end tokens
        (a chat format's), allowed where the grammar accepts, as the tokenizer's are."""
        return GrammarMask(self.compile(constraint), extra_stop_ids=extra_stop_ids)


_ahead: ThreadPoolExecutor | None = None
_ahead_lock = threading.Lock()


def _background() -> ThreadPoolExecutor:
    """The one thread that computes masks ahead, made at the first use."""
    global _ahead
    with _ahead_lock:
        if _ahead is None:
            _ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return _ahead


class GrammarMask:
    """The constraint as a logits processor over the rows of one ``TokenHistory``.

    Bound to the first history it is called with: one matcher per row, which then move with the
    history's rows (``append``, ``reorder``, ``add_rows``: it follows the history). ``stopped(r)``
    says whether row ``r``'s grammar is complete and can take nothing but an end token;
    ``would_stop(r, token)`` asks the same of a candidate token (beam search). ``ahead``: compute
    the next step's masks in the background after each token (else when the logits arrive).
    """

    def __init__(self, compiled: Compiled, *, extra_stop_ids: Iterable[int] = (), ahead: bool = True) -> None:
        self.compiled = compiled
        size = compiled.vocabulary.size
        self.extra_stop_ids = torch.tensor(sorted({int(i) for i in extra_stop_ids if 0 <= int(i) < size}),
                                           dtype=torch.long)
        self.ahead = ahead
        self._history: object | None = None
        self.matchers: list = []
        self._stopped: list[bool] = []
        self._words = torch.empty(0, compiled.words, dtype=torch.int32)  # each row's mask, one bit a token
        self._bias = torch.empty(0, compiled.words * 32)  # the same as what it adds to each logit: 0 or -inf
        self._current = False  # whether the masks are those of the matchers' present state
        self._pending: Future | None = None

    # -- the processor -------------------------------------------------------------------------------

    def __call__(self, history, logits: torch.Tensor) -> torch.Tensor:
        if history is not self._history:
            self._bind(history)
        bias = self._masks()
        if bias.device != logits.device:  # the matchers write host memory: one copy a step
            bias = bias.to(logits.device)
        size = self.compiled.vocabulary.size
        width = logits.shape[-1]
        if width <= size:
            return logits.add_(bias[:, :width])
        logits[:, :size].add_(bias[:, :size])
        logits[:, size:] = NEG_INF  # ids past the tokenizer's vocabulary spell nothing
        return logits

    def stopped(self, row: int) -> bool:
        """Whether row ``row``'s grammar is complete: only an end token could follow."""
        return self._stopped[row]

    def would_stop(self, row: int, token: int) -> bool:
        """Whether taking ``token`` would complete row ``row``'s grammar (without taking it).
        False for a token the row's mask refuses."""
        self._settle()
        if not 0 <= token < self.compiled.vocabulary.size or not self._current or bool(self._bias[row, token] < 0):
            return False
        matcher = self.matchers[row]
        if not matcher.consume_token(token):
            return False
        stopped = matcher.is_stopped()
        matcher.rollback(1)
        return stopped

    # -- following the history -----------------------------------------------------------------------

    def append(self, tokens: Sequence[int]) -> None:
        """One token per row, as the history took them."""
        self._settle()
        for r, (matcher, token) in enumerate(zip(self.matchers, tokens)):
            if not self._stopped[r]:
                matcher.consume_token(int(token))
            # A matcher that met a token its grammar refuses (only when other controls left no
            # token it allows) cannot go on either.
            self._stopped[r] = matcher.is_stopped() or matcher.is_error()
        self._current = False
        if self.ahead and not all(self._stopped):
            self._pending = _background().submit(self._compute)

    def reorder(self, sources: Sequence[int]) -> None:
        """Row ``i`` becomes a copy of row ``sources[i]`` (beams that fork, rows that leave)."""
        self._settle()
        taken: set[int] = set()
        matchers = []
        for s in sources:
            matchers.append(self.matchers[s] if s not in taken else self.matchers[s].deep_copy())
            taken.add(s)
        self.matchers = matchers
        self._stopped = [self._stopped[s] for s in sources]
        index = torch.tensor(list(sources), dtype=torch.long)
        self._words = self._words.index_select(0, index)
        self._bias = self._bias.index_select(0, index)

    def add_rows(self, rows: Sequence[Sequence[int]]) -> None:
        """New rows (their prompts) join below: each starts the grammar from its beginning."""
        self._settle()
        self.matchers += [self.compiled.matcher() for _ in rows]
        self._stopped += [False] * len(rows)
        first = self.compiled.first_mask.expand(len(rows), -1)
        self._words = torch.cat([self._words, first])
        self._bias = torch.cat([self._bias, torch.empty(len(rows), self._bias.shape[1])])
        self._current = False

    # -- masks ---------------------------------------------------------------------------------------

    def _bind(self, history) -> None:
        self._settle()
        rows = history.rows
        self._history = history
        self.matchers = [self.compiled.matcher() for _ in range(rows)]
        self._stopped = [False] * rows
        self._words = self.compiled.first_mask.expand(rows, -1).clone()
        self._bias = torch.empty(rows, self.compiled.words * 32)
        self._unpack()
        self._current = True
        history.follow(self)

    def _settle(self) -> None:
        """Wait for the masks being computed in the background (the matchers are theirs meanwhile)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _masks(self) -> torch.Tensor:
        self._settle()
        if not self._current:
            self._compute()
        return self._bias

    def _compute(self) -> None:
        """Each row's mask for the matcher's present state (in the step thread, or in the
        background while the step's forward runs)."""
        for r, matcher in enumerate(self.matchers):
            self.compiled.fill_mask(matcher, self._words[r])
        accepting = [r for r, m in enumerate(self.matchers) if m.is_accepting()] if self.extra_stop_ids.numel() else []
        self._unpack(accepting)
        self._current = True

    def _unpack(self, accepting: Sequence[int] = ()) -> None:
        """The bits into ``_bias``; the request's own end tokens allowed in the ``accepting`` rows."""
        # Byte k of word w holds the bits of tokens 32w + 8k ... 32w + 8k + 7 (little-endian, as
        # every machine torch runs on).
        index = self._words.view(torch.uint8).view(-1).long()
        # In the buffers' own inference mode: they may have been made in either, and this may run
        # in the background thread, which is in neither.
        with torch.inference_mode(torch.is_inference(self._bias)):
            torch.index_select(_BYTE_BIAS, 0, index, out=self._bias.view(-1, 8))
            for r in accepting:
                self._bias[r].index_fill_(0, self.extra_stop_ids, 0.0)
