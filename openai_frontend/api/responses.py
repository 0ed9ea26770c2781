"""OpenAI response shapes (the order of the OpenAI API reference), and usage from final events."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from backend.contract import FinalEvent


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0  # Predicted Outputs: the prediction's tokens the output matched
    rejected_prediction_tokens: int = 0  # and those it did not (billed as completion tokens all the same)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None  # the spec requires it; this server never refuses in words
    # a reasoning model's thinking (vLLM's field name); left out for models that do not reason
    reasoning_content: str | None = Field(None, exclude_if=lambda text: text is None)
    # left out of the JSON when there are none, as OpenAI does
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, exclude_if=lambda calls: not calls)
    # the older form's call (a request with `functions`); left out otherwise
    function_call: dict[str, Any] | None = Field(None, exclude_if=lambda call: call is None)


def _guard() -> Any:
    """An extension field naming the guard that ended a choice; left out when none did."""
    return Field(None, exclude_if=lambda guard: not guard)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str
    finish_guard: str | None = _guard()  # eos, max_tokens, stop_string, content_loop, deadline, ...
    thinking_guard: str | None = _guard()  # thinking_budget, thinking_loop
    # vLLM's return_token_ids: the completion's tokens
    token_ids: list[int] | None = Field(None, exclude_if=lambda ids: ids is None)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda ids: ids is None)  # vLLM's return_token_ids


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    finish_guard: str | None = _guard()
    thinking_guard: str | None = _guard()
    # vLLM's return_token_ids: this choice's prompt, and its completion's tokens
    prompt_token_ids: list[int] | None = Field(None, exclude_if=lambda ids: ids is None)
    token_ids: list[int] | None = Field(None, exclude_if=lambda ids: ids is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llm-serving"
    root: str | None = None  # vLLM's: the base model's, or the adapter's (a name here: never a folder)
    parent: str | None = None  # vLLM's: a LoRA adapter's base model; null for the base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def usage_of(finals: list[FinalEvent], choices_per_prompt: int = 1) -> Usage:
    """The usage of a request's choices, `choices_per_prompt` (n) per prompt, prompt-major:
    each prompt counts once, completions add up.

    cached_tokens is each prompt's first choice's: a prompt is reported once, and the
    other choices' hits are mostly on blocks this same request computed moments before.
    """
    heads = finals[::choices_per_prompt]
    prompt = sum(f.num_prompt_tokens for f in heads)
    completion = sum(f.num_output_tokens for f in finals)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(f.num_cached_tokens for f in heads)),
        completion_tokens_details=CompletionTokensDetails(
            reasoning_tokens=sum(f.num_reasoning_tokens for f in finals),
            accepted_prediction_tokens=sum(f.num_accepted_prediction_tokens for f in finals),
            rejected_prediction_tokens=sum(f.num_rejected_prediction_tokens for f in finals),
        ),
    )


def guard_fields(final: FinalEvent) -> dict[str, str]:
    """The guards that ended a choice, as its extension fields (on a stream's finish
    chunk, or on a whole response's choice, whose headers also carry them)."""
    fields = {"finish_guard": final.finish_guard.value}
    if final.thinking_guard is not None:
        fields["thinking_guard"] = final.thinking_guard.value
    return fields
