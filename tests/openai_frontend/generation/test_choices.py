"""n choices run together: interleaved as they stream, and closed together."""

from __future__ import annotations

import asyncio

from backend.contract import GenerationRequest
from openai_frontend.generation.choices import interleave
from openai_frontend.generation.deltas import generate_text
from tests.helpers.fake_engine import FakeEngine


def test_closing_the_interleaved_choices_cancels_every_request(tokenization):
    tok = tokenization.tokenizer
    engine = FakeEngine(tok.encode("one two three four five", add_special_tokens=False) + [tok.eos_token_id], 1)

    async def run():
        request = GenerationRequest([1])
        streams = [generate_text(engine, request, tokenization.detokenizer([1]), []) for _ in range(3)]
        deltas = interleave(streams)
        seen = {(await anext(deltas))[0]}
        while len(seen) < 3:
            seen.add((await anext(deltas))[0])
        await deltas.aclose()  # as a client leaving mid-stream

    asyncio.run(run())
    assert len(engine.requests) == 3 and engine.cancelled == 3
