"""api/sse.py `keep_alive`: a comment whenever a stream is silent for an interval, nothing
else changed, and the stream closed (its pending event cancelled) when the client goes."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from openai_frontend.api.sse import KEEP_ALIVE, keep_alive


async def _events(pauses: list[float], closed: list[bool]):
    try:
        for i, pause in enumerate(pauses):
            await asyncio.sleep(pause)
            yield f"data: {i}\n\n"
    finally:
        closed.append(True)


def _sent(pauses: list[float], interval_s: float) -> list[str]:
    async def run():
        async with aclosing(keep_alive(_events(pauses, []), interval_s)) as events:
            return [event async for event in events]

    return asyncio.run(run())


def test_a_silent_stream_gets_comments_and_its_events_unchanged():
    sent = _sent([0.0, 0.25, 0.0], interval_s=0.05)
    assert [event for event in sent if event != KEEP_ALIVE] == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]
    assert sent[0] == "data: 0\n\n" and sent[-2:] == ["data: 1\n\n", "data: 2\n\n"]
    assert 3 <= sent.count(KEEP_ALIVE) <= 6 and KEEP_ALIVE == ": keep-alive\n\n"


def test_a_busy_stream_gets_none():
    assert _sent([0.0, 0.0, 0.0], interval_s=1.0) == ["data: 0\n\n", "data: 1\n\n", "data: 2\n\n"]


def test_closing_while_an_event_is_awaited_closes_the_stream():
    closed: list[bool] = []

    async def run():
        events = keep_alive(_events([0.0, 30.0], closed), 0.02)
        assert await anext(events) == "data: 0\n\n"
        assert await anext(events) == KEEP_ALIVE
        await events.aclose()

    asyncio.run(asyncio.wait_for(run(), 5))
    assert closed == [True]
