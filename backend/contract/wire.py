"""Requests to named arrays and back (frontend -> model), and outputs the same way (model -> frontend).

`encode_request` leaves out every field at its default (an absent input means the
default); `decode_request` fills the defaults in and validates, so model.py gets a
request the engine can trust. `encode_output` / `decode_output` carry a
`RequestOutput` in one response; `apply_inputs` sets fields by their contract names
(the frontend forwards extension fields sent under those names).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import numpy as np

from backend.contract.adapters import AdapterCommand, AdapterTable
from backend.contract.errors import ContractError
from backend.contract.events import FinalEvent, FinishGuard, FinishReason, Logprob, RequestOutput
from backend.contract.model_info import ModelInfo
from backend.contract.request import GenerationRequest, GuardParams, SamplingParams
from backend.contract.tensors import (
    ADAPTER_COMMAND,
    INPUTS_BY_NAME,
    MODEL_INFO_QUERY,
    OUTPUTS_BY_NAME,
    REQUEST_INPUTS,
    TensorSpec,
)

Arrays = Mapping[str, np.ndarray | None]
_PARTS = {"": GenerationRequest, "sampling": SamplingParams, "guards": GuardParams}
_DEFAULTS = {
    spec.name: getattr(GenerationRequest([]) if not spec.part else _PARTS[spec.part](), spec.name)
    for spec in REQUEST_INPUTS
}


def _holder(request: GenerationRequest, spec: TensorSpec):
    return getattr(request, spec.part) if spec.part else request


# -- requests ----------------------------------------------------------------------


def encode_request(request: GenerationRequest) -> dict[str, np.ndarray]:
    """The request's named arrays; fields at their default are left out."""
    out = {}
    for spec in REQUEST_INPUTS:
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
    for spec in REQUEST_INPUTS:
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
        if spec is None or spec in (MODEL_INFO_QUERY, ADAPTER_COMMAND):
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
        return value.encode() if spec.raw else value
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


def _bytes_value(spec: TensorSpec, item: Any) -> bytes | str:
    data = item.encode() if isinstance(item, str) else bytes(item)
    if spec.raw:
        return data
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise ContractError(spec.name, f"must be UTF-8 text: {exc}") from None


# -- outputs -----------------------------------------------------------------------


def _output(name: str, values: Any) -> np.ndarray:
    return np.array(values, dtype=OUTPUTS_BY_NAME[name].numpy_dtype)


def encode_output(out: RequestOutput) -> dict[str, np.ndarray]:
    """One response's arrays: the tokens, their logprobs when asked, and on the first
    and last output what rides there."""
    arrays = {"token_ids": _output("token_ids", out.token_ids)}
    if out.logprobs is not None:
        arrays.update(_logprob_arrays("token_logprobs", "top_logprob", out.logprobs))
    if out.prompt_logprobs is not None:
        arrays.update(_logprob_arrays("prompt_logprobs", "prompt_top_logprob", out.prompt_logprobs))
    if out.starts_in_thinking is not None:
        arrays["starts_in_thinking"] = _output("starts_in_thinking", [out.starts_in_thinking])
    if out.final is not None:
        arrays.update(_final_arrays(out.final))
    return arrays


def _logprob_arrays(values_name: str, top_prefix: str, entries: list[Logprob]) -> dict[str, np.ndarray]:
    """[n] logprobs (None as NaN) and, when any entry has alternatives, [n, k] ids and
    values (a shorter row padded with -1 / NaN)."""
    arrays = {values_name: _output(values_name, [math.nan if e.logprob is None else e.logprob for e in entries])}
    k = max((len(e.top) for e in entries), default=0)
    if k:
        pad = [(-1, math.nan)] * k
        rows = [(e.top + pad)[:k] for e in entries]
        arrays[f"{top_prefix}_ids"] = _output(f"{top_prefix}_ids", [[t for t, _ in row] for row in rows])
        arrays[f"{top_prefix}_values"] = _output(f"{top_prefix}_values", [[v for _, v in row] for row in rows])
    return arrays


def _final_arrays(final: FinalEvent) -> dict[str, np.ndarray]:
    arrays = {}
    for f in fields(FinalEvent):
        value = getattr(final, f.name)
        if value is None:
            continue
        if isinstance(value, FinishReason | FinishGuard):
            value = value.value.encode()
        arrays[f.name] = _output(f.name, [value])
    return arrays


def decode_output(arrays: Arrays, prompt_tokens: list[int], final: bool) -> RequestOutput:
    """A response's arrays -> RequestOutput; `final`: the response carries Triton's final flag."""
    tokens = arrays.get("token_ids")
    token_ids = tokens.reshape(-1).tolist() if tokens is not None else []
    starts = arrays.get("starts_in_thinking")
    return RequestOutput(
        request_id="",
        token_ids=token_ids,
        logprobs=_logprob_entries(arrays, token_ids, "token_logprobs", "top_logprob"),
        prompt_logprobs=_logprob_entries(arrays, prompt_tokens, "prompt_logprobs", "prompt_top_logprob"),
        starts_in_thinking=bool(starts.reshape(-1)[0]) if starts is not None else None,
        final=_final_event(arrays) if final else None,
    )


def _logprob_entries(arrays: Arrays, token_ids: list[int], values_name: str, top_prefix: str):
    values = arrays.get(values_name)
    if values is None:
        return None
    ids, tops = arrays.get(f"{top_prefix}_ids"), arrays.get(f"{top_prefix}_values")
    entries = []
    for i, value in enumerate(values.reshape(-1).tolist()):
        top = []
        if ids is not None:
            top = [(t, v) for t, v in zip(ids[i].tolist(), tops[i].tolist(), strict=True) if t >= 0]
        token = token_ids[i] if i < len(token_ids) else -1
        entries.append(Logprob(token, None if math.isnan(value) else value, top))
    return entries


def _final_event(arrays: Arrays) -> FinalEvent:
    values = {}
    for f in fields(FinalEvent):
        array = arrays.get(f.name)
        if array is None or not array.size:
            continue
        value = array.reshape(-1)[0]
        values[f.name] = value.decode() if isinstance(value, bytes) else value.item()
    if "finish_reason" not in values or "finish_guard" not in values:
        raise ContractError("finish_reason", "the final response carries no finish_reason / finish_guard")
    values["finish_reason"] = FinishReason(values["finish_reason"])
    for name in ("finish_guard", "thinking_guard"):
        if name in values:
            values[name] = FinishGuard(values[name])
    return FinalEvent(**values)


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
    return {"model_info": _output("model_info", [info.encode().encode()])}


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
    return {"adapters": _output("adapters", [table.encode().encode()])}


def decode_adapter_table(arrays: Arrays) -> AdapterTable:
    array = arrays.get("adapters")
    if array is None:
        raise ContractError("adapters", "the answer to an adapter command carries no adapters")
    return AdapterTable.decode(bytes(array.reshape(-1)[0]).decode())
