"""The frontend's HTTP server: uvicorn on h11, bounded against connections that hold it
before any request is authenticated (API keys are checked per request, after its head).

uvicorn's own settings, as `uvicorn_options` passes them:

- `timeout_keep_alive`: an idle keep-alive connection closes this long after a response.
  uvicorn arms it only when a response ends, and any byte received cancels it until the
  next response ends: it never covers a connection before its first request, nor a
  request head sent a byte at a time.
- `h11_max_incomplete_event_size`: the request head's size bound while it arrives (h11
  refuses a buffer past it; uvicorn answers 400 and closes). It does not bound a head that
  arrives whole in one read: `GuardedConnection` checks that one.
- `ws="none"`: no WebSocket upgrades (the frontend serves none; an upgraded connection
  would leave the count of connections below).

`HardenedH11Protocol` adds what uvicorn lacks:

- a header timeout: a request head must be complete within HTTP_HEADER_TIMEOUT_S of the
  connection's opening, or, on a keep-alive connection, of its first byte; more bytes do
  not extend it (slowloris). Bodies and responses are never timed: a slow upload or an
  SSE stream of minutes goes on.
- a cap on open connections, checked as each one opens: past HTTP_MAX_CONNECTIONS it is
  answered 503 at once and closed, holding no slot; the established ones are untouched.
  uvicorn's `limit_concurrency` does not fit: it is checked only once a request head
  has arrived (silent connections past it are never refused), and it refuses the next
  request of every connection, established ones included, while the count is at the
  limit (the count includes the asking connection itself).
- HTTP_MAX_REQUESTS_PER_CONNECTION: the response to a connection's last request says
  `Connection: close` and the connection closes after it (uvicorn's `limit_max_requests`
  instead stops the whole server after that many requests).
- a request with both Content-Length and Transfer-Encoding is refused with 400 and the
  connection closed before the application sees it. RFC 9112 section 6.3 allows this or
  answering by Transfer-Encoding, and requires closing either way; refusing runs nothing
  on a body a proxy in front may have framed by Content-Length, and costs no conforming
  client (RFC 9112 section 6.2: a sender never sends both).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from openai_frontend.api.errors import SERVER_ERROR, OpenAIError

log = logging.getLogger(__name__)

REFUSAL_LINGER_S = 1.0  # a refused connection reads and drops what the client sends this long


def _connection_refusal() -> bytes:
    error = OpenAIError(503, "too many open connections; retry shortly", None, SERVER_ERROR, "too_many_connections")
    body = json.dumps(error.body()).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


REFUSAL = _connection_refusal()


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """The HTTP server's bounds: the HTTP_<FIELD NAME> environment variables (docs/configuration.md), as
    openai_frontend/settings.py passes them to `from_env`."""

    header_timeout_s: float = 10.0
    keepalive_timeout_s: float = 15.0
    max_connections: int = 768
    max_requests_per_connection: int = 1000
    max_header_bytes: int = 16384

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> HttpSettings:
        values = {}
        for f in fields(cls):
            name = f"HTTP_{f.name.upper()}"
            raw = environ.get(name, "").strip()
            if raw:
                values[f.name] = _positive(name, raw, type(f.default))
        return cls(**values)


def _positive(name: str, raw: str, kind: type) -> float | int:
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"{name} must be a {'number' if kind is float else 'whole number'}, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


def uvicorn_options(settings: HttpSettings) -> dict[str, Any]:
    """The keyword arguments of uvicorn.run / uvicorn.Config that serve through these bounds."""
    return {
        "http": functools.partial(HardenedH11Protocol, settings=settings),
        "ws": "none",
        "timeout_keep_alive": settings.keepalive_timeout_s,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
    }


class GuardedConnection(h11.Connection):
    """h11's server side with three more rules: a request head larger than `max_head_bytes`
    and a request with both Content-Length and Transfer-Encoding are protocol errors, and
    the response to the `max_requests`-th request of the connection says Connection: close
    (h11 then closes after it). h11's own `max_incomplete_event_size` bounds only a head
    still incomplete in its buffer: a larger one arriving in one read passes it."""

    def __init__(self, max_requests: int, max_head_bytes: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_requests = max_requests
        self.max_head_bytes = max_head_bytes
        self.requests = 0

    def next_event(self) -> Any:
        event = super().next_event()
        if type(event) is h11.Request:
            self.requests += 1
            refusal = self._protocol_error(event)
            if refusal is not None:
                self._process_error(self.their_role)  # as h11 does for its own refusals
                raise refusal
        return event

    def _protocol_error(self, request: h11.Request) -> h11.RemoteProtocolError | None:
        headers = request.headers.raw_items()
        # the head's bytes as parsed: "METHOD TARGET HTTP/1.1\r\n", "name: value\r\n" each, "\r\n"
        size = len(request.method) + len(request.target) + 14 + sum(len(n) + len(v) + 4 for n, v in headers)
        if size > self.max_head_bytes:
            return h11.RemoteProtocolError(f"request head over {self.max_head_bytes} bytes", error_status_hint=431)
        if {b"content-length", b"transfer-encoding"} <= {name for name, _ in request.headers}:
            return h11.RemoteProtocolError("both Content-Length and Transfer-Encoding", error_status_hint=400)
        return None

    def send_with_data_passthrough(self, event: h11.Event) -> list[bytes] | None:
        if type(event) is h11.Response and self.requests >= self.max_requests:
            event = _closing(event)
        return super().send_with_data_passthrough(event)


def _closing(response: h11.Response) -> h11.Response:
    headers = [(name, value) for name, value in response.headers if name != b"connection"]
    return h11.Response(
        status_code=response.status_code,
        headers=[*headers, (b"connection", b"close")],
        reason=response.reason,
        http_version=response.http_version,
    )


class HardenedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header timeout, a cap on connections and a
    `GuardedConnection` (see the module's docstring)."""

    def __init__(self, *args: Any, settings: HttpSettings, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.conn = GuardedConnection(settings.max_requests_per_connection, self.config.h11_max_incomplete_event_size)
        self.head_timer: asyncio.TimerHandle | None = None
        self.refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.settings.max_connections:
            self._refuse()
        else:
            self._start_head_timer()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def _watch_head(self) -> None:
        """Times a request head from its first byte (a pipelined one's too); stops once it is in."""
        if self.conn.their_state is not h11.IDLE:
            self._stop_head_timer()
        elif self.conn.trailing_data[0]:
            self._start_head_timer()

    def _start_head_timer(self) -> None:
        if self.head_timer is None and not self.transport.is_closing():
            self.head_timer = self.loop.call_later(self.settings.header_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_timed_out(self) -> None:
        self.head_timer = None
        log.debug("closed a connection from %s: no complete request head in %ss", self.client,
                  self.settings.header_timeout_s)  # fmt: skip
        self.transport.close()

    def _refuse(self) -> None:
        """503 and a lingering close: the connection leaves the count at once; the client's
        request is read and dropped, so the close cannot turn into a reset that loses the 503."""
        log.warning("refused a connection from %s: %d connections open (HTTP_MAX_CONNECTIONS)", self.client,
                    self.settings.max_connections)  # fmt: skip
        self.refused = True
        self.connections.discard(self)
        self.transport.write(REFUSAL)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)
