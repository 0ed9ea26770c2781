"""Model `llm` through a real tritonserver, with tritonclient's gRPC streaming client."""

from __future__ import annotations

import queue
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend import contract
from launcher import TritonServer

pytestmark = pytest.mark.e2e

PROMPT = [1, 504, 3575, 282, 4649, 30]


@dataclass(slots=True)
class Event:
    """One response: its tokens, and the final event's fields when it is the last."""

    token_ids: list[int]
    final: bool
    outputs: dict[str, np.ndarray] = field(default_factory=dict)

    def scalar(self, name: str):
        value = self.outputs[name].reshape(-1)[0]
        return value.decode() if isinstance(value, bytes) else value.item()


class Stream:
    """One gRPC stream carrying one request; always closed (an open stream delays shutdown)."""

    def __init__(self, grpc_url: str):
        self._client = grpcclient.InferenceServerClient(grpc_url)
        self._queue: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: self._queue.put((result, error)))

    def send(self, fields: dict) -> None:
        inputs = []
        for name, array in contract.encode_request(fields).items():
            tensor = grpcclient.InferInput(name, list(array.shape), contract.INPUTS_BY_NAME[name].wire_type)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        self._client.async_stream_infer(contract.MODEL_NAME, inputs)

    def next(self, timeout: float = 120.0) -> Event:
        result, error = self._queue.get(timeout=timeout)
        if error is not None:
            raise error
        response = result.get_response()
        outputs = {out.name: result.as_numpy(out.name) for out in response.outputs}
        final = response.parameters["triton_final_response"].bool_param
        return Event(outputs.get("token_ids", np.zeros(0, np.int32)).tolist(), final, outputs)

    def until_final(self, timeout: float = 120.0) -> list[Event]:
        events = [self.next(timeout)]
        while not events[-1].final:
            events.append(self.next(timeout))
        return events

    def close(self, cancel: bool = False) -> None:
        self._client.stop_stream(cancel_requests=cancel)
        self._client.close()


def _generate(grpc_url: str, fields: dict) -> list[Event]:
    stream = Stream(grpc_url)
    try:
        stream.send(fields)
        return stream.until_final()
    finally:
        stream.close()


def _error(grpc_url: str, fields: dict) -> str:
    with pytest.raises(InferenceServerException) as info:
        _generate(grpc_url, fields)
    return info.value.message()


