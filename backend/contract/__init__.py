"""The contract between the frontend and model `llm`: the single source of truth, pure data.

- `request`: `GenerationRequest` (with its `SamplingParams` and `GuardParams`), the one
  typed request at every layer, and its validation.
- `events`: `RequestOutput`, `FinalEvent`, `Logprob`, `FinishReason`, `FinishGuard`:
  what the engine sends back, read as is by the frontend.
- `model_info`: `ModelInfo`, the running model's facts the frontend asks for.
- `adapters`: `AdapterCommand` and `AdapterTable`, managing LoRA adapters; what `adapter_slot` means.
- `errors`: `ContractError` and `ErrorReport`, errors as data on the wire.
- `tensors`: the named tensors and config.pbtxt; `wire`: encoding and decoding.

Imports numpy only (no torch), so both processes import it.
"""

import signal

from backend.contract.adapters import (
    BASE_SLOT,
    FOLLOW_ACTIVE,
    AdapterCommand,
    AdapterInfo,
    AdapterNotFound,
    AdapterTable,
)
from backend.contract.errors import ContractError, EngineUnavailable, ErrorKind, ErrorReport
from backend.contract.events import FinalEvent, FinishGuard, FinishReason, Hypothesis, Logprob, RequestOutput
from backend.contract.model_info import ModelInfo
from backend.contract.output_wire import decode_output, encode_output
from backend.contract.request import (
    DEFAULT_DRY_BREAKERS,
    EARLY_STOPPING,
    GenerationRequest,
    GuardParams,
    SamplingParams,
)
from backend.contract.tensors import INPUTS, INPUTS_BY_NAME, MODEL_NAME, OUTPUTS, render_config_pbtxt
from backend.contract.wire import (
    adapter_command,
    apply_inputs,
    decode_adapter_command,
    decode_adapter_table,
    decode_model_info,
    decode_request,
    encode_adapter_table,
    encode_model_info,
    encode_request,
    is_model_info_query,
    model_info_query,
)

# Sent to the Python backend stub before stopping the server: the model aborts live
# requests, sends their finals and refuses new ones (Triton calls finalize() only once
# nothing is in flight, so finalize alone cannot end them).
DRAIN_SIGNAL = signal.SIGUSR1

__all__ = [
    "BASE_SLOT",
    "FOLLOW_ACTIVE",
    "AdapterCommand",
    "AdapterInfo",
    "AdapterNotFound",
    "AdapterTable",
    "adapter_command",
    "decode_adapter_command",
    "decode_adapter_table",
    "encode_adapter_table",
    "DEFAULT_DRY_BREAKERS",
    "DRAIN_SIGNAL",
    "EARLY_STOPPING",
    "INPUTS",
    "INPUTS_BY_NAME",
    "MODEL_NAME",
    "OUTPUTS",
    "ContractError",
    "EngineUnavailable",
    "ErrorKind",
    "ErrorReport",
    "FinalEvent",
    "FinishGuard",
    "FinishReason",
    "GenerationRequest",
    "GuardParams",
    "Hypothesis",
    "Logprob",
    "ModelInfo",
    "RequestOutput",
    "SamplingParams",
    "apply_inputs",
    "decode_model_info",
    "decode_output",
    "decode_request",
    "encode_model_info",
    "encode_output",
    "encode_request",
    "is_model_info_query",
    "model_info_query",
    "render_config_pbtxt",
]
