"""Requests to named arrays and back (frontend -> model), and outputs the same way (model -> frontend).

`encode_request` leaves out every field at its default (an absent input means the
default); `decode_request` fills the defaults in and validates, so model.py gets a
request the engine can trust. `encode_output` / `decode_output` carry a
`RequestOutput` in one response (backend.contract.output_wire); `apply_inputs` sets fields by their contract names
(the frontend forwards extension fields sent under those names).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from backend.contract.adapters import AdapterCommand, AdapterTable
from backend.contract.errors import ContractError
from backend.contract.model_info import ModelInfo
from backend.contract.output_wire import Arrays, output_array
from backend.contract.request import GenerationRequest, GuardParams, SamplingParams
from backend.contract.tensors import (
    ADAPTER_COMMAND,
    INPUTS_BY_NAME,
    MODEL_INFO_QUERY,
    REQUEST_INPUTS,
    TensorSpec,
)
from backend.contract.vision import decode_vision, encode_vision

_PARTS = {"": GenerationRequest, "sampling": SamplingParams, "guards": GuardParams}
_FIELD_INPUTS = tuple(spec for spec in REQUEST_INPUTS if spec.part != "vision")  # one tensor per field
_DEFAULTS = {
    spec.name: getattr(GenerationRequest([]) if not spec.part else _PARTS[spec.part](), spec.name)
    for spec in _FIELD_INPUTS
}


def _holder(request: GenerationRequest, spec: TensorSpec):
    return getattr(request, spec.part) if spec.part else request


# -- requests ----------------------------------------------------------------------


def encode_request(request: GenerationRequest) -> dict[str, np.ndarray]:
    """The request's named arrays; fields at their default are left out."""
    out = encode_vision(request.vision)
    for spec in _FIELD_INPUTS:
        value = getattr(_holder(request, spec), spec.name)
        if spec.name != "prompt_tokens" and value == _DEFAULTS[spec.name]:
            continue
        try:
            out[spec.name] = _to_array(spec, value)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ContractError(spec.name, f"cannot be sent as {spec.dtype}: {exc}") from None
    return out


def decode_request(arrays: Arrays, vocab_size: int | None = None, max_model_len: int | None = None):
    """Named arrays (None where absent) -> a validated GenerationRequest.

    Refuses a missing prompt_tokens, unknown names, and bad values (validate())."""
    unknown = sorted(set(arrays) - {s.name for s in REQUEST_INPUTS})
    if unknown:
        raise ContractError(unknown[0], "is not an input of a generation request")
    if arrays.get("prompt_tokens") is None:
        raise ContractError("prompt_tokens", "is required")
    values: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
    values[""]["vision"] = decode_vision(arrays)
    for spec in _FIELD_INPUTS:
        array = arrays.get(spec.name)
        if array is not None:
            values[spec.part][spec.name] = _from_array(spec, array)
    values[""]["prompt_tokens"] = list(values[""]["prompt_tokens"])
    request = GenerationRequest(
        **values[""], sampling=SamplingParams(**values["sampling"]), guards=GuardParams(**values["guards"])
    )
    request.validate(vocab_size, max_model_len)
    return request


def apply_inputs(request: GenerationRequest, values: Mapping[str, Any]) -> None:
    """Set request fields by their contract names from JSON-like values (None: leave
    the field as it is); ContractError naming a name that is not a field, or a value
    of the wrong type."""
    for name, value in values.items():
        spec = INPUTS_BY_NAME.get(name)
        if spec is None or spec in (MODEL_INFO_QUERY, ADAPTER_COMMAND) or spec.part == "vision":
            raise ContractError(name, "is not a field of a generation request")
        if value is not None:
            setattr(_holder(request, spec), name, _coerce(spec, value))


def _coerce(spec: TensorSpec, value: Any) -> Any:
    if spec.is_list:
        if not isinstance(value, list | tuple):
            raise ContractError(spec.name, f"must be a list, got {value!r}")
        return tuple(_coerce_item(spec, item) for item in value)
    return _coerce_item(spec, value)


