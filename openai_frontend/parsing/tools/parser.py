"""The base class of tool parsers: one format of tool calls, read, constrained and taught.

A subclass is data: its `syntax` (what parsing accepts) and `call_format` (what the
grammar forces and the system prompt shows; always accepted by `syntax`), built from
the model's call tags.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, ClassVar

from openai_frontend.parsing.tools.calls import ToolCall
from openai_frontend.parsing.tools.grammar import CallFormat, structural_tag_spec
from openai_frontend.parsing.tools.stream import ToolCallStream
from openai_frontend.parsing.tools.syntax import CallSyntax

Tools = Sequence[dict[str, Any]]


class ToolParser:
    """Tool calls in one format. Stateless: one instance serves every request."""

    name: ClassVar[str]
    syntax: CallSyntax
    call_format: CallFormat

    @property
    def tool_call_trigger(self) -> str:
        """The text that starts tool calls in free text (what "auto" grammars wait for)."""
        return self.call_format.trigger

    def parse(self, text: str, tools: Tools | None = None) -> tuple[str | None, list[ToolCall]]:
        """Content and well-formed calls of a whole output (see `stream` for the rules).

        With `tools`, a call of a function not among them is content, not a call.
        """
        stream = self.stream(tools)
        deltas = stream.feed(text) + stream.finish()
        content = "".join(delta for delta in deltas if isinstance(delta, str))
        return content or None, stream.tool_calls

    def stream(self, tools: Tools | None = None) -> ToolCallStream:
        """A stream for one output: `feed(text_delta)` and `finish()` return deltas."""
        names = frozenset(tool["function"]["name"] for tool in tools) if tools else None
        return ToolCallStream(self.syntax, names)

    def compile_tool_grammar(
        self,
        tools: Tools | None,
        tool_choice: str | dict[str, Any] | None,
        parallel_tool_calls: bool = True,
        answer: dict[str, Any] | None = None,
    ) -> tuple[str, str] | None:
        """(grammar_kind, grammar_spec) constraining the output to `tool_choice`, or None
        when nothing is constrained. `tool_choice` None means "auto"; `answer`: the JSON
        schema a text answer follows (response_format). Assumes the request passed
        `validate_tools`."""
        if not tools or tool_choice == "none":
            return None
        forced = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        required = tool_choice == "required"
        spec = structural_tag_spec(self.call_format, tools, forced, required, parallel_tool_calls, answer)
        return "structural_tag", spec

    def system_prompt(self, tools: Tools) -> str:
        """Tells the model the tools and the exact call format, for chat templates with no
        tools section. Short: the default model is tiny."""
        listing = "\n".join(json.dumps(_describe(tool), ensure_ascii=False) for tool in tools)
        example = self.call_format.render([("function_name", '{"argument_name": "value"}')])
        return (
            "You can call these functions:\n"
            f"{listing}\n"
            "To call a function, reply with only this, using the function's name and its arguments as JSON:\n"
            f"{example}"
        )


def _describe(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool as OpenAI writes it, trimmed. Not `{"name": ..., "parameters": ...}`,
    which is itself a call in some formats."""
    function = tool["function"]
    described = {"name": function["name"]}
    if function.get("description"):
        described["description"] = function["description"]
    described["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": described}
