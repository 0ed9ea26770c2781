"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
PERMISSION_DENIED = "permission_denied"
SERVER_ERROR = "server_error"
MODEL_UNAVAILABLE = "model_unavailable"
RETRY_AFTER_S = 5  # about what tritonserver takes to restart the model (launcher.watchdog)


class OpenAIError(Exception):
    """An error returned to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str = INVALID_REQUEST,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(param: str | None, message: str) -> OpenAIError:
    return OpenAIError(400, message, param)


def model_not_found(model: str) -> OpenAIError:
    message = f"The model `{model}` does not exist."
    return OpenAIError(404, message, "model", NOT_FOUND, "model_not_found")


def permission_denied(message: str) -> OpenAIError:
    return OpenAIError(403, message, None, PERMISSION_DENIED, "insufficient_permissions")


def internal_error(exc: BaseException | None, what: str) -> OpenAIError:
    """A 500 that tells the client an error id and nothing of the failure itself: the
    detail (the exception, its traceback) goes to the log under that id."""
    error_id = f"err_{secrets.token_hex(8)}"
    log.error("%s [%s]", what, error_id, exc_info=exc)
    message = f"The server had an error while processing your request (error id {error_id}; the server's log has it)."
    return OpenAIError(500, message, None, SERVER_ERROR, "internal_error")


def service_unavailable(message: str, retry_after_s: int = RETRY_AFTER_S) -> OpenAIError:
    """503: the model cannot serve now (down, restarting, shutting down); Retry-After
    tells clients (the openai SDK honours it) when to try again."""
    headers = {"Retry-After": str(retry_after_s)}
    return OpenAIError(503, message, None, SERVER_ERROR, MODEL_UNAVAILABLE, headers)


def from_validation(exc: RequestValidationError) -> OpenAIError:
    """The first pydantic error, naming the field (`messages.0.content`)."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return bad_request(None, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if not loc and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        # also what a JSON body sent without `Content-Type: application/json` becomes
        return bad_request(None, "the body must be a JSON object, sent with Content-Type: application/json")
    param = ".".join(loc) or None
    ctx = first.get("ctx") or {}
    if first.get("type") == "content_part" and len(loc) >= 3 and loc[0] == "messages":
        # a chat content part (api/chat_protocol.py): named as its media errors name it
        param = f"messages[{loc[1]}].content[{ctx['part']}]"
        return bad_request(param, f"{param}: {ctx['why']}")
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return bad_request(param, message)


def error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def install_handlers(app: FastAPI, on_error=None) -> None:
    """Map every failure to OpenAI's shape; `on_error(status)` counts it."""

    def respond(error: OpenAIError) -> JSONResponse:
        if on_error is not None:
            on_error(error.status)
        return error_response(error)

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError):
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return respond(from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        kind = NOT_FOUND if exc.status_code == 404 else INVALID_REQUEST
        return respond(OpenAIError(exc.status_code, str(exc.detail), None, kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return respond(internal_error(exc, f"unhandled error in {request.method} {request.url.path}"))
