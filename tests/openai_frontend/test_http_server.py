"""The HTTP server's bounds (openai_frontend/http_server.py), against a real uvicorn server on
a loopback port serving a small ASGI app, driven by raw sockets: the header and keep-alive
timeouts, the cap on connections, requests per connection, the head's size, and Content-Length
with Transfer-Encoding; a stream and a slow body outlast every timeout."""

from __future__ import annotations

import asyncio
import http.client
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
import uvicorn

from openai_frontend.http_server import HttpSettings, uvicorn_options

SHORT = HttpSettings(header_timeout_s=1.0, keepalive_timeout_s=1.0, max_connections=4,
                     max_requests_per_connection=3, max_header_bytes=4096)  # fmt: skip
MARGIN_S = 3.0  # scheduling slack on a busy machine
STREAM_GAP_S = 1.5  # longer than every timeout of SHORT


class App:
    """GET /stream: three SSE events STREAM_GAP_S apart; POST /echo: the body's length;
    anything else: "hello". `seen`: the paths it was called for."""

    def __init__(self):
        self.seen: list[str] = []

    async def __call__(self, scope, receive, send):
        self.seen.append(scope["path"])
        if scope["path"] == "/stream":
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
            )
            for i in range(3):
                await asyncio.sleep(0 if i == 0 else STREAM_GAP_S)
                await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        body = b""
        if scope["method"] == "POST":
            while (message := await receive())["type"] == "http.request":
                body += message.get("body", b"")
                if not message.get("more_body"):
                    break
        text = str(len(body)).encode() if scope["path"] == "/echo" else b"hello"
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(text)).encode())]}
        )
        await send({"type": "http.response.body", "body": text})


@contextmanager
def serving(settings: HttpSettings = SHORT) -> Iterator[tuple[int, App, uvicorn.Server]]:
    """(port, app, server): uvicorn on a free loopback port, through uvicorn_options."""
    app = App()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, lifespan="off", log_level="warning", **uvicorn_options(settings)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], app, server
    finally:
        server.should_exit = True
        thread.join(10)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def _get(sock: socket.socket, path: str = "/") -> http.client.HTTPResponse:
    return _get_raw(sock, f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())


def _get_raw(sock: socket.socket, head: bytes) -> http.client.HTTPResponse:
    sock.sendall(head)
    response = http.client.HTTPResponse(sock, method="GET")
    response.begin()
    return response


def _until_closed(sock: socket.socket, limit_s: float = 10) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and the seconds that took."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit_s)
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _closed_while_dripping(sock: socket.socket, text: bytes) -> float:
    """Sends `text` a byte every 0.1 s (repeating) until the server closes; the seconds that took."""
    start = time.monotonic()
    while time.monotonic() - start < 10:
        for byte in text:
            if select.select([sock], [], [], 0.1)[0]:
                assert sock.recv(65536) == b"", "the server answered a head never finished"
                return time.monotonic() - start
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
    raise AssertionError("the server kept a dripping head open for 10 s")


def _count(server: uvicorn.Server, expected: int) -> None:
    deadline = time.monotonic() + 5
    while len(server.server_state.connections) != expected:
        assert time.monotonic() < deadline, f"{len(server.server_state.connections)} connections, not {expected}"
        time.sleep(0.02)


def test_keep_alive_requests_share_a_connection_until_the_per_connection_limit():
    with serving() as (port, app, _), _connect(port) as sock:
        answers = [_get(sock) for _ in range(SHORT.max_requests_per_connection)]
        for response in answers:
            assert response.status == 200 and response.read() == b"hello"
        assert [r.getheader("connection") for r in answers] == [None, None, "close"]
        assert _until_closed(sock)[0] == b""
        assert app.seen == ["/"] * SHORT.max_requests_per_connection


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout():
    with serving() as (port, app, server), _connect(port) as sock:
        data, elapsed = _until_closed(sock)
        assert data == b"" and SHORT.header_timeout_s * 0.9 <= elapsed < SHORT.header_timeout_s + MARGIN_S
        _count(server, 0)


