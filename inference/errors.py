"""Errors in what was asked for, as opposed to failures while doing it.

The command line maps ``RequestError`` to exit status 2 (bad input), like a usage error.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot run as given; the message is one line for the user."""


class EmptyPrompt(RequestError):
    def __init__(self) -> None:
        super().__init__("the prompt is empty")


class PromptTooLong(RequestError):
    def __init__(self, prompt_tokens: int, context: int) -> None:
        super().__init__(f"the prompt is {prompt_tokens} tokens, the context holds {context} "
                         f"(at least one must be left for the answer)")
        self.prompt_tokens = prompt_tokens
        self.context = context


class EngineBusy(RuntimeError):
    """A second request reached an engine that serves one at a time."""


def sole_exception(group: BaseExceptionGroup) -> BaseException:
    """The one exception inside (possibly nested) groups, or the group itself when there are more.

    Task groups always wrap what their children raise; a caller of a single stream wants the
    error itself, so it can catch it by type.
    """
    leaves: list[BaseException] = []
    pending = [group]
    while pending:
        g = pending.pop()
        for exc in g.exceptions:
            (pending if isinstance(exc, BaseExceptionGroup) else leaves).append(exc)
    return leaves[0] if len(leaves) == 1 else group
