"""The request: what a client asks of model `llm`, one typed value at every layer.

The frontend builds a `GenerationRequest` from an OpenAI body, `backend.contract.wire`
encodes it to named tensors, model.py decodes those into the same type, and the engine
reads it by attribute. A field's name here is its tensor's name and the engine's name
for it; its default is what an absent tensor means (the value that turns its feature
off, or None for "the model's default").

`validate()` checks every value; it runs where a request is built: in the frontend's
builder and in the model's decoding of what came over the wire (any Triton client may
send it). The engine trusts the requests it is given. Checks that need the model's
facts (the vocabulary, the context length) take them as arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from backend.contract.errors import ContractError
from backend.contract.tensors import REQUEST_INPUTS, TensorSpec
from backend.contract.vision import VisionItem, vision_checks

# llama.cpp's default DRY sequence breakers
DEFAULT_DRY_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")
MAX_TOP_LOGPROBS = 20

EARLY_STOPPING = ("false", "true", "never")  # transformers' False, True and "never"

Check = tuple[str, bool, str]  # (field, whether it holds, why not)


@dataclass(slots=True)
class SamplingParams:
    """How each token is drawn (docs/sampling.md has the order and the formulas) and
    when the generation stops.

    temperature 0 means greedy. top_k 0, top_p 1, min_p 0, top_n_sigma 0,
    repetition_penalty 1, presence/frequency_penalty 0, dry_multiplier 0, lz_penalty 0
    and an empty logit bias are off. max_tokens None: up to the context length; 0: the
    prompt is computed (its logprobs, when asked: scoring a prompt) and nothing generated. A
    seeded request draws from a generator seeded from (seed, token index), so its
    tokens do not depend on its batch. The logit bias is two parallel tuples (token ids,
    values); a repeated id adds up. Logprobs describe the raw distribution (before
    bias, penalties and temperature); prompt_logprobs N: each prompt token's logprob
    and its N most likely alternatives (None: none).
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
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    lz_penalty: float = 0.0  # ours: logit -= lz_penalty * repeat length
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate past EOS (benchmarks)
    logprobs: bool = False  # the sampled tokens' logprobs
    top_logprobs: int = 0  # and this many alternatives (implies logprobs)
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def uses_penalties(self) -> bool:
        """Whether the sampler needs the request's token history."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.dry_multiplier != 0.0
            or self.lz_penalty != 0.0
        )

    def checks(self, vocab_size: int | None) -> Iterator[Check]:
        yield from self._length_checks()
        yield from self._sampler_checks()
        yield from self._penalty_checks()
        yield from self._bias_checks(vocab_size)
        yield ("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"must be in [0, {MAX_TOP_LOGPROBS}]")
        prompt_ok = self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        yield ("prompt_logprobs", prompt_ok, f"must be in [0, {MAX_TOP_LOGPROBS}]")

    def _length_checks(self) -> Iterator[Check]:
        yield ("max_tokens", self.max_tokens is None or self.max_tokens >= 0, "must be at least 0")
        yield ("min_tokens", self.min_tokens >= 0, "must be at least 0")
        fits = self.max_tokens is None or self.min_tokens <= self.max_tokens
        yield ("min_tokens", fits, "must not exceed max_tokens")

    def _sampler_checks(self) -> Iterator[Check]:
        yield ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must be a 64-bit signed integer")
        yield ("temperature", self.temperature >= 0.0, "must be at least 0")
        yield ("top_k", self.top_k >= 0, "must be at least 0 (0 turns it off)")
        yield ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]")
        yield ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]")
        yield ("top_n_sigma", self.top_n_sigma >= 0.0, "must be at least 0 (0 turns it off)")

    def _penalty_checks(self) -> Iterator[Check]:
        yield ("repetition_penalty", self.repetition_penalty > 0.0, "must be greater than 0 (1 turns it off)")
        yield ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]")
        yield ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]")
        yield ("dry_multiplier", self.dry_multiplier >= 0.0, "must be at least 0 (0 turns it off)")
        yield ("dry_base", self.dry_base >= 1.0, "must be at least 1")
        yield ("dry_allowed_length", self.dry_allowed_length >= 1, "must be at least 1")
        yield ("lz_penalty", self.lz_penalty >= 0.0, "must be at least 0 (0 turns it off)")

    def _bias_checks(self, vocab_size: int | None) -> Iterator[Check]:
        paired = len(self.logit_bias_values) == len(self.logit_bias_ids)
        yield ("logit_bias_values", paired, "must hold one value per id in logit_bias_ids")
        end = vocab_size if vocab_size is not None else 2**31
        in_range = f"must be in [0, {vocab_size})" if vocab_size is not None else "must be at least 0"
        yield ("logit_bias_ids", all(0 <= t < end for t in self.logit_bias_ids), f"token ids {in_range}")
        bounded = all(-100.0 <= v <= 100.0 for v in self.logit_bias_values)
        yield ("logit_bias_values", bounded, "values must be in [-100, 100]")


@dataclass(slots=True)
class GuardParams:
    """What watches the generation besides its length: thinking, loops, time, tools.

    None means the model settings' default (MODEL.toml [reasoning] and [guards]).
    """

    enable_thinking: bool = False  # force a thinking block the prompt did not open
    thinking_budget: int | None = None  # thinking tokens before the end marker is forced
    loop_min_pattern_size: int | None = None
    loop_max_pattern_size: int | None = None
    loop_min_count: int | None = None  # 0: loop detectors off
    timeout_s: float | None = None  # from the request's arrival; 0: none
    tools_present: bool = False  # the request offers tools: a closing call tag never ends the turn
    require_tool_call: bool = False  # EOS and stop tokens are masked until a call has opened
    suppress_tool_call: bool = False  # the token that would complete the call trigger is masked

    def checks(self) -> Iterator[Check]:
        budget_ok = self.thinking_budget is None or self.thinking_budget >= 0
        yield ("thinking_budget", budget_ok, "must be at least 0")
        yield ("timeout_s", self.timeout_s is None or self.timeout_s >= 0, "must be at least 0 (0: none)")
        # the pattern sizes are checked with the model's defaults filled in (backend.guards.thinking)
        yield ("loop_min_count", self.loop_min_count is None or self.loop_min_count >= 0, "must be at least 0")


@dataclass(slots=True)
class GenerationRequest:
    """One generation: the prompt's tokens and everything that shapes the output."""

    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    guards: GuardParams = field(default_factory=GuardParams)
    # structured output: an xgrammar grammar the output follows ("" kind: none);
    # json_object | json_schema | regex | ebnf | structural_tag, and its text
    grammar_kind: str = ""
    grammar_spec: str = ""
    lookup_tenant: str = ""  # scopes the prefix cache (the API key's tenant)
    cache_salt: str = ""  # vLLM's: a further prefix-cache scope within the tenant ("": none)
    priority: int = 0  # vLLM's: lower runs sooner, when the engine's SCHEDULING_POLICY is priority
    stream: bool = False  # False: the model sends one response at the end
    disable_mtp: bool = False  # never draft for this request (every proposer)
    prediction_tokens: tuple[int, ...] = ()  # OpenAI's Predicted Outputs: the expected output, tokenized
    # the LoRA adapter (backend.contract.adapters): 0 none, N the adapter in slot N, -1 the active one
    adapter_slot: int = 0
    # beam search (backend.beams), transformers' semantics: num_beams 1 is no search;
    # the final output carries the num_return_sequences best hypotheses, best first
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: str = "false"  # EARLY_STOPPING
    # a translation model's languages (token ids of their codes; 0: the deployment's default)
    src_lang_id: int = 0
    tgt_lang_id: int = 0
    # images and videos, preprocessed, in prompt order (backend.contract.vision): the prompt
    # holds each one's placeholder tokens, one per merged patch
    vision: tuple[VisionItem, ...] = ()
    # the conversation, for a router in front of several instances (backend.contract.routing;
    # the frontend sets it); the engine itself does not read it
    session_hash: str = ""

    def validate(self, vocab_size: int | None = None, max_model_len: int | None = None) -> None:
        """Raise ContractError naming the first bad field. With `vocab_size`, token ids
        (prompt and logit bias) are checked against the vocabulary; with `max_model_len`,
        the prompt against the context, which must also hold one generated token."""
        checks = (
            *self._storage_checks(),
            *self._checks(vocab_size, max_model_len),
            *self.sampling.checks(vocab_size),
            *self.guards.checks(),
            *self._beam_checks(),
            *vision_checks(self.vision),
        )
        for name, ok, why in checks:
            if not ok:
                raise ContractError(name, why)

    def _storage_checks(self) -> Iterator[Check]:
        """Every number within the type its tensor stores it in: no wrap-around on the wire
        (priority 2**32 must not arrive as 0) and no overflow to infinity."""
        for spec in _NUMBER_INPUTS:
            value = getattr(getattr(self, spec.part) if spec.part else self, spec.name)
            values = value if spec.is_list else (value,)
            low, high = _STORED_RANGES[spec.dtype]
            bad = next((v for v in values if v is not None and not low <= v <= high), None)
            yield (spec.name, bad is None, f"{bad} is outside the range {spec.dtype} holds, [{low}, {high}]")

    def _checks(self, vocab_size: int | None, max_model_len: int | None) -> Iterator[Check]:
        prompt = self.prompt_tokens
        yield ("prompt_tokens", bool(prompt), "must hold at least one token")
        end = vocab_size if vocab_size is not None else 2**31
        bad = next((t for t in prompt if not 0 <= t < end), None)
        where = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "[0, 2**31)"
        yield ("prompt_tokens", bad is None, f"token id {bad} is outside {where}")
        fits = max_model_len is None or len(prompt) < max_model_len
        context = (
            f"the prompt has {len(prompt)} tokens; this model's context is {max_model_len} tokens, "
            "which must hold the prompt and at least one generated token"
        )
        yield ("prompt_tokens", fits, context)
        bad = next((t for t in self.prediction_tokens if not 0 <= t < end), None)
        yield ("prediction_tokens", bad is None, f"token id {bad} is outside {where}")
        room = None if max_model_len is None else max_model_len - len(prompt)
        yield (
            "prediction_tokens",
            room is None or len(self.prediction_tokens) <= room,
            f"the prediction has {len(self.prediction_tokens)} tokens; this model's context leaves {room} "
            "for the output",
        )
        yield (
            "adapter_slot",
            self.adapter_slot >= -1,
            "must be 0 (the base model), an adapter's slot, or -1 (the active adapter)",
        )

    def _beam_checks(self) -> Iterator[Check]:
        yield ("num_beams", self.num_beams >= 1, "must be at least 1 (1: no beam search)")
        fits = 1 <= self.num_return_sequences <= self.num_beams
        yield ("num_return_sequences", fits, f"must be in [1, num_beams = {self.num_beams}]")
        yield ("early_stopping", self.early_stopping in EARLY_STOPPING, f"must be one of {EARLY_STOPPING}")
        if self.num_beams == 1:
            for name in ("length_penalty", "early_stopping"):
                unset = getattr(self, name) == _SEARCH_DEFAULTS[name]
                yield (name, unset, "applies to beam search only: set num_beams above 1, or leave it out")
            return
        yield ("max_tokens", self.sampling.max_tokens != 0, "must be at least 1 for a beam search")
        for name, ok in self._beam_conflicts():
            yield (name, ok, "cannot apply to beam search (num_beams > 1): leave it out")

    def _beam_conflicts(self) -> Iterator[tuple[str, bool]]:
        """What a beam search cannot honour: it is deterministic (temperature 0), scores
        the raw distribution (no sampler or penalty), follows no grammar, drafts nothing
        and runs no thinking or tool-call guard."""
        s, g = self.sampling, self.guards
        yield ("temperature", s.temperature == 0.0)
        for name in _SAMPLER_FIELDS:
            yield (name, getattr(s, name) == getattr(_SAMPLING_DEFAULTS, name))
        yield ("grammar_kind", not self.grammar_kind)
        yield ("prediction_tokens", not self.prediction_tokens)
        yield ("enable_thinking", not g.enable_thinking)
        yield ("thinking_budget", g.thinking_budget is None)
        yield ("require_tool_call", not g.require_tool_call)
        yield ("suppress_tool_call", not g.suppress_tool_call)


_SEARCH_DEFAULTS = {name: getattr(GenerationRequest([]), name) for name in ("length_penalty", "early_stopping")}
_SAMPLING_DEFAULTS = SamplingParams()
_SAMPLER_FIELDS = (
    "top_k", "top_p", "min_p", "top_n_sigma", "seed", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "dry_multiplier", "lz_penalty",
)  # fmt: skip


_STORED_RANGES = {
    "int32": (-(2**31), 2**31 - 1),
    "int64": (-(2**63), 2**63 - 1),
    "float32": (-3.4028234663852886e38, 3.4028234663852886e38),  # finite values only: NaN fails too
}
_NUMBER_INPUTS: tuple[TensorSpec, ...] = tuple(
    spec for spec in REQUEST_INPUTS if spec.dtype in _STORED_RANGES and spec.part in ("", "sampling", "guards")
)
