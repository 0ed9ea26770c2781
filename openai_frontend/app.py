"""The FastAPI app: the routes (api/routes.py, api/lora.py), the gate in front of /v1/
(operations/gate.py), and the one Triton client all requests share."""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI

from openai_frontend.anthropic.errors import AnthropicErrors
from openai_frontend.anthropic.routes import router as anthropic_router
from openai_frontend.api import lora, tokenize
from openai_frontend.api.errors import install_handlers
from openai_frontend.api.routes import router
from openai_frontend.api.serving import Serving
from openai_frontend.generation.chat_template import TemplateBudget
from openai_frontend.generation.engine_client import TritonLLM
from openai_frontend.generation.replicas import Replicas
from openai_frontend.generation.routing import RoutingPolicy
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.media.settings import MediaSettings
from openai_frontend.operations.auth import KeyRing
from openai_frontend.operations.gate import Gate
from openai_frontend.operations.limits import Limits, LimitSettings
from openai_frontend.responses_api.routes import router as responses_router
from openai_frontend.ui import mount_ui, ui_enabled

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Settings:
    model_path: str
    served_model_name: str
    triton_url: str = "127.0.0.1:8001"
    dump_dir: str | None = None  # --dump: one JSON file per request in this folder
    triton_metrics_url: str | None = None  # the engine's gauges on /metrics come from here
    # several instances registered in NVIDIA Dynamo under this namespace instead of one
    # triton_url (generation/replicas.py), routed in router_mode (generation/routing.py)
    dynamo_namespace: str | None = None
    router_mode: str = "kv"


async def _engine(settings: Settings, serving: Serving) -> TritonLLM | Replicas:
    """The one Triton instance's client, or the instances behind Dynamo's router."""
    if not settings.dynamo_namespace:
        return TritonLLM(settings.triton_url)
    replicas = Replicas(settings.dynamo_namespace, RoutingPolicy(mode=settings.router_mode))
    await replicas.start()
    serving.metrics.router = replicas
    log.info("routing over Dynamo namespace %r (%s)", settings.dynamo_namespace, settings.router_mode)
    return replicas


def create_app(settings: Settings, tokenization: Tokenization | None = None) -> FastAPI:
    """The app; its lifespan opens the one Triton client all requests share and asks the
    running model for its facts and its LoRA adapters (again on the first request that
    needs them, if Triton was not up). API keys, limits, who may manage adapters, what
    media chat requests may bring (media/settings.py), a beam search stream's
    keep-alive interval (SSE_KEEPALIVE_S, seconds) and whether the playground page is
    served at / (UI, default 1; openai_frontend/ui/) come from the environment
    (operations/auth.py, limits.py, api/lora.py)."""
    dump_dir = None
    if settings.dump_dir:
        dump_dir = Path(settings.dump_dir)
        dump_dir.mkdir(parents=True, exist_ok=True)
    budget = TemplateBudget.from_env(os.environ)
    tokenization = tokenization or Tokenization(settings.model_path, budget)
    tokenization.template.budget = budget
    serving = Serving(tokenization, settings.served_model_name, dump_dir=dump_dir)
    serving.metrics.engine_url = settings.triton_metrics_url
    serving.keepalive_s = float(os.environ.get("SSE_KEEPALIVE_S", serving.keepalive_s))
    serving.media = MediaSettings.from_env(os.environ)

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
    keys = KeyRing.from_env(os.environ)
    limits = Limits(LimitSettings.from_env(os.environ))
    lora_admin = lora.LoraAdmin.from_env(os.environ, keys)
    log.info("API keys: %s; limits: %s", "none (open server)" if keys.open else "required", limits.settings)
    log.info("runtime LoRA management: %s", lora_admin)

    def count_error(status: int) -> None:
        serving.metrics.errors[status] += 1

    app.state.serving = serving
    app.state.limits = limits
    app.state.lora_admin = lora_admin
    install_handlers(app, on_error=count_error)
    app.include_router(router)
    app.include_router(tokenize.router)  # vLLM's /tokenize and /detokenize
    app.include_router(lora.router)
    app.include_router(responses_router)
    metrics_public = os.environ.get("METRICS_PUBLIC", "0").strip().lower() in ("1", "true", "yes")
    app.add_middleware(Gate, keys=keys, limits=limits, on_error=count_error, metrics_public=metrics_public)
    app.include_router(anthropic_router)  # Anthropic's /v1/messages (anthropic/routes.py)
    app.add_middleware(AnthropicErrors)  # outside the gate: its refusals in Anthropic's shape there too
    if ui_enabled(os.environ):
        mount_ui(app)  # the playground page at / (openai_frontend/ui/)
    return app
