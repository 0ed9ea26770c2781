"""One generation: token packs from the model -> text deltas, cut at stop strings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from backend import contract
from openai_frontend.detokenizer import IncrementalDetokenizer
from openai_frontend.protocol import CompletionTokensDetails, PromptTokensDetails, Usage
from openai_frontend.stop import StopMatcher
from openai_frontend.triton_client import EngineError, Finish, TokenLogprob, TokenPack, TritonLLM


@dataclass(slots=True)
class Outcome:
    """How a generation ended, in the client's terms."""

    finish_reason: str  # "stop" | "length" (| "tool_calls", set by the tool parser)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    stop_guard: str = ""  # what ended the sequence (eos, max_tokens, content_loop, deadline, stop_string, ...)
    thinking_guard: str = ""  # what ended its thinking, if a guard did (thinking_budget, thinking_loop)
    # latencies in seconds, for /metrics: the engine's figures when its final event carried
    # them, else the frontend's own (a stream cut by a stop string has no final event)
    first_token_s: float | None = None  # request -> first token
    decode_s: float = 0.0  # first token -> last token
    queue_s: float | None = None  # engine arrival -> first scheduled (None: not reported)

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
            completion_tokens_details=CompletionTokensDetails(reasoning_tokens=self.reasoning_tokens),
        )


@dataclass(slots=True)
class Delta:
    """New text; the last delta of a generation carries its outcome.

    `logprobs` (when asked for): the tokens received since the previous delta. Tokens
    whose text is held back wait for the delta that releases it; a stop string keeps
    the logprobs of the tokens up to the one that completed it.
    """

    text: str
    outcome: Outcome | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # on the first delta, when asked for
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI tool-call deltas (chat with tools)
    reasoning: str = ""  # thinking text (chat with a reasoning model), split from `text`


async def generate_text(
    engine: TritonLLM,
    fields: dict[str, Any],
    detokenizer: IncrementalDetokenizer,
    stops: list[str],
) -> AsyncIterator[Delta]:
    """Deltas of one request's text; a stop string ends it and cancels the request.

    The model sends tokens in packs (one response may carry many). Without stop strings
    or logprobs a pack is detokenized at once. With them, token by token: a stop string
    then ends the generation at the token that completed it (as vLLM, whose steps make
    one token each): later tokens of the pack, and their logprobs, are dropped and not
    counted; and each logprob entry learns where its token's text begins. Deltas may be
    empty (text held back); the last one is not skipped, since it carries the outcome.
    """
    matcher = StopMatcher(stops)
    per_token = bool(stops) or bool(fields.get("logprobs"))
    prompt_len = len(fields["prompt_tokens"])
    received = 0
    produced = 0  # characters the detokenizer has produced: the next token's text offset
    pending = _Pending()
    clock = _Clock()
    async with aclosing(engine.generate(fields)) as packs:
        async for pack in packs:
            clock.tick(pack)
            pending.add(pack)
            if per_token:
                text = ""
                for j, token in enumerate(pack.token_ids):
                    if pack.logprobs is not None:
                        pack.logprobs[j].offset = produced
                    piece = detokenizer.feed([token])
                    produced += len(piece)
                    received += 1
                    text += matcher.feed(piece)
                    if matcher.stopped:
                        pending.drop_last(len(pack.token_ids) - j - 1)
                        break
            else:
                received += len(pack.token_ids)
                text = matcher.feed(detokenizer.feed(pack.token_ids))
            if pack.finish is not None and not matcher.stopped:
                text += matcher.feed(detokenizer.flush())
                if not matcher.stopped:
                    text += matcher.flush()
            if matcher.stopped:
                # leaving the `async with` cancels the model's request
                outcome = Outcome(contract.FINISH_STOP, prompt_len, received, stop_guard="stop_string")
                yield pending.delta(text, clock.stamp(outcome))
                return
            if pack.finish is not None:
                yield pending.delta(text, clock.stamp(_outcome(pack.finish, prompt_len, received), pack.finish))
                return
            if text:
                yield pending.delta(text)


