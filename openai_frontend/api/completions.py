"""POST /v1/completions: a prompt (text or token ids) -> one response or a stream; `echo`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import Request, Response

from backend.contract import ModelInfo
from openai_frontend.api.logprobs import CompletionLogprobs
from openai_frontend.api.protocol import CompletionRequest
from openai_frontend.api.request_builder import build_request, returns_token_ids, validated
from openai_frontend.api.responses import CompletionChoice, CompletionResponse, guard_fields, usage_of
from openai_frontend.api.serving import Serving, json_response
from openai_frontend.api.sse import CompletionChunkFormat
from openai_frontend.api.translation import translates
from openai_frontend.generation.choices import collect_all
from openai_frontend.generation.deltas import Delta
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.operations.limits import ticket_of


async def complete(serving: Serving, body: CompletionRequest, request: Request) -> Response:
    reply = await serving.start(body, "completions", "cmpl")
    info, dump = reply.info, reply.dump
    tokenization = serving.tokenization
    prompts = [await _encoded(tokenization, prompt, info) for prompt in body.prompts()]
    ticket = ticket_of(request)
    stream = body.stream or bool(body.stop_strings())  # stop strings: the model streams, we cancel it early
    prediction = await tokenization.encode_text(body.prediction.text()) if body.prediction else []
    presets = info.sampling_defaults if info.languages else None  # a translation takes the model's presets
    options = dict(tenant=ticket.tenant, stream=stream, prediction=prediction, adapter_slot=reply.adapter_slot)
    built = [build_request(body, p, info, presets=presets, **options) for p in prompts]
    requests = [validated(body, generation, info) for generation in built]
    streams = serving.generate(body, requests, "completions", ticket, dump)
    if body.echo:
        streams = await _echoed(streams, body, tokenization, prompts)
    # one per choice: text offsets run on within a choice
    formatters = [CompletionLogprobs(tokenization.token_text) for _ in streams]

    def logprobs(index: int, delta: Delta) -> dict[str, Any] | None:
        wanted = body.logprobs is not None and delta.logprobs is not None
        return formatters[index].format(delta.logprobs, delta.text_offsets) if wanted else None

    if body.stream:
        fmt = CompletionChunkFormat(reply.id, reply.created, reply.model, body.include_usage(), logprobs, body.n)
        if returns_token_ids(body):
            fmt.prompt_token_ids = [list(generation.prompt_tokens) for generation in requests]
        return await serving.stream(body, streams, fmt, request, dump, searching=requests[0].num_beams > 1)
    wholes = await serving.until_done(body, collect_all(streams), request)
    choices = [_choice(i, whole, logprobs(i, whole)) for i, whole in enumerate(wholes)]
    finals = [whole.final for whole in wholes]
    if returns_token_ids(body):  # vLLM's shape: each choice its prompt's tokens and its own
        for i, (choice, whole) in enumerate(zip(choices, wholes, strict=True)):
            choice.prompt_token_ids, choice.token_ids = list(requests[i // body.n].prompt_tokens), whole.token_ids
    response = CompletionResponse(
        id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=usage_of(finals, body.n)
    )
    return json_response(response, finals, dump)


async def _encoded(tokenization: Tokenization, prompt: str | list[int], info: ModelInfo) -> list[int]:
    """A prompt's tokens; a translation model's source text has no special tokens (the
    engine adds its language code and </s>)."""
    if translates(info) and isinstance(prompt, str):
        return await tokenization.encode_text(prompt)
    return await tokenization.encode_prompt(prompt)


async def _echoed(
    streams: list[AsyncIterator[Delta]], body: CompletionRequest, tokenization: Tokenization, prompts: list[list[int]]
) -> list[AsyncIterator[Delta]]:
    """Each choice's stream behind its own prompt's text (choices are prompt-major)."""
    texts = [await tokenization.off_loop(tokenization.prompt_text, prompt) for prompt in body.prompts()]
    offsets = [await tokenization.off_loop(tokenization.text_offsets, prompt) for prompt in prompts]
    return [_echo(stream, texts[i // body.n], offsets[i // body.n]) for i, stream in enumerate(streams)]


def _choice(index: int, whole: Delta, logprobs: dict[str, Any] | None) -> CompletionChoice:
    final = whole.final
    return CompletionChoice(
        index=index, text=whole.text, logprobs=logprobs, finish_reason=final.finish_reason.value, **guard_fields(final)
    )


async def _echo(deltas: AsyncIterator[Delta], prompt_text: str, prompt_offsets: list[int]) -> AsyncIterator[Delta]:
    """Completions `echo`: the prompt's text (and its logprobs, when asked) come first;
    the generated tokens' text offsets move past the prompt's text."""
    first = True
    async with aclosing(deltas):
        async for delta in deltas:
            if delta.text_offsets is not None:
                delta.text_offsets = [offset + len(prompt_text) for offset in delta.text_offsets]
            if first:
                first = False
                delta.text = prompt_text + delta.text
                if delta.prompt_logprobs is not None:
                    delta.logprobs = delta.prompt_logprobs + (delta.logprobs or [])
                    delta.text_offsets = prompt_offsets[: len(delta.prompt_logprobs)] + (delta.text_offsets or [])
            yield delta
