"""A streamed response: the generation's parsed deltas as the Responses API's typed events.

`event: <type>` + `data: <json>` lines, each event with its `sequence_number`:
response.created, response.in_progress; per output item (reasoning, message, function
call, in the order they begin) output_item.added, then its deltas
(reasoning_text.delta; content_part.added + output_text.delta; function_call_arguments.delta),
then its .done events and output_item.done; last response.completed or
response.incomplete (max_output_tokens). An error after the stream began is an `error`
event. There is no `[DONE]` (OpenAI sends none for this API).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from openai_frontend.api.errors import OpenAIError
from openai_frontend.generation.deltas import Delta
from openai_frontend.generation.engine_client import EngineError
from openai_frontend.responses_api import output


class ResponseEvents:
    """The events of one response, numbered; the items open now, and all of them."""

    def __init__(self, response: dict[str, Any]):
        self.response = response
        self.items: list[dict[str, Any]] = []
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item receiving deltas
        self._calls: dict[int, dict[str, Any]] = {}  # a call's stream index -> its item

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        return [
            self.event("response.created", response=self.response),
            self.event("response.in_progress", response=self.response),
        ]

    def delta(self, delta: Delta) -> list[str]:
        events = []
        if delta.reasoning:
            events += self._into("reasoning", lambda: output.reasoning_item("", "in_progress"))
            events.append(self._piece("response.reasoning_text.delta", delta.reasoning))
        if delta.text:
            events += self._into("message", lambda: output.message_item(None, "in_progress"))
            events.append(self._piece("response.output_text.delta", delta.text, logprobs=[]))
        for call in delta.tool_calls or []:
            events += self._call(call)
        return events

    def _into(self, kind: str, make: Callable[[], dict[str, Any]]) -> list[str]:
        """Events opening a new item of `kind` (closing the open one) unless it is open."""
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close()
        item = make()
        self._open = item
        self.items.append(item)
        events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if kind == "message":
            item["content"].append(output.text_part(""))
            part = output.text_part("")
            events.append(self.event("response.content_part.added", **self._at(), content_index=0, part=part))
        return events

    def _at(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}

    def _piece(self, kind: str, text: str, **extra: Any) -> str:
        item = self._open
        if item["type"] == "message":
            item["content"][0]["text"] += text
        else:
            if not item["content"]:
                item["content"].append({"type": "reasoning_text", "text": ""})
            item["content"][0]["text"] += text
        return self.event(kind, **self._at(), content_index=0, delta=text, **extra)

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = []
        item = self._calls.get(call["index"])
        if item is None:
            header = {"id": call.get("id"), "function": {"name": call["function"].get("name", ""), "arguments": ""}}
            events += self._into("function_call", lambda: output.call_item(header, "in_progress"))
            item = self._calls[call["index"]] = self._open
        pieces = call["function"].get("arguments") or ""
        if pieces:
            item["arguments"] += pieces
            index = self.items.index(item)
            events.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=pieces
                )
            )
        return events

    def _close(self) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        at = {"item_id": item["id"], "output_index": self.items.index(item)}
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self.event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            )
            events.append(self.event("response.content_part.done", **at, content_index=0, part=part))
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"] if item["content"] else ""
            events.append(self.event("response.reasoning_text.done", **at, content_index=0, text=text))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]
                )
            )
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=at["output_index"], item=item))
        return events

    def closing(self, delta: Delta) -> list[str]:
        """The last item's done events and response.completed (or .incomplete)."""
        events = self._close()
        if not self.items:  # nothing was said: an empty message, as the whole response has
            events += self._into("message", lambda: output.message_item(None, "in_progress")) + self._close()
        self.response = output.finished(self.response, delta.final, self.items)
        kind = "response.completed" if self.response["status"] == "completed" else "response.incomplete"
        return [*events, self.event(kind, response=self.response)]


async def response_events(
    events: ResponseEvents,
    first: list[tuple[int, Delta]],
    rest: AsyncIterator[tuple[int, Delta]],
    to_error: Callable[[Exception], OpenAIError],
    on_done: Callable[[dict[str, Any]], None],
) -> AsyncIterator[str]:
    """The whole event stream of one generation; `on_done(response)` once it completed."""
    async with aclosing(rest):
        try:
            for line in events.opening():
                yield line
            ended = False
            for _, delta in [*first]:
                for line in _lines(events, delta):
                    yield line
                ended = ended or delta.final is not None
            async for _, delta in rest:
                for line in _lines(events, delta):
                    yield line
                ended = ended or delta.final is not None
            if not ended:
                raise EngineError("the generation ended without a final event")
            on_done(events.response)
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
            error = to_error(exc)
            yield events.event("error", code=error.code or error.type, message=error.message, param=error.param)


def _lines(events: ResponseEvents, delta: Delta) -> list[str]:
    lines = events.delta(delta)
    if delta.final is not None:
        lines += events.closing(delta)
    return lines
