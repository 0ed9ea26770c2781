"""An SDK's own pydantic types as the judge of a response: strict validation, and no field
the types lack anywhere (SDK models allow extras, so each model's `model_extra` is checked)."""

from __future__ import annotations

from typing import Any

import pydantic


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
