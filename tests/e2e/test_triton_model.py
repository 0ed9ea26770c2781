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
from backend.contract import ErrorReport, GenerationRequest, GuardParams, ModelInfo, SamplingParams
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

    def send(self, request: GenerationRequest | dict[str, np.ndarray]) -> None:
        """A request, or raw named arrays (a query, or what no GenerationRequest encodes to)."""
        arrays = request if isinstance(request, dict) else contract.encode_request(request)
        inputs = []
        for name, array in arrays.items():
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


def _generate(grpc_url: str, request: GenerationRequest | dict[str, np.ndarray]) -> list[Event]:
    stream = Stream(grpc_url)
    try:
        stream.send(request)
        return stream.until_final()
    finally:
        stream.close()


def _error(grpc_url: str, request: GenerationRequest | dict[str, np.ndarray]) -> ErrorReport:
    with pytest.raises(InferenceServerException) as info:
        _generate(grpc_url, request)
    report = ErrorReport.decode(info.value.message())
    assert report is not None, f"not an ErrorReport: {info.value.message()}"
    return report


def _request(prompt: list[int], **sampling) -> GenerationRequest:
    """min_tokens N (a request meant to run long) turns the loop guard off too: nothing cuts it."""
    stream = sampling.pop("stream", False)
    guards = GuardParams(loop_min_count=0) if sampling.get("min_tokens") else GuardParams()
    return GenerationRequest(prompt, SamplingParams(**sampling), stream=stream, guards=guards)


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
    events = _generate(triton_only.grpc_url, _request(PROMPT, max_tokens=8, temperature=0.0, stream=True))
    assert all(not e.final for e in events[:-1]) and events[-1].final
    assert all(e.token_ids for e in events[:-1]), "a non-final response carries at least one token"
    assert len(_tokens(events)) == 8
    last = events[-1]
    assert last.scalar("finish_reason") == "length"
    assert last.scalar("finish_guard") == "max_tokens"
    assert last.scalar("num_prompt_tokens") == len(PROMPT)
    assert last.scalar("num_output_tokens") == 8
    assert last.scalar("num_reasoning_tokens") == 0 and last.scalar("num_accepted_prediction_tokens") == 0
    # seconds, end to end: a first token on this CPU takes well under a minute
    assert 0 < last.scalar("time_to_first_token_s") < 60 and last.scalar("decode_time_s") >= 0
    assert "thinking_guard" not in last.outputs, "a None field of the final event is left out"
    assert all("finish_reason" not in e.outputs for e in events[:-1])
    assert events[0].scalar("starts_in_thinking") is False, "the first response says where the output starts"
    assert all("starts_in_thinking" not in e.outputs for e in events[1:])


def test_the_decoded_events_are_the_engine_types(triton_only):
    stream = Stream(triton_only.grpc_url)
    try:
        stream.send(_request(PROMPT, max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=2, stream=True))
        events = stream.until_final()
    finally:
        stream.close()
    outputs = [contract.decode_output(e.outputs, PROMPT, e.final) for e in events]
    final = outputs[-1].final
    assert final.finish_reason is contract.FinishReason.LENGTH and final.finish_guard is contract.FinishGuard.MAX_TOKENS
    assert [lp.token_id for out in outputs for lp in out.logprobs] == _tokens(events)
    assert all(len(lp.top) == 2 for out in outputs for lp in out.logprobs)


def test_non_streaming_request_gets_exactly_one_response(triton_only):
    (event,) = _generate(triton_only.grpc_url, _request(PROMPT, max_tokens=8, temperature=0.0))
    assert event.final and event.scalar("num_output_tokens") == 8
    streamed = _generate(triton_only.grpc_url, _request(PROMPT, max_tokens=8, temperature=0.0, stream=True))
    assert event.token_ids == _tokens(streamed), "greedy: streaming or not, the same tokens"


def test_the_model_info_query_answers_the_engines_facts(triton_only):
    (event,) = _generate(triton_only.grpc_url, contract.model_info_query())
    info = contract.decode_model_info(event.outputs)
    assert isinstance(info, ModelInfo) and event.final
    assert info.vocab_size == 49152 and info.max_model_len == 8192  # SmolLM2's, within the default 1 GiB pool
    assert info.tool_parser == "hermes"
    assert (info.tool_call_start, info.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert info.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}  # the shipped preset
    assert info.think_start == info.think_end == ""


