"""Tool calls as an xgrammar structural tag, so the engine can only sample valid calls.

The spec is the JSON text of an `xgrammar.StructuralTag` ({"type": "structural_tag",
"format": ...}), compiled by `GrammarCompiler.compile_structural_tag` (xgrammar 0.2.9).
Each tool becomes a tag: the fixed text up to its arguments, the arguments constrained
by the tool's parameter schema, then the fixed text after them. The `tool_choice`
decides how tags combine:

- "auto": free text until the format's trigger, then calls; after the calls only EOS
  (`triggered_tags` with `stop_after_first`, then, if parallel, more calls).
- "required": calls from the first token, nothing else (`tags_with_separator`, at
  least one; exactly one unless parallel).
- a named function: exactly one call of that function from the first token.

With an answer format (response_format with tools, "auto"), the model either calls
tools from its first token or answers in that format: an `or` of the calls and the
answer's JSON schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# What a tool without `parameters` takes: nothing (OpenAI's rule).
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How a format writes calls when it writes them canonically: what the grammar
    forces and the system prompt shows. Parsing accepts more (see `CallSyntax`)."""

    trigger: str  # starts the calls in free text; a prefix of `section[0]` or of `begin`
    begin: str  # before a call's arguments, with a `{name}` field
    end: str  # after a call's arguments
    separator: str  # between two calls
    section: tuple[str, str] | None = None  # around the list of calls, if the format has one

    def render(self, calls: Sequence[tuple[str, str]]) -> str:
        """The exact text of (name, arguments JSON) calls in this format."""
        text = self.separator.join(self.begin.format(name=name) + arguments + self.end for name, arguments in calls)
        return self.section[0] + text + self.section[1] if self.section else text


def structural_tag(
    call_format: CallFormat,
    tools: Sequence[dict[str, Any]],
    forced_name: str | None,
    required: bool,
    parallel: bool,
    answer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The structural tag for `tools`; `forced_name` or `required` force calls from the start;
    `answer`: the JSON schema a text answer must follow instead of free text."""
    chosen = [tool for tool in tools if forced_name in (None, tool["function"]["name"])]
    tags = [_call_tag(call_format, tool) for tool in chosen]
    calls = _section(call_format, _calls(call_format, tags, one_or_more=forced_name is None and parallel))
    if forced_name is not None or required:
        return _top(calls)
    if answer is not None:
        return _top({"type": "or", "elements": [calls, {"type": "json_schema", "json_schema": answer}]})
    if call_format.section:  # the whole section is one tag, opened by the trigger
        return _top(_free_text_then([calls], call_format.trigger))
    first = _free_text_then(tags, call_format.trigger)
    if not parallel:
        return _top(first)
    more = {"type": "sequence", "elements": [_const(call_format.separator), {"type": "or", "elements": tags}]}
    return _top({"type": "sequence", "elements": [first, {"type": "star", "content": more}]})


def structural_tag_spec(*args: Any, **kwargs: Any) -> str:
    """`structural_tag` as the JSON text the engine's `grammar_spec` carries."""
    return json.dumps(structural_tag(*args, **kwargs), ensure_ascii=False)


def _call_tag(call_format: CallFormat, tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    schema = function.get("parameters") or NO_PARAMETERS
    return {
        "type": "tag",
        "begin": call_format.begin.format(name=function["name"]),
        "content": {"type": "json_schema", "json_schema": schema},
        "end": call_format.end,
    }


def _calls(call_format: CallFormat, tags: list[dict[str, Any]], one_or_more: bool) -> dict[str, Any]:
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": call_format.separator,
        "at_least_one": True,
        "stop_after_first": not one_or_more,
    }


def _section(call_format: CallFormat, calls: dict[str, Any]) -> dict[str, Any]:
    if call_format.section is None:
        return calls
    begin, end = call_format.section
    return {"type": "tag", "begin": begin, "content": calls, "end": end}


def _free_text_then(tags: list[dict[str, Any]], trigger: str) -> dict[str, Any]:
    """Any text without the trigger, optionally one of `tags` (each begins with it), then the end."""
    return {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": True}


def _top(fmt: dict[str, Any]) -> dict[str, Any]:
    return {"type": "structural_tag", "format": fmt}


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}
