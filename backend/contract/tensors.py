"""The named tensors of model `llm`: one input per request field, one output per event field.

An input is named after its field of `GenerationRequest` (or of its `sampling` /
`guards` part), and an output after its field of `RequestOutput` / `FinalEvent`, so a
name means one thing at every layer. `render_config_pbtxt()` generates
model_repository/llm/config.pbtxt (`python -m backend.contract`; a test checks that the
committed file equals it).

Imports nothing heavy (numpy only), so the frontend can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODEL_NAME = "llm"

# numpy dtype name -> (Triton config data type, tritonclient datatype)
_TYPES = {
    "int32": ("TYPE_INT32", "INT32"),
    "int64": ("TYPE_INT64", "INT64"),
    "float32": ("TYPE_FP32", "FP32"),
    "float64": ("TYPE_FP64", "FP64"),
    "bool": ("TYPE_BOOL", "BOOL"),
    "bytes": ("TYPE_STRING", "BYTES"),
}
SCALAR, LIST, MATRIX = (1,), (-1,), (-1, -1)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One named tensor. `dims` are Triton's: [1] a scalar, [-1] a list, [-1, -1] a matrix.

    `part`: where an input's field lives in GenerationRequest ("" the request itself,
    "sampling" or "guards"; "vision": one of the four tensors of the `vision` field).
    """

    name: str
    dtype: str
    dims: tuple[int, ...] = SCALAR
    part: str = ""

    @property
    def is_list(self) -> bool:
        return self.dims == LIST

    @property
    def triton_type(self) -> str:
        return _TYPES[self.dtype][0]

    @property
    def wire_type(self) -> str:
        return _TYPES[self.dtype][1]

    @property
    def numpy_dtype(self):
        return np.object_ if self.dtype == "bytes" else np.dtype(self.dtype)


def _sampling(name: str, dtype: str, dims: tuple[int, ...] = SCALAR) -> TensorSpec:
    return TensorSpec(name, dtype, dims, "sampling")


def _guards(name: str, dtype: str) -> TensorSpec:
    return TensorSpec(name, dtype, SCALAR, "guards")


REQUEST_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("prompt_tokens", "int32", LIST),
    TensorSpec("lookup_tenant", "bytes"),
    TensorSpec("cache_salt", "bytes"),
    TensorSpec("priority", "int32"),
    TensorSpec("stream", "bool"),
    TensorSpec("grammar_kind", "bytes"),
    TensorSpec("grammar_spec", "bytes"),
    TensorSpec("disable_mtp", "bool"),
    TensorSpec("prediction_tokens", "int32", LIST),
    TensorSpec("adapter_slot", "int32"),  # backend.contract.adapters: 0 base, N an adapter, -1 the active one
    # beam search
    TensorSpec("num_beams", "int32"),
    TensorSpec("num_return_sequences", "int32"),
    TensorSpec("length_penalty", "float64"),  # exact: scores divide by length ** length_penalty
    TensorSpec("early_stopping", "bytes"),  # "false" | "true" | "never"
    # a translation model's languages
    TensorSpec("src_lang_id", "int32"),
    TensorSpec("tgt_lang_id", "int32"),
    # images and videos, preprocessed (backend.contract.vision): the `vision` field's four tensors
    TensorSpec("vision_kinds", "bytes", LIST, "vision"),  # "image" | "video", one per item
    TensorSpec("vision_grids", "int32", MATRIX, "vision"),  # [items, 3]: (t, h, w) in patches
    TensorSpec("vision_pixels", "float32", MATRIX, "vision"),  # [sum of t*h*w, patch_dim]
    TensorSpec("vision_seconds", "float64", LIST, "vision"),  # a video's seconds per temporal patch
    # a router's: the conversation (backend.contract.routing)
    TensorSpec("session_hash", "bytes"),
    # SamplingParams
    _sampling("max_tokens", "int32"),
    _sampling("min_tokens", "int32"),
    _sampling("temperature", "float32"),
    _sampling("top_k", "int32"),
    _sampling("top_p", "float32"),
    _sampling("min_p", "float32"),
    _sampling("top_n_sigma", "float32"),
    _sampling("repetition_penalty", "float32"),
    _sampling("presence_penalty", "float32"),
    _sampling("frequency_penalty", "float32"),
    _sampling("dry_multiplier", "float32"),
    _sampling("dry_base", "float32"),
    _sampling("dry_allowed_length", "int32"),
    _sampling("dry_sequence_breakers", "bytes", LIST),
    _sampling("lz_penalty", "float32"),
    _sampling("logit_bias_ids", "int32", LIST),
    _sampling("logit_bias_values", "float32", LIST),
    _sampling("seed", "int64"),
    _sampling("stop_token_ids", "int32", LIST),
    _sampling("ignore_eos", "bool"),
    _sampling("logprobs", "bool"),
    _sampling("top_logprobs", "int32"),
    _sampling("prompt_logprobs", "int32"),
    # GuardParams
    _guards("enable_thinking", "bool"),
    _guards("thinking_budget", "int32"),
    _guards("loop_min_pattern_size", "int32"),
    _guards("loop_max_pattern_size", "int32"),
    _guards("loop_min_count", "int32"),
    _guards("timeout_s", "float64"),
    _guards("tools_present", "bool"),
    _guards("require_tool_call", "bool"),
    _guards("suppress_tool_call", "bool"),
)
# A query, not a request: the model answers it with one response holding its ModelInfo.
MODEL_INFO_QUERY = TensorSpec("model_info", "bool")
# A command, not a request: an AdapterCommand as JSON, answered with the AdapterTable.
ADAPTER_COMMAND = TensorSpec("adapter_command", "bytes")
INPUTS: tuple[TensorSpec, ...] = (*REQUEST_INPUTS, MODEL_INFO_QUERY, ADAPTER_COMMAND)

