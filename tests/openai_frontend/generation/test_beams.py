"""A beam search's choices (generation/beams.py): one model request for all of them,
each its hypothesis, counts that add up, and the request cancelled when every choice
has gone (not before)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from backend.contract import FinalEvent, FinishGuard, FinishReason, GenerationRequest, Hypothesis, SamplingParams
from openai_frontend.generation.beams import BeamSearchRun, hypothesis_final
from openai_frontend.generation.choices import collect_all, interleave
from openai_frontend.generation.detokenizer import IncrementalDetokenizer
from tests.openai_frontend.fake_beams import LENGTH, STOP, BeamEngine

HYPOTHESES = [([72, 73, 74], STOP), ([72, 75], LENGTH), ([76], STOP)]


def _request(n: int, logprobs: bool = False) -> GenerationRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=8, logprobs=logprobs)
    return GenerationRequest([1, 2, 3], sampling, num_beams=4, num_return_sequences=n)


def _run(engine: BeamEngine, request: GenerationRequest) -> BeamSearchRun:
    return BeamSearchRun(engine, request, lambda: IncrementalDetokenizer(lambda ids: "".join(chr(i) for i in ids)))


def test_the_choices_share_one_request_and_get_their_hypotheses():
    engine = BeamEngine(HYPOTHESES)
    wholes = asyncio.run(collect_all(_run(engine, _request(3, logprobs=True)).choices()))
    assert len(engine.requests) == 1
    assert [whole.text for whole in wholes] == ["HIJ", "HK", "L"]
    assert [whole.final.finish_reason for whole in wholes] == [STOP, LENGTH, STOP]
    assert [[entry.token_id for entry in whole.logprobs] for whole in wholes] == [[72, 73, 74], [72, 75], [76]]
    assert wholes[0].text_offsets == [0, 1, 2]
    # the hypotheses' counts add up to the search's: 3 + EOS, 2, 1 + EOS
    assert [whole.final.num_output_tokens for whole in wholes] == [4, 2, 2]


def test_every_choice_gone_cancels_the_search():
    engine = BeamEngine(HYPOTHESES, delay_s=10)

    async def run():
        deltas = interleave(_run(engine, _request(2)).choices())
        pulled = asyncio.ensure_future(anext(deltas))
        await asyncio.sleep(0.05)
        pulled.cancel()
        await asyncio.gather(pulled, return_exceptions=True)
        await deltas.aclose()

    asyncio.run(asyncio.wait_for(run(), 5))
    assert engine.cancelled == 1


def test_a_choice_gone_leaves_the_search_to_the_others():
    engine = BeamEngine(HYPOTHESES, delay_s=0.2)

    async def run():
        first, second = _run(engine, _request(2)).choices()
        left = asyncio.ensure_future(anext(first))
        stays = asyncio.ensure_future(_texts(second))
        await asyncio.sleep(0.05)
        left.cancel()
        await asyncio.gather(left, return_exceptions=True)
        return await stays

    assert asyncio.run(run()) == ["HK", ""]
    assert engine.cancelled == 0


async def _texts(deltas) -> list[str]:
    async with aclosing(deltas):
        return [delta.text async for delta in deltas]


def test_a_hypothesis_final_takes_its_own_reason_and_count():
    search = FinalEvent(STOP, FinishGuard.STOP_TOKEN, 5, 7, num_cached_tokens=3, num_reasoning_tokens=2)
    best = hypothesis_final(search, Hypothesis([1, 2], -0.1, STOP), 0)
    other = hypothesis_final(search, Hypothesis([1, 2, 3, 4], -0.2, LENGTH), 1)
    assert (best.finish_reason, best.finish_guard, best.num_output_tokens) == (STOP, FinishGuard.STOP_TOKEN, 3)
    assert (other.finish_reason, other.finish_guard, other.num_output_tokens) == (LENGTH, FinishGuard.MAX_TOKENS, 4)
    assert (best.num_reasoning_tokens, other.num_reasoning_tokens) == (2, 0)  # counted once
    assert best.num_prompt_tokens == other.num_prompt_tokens == 5 and other.num_cached_tokens == 3
    assert search.finish_reason is FinishReason.STOP and search.num_output_tokens == 7  # left as it was
