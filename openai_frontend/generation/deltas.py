"""One generation: the engine's outputs -> text deltas, cut at stop strings.

The last delta carries the generation's `FinalEvent`: the engine's, as it sent it, or,
when a stop string ended the text here, one the frontend makes (its own clock's times).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from backend.contract import FinalEvent, FinishGuard, FinishReason, GenerationRequest, Logprob, RequestOutput
from openai_frontend.generation.detokenizer import IncrementalDetokenizer
from openai_frontend.generation.engine_client import EngineError, TritonLLM
from openai_frontend.generation.stop import StopMatcher


@dataclass(slots=True)
class Delta:
    """New text; the last delta of a generation carries its final event.

    `logprobs` (when asked for): the tokens received since the previous delta, and
    `text_offsets` where each one's text begins. Tokens whose text is held back wait for
    the delta that releases it; a stop string keeps the logprobs of the tokens up to
    the one that completed it. The first delta carries the prompt's logprobs (when
    asked) and whether the output starts inside thinking.
    """

    text: str
    final: FinalEvent | None = None
    logprobs: list[Logprob] | None = None
    text_offsets: list[int] | None = None
    prompt_logprobs: list[Logprob] | None = None
    starts_in_thinking: bool | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI tool-call deltas (chat with tools)
    function_call: dict[str, Any] | None = None  # the same, for the older `functions` form
    reasoning: str = ""  # thinking text (chat with a reasoning model), split from `text`
    token_ids: list[int] | None = None  # the tokens this delta's text came from (vLLM's return_token_ids)
    stop_string: str | None = None  # on the last delta: the stop string that ended the text, if one did


async def generate_text(
    engine: TritonLLM, request: GenerationRequest, detokenizer: IncrementalDetokenizer, stops: list[str]
) -> AsyncIterator[Delta]:
    """Deltas of one request's text; a stop string ends it and cancels the request.

    The model sends tokens in packs (one response may carry many). Without stop strings
    or logprobs a pack is detokenized at once. With them, token by token: a stop string
    then ends the generation at the token that completed it (as vLLM, whose steps make
    one token each): later tokens of the pack, and their logprobs, are dropped and not
    counted; and each logprob learns where its token's text begins. Deltas may be
    empty (text held back); the last one is not skipped, since it carries the final.
    """
    wants_logprobs = request.sampling.wants_logprobs
    text_of = _TextOf(detokenizer, StopMatcher(stops), _Pending(wants_logprobs), bool(stops) or wants_logprobs)
    clock = _Clock()
    async with aclosing(engine.generate(request)) as outputs:
        async for out in outputs:
            clock.tick(out)
            text = text_of.feed(out)
            if text_of.matcher.stopped:  # leaving the `async with` cancels the model's request
                final = FinalEvent(
                    FinishReason.STOP, FinishGuard.STOP_STRING, len(request.prompt_tokens), text_of.received
                )
                last = text_of.pending.delta(text, clock.stamp(final))
                last.stop_string = text_of.matcher.matched
                yield last
                return
            if out.final is not None:
                yield text_of.pending.delta(text, checked_final(out.final))
                return
            if text:
                yield text_of.pending.delta(text)


@dataclass(slots=True)
class _TextOf:
    """Outputs -> text, through the detokenizer and the stop matcher."""

    detokenizer: IncrementalDetokenizer
    matcher: StopMatcher
    pending: _Pending
    per_token: bool
    received: int = 0
    produced: int = 0  # characters the detokenizer has produced: the next token's text offset

    def feed(self, out: RequestOutput) -> str:
        self.pending.add(out)
        text = self._per_token(out) if self.per_token else self._whole(out)
        if out.final is not None and not self.matcher.stopped:
            text += self.matcher.feed(self.detokenizer.flush())
            if not self.matcher.stopped:
                text += self.matcher.flush()
        return text

    def _whole(self, out: RequestOutput) -> str:
        self.received += len(out.token_ids)
        return self.matcher.feed(self.detokenizer.feed(out.token_ids))

    def _per_token(self, out: RequestOutput) -> str:
        text = ""
        for j, token in enumerate(out.token_ids):
            self.pending.offsets.append(self.produced)
            piece = self.detokenizer.feed([token])
            self.produced += len(piece)
            self.received += 1
            text += self.matcher.feed(piece)
            if self.matcher.stopped:
                self.pending.drop_last(len(out.token_ids) - j - 1)
                break
        return text


def checked_final(final: FinalEvent) -> FinalEvent:
    """The engine's final event, unless it says the model gave up on the request."""
    if final.finish_reason is FinishReason.ABORT:
        # an abort while the client still waits: the model gave up on the request
        raise EngineError(f"the model ended the request with finish_reason {final.finish_reason.value!r}")
    return final


@dataclass(slots=True)
class _Clock:
    """When a generation's tokens arrived here: the times of a final the frontend makes
    (a stop string). The engine's own final has better ones: a non-streaming model
    request brings every token in one response, so only the engine saw the first come."""

    started: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None

    def tick(self, out: RequestOutput) -> None:
        if out.token_ids:
            self.last = time.monotonic()
            if self.first is None:
                self.first = self.last

    def stamp(self, final: FinalEvent) -> FinalEvent:
        if self.first is not None:
            final.time_to_first_token_s = self.first - self.started
            final.decode_time_s = self.last - self.first
        return final


@dataclass(slots=True)
class _Pending:
    """What the engine sent that no delta has carried yet (its tokens' text aside): the
    outputs merged, and where each of their tokens' text begins."""

    wants_logprobs: bool
    output: RequestOutput | None = None
    offsets: list[int] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        if self.output is None:
            self.output = out
        else:
            self.output.absorb(out)

    def drop_last(self, count: int) -> None:
        """Forget the logprobs of the last `count` tokens received (cut by a stop string).
        Their offsets were never taken: `offsets` stops at the token that completed it."""
        if count and self.output is not None:
            del self.output.token_ids[-count:]
            if self.output.logprobs:
                del self.output.logprobs[-count:]

    def delta(self, text: str, final: FinalEvent | None = None) -> Delta:
        out, self.output = self.output, None
        offsets, self.offsets = self.offsets, []
        if out is None:
            wanted = [] if self.wants_logprobs else None
            return Delta(text, final, wanted, None if wanted is None else [], token_ids=[])
        logprobs = (out.logprobs or []) if self.wants_logprobs else None
        offsets = offsets if self.wants_logprobs else None
        tokens = list(out.token_ids)
        return Delta(text, final, logprobs, offsets, out.prompt_logprobs, out.starts_in_thinking, token_ids=tokens)


async def collect(deltas: AsyncIterator[Delta]) -> Delta:
    """The whole generation as one delta: all its text, logprobs and its final event
    (non-streaming requests)."""
    whole = Delta("", logprobs=None)
    parts, tokens = [], []
    async with aclosing(deltas):
        async for delta in deltas:
            parts.append(delta.text)
            tokens += delta.token_ids or ()
            if delta.logprobs is not None:
                whole.logprobs = (whole.logprobs or []) + delta.logprobs
                whole.text_offsets = (whole.text_offsets or []) + (delta.text_offsets or [])
            if delta.prompt_logprobs is not None:
                whole.prompt_logprobs = delta.prompt_logprobs
            if delta.starts_in_thinking is not None:
                whole.starts_in_thinking = delta.starts_in_thinking
            if delta.final is not None:
                whole.text, whole.final, whole.token_ids = "".join(parts), delta.final, tokens
                whole.stop_string = delta.stop_string
                return whole
    raise EngineError("the generation ended without a final event")
