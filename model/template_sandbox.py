"""Rendering a model's Jinja chat template with bounded output, bounded work, and Ctrl+C working.

A chat template is code that came with the model. Jinja's sandbox already refuses attribute
escapes (``__class__``, ``__globals__``...) and ranges over 100,000 items, but a template may still:

* build one huge value in a single C call that neither Ctrl+C nor a memory limit interrupts:
  ``'a' * 4 * 10**9``, ``tojson(indent=10**8)``, ``'x'.ljust(10**10)``, ``2 ** 10**10``,
  ``'%999999999d' % 1``, a ``replace`` that multiplies a string by itself;
* grow a value step by step (``~`` in a loop, a buffer of a million references to one string
  joined at the end);
* loop for ever without output (nested ``range`` loops).

So rendering here is bounded three ways:

1. *Every value*: arithmetic operators, calls and filters check the size of what they would
   produce before producing it, and the size of what they produced after; ``~``, ``{% set %}``
   blocks, ``{% filter %}`` and macro bodies are joined by a join that counts first. No string or
   list may exceed ``limit`` items (1 MiB plus four times the size of the messages).
2. *The output*: the template's output stream is cut at ``limit`` characters.
3. *The work*: a trace function counts the lines the template's compiled code executes
   (``MAX_STEPS``, a few seconds of work; real templates use thousands).

Every check raises ``TemplateLimitError``; Python code between them stays interruptible, so Ctrl+C
stops a rendering template like anything else.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

BASE_LIMIT = 1 << 20  # characters (or items) any one value, and the whole output, may hold ...
INPUT_FACTOR = 4  # ... plus this many times the characters of the messages being rendered
MAX_STEPS = 2_000_000  # lines of template code executed in one render
MAX_INT_BITS = 4096  # integers beyond this many bits are not chat-template arithmetic
MAX_JSON_INDENT = 64
# Characters of a template's source. Real templates run to tens of KB; compiling takes time and
# memory in proportion to the source, far more than rendering a real one does.
MAX_TEMPLATE_CHARS = 1 << 18

_FORMAT_NUMBER = re.compile(r"\d+")


class TemplateLimitError(SecurityError):
    """A chat template went past one of the bounds above."""


def _size(value: Any) -> int | None:
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    return None


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose operators, calls, filters and joins respect ``limit``."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit = BASE_LIMIT
        self.filters = {name: self._bounded_filter(name, f) for name, f in self.filters.items()}

    # -- values ----------------------------------------------------------------------------------

    def check_size(self, value: Any, what: str) -> Any:
        n = _size(value)
        if n is not None and n > self.limit:
            raise TemplateLimitError(f"{what} would hold {n:,} items, more than the limit of {self.limit:,}")
        return value

    def _refuse_over(self, n: int, what: str) -> None:
        if n > self.limit:
            raise TemplateLimitError(f"{what} would make a value of {n:,} items, more than the limit of {self.limit:,}")

    def _check_ints(self, values: Iterable[Any], what: str) -> None:
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > self.limit:
                raise TemplateLimitError(f"{what}: argument {v} is larger than the limit of {self.limit:,}")

    def _check_format(self, fmt: str, what: str) -> None:
        for m in _FORMAT_NUMBER.finditer(fmt):
            if len(m.group()) > 9 or int(m.group()) > self.limit:
                raise TemplateLimitError(f"{what}: a field width of {m.group()[:12]} is larger than the limit")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) is not None and isinstance(n, int):
                    self._refuse_over(len(seq) * max(n, 0), "'*'")
            if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError("'*': the product is too large")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if right * math.log2(abs(left)) > MAX_INT_BITS:
                    raise TemplateLimitError(f"'**': {left} ** {right} is too large")
        elif operator == "+":
            if _size(left) is not None and _size(right) is not None:
                self._refuse_over(len(left) + len(right), "'+'")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left, "'%'")
            self._check_ints(right if isinstance(right, tuple) else (right,), "'%'")
        return self.check_size(super().call_binop(context, operator, left, right), f"'{operator}'")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        name = getattr(__obj, "__name__", "a call")
        __self._check_ints((*args, *kwargs.values()), name)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            __self._check_str_method(owner, name, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        return __self.check_size(result, name)

    def _check_str_method(self, s: str, name: str, args: tuple, kwargs: dict) -> None:
        if name in ("format", "format_map"):
            self._check_format(s, name)
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tab, int):
                self._refuse_over(len(s) * max(tab, 1), name)
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            old, new = args[0], args[1]
            hits = s.count(old) if old else len(s) + 1
            self._refuse_over(len(s) + hits * len(new), name)
        elif name == "join" and args:
            items = args[0]
            if isinstance(items, (list, tuple)):
                self._refuse_over(sum(len(x) if isinstance(x, str) else 1 for x in items) + len(s) * len(items), name)

    def _bounded_filter(self, name: str, func: Callable[..., Any]) -> Callable[..., Any]:
        def bounded(*args: Any, **kwargs: Any) -> Any:
            self._check_ints((*args[1:], *kwargs.values()), f"filter {name}")
            if args and name == "join" and isinstance(args[0], (list, tuple)):
                sep = args[1] if len(args) > 1 else kwargs.get("d", "")
                if isinstance(sep, str):
                    self._refuse_over(sum(len(x) if isinstance(x, str) else 1 for x in args[0])
                                      + len(sep) * len(args[0]), "filter join")
            if args and name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
                s, old, new = args[:3]
                self._refuse_over(len(s) + (s.count(old) if old else len(s) + 1) * len(new), "filter replace")
            if args and name == "format" and isinstance(args[0], str):
                self._check_format(args[0], "filter format")
            return self.check_size(func(*args, **kwargs), f"filter {name}")

        # Jinja passes the environment or context to filters marked for it; keep those marks.
        for mark in ("jinja_pass_arg",):
            if hasattr(func, mark):
                setattr(bounded, mark, getattr(func, mark))
        bounded.__name__ = getattr(func, "__name__", name)
        return bounded

    # -- joins -----------------------------------------------------------------------------------

    def bounded_join(self, pieces: Iterable[Any]) -> str:
        """``"".join`` that refuses before building more than ``limit`` characters."""
        items = list(pieces)
        self._refuse_over(sum(len(x) if isinstance(x, str) else 0 for x in items), "joining output")
        return "".join(map(str, items))

    def concat(self, pieces: Iterable[Any]) -> str:  # type: ignore[override]
        # Buffers of {% set %} blocks, {% filter %} bodies and macro bodies are joined here.
        return self.bounded_join(pieces)

    def install_joins(self, template: Any) -> None:
        """Route the compiled template's ``~`` operator through ``bounded_join`` as well."""
        namespace = template.root_render_func.__globals__
        namespace["str_join"] = self.bounded_join
        if "markup_join" in namespace:
            original = namespace["markup_join"]

            def markup_join(seq: Iterable[Any]) -> Any:
                items = list(seq)
                self._refuse_over(sum(len(x) if isinstance(x, str) else 0 for x in items), "'~'")
                return original(items)

            namespace["markup_join"] = markup_join


