"""The gate in front of /v1/ (and /tokenize, /detokenize, /metrics): API keys, the body's size
and content bounds, admission and the tenants' slots, as ASGI middleware."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_frontend.api.errors import INVALID_REQUEST, OpenAIError, error_response
from openai_frontend.operations.auth import KeyRing
from openai_frontend.operations.bounds import checked_body
from openai_frontend.operations.limits import Limits, LimitSettings, Ticket

GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
# outside /v1/ yet behind the same keys and body bound: vLLM's tokenizer routes (api/tokenize.py)
GATED_PATHS = frozenset({"/tokenize", "/detokenize"})
_LARGE_BODY_BYTES = 64 * 1024  # a body this large is checked off the event loop


class Gate:
    """ASGI middleware in front of /v1/: the API key (401); for every POST, the declared
    body size and then the body itself, read within its bound (413); and for generation
    requests (GENERATION_PATHS), first the tenant's and the server's slots (429, 503, or
    a wait in the queue). Other POSTs (LoRA management) take no slot and no tokens.

    It is ASGI, not a FastAPI dependency, so that a refusal comes before the body is
    parsed or even read, and so that the slots are freed when the app returns: when the
    response, a stream included, has been sent or the client has left. The tenant, and a
    generation's Ticket, ride in scope["state"] for the handlers; every response of an
    admitted generation carries the tenant's x-ratelimit-* headers.
    """

    def __init__(
        self, app: ASGIApp, keys: KeyRing, limits: Limits, on_error: Callable[[int], None], metrics_public: bool = False
    ):
        self.app = app
        self.keys = keys
        self.limits = limits
        self.on_error = on_error
        # /metrics names the tenants and their usage: behind a key unless the operator says
        self.gated_paths = GATED_PATHS if metrics_public else GATED_PATHS | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gated = scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in self.gated_paths)
        if not gated:
            await self.app(scope, receive, send)
            return
        posted = scope["method"] == "POST"
        generation = posted and scope["path"] in GENERATION_PATHS
        try:
            tenant = self.keys.tenant(_header(scope, b"authorization"), _header(scope, b"x-api-key"))
            if posted:
                _check_content_length(scope, self.limits.settings.max_request_bytes)
            if generation:
                ticket = await self.limits.admit(tenant)
        except OpenAIError as error:
            await self._refuse(error, scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        if generation:
            await self._admitted(ticket, scope, receive, send)
        elif posted:
            await self._bounded(scope, receive, send, send)
        else:
            await self.app(scope, receive, send)

    async def _admitted(self, ticket: Ticket, scope: Scope, receive: Receive, send: Send) -> None:
        status = 0  # the response's, once it begins; 0: none began

        async def send_with_limits(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = _with_headers(message, self.limits.tenants.headers(ticket.tenant))
            await send(message)

        scope["state"]["ticket"] = ticket
        try:
            await self._bounded(scope, receive, send, send_with_limits)
        finally:
            self.limits.release(ticket, status)

    async def _bounded(self, scope: Scope, receive: Receive, send: Send, app_send: Send) -> None:
        """The app on the body read within its bound (a 413 past it, sent on `send`) and
        within every bound on its content (operations/bounds.py, a 400); the app's
        messages go to `app_send`."""
        settings = self.limits.settings
        try:
            raw, replay = await _bounded_body(receive, settings.max_request_bytes)
            if raw:
                await _off_loop_if_large(checked_body, raw, settings)
        except OpenAIError as error:
            await self._refuse(error, scope, receive, send)
            return
        await self.app(scope, replay, app_send)

    async def _refuse(self, error: OpenAIError, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_error(error.status)
        await error_response(error)(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _too_large(limit: int) -> OpenAIError:
    message = f"The request body is larger than {limit} bytes (the server's MAX_REQUEST_BYTES)."
    return OpenAIError(413, message, None, INVALID_REQUEST, "request_too_large")


def _check_content_length(scope: Scope, limit: int) -> None:
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)


async def _bounded_body(receive: Receive, limit: int) -> tuple[bytes, Receive]:
    """The body read in full, up to `limit` bytes (a 413 past it, whatever Content-Length
    said), and a receive that replays it; later messages (a disconnect) come through."""
    buffered: deque[Message] = deque()
    size = 0
    while True:
        message = await receive()
        buffered.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if size > limit:
            raise _too_large(limit)
        if not message.get("more_body", False):
            break

    raw = b"".join(m.get("body", b"") for m in buffered if m["type"] == "http.request")

    async def replay() -> Message:
        return buffered.popleft() if buffered else await receive()

    return raw, replay


async def _off_loop_if_large(check: Callable[[bytes, LimitSettings], object], raw: bytes, settings: LimitSettings):
    """A large body is parsed and walked on a thread: the event loop keeps serving meanwhile."""
    if len(raw) < _LARGE_BODY_BYTES:
        return check(raw, settings)
    return await asyncio.to_thread(check, raw, settings)


def _with_headers(message: Message, headers: dict[str, str]) -> Message:
    """The response start with `headers` added, except those the response already set."""
    present = {key.lower() for key, _ in message.get("headers", [])}
    extra = [(k.encode(), v.encode()) for k, v in headers.items() if k.encode() not in present]
    return {**message, "headers": [*message.get("headers", []), *extra]}
