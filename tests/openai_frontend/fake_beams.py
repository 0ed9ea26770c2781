"""A fake engine that also answers beam searches, for the frontend's beam tests.

`BeamEngine` is tests/helpers/fake_engine.py's FakeEngine (a request with num_beams 1
replays its tokens), and answers a beam request (num_beams > 1) as the engine does: after
`delay_s`, one output with no tokens, its first num_return_sequences `hypotheses` (best
first; their logprobs when asked), the prompt's logprobs when asked, and a final event
counting the hypotheses' tokens (a stopping token for one that stopped). The output
crosses the contract's wire (encoded to tensors and decoded back), as the frontend gets it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from backend import contract
from backend.contract import FinalEvent, FinishGuard, FinishReason, GenerationRequest, Hypothesis, RequestOutput
from tests.helpers.fake_engine import DEFAULT_INFO, FakeEngine

STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH
# the default model's facts with the chat presets a search must not take (its max_tokens it keeps)
BEAM_INFO = replace(DEFAULT_INFO, sampling_defaults={"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 50})


class BeamEngine(FakeEngine):
    def __init__(self, hypotheses, *, final_reason=None, late_error=None, **kwargs):
        """`hypotheses`: (token ids, finish reason) each, best first; `final_reason`: the
        search's own (default: its best hypothesis's); `late_error`: raised after
        `delay_s` instead of the output."""
        kwargs.setdefault("info", BEAM_INFO)
        super().__init__(**kwargs)
        self.hypotheses: list[tuple[list[int], FinishReason]] = hypotheses
        self.final_reason, self.late_error = final_reason, late_error

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if request.num_beams == 1:
            async for out in super().generate(request):
                yield out
            return
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        finished = False
        try:
            await asyncio.sleep(self.delay_s)
            if self.late_error is not None:
                raise self.late_error
            out = self._search_output(request)
            finished = True
            yield contract.decode_output(contract.encode_output(out), request.prompt_tokens, final=True)
        finally:
            if not finished:
                self.cancelled += 1

    def _search_output(self, request: GenerationRequest) -> RequestOutput:
        hyps = [
            Hypothesis(list(ids), -0.1 * (i + 1), reason, self._logprobs(request, list(ids)))
            for i, (ids, reason) in enumerate(self.hypotheses[: request.num_return_sequences])
        ]
        reason = self.final_reason or (hyps[0].finish_reason if hyps else LENGTH)
        guard = FinishGuard.EOS if reason is STOP else FinishGuard.MAX_TOKENS
        count = sum(len(h.token_ids) + (h.finish_reason is STOP) for h in hyps)
        final = FinalEvent(reason, guard, len(request.prompt_tokens), count, **self.final_fields)
        return RequestOutput("", [], prompt_logprobs=self._prompt_logprobs(request), final=final, hypotheses=hyps)
