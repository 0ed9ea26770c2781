"""Server-sent events: a generation's deltas as OpenAI stream chunks.

`data: {chunk}` events: (chat) a first chunk with the assistant role, content
deltas, a chunk with the finish_reason, then, when stream_options.include_usage is
set, a chunk with no choices and the usage, and `data: [DONE]`. An error after the
stream has begun is sent as `data: {"error": ...}` before `[DONE]`.

With n choices, each chunk carries one choice and its `index`: (chat) a role chunk
per index first, then the choices' chunks interleaved as they come, each ending with
its own finish_reason chunk; the usage chunk follows once all have ended.

A stream that may stay silent for long (a beam search sends nothing until it ends) is
sent through `keep_alive`: a comment line, `: keep-alive`, whenever no event has come
for an interval. SSE clients skip comments (the openai SDK does).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from backend.contract import FinalEvent
from openai_frontend.api.errors import OpenAIError
from openai_frontend.api.responses import guard_fields, usage_of
from openai_frontend.generation.deltas import Delta
from openai_frontend.generation.engine_client import EngineError

T = TypeVar("T")

DONE = "data: [DONE]\n\n"
KEEP_ALIVE = ": keep-alive\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ChunkFormat:
    """The frame every chunk of one response shares; subclasses shape the choice.

    `logprobs(index, delta)` shapes a delta's logprobs for choice `index` (None: not
    asked for); `choices_per_prompt`: n (completions may have several prompts, each with
    its n choices). With include_usage, chat chunks carry `"usage": null` until the usage
    chunk (the spec's words for chat); completions chunks leave it out.
    """

    object = ""
    usage_on_every_chunk = True
    # vLLM's return_token_ids: each choice's prompt tokens (None: not asked); each chunk then
    # carries its tokens, and the first one (chat: the role chunks) the prompt's
    prompt_token_ids: list[list[int]] | None = None

    def __init__(
        self,
        response_id: str,
        created: int,
        model: str,
        include_usage: bool,
        logprobs: Callable[[int, Delta], dict[str, Any] | None] | None = None,
        choices_per_prompt: int = 1,
    ):
        self._head = {"id": response_id, "object": self.object, "created": created, "model": model}
        self._include_usage = include_usage
        self._logprobs = logprobs
        self._choices_per_prompt = choices_per_prompt
        self._prompts_shown: set[int] = set()  # return_token_ids: the choices whose prompt was shown

    def opening(self, n: int = 1) -> list[str]:
        return []

    def text(self, index: int, text: str, finish_reason: str | None, delta: Delta | None = None) -> str:
        choice = self._choice(index, text, finish_reason, delta)
        if delta is not None and self._logprobs is not None:
            choice["logprobs"] = self._logprobs(index, delta)
        if delta is not None and delta.final is not None:  # the choice's finish chunk
            choice.update(guard_fields(delta.final))
        if self.prompt_token_ids is not None and delta is not None and delta.token_ids is not None:
            choice["token_ids"] = delta.token_ids
            self._first_of(index, choice)
        return self._chunk([choice])

    def _first_of(self, index: int, choice: dict[str, Any]) -> None:
        """return_token_ids: what a choice's first chunk carries besides its tokens."""

    def usage(self, finals: list[FinalEvent]) -> str | None:
        """The usage chunk of all the choices' final events (in choice order), if asked."""
        if not self._include_usage:
            return None
        usage = usage_of(finals, self._choices_per_prompt)
        return _event({**self._head, "choices": [], "usage": usage.model_dump()})

    def _chunk(self, choices: list[dict[str, Any]], **head: Any) -> str:
        payload = {**self._head, **head, "choices": choices}
        if self._include_usage and self.usage_on_every_chunk:
            payload["usage"] = None
        return _event(payload)

    def _choice(self, index: int, text: str, finish_reason: str | None, delta: Delta | None) -> dict[str, Any]:
        raise NotImplementedError


class ChatChunkFormat(ChunkFormat):
    object = "chat.completion.chunk"

    def opening(self, n: int = 1) -> list[str]:
        role = {"role": "assistant", "content": ""}
        # vLLM's return_token_ids: the prompt's tokens top-level, on the first chunks
        head = {} if self.prompt_token_ids is None else {"prompt_token_ids": self.prompt_token_ids[0]}
        choices = [{"index": i, "delta": role, "logprobs": None, "finish_reason": None} for i in range(n)]
        return [self._chunk([choice], **head) for choice in choices]

    def _choice(self, index: int, text: str, finish_reason: str | None, delta: Delta | None) -> dict[str, Any]:
        message: dict[str, Any] = {"content": text} if text else {}
        if delta is not None and delta.reasoning:
            message["reasoning_content"] = delta.reasoning
        if delta is not None and delta.tool_calls:
            message["tool_calls"] = delta.tool_calls
        if delta is not None and delta.function_call:
            message["function_call"] = delta.function_call
        return {"index": index, "delta": message, "logprobs": None, "finish_reason": finish_reason}


class CompletionChunkFormat(ChunkFormat):
    object = "text_completion"
    usage_on_every_chunk = False

    def _choice(self, index: int, text: str, finish_reason: str | None, delta: Delta | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _first_of(self, index: int, choice: dict[str, Any]) -> None:
        if index not in self._prompts_shown:
            self._prompts_shown.add(index)
            choice["prompt_token_ids"] = self.prompt_token_ids[index // self._choices_per_prompt]


async def sse_events(
    first: list[tuple[int, Delta]],
    rest: AsyncIterator[tuple[int, Delta]],
    n: int,
    fmt: ChunkFormat,
    to_error: Callable[[Exception], OpenAIError],
) -> AsyncIterator[str]:
    """The whole event stream of n choices' (index, delta)s. `first` was awaited before
    the response began, so a request the model refuses still gets its HTTP error status."""
    async with aclosing(rest):
        try:
            for line in fmt.opening(n):
                yield line
            finals: dict[int, FinalEvent] = {}
            async for index, delta in _chained(first, rest):
                if delta.final is not None:
                    finals[index] = delta.final
                    yield fmt.text(index, delta.text, delta.final.finish_reason.value, delta)
                elif delta.text or delta.logprobs or delta.tool_calls or delta.function_call or delta.reasoning:
                    yield fmt.text(index, delta.text, None, delta)
            if len(finals) < n:
                raise EngineError("a choice ended without a final event")
            usage = fmt.usage([finals[i] for i in range(n)])
            if usage is not None:
                yield usage
        except Exception as exc:  # noqa: BLE001 - reported to the client in the stream
            yield _event(to_error(exc).body())
    yield DONE


async def _chained(first: list[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def keep_alive(events: AsyncIterator[str], interval_s: float) -> AsyncIterator[str]:
    """The events, and a keep-alive comment whenever none has come for `interval_s`."""
    pending: asyncio.Future[str | None] | None = None
    async with aclosing(events):
        try:
            while True:
                pending = asyncio.ensure_future(anext(events, None))
                while not (await asyncio.wait({pending}, timeout=interval_s))[0]:
                    yield KEEP_ALIVE
                event = pending.result()
                if event is None:
                    return
                yield event
        finally:
            if pending is not None and not pending.done():  # the client left while an event was awaited
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
