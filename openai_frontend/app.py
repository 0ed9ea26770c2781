"""The FastAPI app: the routes (api/routes.py, api/lora.py), the gate in front of /v1/
(operations/gate.py), and the one Triton client all requests share."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI

from openai_frontend.anthropic.errors import AnthropicErrors
from openai_frontend.anthropic.routes import router as anthropic_router
from openai_frontend.api import lora, tokenize
from openai_frontend.api.errors import install_handlers
from openai_frontend.api.routes import router
from openai_frontend.api.serving import Serving
from openai_frontend.generation.dynamo_view import DynamoView
from openai_frontend.generation.engine_client import TritonLLM
from openai_frontend.generation.replicas import Replicas
from openai_frontend.generation.routing import RoutingPolicy
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.operations.gate import Gate
from openai_frontend.operations.limits import Limits
from openai_frontend.responses_api.routes import router as responses_router
from openai_frontend.responses_api.store import ResponseStore
from openai_frontend.settings import Settings
from openai_frontend.ui import mount_ui

log = logging.getLogger(__name__)


async def _engine(settings: Settings, serving: Serving) -> TritonLLM | Replicas:
    """The one Triton instance's client, or the instances behind Dynamo's router."""
    if not settings.dynamo_namespace:
        return TritonLLM(settings.triton_url)
    view = DynamoView(settings.dynamo_namespace, settings.dynamo)
    replicas = Replicas(settings.dynamo_namespace, RoutingPolicy(mode=settings.router_mode), view)
    await replicas.start()
    serving.metrics.router = replicas
    log.info("routing over Dynamo namespace %r (%s)", settings.dynamo_namespace, settings.router_mode)
    return replicas


def create_app(settings: Settings, tokenization: Tokenization | None = None) -> FastAPI:
    """The app; its lifespan opens the one Triton client all requests share and asks the
    running model for its facts and its LoRA adapters (again on the first request that
    needs them, if Triton was not up). Everything it is configured by comes in `settings`
    (openai_frontend/settings.py: API keys, limits, who may manage adapters, media, ...);
    it reads no environment."""
    serving = _serving(settings, tokenization)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        serving.engine = await _engine(settings, serving)
        try:
            await serving.model_info()
        except Exception as exc:  # noqa: BLE001 - asked again by the first request
            log.warning("the model's facts are not available yet: %s", exc)
        try:
            await serving.adapters.known(serving.engine)
        except Exception as exc:  # noqa: BLE001 - asked again by the first request naming one
            log.warning("the model's adapters are not known yet: %s", exc)
        try:
            yield
        finally:
            await serving.engine.close()
            serving.engine = None

    app = FastAPI(title="LLM serving: OpenAI-compatible frontend", lifespan=lifespan)
    _install(app, settings, serving)
    return app


def _serving(settings: Settings, tokenization: Tokenization | None) -> Serving:
    """The requests' shared state, configured by `settings` (the engine comes in the lifespan)."""
    dump_dir = None
    if settings.dump_dir:
        dump_dir = Path(settings.dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
    tokenization = tokenization or Tokenization(settings.model_path, settings.template_budget)
    tokenization.template.budget = settings.template_budget
    serving = Serving(tokenization, settings.served_model_name, dump_dir=dump_dir)
    serving.metrics.engine_url = settings.triton_metrics_url
    serving.keepalive_s = settings.keepalive_s
    serving.media = settings.media
    return serving


def _install(app: FastAPI, settings: Settings, serving: Serving) -> None:
    """The routes, the gate in front of them (keys, limits) and the error handlers."""
    keys, limits, lora_admin = settings.keys, Limits(settings.limits), settings.lora_admin
    log.info("API keys: %s; limits: %s", "none (open server)" if keys.open else "required", limits.settings)
    log.info("runtime LoRA management: %s", lora_admin)

    def count_error(status: int) -> None:
        serving.metrics.errors[status] += 1

    app.state.serving = serving
    app.state.limits = limits
    app.state.lora_admin = lora_admin
    app.state.responses_store = ResponseStore(settings.responses_store_max)
    install_handlers(app, on_error=count_error)
    app.include_router(router)
    app.include_router(tokenize.router)  # vLLM's /tokenize and /detokenize
    app.include_router(lora.router)
    app.include_router(responses_router)
    app.add_middleware(Gate, keys=keys, limits=limits, on_error=count_error, metrics_public=settings.metrics_public)
    app.include_router(anthropic_router)  # Anthropic's /v1/messages (anthropic/routes.py)
    app.add_middleware(AnthropicErrors)  # outside the gate: its refusals in Anthropic's shape there too
    if settings.ui:
        mount_ui(app)  # the playground page at / (openai_frontend/ui/)
