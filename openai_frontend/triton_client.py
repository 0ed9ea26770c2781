"""The frontend's door to Triton: one shared gRPC aio client, one stream per request.

Failures that mean "the model cannot serve now" (Triton unreachable or restarting, a
dead Python backend stub, the model not loaded, a drain) raise ModelUnavailable: a 503
with Retry-After in OpenAI's shape, so clients retry instead of giving up.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from backend import contract
from openai_frontend.errors import OpenAIError, service_unavailable

# An error raised from contract.ContractError on the model side reads "field: why".
_FIELD_ERROR = re.compile(r"^\s*(\w+): ")
# Triton's (and model.py's) words for a model that cannot serve now, e.g. "Stub process
# 'llm_0_0' is not healthy." (Triton 2.51 after the stub died), "Request for unknown
# model: 'llm' is not found" (not loaded), "the server is shutting down" (a drain).
_UNAVAILABLE_ERROR = re.compile(
    r"Stub process .* is not healthy|unknown model|is not ready|not available|shutting down|is stopping",
    re.IGNORECASE,
)
_FINAL_OUTPUTS = (
    "finish_reason",
    "stop_guard",
    "thinking_guard",
    "prompt_token_count",
    "completion_token_count",
    "cached_prompt_tokens",
    "reasoning_tokens",
    "time_to_first_token_ms",
    "decode_time_ms",
    "queue_time_ms",
)
_LOGPROB_OUTPUTS = (
    "token_logprobs",
    "top_logprob_ids",
    "top_logprob_values",
    "prompt_logprobs",
    "prompt_top_logprob_ids",
    "prompt_top_logprob_values",
)
_REQUESTED_OUTPUTS = [
    grpcclient.InferRequestedOutput(name) for name in ("token_ids", *_LOGPROB_OUTPUTS, *_FINAL_OUTPUTS)
]


class EngineError(Exception):
    """The model refused the request (`field` set: the client's fault) or failed."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class ModelUnavailable(EngineError, OpenAIError):
    """The model cannot serve now; retry later. Also the OpenAI error the client gets
    (503, Retry-After), so every path that reports an OpenAIError reports it as is."""

    def __init__(self, message: str):
        error = service_unavailable(message)
        OpenAIError.__init__(self, error.status, error.message, error.param, error.type, error.code, error.headers)
        self.field = None


@dataclass(slots=True)
class Finish:
    """The final event of a request, as the model reports it."""

    reason: str
    stop_guard: str = ""  # the guard that ended the sequence (eos, max_tokens, content_loop, deadline, ...)
    thinking_guard: str = ""  # the guard that ended its thinking (thinking_budget, thinking_loop), if one did
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0
    time_to_first_token_ms: float = 0.0
    decode_time_ms: float = 0.0
    queue_time_ms: float | None = None  # None: the model did not report it


@dataclass(slots=True)
class TokenLogprob:
    """A token's logprob and its most likely alternatives (id, logprob), descending."""

    token_id: int
    logprob: float | None  # None: the first prompt token, which nothing predicts
    top: list[tuple[int, float]]
    offset: int | None = None  # where the token's text begins in its text (set by the frontend)


@dataclass(slots=True)
class TokenPack:
    """One response: the tokens generated since the previous one; `finish` on the last."""

    token_ids: list[int]
    finish: Finish | None = None
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when asked for
    # once, with the first token: one entry per prompt token (the first has logprob None)
    prompt_logprobs: list[TokenLogprob] | None = None


class TritonLLM:
    """Streams requests to model `llm`. Make one per process, in the app's lifespan."""

    def __init__(self, url: str):
        self._client = grpcclient_aio.InferenceServerClient(url)

    async def close(self) -> None:
        await self._client.close()

    async def is_ready(self, timeout_s: float = 2.0) -> bool:
        try:
            return bool(await self._client.is_model_ready(contract.MODEL_NAME, client_timeout=timeout_s))
        except (InferenceServerException, grpc.RpcError):
            return False

    async def generate(self, fields: dict[str, Any]) -> AsyncIterator[TokenPack]:
        """Token packs until the final one. Closing the iterator early cancels the request.

        Use it under `contextlib.aclosing`: breaking out of `async for` does not cancel
        a gRPC stream, so the `finally` here does (also when the task is cancelled).
        """
        request = _infer_request(fields)

        async def one_request():
            yield request

        call = self._client.stream_infer(one_request())
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    raise engine_error(error.message())
                pack = _token_pack(result, fields["prompt_tokens"])
                finished = pack.finish is not None
                yield pack
                if finished:
                    return
            raise EngineError("the model's stream ended without a final response")
        except grpc.RpcError as exc:  # unreachable, or the stream broke (server restarted)
            raise ModelUnavailable(f"Triton is unavailable: {exc.details() or exc}") from exc
        finally:
            if not finished:
                call.cancel()


def engine_error(message: str) -> EngineError:
    """A model error; one that names a contract input is the request's fault."""
    if _UNAVAILABLE_ERROR.search(message):
        return ModelUnavailable(f"model {contract.MODEL_NAME!r} is unavailable: {message.strip()}")
    match = _FIELD_ERROR.match(message)
    field = match.group(1) if match and match.group(1) in contract.INPUTS_BY_NAME else None
    return EngineError(message.strip(), field)


def _infer_request(fields: dict[str, Any]) -> dict[str, Any]:
    try:
        arrays = contract.encode_request(fields)
    except contract.ContractError as exc:
        raise EngineError(str(exc), exc.field) from exc
    except (TypeError, ValueError, OverflowError) as exc:
        raise EngineError(f"invalid value: {exc}", _bad_field(fields)) from exc
    inputs = []
    for name, array in arrays.items():
        tensor = grpcclient.InferInput(name, list(array.shape), contract.INPUTS_BY_NAME[name].wire_type)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return {
        "model_name": contract.MODEL_NAME,
        "inputs": inputs,
        "outputs": _REQUESTED_OUTPUTS,
        "request_id": uuid.uuid4().hex,
    }


def _bad_field(fields: dict[str, Any]) -> str | None:
    """The first field that does not convert to its tensor."""
    for name, value in fields.items():
        if value is None:
            continue
        try:
            contract.encode_request({"prompt_tokens": [0], name: value})
        except (TypeError, ValueError, OverflowError):
            return name
    return None


def _token_pack(result, prompt_ids: list[int]) -> TokenPack:
    tokens = result.as_numpy("token_ids")
    token_ids = tokens.tolist() if tokens is not None else []
    params = result.get_response().parameters
    final = "triton_final_response" in params and params["triton_final_response"].bool_param
    logprobs = _entries(result, token_ids, "token_logprobs", "top_logprob_ids", "top_logprob_values")
    return TokenPack(token_ids, _finish(result) if final else None, logprobs, _prompt_entries(result, prompt_ids))


def _entries(result, token_ids: list[int], values_name: str, ids_name: str, tops_name: str):
    """Logprob entries of `token_ids` from a response's outputs; None when absent. The
    token ids of prompt entries are filled in by the caller (-1 here when unknown)."""
    values = result.as_numpy(values_name)
    if values is None:
        return None
    ids = result.as_numpy(ids_name)
    tops = result.as_numpy(tops_name)
    entries = []
    for i, value in enumerate(values.reshape(-1).tolist()):
        top = []
        if ids is not None:
            top = [(t, v) for t, v in zip(ids[i].tolist(), tops[i].tolist(), strict=True) if t >= 0]
        token = token_ids[i] if i < len(token_ids) else -1
        entries.append(TokenLogprob(token, None if math.isnan(value) else value, top))
    return entries


def _prompt_entries(result, prompt_ids: list[int]) -> list[TokenLogprob] | None:
    return _entries(result, prompt_ids, "prompt_logprobs", "prompt_top_logprob_ids", "prompt_top_logprob_values")


def _finish(result) -> Finish:
    values = {}
    for name in _FINAL_OUTPUTS:
        array = result.as_numpy(name)
        if array is not None and array.size:
            value = array.reshape(-1)[0]
            values[name] = value.decode() if isinstance(value, bytes) else value.item()
    if "finish_reason" not in values:
        raise EngineError("the model's final response carries no finish_reason")
    return Finish(
        reason=values["finish_reason"],
        stop_guard=values.get("stop_guard", ""),
        thinking_guard=values.get("thinking_guard", ""),
        prompt_tokens=int(values.get("prompt_token_count", 0)),
        completion_tokens=int(values.get("completion_token_count", 0)),
        cached_tokens=int(values.get("cached_prompt_tokens", 0)),
        reasoning_tokens=int(values.get("reasoning_tokens", 0)),
        time_to_first_token_ms=float(values.get("time_to_first_token_ms", 0.0)),
        decode_time_ms=float(values.get("decode_time_ms", 0.0)),
        queue_time_ms=float(values["queue_time_ms"]) if "queue_time_ms" in values else None,
    )
