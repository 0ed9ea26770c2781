"""Fault handling without a server: which errors become 503s, and what the watchdog does."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import pytest

from backend.contract import ContractError, EngineUnavailable, ErrorKind, ErrorReport, GenerationRequest
from launcher.procs import free_port
from launcher.watchdog import NOT_READY_CHECKS, Watchdog
from openai_frontend.api.errors import OpenAIError, error_response, service_unavailable
from openai_frontend.generation.engine_client import EngineError, ModelUnavailable, TritonLLM, engine_error

DRAIN = "the server is shutting down"


@pytest.mark.parametrize(
    ("message", "says"),
    [
        # Triton's own words: not an ErrorReport, recognised as such
        ("Stub process 'llm_0_0' is not healthy.", "Stub process 'llm_0_0' is not healthy."),
        ("Request for unknown model: 'llm' is not found", "Request for unknown model: 'llm' is not found"),
        # the model's drain, as the model reports it (model.py: ErrorReport.of(EngineUnavailable(...)))
        (ErrorReport(ErrorKind.UNAVAILABLE, DRAIN).encode(), DRAIN),
        (ErrorReport.of(EngineUnavailable(DRAIN)).encode(), DRAIN),
    ],
)
def test_unavailable_model_errors_are_503(message, says):
    error = engine_error(message)
    assert isinstance(error, ModelUnavailable) and isinstance(error, EngineError)
    assert isinstance(error, OpenAIError) and error.status == 503
    assert error.field is None and says in error.message


def test_other_model_errors_are_not_503():
    refusal = engine_error(ErrorReport.of(ContractError("max_tokens", "must be at least 1")).encode())
    assert not isinstance(refusal, ModelUnavailable)
    assert refusal.field == "max_tokens"
    assert not isinstance(
        engine_error(ErrorReport(ErrorKind.INTERNAL, "CUDA error: out of memory").encode()), ModelUnavailable
    )
    assert not isinstance(engine_error("CUDA error: out of memory"), ModelUnavailable)
    # a message that is not an ErrorReport keeps no field
    assert engine_error("max_tokens: must be at least 1").field is None


def test_503_response_has_retry_after_and_openai_shape():
    response = error_response(service_unavailable("down"))
    assert response.status_code == 503
    assert response.headers["retry-after"].isdigit()
    body = json.loads(response.body)
    assert body == {"error": {"message": "down", "type": "server_error", "param": None, "code": "model_unavailable"}}


def test_unreachable_triton_is_503():
    async def first_pack():
        engine = TritonLLM(f"127.0.0.1:{free_port()}")
        try:
            async for _ in engine.generate(GenerationRequest([1, 2, 3])):
                pass
        finally:
            await engine.close()

    async def model_info():
        engine = TritonLLM(f"127.0.0.1:{free_port()}")
        try:
            return await engine.model_info()
        finally:
            await engine.close()

    with pytest.raises(ModelUnavailable):
        asyncio.run(asyncio.wait_for(first_pack(), 30))
    with pytest.raises(ModelUnavailable):  # the model's facts too: the app asks again later
        asyncio.run(asyncio.wait_for(model_info(), 30))


# -- the watchdog, on a stand-in server ----------------------------------------------


@dataclass
class _Process:
    code: int | None = None

    def poll(self) -> int | None:
        return self.code


@dataclass
class _Server:
    process: _Process | None = field(default_factory=_Process)
    stub: bool = True
    ready: bool = True
    restarts: int = 0

    def has_stub(self) -> bool:
        return self.stub

    def is_model_ready(self) -> bool:
        return self.ready

    def restart(self) -> None:
        self.restarts += 1
        self.process, self.stub, self.ready = _Process(), True, True


def test_watchdog_leaves_a_healthy_server_alone():
    server = _Server()
    watchdog = Watchdog(server)
    assert [watchdog.check() for _ in range(5)] == [None] * 5
    assert server.restarts == 0


def test_watchdog_restarts_when_the_stub_dies():
    server = _Server(stub=False)
    restart = Watchdog(server).check()
    assert server.restarts == 1 and "stub" in restart.reason


def test_watchdog_restarts_when_the_server_exits():
    server = _Server(process=_Process(code=-9))
    assert "exited" in Watchdog(server).check().reason
    assert server.restarts == 1


def test_watchdog_tolerates_a_blink_of_not_ready():
    server = _Server(ready=False)
    watchdog = Watchdog(server)
    results = [watchdog.check() for _ in range(NOT_READY_CHECKS)]
    assert results[:-1] == [None] * (NOT_READY_CHECKS - 1) and "not ready" in results[-1].reason
    assert server.restarts == 1


def test_watchdog_paused_or_unstarted_does_nothing():
    paused = Watchdog(_Server(stub=False))
    paused.pause()
    assert paused.check() is None
    assert Watchdog(_Server(process=None, stub=False)).check() is None
