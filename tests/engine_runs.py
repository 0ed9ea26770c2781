"""Running requests through an in-process engine to completion, for the engine's tests."""

from __future__ import annotations

from backend.engine import LLMEngine
from backend.request import EngineRequest, FinalStats


def run_to_completion(
    engine: LLMEngine, *requests: EngineRequest
) -> tuple[dict[str, list[int]], dict[str, FinalStats]]:
    """Add the requests, step until the engine is idle: (emitted tokens, final stats) by request id."""
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finals: dict[str, FinalStats] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.final is not None:
                finals[out.request_id] = out.final
    return tokens, finals
