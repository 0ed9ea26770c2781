"""Fixtures of the frontend's unit tests: the default model's tokenizer, loaded once, and
apps made with a given environment."""

from __future__ import annotations

import pytest

from openai_frontend.app import create_app
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.settings import Settings


@pytest.fixture(scope="session")
def tokenization() -> Tokenization:
    from backend.runner.convert import ensure_default_model

    return Tokenization(ensure_default_model())


@pytest.fixture
def make_app(tokenization):
    """An app configured by the given environment variables (and only those), on `engine`."""

    def make(engine, **env):
        environ = {name: str(value) for name, value in env.items()}
        app = create_app(Settings.from_env(environ, "unused", "smol"), tokenization=tokenization)
        app.state.serving.engine = engine
        return app

    return make
