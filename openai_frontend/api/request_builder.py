"""An OpenAI body -> the contract's GenerationRequest: built here once, validated here once.

The one place where API names meet the contract's: `max_completion_tokens` is the
request's `max_tokens`, `logit_bias` its ids and values, `timeout` its guards'
`timeout_s`, `repetition_detection` its loop limits, a beam search's `n` its
num_return_sequences (api/beams.py), `src_lang` / `tgt_lang` its language ids
(api/translation.py), `prompt_cache_key` / `session_id` its session_hash
(backend.contract.routing). The model's sampling presets (ModelInfo.sampling_defaults, chat
only; a search keeps their bounds alone) fill what the body leaves unset, and extension
fields a client sends by their contract name (`dry_multiplier`, `thinking_budget`, ...)
are set by name through the contract: `adapter_slot` too, over the slot the body's
`model` picked. A value the contract refuses is a 400 naming the body's field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from backend.contract import (
    ContractError,
    GenerationRequest,
    GuardParams,
    ModelInfo,
    SamplingParams,
    apply_inputs,
)
from backend.contract.routing import session_hash
from openai_frontend.api.beams import beam_settings
from openai_frontend.api.errors import OpenAIError, bad_request
from openai_frontend.api.fields import forwardable
from openai_frontend.api.protocol import GenerationBody
from openai_frontend.api.structured import grammar_of
from openai_frontend.api.translation import apply_languages

# reasoning_effort -> the thinking budget (None: the model's own); "none" turns thinking off
_EFFORT_BUDGETS = {"minimal": 64, "low": 512, "medium": 2048, "high": None, "xhigh": None, "max": None}


def build_request(
    body: GenerationBody,
    prompt: list[int],
    info: ModelInfo,
    *,
    tenant: str,
    stream: bool,
    presets: Mapping[str, Any] | None = None,
    prediction: list[int] = (),
    adapter_slot: int = 0,
) -> GenerationRequest:
    """The body's request for `prompt`, not yet validated (tools may still constrain it:
    `validated`). `presets`: sampling defaults for the fields the body does not set;
    `prediction`: the tokens of the body's prediction; `adapter_slot`: the LoRA adapter
    the body's `model` picked (0: none)."""
    beams = beam_settings(body, info)
    defaults = SamplingParams(**{k: v for k, v in beams.presets(presets or {}).items() if not body.sets(k)})
    request = GenerationRequest(
        list(prompt), _sampling(body, defaults), _guards(body, info), lookup_tenant=tenant, stream=stream,
        prediction_tokens=tuple(prediction), adapter_slot=adapter_slot,
        session_hash=session_hash(tenant, prompt, body.session_name()),
    )  # fmt: skip
    grammar = grammar_of(body)  # response_format, or vLLM's structured outputs
    if grammar is not None:
        request.grammar_kind, request.grammar_spec = grammar
    beams.apply(request, body.n)
    apply_languages(body, info, request)
    try:
        apply_inputs(request, _forwarded(body))
    except ContractError as exc:
        raise _refusal(body, exc) from None
    return request


def returns_token_ids(body: GenerationBody) -> bool:
    """vLLM's return_token_ids: the choices carry their tokens, the response its prompt's."""
    return bool((body.model_extra or {}).get("return_token_ids"))


def validated(body: GenerationBody, request: GenerationRequest, info: ModelInfo) -> GenerationRequest:
    """The request, checked against the contract and the model's vocabulary; a 400
    naming the body's field otherwise."""
    try:
        request.validate(info.vocab_size)
    except ContractError as exc:
        raise _refusal(body, exc) from None
    room = info.max_model_len - len(request.prompt_tokens)
    if 0 < room < len(request.prediction_tokens):  # (a prompt that leaves no room is check_context's 400)
        message = (
            f"prediction: it has {len(request.prediction_tokens)} tokens, and this model's context "
            f"({info.max_model_len} tokens) leaves {room} for the output after the {body.PROMPT_PARAM}"
        )
        raise bad_request("prediction", message)
    return request


def for_choice(request: GenerationRequest, index: int) -> GenerationRequest:
    """Choice `index`'s request: with a seed, seed + index (distinct yet reproducible),
    wrapping around within the 64-bit range the spec gives a seed."""
    seed = request.sampling.seed
    if seed is None or index == 0:
        return request
    wrapped = (seed + index + 2**63) % 2**64 - 2**63
    return replace(request, sampling=replace(request.sampling, seed=wrapped))


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _sampling(body: GenerationBody, defaults: SamplingParams) -> SamplingParams:
    bias = body.logit_bias or {}
    logprobs, top_logprobs = body.logprob_counts()
    return replace(
        defaults,
        # a preset max_tokens replaces the spec's default too (completions' 16)
        max_tokens=defaults.max_tokens if defaults.max_tokens is not None else body.max_new_tokens(),
        min_tokens=_pick(body.min_tokens, defaults.min_tokens),
        # top_p 0 keeps the most likely token alone: a greedy draw
        temperature=0.0 if body.top_p == 0 else _pick(body.temperature, defaults.temperature),
        top_k=defaults.top_k if body.top_k is None else max(body.top_k, 0),  # vLLM's -1: off
        top_p=defaults.top_p if body.top_p is None else body.top_p or 1.0,
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


def _guards(body: GenerationBody, info: ModelInfo) -> GuardParams:
    loops = body.repetition_detection
    return GuardParams(
        enable_thinking=body.forces_thinking(),
        thinking_budget=_effort_budget(body, info),
        loop_min_pattern_size=loops.min_pattern_size if loops else None,
        loop_max_pattern_size=loops.max_pattern_size if loops else None,
        loop_min_count=loops.min_count if loops else None,
        timeout_s=body.timeout,
    )


def _effort_budget(body: GenerationBody, info: ModelInfo) -> int | None:
    """reasoning_effort's thinking budget (its on / off is the chat template's
    enable_thinking); a 400 when it asks a model that does not reason to reason."""
    effort = body.reasoning_effort_asked()
    if effort in (None, "none"):
        return None
    if not info.think_start:
        raise bad_request("reasoning_effort", f"reasoning_effort: this model does not reason; {effort!r} cannot apply")
    return _EFFORT_BUDGETS[effort]


def _forwarded(body: GenerationBody) -> dict[str, Any]:
    """Extension fields sent by a contract name (the field table refused any other unknown one)."""
    return {name: value for name, value in (body.model_extra or {}).items() if forwardable(name)}


def _refusal(body: GenerationBody, error: ContractError) -> OpenAIError:
    param = body.param_of(error.field)
    return bad_request(param, f"{param}: {error.message}")
