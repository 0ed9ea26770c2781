"""A beam search's n choices: one model request answers them all.

The model sends a search nothing until it ends; its one output then carries the n best
hypotheses, best first (`RequestOutput.hypotheses`). Choice i's stream is hypothesis
i: a delta with its whole text (and its logprobs, with their text offsets), then a delta
with its final event: the search's, with the hypothesis's own finish reason and token
count (its tokens, and the stopping token of one that stopped: the counts add up to
the search's). The first of the choices to be read starts the model request; when every
choice waiting for it has gone, the request is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace

from backend.contract import FinalEvent, FinishGuard, FinishReason, GenerationRequest, Hypothesis, RequestOutput
from openai_frontend.generation.deltas import Delta, checked_final
from openai_frontend.generation.detokenizer import IncrementalDetokenizer
from openai_frontend.generation.engine_client import EngineError, TritonLLM

# a hypothesis that ended otherwise than the best one: the guard its reason most often means
_GUARD_OF = {FinishReason.STOP: FinishGuard.EOS, FinishReason.LENGTH: FinishGuard.MAX_TOKENS}


class BeamSearchRun:
    """One search's model request, shared by the choices it answers."""

    def __init__(
        self, engine: TritonLLM, request: GenerationRequest, detokenizer: Callable[[], IncrementalDetokenizer]
    ):
        self._engine = engine
        self._request = request
        self._detokenizer = detokenizer  # a fresh one per hypothesis
        self._search: asyncio.Future[RequestOutput] | None = None
        self._waiting = 0

    def choices(self) -> list[AsyncIterator[Delta]]:
        """The search's choices, best first: num_return_sequences of them."""
        return [self._choice(index) for index in range(self._request.num_return_sequences)]

    async def _choice(self, index: int) -> AsyncIterator[Delta]:
        if self._search is None:
            self._search = asyncio.ensure_future(self._final_output())
        self._waiting += 1
        try:
            out = await asyncio.shield(self._search)
        finally:
            self._waiting -= 1
            if not self._waiting and not self._search.done():  # no choice waits any more
                self._search.cancel()
        for delta in hypothesis_deltas(out, index, self._detokenizer(), self._request.sampling.wants_logprobs):
            yield delta

    async def _final_output(self) -> RequestOutput:
        merged: RequestOutput | None = None
        async with aclosing(self._engine.generate(self._request)) as outputs:
            async for out in outputs:
                if merged is None:
                    merged = out
                else:
                    merged.absorb(out)
                if merged.final is not None:
                    return merged
        raise EngineError("the beam search ended without a final output")


def hypothesis_deltas(
    out: RequestOutput, index: int, detokenizer: IncrementalDetokenizer, wants_logprobs: bool
) -> list[Delta]:
    """Choice `index`'s deltas of a search's final output: its text, then its final event.
    A search that ended before its first step (a deadline) has no hypotheses: its
    choices are empty."""
    final = checked_final(out.final)
    hypotheses = out.hypotheses or []
    if hypotheses and index >= len(hypotheses):
        raise EngineError(f"the beam search returned {len(hypotheses)} hypotheses for choice {index}")
    if hypotheses:
        hypothesis = hypotheses[index]
        event = hypothesis_final(final, hypothesis, index)
    else:
        hypothesis = Hypothesis([], 0.0, final.finish_reason, [])
        event = replace(final, num_output_tokens=0, num_reasoning_tokens=0)
    text, offsets = _text(detokenizer, hypothesis.token_ids, wants_logprobs)
    logprobs = (hypothesis.logprobs or []) if wants_logprobs else None
    head = Delta(text, None, logprobs, offsets, out.prompt_logprobs, out.starts_in_thinking)
    head.token_ids = list(hypothesis.token_ids)
    empty = [] if wants_logprobs else None
    return [head, Delta("", event, empty, empty, token_ids=[])]


def hypothesis_final(final: FinalEvent, hypothesis: Hypothesis, index: int) -> FinalEvent:
    """A hypothesis's final event. The search's counts that are not per hypothesis
    (reasoning tokens) go with the first, so that the choices' counts add up to it."""
    reason = hypothesis.finish_reason
    guard = final.finish_guard if reason is final.finish_reason else _GUARD_OF.get(reason, final.finish_guard)
    tokens = len(hypothesis.token_ids) + (reason is FinishReason.STOP)
    reasoning = final.num_reasoning_tokens if index == 0 else 0
    return replace(final, finish_reason=reason, finish_guard=guard, num_output_tokens=tokens,
                   num_reasoning_tokens=reasoning)  # fmt: skip


def _text(detokenizer: IncrementalDetokenizer, token_ids: list[int], per_token: bool) -> tuple[str, list[int] | None]:
    """The tokens' text and, `per_token`, where each token's text begins in it."""
    if not per_token:
        return detokenizer.feed(token_ids) + detokenizer.flush(), None
    text, offsets = "", []
    for token in token_ids:
        offsets.append(len(text))
        text += detokenizer.feed([token])
    return text + detokenizer.flush(), offsets
