"""Server-sent events: a generation's deltas as OpenAI stream chunks.

`data: {chunk}` events: (chat) a first chunk with the assistant role, content
deltas, a chunk with the finish_reason, then, when stream_options.include_usage is
set, a chunk with no choices and the usage, and `data: [DONE]`. An error after the
stream has begun is sent as `data: {"error": ...}` before `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from openai_frontend.errors import OpenAIError
from openai_frontend.generation import Delta
from openai_frontend.protocol import Usage

DONE = "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChunkFormat:
    """The frame every chunk of one response shares; subclasses shape the choice.

    `logprobs` shapes a delta's logprobs for the choice (None: not asked for).
    """

    object = ""

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        include_usage: bool,
        logprobs: Callable[[Delta], dict[str, Any] | None] | None = None,
    ):
        self._head = {"id": response_id, "object": self.object, "created": created, "model": model}
        self._include_usage = include_usage
        self._logprobs = logprobs

    def opening(self) -> list[str]:
        return []

    def text(self, text: str, finish_reason: str | None, delta: Delta | None = None) -> str:
        choice = self._choice(text, finish_reason)
        if delta is not None and self._logprobs is not None:
            choice["logprobs"] = self._logprobs(delta)
        return self._chunk([choice])

    def usage(self, usage: Usage) -> str | None:
        if not self._include_usage:
            return None
        return _event({**self._head, "choices": [], "usage": usage.model_dump()})

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        payload = {**self._head, "choices": choices}
        if self._include_usage:
            payload["usage"] = None
        return _event(payload)

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class ChatChunkFormat(ChunkFormat):
    object = "chat.completion.chunk"

    def opening(self) -> list[str]:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._chunk([role])]

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


class CompletionChunkFormat(ChunkFormat):
    object = "text_completion"

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


async def sse_events(
    first: Delta,
    rest: AsyncIterator[Delta],
    fmt: ChunkFormat,
    to_error: Callable[[Exception], OpenAIError],
) -> AsyncIterator[str]:
    """The whole event stream. `first` was awaited before the response began, so a
    request the model refuses still gets its HTTP error status."""
    async with aclosing(rest):
        try:
            for line in fmt.opening():
                yield line
            delta = first
            while delta.outcome is None:
                if delta.text or delta.logprobs:
                    yield fmt.text(delta.text, None, delta)
                delta = await anext(rest)
            yield fmt.text(delta.text, delta.outcome.finish_reason, delta)
            usage = fmt.usage(delta.outcome.usage())
            if usage is not None:
                yield usage
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
            yield _event(to_error(exc).body())
    yield DONE
