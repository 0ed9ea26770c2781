"""Every field a request body may carry, and what this server does with it: the one table.

OpenAI's fields (the spec's CreateChatCompletionRequest and CreateCompletionRequest;
tests/openai_frontend/api/openai_spec.json vendors them and a test holds this table to
them), then this server's extensions. A field is

- SUPPORTED: honoured (the request builder or the handlers read it);
- NO_EFFECT: accepted, and meaningless here (`user`: OpenAI's abuse-monitoring id);
- PARTLY: some values honoured, any other a 400 naming the field and why;
- REFUSED: any value but null is a 400 naming the field and why.

A field in no table is a 400 too, unless it is a field of the contract's request sent by
its contract name (`dry_multiplier`, `thinking_budget`, ...): nothing is silently ignored.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from backend.contract import INPUTS_BY_NAME


class Treatment(enum.Enum):
    SUPPORTED = "supported"
    NO_EFFECT = "accepted, no effect"
    PARTLY = "partly supported"
    REFUSED = "refused"


@dataclass(frozen=True, slots=True)
class FieldRule:
    treatment: Treatment
    note: str  # what the field does here; for PARTLY and REFUSED, why a value is refused
    accepts: Callable[[Any], bool] = lambda value: True


def _supported(note: str) -> FieldRule:
    return FieldRule(Treatment.SUPPORTED, note)


def _no_effect(note: str) -> FieldRule:
    return FieldRule(Treatment.NO_EFFECT, note)


def _partly(note: str, accepts: Callable[[Any], bool]) -> FieldRule:
    return FieldRule(Treatment.PARTLY, note, lambda value: value is None or accepts(value))


def _refused(note: str) -> FieldRule:
    return FieldRule(Treatment.REFUSED, note, lambda value: value is None)


def _no_obfuscation(options: Any) -> bool:
    return not (isinstance(options, dict) and options.get("include_obfuscation"))


_SESSION = "names the conversation: with several instances (REPLICAS), it stays on one while that one is healthy"
_PREDICTION = "Predicted Outputs: the expected output's tokens are drafts for speculative decoding"

# the fields both endpoints take
SHARED: dict[str, FieldRule] = {
    "model": _supported("the served model's name, or a LoRA adapter's (a 404 for any other)"),
    "frequency_penalty": _supported("OpenAI's frequency penalty"),
    "logit_bias": _supported("added to the logits of the token ids given"),
    "n": _supported("1..8 choices, each its own model request; with beam search, its n best hypotheses"),
    "presence_penalty": _supported("OpenAI's presence penalty"),
    "seed": _supported("reproducible draws: choice i uses seed + i"),
    "stop": _supported("stop strings, cut from the text"),
    "stream": _supported("server-sent events"),
    "stream_options": _partly(
        "include_usage is supported; include_obfuscation (padding chunks against side channels) is not",
        _no_obfuscation,
    ),
    "temperature": _supported("0 is greedy"),
    "top_p": _supported("nucleus sampling; 0 is greedy"),
    "user": _no_effect("OpenAI's end-user id for abuse monitoring"),
}

CHAT: dict[str, FieldRule] = {
    **SHARED,
    "messages": _supported("through the model's chat template"),
    "max_completion_tokens": _supported("the generated tokens' bound (reasoning included)"),
    "max_tokens": _supported("the same bound, the older name"),
    "logprobs": _supported("the sampled tokens' logprobs"),
    "top_logprobs": _supported("0..20 alternatives per token"),
    "response_format": _supported("text, json_object or json_schema, enforced by a grammar; also with tools"),
    "tools": _supported("function tools; calls parsed from the model's format"),
    "tool_choice": _supported("none, auto, required or a named function"),
    "parallel_tool_calls": _supported("false: at most one call"),
    "functions": _supported("the older tools: answered with function_call"),
    "function_call": _supported("the older tool_choice"),
    "reasoning_effort": _supported("thinking on or off and its budget (a 400 for a model that does not reason)"),
    "metadata": _no_effect("OpenAI's tags for stored completions; nothing is stored here"),
    "safety_identifier": _no_effect("OpenAI's end-user id for abuse monitoring"),
    "prompt_cache_key": _supported(_SESSION),
    "store": _partly("stored completions are not kept by this server", lambda value: value is False),
    "service_tier": _partly("one tier here: auto or default", lambda value: value in ("auto", "default")),
    "modalities": _partly("text only: no audio output", lambda value: value == ["text"]),
    "audio": _refused("audio output is not supported"),
    "verbosity": _refused("verbosity control is not supported"),
    "web_search_options": _refused("web search is not supported"),
    "prediction": _supported(_PREDICTION),
    "prompt_cache_retention": _refused("cache retention options are not supported"),
    "prompt_cache_options": _refused("cache options are not supported"),
    "moderation": _refused("moderation is not supported"),
}

COMPLETIONS: dict[str, FieldRule] = {
    **SHARED,
    "prompt": _supported("a text, token ids, or a list of either (each its own n choices)"),
    "max_tokens": _supported("16 by default; 0 computes the prompt alone (with echo: scoring)"),
    "echo": _supported("the prompt's text (and logprobs) before the completion"),
    "logprobs": _supported("the sampled tokens' logprobs and 0..20 alternatives"),
    "best_of": _partly("only 1: no server-side candidates", lambda value: value == 1),
    "suffix": _partly("insertion (a suffix) is not supported", lambda value: value == ""),
}

EXTENSIONS: dict[str, FieldRule] = {
    "top_k": _supported("top-k filtering (-1 or 0: off)"),
    "min_p": _supported("min-p filtering"),
    "repetition_penalty": _supported("the HF / vLLM repetition penalty"),
    "min_tokens": _supported("EOS and stop tokens masked until this many"),
    "stop_token_ids": _supported("token ids that stop the output"),
    "ignore_eos": _supported("generate past EOS (benchmarks)"),
    "dry_sequence_breakers": _supported("DRY's sequence breakers"),
    "repetition_detection": _supported("the loop detectors' settings"),
    "timeout": _supported("a deadline in seconds: the answer ends with what it has"),
    "num_beams": _supported("beam search with this many beams (1: none), up to the model's MAX_BEAMS"),
    "length_penalty": _supported("beam search: scores divide by length ** length_penalty"),
    "early_stopping": _supported('beam search: true, false or "never" (transformers\' rules)'),
    "src_lang": _supported("a translation model's source language (a FLORES-200 code)"),
    "tgt_lang": _supported("a translation model's target language (a FLORES-200 code)"),
    "prompt_logprobs": _refused("use echo with logprobs (completions) for the prompt's logprobs"),
    # vLLM's structured outputs (api/structured.py): one form at a time, response_format included
    "structured_outputs": _supported(
        "vLLM's: one of json, regex, choice, grammar (EBNF), json_object, structural_tag; enforced by a grammar"
    ),
    "guided_json": _supported("vLLM's older structured_outputs.json: a JSON schema"),
    "guided_regex": _supported("vLLM's older structured_outputs.regex: the whole output matches it"),
    "guided_choice": _supported("vLLM's older structured_outputs.choice: the output is one of the strings"),
    "guided_grammar": _supported("vLLM's older structured_outputs.grammar: an EBNF grammar (xgrammar's)"),
    "guided_decoding_backend": _partly(
        "xgrammar is the one backend here", lambda value: value in ("xgrammar", "auto", "")
    ),
    "guided_whitespace_pattern": _refused("JSON whitespace is fixed here (one line, json.dumps' separators)"),
    "session_id": _supported(_SESSION),
    "return_token_ids": _supported("vLLM's: each choice's token_ids and the response's prompt_token_ids"),
}

# completions' own extensions: chat's Predicted Outputs
COMPLETION_EXTENSIONS: dict[str, FieldRule] = {
    "prediction": _supported(_PREDICTION),
    "prompt_cache_key": _supported(_SESSION),
}

# chat's own extensions
CHAT_EXTENSIONS: dict[str, FieldRule] = {
    "chat_template_kwargs": _supported("passed to the chat template"),
    "enable_thinking": _supported("the same as chat_template_kwargs.enable_thinking"),
    "mm_processor_kwargs": _supported("vLLM's: min_pixels / max_pixels bound the resize of the images and videos"),
}

# Fields of the contract's request a client may not set by name: the frontend derives them
# from the body (the logprob fields shape the response, which the body's own fields ask for;
# num_return_sequences is a search's `n`, the language ids come from src_lang / tgt_lang,
# the vision tensors from a chat's image and video parts, session_hash from the session the body
# names or its prompt: backend.contract.routing); model_info and adapter_command are
# inputs of queries, not of requests.
DERIVED = frozenset(
    {"prompt_tokens", "stream", "lookup_tenant", "model_info", "adapter_command", "logprobs", "top_logprobs",
     "num_return_sequences", "src_lang_id", "tgt_lang_id", "vision_kinds", "vision_grids", "vision_pixels",
     "vision_seconds", "session_hash"}
)  # fmt: skip


def forwardable(name: str) -> bool:
    """A field of the contract's request a client may set by its contract name."""
    return name in INPUTS_BY_NAME and name not in DERIVED


def refusal(values: Mapping[str, Any], table: Mapping[str, FieldRule]) -> tuple[str, str] | None:
    """(the field, why) of the first value the table (or the extensions) refuses; None if
    every one is honoured."""
    for name, value in values.items():
        rule = table.get(name) or EXTENSIONS.get(name)
        if rule is None:
            if not forwardable(name):
                return name, "is not a field of this API (OpenAI's, or this server's extensions)"
        elif not rule.accepts(value):
            return name, rule.note
    return None
