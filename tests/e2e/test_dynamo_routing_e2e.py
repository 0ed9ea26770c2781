"""The engine's KV events reach NVIDIA Dynamo's KV-aware router: two tritonserver
instances, each with its Dynamo worker shim, nats-server (JetStream) and file discovery
on loopback; the test process holds a real `dynamo.llm.KvRouter` and asks it where
prompts are cached. Prompts are token ids (/v1/completions), so the router is asked about
exactly the tokens the engines computed."""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from backend.contract.routing import routing_scope
from launcher import Stack, TritonServer
from launcher.dynamo_worker import dynamo_env
from launcher.replicas import DynamoWorker, NatsServer, kv_events_endpoint
from openai_frontend.generation.dynamo_view import ENDPOINT

pytestmark = pytest.mark.e2e

KV_CACHE_MB = 4  # instance 0: 11 blocks of 16 tokens (float16, the default), so a few prompts evict the first
PROMPT_BLOCKS = 5


@pytest.fixture(scope="module")
def cluster(model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("dynamo")
    nats = NatsServer(root / "nats").start()
    env = dynamo_env(nats.url, str(root / "discovery"))
    servers = [
        TritonServer(model_path, env={"KV_EVENTS_ENDPOINT": kv_events_endpoint(), "KV_CACHE_MB": str(mb)})
        for mb in (KV_CACHE_MB, 256)
    ]
    started: list = [nats]
    try:
        for server in servers:
            started.append(server.start())
            started.append(DynamoWorker(server, nats.url, root / "discovery", model_path.name).start())
        stacks = [Stack(model_path, triton=server).start() for server in servers]
        started.extend(stacks)
        yield env, servers, stacks
    finally:
        for process in reversed(started):
            process.stop()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_BLOCKS * 16 + 3)]


def _compute(stack: Stack, prompt: list[int]) -> None:
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=120)
    client.completions.create(model=stack.served_model_name, prompt=prompt, max_tokens=1)


async def _router_session(env, servers, stacks):
    from dynamo.llm import KvRouter, KvRouterConfig
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", True)
    try:
        endpoint = runtime.endpoint(f"tritonllm.{ENDPOINT}")
        client = await endpoint.client()
        workers = await _workers(client, len(servers))
        by_url = {info["triton_grpc_url"]: worker for worker, info in workers.items()}
        ids = [by_url[server.grpc_url] for server in servers]
        router = KvRouter(endpoint, 16, KvRouterConfig())
        a, b = _prompt(1), _prompt(2)
        await asyncio.to_thread(_compute, stacks[0], a)
        await asyncio.to_thread(_compute, stacks[1], b)
        assert await _until(router, a, ids[0], lambda overlap: overlap == PROMPT_BLOCKS)
        assert await _until(router, b, ids[1], lambda overlap: overlap == PROMPT_BLOCKS)
        # another tenant's query finds nothing: the scope is hashed into the router's blocks
        _, _, foreign = await router.best_worker(a, lora_name=routing_scope("alice"))
        assert foreign == 0
        # instance 0's small pool: three more prompts evict a's blocks, and the router hears it
        for seed in (3, 4, 5):
            await asyncio.to_thread(_compute, stacks[0], _prompt(seed))
        assert await _until(router, a, None, lambda overlap: overlap == 0)
    finally:
        runtime.shutdown()


async def _workers(client, count: int, timeout_s: float = 120) -> dict[int, dict]:
    """Each registered worker's answer (WorkerInfo), once `count` have registered."""
    deadline = time.monotonic() + timeout_s
    while len(client.instance_ids()) < count:
        assert time.monotonic() < deadline, f"{len(client.instance_ids())} of {count} workers registered"
        await asyncio.sleep(0.2)
    answers = {}
    for worker in client.instance_ids():
        async for answer in await client.direct({}, worker):
            answers[worker] = answer.data()
    return answers


async def _until(router, prompt, worker, holds, timeout_s: float = 15) -> bool:
    """Poll best_worker until its overlap `holds` (and, if given, it picks `worker`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        chosen, _, overlap = await router.best_worker(prompt)
        if holds(overlap) and (worker is None or chosen == worker):
            return True
        await asyncio.sleep(0.1)
    raise AssertionError(f"best_worker gave ({chosen}, {overlap}) after {timeout_s} s")


def test_the_router_finds_each_prompt_where_it_was_computed(cluster, monkeypatch):
    env, servers, stacks = cluster
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    asyncio.run(_router_session(env, servers, stacks))
