"""Anthropic's own SDK types as the judge of a response: strict validation, no extra field
anywhere (the SDK's models allow extras, so each model's `model_extra` is checked)."""

from __future__ import annotations

import anthropic.types as at
import pydantic

from tests.helpers.strict_types import no_extras, strict  # noqa: F401 (re-exported for the Anthropic tests)

STREAM_EVENT = pydantic.TypeAdapter(at.RawMessageStreamEvent)


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each event of an SSE body; the data's type is the event's name."""
    import json

    events = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events