def _metric(metrics_url: str, name: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    match = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match, f"metric {name} not exported"
    return float(match.group(1))


def _wait_for_metric(metrics_url: str, name: str, ok, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while not ok(value := _metric(metrics_url, name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def _tokens(events: list[Event]) -> list[int]:
    return [t for e in events for t in e.token_ids]


# ---------------------------------------------------------------------------


def test_greedy_stream_returns_tokens_and_a_final(triton_only):
    fields = {"prompt_tokens": PROMPT, "max_tokens": 8, "temperature": 0.0, "stream": True}
    events = _generate(triton_only.grpc_url, fields)
    assert all(not e.final for e in events[:-1]) and events[-1].final
    assert all(e.token_ids for e in events[:-1]), "a non-final response carries at least one token"
    assert len(_tokens(events)) == 8
    last = events[-1]
    assert last.scalar("finish_reason") == "length"
    assert last.scalar("stop_guard") == "max_tokens"
    assert last.scalar("prompt_token_count") == len(PROMPT)
    assert last.scalar("completion_token_count") == 8
    assert last.scalar("reasoning_tokens") == 0 and last.scalar("accepted_spec_tokens") == 0
    assert last.scalar("time_to_first_token_ms") > 0 and last.scalar("decode_time_ms") >= 0
    assert all("finish_reason" not in e.outputs for e in events[:-1])


def test_non_streaming_request_gets_exactly_one_response(triton_only):
    fields = {"prompt_tokens": PROMPT, "max_tokens": 8, "temperature": 0.0}
    (event,) = _generate(triton_only.grpc_url, fields)
    assert event.final and event.scalar("completion_token_count") == 8
    streamed = _generate(triton_only.grpc_url, dict(fields, stream=True))
    assert event.token_ids == _tokens(streamed), "greedy: streaming or not, the same tokens"


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"prompt_tokens": PROMPT, "num_beams": 4}, "num_beams"),
        ({"prompt_tokens": []}, "prompt_tokens"),
        ({"prompt_tokens": [10**6]}, "prompt_tokens"),
        ({"prompt_tokens": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt_tokens": PROMPT, "top_p": 1.5}, "top_p"),
    ],
)
def test_bad_field_is_a_triton_error_naming_it_and_the_server_keeps_serving(triton_only, fields, name):
    message = _error(triton_only.grpc_url, fields)
    assert message.startswith(f"{name}: "), message
    events = _generate(triton_only.grpc_url, {"prompt_tokens": PROMPT, "max_tokens": 2, "temperature": 0.0})
    assert events[-1].scalar("completion_token_count") == 2


def test_cancel_mid_stream_frees_the_kv_blocks(triton_only):
    metrics = triton_only.metrics_url
    assert _wait_for_metric(metrics, "llm_requests_in_flight", lambda v: v == 0) == 0
    idle_blocks = _metric(metrics, "llm_kv_blocks_used")
    assert _metric(metrics, "llm_kv_blocks_total") > idle_blocks
    stream = Stream(triton_only.grpc_url)
    try:
        # min_tokens keeps the sequence from ending early: finishing would take minutes
        stream.send({"prompt_tokens": PROMPT * 8, "max_tokens": 4000, "min_tokens": 4000, "stream": True})
        first = [stream.next() for _ in range(3)]
        assert not any(e.final for e in first)
        busy = _wait_for_metric(metrics, "llm_kv_blocks_used", lambda v: v > idle_blocks)
        assert busy > idle_blocks
    finally:
        stream.close(cancel=True)
    assert _wait_for_metric(metrics, "llm_requests_in_flight", lambda v: v == 0) == 0
    assert _wait_for_metric(metrics, "llm_kv_blocks_used", lambda v: v == idle_blocks) == idle_blocks
    events = _generate(triton_only.grpc_url, {"prompt_tokens": PROMPT, "max_tokens": 2, "temperature": 0.0})
    assert events[-1].final


def test_concurrent_streams_each_get_their_tokens_and_final(triton_only):
    streams = [Stream(triton_only.grpc_url) for _ in range(4)]
    try:
        for i, stream in enumerate(streams):
            stream.send({"prompt_tokens": PROMPT[: 2 + i], "max_tokens": 6, "temperature": 0.0, "stream": True})
        results = [stream.until_final() for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    for events in results:
        assert len(_tokens(events)) == 6 and events[-1].scalar("completion_token_count") == 6


@pytest.mark.slow
def test_stop_drains_live_requests_with_finals_and_reaps_the_stub(model_path):
    server = TritonServer(model_path).start()
    stubs = list(server._stubs.values())
    assert stubs, "the python backend stub was found"
    stream = Stream(server.grpc_url)
    stream.send({"prompt_tokens": PROMPT, "max_tokens": 4000, "min_tokens": 4000, "stream": True})
    stream.next()
    start = time.monotonic()
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    try:
        events = stream.until_final(timeout=30)
    finally:
        stream.close()
    stopper.join(60)
    assert events[-1].scalar("finish_reason") == "abort"
    assert events[-1].scalar("stop_guard") == "cancelled"
    assert time.monotonic() - start < server.exit_timeout_s, "the model unloaded without hitting the exit timeout"
    for stub in stubs:
        assert not Path(f"/proc/{stub.pid}").exists() or b"backend_stub" not in _cmdline(stub.pid)
        assert not (Path("/dev/shm") / stub.shm_region).exists()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
