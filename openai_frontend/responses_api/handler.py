"""POST /v1/responses over the chat pipeline (api/chat.py's pieces: the template, the
tools, the reasoning split, the engine's streams), whole or streamed, and stored."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from openai_frontend.api import chat as chat_api
from openai_frontend.api.errors import OpenAIError, bad_request
from openai_frontend.api.serving import FINISH_GUARD_HEADER, Serving
from openai_frontend.generation.choices import collect_all, heads, interleave
from openai_frontend.operations.auth import OPEN_TENANT
from openai_frontend.operations.limits import ticket_of
from openai_frontend.parsing.chat_reasoning import ChatReasoning
from openai_frontend.parsing.chat_tools import ChatTools
from openai_frontend.responses_api import items as items_of
from openai_frontend.responses_api import output
from openai_frontend.responses_api.convert import ResponsesChat, chat_body, renamed
from openai_frontend.responses_api.protocol import ResponsesRequest
from openai_frontend.responses_api.store import ResponseStore, Stored
from openai_frontend.responses_api.stream import ResponseEvents, response_events


def tenant_of(request: Request) -> str:
    """The tenant the gate found for the request's API key (the open tenant without keys)."""
    return getattr(request.state, "tenant", OPEN_TENANT)


@dataclass(slots=True)
class Prepared:
    """A request made ready: its conversation (input items), its chat body and pieces."""

    conversation: list[dict[str, Any]]
    chat: ResponsesChat
    messages: list[dict[str, Any]]  # as the template sees them
    tools: ChatTools | None


def prepare(serving: Serving, store: ResponseStore, body: ResponsesRequest, tenant: str) -> Prepared:
    """The conversation (a previous response's, then this input) as the chat body."""
    conversation = []
    if body.previous_response_id is not None:
        earlier = store.get(tenant, body.previous_response_id, "previous_response_id")
        answered = [items_of.output_as_input(item) for item in earlier.response["output"]]
        conversation = earlier.inputs + [item for item in answered if item is not None]
    conversation += items_of.normalized(body.input)
    try:
        chat = chat_body(body, items_of.chat_messages(body.instructions, conversation))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise renamed(bad_request(where, f"{where}: {first['msg']}")) from None
    tools = ChatTools.of(serving.tool_parser, chat)
    return Prepared(conversation, chat, [m.template_dict() for m in chat.messages], tools)


async def create(serving: Serving, store: ResponseStore, body: ResponsesRequest, request: Request) -> Response:
    tenant = tenant_of(request)
    try:
        return await _create(serving, store, body, request, tenant)
    except OpenAIError as error:
        raise renamed(error) from None


async def _create(
    serving: Serving, store: ResponseStore, body: ResponsesRequest, request: Request, tenant: str
) -> Response:
    await serving.model_info()  # the tool parser is known once the model's facts are
    ready = prepare(serving, store, body, tenant)
    chat = ready.chat
    reply = await serving.start(chat, "responses", "resp")
    reply.id = "resp_" + reply.id.removeprefix("resp-")
    ticket = ticket_of(request)
    generation = await chat_api.chat_request(serving, chat, ready.messages, ready.tools, reply, ticket.tenant)
    streams = serving.generate(chat, [generation], "responses", ticket, reply.dump)
    reasoning = ChatReasoning.of(reply.info)
    started = output.head(body, reply.id, reply.created, reply.model)

    def keep(response: dict[str, Any]) -> None:
        if body.stores:
            store.put(tenant, Stored(response, ready.conversation))

    if body.stream:
        return await _streamed(
            serving, chat, chat_api.parsed_stream(streams[0], reasoning, ready.tools), started, request, keep
        )
    whole = (await serving.until_done(chat, collect_all(streams), request))[0]
    thinking, answer = reasoning.split(whole) if reasoning is not None else (None, whole.text)
    calls: list[dict[str, Any]] = []
    if ready.tools is not None:
        answer, calls = ready.tools.parse(answer)
        ready.tools.settle(whole.final, bool(calls))
    response = output.finished(started, whole.final, output.output_items(thinking, answer, calls))
    keep(response)
    headers = {FINISH_GUARD_HEADER: whole.final.finish_guard.value}
    return Response(json.dumps(response, ensure_ascii=False), media_type="application/json", headers=headers)


async def _streamed(
    serving: Serving, chat: ResponsesChat, deltas, started: dict[str, Any], request: Request, keep
) -> Response:
    """The event stream; its first delta comes before it begins, so a refused request still gets its status."""
    merged = interleave([deltas])
    first = await serving.until_done(chat, heads(merged, 1), request)

    def to_error(exc: Exception) -> OpenAIError:
        error = renamed(serving.error(chat, exc))
        serving.metrics.errors[error.status] += 1
        return error

    events = response_events(ResponseEvents(started), first, merged, to_error, keep)
    return StreamingResponse(events, media_type="text/event-stream")


async def input_tokens(
    serving: Serving, store: ResponseStore, body: ResponsesRequest, request: Request
) -> dict[str, Any]:
    """The prompt's token count, as a request with this body would be prompted."""
    try:
        info = await serving.model_info()
        ready = prepare(serving, store, body, tenant_of(request))
        prompt = await chat_api.chat_prompt(serving.tokenization, ready.chat, ready.messages, ready.tools, info)
    except OpenAIError as error:
        raise renamed(error) from None
    return {"object": "response.input_tokens", "input_tokens": len(prompt)}
