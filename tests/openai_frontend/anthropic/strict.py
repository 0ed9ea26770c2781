"""Anthropic's own SDK types as the judge of a response: strict validation, no extra field
anywhere (the SDK's models allow extras, so each model's `model_extra` is checked)."""

from __future__ import annotations

from typing import Any

import anthropic.types as at
import pydantic

STREAM_EVENT = pydantic.TypeAdapter(at.RawMessageStreamEvent)


def strict(model: Any, payload: Any) -> Any:
    """The payload as the SDK type `model` (a class or a TypeAdapter), strictly; an
    AssertionError naming any field the SDK's types do not have."""
    parsed = model.validate_python(payload, strict=True) if isinstance(model, pydantic.TypeAdapter) else None
    if parsed is None:
        parsed = model.model_validate(payload, strict=True)
    no_extras(parsed)
    return parsed


def no_extras(value: Any, path: str = "$") -> None:
    if isinstance(value, pydantic.BaseModel):
        assert not value.model_extra, f"{path}: fields the SDK does not know: {sorted(value.model_extra)}"
        for name in type(value).model_fields:
            no_extras(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            no_extras(item, f"{path}[{index}]")


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
