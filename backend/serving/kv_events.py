"""The prefix cache's KV events on a ZMQ socket, for a KV-aware router: NVIDIA Dynamo's
worker shim (launcher/dynamo_worker.py) subscribes and relays them to its router.

Off unless KV_EVENTS_ENDPOINT is set (e.g. `tcp://127.0.0.1:5557`; the model binds it).
The wire is vLLM's, which Dynamo reads: frames [topic, sequence (8 bytes, big-endian),
msgpack([timestamp, [event, ...], data_parallel_rank])], each event a map
`{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
"lora_name"}` or `{"type": "BlockRemoved", "block_hashes"}`. A block's hash is our chain
hash's first 8 bytes as a signed 64-bit integer; `lora_name` carries the block's routing
scope (backend.contract.routing). Publishing never blocks the engine: past the socket's
high-water mark ZMQ drops, and a router that missed events only routes less well."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from backend.kv.block_manager import KVEvent, KVEventKind

ENV = "KV_EVENTS_ENDPOINT"


def wire_hash(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little", signed=True)


def event_map(event: KVEvent, block_size: int) -> dict[str, Any]:
    if event.kind is KVEventKind.EVICTED:
        return {"type": "BlockRemoved", "block_hashes": [wire_hash(event.block_hash)]}
    stored = {
        "type": "BlockStored",
        "block_hashes": [wire_hash(event.block_hash)],
        "parent_block_hash": None if event.parent_hash is None else wire_hash(event.parent_hash),
        "token_ids": list(event.tokens),
        "block_size": block_size,
    }
    if event.scope is not None:
        stored["lora_name"] = event.scope
    return stored


class KvEventSink:
    """A ZMQ PUB socket bound at `endpoint`; `publish` sends one batch per call."""

    def __init__(self, endpoint: str, block_size: int):
        import msgpack
        import zmq

        self._pack = msgpack.packb
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, 10000)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self._noblock = zmq.NOBLOCK
        self._again = zmq.Again
        self.block_size = block_size
        self.sequence = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str], block_size: int) -> KvEventSink | None:
        endpoint = env.get(ENV, "").strip()
        return cls(endpoint, block_size) if endpoint else None

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        batch = [time.time(), [event_map(event, self.block_size) for event in events], 0]
        frames = [b"", self.sequence.to_bytes(8, "big"), self._pack(batch, use_bin_type=True)]
        self.sequence += 1
        try:
            self._socket.send_multipart(frames, flags=self._noblock)
        except self._again:  # no room: dropped (see the module's docstring)
            pass

    def close(self) -> None:
        self._socket.close()
        self._context.term()
