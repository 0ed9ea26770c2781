"""Running requests through an in-process engine to completion, for the engine's tests."""

from __future__ import annotations

from collections.abc import Mapping

from backend.contract import FinalEvent, GenerationRequest
from backend.core.engine import LLMEngine


def run_to_completion(
    engine: LLMEngine, requests: Mapping[str, GenerationRequest], arrival_time: float | None = None
) -> tuple[dict[str, list[int]], dict[str, FinalEvent]]:
    """Add the requests (by request id; all arriving at `arrival_time`, None: now), step
    until the engine is idle: (emitted tokens, final events) by request id."""
    for request_id, request in requests.items():
        engine.add_request(request_id, request, arrival_time)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    finals: dict[str, FinalEvent] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.token_ids
            if out.final is not None:
                finals[out.request_id] = out.final
    return tokens, finals
