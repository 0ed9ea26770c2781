"""The FastAPI app: endpoints of the OpenAI API, /health and /metrics, and the gate in front of /v1/."""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.config import EngineConfig
from openai_frontend.auth import KeyRing
from openai_frontend.errors import INVALID_REQUEST, OpenAIError, error_response, install_handlers, service_unavailable
from openai_frontend.limits import Limits, LimitSettings, Ticket
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest, ModelList
from openai_frontend.serving import Serving
from openai_frontend.tokenization import Tokenization
from openai_frontend.triton_client import TritonLLM

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
log = logging.getLogger(__name__)

router = APIRouter()


@dataclass(slots=True)
class Settings:
    model_path: str
    served_model_name: str
    triton_url: str = "127.0.0.1:8001"
    dump_dir: str | None = None  # --dump: one JSON file per request in this folder
    triton_metrics_url: str | None = None  # the engine's gauges on /metrics come from here


def _serving(request: Request) -> Serving:
    return request.app.state.serving


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return _serving(request).models()


def _check_sizes(body: GenerationRequest, request: Request) -> None:
    settings: LimitSettings = request.app.state.limits.settings
    body.check_sizes(settings.max_messages, settings.max_string_chars)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    _check_sizes(body, request)
    return await _serving(request).chat(body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    _check_sizes(body, request)
    return await _serving(request).complete(body, request)


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while model `llm` is ready on Triton; 503 (Retry-After) while Triton is down
    or restarting it, so a load balancer sends traffic elsewhere meanwhile."""
    engine = _serving(request).engine
    if engine is not None and await engine.is_ready():
        return Response(status_code=200)
    return error_response(service_unavailable("the model is not ready"))


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return PlainTextResponse(await _serving(request).metrics.scrape(), media_type=PROMETHEUS_TEXT)


class Gate:
    """ASGI middleware in front of /v1/: the API key (401); then, for generation requests
    (POST), the declared body size (413), the tenant's and the server's slots (429, 503,
    or a wait in the queue) and the body itself, read within its bound (413).

    It is ASGI, not a FastAPI dependency, so that a refusal comes before the body is
    parsed or even read, and so that the slots are freed when the app returns: when the
    response, a stream included, has been sent or the client has left. The request's
    Ticket rides in scope["state"] for the serving code; every response of an admitted
    request carries the tenant's x-ratelimit-* headers.
    """

    def __init__(self, app: ASGIApp, keys: KeyRing, limits: Limits, on_error: Callable[[int], None]):
        self.app = app
        self.keys = keys
        self.limits = limits
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        generation = scope["method"] == "POST"
        try:
            tenant = self.keys.tenant(_header(scope, b"authorization"))
            if generation:
                _check_content_length(scope, self.limits.settings.max_request_bytes)
                ticket = await self.limits.admit(tenant)
        except OpenAIError as error:
            await self._refuse(error, scope, receive, send)
            return
        if generation:
            await self._admitted(ticket, scope, receive, send)
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

        try:
            try:
                replay = await _bounded_body(receive, self.limits.settings.max_request_bytes)
            except OpenAIError as error:
                await self._refuse(error, scope, receive, send)
                return
            scope.setdefault("state", {})["ticket"] = ticket
            await self.app(scope, replay, send_with_limits)
        finally:
            self.limits.release(ticket, status)

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


async def _bounded_body(receive: Receive, limit: int) -> Receive:
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

    async def replay() -> Message:
        return buffered.popleft() if buffered else await receive()

    return replay


def _with_headers(message: Message, headers: dict[str, str]) -> Message:
    """The response start with `headers` added, except those the response already set."""
    present = {key.lower() for key, _ in message.get("headers", [])}
    extra = [(k.encode(), v.encode()) for k, v in headers.items() if k.encode() not in present]
    return {**message, "headers": [*message.get("headers", []), *extra]}


def create_app(settings: Settings, tokenization: Tokenization | None = None) -> FastAPI:
    """The app; its lifespan opens the one Triton client all requests share. API keys,
    limits and MAX_MODEL_LEN come from the environment (openai_frontend/auth.py, limits.py)."""
    dump_dir = None
    if settings.dump_dir:
        dump_dir = Path(settings.dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
    if tokenization is None:  # the context cap as the engine reads it (MAX_MODEL_LEN)
        max_model_len = EngineConfig.from_env(settings.model_path).max_model_len
        tokenization = Tokenization(settings.model_path, max_model_len=max_model_len)
    serving = Serving(tokenization, settings.served_model_name, dump_dir=dump_dir)
    serving.metrics.engine_url = settings.triton_metrics_url

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.engine = TritonLLM(settings.triton_url)
        try:
            yield
        finally:
            await serving.engine.close()
            serving.engine = None

    app = FastAPI(title="LLM serving: OpenAI-compatible frontend", lifespan=lifespan)
    keys = KeyRing.from_env(os.environ)
    limits = Limits(LimitSettings.from_env(os.environ))
    log.info("API keys: %s; limits: %s", "none (open server)" if keys.open else "required", limits.settings)

    def count_error(status: int) -> None:
        serving.metrics.errors[status] += 1

    app.state.serving = serving
    app.state.limits = limits
    install_handlers(app, on_error=count_error)
    app.include_router(router)
    app.add_middleware(Gate, keys=keys, limits=limits, on_error=count_error)
    return app
