"""A streamed message: the chat pipeline's deltas (thinking split off, tool calls parsed)
as Anthropic's server-sent events.

message_start, ping, then per content block content_block_start, its deltas
(thinking_delta, text_delta, input_json_delta) and content_block_stop, then
message_delta (stop_reason, stop_sequence, usage) and message_stop. A failure after the
stream has begun is an `error` event, and the stream ends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from openai_frontend.anthropic import responses
from openai_frontend.anthropic.errors import AnthropicError
from openai_frontend.generation.deltas import Delta
from openai_frontend.generation.engine_client import EngineError


def event(kind: str, payload: dict[str, Any]) -> str:
    data = json.dumps({"type": kind, **payload}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


@dataclass(slots=True)
class _Blocks:
    """The content blocks so far: which one is open, and each tool call's block."""

    count: int = 0
    open_kind: str | None = None
    calls: dict[int, int] = field(default_factory=dict)  # tool-call index -> block index

    def start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self.stop()
        self.open_kind = kind
        self.count += 1
        return [*events, event("content_block_start", {"index": self.count - 1, "content_block": block})]

    def stop(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [event("content_block_stop", {"index": self.count - 1})]

    def delta(self, kind: str, block: dict[str, Any], delta: dict[str, Any]) -> list[str]:
        events = self.start(kind, block) if self.open_kind != kind else []
        return [*events, event("content_block_delta", {"index": self.count - 1, "delta": delta})]


def _piece_events(blocks: _Blocks, delta: Delta) -> list[str]:
    events: list[str] = []
    if delta.reasoning:
        empty = responses.thinking_block("")
        events += blocks.delta("thinking", empty, {"type": "thinking_delta", "thinking": delta.reasoning})
    if delta.text:
        events += blocks.delta("text", responses.text_block(""), {"type": "text_delta", "text": delta.text})
    for call in delta.tool_calls or ():
        function = call.get("function") or {}
        if call["index"] not in blocks.calls:
            block = {"type": "tool_use", "id": responses.tool_use_id(), "name": function.get("name", ""), "input": {}}
            events += blocks.start("tool_use", block)
            blocks.calls[call["index"]] = blocks.count - 1
        if function.get("arguments"):
            piece = {"type": "input_json_delta", "partial_json": function["arguments"]}
            events.append(event("content_block_delta", {"index": blocks.calls[call["index"]], "delta": piece}))
    return events


async def message_events(
    start: dict[str, Any],
    first: Delta,
    rest: AsyncIterator[Delta],
    to_error: Callable[[Exception], AnthropicError],
) -> AsyncIterator[str]:
    """The whole event stream of one choice; `first` was awaited before the response
    began, so that a refused request still got its HTTP status."""
    blocks = _Blocks()
    async with aclosing(rest):
        try:
            yield event("message_start", {"message": start})
            yield event("ping", {})
            async for delta in _chained(first, rest):
                for line in _piece_events(blocks, delta):
                    yield line
                if delta.final is not None:
                    for line in _closing(blocks, delta):
                        yield line
                    return
            raise EngineError("the generation ended without a final event")
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
            yield event("error", {"error": to_error(exc).error()})


def _closing(blocks: _Blocks, delta: Delta) -> list[str]:
    reason, sequence = responses.stop_of(delta.final, delta.stop_string)
    ending = {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": responses.usage(delta.final)}
    return [*blocks.stop(), event("message_delta", ending), event("message_stop", {})]


async def _chained(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    async for item in rest:
        yield item
