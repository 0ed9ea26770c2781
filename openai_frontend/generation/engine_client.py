"""The frontend's door to the engine: one shared Triton gRPC aio client, one stream per request.

Requests go out as the contract's named tensors (`GenerationRequest`), responses come
back as the contract's `RequestOutput`s, and the model's errors as the contract's
`ErrorReport`. An `AdapterCommand` (list, load, unload or activate a LoRA adapter) is
answered with the `AdapterTable` after it, as a model-info query is with the model's
facts. Failures that mean "the model cannot serve now" (Triton unreachable or
restarting, a dead Python backend stub, the model not loaded, a drain) raise
ModelUnavailable: a 503 with Retry-After in OpenAI's shape, so clients retry.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.utils import InferenceServerException

from backend import contract
from backend.contract import (
    AdapterCommand,
    AdapterTable,
    ErrorKind,
    ErrorReport,
    GenerationRequest,
    ModelInfo,
    RequestOutput,
)
from openai_frontend.api.errors import OpenAIError, service_unavailable

# Triton's own words (not the model's reports) for a model that cannot serve now, e.g.
# "Stub process 'llm_0_0' is not healthy." (Triton 2.51 after the stub died), "Request
# for unknown model: 'llm' is not found" (not loaded).
_TRITON_UNAVAILABLE = re.compile(
    r"Stub process .* is not healthy|unknown model|is not ready|not available|is stopping", re.IGNORECASE
)
_REQUESTED_OUTPUTS = [grpcclient.InferRequestedOutput(spec.name) for spec in contract.OUTPUTS]


class EngineError(Exception):
    """The model refused the request (`field` set: the client's fault) or failed.
    `not_found`: what `field` names (an adapter) is not there."""

    def __init__(self, message: str, field: str | None = None, not_found: bool = False):
        super().__init__(message)
        self.message = message
        self.field = field
        self.not_found = not_found


class ModelUnavailable(EngineError, OpenAIError):
    """The model cannot serve now; retry later. Also the OpenAI error the client gets
    (503, Retry-After), so every path that reports an OpenAIError reports it as is."""

    def __init__(self, message: str):
        error = service_unavailable(message)
        OpenAIError.__init__(self, error.status, error.message, error.param, error.type, error.code, error.headers)
        self.field = None
        self.not_found = False


def engine_error(message: str) -> EngineError:
    """The exception for an error message from the model's stream."""
    report = ErrorReport.decode(message)
    if report is None:  # Triton's own error, not the model's
        if _TRITON_UNAVAILABLE.search(message):
            return ModelUnavailable(f"model {contract.MODEL_NAME!r} is unavailable: {message.strip()}")
        return EngineError(message.strip())
    if report.kind is ErrorKind.UNAVAILABLE:
        return ModelUnavailable(f"model {contract.MODEL_NAME!r} is unavailable: {report.message}")
    if report.kind is ErrorKind.NOT_FOUND:
        return EngineError(report.message, report.field, not_found=True)
    return EngineError(report.message, report.field if report.kind is ErrorKind.INVALID_REQUEST else None)


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

    async def model_info(self) -> ModelInfo:
        """The running model's facts (a model-info query)."""
        async with aclosing(self._responses(contract.model_info_query())) as results:
            async for result in results:
                return contract.decode_model_info(_arrays(result))
        raise EngineError("the model did not answer the model-info query")

    async def adapters(self, command: AdapterCommand) -> AdapterTable:
        """The adapter table after `command` (EngineError naming lora_name, lora_path or
        adapter_command when the model refuses it; not_found for a name not registered)."""
        async with aclosing(self._responses(contract.adapter_command(command))) as results:
            async for result in results:
                try:
                    return contract.decode_adapter_table(_arrays(result))
                except (ValueError, TypeError, KeyError) as exc:  # ContractError is a ValueError
                    raise EngineError(f"the model's adapter table is malformed: {exc}") from exc
        raise EngineError("the model did not answer the adapter command")

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Outputs until the final one. Closing the iterator early cancels the request.

        Use it under `contextlib.aclosing`: breaking out of `async for` does not cancel
        a gRPC stream; the `finally` of `_responses` does (also when the task is cancelled).
        """
        arrays = contract.encode_request(request)
        async with aclosing(self._responses(arrays)) as results:
            async for result in results:
                yield _output(result, request.prompt_tokens)

    async def _responses(self, arrays: dict[str, np.ndarray]) -> AsyncIterator:
        """The stream's results up to and including the final one."""
        call = self._client.stream_infer(_one(_infer_request(arrays)))
        finished = False
        try:
            async for result, error in call:
                if error is not None:
                    raise engine_error(error.message())
                finished = _is_final(result)
                yield result
                if finished:
                    return
            raise EngineError("the model's stream ended without a final response")
        except grpc.RpcError as exc:  # unreachable, or the stream broke (server restarted)
            raise ModelUnavailable(f"Triton is unavailable: {exc.details() or exc}") from exc
        finally:
            if not finished:
                call.cancel()


async def _one(request: dict):
    yield request


def _infer_request(arrays: dict[str, np.ndarray]) -> dict:
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


def _output(result, prompt_tokens: list[int]) -> RequestOutput:
    try:
        return contract.decode_output(_arrays(result), prompt_tokens, _is_final(result))
    except contract.ContractError as exc:
        raise EngineError(f"the model's response is malformed: {exc}") from exc


def _is_final(result) -> bool:
    params = result.get_response().parameters
    return "triton_final_response" in params and params["triton_final_response"].bool_param


def _arrays(result) -> dict[str, np.ndarray]:
    return {output.name: result.as_numpy(output.name) for output in result.get_response().outputs}
