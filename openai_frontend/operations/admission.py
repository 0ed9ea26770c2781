"""Admission: a bounded number of generation requests in flight, a bounded queue behind them.

MAX_INFLIGHT_REQUESTS run at once and MAX_QUEUED_REQUESTS more wait their turn (first
come, first served); past both, a 503 with Retry-After at once, so that admitted
requests keep their latency. All state lives on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from openai_frontend.api.errors import SERVER_ERROR, OpenAIError

RETRY_SOON_S = 1  # Retry-After when a slot, not a token budget, is what is missing


class Admission:
    """A bounded number of requests in flight and a bounded, first-come-first-served
    queue behind them; a request that finds both full is refused at once (503)."""

    def __init__(self, max_inflight: int, max_queued: int):
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def enter(self) -> None:
        if self.inflight < self.max_inflight and not self._waiters:
            self.inflight += 1
            return
        if len(self._waiters) >= self.max_queued:
            headers = {"retry-after": str(RETRY_SOON_S)}
            message = "The server is overloaded: too many requests in flight and waiting. Please retry shortly."
            raise OpenAIError(503, message, None, SERVER_ERROR, "server_overloaded", headers)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn  # leave() hands its slot to us: `inflight` does not change
        except asyncio.CancelledError:
            if turn.cancelled():
                with contextlib.suppress(ValueError):  # leave() may have skipped it already
                    self._waiters.remove(turn)
            else:  # the slot was ours, but we are gone: pass it on
                self.leave()
            raise

    def leave(self) -> None:
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self.inflight -= 1
