"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat
endpoint's pipeline (the body becomes a chat body: anthropic/convert.py; then the chat
handler's prompt, tools, reasoning and request, Serving's generation and streaming)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from openai_frontend.anthropic import responses
from openai_frontend.anthropic.convert import chat_body
from openai_frontend.anthropic.errors import AnthropicError, anthropic_error, from_validation
from openai_frontend.anthropic.protocol import CountTokensRequest, MessagesRequest
from openai_frontend.anthropic.stream import message_events
from openai_frontend.api import chat as chat_handler
from openai_frontend.api.chat_protocol import ChatCompletionRequest
from openai_frontend.api.errors import bad_request
from openai_frontend.api.serving import FINISH_GUARD_HEADER, Serving
from openai_frontend.generation.choices import collect_all
from openai_frontend.generation.deltas import Delta
from openai_frontend.media.parts import expand_placeholders
from openai_frontend.operations.dump import RequestDump
from openai_frontend.operations.limits import ticket_of
from openai_frontend.parsing.chat_reasoning import ChatReasoning
from openai_frontend.parsing.chat_tools import ChatTools

B = TypeVar("B", bound=BaseModel)
router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    body = await _body(request, MessagesRequest)
    serving: Serving = request.app.state.serving
    chat = await _chat(serving, body, request)
    return await _generate(serving, body, chat, request)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    """The prompt's tokens, as a message request with the same body would send them."""
    body = await _body(request, CountTokensRequest)
    serving: Serving = request.app.state.serving
    chat = await _chat(serving, body, request)
    await serving.adapters.choose(serving.engine, chat.model, None)  # an unknown model is a 404
    info = serving.info
    messages = [m.template_dict() for m in chat.messages]
    tools = ChatTools.of(serving.tool_parser, chat)
    prompt = await chat_handler.chat_prompt(serving.tokenization, chat, messages, tools, info)
    if info.vision is not None:
        prompt = expand_placeholders(prompt, await chat_handler.chat_vision(serving, chat, info), info.vision)
    return JSONResponse({"input_tokens": len(prompt)})


async def _body(request: Request, model: type[B]) -> B:
    """The body, parsed and validated: a 400 naming what is wrong (every unknown field)."""
    try:
        raw = json.loads(await request.body())
    except ValueError as exc:
        raise bad_request(None, f"the body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise bad_request(None, "the body must be a JSON object")
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise from_validation(exc) from None


async def _chat(serving: Serving, body: CountTokensRequest, request: Request) -> ChatCompletionRequest:
    """The chat body of the request, its fields and sizes checked as the chat endpoint checks them."""
    info = await serving.model_info()
    try:
        chat = chat_body(body, bool(info.think_start))
    except ValidationError as exc:
        raise from_validation(exc) from None
    chat.check_fields()
    return chat


async def _generate(serving: Serving, body: MessagesRequest, chat: ChatCompletionRequest, request: Request) -> Response:
    reply = await serving.start(chat, "messages", "msg")
    reply.id = responses.message_id()
    vision = await chat_handler.chat_vision(serving, chat, reply.info)
    messages = [m.template_dict() for m in chat.messages]
    tools = ChatTools.of(serving.tool_parser, chat)
    ticket = ticket_of(request)
    generation = await chat_handler.chat_request(serving, chat, messages, tools, reply, ticket.tenant, vision)
    (stream,) = serving.generate(chat, [generation], "messages", ticket, reply.dump)
    reasoning = ChatReasoning.of(reply.info)
    if body.stream:
        start = _start(reply.id, reply.model, len(generation.prompt_tokens))
        parsed = chat_handler.parsed_stream(stream, reasoning, tools)
        return await _streamed(serving, chat, parsed, start, request, reply.dump)
    (whole,) = await serving.until_done(chat, collect_all([stream]), request)
    thinking, answer = reasoning.split(whole) if reasoning is not None else (None, whole.text)
    calls: list[dict[str, Any]] = []
    if tools is not None:
        answer, calls = tools.parse(answer)
        tools.settle(whole.final, bool(calls))
    content = responses.blocks(thinking, answer, calls)
    payload = responses.message(reply.id, reply.model, content, whole.final, whole.stop_string)
    if reply.dump is not None:
        reply.dump.response(payload)
    return JSONResponse(payload, headers={FINISH_GUARD_HEADER: whole.final.finish_guard.value})


def _start(reply_id: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    """The message_start event's message: no content yet, the prompt's tokens (the cached
    part is known at the end: message_delta's usage)."""
    usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
    usage.update(cache_read_input_tokens=0, cache_creation_input_tokens=0)
    return {"id": reply_id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": None, "stop_sequence": None, "usage": usage}  # fmt: skip


async def _streamed(
    serving: Serving,
    chat: ChatCompletionRequest,
    deltas: AsyncIterator[Delta],
    start: dict[str, Any],
    request: Request,
    dump: RequestDump | None,
) -> Response:
    """The SSE response; its first delta comes before it begins, so that a refused
    request still gets its HTTP status."""
    try:
        first = await serving.until_done(chat, anext(deltas), request)
    except BaseException:
        await deltas.aclose()
        raise

    def to_error(exc: Exception) -> AnthropicError:
        error = anthropic_error(serving.error(chat, exc))
        serving.metrics.errors[error.status] += 1
        return error

    events = message_events(start, first, deltas, to_error)
    if dump is not None:
        events = dump.recorded(events)
    return StreamingResponse(events, media_type="text/event-stream")
