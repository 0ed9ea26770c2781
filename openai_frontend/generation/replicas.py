"""Several Triton instances of one model behind the frontend (`--dynamo-namespace`,
REPLICAS=N make serve): the engine door the handlers use, with TritonLLM's methods,
over one TritonLLM per instance.

- Membership: the instances registered in NVIDIA Dynamo's discovery
  (generation/dynamo_view.py), and of those the ones whose model answers ready; each is
  probed every PROBE_S, and one that fails a request is out for `down_s` at once.
- Routing: generation/routing.py, with Dynamo's KV-aware router saying where a prompt's
  blocks are cached.
- Failover: a request whose instance fails before its first output goes to another (up
  to one try per instance); after that it ends with the error (ModelUnavailable: a 503,
  or the stream's error event). Nothing hangs: a dead instance's gRPC stream breaks.
- Adapters: a load, unload or activate goes to every instance up; a list to one.
- /metrics: per-instance load and routing counts, the router's hit rate, and the
  engines' figures summed (`families`, `engine_figures`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from backend.contract import AdapterCommand, AdapterTable, GenerationRequest, ModelInfo, RequestOutput
from backend.contract.routing import routing_scope
from openai_frontend.generation.dynamo_view import DynamoView, WorkerInfo
from openai_frontend.generation.engine_client import ModelUnavailable, TritonLLM
from openai_frontend.generation.routing import (
    InstanceLoad,
    RoutedPrefixes,
    RoutingPolicy,
    Sessions,
    block_keys,
    choose,
    least_loaded,
)
from openai_frontend.operations.engine_metrics import read_engine
from openai_frontend.operations.prometheus import Counter, Family, Gauge

log = logging.getLogger(__name__)
PROBE_S = 0.5


class Instance:
    """One tritonserver: its client and what the policy knows of it."""

    def __init__(self, info: WorkerInfo):
        self.info = info
        self.llm = TritonLLM(info.triton_grpc_url)
        self.load = InstanceLoad(info.triton_grpc_url)
        self.down_until = 0.0

    def usable(self, now: float) -> bool:
        return self.load.up and now >= self.down_until


class Replicas:
    """The instances under `namespace`. `start` in the app's lifespan, `close` after."""

    def __init__(self, namespace: str, policy: RoutingPolicy | None = None, view: DynamoView | None = None):
        self.policy = policy or RoutingPolicy()
        self.view = view or DynamoView(namespace)
        self.instances: dict[str, Instance] = {}  # by gRPC address
        self.sessions = Sessions(self.policy.max_sessions)
        self.routed_prefixes = RoutedPrefixes(self.policy.pending_s, self.policy.max_pending_blocks)
        self.prompt_blocks = 0  # of requests routed in KV mode
        self.matched_blocks = 0  # of those, cached where they went (as the router knew it)
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        await self.view.start()
        await self._refresh()
        self._watch = asyncio.create_task(self._watch_members())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for instance in self.instances.values():
            await instance.llm.close()
        self.view.close()

    # -- membership and health ---------------------------------------------------

    async def _watch_members(self) -> None:
        while True:
            await asyncio.sleep(PROBE_S)
            try:
                await self._refresh()
            except Exception as exc:  # noqa: BLE001 - the watch outlives any one failure
                log.warning("refreshing the instances failed: %s", exc)

    async def _refresh(self) -> None:
        registered = {info.triton_grpc_url: info for info in (await self.view.refresh()).values()}
        for name in set(self.instances) - set(registered):
            self.instances[name].load.up = False  # kept (its counts stay on /metrics) until it is back
        for name, info in registered.items():
            if name not in self.instances:
                self.instances[name] = Instance(info)
        await asyncio.gather(*(self._probe(i, name in registered) for name, i in self.instances.items()))

    async def _probe(self, instance: Instance, registered: bool) -> None:
        up = registered and await instance.llm.is_ready(timeout_s=PROBE_S)
        if up != instance.load.up:
            log.warning("instance %s is %s", instance.load.name, "back in rotation" if up else "out of rotation")
        instance.load.up = up

    def _mark_down(self, instance: Instance, exc: Exception) -> None:
        log.warning("instance %s failed a request (%s): out for %.1f s", instance.load.name, exc, self.policy.down_s)
        instance.down_until = time.monotonic() + self.policy.down_s

    def _usable(self, excluded: set[str] = frozenset()) -> list[Instance]:
        now = time.monotonic()
        return [i for name, i in self.instances.items() if name not in excluded and i.usable(now)]

    async def is_ready(self, timeout_s: float = 2.0) -> bool:
        """Ready while at least one instance is."""
        return bool(self._usable())

    # -- the engine's methods ----------------------------------------------------

    async def model_info(self) -> ModelInfo:
        return await self._any().llm.model_info()

    async def adapters(self, command: AdapterCommand) -> AdapterTable:
        """A list asks one instance; a change goes to every instance up (the table: the first's)."""
        if command.op == "list":
            return await self._any().llm.adapters(command)
        tables = [await instance.llm.adapters(command) for instance in self._usable()]
        if not tables:
            raise self._none_up()
        return tables[0]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """The outputs of the request on the instance the policy picks; before any output,
        a failed instance's request is tried on another."""
        tried: set[str] = set()
        while True:
            instance, reason = await self._route(request, tried)
            started = False
            instance.load.routed[reason] += 1
            instance.load.in_flight += 1
            try:
                async with aclosing(instance.llm.generate(request)) as outputs:
                    async for output in outputs:
                        started = True
                        yield output
                return
            except ModelUnavailable as exc:
                self._mark_down(instance, exc)
                tried.add(instance.load.name)
                if started or not self._usable(tried):
                    raise
            finally:
                instance.load.in_flight -= 1

    async def _route(self, request: GenerationRequest, tried: set[str]) -> tuple[Instance, str]:
        candidates = self._usable(tried)
        if not candidates:
            raise self._none_up()
        loads = [c.load for c in candidates]
        if tried:  # a retry: the least loaded of the rest
            return self.instances[least_loaded(loads).name], "retry"
        session = self.sessions.get(request.session_hash) if request.session_hash else None
        prefix, keys = (None, 0, 0), []
        if self.policy.mode == "kv":
            scope = _scope(request)
            keys = block_keys(request.prompt_tokens, self.view.block_size, scope)
            prefix = await self._prefix(request.prompt_tokens, scope, keys, {load.name for load in loads})
        picked = choose(loads, self.policy, session=session, prefix=prefix)
        if request.session_hash:
            self.sessions.put(request.session_hash, picked.name)
        self.routed_prefixes.record(keys, picked.name, time.monotonic())
        self._count_match(picked.name, prefix)
        return self.instances[picked.name], picked.reason

    async def _prefix(
        self, tokens: list[int], scope: str | None, keys: list[int], names: set[str]
    ) -> tuple[str | None, int, int]:
        """(the candidate holding the longest prefix of the prompt, its blocks, the
        prompt's full blocks): from Dynamo's router, or from the blocks routed in the last
        `pending_s` when that prefix is longer (its KV events are not in yet)."""
        worker, matched, blocks = await self.view.best(tokens, scope)
        info = self.view.workers.get(worker) if worker is not None else None
        best = info.triton_grpc_url if info else None
        routed, routed_blocks = self.routed_prefixes.match(keys, time.monotonic())
        if routed in names and (routed_blocks > matched or best not in names):
            return routed, routed_blocks, blocks
        return best, matched, blocks

    def _count_match(self, name: str, prefix: tuple[str | None, int, int]) -> None:
        best, matched, blocks = prefix
        self.prompt_blocks += blocks
        self.matched_blocks += matched if best == name else 0

    def _any(self) -> Instance:
        usable = self._usable()
        if not usable:
            raise self._none_up()
        return usable[0]

    def _none_up(self) -> ModelUnavailable:
        return ModelUnavailable(f"no instance is up ({len(self.instances)} known, none ready)")

    # -- /metrics ------------------------------------------------------------------

    async def engine_figures(self) -> dict[str, float] | None:
        """The engines' figures, summed over the instances up (None: none answered)."""
        pages = await asyncio.gather(*(read_engine(i.info.triton_metrics_url) for i in self._usable()))
        answered = [page for page in pages if page is not None]
        if not answered:
            return None
        summed: dict[str, float] = {}
        for page in answered:
            for key, value in page.items():
                summed[key] = summed.get(key, 0.0) + value
        return summed

    def families(self) -> list[Family]:
        """Per instance: up, in flight, routed by reason; the router's prefix hit rate."""
        i = ("instance",)
        up = Gauge("llm_router_instance_up", "1 while the instance is in rotation.", i)
        in_flight = Gauge("llm_router_instance_in_flight", "Requests the frontend has in flight there.", i)
        routed = Counter("llm_router_requests_total", "Requests routed, by reason.", ("instance", "reason"))
        now = time.monotonic()
        for name, instance in sorted(self.instances.items()):
            up.set(1 if instance.usable(now) else 0, name)
            in_flight.set(instance.load.in_flight, name)
            for reason, count in sorted(instance.load.routed.items()):
                routed.inc(name, reason, amount=count)
        prompt = Counter("llm_router_prompt_blocks_total", "Full prompt blocks of requests routed by KV.")
        prompt.inc(amount=self.prompt_blocks)
        matched = Counter("llm_router_matched_blocks_total", "Of those, cached where the request went.")
        matched.inc(amount=self.matched_blocks)
        rate = Gauge("llm_router_kv_hit_rate", "matched / prompt blocks since start.")
        rate.set(self.matched_blocks / self.prompt_blocks if self.prompt_blocks else 0.0)
        return [up, in_flight, routed, prompt, matched, rate]


def _scope(request: GenerationRequest) -> str | None:
    """The request's prefix-cache scope, as the engine's KV events carry it. An adapter
    is named by its slot here; the engine names it by the adapter's name, so requests on
    an adapter find no prefix in the router (they are routed by load)."""
    adapter = "" if request.adapter_slot == 0 else f"slot:{request.adapter_slot}"
    return routing_scope(request.lookup_tenant, request.cache_salt, adapter)
