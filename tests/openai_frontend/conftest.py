"""Fixtures of the frontend's unit tests: the default model's tokenizer, loaded once."""

from __future__ import annotations

import pytest

from openai_frontend.generation.tokenization import Tokenization


@pytest.fixture(scope="session")
def tokenization() -> Tokenization:
    from backend.runner.convert import ensure_default_model

    return Tokenization(ensure_default_model())
