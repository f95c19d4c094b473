"""The interactive chat: read a message, generate a reply through the one-shot path, remember both.

::

    run_chat
    ├── ChatInput        readline line editing and history, multi-line input between \"\"\" lines
    ├── Chat             the conversation (system message, turns), settings, /commands
    │   └── reply        the dialog in the model's chat format -> Request(reuse_cache=True)
    │                    -> run_one_shot (anyio.run per reply: watcher, producer, renderer)
    └── overflow         the oldest turns are dropped until the next one fits in the context

The replies run on the scheduler (``inference/scheduler.py``), one job at a time: the pages of a
turn stay in its page table under their prefix keys, so the next reply finds the conversation so
far there and prefills only the tokens after it (the new user message, not the whole dialog),
as any job of ``--batch`` that starts with the same tokens would; a reply running alone takes
the lone job's backend (``inference/batch_step.py``). The source is made as every command's is
(``generation_source.make_source``). Beam search runs beside it, with a cache of its own
(``inference/beam.py``).

Signals: at the prompt (outside the event loop) Ctrl+C raises ``KeyboardInterrupt``: on an empty
line it ends the chat (exit 0), on a line with text it discards the text. During a reply the
watcher of ``run_one_shot`` cancels the reply at the first Ctrl+C (the partial reply stays in the
history, marked as interrupted) and exits at once with 130 at a second one. SIGTERM and SIGHUP end
the chat with their usual statuses after the reply has been cut.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from rich.console import Console
from rich.text import Text

from llama_chat.cmd import exit_status
from llama_chat.cmd.chat_settings import Settings, apply_setting, set_help, split_setting
from llama_chat.cmd.conversation_file import (SAVE_FORMAT, ConversationError, Turn, load_conversation,
                                              save_conversation)
from llama_chat.cmd.inputs import UsageProblem
from llama_chat.cmd.one_shot import Outcome, run_one_shot
from llama_chat.cmd.prompt import dialog_ids, thinking_model
from llama_chat.cmd.render import make_renderer
from llama_chat.cmd.report import drafts_text, failure_line, seed_to_report, weights_text
from llama_chat.cmd.sanitize import one_line
from llama_chat.cmd.signals import install_sync_handlers, interruptible_prompt, no_control_echo
from llama_chat.cmd.typeahead import Typed, held_typing
from llama_chat.cmd.sanitize import displayable
from llama_chat.cmd.generation_source import make_source
from llama_chat.inference.reasoning import ThinkTags
from llama_chat.inference.types import Completion, GenerationState, Request, Timings
from llama_chat.ml.controls import THINK_MODES
from llama_chat.ml.safe_files import require_regular
from llama_chat.model.chat_format import ChatFormat, Message
from llama_chat.model.safe_input import NotText, check_text

if TYPE_CHECKING:
    from collections.abc import Callable

    from llama_chat.cmd.generation_source import Source
    from llama_chat.cmd.options import Options
    from llama_chat.model.loader import WeightsSummary

PROMPT = ">>> "
CONTINUATION = "... "
FENCE = '"""'
# Tokens kept free for a reply when the dialog is fitted into the context, at most this share of it.
REPLY_ROOM = 256
HISTORY_LENGTH = 1000
MAX_HISTORY_BYTES = 16 << 20

HELP = f"""\
Commands:
  /help               this list
  /exit               leave (also /bye, Ctrl+D, or Ctrl+C at an empty prompt)
  /clear              forget the conversation (the system message stays)
  /system [TEXT]      set the system message (no text: remove it)
{set_help(22)}
  /stats              token counts and timings of the last reply
  /save FILE          write the conversation to FILE as JSON
  /load FILE          read a conversation written by /save
  /retry              generate the last reply again
  /think on|off|auto  a thinking model's thinking (no argument: show the setting)
Input: \"\"\" on a line of its own starts and ends a message of several lines; a message that
starts with / is typed with two (//etc/hosts is sent as /etc/hosts).
Ctrl+C stops a reply (it stays in the conversation, marked as interrupted)."""


# -- the conversation ------------------------------------------------------------------------------


