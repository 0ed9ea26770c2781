"""OpenAI request bodies: what both endpoints share, and the body of /v1/completions
(the chat body is in api/chat_protocol.py).

Fields follow the order of the OpenAI API reference; a marked block of extensions
(vLLM-style, sent by clients as extra body fields) follows. Every field a body may carry
is in the table of api/fields.py (`check_fields`): one this server cannot honour, or
one in no table, is a 400 naming it, never dropped. The values' ranges are the
contract's to check (`GenerationRequest.validate`, once, in api/request_builder.py);
these models check shapes and what only the API has (`n`, `timeout`, message sizes).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from openai_frontend.api.errors import bad_request
from openai_frontend.api.fields import COMPLETION_EXTENSIONS, COMPLETIONS, FieldRule, refusal
from openai_frontend.api.structured import structured_param

MAX_CHOICES = 8  # `n`: each choice is its own model request (the prefix cache shares the prompt)
MAX_PROMPT_CHOICES = 64  # completions: prompts x n, each a model request (the engine's default batch)
MAX_TIMEOUT_S = 86_400.0 * 365  # `timeout`: a year; a bound keeps the engine's deadline finite (1e308 s overflowed)


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None  # refused when true (api/fields.py)


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the output expected (an edited file's original, say),
    as a text or a list of text parts. Its tokens are drafts for speculative decoding:
    they make the answer faster where it matches, never different."""

    model_config = ConfigDict(extra="forbid")

    type: str
    content: str | list[dict[str, Any]]

    @model_validator(mode="after")
    def _content_shape(self):
        if self.type != "content":
            raise ValueError(f"type must be 'content', not {self.type!r}")
        if isinstance(self.content, list):
            for i, part in enumerate(self.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise ValueError(f"content[{i}] must be a text part: {{'type': 'text', 'text': '...'}}")
        return self

    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "".join(part["text"] for part in content)


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
    FIELDS: ClassVar[dict[str, FieldRule]] = COMPLETIONS  # every field it may carry (api/fields.py)

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
    prediction: Prediction | None = None  # chat's, in the spec; completions take it too
    # the conversation, kept on one instance by the router (backend.contract.routing):
    # OpenAI's name (chat's, in the spec; completions take it too), or vLLM users' session_id
    prompt_cache_key: str | None = Field(None, max_length=1024)

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
    # beam search (api/beams.py): num_beams > 1 searches, and `n` is how many of its best
    # hypotheses come back; absent: the model's defaults (ModelInfo.beam_defaults)
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None  # true, false or "never" (transformers' three rules)
    # a translation model's languages as FLORES-200 codes (api/translation.py); absent: the deployment's
    src_lang: str | None = None
    tgt_lang: str | None = None
    session_id: str | None = Field(None, max_length=1024)  # the same as prompt_cache_key
    # Any other field of the contract's request not derived by the frontend (dry_multiplier,
    # thinking_budget, ...) may be sent by its contract name and is forwarded as is
    # (api/fields.py `forwardable`).

    @field_validator("prediction", mode="wrap")
    @classmethod
    def _prediction_is_named(cls, value, handler):
        """Any shape error inside it names `prediction` and says what it should be."""
        try:
            return handler(value)
        except ValueError as exc:
            problems = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors()[:1])
            raise ValueError(
                f"expected {{'type': 'content', 'content': a text or a list of text parts}} ({problems})"
            ) from None

    @field_validator("n", "stream", "echo", "max_tokens", "ignore_eos", mode="before", check_fields=False)
    @classmethod
    def _null_is_the_default(cls, value, info):
        """The spec allows null for these, meaning their default (n 1, stream false, echo
        false, completions' max_tokens 16)."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("early_stopping", mode="before")
    @classmethod
    def _early_stopping_rule(cls, value):
        if value is None or value is True or value is False or value == "never":
            return value
        raise ValueError(f'must be true, false or "never", got {value!r}')

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

    def session_name(self) -> str | None:
        """The conversation the client names (prompt_cache_key, else session_id), if any."""
        return self.prompt_cache_key or self.session_id

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

    def forced_tool_param(self) -> str | None:
        """The field that forces a tool call (chat's tool_choice "required" or a named
        function), if the body forces one; None otherwise."""
        return None

    def reasoning_effort_asked(self) -> str | None:
        """OpenAI's reasoning_effort (chat), when the body sets it."""
        return None

    def check_fields(self) -> None:
        """A 400 naming the first field the table refuses (api/fields.py): nothing is ignored."""
        refused = refusal(self.model_dump(exclude_unset=True, by_alias=True), self.FIELDS)
        if refused is not None:
            name, why = refused
            raise bad_request(name, f"{name}: {why}")

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
        if field in ("grammar_kind", "grammar_spec"):  # vLLM's structured outputs name their own field
            named = structured_param(self)
            if named is not None:
                return named
        return _PARAM_OF_FIELD.get(field, field)


# a field of the contract's request -> the body field a client sets it with
_PARAM_OF_FIELD = {
    "logit_bias_ids": "logit_bias",
    "logit_bias_values": "logit_bias",
    "grammar_kind": "response_format",
    "grammar_spec": "response_format",
    "tools_present": "tools",
    "prediction_tokens": "prediction",
    "require_tool_call": "tool_choice",
    "suppress_tool_call": "tool_choice",
    "enable_thinking": "chat_template_kwargs.enable_thinking",
    "loop_min_pattern_size": "repetition_detection.min_pattern_size",
    "loop_max_pattern_size": "repetition_detection.max_pattern_size",
    "loop_min_count": "repetition_detection.min_count",
    "timeout_s": "timeout",
    "num_return_sequences": "n",
    "src_lang_id": "src_lang",
    "tgt_lang_id": "tgt_lang",
}


# ---------------------------------------------------------------------------
# /v1/completions


class CompletionRequest(GenerationBody):
    FIELDS: ClassVar[dict[str, FieldRule]] = {**COMPLETIONS, **COMPLETION_EXTENSIONS}

    # a text, token ids, or a list of either: each prompt gets its own n choices, in order;
    # null or "": the start of a document (the spec's "<|endoftext|>")
    prompt: str | list[str] | list[int] | list[list[int]] | None
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = None  # OpenAI allows up to 5, we up to 20
    max_tokens: int | None = 16  # the spec's default, for null too; 0: the prompt alone (scoring, with echo)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts_are_not_empty_lists(cls, prompt):
        if isinstance(prompt, list) and (not prompt or any(isinstance(p, list) and not p for p in prompt)):
            raise ValueError("a list of prompts or of token ids must not be empty")
        return prompt

    @model_validator(mode="after")
    def _choices_fit(self):
        if len(self.prompts()) * self.n > MAX_PROMPT_CHOICES:
            raise ValueError(f"prompts times n must be at most {MAX_PROMPT_CHOICES}")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: text or token ids each."""
        prompt = self.prompt
        if prompt is None or isinstance(prompt, str):
            return [prompt or ""]
        if isinstance(prompt[0], str | list):
            return list(prompt)
        return [prompt]

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
