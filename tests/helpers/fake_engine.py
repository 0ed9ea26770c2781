"""A stand-in for the frontend's engine client (TritonLLM), for driving the app in-process.

`FakeEngine` answers `model_info()` with a ModelInfo (the default model's facts unless
given others) and `generate(request)` by replaying a token list in packs as
`RequestOutput`s, the last with a `FinalEvent`. It records the `GenerationRequest`s it
received (`requests`) and counts the generations closed before their end (`cancelled`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from backend.contract import (
    ContractError,
    ErrorReport,
    FinalEvent,
    FinishGuard,
    FinishReason,
    GenerationRequest,
    Logprob,
    ModelInfo,
    RequestOutput,
)
from openai_frontend.generation.engine_client import EngineError, engine_error

# The default model's facts, as its engine reports them (SmolLM2-135M-Instruct's preset).
DEFAULT_INFO = ModelInfo(
    max_model_len=8192,
    vocab_size=49152,
    sampling_defaults={"temperature": 0.2, "top_p": 0.9},
    tool_parser="hermes",
    tool_call_start="<tool_call>",
    tool_call_end="</tool_call>",
)
_GUARD_OF = {FinishReason.STOP: FinishGuard.EOS, FinishReason.LENGTH: FinishGuard.MAX_TOKENS}


def model_refusal(field: str, why: str) -> EngineError:
    """What the engine client raises when the model refuses a request naming `field`
    (the model sends an ErrorReport; the client decodes it)."""
    return engine_error(ErrorReport.of(ContractError(field, why)).encode())


def fake_logprob(token_id: int, alternatives: int, first_alternative: int | None = None) -> Logprob:
    """Made-up logprobs: token t has -t / 1000; its alternatives are the next ids."""
    start = token_id if first_alternative is None else first_alternative
    return Logprob(token_id, -token_id / 1000, [(start + j, -(start + j) / 1000) for j in range(alternatives)])


class FakeEngine:
    """Replays `token_ids` in packs of `pack_size`, then a final event of `reason`.

    `final`: more FinalEvent fields (timings, cached tokens, ...); `delay_s`: a sleep
    before each pack; `error`: raised instead of generating; `starts_in_thinking`: the
    engine's word on the first output; `hold` (an asyncio.Event, set by a test): the
    packs after the first wait for it. Logprobs (and the prompt's) come when asked.
    """

    def __init__(
        self,
        token_ids: Sequence[int] = (),
        pack_size: int = 2,
        reason: FinishReason = FinishReason.LENGTH,
        *,
        guard: FinishGuard | None = None,
        final: dict[str, Any] | None = None,
        error: Exception | None = None,
        info: ModelInfo = DEFAULT_INFO,
        delay_s: float = 0.0,
        starts_in_thinking: bool | None = None,
    ):
        self.token_ids = list(token_ids)
        self.pack_size, self.reason, self.guard = pack_size, reason, guard or _GUARD_OF.get(reason, FinishGuard.EOS)
        self.final_fields = dict(final or {})
        self.error, self.info, self.delay_s = error, info, delay_s
        self.starts_in_thinking = starts_in_thinking
        self.hold: asyncio.Event | None = None
        self.requests: list[GenerationRequest] = []
        self.cancelled = 0
        self.model_info_calls = 0

    async def is_ready(self) -> bool:
        return True

    async def model_info(self) -> ModelInfo:
        self.model_info_calls += 1
        return self.info

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        ids, size = self.token_ids, self.pack_size
        finished = False
        try:
            for i in range(0, max(len(ids), 1), size):
                await asyncio.sleep(self.delay_s)
                if i and self.hold is not None:
                    await self.hold.wait()
                out = RequestOutput("", ids[i : i + size], self._logprobs(request, ids[i : i + size]))
                if i == 0:
                    out.prompt_logprobs = self._prompt_logprobs(request)
                    out.starts_in_thinking = self.starts_in_thinking
                if i + size >= len(ids):
                    out.final = FinalEvent(
                        self.reason, self.guard, len(request.prompt_tokens), len(ids), **self.final_fields
                    )
                    finished = True
                yield out
        finally:
            if not finished:
                self.cancelled += 1

    @staticmethod
    def _logprobs(request: GenerationRequest, tokens: list[int]) -> list[Logprob] | None:
        sampling = request.sampling
        if not sampling.wants_logprobs:
            return None
        return [fake_logprob(t, sampling.top_logprobs) for t in tokens]

    @staticmethod
    def _prompt_logprobs(request: GenerationRequest) -> list[Logprob] | None:
        k = request.sampling.prompt_logprobs
        if k is None:
            return None
        first, *rest = request.prompt_tokens
        return [Logprob(first, None, []), *(fake_logprob(t, k, first_alternative=t + 1) for t in rest)]
