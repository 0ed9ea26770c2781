"""The FastAPI app: endpoints of the OpenAI API, /health and /metrics."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import PlainTextResponse

from openai_frontend.errors import install_handlers
from openai_frontend.protocol import ChatCompletionRequest, CompletionRequest, ModelList
from openai_frontend.serving import Serving
from openai_frontend.tokenization import Tokenization
from openai_frontend.triton_client import TritonLLM

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

router = APIRouter()


@dataclass(slots=True)
class Settings:
    model_path: str
    served_model_name: str
    triton_url: str = "127.0.0.1:8001"
    dump_dir: str | None = None  # --dump: one JSON file per request in this folder


def _serving(request: Request) -> Serving:
    return request.app.state.serving


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    return _serving(request).models()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _serving(request).chat(body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _serving(request).complete(body, request)


@router.get("/health")
async def health(request: Request) -> Response:
    engine = _serving(request).engine
    ready = engine is not None and await engine.is_ready()
    return Response(status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return PlainTextResponse(_serving(request).metrics.render(), media_type=PROMETHEUS_TEXT)


def create_app(settings: Settings, tokenization: Tokenization | None = None) -> FastAPI:
    """The app; its lifespan opens the one Triton client all requests share."""
    dump_dir = None
    if settings.dump_dir:
        dump_dir = Path(settings.dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
    serving = Serving(tokenization or Tokenization(settings.model_path), settings.served_model_name, dump_dir=dump_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.engine = TritonLLM(settings.triton_url)
        try:
            yield
        finally:
            await serving.engine.close()
            serving.engine = None

    app = FastAPI(title="LLM serving: OpenAI-compatible frontend", lifespan=lifespan)
    app.state.serving = serving
    install_handlers(app, on_error=lambda status: serving.metrics.errors.update([status]))
    app.include_router(router)
    return app
