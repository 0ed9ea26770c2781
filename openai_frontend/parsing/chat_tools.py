"""Tool calling in a chat request: prompting, constraining and parsing, around one parser.

- Prompting: the chat template receives the tools when it has a tools section;
  otherwise the parser's default system prompt (the tools as JSON and the exact call
  format) goes into the system message, and earlier assistant calls are written back
  into their messages in that same format, so the model sees its own history.
- Constraining: `tool_choice` "required" or a named function forces a call from the
  first token; "auto" (the default with tools) leaves text free until the trigger and
  then forces a well-formed call of a listed tool; "none" constrains nothing. The
  grammar travels as the request's `grammar_kind` / `grammar_spec`; its guards'
  `tools_present`, `require_tool_call` and `suppress_tool_call` tell the engine the rest.
- A tool loop (the same call with the same arguments in the last three assistant turns)
  sets `suppress_tool_call`, which keeps the model from opening another call.
- Parsing: the whole output (`parse`) or its deltas (`stream`); calls become
  `message.tool_calls` / `delta.tool_calls` and the finish reason "tool_calls".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from backend.contract import FinalEvent, FinishGuard, FinishReason, GenerationRequest
from openai_frontend.api.errors import bad_request
from openai_frontend.generation.deltas import Delta
from openai_frontend.parsing.tools import ToolParser, tool_loop_detected, validate_tools


@dataclass(slots=True)
class ChatTools:
    """One request's tools, checked, and what they do to the prompt and the fields."""

    parser: ToolParser
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel: bool
    answer: dict[str, Any] | None = None  # the JSON schema a text answer follows (response_format)
    legacy: bool = False  # the request used the older `functions`: its call is a `function_call`

    @classmethod
    def of(cls, parser: ToolParser, body) -> ChatTools | None:
        """The request's tools (None without tools or with tool_choice "none"); a bad
        `tools` or `tool_choice` is a 400 naming it."""
        try:
            validate_tools(body.tools, body.tool_choice)
        except ValueError as exc:
            message = str(exc)
            param = "tool_choice" if message.startswith("tool_choice") else "tools"
            raise bad_request(param, message) from None
        if not body.tools or body.tool_choice == "none":
            return None
        parallel = body.parallel_tool_calls is not False
        answer = body.response_format.answer_schema() if body.response_format is not None else None
        return cls(parser, body.tools, body.tool_choice or "auto", parallel, answer, body.legacy_functions)

    # -- the prompt -------------------------------------------------------

    def template_messages(self, messages: list[dict[str, Any]], template_has_tools: bool) -> list[dict[str, Any]]:
        """The conversation as the chat template should see it."""
        if template_has_tools:
            return messages
        messages = [self._with_calls_as_text(m) for m in messages]
        prompt = self.parser.system_prompt(self.tools)
        if messages and messages[0]["role"] in ("system", "developer"):
            first = messages[0]
            return [{**first, "content": f"{first['content']}\n\n{prompt}".lstrip()}, *messages[1:]]
        return [{"role": "system", "content": prompt}, *messages]

    def _with_calls_as_text(self, message: dict[str, Any]) -> dict[str, Any]:
        calls = message.get("tool_calls") or []
        if message["role"] != "assistant" or not calls:
            return message
        rendered = self.parser.call_format.render([_name_and_arguments(call) for call in calls])
        content = message.get("content") or ""
        return {**message, "content": f"{content}\n{rendered}".lstrip("\n")}

    # -- the request ---------------------------------------------------------

    def constrain(self, request: GenerationRequest, messages: list[dict[str, Any]]) -> None:
        """The tools' grammar (response_format's answer schema inside it) and the engine's
        tool guards. A beam search follows no grammar (api/beams.py refuses a forced call):
        its calls are parsed from its text."""
        kind_spec = None
        if request.num_beams == 1:
            kind_spec = self.parser.compile_tool_grammar(self.tools, self.tool_choice, self.parallel, self.answer)
        forced = self.tool_choice != "auto"
        guards = request.guards
        guards.tools_present, guards.require_tool_call = True, forced
        if kind_spec is not None:
            request.grammar_kind, request.grammar_spec = kind_spec
        guards.suppress_tool_call = not forced and tool_loop_detected(messages)

    # -- the output -----------------------------------------------------------

    def settle(self, final: FinalEvent, called: bool) -> None:
        """The final event's finish reason, now that the calls are known."""
        reason = finish_reason(final.finish_reason, called, final.finish_guard)
        legacy_call = self.legacy and reason is FinishReason.TOOL_CALLS
        final.finish_reason = FinishReason.FUNCTION_CALL if legacy_call else reason

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        content, calls = self.parser.parse(text, self.tools)
        return content, [call.to_openai() for call in calls]

    async def stream(self, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """The deltas with their text split into content and tool-call deltas (or, for the
        older `functions`, function_call deltas); the finish reason becomes "tool_calls"
        ("function_call") when the turn made any."""
        parsed = self.parser.stream(self.tools)
        async with aclosing(deltas):
            async for delta in deltas:
                pieces = parsed.feed(delta.text)
                if delta.final is not None:
                    pieces += parsed.finish()
                    self.settle(delta.final, bool(parsed.tool_calls))
                delta.text = "".join(p for p in pieces if isinstance(p, str))
                calls = _one_entry_per_index([p for p in pieces if isinstance(p, dict)])
                if self.legacy:  # one call at most: its function's pieces
                    delta.function_call = calls[0]["function"] if calls else None
                else:
                    delta.tool_calls = calls or None
                yield delta


# guards that cut an answer short: a turn that made its calls before one fired still
# reports "tool_calls" (the higher rung); max_tokens and the context length do not
_GUARD_CUTS = frozenset({FinishGuard.CONTENT_LOOP, FinishGuard.DEADLINE})


def finish_reason(finish: FinishReason, called: bool, guard: FinishGuard) -> FinishReason:
    """A turn that called tools finishes with "tool_calls" when it ended by itself (or a
    loop or deadline guard cut what came after its calls); one cut by max_tokens stays
    "length"."""
    if called and (finish is FinishReason.STOP or guard in _GUARD_CUTS):
        return FinishReason.TOOL_CALLS
    return finish


def _one_entry_per_index(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chunk's tool-call deltas with each index once (OpenAI's shape): a later piece of
    the same call joins the earlier entry's arguments (feed and finish may both add one)."""
    merged: dict[int, dict[str, Any]] = {}
    for call in calls:
        entry = merged.get(call["index"])
        if entry is None:
            merged[call["index"]] = call
        else:
            entry["function"]["arguments"] += call["function"]["arguments"]
    return list(merged.values())


def _name_and_arguments(call: dict[str, Any]) -> tuple[str, str]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return str(function.get("name", "")), arguments
