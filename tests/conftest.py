"""Shared fixtures: the serving stack, started once per session on free loopback ports.

`triton_only`: tritonserver serving model `llm` (the default model), no frontend.
`stack`: the OpenAI frontend on top of that same server (`client`, `model`: the openai
client on it and the served model name); `.base_url` is
"http://127.0.0.1:PORT/v1", plus `.triton_grpc_url`, `.triton_http_url`,
`.triton_metrics_url`. Both always tear down (stub processes and shm files included).
Process logs go to build/logs/.

Markers (`e2e`, `slow`, `gpu`) are registered in pyproject.toml.

The suite runs with QUANT_ACTIVATIONS=float32 (unless set): it proves the engine against
references token for token (transformers, PEFT, plain decoding against speculative, one
request alone against it among others), which takes float32's numbers; the default, auto,
gives the default model's int4 weights int8 activations (docs/quantization.md), whose
rounding those comparisons cannot hold to. tests/e2e/test_default_serving_e2e.py serves
that default and tests/backend/runner/quant/ its kernels.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from launcher import Stack, TritonServer
from launcher.layout import default_model_path

os.environ.setdefault("QUANT_ACTIVATIONS", "float32")  # before any server or engine starts


@pytest.fixture(scope="session")
def model_path():
    """$MODEL if set, else the default model (converted on first use)."""
    return default_model_path()


@pytest.fixture(scope="session")
def thinking_model_path(model_path):
    """The reasoning variant of the default model (tests/helpers/thinking_model.py), built once
    into build/ and reused."""
    from tests.helpers.thinking_model import build_thinking_model

    return build_thinking_model(Path(__file__).resolve().parent.parent / "build" / "models" / "SmolLM2-thinking")


@pytest.fixture(scope="session")
def triton_only(model_path) -> Iterator[TritonServer]:
    with TritonServer(model_path) as server:
        yield server


@pytest.fixture(scope="session")
def stack(triton_only, model_path) -> Iterator[Stack]:
    with Stack(model_path, triton=triton_only) as running:
        yield running


@pytest.fixture(scope="session")
def client(stack) -> openai.OpenAI:
    """The official openai client on the stack's frontend."""
    return openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def model(client) -> str:
    """The served model's name, as /v1/models lists it."""
    return client.models.list().data[0].id