def render_bounded(env: BoundedSandbox, template: Any, limit: int, **context: Any) -> str:
    """Render ``template`` with every value and the output bounded by ``limit``, and the work by ``MAX_STEPS``."""
    env.limit = limit
    pieces: list[str] = []
    total = 0
    with _step_budget(MAX_STEPS):
        for piece in template.generate(**context):
            total += len(piece)
            if total > limit:
                raise TemplateLimitError(f"the rendered prompt is longer than the limit of {limit:,} characters")
            pieces.append(piece)
    return "".join(pieces)


class _StepBudget:
    def __init__(self, steps: int) -> None:
        self.left = steps

    def global_trace(self, frame: Any, event: str, arg: Any) -> Callable[..., Any] | None:
        # Only the template's compiled code is counted; Python's and Jinja's own code runs untraced.
        return self.local_trace if frame.f_code.co_filename == "<template>" else None

    def local_trace(self, frame: Any, event: str, arg: Any) -> Callable[..., Any]:
        if event == "line":
            self.left -= 1
            if self.left < 0:
                raise TemplateLimitError(f"the template ran for more than {MAX_STEPS:,} steps")
        return self.local_trace


class _step_budget:  # noqa: N801 - used as a context manager
    def __init__(self, steps: int) -> None:
        self.budget = _StepBudget(steps)

    def __enter__(self) -> None:
        self.previous = sys.gettrace()
        sys.settrace(self.budget.global_trace)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)


def iter_limit(messages: Iterator[str]) -> int:
    """The value and output limit for messages of these contents."""
    return BASE_LIMIT + INPUT_FACTOR * sum(len(m) for m in messages)
