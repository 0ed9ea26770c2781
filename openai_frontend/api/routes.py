"""The endpoints: the OpenAI API (/v1/models, /v1/chat/completions, /v1/completions), /health, /metrics
(runtime LoRA management: api/lora.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse

from openai_frontend.api.chat import chat
from openai_frontend.api.chat_protocol import ChatCompletionRequest
from openai_frontend.api.completions import complete
from openai_frontend.api.errors import error_response, service_unavailable
from openai_frontend.api.protocol import CompletionRequest, GenerationBody
from openai_frontend.api.responses import ModelCard, ModelList
from openai_frontend.api.serving import Serving

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter()


def _serving(request: Request) -> Serving:
    return request.app.state.serving


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return await _serving(request).models()


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    """The served model's card, or an adapter's; any other id is a 404 model_not_found."""
    return await _serving(request).model_card(model_id)


def _check(body: GenerationBody) -> None:
    """Before any work: every field honoured or refused (api/fields.py); the sizes are the
    gate's (operations/bounds.py)."""
    body.check_fields()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    _check(body)
    return await chat(_serving(request), body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    _check(body)
    return await complete(_serving(request), body, request)


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
