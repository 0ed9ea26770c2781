"""What the endpoint handlers share: the model's facts and adapters, the generations of a
request, the response (whole or streamed), and how failures become OpenAI errors."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from backend.contract import AdapterInfo, FinalEvent, GenerationRequest, ModelInfo
from openai_frontend.api.errors import NOT_FOUND, OpenAIError, bad_request, internal_error, model_not_found
from openai_frontend.api.protocol import GenerationBody
from openai_frontend.api.request_builder import for_choice
from openai_frontend.api.responses import ModelCard, ModelList
from openai_frontend.api.sse import ChunkFormat, keep_alive, sse_events
from openai_frontend.api.translation import translates
from openai_frontend.generation.adapters import Adapters
from openai_frontend.generation.beams import BeamSearchRun
from openai_frontend.generation.choices import after, heads, interleave
from openai_frontend.generation.deltas import Delta, generate_text
from openai_frontend.generation.detokenizer import IncrementalDetokenizer
from openai_frontend.generation.engine_client import EngineError, TritonLLM
from openai_frontend.generation.tokenization import Tokenization
from openai_frontend.media.images import Qwen2VLImages
from openai_frontend.media.settings import MediaSettings
from openai_frontend.operations.dump import RequestDump
from openai_frontend.operations.limits import Ticket
from openai_frontend.operations.metrics import Metrics
from openai_frontend.parsing.tools import ToolParser, get_tool_parser

T = TypeVar("T")
log = logging.getLogger(__name__)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it
KEEPALIVE_S = 5.0  # a silent stream's keep-alive interval (SSE_KEEPALIVE_S)
FINISH_GUARD_HEADER = "x-finish-guard"
THINKING_GUARD_HEADER = "x-thinking-guard"


class ClientGone(Exception):
    pass


@dataclass(slots=True)
class Reply:
    """What a response is given at its start: its id, its `created` (the request's
    arrival, as OpenAI stamps it), the model's facts, its --dump record, the model name
    it echoes (the base model's or an adapter's) and the adapter slot that name picked."""

    id: str
    created: int
    info: ModelInfo
    dump: RequestDump | None
    model: str
    adapter_slot: int


class Serving:
    """The tokenizer, the engine client, the running model's facts, its adapters and the counters."""

    def __init__(self, tokenization: Tokenization, served_model_name: str, dump_dir: Path | None = None):
        self.tokenization = tokenization
        self.model_name = served_model_name
        self.engine: TritonLLM | None = None  # set in the app's lifespan
        self.dump_dir = dump_dir  # --dump: one JSON file per request
        self.metrics = Metrics(served_model_name)
        self.created = int(time.time())
        self.info: ModelInfo | None = None  # the running model's facts, once asked
        self.tool_parser: ToolParser | None = None  # the model's tool-call format
        self.adapters = Adapters(served_model_name)  # the engine's LoRA adapters, as last heard
        self.keepalive_s = KEEPALIVE_S  # a beam search's stream sends a comment this often until it ends
        self.media = MediaSettings()  # what chat requests may bring as images and videos (Settings.media)
        self._images: Qwen2VLImages | None = None

    @property
    def images(self) -> Qwen2VLImages:
        """The model folder's image processor settings (preprocessor_config.json), read once."""
        if self._images is None:
            self._images = Qwen2VLImages.from_folder(self.tokenization.model_path)
        return self._images

    async def model_info(self) -> ModelInfo:
        """The running model's facts, asked of it once (ModelUnavailable while it is down)."""
        if self.info is None:
            info = await self.engine.model_info()
            self.tool_parser = get_tool_parser(info.tool_parser, (info.tool_call_start, info.tool_call_end))
            self.metrics.describe(info.max_model_len)
            self.info = info
        return self.info

    async def models(self) -> ModelList:
        """The base model's card, then one per adapter (vLLM's: `parent` the base model)."""
        adapters = await self.adapters.listed(self.engine)
        return ModelList(data=[self._card(), *(self._card(a) for a in adapters)])

    async def model_card(self, model: str) -> ModelCard:
        """The card of the base model or of an adapter; a 404 model_not_found otherwise."""
        if model == self.model_name:
            return self._card()
        adapter = await self.adapters.find(self.engine, model)
        if adapter is None:
            raise model_not_found(model)
        return self._card(adapter)

    def _card(self, adapter: AdapterInfo | None = None) -> ModelCard:
        """The base model's card, or an adapter's. `root` is a name, never a folder: every
        tenant reads this list, and the server's filesystem is not theirs to see."""
        max_model_len = self.info.max_model_len if self.info is not None else None
        card = ModelCard(id=self.model_name, created=self.created, root=self.model_name, max_model_len=max_model_len)
        if adapter is None:
            return card
        return card.model_copy(update={"id": adapter.name, "root": adapter.name, "parent": self.model_name})

    async def start(self, body: GenerationBody, endpoint: str, id_prefix: str) -> Reply:
        """A request's response begins: its model (or adapter) chosen, the model's facts at hand."""
        created = int(time.time())
        choice = await self.adapters.choose(self.engine, body.model, (body.model_extra or {}).get("adapter_slot"))
        info = await self.model_info()
        reply_id = f"{id_prefix}-{uuid.uuid4().hex}"
        dump = None
        if self.dump_dir is not None:
            dump = RequestDump(
                self.dump_dir, reply_id, endpoint, body.model_dump(mode="json", exclude_unset=True, by_alias=True)
            )
        return Reply(reply_id, created, info, dump, choice.model, choice.adapter_slot)

    def generate(
        self,
        body: GenerationBody,
        requests: list[GenerationRequest],
        endpoint: str,
        ticket: Ticket,
        dump: RequestDump | None,
    ) -> list[AsyncIterator[Delta]]:
        """One delta stream per choice: n model requests per prompt, prompt-major (choice
        index = prompt index * n + i; the model's prefix cache shares each prompt's KV
        blocks between its n). `ticket`: the tenant it runs as and its token budget,
        charged here for every prompt's choices together."""
        self.metrics.received(endpoint, ticket.tenant)
        prompt_tokens = new_tokens = 0
        for request in requests:
            prompt = len(request.prompt_tokens)
            # a translation's context is its decoder's (from one start token); the engine bounds its source
            room = body.check_context(1 if self.info.languages else prompt, self.info.max_model_len)
            asked = request.sampling.max_tokens
            prompt_tokens += prompt
            new_tokens += body.n * (room if asked is None else asked)
        ticket.reserve(prompt_tokens, new_tokens, len(requests) * body.n)
        streams = []
        for request in requests:
            lora = self.adapters.name_of(request.adapter_slot)
            for text in self._texts(body, request, dump):
                streams.append(ticket.metered(self._observed(text, len(streams), dump, ticket.tenant, lora)))
        return streams

    def _texts(
        self, body: GenerationBody, request: GenerationRequest, dump: RequestDump | None
    ) -> list[AsyncIterator[Delta]]:
        """A prompt's n choices: n generations, or one beam search's n best hypotheses."""
        detokenizer = partial(self._detokenizer, request)
        if request.num_beams > 1:
            if dump is not None:
                dump.tensors(request)
            return BeamSearchRun(self.engine, request, detokenizer).choices()
        texts = []
        for index in range(body.n):
            choice = for_choice(request, index)
            if dump is not None:
                dump.tensors(choice)
            texts.append(generate_text(self.engine, choice, detokenizer(), body.stop_strings()))
        return texts

    def _detokenizer(self, request: GenerationRequest) -> IncrementalDetokenizer:
        """A generation's detokenizer: its text continues the prompt's, unless it is a
        translation (a text of its own, in another language)."""
        return self.tokenization.detokenizer([] if translates(self.info) else request.prompt_tokens)

    async def stream(
        self,
        body: GenerationBody,
        streams: list[AsyncIterator[Delta]],
        fmt: ChunkFormat,
        request: Request,
        dump: RequestDump | None,
        *,
        searching: bool = False,
    ) -> Response:
        """The SSE response. Every choice's first delta comes before it begins, so that a
        refused request still gets its HTTP status; a beam search (`searching`), which
        sends nothing until it ends, waits one keep-alive interval for them at most, then
        begins, with keep-alive comments until they come."""
        deltas = interleave(streams)
        if searching:
            first, deltas = await self._heads_soon(body, deltas, len(streams), request)
        else:
            first = await self.until_done(body, heads(deltas, len(streams)), request)

        def to_error(exc: Exception) -> OpenAIError:
            error = self.error(body, exc)
            self.metrics.errors[error.status] += 1
            return error

        events = sse_events(first, deltas, len(streams), fmt, to_error)
        if dump is not None:
            events = dump.recorded(events)
        if searching:
            events = keep_alive(events, self.keepalive_s)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _heads_soon(
        self, body: GenerationBody, deltas: AsyncIterator[tuple[int, Delta]], n: int, request: Request
    ) -> tuple[list[tuple[int, Delta]], AsyncIterator[tuple[int, Delta]]]:
        """(the choices' first deltas, the rest) if they come within one keep-alive
        interval (a refusal does); else (none, the rest with them first)."""
        first = asyncio.ensure_future(heads(deltas, n))
        try:
            await self.until_done(body, asyncio.wait({first}, timeout=self.keepalive_s), request)
        except BaseException:
            first.cancel()
            raise
        if first.done():
            return await self.until_done(body, first, request), deltas
        return [], after(first, deltas)

    async def until_done(self, body: GenerationBody, work: Awaitable[T], request: Request) -> T:
        try:
            return await _unless_disconnected(request, work)
        except ClientGone:
            raise OpenAIError(CLIENT_CLOSED_REQUEST, "the client closed the connection") from None
        except Exception as exc:
            raise self.error(body, exc) from exc

    def error(self, body: GenerationBody, exc: Exception) -> OpenAIError:
        if isinstance(exc, OpenAIError):
            return exc
        if isinstance(exc, EngineError) and exc.not_found:
            return self._adapter_gone(body, exc)
        if isinstance(exc, EngineError) and exc.field is not None:
            param = body.param_of(exc.field)
            return bad_request(param, exc.message)
        return internal_error(exc, "generation failed")

    def _adapter_gone(self, body: GenerationBody, exc: EngineError) -> OpenAIError:
        """The engine has no adapter in the request's slot (unloaded since it was chosen):
        the 404 of the `model` that named it, or of the adapter_slot the body sent. The
        copy of the table that listed it is dropped."""
        self.adapters.forget()
        if body.model not in (None, self.model_name):
            return model_not_found(body.model)
        param = body.param_of(exc.field or "adapter_slot")
        return OpenAIError(404, f"{param}: {exc.message}", param, NOT_FOUND, "model_not_found")

    async def _observed(
        self, deltas: AsyncIterator[Delta], index: int, dump: RequestDump | None, tenant: str, lora: str
    ) -> AsyncIterator[Delta]:
        """Counts a generation: running, tokens, latencies, and how it ended ("abort":
        client left), also per adapter (`lora`, "" for the base model). Its end-to-end
        latency runs from here: the first pull starts its model request."""
        metrics = self.metrics
        metrics.running += 1
        started = time.monotonic()
        ended = False
        try:
            async with aclosing(deltas):
                async for delta in deltas:
                    if delta.final is not None:
                        ended = True
                        metrics.finished(delta.final, time.monotonic() - started, tenant, lora)
                        if dump is not None:
                            dump.final(index, delta.final)
                    yield delta
        except (GeneratorExit, asyncio.CancelledError):
            if not ended:
                metrics.aborted(lora)
            raise
        finally:
            metrics.running -= 1


def json_response(model, finals: list[FinalEvent], dump: RequestDump | None = None) -> Response:
    """The response; its headers name the guard that ended each choice (and the one that
    ended its thinking, if one did), comma-separated in choice order."""
    body = model.model_dump_json()
    if dump is not None:
        dump.response(json.loads(body))
    headers = {FINISH_GUARD_HEADER: ",".join(final.finish_guard.value for final in finals)}
    if any(final.thinking_guard for final in finals):
        guards = [final.thinking_guard.value if final.thinking_guard else "" for final in finals]
        headers[THINKING_GUARD_HEADER] = ",".join(guards)
    return Response(body, media_type="application/json", headers=headers)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it (and so its Triton request) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
