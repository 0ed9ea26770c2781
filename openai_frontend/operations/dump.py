"""`--dump DIR`: one JSON file per request, for debugging what happened to it.

Each file (named by the response id) holds the incoming body, the request sent to
Triton for each choice (its tensors, as lists; images' pixels as their shape and content
hashes), each choice's final event (every field
of the contract's FinalEvent) and the response body (for a stream: its SSE text). Off by default; written when the
response is complete, so a file is never half a request.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from backend import contract
from backend.contract import FinalEvent, GenerationRequest

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

    def tensors(self, request: GenerationRequest) -> None:
        """The request's tensors; the pixels (megabytes) as their shape and each item's hash."""
        arrays = contract.encode_request(request)
        record = {name: _jsonable(array) for name, array in arrays.items() if name != "vision_pixels"}
        if "vision_pixels" in arrays:
            hashes = [item.content_hash for item in request.vision]
            record["vision_pixels"] = {"shape": list(arrays["vision_pixels"].shape), "content_hashes": hashes}
        self.record["tensors"].append(record)

    def final(self, index: int, final: FinalEvent) -> None:
        record = {name: value.value if isinstance(value, Enum) else value for name, value in asdict(final).items()}
        self.record["finals"][str(index)] = record

    async def recorded(self, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """A stream's SSE events as they go, and into the record (its response) once it is over."""
        sent = []
        try:
            async for event in events:
                sent.append(event)
                yield event
        finally:
            self.response("".join(sent))

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
