"""What the frontend learns from NVIDIA Dynamo: which Triton instances are registered
(launcher/dynamo_worker.py registers each one, and takes it out while its model is not
ready), and, from Dynamo's KV-aware router, which of them holds most of a prompt.

Dynamo's router keeps one radix tree of every instance's cached blocks, fed by the
engines' KV events (backend/serving/kv_events.py); `best_worker` asked without a request
id is a query: it changes no state in the router. The frontend counts the load itself
(generation/routing.py), so Dynamo's load tracking is not used.

Dynamo's settings are launcher.dynamo_worker.dynamo_env's: DYN_DISCOVERY_BACKEND (file,
etcd or kubernetes) and DYN_REQUEST_PLANE come in the frontend's settings (DynamoSettings,
read by openai_frontend/settings.py); the others (NATS_SERVER, DYN_FILE_KV, ...) Dynamo's
runtime reads from the process's environment itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)
ENDPOINT = "llm.generate"  # component.endpoint, under the namespace (launcher/dynamo_worker.py)


@dataclass(slots=True, frozen=True)
class WorkerInfo:
    """What a worker's endpoint answers: where its tritonserver listens, for the frontend."""

    triton_grpc_url: str
    triton_metrics_url: str
    served_model_name: str
    block_size: int = 16


@dataclass(slots=True, frozen=True)
class DynamoSettings:
    """How the runtime finds the instances and talks to them."""

    discovery_backend: str = "file"  # DYN_DISCOVERY_BACKEND
    request_plane: str = "tcp"  # DYN_REQUEST_PLANE

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> DynamoSettings:
        return cls(environ.get("DYN_DISCOVERY_BACKEND", "file"), environ.get("DYN_REQUEST_PLANE", "tcp"))


class DynamoView:
    """The registered instances (`workers`: Dynamo's instance id -> WorkerInfo) and the
    KV-aware router's answers. Make one per process, in the app's lifespan (`start`)."""

    def __init__(self, namespace: str, settings: DynamoSettings | None = None):
        self.namespace = namespace
        self.settings = settings or DynamoSettings()
        self.workers: dict[int, WorkerInfo] = {}
        self._runtime = None
        self._client = None
        self._router = None
        self._block_size = 16

    async def start(self) -> None:
        from dynamo.runtime import DistributedRuntime

        backend, plane = self.settings.discovery_backend, self.settings.request_plane
        self._runtime = DistributedRuntime(asyncio.get_running_loop(), backend, plane, True)
        self._endpoint = self._runtime.endpoint(f"{self.namespace}.{ENDPOINT}")
        self._client = await self._endpoint.client()

    def close(self) -> None:
        if self._runtime is not None:
            self._runtime.shutdown()
            self._runtime = None

    async def refresh(self) -> dict[int, WorkerInfo]:
        """The registered instances now (new ones asked for their WorkerInfo)."""
        ids = set(self._client.instance_ids())
        for gone in set(self.workers) - ids:
            log.warning("instance %s (%s) left Dynamo's discovery", gone, self.workers.pop(gone).triton_grpc_url)
        for worker in ids - set(self.workers):
            try:
                info = await asyncio.wait_for(self._describe(worker), timeout=5)
            except Exception as exc:  # noqa: BLE001 - asked again at the next refresh
                log.warning("instance %s did not describe itself: %s", worker, exc)
                continue
            self.workers[worker] = info
            self._block_size = info.block_size
            log.info("instance %s joined: tritonserver %s", worker, info.triton_grpc_url)
        if self._router is None and self.workers:
            self._router = self._make_router()
        return self.workers

    async def _describe(self, worker: int) -> WorkerInfo:
        async for answer in await self._client.direct({}, worker):
            return WorkerInfo(**answer.data())
        raise RuntimeError("no answer")

    @property
    def block_size(self) -> int:
        """The engines' KV block size (the first worker's; 16 until one describes itself)."""
        return self._block_size

    def _make_router(self):
        from dynamo.llm import KvRouter, KvRouterConfig

        return KvRouter(self._endpoint, self._block_size, KvRouterConfig())

    async def best(self, token_ids: list[int], scope: str | None) -> tuple[int | None, int, int]:
        """(the instance holding most of the prompt, the blocks it holds, the prompt's
        full blocks); (None, 0, blocks) when the router is not up or cannot say."""
        blocks = len(token_ids) // self._block_size
        if self._router is None or not blocks:
            return None, 0, blocks
        try:
            worker, _, overlap = await self._router.best_worker(token_ids, lora_name=scope)
        except Exception as exc:  # noqa: BLE001 - route by load instead
            log.warning("Dynamo's router did not answer: %s", exc)
            return None, 0, blocks
        return worker, overlap, blocks
