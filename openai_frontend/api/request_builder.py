"""An OpenAI body -> the contract's GenerationRequest: built here once, validated here once.

The one place where API names meet the contract's: `max_completion_tokens` is the
request's `max_tokens`, `logit_bias` its ids and values, `timeout` its guards'
`timeout_s`, `repetition_detection` its loop limits. The model's sampling presets
(ModelInfo.sampling_defaults, chat only) fill what the body leaves unset, and
extension fields a client sends by their contract name (`dry_multiplier`,
`thinking_budget`, `num_beams`, ...) are set by name through the contract. A value the
contract refuses is a 400 naming the body's field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from backend.contract import (
    INPUTS_BY_NAME,
    ContractError,
    GenerationRequest,
    GuardParams,
    ModelInfo,
    SamplingParams,
    apply_inputs,
)
from openai_frontend.api.errors import OpenAIError, bad_request
from openai_frontend.api.protocol import GenerationBody

log = logging.getLogger(__name__)

# Fields of the contract's request a client may not set by name: the frontend derives them.
_DERIVED = frozenset({"prompt_tokens", "stream", "lookup_tenant", "model_info"})
# OpenAI fields that carry no meaning for generation here; ignored without a warning.
_HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})


def build_request(
    body: GenerationBody,
    prompt: list[int],
    info: ModelInfo,
    *,
    tenant: str,
    stream: bool,
    presets: Mapping[str, Any] | None = None,
) -> GenerationRequest:
    """The body's request for `prompt`, not yet validated (tools may still constrain it:
    `validated`). `presets`: sampling defaults for the fields the body does not set."""
    defaults = SamplingParams(**{k: v for k, v in (presets or {}).items() if not body.sets(k)})
    request = GenerationRequest(
        list(prompt), _sampling(body, defaults), _guards(body), lookup_tenant=tenant, stream=stream
    )
    grammar = body.grammar()
    if grammar is not None:
        request.grammar_kind, request.grammar_spec = grammar
    try:
        apply_inputs(request, _forwarded(body))
    except ContractError as exc:
        raise _refusal(body, exc) from None
    return request


def validated(body: GenerationBody, request: GenerationRequest, info: ModelInfo) -> GenerationRequest:
    """The request, checked against the contract and the model's vocabulary; a 400
    naming the body's field otherwise."""
    try:
        request.validate(info.vocab_size)
    except ContractError as exc:
        raise _refusal(body, exc) from None
    return request


def for_choice(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index`'s request: with a seed, seed + index (distinct yet reproducible)."""
    seed = request.sampling.seed
    if seed is None:
        return request
    return replace(request, sampling=replace(request.sampling, seed=seed + index))


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _sampling(body: GenerationBody, defaults: SamplingParams) -> SamplingParams:
    bias = body.logit_bias or {}
    logprobs, top_logprobs = body.logprob_counts()
    return replace(
        defaults,
        max_tokens=_pick(body.max_new_tokens(), defaults.max_tokens),
        min_tokens=_pick(body.min_tokens, defaults.min_tokens),
        temperature=_pick(body.temperature, defaults.temperature),
        top_k=defaults.top_k if body.top_k is None else max(body.top_k, 0),  # vLLM's -1: off
        top_p=_pick(body.top_p, defaults.top_p),
        min_p=_pick(body.min_p, defaults.min_p),
        repetition_penalty=_pick(body.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_pick(body.presence_penalty, defaults.presence_penalty),
        frequency_penalty=_pick(body.frequency_penalty, defaults.frequency_penalty),
        dry_sequence_breakers=tuple(body.dry_sequence_breakers or defaults.dry_sequence_breakers),
        logit_bias_ids=tuple(int(token_id) for token_id in bias),
        logit_bias_values=tuple(float(value) for value in bias.values()),
        seed=body.seed,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=body.prompt_logprob_count(),
    )


def _guards(body: GenerationBody) -> GuardParams:
    loops = body.repetition_detection
    return GuardParams(
        enable_thinking=body.forces_thinking(),
        loop_min_pattern_size=loops.min_pattern_size if loops else None,
        loop_max_pattern_size=loops.max_pattern_size if loops else None,
        loop_min_count=loops.min_count if loops else None,
        timeout_s=body.timeout,
    )


def _forwarded(body: GenerationBody) -> dict[str, Any]:
    """Extension fields sent by a contract name; other unknown fields are logged."""
    forwarded = {}
    for name, value in (body.model_extra or {}).items():
        if name in INPUTS_BY_NAME and name not in _DERIVED:
            forwarded[name] = value
        elif name not in _HARMLESS:
            log.warning("ignoring unknown request field %r", name)
    return forwarded


def _refusal(body: GenerationBody, error: ContractError) -> OpenAIError:
    param = body.param_of(error.field)
    return bad_request(param, f"{param}: {error.message}")
