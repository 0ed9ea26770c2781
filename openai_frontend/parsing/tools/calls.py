"""What tool parsing produces: whole tool calls, and the deltas a stream sends.

A stream's `Delta` is either content text (a `str`) or a tool-call delta (a `dict`)
already in the OpenAI shape, so the frontend can put it in `delta.tool_calls` as is:
the first delta of a call carries its index, id, type and name with empty arguments,
the next ones pieces of its arguments.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

Delta = str | dict[str, Any]


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One complete, well-formed call. `arguments` is a JSON object's text, exactly as
    the model wrote it (from its `{` to its `}`), so streamed pieces add up to it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_header(index: int, call_id: str, name: str) -> dict[str, Any]:
    """The first delta of a call: who is called, no arguments yet."""
    return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}


def arguments_piece(index: int, text: str) -> dict[str, Any]:
    """A further delta of a call: the next piece of its arguments' JSON text."""
    return {"index": index, "function": {"arguments": text}}
