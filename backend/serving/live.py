"""The Triton process's one registry of live requests, and per-stream output coalescing.

A request is live from `open` (model.py's execute) until its last packet is taken.
Its entry holds its response sender, the outputs the engine pushed that are not sent
yet, and whether an abort was asked. Sending is the narrow pipe: one Triton `send()` is
a blocking round trip whatever the response holds. So the engine thread never sends; it
pushes each step's outputs here, and the sender thread takes, per stream, everything
pending as one packet. When sending falls behind, a packet carries many tokens; when it
keeps up, one. A request with `stream` false accumulates its outputs and becomes ready
only at its end, so it is sent as exactly one packet.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from backend.contract import RequestOutput


@dataclass(slots=True)
class Packet:
    """What one response carries: a stream's pending outputs merged, or its error."""

    request_id: str
    sender: Any  # Triton's response sender (any object in the tests)
    output: RequestOutput | None = None
    error: Exception | None = None  # the request failed; its pending tokens are dropped

    @property
    def is_last(self) -> bool:
        return self.error is not None or (self.output is not None and self.output.finished)


@dataclass(slots=True)
class _Live:
    sender: Any
    stream: bool
    pending: RequestOutput | None = None
    error: Exception | None = None
    abort_requested: bool = False

    @property
    def ended(self) -> bool:
        return self.error is not None or (self.pending is not None and self.pending.finished)

    @property
    def ready(self) -> bool:
        return self.ended or (self.stream and self.pending is not None)


class LiveRequests:
    """One lock guards it all. Opened by Triton's threads (execute), filled by the engine
    thread (push; fail, also from Triton's thread when a submit comes during shutdown),
    drained by the sender thread, which with the drain's watcher thread also marks aborts."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._live: dict[str, _Live] = {}
        self._ready: dict[str, None] = {}  # insertion-ordered set of ready request ids
        self._closed = False

    def open(self, request_id: str, sender: Any, stream: bool) -> None:
        with self._cond:
            if request_id in self._live:
                raise ValueError(f"request {request_id!r} is already live")
            self._live[request_id] = _Live(sender, stream)

    def push(self, outputs: Iterable[RequestOutput]) -> None:
        """Add one engine step's outputs (one lock round for the whole step); outputs of
        requests not live, or already ended, are dropped."""
        with self._cond:
            woke = False
            for out in outputs:
                live = self._live.get(out.request_id)
                if live is None or live.ended:
                    continue
                if live.pending is None:
                    live.pending = out
                else:
                    live.pending.absorb(out)
                woke |= self._mark_if_ready(out.request_id, live)
            if woke:
                self._cond.notify_all()

    def fail(self, request_id: str, error: Exception) -> None:
        """End a request with an error; outputs not yet taken are dropped."""
        with self._cond:
            live = self._live.get(request_id)
            if live is None or live.ended:
                return
            live.pending, live.error = None, error
            self._mark_if_ready(request_id, live)
            self._cond.notify_all()

    def take(self, timeout: float | None = None) -> list[Packet]:
        """Wait up to `timeout` s for ready requests; return one packet per ready request."""
        with self._cond:
            if not self._ready and not self._closed:
                self._cond.wait(timeout)
            packets = [self._take_one(request_id) for request_id in self._ready]
            self._ready.clear()
            return packets

    def request_abort(self, request_id: str) -> bool:
        """Note that the request is to be aborted; False if it was already, or is not live."""
        with self._cond:
            live = self._live.get(request_id)
            if live is None or live.abort_requested:
                return False
            live.abort_requested = True
            return True

    def senders(self) -> list[tuple[str, Any]]:
        """(request id, sender) of every live request not yet asked to abort."""
        with self._cond:
            return [(rid, live.sender) for rid, live in self._live.items() if not live.abort_requested]

    def close(self) -> None:
        """Wake waiting takers for good (shutdown); packets ready now can still be taken."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def forget_all(self) -> list[Any]:
        """Forget every live request (after the sender has stopped): the senders of those
        that never got their last response, for one."""
        with self._cond:
            left = [live.sender for live in self._live.values()]
            self._live.clear()
            self._ready.clear()
            return left

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._cond:
            return len(self._live)

    def _mark_if_ready(self, request_id: str, live: _Live) -> bool:
        if live.ready:
            self._ready[request_id] = None
            return True
        return False

    def _take_one(self, request_id: str) -> Packet:
        live = self._live[request_id]
        packet = Packet(request_id, live.sender, live.pending, live.error)
        if packet.is_last:
            del self._live[request_id]
        else:
            live.pending = None
        return packet
