"""End to end, the HTTP server's bounds (openai_frontend/http_server.py) on a frontend started
with API keys: silent and slowloris connections are closed, connections past the cap are
refused, Content-Length with Transfer-Encoding and an oversized head are 400s, all before
any key is read (refusals, never 401s), while a tenant's requests and a stream longer than
the header timeout go on."""

from __future__ import annotations

import select
import socket
import threading
import time

import httpx
import openai
import pytest

from launcher import Stack

pytestmark = pytest.mark.e2e

KEY = "key-h"
HEADER_TIMEOUT_S = 3
MAX_CONNECTIONS = 6
MARGIN_S = 4.0  # scheduling slack on a busy machine
ENV = {
    "API_KEYS": f"{KEY}:tenant-h",
    "HTTP_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
    "HTTP_KEEPALIVE_TIMEOUT_S": "60",
    "HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
}


@pytest.fixture(scope="module")
def hardened(triton_only, model_path):
    with Stack(model_path, triton=triton_only, env=ENV) as running:
        yield running


@pytest.fixture(scope="module")
def model(hardened) -> str:
    with _client(hardened) as client:
        return client.models.list().data[0].id


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=300)


def _connect(stack) -> socket.socket:
    return socket.create_connection(("127.0.0.1", stack.frontend.port), timeout=30)


def _until_closed(sock: socket.socket) -> tuple[bytes, float]:
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def _drip_until_closed(sock: socket.socket, times: list[float]) -> None:
    """A head a byte every 0.2 s until the server closes; the seconds that took go in `times`."""
    start, text = time.monotonic(), b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 1000
    for byte in text:
        if select.select([sock], [], [], 0.2)[0] and sock.recv(65536) == b"":
            break
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            break
    times.append(time.monotonic() - start)


def _refused_at_once(sock: socket.socket) -> bool:
    """Whether the server answers this fresh connection a 503 within 0.5 s."""
    if not select.select([sock], [], [], 0.5)[0]:
        return False
    data, _ = _until_closed(sock)
    assert data.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in data
    return True


def test_silent_and_slowloris_connections_close_while_a_tenant_is_served(hardened, model):
    with _connect(hardened) as silent, _connect(hardened) as slow, _client(hardened) as client:
        times: list[float] = []
        dripping = threading.Thread(target=_drip_until_closed, args=(slow, times))
        dripping.start()
        answer = client.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert answer.usage.completion_tokens >= 1
        data, elapsed = _until_closed(silent)
        dripping.join(HEADER_TIMEOUT_S + MARGIN_S + 10)
        assert data == b"" and elapsed < HEADER_TIMEOUT_S + MARGIN_S
        assert len(times) == 1 and HEADER_TIMEOUT_S * 0.9 <= times[0] < HEADER_TIMEOUT_S + MARGIN_S


def test_connections_past_the_cap_get_503_before_auth_and_a_tenants_connection_keeps_working(hardened, model):
    limits = httpx.Limits(max_connections=1, keepalive_expiry=60)
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=hardened.base_url, headers=auth, limits=limits, timeout=300) as tenant:
        assert tenant.get("/models").status_code == 200  # the tenant's connection, kept alive
        held, refused = [], None
        for _ in range(MAX_CONNECTIONS):  # keep-alive connections without a key, until one is refused
            sock = _connect(hardened)
            if _refused_at_once(sock):
                refused = sock
                break
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
            held.append(sock)
        assert refused is not None and len(held) < MAX_CONNECTIONS
        with _connect(hardened) as keyless:  # refused as it opens: never a 401
            keyless.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Length: 2\r\n\r\n{}")
            data, elapsed = _until_closed(keyless)
            assert data.startswith(b"HTTP/1.1 503 ") and elapsed < 1.0
        answer = tenant.post("/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        with _connect(hardened) as still:  # the cap held while the tenant was served
            assert _refused_at_once(still)
        for sock in [refused, *held]:
            sock.close()
    deadline = time.monotonic() + 10
    while httpx.get(f"{hardened.base_url}/models", headers=auth).status_code != 200:
        assert time.monotonic() < deadline, "new connections stayed refused after the held ones closed"
        time.sleep(0.2)


def test_content_length_with_transfer_encoding_is_400_before_auth_and_nothing_smuggled_is_answered(hardened):
    smuggled = f"GET /v1/models HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % (5 + len(smuggled))
    )
    with _connect(hardened) as sock:
        sock.sendall(head + b"0\r\n\r\n" + smuggled)
        data, _ = _until_closed(sock)
    assert data.startswith(b"HTTP/1.1 400 ") and data.count(b"HTTP/1.1 ") == 1
    assert b'"object"' not in data  # no model list: the smuggled request never ran


def test_an_oversized_head_is_400_before_auth(hardened):
    with _connect(hardened) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
        data, _ = _until_closed(sock)
    assert data.startswith(b"HTTP/1.1 400 ")


def test_a_stream_longer_than_the_header_timeout_is_delivered_whole(hardened, model):
    with _client(hardened) as client:
        start = time.monotonic()
        client.completions.create(model=model, prompt="Once", max_tokens=32, extra_body={"ignore_eos": True})
        rate = 32 / (time.monotonic() - start)  # tokens per second, to size a stream past the timeout
        tokens = int(rate * (HEADER_TIMEOUT_S + 2)) + 32
        start = time.monotonic()
        stream = client.completions.create(
            model=model, prompt="Once", max_tokens=tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(stream)
        assert time.monotonic() - start > HEADER_TIMEOUT_S
        assert chunks[-1].usage.completion_tokens == tokens
        assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
