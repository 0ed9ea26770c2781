"""The wire contract between the frontend and model `llm`: the single source of truth.

Every request field travels as a named input tensor; every event travels back as a
Triton response holding some of the named outputs. The frontend builds requests with
`encode_request`, model.py parses them with `decode_request`, and
`render_config_pbtxt()` generates model_repository/llm/config.pbtxt (a test checks
that the committed file equals it).

Imports nothing heavy (numpy only), so the frontend can use it.

Rules:
- `prompt_tokens` is the only required input. An absent input means the value that
  disables its feature (`default`).
- A field whose feature is not built yet (`implemented=False`) is rejected when it
  carries a non-default value, never silently ignored.
"""

from __future__ import annotations

import math
import signal
from dataclasses import dataclass
from typing import Any

import numpy as np

MODEL_NAME = "llm"
# Sent to the Python backend stub before stopping the server: the model aborts live
# requests, sends their finals and refuses new ones (Triton calls finalize() only once
# nothing is in flight, so finalize alone cannot end them).
DRAIN_SIGNAL = signal.SIGUSR1

# numpy dtype name -> Triton config data type
_TRITON_TYPES = {
    "int32": "TYPE_INT32",
    "int64": "TYPE_INT64",
    "float32": "TYPE_FP32",
    "bool": "TYPE_BOOL",
    "bytes": "TYPE_STRING",
}
# numpy dtype name -> tritonclient datatype string
_WIRE_TYPES = {"int32": "INT32", "int64": "INT64", "float32": "FP32", "bool": "BOOL", "bytes": "BYTES"}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor. `dims` are Triton dims: [1] for a scalar, [-1] for a list."""

    name: str
    dtype: str  # key of _TRITON_TYPES
    dims: tuple[int, ...]
    default: Any = None
    implemented: bool = True
    feature: str = ""  # what the field is for; named in the error when unimplemented
    optional: bool = True

    @property
    def is_list(self) -> bool:
        return self.dims == (-1,)

    @property
    def triton_type(self) -> str:
        return _TRITON_TYPES[self.dtype]

    @property
    def wire_type(self) -> str:
        return _WIRE_TYPES[self.dtype]

    @property
    def numpy_dtype(self):
        return np.object_ if self.dtype == "bytes" else np.dtype(self.dtype)


def _scalar(name, dtype, default=None, implemented=True, feature=""):
    return TensorSpec(name, dtype, (1,), default, implemented, feature)


def _list(name, dtype, implemented=True, feature=""):
    return TensorSpec(name, dtype, (-1,), (), implemented, feature)


_BEAMS = "translation with beam search"
_VISION = "vision inputs"

INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("prompt_tokens", "int32", (-1,), optional=False),
    # routing and cache scoping
    _scalar("session_hash", "bytes", b"", False, "prefix-aware routing"),
    _scalar("lookup_tenant", "bytes", b""),
    _scalar("adapter_slot", "int32", 0, False, "LoRA adapters"),
    # translation
    _scalar("src_lang_id", "int32", 0, False, _BEAMS),
    _scalar("tgt_lang_id", "int32", 0, False, _BEAMS),
    _scalar("num_beams", "int32", 1, False, _BEAMS),
    _scalar("length_penalty", "float32", 1.0, False, _BEAMS),
    _scalar("early_stopping", "bool", False, False, _BEAMS),
    # multimodal items: one encoded image / video per element
    _list("images", "bytes", False, _VISION),
    _list("videos", "bytes", False, _VISION),
    # length
    _scalar("max_tokens", "int32"),  # absent: up to the context length
    _scalar("min_tokens", "int32", 0),
    # samplers
    _scalar("temperature", "float32", 1.0),
    _scalar("top_k", "int32", 0),
    _scalar("top_p", "float32", 1.0),
    _scalar("top_n_sigma", "float32", 0.0),
    _scalar("min_p", "float32", 0.0),
    _scalar("repetition_penalty", "float32", 1.0),
    _scalar("presence_penalty", "float32", 0.0),
    _scalar("frequency_penalty", "float32", 0.0),
    _scalar("dry_multiplier", "float32", 0.0),
    _scalar("dry_base", "float32", 1.75),
    _scalar("dry_allowed_length", "int32", 2),
    _list("dry_sequence_breakers", "bytes"),  # strings; absent: llama.cpp's ("\\n", ":", "\"", "*")
    _scalar("lz_penalty", "float32", 0.0),
    _list("logit_bias_ids", "int32"),
    _list("logit_bias_values", "float32"),
    _scalar("seed", "int64"),  # absent: unseeded
    # stopping and guards
    _list("stop_tokens", "int32"),
    _scalar("ignore_eos", "bool", False),  # vLLM's extension: generate past EOS (benchmarks)
    _scalar("enable_thinking", "bool", False),  # force a thinking block the prompt did not open
    # absent: the model settings' default (MODEL.toml [reasoning] / [guards])
    _scalar("thinking_budget", "int32"),
    _scalar("loop_min_pattern_size", "int32"),
    _scalar("loop_max_pattern_size", "int32"),
    _scalar("loop_min_count", "int32"),  # 0: loop detectors off
    _scalar("deadline_ms", "int64"),  # from the request's arrival; 0: none
    # tools and structured output
    _scalar("require_tool_call", "bool", False),
    _scalar("tools_present", "bool", False),
    _scalar("suppress_tool_call", "bool", False),
    # json_object | json_schema | regex | ebnf | structural_tag (xgrammar's), and its text
    _scalar("grammar_kind", "bytes", b""),
    _scalar("grammar_spec", "bytes", b""),
    # speculative decoding: there is no draft yet, so disabling it is always honoured
    _scalar("disable_mtp", "bool", False),
    # logprobs
    _scalar("logprobs", "bool", False),  # return the sampled tokens' logprobs
    _scalar("top_logprobs", "int32", 0),  # and this many alternatives, 0..20 (implies logprobs)
    _scalar("prompt_logprobs", "int32", 0),  # N > 0: each prompt token's logprob and N alternatives
    _scalar("echo", "bool", False),  # return each prompt token's logprob (completions echo)
    # delivery
    _scalar("stream", "bool", False),
)

OUTPUTS: tuple[TensorSpec, ...] = (
    # token events: the tokens generated since the previous response (one or more)
    _list("token_ids", "int32"),
    _list("token_logprobs", "float32"),
    TensorSpec("top_logprob_ids", "int32", (-1, -1)),  # [num_tokens, k]
    TensorSpec("top_logprob_values", "float32", (-1, -1)),
    _list("prompt_logprobs", "float32"),  # once, with the first token; one per prompt token, the first NaN
    TensorSpec("prompt_top_logprob_ids", "int32", (-1, -1)),  # [num_prompt_tokens, k], the first row -1
    TensorSpec("prompt_top_logprob_values", "float32", (-1, -1)),  # the first row NaN
    # the final event
    _scalar("finish_reason", "bytes"),
    _scalar("stop_guard", "bytes"),  # which guard ended the sequence ("" if none)
    _scalar("thinking_guard", "bytes"),  # which guard ended thinking (thinking_budget, thinking_loop; "" if none)
    _scalar("prompt_token_count", "int32"),
    _scalar("completion_token_count", "int32"),
    _scalar("cached_prompt_tokens", "int32"),
    _scalar("reasoning_tokens", "int32"),
    _scalar("accepted_spec_tokens", "int32"),
    _scalar("time_to_first_token_ms", "float32"),
    _scalar("decode_time_ms", "float32"),
    _scalar("queue_time_ms", "float32"),  # arrival in the engine -> first scheduled
)

INPUTS_BY_NAME = {s.name: s for s in INPUTS}
OUTPUTS_BY_NAME = {s.name: s for s in OUTPUTS}

# finish_reason values on the wire (OpenAI's, plus "abort" for a cancelled request)
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


class ContractError(ValueError):
    """A request that breaks the contract. `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# ---------------------------------------------------------------------------
# config.pbtxt


def _pbtxt_tensor(spec: TensorSpec, is_input: bool) -> str:
    lines = [
        "  {",
        f'    name: "{spec.name}"',
        f"    data_type: {spec.triton_type}",
        f"    dims: [ {', '.join(str(d) for d in spec.dims)} ]",
    ]
    if is_input and spec.optional:
        lines.append("    optional: true")
    lines.append("  }")
    return "\n".join(lines)


def render_config_pbtxt() -> str:
    """The text of model_repository/llm/config.pbtxt, generated from the contract."""
    inputs = ",\n".join(_pbtxt_tensor(s, True) for s in INPUTS)
    outputs = ",\n".join(_pbtxt_tensor(s, False) for s in OUTPUTS)
    return (
        "# Generated from backend/contract.py by `python -m backend.contract`; do not edit.\n"
        f'name: "{MODEL_NAME}"\n'
        'backend: "python"\n'
        "max_batch_size: 0\n"
        "model_transaction_policy {\n  decoupled: true\n}\n"
        f"input [\n{inputs}\n]\n"
        f"output [\n{outputs}\n]\n"
        "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]\n"
    )


# ---------------------------------------------------------------------------
# request encoding (frontend side) and decoding (model side)


def _to_array(spec: TensorSpec, value) -> np.ndarray:
    if spec.dtype == "bytes":
        items = list(value) if spec.is_list else [value]
        return np.array([v.encode() if isinstance(v, str) else bytes(v) for v in items], dtype=np.object_)
    items = list(value) if spec.is_list else [value]
    return np.asarray(items, dtype=spec.numpy_dtype).reshape(-1)


def encode_request(fields: dict[str, Any]) -> dict[str, np.ndarray]:
    """Field values -> named numpy arrays. Fields that are None are left out."""
    out = {}
    for name, value in fields.items():
        if value is None:
            continue
        spec = INPUTS_BY_NAME.get(name)
        if spec is None:
            raise ContractError(name, "is not an input of the contract")
        out[name] = _to_array(spec, value)
    if "prompt_tokens" not in out:
        raise ContractError("prompt_tokens", "is required")
    return out


def _from_array(spec: TensorSpec, array: np.ndarray):
    flat = np.asarray(array).reshape(-1)
    if spec.dtype == "bytes":
        items = [bytes(v) if not isinstance(v, str) else v.encode() for v in flat]
        return tuple(items) if spec.is_list else (items[0] if items else b"")
    if spec.is_list:
        return tuple(flat.tolist())
    if flat.size != 1:
        raise ContractError(spec.name, f"must hold exactly one value, got {flat.size}")
    value = flat[0].item()
    if spec.dtype == "float32" and not math.isfinite(value):
        raise ContractError(spec.name, f"must be a finite number, got {value}")
    return value


def decode_request(arrays: dict[str, np.ndarray | None]) -> dict[str, Any]:
    """Named arrays (None where absent) -> every input's value, defaults filled in.

    Rejects a missing `prompt_tokens`, unknown names, and non-default values of
    fields whose feature is not built yet.
    """
    unknown = set(arrays) - set(INPUTS_BY_NAME)
    if unknown:
        name = sorted(unknown)[0]
        raise ContractError(name, "is not an input of the contract")
    values: dict[str, Any] = {}
    for spec in INPUTS:
        array = arrays.get(spec.name)
        if array is None:
            if not spec.optional:
                raise ContractError(spec.name, "is required")
            values[spec.name] = spec.default
            continue
        value = _from_array(spec, array)
        if not spec.implemented and value != spec.default:
            raise ContractError(
                spec.name,
                f"{spec.feature} is not supported by this server yet; leave it out or set it to {spec.default!r}",
            )
        values[spec.name] = value
    return values


def main() -> None:
    import sys

    sys.stdout.write(render_config_pbtxt())


if __name__ == "__main__":
    main()
