"""OpenAI request bodies: what both endpoints share, and the body of /v1/completions
(the chat body is in api/chat_protocol.py).

Fields follow the order of the OpenAI API reference; a marked block of extensions
(vLLM-style, sent by clients as extra body fields) follows. Unknown top-level fields
are accepted and logged, as vLLM does. A field this server cannot honour is never
dropped: the frontend rejects it with a 400 naming it. The values' ranges are the
contract's to check (`GenerationRequest.validate`, once, in api/request_builder.py);
these models check shapes and what only the API has (`n`, `timeout`, message sizes).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from openai_frontend.api.errors import bad_request

MAX_CHOICES = 8  # `n`: each choice is its own model request (the prefix cache shares the prompt)
MAX_TIMEOUT_S = 86_400.0 * 365  # `timeout`: a year; a bound keeps the engine's deadline finite (1e308 s overflowed)


class StreamOptions(BaseModel):
    include_usage: bool = False


class RepetitionDetection(BaseModel):
    """The loop detectors' settings for one request (absent fields: the model's defaults):
    a pattern of min_pattern_size..max_pattern_size tokens repeated min_count times in a
    row (0 turns the detectors off)."""

    model_config = ConfigDict(extra="forbid")

    min_pattern_size: int | None = Field(None, ge=1)
    max_pattern_size: int | None = Field(None, ge=1)
    min_count: int | None = Field(None, ge=0)


class GenerationBody(BaseModel):
    """What both endpoints share: the extensions, sizes, and the context check."""

    model_config = ConfigDict(extra="allow")
    PROMPT_PARAM: ClassVar[str] = "prompt"

    # OpenAI's fields both endpoints take (each body adds its own, and its own logprobs
    # and max_tokens)
    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None

    # --- extensions (vLLM-style extra body fields) ---
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM sends -1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # DRY's sequence breakers, as llama.cpp's server takes them; absent or empty: its defaults
    dry_sequence_breakers: list[str] | None = None
    # guards: loop detectors, and a deadline in seconds (the answer ends with what it has)
    repetition_detection: RepetitionDetection | None = None
    timeout: float | None = Field(None, gt=0, le=MAX_TIMEOUT_S)
    # Any other field of the contract's request not derived by the frontend (num_beams,
    # dry_multiplier, thinking_budget, ...) may be sent by its contract name and is
    # forwarded as is (request_builder.FORWARDABLE).

    @field_validator("logit_bias")
    @classmethod
    def _keys_are_token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # the ranges (ids in the vocabulary, values in [-100, 100]) are the contract's to check
        for key in bias or {}:
            try:
                int(key)
            except ValueError:
                raise ValueError(f"keys must be token ids, got {key!r}") from None
        return bias

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def sets(self, name: str) -> bool:
        """Whether the body gives a value for the sampling field `name` (a model preset
        then does not apply to it)."""
        given = set(self.model_fields_set) | set(self.model_extra or {})
        return name in given or (name == "max_tokens" and "max_completion_tokens" in given)

    def stop_strings(self) -> list[str]:
        stop = self.stop
        return [stop] if isinstance(stop, str) else list(stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def logprob_counts(self) -> tuple[bool, int]:
        """(the sampled tokens' logprobs, how many alternatives each)."""
        raise NotImplementedError

    def prompt_logprob_count(self) -> int | None:
        """The prompt tokens' alternatives when their logprobs are wanted, else None."""
        return None

    def grammar(self) -> tuple[str, str] | None:
        """The output constraint (grammar kind, spec) the body asks for; None: free text."""
        return None

    def forces_thinking(self) -> bool:
        return False

    def check_sizes(self, max_messages: int, max_string_chars: int) -> None:
        """A 400 naming the first string over `max_string_chars` characters (0: no bound),
        so no tokenizer or template ever runs on one."""
        path = _long_string(self.model_dump(exclude_unset=True, by_alias=True), max_string_chars)
        if path is not None:
            raise bad_request(path, f"{path}: longer than {max_string_chars} characters")

    def check_context(self, prompt_len: int, max_model_len: int) -> int:
        """The most new tokens a choice may ask for: max_tokens, else what the context
        leaves. A 400 with the numbers when the prompt, or the prompt and max_tokens, do
        not fit the model's context (ModelInfo.max_model_len: the engine's)."""
        asked = self.max_new_tokens()
        if prompt_len >= max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"{self.PROMPT_PARAM} resulted in {prompt_len} tokens. Please reduce the length of the "
                f"{self.PROMPT_PARAM}."
            )
            raise bad_request(self.PROMPT_PARAM, message)
        if asked is not None and prompt_len + asked > max_model_len:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + asked} tokens ({prompt_len} in the {self.PROMPT_PARAM}, {asked} in the "
                f"completion). Please reduce the length of the {self.PROMPT_PARAM} or completion."
            )
            raise bad_request(self.param_of("max_tokens"), message)
        return asked if asked is not None else max_model_len - prompt_len

    def param_of(self, field: str) -> str:
        """The body field behind a field of the contract's request, to name it in an error."""
        if field == "prompt_tokens":
            return self.PROMPT_PARAM
        return _PARAM_OF_FIELD.get(field, field)


# a field of the contract's request -> the body field a client sets it with
_PARAM_OF_FIELD = {
    "logit_bias_ids": "logit_bias",
    "logit_bias_values": "logit_bias",
    "grammar_kind": "response_format",
    "grammar_spec": "response_format",
    "tools_present": "tools",
    "require_tool_call": "tool_choice",
    "suppress_tool_call": "tool_choice",
    "enable_thinking": "chat_template_kwargs.enable_thinking",
    "loop_min_pattern_size": "repetition_detection.min_pattern_size",
    "loop_max_pattern_size": "repetition_detection.max_pattern_size",
    "loop_min_count": "repetition_detection.min_count",
    "timeout_s": "timeout",
}


def _long_string(value: Any, limit: int, path: str = "") -> str | None:
    """The dotted path (`messages.3.content`) of the first string longer than `limit`."""
    if not limit:
        return None
    if isinstance(value, str):
        return path if len(value) > limit else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _long_string(item, limit, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


# ---------------------------------------------------------------------------
# /v1/completions


class CompletionRequest(GenerationBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1, le=1)
    echo: bool = False
    logprobs: int | None = None  # OpenAI allows up to 5, we up to 20
    max_tokens: int | None = 16
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server yet")
        return value

    def logprob_counts(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0

    def prompt_logprob_count(self) -> int | None:
        """echo's text is the frontend's; with logprobs, the model adds the prompt's logprobs
        (and as many alternatives as the generated tokens get)."""
        return self.logprobs if self.echo and self.logprobs is not None else None

    def param_of(self, field: str) -> str:
        if field in ("top_logprobs", "prompt_logprobs"):
            return "logprobs"
        return super().param_of(field)
