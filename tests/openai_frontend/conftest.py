"""Fixtures of the frontend's unit tests: the default model's tokenizer, loaded once, and
apps made with a given environment."""

from __future__ import annotations

import pytest

from openai_frontend.app import Settings, create_app
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.media.settings import ENV_NAMES as MEDIA_ENV
from openai_frontend.operations.limits import LimitSettings

# what the app reads from the environment: cleared before each app is made
APP_ENV = ["API_KEYS", "API_KEYS_FILE", "ALLOW_RUNTIME_LORA", "ADMIN_TENANTS", "SSE_KEEPALIVE_S", "UI", "METRICS_PUBLIC",
           "CHAT_TEMPLATE_TIMEOUT_S", "CHAT_TEMPLATE_MAX_CHARS",
           *(f.upper() for f in LimitSettings.__dataclass_fields__), *MEDIA_ENV]  # fmt: skip


@pytest.fixture(scope="session")
def tokenization() -> Tokenization:
    from backend.runner.convert import ensure_default_model

    return Tokenization(ensure_default_model())


@pytest.fixture
def make_app(tokenization, monkeypatch):
    """An app configured by the given environment variables (and only those), on `engine`."""

    def make(engine, **env):
        for name in APP_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, str(value))
        app = create_app(Settings("unused", "smol"), tokenization=tokenization)
        app.state.serving.engine = engine
        return app

    return make