OUTPUTS: tuple[TensorSpec, ...] = (
    # RequestOutput: the tokens generated since the previous response (one or more)
    TensorSpec("token_ids", "int32", LIST),
    # its logprobs when asked: one per token, and the top alternatives [num_tokens, k]
    TensorSpec("token_logprobs", "float32", LIST),
    TensorSpec("top_logprob_ids", "int32", MATRIX),
    TensorSpec("top_logprob_values", "float32", MATRIX),
    # once, with the first tokens: one per prompt token (the first NaN, its row padded)
    TensorSpec("prompt_logprobs", "float32", LIST),
    TensorSpec("prompt_top_logprob_ids", "int32", MATRIX),
    TensorSpec("prompt_top_logprob_values", "float32", MATRIX),
    TensorSpec("starts_in_thinking", "bool"),  # once, with the first tokens
    # a beam search's final response: its hypotheses, best first, their tokens one after
    # another in token_ids (logprobs aligned), split by these lengths
    TensorSpec("hypothesis_lengths", "int32", LIST),
    TensorSpec("hypothesis_scores", "float32", LIST),
    TensorSpec("hypothesis_finish_reasons", "bytes", LIST),
    # FinalEvent, on the last response; a field that is None is left out
    TensorSpec("finish_reason", "bytes"),
    TensorSpec("finish_guard", "bytes"),
    TensorSpec("thinking_guard", "bytes"),
    TensorSpec("num_prompt_tokens", "int32"),
    TensorSpec("num_output_tokens", "int32"),
    TensorSpec("num_cached_tokens", "int32"),
    TensorSpec("num_reasoning_tokens", "int32"),
    TensorSpec("num_accepted_prediction_tokens", "int32"),
    TensorSpec("num_rejected_prediction_tokens", "int32"),
    TensorSpec("time_to_first_token_s", "float64"),
    TensorSpec("decode_time_s", "float64"),
    TensorSpec("queue_time_s", "float64"),
    # the answer to a model-info query: ModelInfo as JSON
    TensorSpec("model_info", "bytes"),
    # the answer to an adapter command: AdapterTable as JSON
    TensorSpec("adapters", "bytes"),
)

INPUTS_BY_NAME = {s.name: s for s in INPUTS}
OUTPUTS_BY_NAME = {s.name: s for s in OUTPUTS}


def _pbtxt_tensor(spec: TensorSpec, is_input: bool) -> str:
    lines = [
        "  {",
        f'    name: "{spec.name}"',
        f"    data_type: {spec.triton_type}",
        f"    dims: [ {', '.join(str(d) for d in spec.dims)} ]",
    ]
    if is_input:  # prompt_tokens is required of a request, not of a model-info query
        lines.append("    optional: true")
    lines.append("  }")
    return "\n".join(lines)


def render_config_pbtxt() -> str:
    """The text of model_repository/llm/config.pbtxt, generated from the contract."""
    inputs = ",\n".join(_pbtxt_tensor(s, True) for s in INPUTS)
    outputs = ",\n".join(_pbtxt_tensor(s, False) for s in OUTPUTS)
    return (
        "# Generated from backend/contract/tensors.py by `python -m backend.contract`; do not edit.\n"
        f'name: "{MODEL_NAME}"\n'
        'backend: "python"\n'
        "max_batch_size: 0\n"
        "model_transaction_policy {\n  decoupled: true\n}\n"
        f"input [\n{inputs}\n]\n"
        f"output [\n{outputs}\n]\n"
        "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]\n"
    )
