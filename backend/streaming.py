"""Per-stream output coalescing between the engine thread and the sender thread.

Sending is the narrow pipe: one Triton `send()` is a blocking round trip whatever
the response holds. So the engine thread never sends; it pushes each step's outputs
here, and the sender thread takes, per stream, everything pending as one packet.
When sending falls behind, a packet carries many tokens; when it keeps up, one.

A stream with `stream=False` accumulates all its tokens and becomes ready only at
its end, so it is sent as exactly one packet.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

from backend.request import FinalStats, RequestOutput


@dataclass(slots=True)
class Packet:
    """What one response carries: the stream's pending tokens, and its end if reached."""

    request_id: str
    token_ids: list[int]
    final: FinalStats | None = None
    error: Exception | None = None  # the request failed; its pending tokens are dropped
    # aligned with token_ids when the request asked for logprobs (RequestOutput's shapes)
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None

    @property
    def is_last(self) -> bool:
        return self.final is not None or self.error is not None


@dataclass(slots=True)
class _Buffer:
    stream: bool
    token_ids: list[int] = field(default_factory=list)
    final: FinalStats | None = None
    error: Exception | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.final = out.final
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
            self.top_logprobs = (self.top_logprobs or []) + (out.top_logprobs or [])
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
            self.prompt_top_logprobs = out.prompt_top_logprobs

    def clear(self) -> None:
        self.token_ids = []
        self.logprobs = self.top_logprobs = self.prompt_logprobs = self.prompt_top_logprobs = None

    @property
    def ended(self) -> bool:
        return self.final is not None or self.error is not None

    @property
    def ready(self) -> bool:
        return self.ended or (self.stream and bool(self.token_ids))


class StreamCoalescer:
    """Buffers of open streams, filled by the engine thread, drained by the sender.

    A stream is opened before its request reaches the engine and forgotten once its
    last packet is taken; outputs for streams not open are dropped.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._buffers: dict[str, _Buffer] = {}
        self._ready: dict[str, None] = {}  # insertion-ordered set of ready stream ids
        self._closed = False

    def open(self, request_id: str, stream: bool) -> None:
        with self._cond:
            if request_id in self._buffers:
                raise ValueError(f"stream {request_id!r} is already open")
            self._buffers[request_id] = _Buffer(stream)

    def push(self, outputs: Iterable[RequestOutput]) -> None:
        """Add one engine step's outputs (one lock round for the whole step)."""
        with self._cond:
            woke = False
            for out in outputs:
                buf = self._buffers.get(out.request_id)
                if buf is None or buf.ended:
                    continue
                buf.add(out)
                woke |= self._mark_if_ready(out.request_id, buf)
            if woke:
                self._cond.notify_all()

    def fail(self, request_id: str, error: Exception) -> None:
        """End a stream with an error; tokens not yet taken are dropped."""
        with self._cond:
            buf = self._buffers.get(request_id)
            if buf is None or buf.ended:
                return
            buf.clear()
            buf.error = error
            self._mark_if_ready(request_id, buf)
            self._cond.notify_all()

    def take(self, timeout: float | None = None) -> list[Packet]:
        """Wait up to `timeout` s for ready streams; return one packet per ready stream."""
        with self._cond:
            if not self._ready and not self._closed:
                self._cond.wait(timeout)
            packets = [self._take_one(rid) for rid in self._ready]
            self._ready.clear()
            return packets

    def close(self) -> None:
        """Wake waiting takers for good (shutdown); pending packets can still be taken."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def open_ids(self) -> list[str]:
        with self._cond:
            return list(self._buffers)

    def __len__(self) -> int:
        with self._cond:
            return len(self._buffers)

    def _mark_if_ready(self, request_id: str, buf: _Buffer) -> bool:
        if buf.ready:
            self._ready[request_id] = None
            return True
        return False

    def _take_one(self, request_id: str) -> Packet:
        buf = self._buffers[request_id]
        packet = Packet(
            request_id,
            buf.token_ids,
            buf.final,
            buf.error,
            buf.logprobs,
            buf.top_logprobs,
            buf.prompt_logprobs,
            buf.prompt_top_logprobs,
        )
        if packet.is_last:
            del self._buffers[request_id]
        else:
            buf.clear()
        return packet