@dataclass(slots=True)
class _Clock:
    """When a generation's tokens arrived here. The engine's figures are preferred: a
    non-streaming model request brings every token in one response, so only the engine
    saw the first token come."""

    started: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None

    def tick(self, pack: TokenPack) -> None:
        if pack.token_ids:
            self.last = time.monotonic()
            if self.first is None:
                self.first = self.last

    def stamp(self, outcome: Outcome, finish: Finish | None = None) -> Outcome:
        """The outcome with its latencies filled in."""
        if finish is not None and finish.time_to_first_token_ms > 0:
            outcome.first_token_s = finish.time_to_first_token_ms / 1e3
            outcome.decode_s = finish.decode_time_ms / 1e3
            outcome.queue_s = finish.queue_time_ms / 1e3 if finish.queue_time_ms is not None else None
        elif self.first is not None:
            outcome.first_token_s = self.first - self.started
            outcome.decode_s = self.last - self.first
        return outcome


@dataclass(slots=True)
class _Pending:
    """Logprobs received but not yet sent with a delta."""

    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None

    def add(self, pack: TokenPack) -> None:
        if pack.logprobs is not None:
            self.logprobs = (self.logprobs or []) + pack.logprobs
        if pack.prompt_logprobs is not None:
            self.prompt_logprobs = pack.prompt_logprobs

    def drop_last(self, count: int) -> None:
        """Forget the logprobs of the last `count` tokens received (cut by a stop string)."""
        if count and self.logprobs:
            del self.logprobs[-count:]

    def delta(self, text: str, outcome: Outcome | None = None) -> Delta:
        delta = Delta(text, outcome, self.logprobs, self.prompt_logprobs)
        self.logprobs = [] if self.logprobs is not None else None
        self.prompt_logprobs = None
        return delta


def _outcome(finish: Finish, prompt_len: int, received: int) -> Outcome:
    if finish.reason not in (contract.FINISH_STOP, contract.FINISH_LENGTH):
        # "abort" while the client still waits: the model gave up on the request
        raise EngineError(f"the model ended the request with finish_reason {finish.reason!r}")
    return Outcome(
        finish.reason,
        finish.prompt_tokens or prompt_len,
        finish.completion_tokens or received,
        finish.cached_tokens,
        finish.reasoning_tokens,
        finish.stop_guard,
        finish.thinking_guard,
    )


async def collect(deltas: AsyncIterator[Delta]) -> Delta:
    """The whole generation as one delta: all its text, logprobs and its outcome
    (non-streaming requests)."""
    whole = Delta("")
    parts = []
    async with aclosing(deltas):
        async for delta in deltas:
            parts.append(delta.text)
            if delta.logprobs is not None:
                whole.logprobs = (whole.logprobs or []) + delta.logprobs
            if delta.prompt_logprobs is not None:
                whole.prompt_logprobs = delta.prompt_logprobs
            if delta.outcome is not None:
                whole.text, whole.outcome = "".join(parts), delta.outcome
                return whole
    raise EngineError("the generation ended without an outcome")


def total_usage(outcomes: list[Outcome]) -> Usage:
    """The usage of n choices of one prompt: the prompt counts once, completions add up.

    cached_tokens is choice 0's: the prompt is reported once, and the other choices'
    hits are mostly on blocks this same request computed moments before.
    """
    first = outcomes[0]
    completion = sum(o.completion_tokens for o in outcomes)
    reasoning = sum(o.reasoning_tokens for o in outcomes)
    return Outcome(first.finish_reason, first.prompt_tokens, completion, first.cached_tokens, reasoning).usage()


async def collect_all(streams: list[AsyncIterator[Delta]]) -> list[Delta]:
    """Each choice collected, concurrently; one failing cancels the others."""
    tasks = [asyncio.ensure_future(collect(stream)) for stream in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def interleave(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The choices' deltas as they come, tagged with their index, until all have ended.

    A choice's error is raised here; closing the iterator (or an error) cancels every
    choice, and so its model request.
    """
    queue: asyncio.Queue[tuple[int, Delta | Exception | None]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(i, stream, queue)) for i, stream in enumerate(streams)]
    running = len(tasks)
    try:
        while running:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(index: int, stream: AsyncIterator[Delta], queue: asyncio.Queue) -> None:
    try:
        async with aclosing(stream):
            async for delta in stream:
                queue.put_nowait((index, delta))
        queue.put_nowait((index, None))
    except Exception as exc:  # noqa: BLE001 - handed to the reader of the queue
        queue.put_nowait((index, exc))


async def heads(deltas: AsyncIterator[tuple[int, Delta]], n: int) -> list[tuple[int, Delta]]:
    """Deltas until each of the n choices has sent one (a refusal comes before any)."""
    received: list[tuple[int, Delta]] = []
    seen: set[int] = set()
    while len(seen) < n:
        index, delta = await anext(deltas)
        received.append((index, delta))
        seen.add(index)
    return received