@dataclass
class Chat:
    """The conversation and its settings; ``dialog_ids`` fits it into the context."""

    backend: Source  # what runs the replies (see the module's docstring)
    chat_format: ChatFormat
    settings: Settings
    system: str | None = None
    turns: list[Turn] = field(default_factory=list)
    last: Completion | None = None
    last_seed: int | None = None
    think: tuple[ThinkTags, Any] | None = None  # a thinking model's tags and tokenizer

    def messages(self) -> list[Message]:
        head = [Message("system", self.system)] if self.system else []
        return head + [_message(t) for t in self.turns]

    def encode(self, messages: list[Message]) -> list[int]:
        return dialog_ids(self.chat_format, messages, thinking=self.settings.options.thinking(), think=self.think)

    def reply_room(self) -> int:
        ctx = self.backend.max_seq_len
        return max(1, min(self.settings.max_tokens or REPLY_ROOM, ctx // 2))

    def dialog_ids(self, say) -> list[int] | None:
        """The dialog's ids ending where the reply begins, after dropping the oldest turns it
        takes to leave room for a reply; None when the last message alone does not fit."""
        ctx = self.backend.max_seq_len
        dropped = self._exchanges_to_drop(ctx)
        self.turns[:2 * dropped] = []  # the oldest user messages and their replies
        ids = self.encode(self.messages())
        if dropped:
            say(f"the conversation was longer than the context ({ctx} tokens): dropped the oldest "
                f"{dropped} exchange{'s' if dropped > 1 else ''}")
        if len(ids) >= ctx:
            say(f"this message is {len(ids)} tokens with the system message, more than the context holds "
                f"({ctx}); it was not sent")
            self.turns.pop()
            return None
        return ids

    def _exchanges_to_drop(self, ctx: int) -> int:
        """The fewest oldest exchanges (a user message and its reply) to drop for the dialog and a
        reply to fit in ``ctx``; at most all but the last message. Found by bisection, so a long
        conversation (a /load of thousands of messages) is encoded a few times, not once per
        exchange dropped."""
        head = [Message("system", self.system)] if self.system else []
        messages = [_message(t) for t in self.turns]
        room = self.reply_room()

        def fits(dropped: int) -> bool:
            ids = self.encode(head + messages[2 * dropped:])
            return len(ids) + room <= ctx

        high = len(self.turns) // 2  # dropping ``high`` leaves one message or none
        # Every message takes a token at least (its role's marks), so of more than ``ctx`` of them
        # the oldest are dropped unseen: a template never renders thousands of messages.
        low = min(high, max(0, (len(self.turns) - ctx + 1) // 2))
        if fits(low):
            return low
        while high - low > 1:  # fits(high) or nothing fits; never fits(low)
            middle = (low + high) // 2
            if fits(middle):
                high = middle
            else:
                low = middle
        return high


def _message(turn: Turn) -> Message:
    """A turn as the template renders it: an assistant's thinking apart from its content (each
    family's template keeps or drops earlier turns' thinking its own way)."""
    return Message(turn.role, turn.content, reasoning=turn.reasoning or None)


# -- input -----------------------------------------------------------------------------------------


def history_path() -> Path:
    """The input history: in the user's state directory (XDG), like a shell's."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "llama-chat" / "history"


class ChatInput:
    """Lines from the terminal with readline editing; history in a file unless ``--no-history``.

    Bytes that are not UTF-8 (Latin-1 pasted in, a terminal not set to UTF-8) come in as lone
    surrogates, one a byte, rather than ending the chat with a decoding error: ``message``'s
    caller refuses such a message with a notice (``check_text``) and the chat goes on."""

    def __init__(self, *, history: bool) -> None:
        if isinstance(sys.stdin, io.TextIOWrapper):
            sys.stdin.reconfigure(errors="surrogateescape")  # input() decodes by these, at a terminal too
        self.history_file = history_path() if history else None
        try:
            import readline
        except ImportError:  # a Python without readline: plain input() still works
            readline = None
        self.readline = readline
        if readline is not None:
            readline.set_history_length(HISTORY_LENGTH)
            if self.history_file is not None:
                try:
                    # readline reads the file whole and blocking: a regular file of bounded size only
                    if require_regular(self.history_file).st_size <= MAX_HISTORY_BYTES:
                        readline.read_history_file(self.history_file)
                except OSError:  # missing, a FIFO or a device, unreadable: the chat starts without it
                    pass

    def line(self, prompt: str, text: str = "") -> str:
        """One line, starting as ``text`` (editable); ``EOFError`` on Ctrl+D, ``KeyboardInterrupt``
        on Ctrl+C."""
        readline = self.readline
        if text and readline is not None:
            readline.set_startup_hook(lambda: readline.insert_text(text))
        try:
            with interruptible_prompt():
                return input(prompt)
        finally:
            if text and readline is not None:
                readline.set_startup_hook(None)

    def current_text(self) -> str:
        return self.readline.get_line_buffer() if self.readline is not None else ""

    def message(self, typed: str = "") -> str:
        """One message: a line, or the lines between two \"\"\" fences. ``typed``: text typed during
        the reply (``typeahead.held_typing``), shown as the prompt's text."""
        first = self.line(PROMPT, typed)
        if not first.lstrip().startswith(FENCE):
            self._save()
            return first
        rest = first.lstrip()[len(FENCE):]
        if rest.rstrip().endswith(FENCE) and rest.strip():
            self._save()
            return rest.rstrip()[:-len(FENCE)]
        lines = [rest] if rest else []
        while True:
            line = self.line(CONTINUATION)
            if line.rstrip().endswith(FENCE):
                lines.append(line.rstrip()[:-len(FENCE)])
                break
            lines.append(line)
        self._save()
        return "\n".join(lines).strip("\n")

    def _save(self) -> None:
        if self.readline is None or self.history_file is None:
            return
        # Through a temporary file and a rename, so that a FIFO in the history's place is replaced
        # rather than blocking the chat, and two chats never mix their lines.
        partial = self.history_file.with_name(f".{self.history_file.name}.{os.getpid()}.tmp")
        try:
            self.history_file.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(partial)
            os.replace(partial, self.history_file)
        except OSError:  # a read-only home: the chat goes on without a history file
            try:
                partial.unlink()
            except OSError:
                pass


# -- the loop --------------------------------------------------------------------------------------


def print_wrapped(console: Console, text: Text) -> None:
    """``text`` on ``console``: wrapped at spaces to a terminal's width (rich's wrapping, which
    measures wide characters), whole lines to a pipe or a file."""
    try:
        terminal = console.file.isatty()
    except (AttributeError, OSError, ValueError):
        terminal = False
    console.print(text, highlight=False, soft_wrap=not terminal)


class Leave(Exception):
    def __init__(self, status: int = exit_status.OK) -> None:
        self.status = status


class ChatRunner:
    def __init__(self, chat: Chat, opts: Options, color: str, err: Console, name: str,
                 weights: Callable[[], WeightsSummary] | None = None) -> None:
        self.chat = chat
        self.opts = opts
        self.color = color
        self.err = err
        self.name = name
        self.weights = weights  # the model's weights as they are when /stats asks
        self.typed = ""  # what was typed during the last reply, for the next prompt

    # -- output

    def say(self, message: str, style: str = "dim") -> None:
        """A notice on stderr, wrapped at spaces on a terminal."""
        print_wrapped(self.err, Text(one_line(message), style=style))

    def show(self, text: str) -> None:
        """Text the user asked for (help, settings, stats) on stdout, wrapped at spaces on a terminal."""
        print_wrapped(Console(file=sys.stdout, highlight=False, color_system=None), Text(text))

    def show_typed(self, message: str) -> None:
        """A message that came from a pipe, shown as the user's turn as if it had been typed."""
        lines = displayable(message).split("\n")
        sys.stdout.write(PROMPT + "".join([lines[0], *(f"\n{CONTINUATION}{line}" for line in lines[1:])]) + "\n")
        sys.stdout.flush()

    # -- one reply

    def reply(self) -> None:
        chat = self.chat
        ids = chat.dialog_ids(self.say)
        if ids is None:
            return
        ids = chat.backend.align_to_cache(ids)
        request = chat.settings.request(ids, chat_reply=True, reuse_cache=True, thinker=chat.think)
        seed = request.seed
        typed = Typed()
        try:
            with held_typing() as typed:  # keys pressed meanwhile stay out of the reply
                if request.beams.enabled:
                    outcome: Outcome = self.beam_reply(request)
                else:
                    renderer = make_renderer(sys.stdout.isatty(), self.color, sys.stdout)
                    outcome = anyio.run(partial(run_one_shot, hide_thinking=self.opts.hide_thinking), chat.backend,
                                        request, renderer)
        except KeyboardInterrupt:  # Ctrl+C just before the event loop took the signal over
            chat.turns.append(Turn("assistant", "", interrupted=True))
            self.say("(interrupted)")
            return
        except Exception as e:  # noqa: BLE001 - a failed reply must not end the conversation
            if self.opts.debug:
                import traceback

                traceback.print_exc()
            chat.turns.pop()  # the user message stays unanswered: take it back
            self.say(f"error: {failure_line(e)}", style="bold")
            return
        finally:
            install_sync_handlers()  # the event loop's signal receiver left SIGTERM at its default
            self.typed = typed.text
        done = outcome.completion
        chat.last = done
        chat.last_seed = seed_to_report(seed, given=chat.settings.options.seed,
                                        temperature=request.sampling.temperature)
        interrupted = outcome.signum is not None
        chat.turns.append(Turn("assistant", done.text, interrupted=interrupted, reasoning=done.reasoning))
        if outcome.signum is not None and outcome.signum != signal.SIGINT:
            raise Leave(exit_status.for_signal(outcome.signum))
        if interrupted:
            self.say("(interrupted: the reply so far is kept)")
        elif done.finish_reason not in (GenerationState.EOS, GenerationState.STOP_STRING, GenerationState.STOP_GRAMMAR):
            self.say(f"finish: {done.finish_reason.value}")
        if self.opts.stats:
            self.say(self.stats_text())

    def beam_reply(self, request: Request) -> Outcome:
        """A reply by beam search, which is not streamed: a progress line, then the best beam."""
        from llama_chat.cmd.beam_command import search

        found = search(self.chat.backend, request, self.err)
        best = found.completion.best
        text = best.text if best is not None else ""
        renderer = make_renderer(sys.stdout.isatty(), self.color, sys.stdout)  # wrapped as a streamed reply
        try:
            renderer.start()
            renderer.update(displayable(text), b"", "")
        finally:
            renderer.finish()
        reason = best.finish_reason if best is not None else GenerationState.CANCELLED
        completion = Completion(request.request_id, text, best.token_ids if best is not None else (), reason,
                                len(request.prompt_ids), Timings(None, None, None))
        return Outcome(completion, found.signum, False)

    def stats_text(self) -> str:
        done = self.chat.last
        if done is None:
            return "no reply yet"
        t = done.timings

        def fmt(value: float | None, unit: str, digits: int = 1) -> str:
            return "n/a" if value is None else f"{value:.{digits}f} {unit}"

        used = done.prompt_tokens + done.completion_tokens
        seed = f"  seed: {self.chat.last_seed}" if self.chat.last_seed is not None else ""  # none for greedy
        return (f"prompt: {done.prompt_tokens} tokens ({done.cached_tokens} from the cache, "
                f"{done.prefilled_tokens} prefilled)  reply: {done.completion_tokens} tokens, "
                f"{done.finish_reason.value}  ttft: {fmt(t.ttft_s, 's', 3)}  prefill: {fmt(t.prefill_tok_s, 'tok/s')}  "
                f"decode: {fmt(t.decode_tok_s, 'tok/s')}{drafts_text(done)}  context: {used}/{self.chat.backend.max_seq_len}"
                f"{seed}{self.pages_text()}" + (f"  {weights_text(self.weights())}" if self.weights else ""))

    def pages_text(self) -> str:
        """Where the conversation's keys are: the scheduler's page table (nothing for a remote
        model, whose counters have no pages)."""
        st = getattr(self.chat.backend, "stats", None)
        if st is None or not st.page_size:
            return ""
        return (f"  pages: {st.pages_cached} kept, {st.pages_free} free of {st.pages_total} "
                f"({st.page_size} tokens each)")

    # -- commands

    def command(self, line: str) -> None:
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        chat = self.chat
        if name in ("/exit", "/bye", "/quit"):
            raise Leave()
        if name in ("/help", "/?"):
            self.show(HELP)
        elif name == "/clear":
            chat.turns.clear()
            self.say("the conversation was cleared")
        elif name == "/system":
            chat.system = arg or None
            self.say("system message set" if arg else "system message removed")
        elif name == "/set":
            self.set(arg)
        elif name == "/stats":
            self.show(self.stats_text())
        elif name == "/think":
            self.think(arg)
        elif name == "/save":
            self.save(arg)
        elif name == "/load":
            self.load(arg)
        elif name == "/retry":
            if not chat.turns or chat.turns[-1].role != "assistant":
                self.say("there is no reply to generate again")
                return
            chat.turns.pop()
            self.reply()
        else:
            self.say(f"unknown command {name}; /help lists the commands")

    def think(self, arg: str) -> None:
        """``/think on|off|auto``: a thinking model's thinking for the next replies."""
        settings = self.chat.settings
        if not arg:
            self.show(f"think={settings.options.think}")
            return
        if arg not in THINK_MODES:
            self.say(f"/think takes one of {', '.join(THINK_MODES)}, got {arg!r}")
            return
        if self.chat.think is None:
            self.say(f"{self.name} is not a thinking model: /think changes nothing")
        self.chat.settings = replace(settings, options=settings.options.with_settings(think=arg))
        self.say(f"thinking {arg}")

    def set(self, arg: str) -> None:
        """``/set NAME VALUE`` or ``/set NAME=VALUE``; ``/set NAME`` shows one setting, ``/set`` all."""
        if not arg:
            self.show("  ".join(f"{k}={v}" for k, v in self.chat.settings.as_dict().items()))
            return
        try:
            key, value = split_setting(arg)
            if value is not None:
                self.chat.settings = apply_setting(key, value, self.chat.settings)
        except ValueError as e:
            self.say(f"/set {arg}: {e}")
            return
        self.say(f"{key} = {self.chat.settings.as_dict()[key]}")

    def save(self, path: str) -> None:
        if not path:
            self.say("/save needs a file name")
            return
        chat = self.chat
        data = {"format": SAVE_FORMAT, "model": self.name, "system": chat.system,
                "settings": chat.settings.as_dict(), "messages": [t.as_dict() for t in chat.turns]}
        try:
            save_conversation(path, data)
        except ConversationError as e:
            self.say(f"/save {path}: {e}")
            return
        self.say(f"saved {len(chat.turns)} messages to {path}")

    def load(self, path: str) -> None:
        if not path:
            self.say("/load needs a file name")
            return
        try:
            system, turns = load_conversation(path)
        except ConversationError as e:
            self.say(f"/load {path}: {e}")
            return
        self.chat.system, self.chat.turns = system, turns
        self.say(f"loaded {len(turns)} messages from {path}")


def run_chat(opts: Options, first: str | None, color: str, err: Console) -> int:
    """Load the model and chat until /exit, Ctrl+D or Ctrl+C at an empty prompt; the exit status."""
    with no_control_echo():  # a Ctrl+C leaves no ^C on the screen (cmd/signals.py)
        return _chat(opts, first, color, err)


def _chat(opts: Options, first: str | None, color: str, err: Console) -> int:
    from llama_chat.cmd.run_command import load, warm_up

    settings = opts.source_settings()
    loaded = load(settings.load, err)
    if loaded.chat_format is None:
        raise UsageProblem(f"cannot chat with {loaded.name}: it has no chat format (a plain completion model); "
                           f"choose one with --template llama2|llama3|hf, or pass a prompt with -p")
    backend = make_source(loaded, settings)
    settings = Settings(opts)
    chat = Chat(backend, loaded.chat_format, settings, system=opts.system, think=thinking_model(loaded))
    runner = ChatRunner(chat, opts, color, err, loaded.name, weights=getattr(loaded, "weights", None))
    warm_up(backend, settings.sampling, err, quiet=False)
    reader = ChatInput(history=not opts.no_history)
    runner.say(f"chatting with {loaded.name} ({loaded.chat_format.name} format, {backend.max_seq_len} tokens of "
               f"context); /help for commands, Ctrl+D to leave")
    try:
        if first is not None:
            runner.show_typed(first)
            chat.turns.append(Turn("user", first))
            runner.reply()
        while True:
            try:
                typed, runner.typed = runner.typed, ""
                text = reader.message(typed)
            except EOFError:  # Ctrl+D
                sys.stdout.write("\n")
                return exit_status.OK
            except KeyboardInterrupt:  # Ctrl+C at the prompt
                typed = reader.current_text()
                sys.stdout.write("\n")
                sys.stdout.flush()
                if not typed:
                    return exit_status.OK
                continue
            if not text.strip():
                continue
            try:
                check_text(text, "the message")
            except NotText as e:
                runner.say(f"{e}: not sent; type it again in UTF-8", style="bold")
                continue
            if text.startswith("/") and not text.startswith("//"):
                try:
                    runner.command(text)
                except KeyboardInterrupt:  # Ctrl+C during a command (a slow /load): the chat goes on
                    sys.stdout.write("\n")
                    runner.say("(interrupted)")
                continue
            chat.turns.append(Turn("user", text[1:] if text.startswith("//") else text))
            runner.reply()
    except Leave as leave:
        return leave.status