@pytest.mark.parametrize(
    ("request_", "name"),
    [
        (GenerationRequest(PROMPT, SamplingParams(temperature=0.0), num_beams=9), "num_beams"),  # MAX_BEAMS 8
        (GenerationRequest(PROMPT, num_beams=4), "temperature"),  # a search is deterministic
        (GenerationRequest([]), "prompt_tokens"),
        (GenerationRequest([10**6]), "prompt_tokens"),
        (_request(PROMPT, max_tokens=-1), "max_tokens"),
        (_request(PROMPT, top_p=1.5), "top_p"),
        ({"prompt_tokens": np.array(PROMPT, np.int32), "temperature": np.array([np.nan], np.float32)}, "temperature"),
        ({"model_info": np.array([True]), "prompt_tokens": np.array(PROMPT, np.int32)}, "model_info"),
    ],
)
def test_bad_field_is_a_triton_error_naming_it_and_the_server_keeps_serving(triton_only, request_, name):
    report = _error(triton_only.grpc_url, request_)
    assert report.kind is contract.ErrorKind.INVALID_REQUEST and report.field == name, report
    assert report.message.startswith(f"{name}: "), report.message
    events = _generate(triton_only.grpc_url, _request(PROMPT, max_tokens=2, temperature=0.0))
    assert events[-1].scalar("num_output_tokens") == 2


def test_a_beam_search_streams_nothing_then_its_hypotheses_in_one_final_response(triton_only):
    request = GenerationRequest(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, logprobs=True), stream=True,
                                num_beams=3, num_return_sequences=2, early_stopping="never")  # fmt: skip
    events = _generate(triton_only.grpc_url, request)
    assert all(not e.outputs or not e.token_ids for e in events[:-1])  # no tokens before the end
    out = contract.decode_output(events[-1].outputs, PROMPT, final=True)
    assert len(out.hypotheses) == 2 and out.hypotheses[0].score >= out.hypotheses[1].score
    assert all(len(h.logprobs) == len(h.token_ids) for h in out.hypotheses)
    assert out.final.num_output_tokens == sum(
        len(h.token_ids) + (h.finish_reason is contract.FinishReason.STOP) for h in out.hypotheses
    )


def test_cancel_mid_stream_frees_the_kv_blocks(triton_only):
    metrics = triton_only.metrics_url
    assert _wait_for_metric(metrics, "llm_requests_in_flight", lambda v: v == 0) == 0
    idle_blocks = _metric(metrics, "llm_kv_blocks_used")
    assert _metric(metrics, "llm_kv_blocks_total") > idle_blocks
    stream = Stream(triton_only.grpc_url)
    try:
        # min_tokens keeps the sequence from ending early: finishing would take minutes
        stream.send(_request(PROMPT * 8, max_tokens=4000, min_tokens=4000, stream=True))
        first = [stream.next() for _ in range(3)]
        assert not any(e.final for e in first)
        busy = _wait_for_metric(metrics, "llm_kv_blocks_used", lambda v: v > idle_blocks)
        assert busy > idle_blocks
    finally:
        stream.close(cancel=True)
    assert _wait_for_metric(metrics, "llm_requests_in_flight", lambda v: v == 0) == 0
    assert _wait_for_metric(metrics, "llm_kv_blocks_used", lambda v: v == idle_blocks) == idle_blocks
    events = _generate(triton_only.grpc_url, _request(PROMPT, max_tokens=2, temperature=0.0))
    assert events[-1].final


def test_concurrent_streams_each_get_their_tokens_and_final(triton_only):
    streams = [Stream(triton_only.grpc_url) for _ in range(4)]
    try:
        for i, stream in enumerate(streams):
            stream.send(_request(PROMPT[: 2 + i], max_tokens=6, temperature=0.0, stream=True))
        results = [stream.until_final() for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    for events in results:
        assert len(_tokens(events)) == 6 and events[-1].scalar("num_output_tokens") == 6


@pytest.mark.slow
def test_stop_drains_live_requests_with_finals_and_reaps_the_stub(model_path):
    server = TritonServer(model_path).start()
    stubs = list(server._stubs.values())
    assert stubs, "the python backend stub was found"
    stream = Stream(server.grpc_url)
    stream.send(_request(PROMPT, max_tokens=4000, min_tokens=4000, stream=True))
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
    assert events[-1].scalar("finish_guard") == "cancelled"
    assert time.monotonic() - start < server.exit_timeout_s, "the model unloaded without hitting the exit timeout"
    for stub in stubs:
        assert not Path(f"/proc/{stub.pid}").exists() or b"backend_stub" not in _cmdline(stub.pid)
        assert not (Path("/dev/shm") / stub.shm_region).exists()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
