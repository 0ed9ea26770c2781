"""The model's chat template, rendered in a sandbox with a time and an output budget.

Only the model's own template runs: a request brings variables (`chat_template_kwargs`),
never template code (`template_variables` refuses the keys that would replace the
template or the renderer's own names). The template is compiled once in a Jinja
sandbox laid out as transformers lays out its own (the same filters, globals and tags,
so the prompt is the same text `apply_chat_template` renders), whose operations also
draw on a budget: every call, attribute and item lookup ticks a meter that stops the
render past CHAT_TEMPLATE_TIMEOUT_S, and the rendered text is counted as it is produced
and stopped past CHAT_TEMPLATE_MAX_CHARS. `*` and `**` are checked before they run, so
a template cannot build a giant string or number in one operation. Renders run on the
frontend's text threads (generation/tokenization.py), never on the event loop.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from openai_frontend.api.errors import bad_request

# The renderer's own names: a request's variables may not replace them (nor the template).
RESERVED_VARIABLES = frozenset(
    {"chat_template", "messages", "tools", "documents", "add_generation_prompt", "continue_final_message"}
    | {"raise_exception", "strftime_now", "dict", "namespace"}
)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' order
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_MAX_REASON_CHARS = 300
_CHECK_EVERY = 64  # meter ticks between two looks at the clock


@dataclass(frozen=True, slots=True)
class TemplateBudget:
    """What one render may take: seconds, and characters of output."""

    max_seconds: float = 2.0
    max_chars: int = 4_000_000

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> TemplateBudget:
        seconds = environ.get("CHAT_TEMPLATE_TIMEOUT_S", "").strip()
        chars = environ.get("CHAT_TEMPLATE_MAX_CHARS", "").strip()
        budget = cls(float(seconds) if seconds else 2.0, int(chars) if chars else 4_000_000)
        if budget.max_seconds <= 0 or budget.max_chars < 1:
            raise ValueError("CHAT_TEMPLATE_TIMEOUT_S and CHAT_TEMPLATE_MAX_CHARS must be positive")
        return budget


class BudgetExceeded(Exception):
    """A render went past its budget (the message says which and the setting)."""


class _Meter:
    def __init__(self, budget: TemplateBudget):
        self.budget = budget
        self.deadline = time.monotonic() + budget.max_seconds
        self.ticks = 0
        self.chars = 0

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks % _CHECK_EVERY == 0:
            self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(
                f"rendering the chat template took longer than {self.budget.max_seconds:g} s "
                "(the server's CHAT_TEMPLATE_TIMEOUT_S)"
            )

    def add_output(self, size: int) -> None:
        self.chars += size
        if self.chars > self.budget.max_chars:
            raise BudgetExceeded(
                f"the chat template's output is longer than {self.budget.max_chars} characters "
                "(the server's CHAT_TEMPLATE_MAX_CHARS)"
            )
        self.check_time()


_meter: ContextVar[_Meter | None] = ContextVar("chat_template_meter", default=None)


def _tick() -> _Meter | None:
    meter = _meter.get()
    if meter is not None:
        meter.tick()
    return meter


class _BudgetedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, whose operations draw on the render's budget."""

    intercepted_binops = frozenset({"*", "**"})

    def call(self, __context, __obj, *args, **kwargs):
        _tick()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        meter = _tick()
        if meter is not None:
            _check_binop(operator, left, right, meter.budget.max_chars)
        return super().call_binop(context, operator, left, right)


def _check_binop(operator: str, left: Any, right: Any, max_chars: int) -> None:
    """Refuse a repetition longer than the output budget, or a power too large to compute."""
    if operator == "*":
        sized, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(sized, (str, list, tuple)) and isinstance(count, int) and len(sized) * count > max_chars:
            raise BudgetExceeded(f"the chat template built a value longer than {max_chars} characters")
    elif isinstance(left, int) and isinstance(right, int) and abs(right) > 64 and abs(left) > 1:
        raise BudgetExceeded("the chat template raised a number to a power too large to compute")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it; the text renders as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore names (no reach into Python's internals)."""

    def __init__(*args, **kwargs):  # Jinja's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace may not hold the underscore name {name!r}")


class _TemplateDict:
    """dict() and dict.fromkeys() for templates, without the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; transformers' (and so every template's) does not
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> _BudgetedSandbox:
    env = _BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_TemplateDict(),
        namespace=_Namespace,
    )
    return env


def template_variables(kwargs: Mapping[str, Any] | None, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's template variables; a 400 naming a key that would replace the template or
    one of the renderer's names."""
    variables = dict(kwargs or {})
    for key in variables:
        if key in RESERVED_VARIABLES:
            what = "template code is not accepted" if key == "chat_template" else f"{key!r} is the renderer's own"
            raise bad_request(f"{param}.{key}", f"{param}.{key}: {what}; {param} carries template variables only")
    return variables


class ChatTemplate:
    """The tokenizer's chat template(s), compiled once; `render` within the budget."""

    def __init__(self, tokenizer, budget: TemplateBudget):
        self.tokenizer = tokenizer
        self.budget = budget
        self._env = _environment()
        self._compiled: dict[str, jinja2.Template] = {}

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        variables: Mapping[str, Any],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation as text; raises BudgetExceeded, or jinja's errors for a
        conversation the template refuses."""
        try:
            source = self.tokenizer.get_chat_template(None, tools)
        except ValueError as exc:  # transformers' words: the folder has no chat template
            raise jinja2.exceptions.TemplateError(str(exc)) from None
        template = self._compiled.get(source) or self._compiled.setdefault(source, self._env.from_string(source))
        chat = [_aliased({k: v for k, v in message.items() if v is not None}) for message in messages]
        if continue_final_message:
            chat, final = _tagged_final(chat)
        context = {**self.tokenizer.special_tokens_map, **variables}
        context.update(messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt)
        text = self._generate(template, context)
        return _cut_at_tag(text, final) if continue_final_message else text

    def _generate(self, template: jinja2.Template, context: dict[str, Any]) -> str:
        meter = _Meter(self.budget)
        token = _meter.set(meter)
        try:
            pieces = []
            for piece in template.generate(**context):
                meter.add_output(len(piece))
                pieces.append(piece)
            return "".join(pieces)
        finally:
            _meter.reset(token)


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under both names templates read (transformers' rule)."""
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tagged_final(chat: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The chat with a tag after its final message's text, and that text (continue_final_message)."""
    last = dict(chat[-1])
    content = last.get("content")
    if not isinstance(content, str):
        raise jinja2.exceptions.TemplateError("continue_final_message needs a final message with text content")
    last["content"] = content + _CONTINUE_TAG
    return [*chat[:-1], last], content


def _cut_at_tag(text: str, final: str) -> str:
    """The render up to the final message's end: the template's closing of it is cut."""
    at = text.rfind(_CONTINUE_TAG.strip())
    if at < 0 or final.strip() not in text:
        raise jinja2.exceptions.TemplateError("the chat template dropped the final message, which cannot be continued")
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def template_failure(exc: Exception) -> str:
    """What went wrong in a render, for the client: the template's own words or the
    budget's, never a Python object's address or a traceback."""
    if isinstance(exc, BudgetExceeded):
        return str(exc)
    if isinstance(exc, jinja2.exceptions.TemplateError):
        reason = _ADDRESS.sub("0x...", " ".join(str(exc).split()))
        if len(reason) > _MAX_REASON_CHARS:
            reason = reason[:_MAX_REASON_CHARS] + "..."
        return f"the chat template refused this conversation: {reason}"
    return f"the chat template failed on this conversation ({type(exc).__name__})"
