"""`--dump DIR`: one JSON file per request, for debugging what happened to it.

Each file (named by the response id) holds the incoming body, the contract fields sent
to Triton for each choice (the tensors, as lists), each choice's final event (finish
reason, the guard that ended it, the guard that ended its thinking, token counts) and
the response body (for a stream: its SSE text). Off by default; written when the
response is complete, so a file is never half a request.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from backend import contract

log = logging.getLogger(__name__)


class RequestDump:
    def __init__(self, directory: Path, request_id: str, endpoint: str, body: dict[str, Any]):
        self.path = directory / f"{request_id}.json"
        self.record: dict[str, Any] = {
            "id": request_id,
            "endpoint": endpoint,
            "time": time.time(),
            "request": body,
            "tensors": [],
            "finals": {},
            "response": None,
        }

    def tensors(self, fields: dict[str, Any]) -> None:
        arrays = contract.encode_request(fields)
        self.record["tensors"].append({name: _jsonable(array) for name, array in arrays.items()})

    def final(self, index: int, outcome) -> None:
        self.record["finals"][str(index)] = {
            "finish_reason": outcome.finish_reason,
            "stop_guard": outcome.stop_guard,
            "thinking_guard": outcome.thinking_guard,
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "reasoning_tokens": outcome.reasoning_tokens,
            "cached_tokens": outcome.cached_tokens,
        }

    def response(self, body: Any) -> None:
        self.record["response"] = body
        try:
            self.path.write_text(json.dumps(self.record, ensure_ascii=False, indent=1, default=str))
        except OSError as exc:  # a full disk must not fail the request
            log.warning("could not write %s: %s", self.path, exc)


def _jsonable(array: np.ndarray) -> Any:
    if array.dtype == np.object_:
        return [item.decode(errors="replace") if isinstance(item, bytes) else item for item in array.tolist()]
    return array.tolist()
