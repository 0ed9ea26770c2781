"""What crosses the engine's boundary: a request in, outputs back. Plain dataclasses."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from backend import contract
from backend.vocab import DEFAULT_DRY_BREAKERS


class FinishReason(enum.Enum):
    STOP = contract.FINISH_STOP  # EOS or a stop token
    LENGTH = contract.FINISH_LENGTH  # max_tokens or the context length
    ABORT = contract.FINISH_ABORT  # cancelled by the client


class StopGuard(enum.Enum):
    """Which guard ended a sequence; reported in the final event."""

    EOS = "eos"
    STOP_TOKEN = "stop_token"
    MAX_TOKENS = "max_tokens"
    CONTEXT_LENGTH = "context_length"
    CANCELLED = "cancelled"
    CONTENT_LOOP = "content_loop"  # the answer repeats a pattern: finished
    DEADLINE = "deadline"  # the request's time ran out: finished with what it has
    THINKING_LOOP = "thinking_loop"  # thinking repeated a pattern: its end was forced
    THINKING_BUDGET = "thinking_budget"  # thinking spent its budget: its end was forced


@dataclass(slots=True)
class SamplingParams:
    """The sampling and stopping settings of one request.

    temperature 0 means greedy. top_k 0, top_p 1.0, min_p 0, top_n_sigma 0,
    repetition_penalty 1, presence/frequency_penalty 0, dry_multiplier 0, lz_penalty 0
    and an empty logit bias are off. DRY's sequence breakers come as strings
    (llama.cpp's, by default); the engine turns them into the ids of the tokens whose
    text holds one (`dry_sequence_breakers`, which the sampler reads).
    max_tokens None means up to the context length. A seeded request draws from a
    generator seeded from (seed, token index), so its tokens do not depend on the rest
    of the batch. The logit bias is two parallel tuples (token ids, values), as on the
    wire; a repeated id adds up.
    """

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    top_n_sigma: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens (HF / vLLM)
    presence_penalty: float = 0.0  # over output tokens (OpenAI)
    frequency_penalty: float = 0.0  # over output tokens (OpenAI)
    dry_multiplier: float = 0.0  # DRY (llama.cpp), over prompt and output tokens
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_breaker_strings: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    dry_sequence_breakers: tuple[int, ...] = ()  # token ids, set by the engine from the strings
    lz_penalty: float = 0.0  # ours: logit -= lz_penalty * repeat length
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # logprobs of the raw distribution (before bias, penalties, temperature, truncation)
    logprobs: bool = False  # the sampled tokens' logprobs
    top_logprobs: int = 0  # and this many most likely alternatives (implies logprobs)
    prompt_logprobs: bool = False  # each prompt token's logprob (skips the prefix cache)
    prompt_top_logprobs: int = 0  # and this many alternatives at each prompt position
    # tool calling (the engine knows the model's call tags from its settings)
    tools_present: bool = False  # the request offers tools: a closing call tag never ends the turn
    require_tool_call: bool = False  # EOS and stop tokens are masked until a call has opened
    suppress_tool_call: bool = False  # the token that would complete the call trigger is masked
    # reasoning and guards (None: the model settings' default)
    enable_thinking: bool = False  # force a thinking block when the prompt did not open one
    thinking_budget: int | None = None  # thinking tokens before the end marker is forced
    loop_min_pattern_size: int | None = None
    loop_max_pattern_size: int | None = None
    loop_min_count: int | None = None  # 0: loop detectors off
    deadline_ms: int | None = None  # from arrival; 0: none

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs this request's token history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.dry_multiplier != 0.0
            or self.lz_penalty != 0.0
        )

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise contract.ContractError naming the first bad field.

        With `vocab_size`, logit bias ids are also checked against the vocabulary.
        """
        vocab_end = vocab_size if vocab_size is not None else 2**31
        id_range = f"must be in [0, {vocab_size})" if vocab_size is not None else "must be at least 0"
        checks = (
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be at least 0"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "must not exceed max_tokens",
            ),
            ("temperature", self.temperature >= 0.0, "must be at least 0"),
            ("top_k", self.top_k >= 0, "must be at least 0 (0 turns it off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("top_n_sigma", self.top_n_sigma >= 0.0, "must be at least 0 (0 turns it off)"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be greater than 0 (1 turns it off)"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("top_logprobs", 0 <= self.top_logprobs <= 20, "must be in [0, 20]"),
            ("prompt_logprobs", 0 <= self.prompt_top_logprobs <= 20, "must be in [0, 20]"),
            ("thinking_budget", self.thinking_budget is None or self.thinking_budget >= 0, "must be at least 0"),
            ("deadline_ms", self.deadline_ms is None or self.deadline_ms >= 0, "must be at least 0 (0: none)"),
            ("loop_min_count", self.loop_min_count is None or self.loop_min_count >= 0, "must be at least 0"),
            ("dry_multiplier", self.dry_multiplier >= 0.0, "must be at least 0 (0 turns it off)"),
            ("dry_base", self.dry_base >= 1.0, "must be at least 1"),
            ("dry_allowed_length", self.dry_allowed_length >= 1, "must be at least 1"),
            ("lz_penalty", self.lz_penalty >= 0.0, "must be at least 0 (0 turns it off)"),
            (
                "logit_bias_values",
                len(self.logit_bias_values) == len(self.logit_bias_ids),
                "must hold one value per id in logit_bias_ids",
            ),
            (
                "logit_bias_ids",
                all(0 <= t < vocab_end for t in self.logit_bias_ids),
                f"token ids {id_range}",
            ),
            (
                "logit_bias_values",
                all(-100.0 <= v <= 100.0 for v in self.logit_bias_values),
                "values must be in [-100, 100]",
            ),
        )
        for name, ok, why in checks:
            if not ok:
                raise contract.ContractError(name, why)


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = ""  # scopes the prefix cache
    adapter: int = 0  # scopes the prefix cache (0: the base model)
    # structured output: an xgrammar grammar the output must follow ("" kind: none)
    grammar_kind: str = ""
    grammar_spec: str = ""
    grammar: Any = None  # the compiled grammar (backend.grammar.CompiledGrammar), once prepared
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class FinalStats:
    finish_reason: FinishReason
    stop_guard: StopGuard
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    time_to_first_token_s: float
    decode_time_s: float
    reasoning_tokens: int = 0
    thinking_guard: StopGuard | None = None  # the guard that ended thinking, if one did
    queue_time_s: float = 0.0  # arrival -> first scheduled (vLLM's queue time)


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    final: FinalStats | None = None  # set on the last output of the request
    # when the request asked: one per new token, and its top alternatives (ids, values)
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None
    # once, with the first token: one per prompt token, the first None (nothing predicts
    # it); and, when asked, each prompt position's top alternatives (the first empty)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.final is not None


def sampling_from_fields(values: dict[str, Any]) -> SamplingParams:
    """Contract field values (contract.decode_request) -> validated SamplingParams."""
    params = SamplingParams(
        max_tokens=values["max_tokens"],
        min_tokens=values["min_tokens"],
        temperature=values["temperature"],
        top_k=values["top_k"],
        top_p=values["top_p"],
        min_p=values["min_p"],
        top_n_sigma=values["top_n_sigma"],
        repetition_penalty=values["repetition_penalty"],
        presence_penalty=values["presence_penalty"],
        frequency_penalty=values["frequency_penalty"],
        dry_multiplier=values["dry_multiplier"],
        dry_base=values["dry_base"],
        dry_allowed_length=values["dry_allowed_length"],
        dry_breaker_strings=_strings(values["dry_sequence_breakers"]) or DEFAULT_DRY_BREAKERS,
        lz_penalty=values["lz_penalty"],
        logit_bias_ids=tuple(values["logit_bias_ids"]),
        logit_bias_values=tuple(values["logit_bias_values"]),
        seed=values["seed"],
        stop_token_ids=tuple(values["stop_tokens"]),
        ignore_eos=values["ignore_eos"],
        logprobs=values["logprobs"],
        top_logprobs=values["top_logprobs"],
        # prompt_logprobs N > 0: each prompt token's logprob and N alternatives (vLLM);
        # echo: the logprobs alone
        prompt_logprobs=values["prompt_logprobs"] > 0 or values["echo"],
        prompt_top_logprobs=values["prompt_logprobs"],
        tools_present=values["tools_present"],
        require_tool_call=values["require_tool_call"],
        suppress_tool_call=values["suppress_tool_call"],
        enable_thinking=values["enable_thinking"],
        thinking_budget=values["thinking_budget"],
        loop_min_pattern_size=values["loop_min_pattern_size"],
        loop_max_pattern_size=values["loop_max_pattern_size"],
        loop_min_count=values["loop_min_count"],
        deadline_ms=values["deadline_ms"],
    )
    params.validate()
    return params


def _strings(items: tuple[bytes, ...]) -> tuple[str, ...]:
    try:
        return tuple(item.decode() for item in items)
    except UnicodeDecodeError as exc:
        raise contract.ContractError("dry_sequence_breakers", f"must be UTF-8 strings: {exc}") from None
