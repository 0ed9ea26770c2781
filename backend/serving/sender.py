"""The sender thread's loop: packets out, cancellations in, the gauges kept current.

Each pass takes every ready packet (backend.serving.live) and sends it as one response
through the `Responder` (model.py's, over Triton's response senders), the final flag
riding on the last. Between passes it checks cancellation (`is_cancelled()` is a round
trip too, so at most every `cancel_check_s`) and aborts cancelled requests in the
engine, whose abort final is then sent like any other.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from backend.contract import RequestOutput
from backend.serving.engine_thread import EngineThread
from backend.serving.gauges import Gauges
from backend.serving.live import LiveRequests, Packet

log = logging.getLogger("llm")


class Responder(Protocol):
    def send_output(self, sender: Any, output: RequestOutput) -> None:
        """One response; the final flag when `output` is the last."""

    def send_error(self, sender: Any, error: Exception) -> None:
        """An error response with the final flag."""


@dataclass(slots=True)
class SenderLoop:
    live: LiveRequests
    responder: Responder
    engine: EngineThread
    gauges: Gauges
    cancel_check_s: float = 0.05  # cancellation checks (20-120 us each), per live stream, at most this often
    idle_wake_s: float = 0.05  # the loop wakes this often when nothing is sent
    _next_cancel_check: float = 0.0

    def run(self) -> None:
        """Until the registry is closed and nothing ready is left."""
        while True:
            packets = self.live.take(self.idle_wake_s)
            for packet in packets:
                if packet.error is None:
                    self.gauges.count(len(packet.output.token_ids))
            if any(packet.is_last for packet in packets):  # whoever has a whole answer finds it counted
                self._bookkeep(self.gauges.publish, self.engine.snapshot, len(self.live), now=True)
            for packet in packets:
                self._send(packet)
            self._bookkeep(self._check_cancelled)
            self._bookkeep(self.gauges.publish, self.engine.snapshot, len(self.live))  # at most every every_s
            if self.live.closed and not packets:
                return

    @staticmethod
    def _bookkeep(work, *args, **kwargs) -> None:
        """Cancellation checks, the gauges: never let them stop the sending."""
        try:
            work(*args, **kwargs)
        except Exception:
            log.exception("sender bookkeeping failed")

    def abort_all(self) -> None:
        """Abort every live request (a drain); their finals are sent as they come."""
        for request_id, _ in self.live.senders():
            if self.live.request_abort(request_id):
                self.engine.abort(request_id)

    def _send(self, packet: Packet) -> None:
        if packet.error is not None:
            self.responder.send_error(packet.sender, packet.error)
            return
        self.responder.send_output(packet.sender, packet.output)

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        if now < self._next_cancel_check:
            return
        self._next_cancel_check = now + self.cancel_check_s
        for request_id, sender in self.live.senders():
            if sender.is_cancelled() and self.live.request_abort(request_id):
                self.engine.abort(request_id)
