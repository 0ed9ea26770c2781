"""The frontend's settings: the one place that reads its environment.

`Settings.from_env(environ, ...)` (called once, by __main__, with os.environ) parses every
variable the frontend reads, each with its sub-settings' own parser, and the app is
made from the result (app.py's `create_app`); nothing below it reads the environment.
A `Settings` made directly holds the defaults: what an empty environment gives.

What it reads (docs/configuration.md): DUMP_DIR (when --dump is not given), HTTP_* (http_server.py),
CHAT_TEMPLATE_TIMEOUT_S and CHAT_TEMPLATE_MAX_CHARS (generation/chat_template.py),
SSE_KEEPALIVE_S (seconds: a silent beam search stream's keep-alive comment), the media
limits (media/settings.py), API_KEYS and API_KEYS_FILE (operations/auth.py), the limits
(operations/limits.py), ALLOW_RUNTIME_LORA and ADMIN_TENANTS (api/lora.py),
METRICS_PUBLIC (/metrics without an API key), UI (the playground page at /, ui/),
DYN_DISCOVERY_BACKEND and DYN_REQUEST_PLANE (generation/dynamo_view.py) and
RESPONSES_STORE_MAX (responses_api/store.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from openai_frontend.api.lora import LoraAdmin
from openai_frontend.api.serving import KEEPALIVE_S
from openai_frontend.generation.chat_template import TemplateBudget
from openai_frontend.generation.dynamo_view import DynamoSettings
from openai_frontend.http_server import HttpSettings
from openai_frontend.media.settings import MediaSettings
from openai_frontend.operations.auth import KeyRing
from openai_frontend.operations.limits import LimitSettings
from openai_frontend.responses_api.store import DEFAULT_MAX, store_max_from_env
from openai_frontend.ui import ui_enabled

_TRUE = ("1", "true", "yes")


@dataclass(slots=True)
class Settings:
    model_path: str
    served_model_name: str
    triton_url: str = "127.0.0.1:8001"
    dump_dir: str | None = None  # --dump (default DUMP_DIR): one JSON file per request in this folder
    triton_metrics_url: str | None = None  # the engine's gauges on /metrics come from here
    # several instances registered in NVIDIA Dynamo under this namespace instead of one
    # triton_url (generation/replicas.py), routed in router_mode (generation/routing.py)
    dynamo_namespace: str | None = None
    router_mode: str = "kv"
    # from the environment (the module's docstring); the defaults are an empty environment's
    http: HttpSettings = field(default_factory=HttpSettings)
    template_budget: TemplateBudget = field(default_factory=TemplateBudget)
    keepalive_s: float = KEEPALIVE_S
    media: MediaSettings = field(default_factory=MediaSettings)
    keys: KeyRing = field(default_factory=lambda: KeyRing({}))
    limits: LimitSettings = field(default_factory=LimitSettings)
    lora_admin: LoraAdmin = field(default_factory=LoraAdmin)
    metrics_public: bool = False
    ui: bool = True
    dynamo: DynamoSettings = field(default_factory=DynamoSettings)
    responses_store_max: int = DEFAULT_MAX

    @classmethod
    def from_env(cls, environ: Mapping[str, str], model_path: str, served_model_name: str, **options: Any) -> Settings:
        """The settings `environ` gives, over `options` (the other fields: the command
        line's); a ValueError (KeyConfigError for the keys) naming a malformed variable."""
        if options.get("dump_dir") is None:
            options["dump_dir"] = environ.get("DUMP_DIR") or None
        return cls(model_path, served_model_name, **options, **_from_environ(environ))


def _from_environ(environ: Mapping[str, str]) -> dict[str, Any]:
    """The fields read from the environment, parsed in the order the frontend always has."""
    http = HttpSettings.from_env(environ)
    budget = TemplateBudget.from_env(environ)
    keepalive_s = float(environ.get("SSE_KEEPALIVE_S", KEEPALIVE_S))
    media = MediaSettings.from_env(environ)
    keys = KeyRing.from_env(environ)
    limits = LimitSettings.from_env(environ)
    lora_admin = LoraAdmin.from_env(environ, keys)
    metrics_public = environ.get("METRICS_PUBLIC", "0").strip().lower() in _TRUE
    return dict(
        http=http, template_budget=budget, keepalive_s=keepalive_s, media=media, keys=keys, limits=limits,
        lora_admin=lora_admin, metrics_public=metrics_public, ui=ui_enabled(environ),
        dynamo=DynamoSettings.from_env(environ), responses_store_max=store_max_from_env(environ),
    )  # fmt: skip
