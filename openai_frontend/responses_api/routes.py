"""The Responses API's endpoints: create, count input tokens, retrieve, delete, cancel."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from openai_frontend.api.errors import bad_request
from openai_frontend.api.serving import Serving
from openai_frontend.responses_api import handler
from openai_frontend.responses_api.protocol import ResponsesRequest
from openai_frontend.responses_api.store import ResponseStore

router = APIRouter()


def _serving(request: Request) -> Serving:
    return request.app.state.serving


def _store(request: Request) -> ResponseStore:
    """The app's store (app.py makes it: Settings.responses_store_max per tenant)."""
    return request.app.state.responses_store


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    body.check_fields()
    return await handler.create(_serving(request), _store(request), body, request)


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(body: ResponsesRequest, request: Request) -> dict[str, Any]:
    body.check_fields()
    return await handler.input_tokens(_serving(request), _store(request), body, request)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request) -> dict[str, Any]:
    return _store(request).get(handler.tenant_of(request), response_id).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    _store(request).delete(handler.tenant_of(request), response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> dict[str, Any]:
    """Only a background response can be cancelled (OpenAI's rule); none is, here."""
    _store(request).get(handler.tenant_of(request), response_id)
    raise bad_request(None, "Only responses created with background=true can be cancelled.")
