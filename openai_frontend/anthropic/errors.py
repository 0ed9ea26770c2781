"""Anthropic-shaped errors on /v1/messages: `{"type": "error", "error": {"type", "message"}}`.

The handlers raise the frontend's OpenAIError like every endpoint; `AnthropicErrors`
(ASGI middleware, outside the gate) rewrites every OpenAI-shaped error response on these
paths (the gate's 401 / 413 / 429 / 503, a 404, a handler's refusal) into Anthropic's
shape, keeping the status and headers (Retry-After).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openai_frontend.api.errors import OpenAIError, bad_request

MESSAGES_PATH = "/v1/messages"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_BLOCK_TAGS = {"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"}


class AnthropicError(OpenAIError):
    def error(self) -> dict[str, str]:
        return {"type": _TYPES.get(self.status, "api_error"), "message": self.message}

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": self.error()}


def anthropic_error(error: OpenAIError) -> AnthropicError:
    return AnthropicError(error.status, error.message, error.param, error.type, error.code, error.headers)


def from_validation(exc: ValidationError) -> OpenAIError:
    """A 400 naming every unknown field, else the first invalid one (`messages[0].role`)."""
    errors = exc.errors()
    # a union's branches each report: a list that is not a string is judged as the list
    errors = [e for e in errors if "str" not in e["loc"]] or errors
    unknown = [_path(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        names = ", ".join(unknown)
        return bad_request(unknown[0], f"{names}: unknown field{'s' if len(unknown) > 1 else ''} (not accepted here)")
    first = errors[0]
    path = _path(first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "Field required"
    return bad_request(path or None, f"{path}: {message}" if path else message)


def _path(loc: tuple) -> str:
    """A pydantic location as a JS-style path; a content block's type tag (after its index) dropped."""
    path = ""
    previous: Any = None
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part:  # a union's branch (`list[tagged-union[...]]`)
            continue
        elif not (isinstance(previous, int) and part in _BLOCK_TAGS):
            path += f".{part}" if path else str(part)
        previous = part
    return path


class AnthropicErrors:
    """Rewrites OpenAI-shaped error responses on /v1/messages paths into Anthropic's shape."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(MESSAGES_PATH):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshaping(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400 and _is_json(message):
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                await _send_reshaped(send, start, b"".join(chunks))

        await self.app(scope, receive, reshaping)


def _is_json(start: Message) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json") for k, v in start["headers"])


async def _send_reshaped(send: Send, start: Message, body: bytes) -> None:
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and payload.get("type") != "error":
        shaped = AnthropicError(start["status"], str(error.get("message", "")))
        body = json.dumps(shaped.body()).encode()
    headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})
