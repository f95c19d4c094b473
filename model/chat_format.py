"""Chat formats: a dialog of messages in, the exact token ids a model was trained on out.

Three formats, each building ids from the tokenizer's ids of special tokens, never by tokenizing
strings such as ``"<s>"``:

* ``Llama2ChatFormat``: Meta's Llama 2 chat layout, one ``<s>[INST] ... [/INST] reply </s>`` per turn;
* ``Llama3ChatFormat``: ``<|begin_of_text|>`` then a header and ``<|eot_id|>`` per message;
* ``HFTemplateChatFormat``: the checkpoint's own Jinja ``chat_template``.

``chat_format_for`` picks one; its ``auto`` rule is written there and in docs/tokenizers.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from llama_chat.ml.safe_files import read_regular
from llama_chat.model.errors import ModelLoadError
from llama_chat.model.formats.json_files import read_json
from llama_chat.model.safe_input import BadInput, decode_utf8
from llama_chat.model.tokenizers.base import Tokenizer
from llama_chat.model.tokenizers.specials import split_on_specials, token_name


@dataclass(frozen=True)
class CalledTool:
    """A tool call an assistant message made, as a chat template reads it: ``arguments`` is the
    parsed JSON value (templates write it with ``tojson``), not the text a client sent."""

    id: str
    name: str
    arguments: Any


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    tool_calls: tuple[CalledTool, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning: str | None = None  # an assistant's thinking, apart from its content

    def as_dict(self) -> dict[str, Any]:
        """The message as Hugging Face's ``apply_chat_template`` takes it: OpenAI's shape, with
        ``tool_calls``, ``tool_call_id`` and ``reasoning_content`` (the name Qwen3's template
        reads) only where there are some (templates test ``'tool_calls' in message``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatFormat(Protocol):
    name: str

    def encode_dialog(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                      template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids for the dialog, ending (when asked) where the assistant's reply begins.
        ``template_kwargs``: more variables for a Jinja template (``enable_thinking``); the
        built-in formats have no use for them."""
        ...


# Names a template is given by the renderer itself: a request's own variables may not replace them.
RENDER_NAMES = frozenset(("env", "template", "limit", "messages", "tools", "bos_token", "eos_token", "add_generation_prompt", "raise_exception",
                          "strftime_now"))


FORMAT_NAMES = ("auto", "none", "llama2", "llama3", "hf")
MAX_JSON_INDENT = 64
HINT_FILES = ("chat_format.json", "params.json", "config.json")


# ---------------------------------------------------------------------------------------------
# Llama 2


class Llama2ChatFormat:
    """Meta's Llama 2 chat layout.

    ``[bos] "[INST] {user} [/INST] {assistant} " [eos]`` per finished turn, then
    ``[bos] "[INST] {user} [/INST]"`` for the turn being answered. A system message is folded into
    the first user message as ``"<<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user}"``. Contents are
    stripped, as Meta's reference does. The prompt always ends with ``[/INST]`` after a user
    message, so ``add_generation_prompt`` changes nothing here.
    """

    name = "llama2"

    def __init__(self, tokenizer: Tokenizer) -> None:
        if tokenizer.bos_id is None or tokenizer.eos_id is None:
            raise ModelLoadError("chat format 'llama2' needs a tokenizer with bos and eos ids")
        self.tokenizer = tokenizer

    def encode_dialog(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                      template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        messages = list(messages)
        if messages and messages[0].role == "system":
            system, messages = messages[0], messages[1:]
            if not messages or messages[0].role != "user":
                raise ValueError("llama2 chat: a system message must be followed by a user message")
            first = f"<<SYS>>\n{system.content}\n<</SYS>>\n\n{messages[0].content}"
            messages[0] = Message("user", first)
        _check_alternating(messages)

        tok = self.tokenizer
        ids: list[int] = []
        for user, assistant in zip(messages[::2], messages[1::2]):
            text = f"[INST] {user.content.strip()} [/INST] {assistant.content.strip()} "
            ids += [tok.bos_id, *tok.encode(text), tok.eos_id]
        if len(messages) % 2 == 1:
            ids += [tok.bos_id, *tok.encode(f"[INST] {messages[-1].content.strip()} [/INST]")]
        return ids


def _check_alternating(messages: Sequence[Message]) -> None:
    for i, message in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if message.role != expected:
            raise ValueError(f"chat message {i}: expected role {expected!r}, found {message.role!r}")


# ---------------------------------------------------------------------------------------------
# Llama 3


class Llama3ChatFormat:
    """Meta's Llama 3 chat layout.

    ``<|begin_of_text|>``, then per message ``<|start_header_id|>{role}<|end_header_id|>\\n\\n``
    ``{content}<|eot_id|>``; the generation prompt is an empty assistant header.
    """

    name = "llama3"
    NEEDED = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

    def __init__(self, tokenizer: Tokenizer) -> None:
        specials = tokenizer.special_tokens
        missing = [name for name in self.NEEDED if name not in specials]
        if missing:
            raise ModelLoadError(f"chat format 'llama3' needs {', '.join(missing)} in the tokenizer, not found")
        self.tokenizer = tokenizer
        self._bos, self._start, self._end, self._eot = (specials[name] for name in self.NEEDED)

    def _header(self, role: str) -> list[int]:
        return [self._start, *self.tokenizer.encode(role), self._end, *self.tokenizer.encode("\n\n")]

    def encode_dialog(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                      template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        ids = [self._bos]
        for message in messages:
            ids += [*self._header(message.role), *self.tokenizer.encode(message.content.strip()), self._eot]
        if add_generation_prompt:
            ids += self._header("assistant")
        return ids


# ---------------------------------------------------------------------------------------------
# Hugging Face Jinja chat templates


class ChatTemplateError(ModelLoadError, ValueError):
    """The model's chat template failed: it raised, broke a limit, or hit an error (exit status 2)."""


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Templates expect the Hugging Face flavour: non-ASCII kept as it is.
    if indent is not None and not (isinstance(indent, int) and 0 <= indent <= MAX_JSON_INDENT):
        from llama_chat.model.template_sandbox import TemplateLimitError

        raise TemplateLimitError(f"tojson: indent must be an integer from 0 to {MAX_JSON_INDENT}, found {indent!r}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class HFTemplateChatFormat:
    """Render a checkpoint's ``chat_template`` with Jinja (sandboxed, bounded), then tokenize the text.

    Rendering gets what Hugging Face's ``apply_chat_template`` passes: ``messages`` (dicts),
    ``bos_token``, ``eos_token``, ``add_generation_prompt``, ``raise_exception`` and
    ``strftime_now``. The rendered text is tokenized with special-token names mapped to their
    ids. A bos id is prepended only when the tokenizer starts prompts with bos and the template
    did not already write one, so there is never a doubled bos. The template's output, the size of
    every value it builds and the work it does are bounded (``template_sandbox.py``); whatever goes
    wrong while it renders is a ``ChatTemplateError``.
    """

    name = "hf"

    def __init__(self, template: str, tokenizer: Tokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        from jinja2.exceptions import TemplateSyntaxError

        from llama_chat.model.template_sandbox import MAX_TEMPLATE_CHARS, BoundedSandbox

        if len(template) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"chat template: {len(template):,} characters, more than the limit of "
                                    f"{MAX_TEMPLATE_CHARS:,}")
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = env._bounded_filter("tojson", _tojson)
        env.globals.pop("lipsum", None)  # a text generator, not something a chat template needs
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template)
        except TemplateSyntaxError as exc:
            raise ModelLoadError(f"chat_template: Jinja syntax error on line {exc.lineno}: {exc.message}") from None
        except Exception as exc:  # noqa: BLE001 - compiling runs constant expressions: any error is the file's
            raise ChatTemplateError(f"chat_template: cannot compile it ({type(exc).__name__}: {exc})") from None
        env.install_joins(self._template)
        self._env = env
        self.template = template  # its text: tool-call formats are told from it
        self.tokenizer = tokenizer
        names = {i: name for name, i in tokenizer.special_tokens.items()}
        self.bos_token = bos_token if bos_token is not None else names.get(tokenizer.bos_id, "")
        self.eos_token = eos_token if eos_token is not None else names.get(tokenizer.eos_id, "")

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None, template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The template's text; ``ChatTemplateError`` (a ValueError) when the template fails.
        ``tools``: OpenAI's tool objects, passed to the template as ``tools`` when there are any.
        ``template_kwargs``: more variables (``chat_template_kwargs``, ``enable_thinking``), as
        ``apply_chat_template`` takes them; none may replace a name of the renderer's own."""
        from llama_chat.model.template_sandbox import TemplateLimitError, iter_limit, render_bounded

        dicts = [m.as_dict() for m in messages]
        sized = [m.content + (m.reasoning or "") for m in messages]
        if tools or any(m.tool_calls for m in messages):
            sized.append(json.dumps([tools, [d.get("tool_calls") for d in dicts]], ensure_ascii=False))
        extra = {"tools": list(tools)} if tools else {}
        for name, value in (template_kwargs or {}).items():
            if name in RENDER_NAMES:
                raise ChatTemplateError(f"chat template: {name} is set by the server and cannot be a template variable")
            extra[name] = value
            sized.append(json.dumps(value, ensure_ascii=False, default=str))
        try:
            return render_bounded(
                self._env, self._template, iter_limit(iter(sized)),
                messages=dicts,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        except TemplateLimitError as exc:
            raise ChatTemplateError(f"chat template: {exc}") from None
        except RecursionError:
            raise ChatTemplateError("chat template: recursion too deep") from None
        except MemoryError:
            raise ChatTemplateError("chat template: out of memory") from None
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception, or any error in it
            from jinja2.exceptions import TemplateError

            detail = str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"
            raise ChatTemplateError(f"chat template: {detail}") from None

    def encode_dialog(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                      tools: Sequence[dict] | None = None, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        text = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                           template_kwargs=template_kwargs)
        ids = encode_allowing_special(self.tokenizer, text)
        tok = self.tokenizer
        if getattr(tok, "add_bos", True) and tok.bos_id is not None and ids[:1] != [tok.bos_id]:
            ids.insert(0, tok.bos_id)
        return ids


def encode_allowing_special(tokenizer: Tokenizer, text: str) -> list[int]:
    """Tokenize rendered template text, special-token names becoming their ids."""
    native = getattr(tokenizer, "encode_allowing_special", None)
    if native is not None:
        return native(text)
    ids: list[int] = []
    for chunk, special_id in split_on_specials(text, tokenizer.special_tokens):
        ids.extend([special_id] if special_id is not None else tokenizer.encode(chunk))
    return ids


# ---------------------------------------------------------------------------------------------
# choosing a format


def read_chat_template(model_dir: Path) -> tuple[str | None, dict]:
    """The checkpoint's chat template and its tokenizer_config.json (``{}`` when absent).

    Looked up in ``tokenizer_config.json`` (``chat_template``: a string, or a list of
    ``{"name", "template"}`` of which ``default`` is used), then ``chat_template.jinja``, then
    ``chat_template.json``.
    """
    config_path = model_dir / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja = model_dir / "chat_template.jinja"
    if template is None and (jinja.exists() or jinja.is_symlink()):
        template = _read_template_file(jinja)
    if template is None and (model_dir / "chat_template.json").is_file():
        template = read_json(model_dir / "chat_template.json").get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ModelLoadError(f"{config_path}: chat_template must be a string, found {type(template).__name__}")
    return template, config


def _read_template_file(path: Path) -> str:
    """A ``chat_template.jinja``: a regular file of UTF-8 text, no larger than a template may be."""
    from llama_chat.model.template_sandbox import MAX_TEMPLATE_CHARS

    try:
        return decode_utf8(read_regular(path, 4 * MAX_TEMPLATE_CHARS))
    except OSError as e:
        raise ModelLoadError(f"{path}: cannot read it ({e.strerror or e})") from None
    except BadInput as e:
        raise ModelLoadError(f"{path}: {e}") from None


def chat_format_from_file(path: Path, tokenizer: Tokenizer) -> HFTemplateChatFormat:
    """A Jinja chat template from a file of its own (``--chat-template-file``), in place of the
    model's: ``ModelLoadError`` naming the file when it cannot be read or compiled."""
    try:
        return HFTemplateChatFormat(_read_template_file(Path(path)), tokenizer)
    except ModelLoadError as e:
        message = str(e)
        raise ModelLoadError(message if message.startswith(str(path)) else f"{path}: {message}") from None


def chat_format_hint(model_dir: Path) -> str | None:
    """An explicit ``"chat_format"`` field in chat_format.json, params.json or config.json."""
    for name in HINT_FILES:
        path = model_dir / name
        if not path.is_file():
            continue
        value = read_json(path).get("chat_format")
        if value is None:
            continue
        if value not in FORMAT_NAMES or value == "auto":
            raise ModelLoadError(f"{path}: chat_format must be one of none, llama2, llama3, hf; found {value!r}")
        return value
    return None


def chat_format_for(model_dir: Path, tokenizer: Tokenizer, name: str = "auto") -> ChatFormat | None:
    """The chat format to use, or None for plain completion.

    ``auto`` takes, in order: an explicit ``"chat_format"`` field (chat_format.json, params.json,
    config.json); the checkpoint's Jinja chat template; ``llama3`` when the tokenizer has
    ``<|start_header_id|>``; otherwise None. A SentencePiece Llama 2 chat model cannot be told
    from its base model by its files, so it needs the explicit field.
    """
    if name not in FORMAT_NAMES:
        raise ValueError(f"unknown chat format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    model_dir = Path(model_dir)
    if name == "auto":
        name = chat_format_hint(model_dir) or "auto"
    if name == "none":
        return None
    if name == "llama2":
        return Llama2ChatFormat(tokenizer)
    if name == "llama3":
        return Llama3ChatFormat(tokenizer)

    template, config = read_chat_template(model_dir)
    if template is not None:
        return HFTemplateChatFormat(template, tokenizer, bos_token=token_name(config.get("bos_token")),
                                    eos_token=token_name(config.get("eos_token")))
    if name == "hf":
        raise ModelLoadError(f"{model_dir / 'tokenizer_config.json'}: no chat_template for chat format 'hf'")
    if "<|start_header_id|>" in tokenizer.special_tokens:
        return Llama3ChatFormat(tokenizer)
    return None


def chat_format_from_template(template: str | None, tokenizer: Tokenizer, name: str = "auto", *,
                              where: str = "chat template") -> ChatFormat | None:
    """The chat format of a model whose template comes with its weights (a GGUF file).

    The same rule as ``chat_format_for`` without the files of a model directory: a named format
    is that format; ``auto`` and ``hf`` take the template when there is one; ``auto`` without one
    is ``llama3`` when the tokenizer has ``<|start_header_id|>``, else plain completion.
    """
    if name not in FORMAT_NAMES:
        raise ValueError(f"unknown chat format {name!r}; expected one of {', '.join(FORMAT_NAMES)}")
    if name == "none":
        return None
    if name == "llama2":
        return Llama2ChatFormat(tokenizer)
    if name == "llama3":
        return Llama3ChatFormat(tokenizer)
    if template is not None:
        return HFTemplateChatFormat(template, tokenizer)
    if name == "hf":
        raise ModelLoadError(f"{where}: not in the file, so chat format 'hf' cannot be used")
    if "<|start_header_id|>" in tokenizer.special_tokens:
        return Llama3ChatFormat(tokenizer)
    return None