def _coerce_item(spec: TensorSpec, value: Any) -> Any:
    kind = spec.dtype
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind in ("int32", "int64") and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind in ("float32", "float64") and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind == "bytes" and isinstance(value, str):
        return value
    expected = {"bool": "a boolean", "bytes": "a string"}.get(kind, "a number" if "float" in kind else "an integer")
    raise ContractError(spec.name, f"must be {expected}, got {value!r}")


def _to_array(spec: TensorSpec, value: Any) -> np.ndarray:
    items = list(value) if spec.is_list else [value]
    if spec.dtype == "bytes":
        return np.array([v.encode() if isinstance(v, str) else bytes(v) for v in items], dtype=np.object_)
    return np.asarray(items, dtype=spec.numpy_dtype).reshape(-1)


def _from_array(spec: TensorSpec, array: np.ndarray) -> Any:
    flat = np.asarray(array).reshape(-1)
    if spec.dtype == "bytes":
        items = tuple(_bytes_value(spec, v) for v in flat)
        return items if spec.is_list else (items[0] if items else "")
    if spec.is_list:
        return tuple(flat.tolist())
    if flat.size != 1:
        raise ContractError(spec.name, f"must hold exactly one value, got {flat.size}")
    value = flat[0].item()
    if isinstance(value, float) and not math.isfinite(value):
        raise ContractError(spec.name, f"must be a finite number, got {value}")
    return value


def _bytes_value(spec: TensorSpec, item: Any) -> str:
    data = item.encode() if isinstance(item, str) else bytes(item)
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ContractError(spec.name, f"must be UTF-8 text: {exc}") from None


# -- the model-info query -------------------------------------------------------------


def model_info_query() -> dict[str, np.ndarray]:
    return {MODEL_INFO_QUERY.name: np.array([True])}


def is_model_info_query(arrays: Arrays) -> bool:
    """Whether `arrays` are a model-info query; ContractError if they mix one with a request."""
    if arrays.get(MODEL_INFO_QUERY.name) is None:
        return False
    if any(name != MODEL_INFO_QUERY.name and array is not None for name, array in arrays.items()):
        raise ContractError(MODEL_INFO_QUERY.name, "a model-info query takes no other input")
    return True


def encode_model_info(info: ModelInfo) -> dict[str, np.ndarray]:
    return {"model_info": output_array("model_info", [info.encode().encode()])}


def decode_model_info(arrays: Arrays) -> ModelInfo:
    array = arrays.get("model_info")
    if array is None:
        raise ContractError("model_info", "the answer to a model-info query carries no model_info")
    return ModelInfo.decode(bytes(array.reshape(-1)[0]).decode())


# -- adapter commands ------------------------------------------------------------------


def adapter_command(command: AdapterCommand) -> dict[str, np.ndarray]:
    return {ADAPTER_COMMAND.name: np.array([command.encode().encode()], dtype=np.object_)}


def decode_adapter_command(arrays: Arrays) -> AdapterCommand | None:
    """The adapter command in `arrays` (None: they are not one); ContractError if they
    mix one with other inputs, or it is malformed."""
    array = arrays.get(ADAPTER_COMMAND.name)
    if array is None:
        return None
    if any(name != ADAPTER_COMMAND.name and value is not None for name, value in arrays.items()):
        raise ContractError(ADAPTER_COMMAND.name, "an adapter command takes no other input")
    return AdapterCommand.decode(bytes(array.reshape(-1)[0]).decode())


def encode_adapter_table(table: AdapterTable) -> dict[str, np.ndarray]:
    return {"adapters": output_array("adapters", [table.encode().encode()])}


def decode_adapter_table(arrays: Arrays) -> AdapterTable:
    array = arrays.get("adapters")
    if array is None:
        raise ContractError("adapters", "the answer to an adapter command carries no adapters")
    return AdapterTable.decode(bytes(array.reshape(-1)[0]).decode())