@pytest.mark.parametrize("after_a_response", [False, True])
def test_a_head_sent_a_byte_at_a_time_is_closed_after_the_header_timeout(after_a_response):
    with serving() as (port, app, _), _connect(port) as sock:
        if after_a_response:  # a keep-alive connection's next head: its first byte starts the clock
            assert _get(sock).read() == b"hello"
        elapsed = _closed_while_dripping(sock, b"GET / HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 200)
        assert SHORT.header_timeout_s * 0.9 <= elapsed < SHORT.header_timeout_s + MARGIN_S
        assert app.seen == (["/"] if after_a_response else [])


def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout():
    settings = replace(SHORT, header_timeout_s=30.0)
    with serving(settings) as (port, _, _), _connect(port) as sock:
        assert _get(sock).read() == b"hello"
        data, elapsed = _until_closed(sock)
        assert data == b"" and elapsed < settings.keepalive_timeout_s + MARGIN_S


def test_a_stream_and_a_slow_body_outlast_every_timeout():
    with serving() as (port, _, _), _connect(port) as sock:
        start = time.monotonic()
        stream = _get(sock, "/stream")
        assert stream.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert time.monotonic() - start >= 2 * STREAM_GAP_S > SHORT.header_timeout_s + SHORT.keepalive_timeout_s
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 12\r\n\r\n")
        for byte in b"twelve bytes":  # 2.4 s of body
            time.sleep(0.2)
            sock.sendall(bytes([byte]))
        echo = http.client.HTTPResponse(sock, method="POST")
        echo.begin()
        assert echo.status == 200 and echo.read() == b"12"


def test_connections_past_the_cap_are_refused_at_once_and_established_ones_keep_working():
    settings = replace(SHORT, max_connections=3, header_timeout_s=10.0, keepalive_timeout_s=10.0)
    with serving(settings) as (port, app, server):
        a, b, silent = _connect(port), _connect(port), _connect(port)
        assert _get(a).read() == b"hello" and _get(b).read() == b"hello"
        _count(server, 3)
        with _connect(port) as quiet, _connect(port) as asking:
            asking.sendall(b"GET /refused HTTP/1.1\r\nHost: test\r\n\r\n")
            for refused in (quiet, asking):
                data, elapsed = _until_closed(refused)
                assert data.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in data
                assert b'"code": "too_many_connections"' in data and elapsed < 1.0
        _count(server, 3)  # the refused ones took no slot
        assert _get(a).read() == b"hello" and _get(b).read() == b"hello"
        silent.close()
        _count(server, 2)
        with _connect(port) as later:
            assert _get(later).read() == b"hello"
        a.close(), b.close()
        assert "/refused" not in app.seen


@pytest.mark.parametrize(
    "names", [(b"Content-Length", b"Transfer-Encoding"), (b"transfer-ENCODING", b"content-length")]
)
def test_content_length_with_transfer_encoding_is_400_and_closed_and_nothing_smuggled_is_answered(names):
    first, second = names
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: test\r\n\r\n"
    framing = {b"content-length": b"%d" % (5 + len(smuggled)), b"transfer-encoding": b"chunked"}
    head = b"POST /echo HTTP/1.1\r\nHost: test\r\n" + b"".join(
        name + b": " + framing[name.lower()] + b"\r\n" for name in (first, second)
    )
    with serving() as (port, app, _), _connect(port) as sock:
        sock.sendall(head + b"\r\n0\r\n\r\n" + smuggled)
        data, _ = _until_closed(sock)
        assert data.startswith(b"HTTP/1.1 400 ") and data.count(b"HTTP/1.1") == 1
        assert b"connection: close" in data.lower()
        assert app.seen == []


@pytest.mark.parametrize("in_pieces", [False, True])
def test_a_request_head_past_the_size_bound_is_400_and_closed(in_pieces):
    line = b"GET / HTTP/1.1\r\nHost: test\r\nX-Big: "
    fits = line + b"a" * (SHORT.max_header_bytes - len(line) - 4) + b"\r\n\r\n"
    with serving() as (port, app, _), _connect(port) as sock:
        assert len(fits) == SHORT.max_header_bytes and _get_raw(sock, fits).read() == b"hello"
    with serving() as (port, app, _), _connect(port) as sock:
        if in_pieces:  # h11's bound on its buffer: refused before the head ends
            sock.sendall(line)
            time.sleep(0.2)
            sock.sendall(b"a" * SHORT.max_header_bytes)
        else:  # one byte over, whole in one read: GuardedConnection's bound
            sock.sendall(fits[:-4] + b"a\r\n\r\n")
        data, _ = _until_closed(sock)
        assert data.startswith(b"HTTP/1.1 400 ") and app.seen == []


def test_settings_from_the_environment():
    assert HttpSettings.from_env({}) == HttpSettings()
    env = {"HTTP_HEADER_TIMEOUT_S": "2.5", "HTTP_MAX_CONNECTIONS": " 10 ", "HTTP_MAX_REQUESTS_PER_CONNECTION": ""}
    assert HttpSettings.from_env(env) == HttpSettings(header_timeout_s=2.5, max_connections=10)
    for name, raw in (
        ("HTTP_KEEPALIVE_TIMEOUT_S", "0"),
        ("HTTP_MAX_HEADER_BYTES", "-1"),
        ("HTTP_MAX_CONNECTIONS", "1.5"),
    ):
        with pytest.raises(ValueError, match=name):
            HttpSettings.from_env({name: raw})
