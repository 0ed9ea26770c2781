"""Model `llm`: the thin Triton Python-backend adapter over the engine (decoupled).

execute() parses each request with the contract, hands it to the engine thread and
returns at once. The engine thread pushes outputs into a StreamCoalescer; a sender
thread takes, per stream, everything pending and sends it as ONE response (a send is
a blocking round trip, whatever it holds), the final flag riding on the last one.
The sender also checks cancellation (a round trip too, so at most every
_CANCEL_CHECK_S) and aborts cancelled requests; the abort's final is then sent.

Every request gets its final flag: with its last tokens, with an error, or at shutdown.
Triton calls finalize() only once no request is in flight, so the launcher asks for a
drain first (contract.DRAIN_SIGNAL to the stub): live requests are aborted and get
their finals, new ones are refused.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# The stub ignores PYTHONPATH: make the repository's packages importable.
_SOURCE_ROOT = os.environ.get("LLM_SOURCE_ROOT") or str(Path(__file__).resolve().parents[3])
if _SOURCE_ROOT not in sys.path:
    sys.path.insert(0, _SOURCE_ROOT)

from backend import contract  # noqa: E402
from backend.config import EngineConfig  # noqa: E402
from backend.engine import LLMEngine  # noqa: E402
from backend.engine_thread import EngineSnapshot, EngineThread  # noqa: E402
from backend.request import EngineRequest, FinalStats, sampling_from_fields  # noqa: E402
from backend.streaming import Packet, StreamCoalescer  # noqa: E402

log = logging.getLogger("llm")

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
_CANCEL_CHECK_S = 0.05  # cancellation checks (20-120 us each), per live stream, at most this often
_IDLE_WAKE_S = 0.05  # the sender wakes this often when nothing is sent
_METRICS_EVERY_S = 0.1


@dataclass(slots=True)
class _Live:
    """A request between execute() and its final response."""

    sender: pb_utils.InferenceResponseSender
    abort_requested: bool = False


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        _check_numpy_abi()
        config = EngineConfig.from_env(os.environ.get("LLM_MODEL_PATH"))
        self._coalescer = StreamCoalescer()
        self._engine_thread = EngineThread(lambda: LLMEngine(config), self._coalescer.push, self._coalescer.fail)
        self._live: dict[str, _Live] = {}
        self._live_lock = threading.Lock()
        self._ids = itertools.count()
        self._metrics = _Metrics()
        self._next_cancel_check = 0.0
        self._draining = threading.Event()
        self._sender = threading.Thread(target=self._send_loop, name="llm-sender", daemon=True)
        self._engine_thread.start()
        self._sender.start()
        self._install_drain_handler()

    def execute(self, requests: list) -> None:
        for request in requests:
            self._accept(request)
        return None

    def finalize(self) -> None:
        """Abort what is in flight, send every final, stop the threads."""
        self._engine_thread.shutdown()
        self._coalescer.close()
        self._sender.join(timeout=30)
        with self._live_lock:
            leftovers, self._live = self._live, {}
        for live in leftovers.values():
            _send_quietly(live.sender, _error_response(RuntimeError("the server shut down")), FINAL)
        if not self._sender.is_alive():  # else it may still publish
            self._metrics = None
            _release_metric_families()

    # -- execute(): parse, validate, hand over ------------------------------

    def _accept(self, request) -> None:
        sender = request.get_response_sender()
        if self._draining.is_set():
            error = pb_utils.TritonError("the server is shutting down", pb_utils.TritonError.UNAVAILABLE)
            _send_quietly(sender, pb_utils.InferenceResponse(output_tensors=[], error=error), FINAL)
            return
        request_id = f"{request.request_id() or 'req'}#{next(self._ids)}"
        try:
            values = contract.decode_request({t.name(): t.as_numpy() for t in request.inputs()})
            engine_request = _engine_request(request_id, values)
            self._engine_thread.prepare(engine_request)
        except contract.ContractError as exc:
            _send_quietly(sender, _error_response(exc), FINAL)
            return
        with self._live_lock:
            self._live[request_id] = _Live(sender)
        self._coalescer.open(request_id, stream=values["stream"])
        self._engine_thread.submit(engine_request)

    # -- the sender thread ----------------------------------------------------

    def _send_loop(self) -> None:
        while True:
            packets = self._coalescer.take(_IDLE_WAKE_S)
            for packet in packets:
                self._send(packet)
            try:
                self._check_cancelled()
                self._metrics.publish(self._engine_thread.snapshot, self._live_count())
            except Exception:  # never let bookkeeping stop the sending
                log.exception("sender bookkeeping failed")
            if self._coalescer.closed and not packets:
                return

    def _send(self, packet: Packet) -> None:
        with self._live_lock:
            live = self._live.pop(packet.request_id) if packet.is_last else self._live.get(packet.request_id)
        if live is None:
            return
        response = _error_response(packet.error) if packet.error else _data_response(packet)
        _send_quietly(live.sender, response, FINAL if packet.is_last else 0)
        self._metrics.count(len(packet.token_ids))

    def _live_count(self) -> int:
        with self._live_lock:
            return len(self._live)

    def _check_cancelled(self) -> None:
        now = time.monotonic()
        if now < self._next_cancel_check:
            return
        self._next_cancel_check = now + _CANCEL_CHECK_S
        with self._live_lock:
            live_items = list(self._live.items())
        for request_id, live in live_items:
            if not live.abort_requested and live.sender.is_cancelled():
                live.abort_requested = True
                self._engine_thread.abort(request_id)

    # -- drain before shutdown ------------------------------------------------

    def _install_drain_handler(self) -> None:
        """Wake a watcher thread on contract.DRAIN_SIGNAL (the stub's main thread sits in C++,
        so a Python handler alone would run late; the wakeup fd is written at once)."""
        try:
            read_fd, write_fd = os.pipe()
            os.set_blocking(write_fd, False)
            signal.signal(contract.DRAIN_SIGNAL, lambda signum, frame: None)
            signal.set_wakeup_fd(write_fd)
        except ValueError:  # not the main thread: no drain, finalize() still cleans up
            log.warning("drain signal handler not installed")
            return
        threading.Thread(target=self._await_drain, args=(read_fd,), name="llm-drain", daemon=True).start()

    def _await_drain(self, read_fd: int) -> None:
        while os.read(read_fd, 1) != bytes([contract.DRAIN_SIGNAL]):
            pass
        self._draining.set()
        with self._live_lock:
            live_items = list(self._live.items())
        for request_id, live in live_items:
            live.abort_requested = True
            self._engine_thread.abort(request_id)


def _check_numpy_abi() -> None:
    """The stub's numpy bindings (pybind11) read NumPy 1 structs: NumPy 2 corrupts tensors."""
    if int(np.__version__.split(".")[0]) >= 2:
        raise pb_utils.TritonModelException(
            f"numpy {np.__version__} is installed, but the Python backend stub of nvidia-pytriton 0.7.0 "
            "needs numpy<2 (with numpy 2 every tensor arrives empty or garbled): install numpy==1.26.4"
        )


def _engine_request(request_id: str, values: dict) -> EngineRequest:
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=list(values["prompt_tokens"]),
        sampling=sampling_from_fields(values),
        tenant=values["lookup_tenant"].decode(errors="replace"),
        adapter=values["adapter_slot"],
        grammar_kind=_text(values, "grammar_kind"),
        grammar_spec=_text(values, "grammar_spec"),
    )


def _text(values: dict, name: str) -> str:
    try:
        return values[name].decode()
    except UnicodeDecodeError as exc:
        raise contract.ContractError(name, f"must be UTF-8 text: {exc}") from None


# -- responses -----------------------------------------------------------------


def _tensor(name: str, values: list) -> pb_utils.Tensor:
    spec = contract.OUTPUTS_BY_NAME[name]
    return pb_utils.Tensor(name, np.array(values, dtype=spec.numpy_dtype))


def _data_response(packet: Packet) -> pb_utils.InferenceResponse:
    tensors = [_tensor("token_ids", packet.token_ids)]
    tensors += _logprob_tensors(packet)
    if packet.final is not None:
        tensors += _final_tensors(packet.final)
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _logprob_tensors(packet: Packet) -> list[pb_utils.Tensor]:
    """token_logprobs [n], top_logprob_ids/values [n, k] (k > 0) and prompt_logprobs
    (NaN for the first token), each only when the request asked for it."""
    tensors = []
    if packet.logprobs is not None:
        tensors.append(_tensor("token_logprobs", packet.logprobs))
        top = packet.top_logprobs or []
        if top and top[0][0]:
            tensors.append(_tensor("top_logprob_ids", [ids for ids, _ in top]))
            tensors.append(_tensor("top_logprob_values", [values for _, values in top]))
    if packet.prompt_logprobs is not None:
        values = [math.nan if v is None else v for v in packet.prompt_logprobs]
        tensors.append(_tensor("prompt_logprobs", values))
    if packet.prompt_top_logprobs is not None:
        # the first position has no alternatives: its row is padded (-1, NaN)
        k = max(len(ids) for ids, _ in packet.prompt_top_logprobs)
        tensors.append(_tensor("prompt_top_logprob_ids", [ids or [-1] * k for ids, _ in packet.prompt_top_logprobs]))
        values = [vals or [math.nan] * k for _, vals in packet.prompt_top_logprobs]
        tensors.append(_tensor("prompt_top_logprob_values", values))
    return tensors


def _final_tensors(final: FinalStats) -> list[pb_utils.Tensor]:
    guard = final.stop_guard.value if final.stop_guard is not None else ""
    thinking_guard = final.thinking_guard.value if final.thinking_guard is not None else ""
    return [
        _tensor("finish_reason", [final.finish_reason.value.encode()]),
        _tensor("stop_guard", [guard.encode()]),
        _tensor("thinking_guard", [thinking_guard.encode()]),
        _tensor("prompt_token_count", [final.prompt_tokens]),
        _tensor("completion_token_count", [final.completion_tokens]),
        _tensor("cached_prompt_tokens", [final.cached_prompt_tokens]),
        _tensor("reasoning_tokens", [final.reasoning_tokens]),
        _tensor("accepted_spec_tokens", [0]),
        _tensor("time_to_first_token_ms", [final.time_to_first_token_s * 1000.0]),
        _tensor("decode_time_ms", [final.decode_time_s * 1000.0]),
        _tensor("queue_time_ms", [final.queue_time_s * 1000.0]),
    ]


def _error_response(error: Exception) -> pb_utils.InferenceResponse:
    bad_input = isinstance(error, contract.ContractError)
    code = pb_utils.TritonError.INVALID_ARG if bad_input else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(error), code))


def _send_quietly(sender, response: pb_utils.InferenceResponse, flags: int) -> None:
    """A send that fails (the client is gone) must not stop the sender thread."""
    try:
        sender.send(response, flags=flags)
    except Exception:
        log.exception("send failed")


# -- metrics (each update is a round trip: batched, and only on change) ---------


class _Metrics:
    """The engine's own figures on Triton's metrics port; the frontend's /metrics reads
    them from there (vllm:num_requests_running/waiting, vllm:kv_cache_usage_perc)."""

    def __init__(self) -> None:
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        self._kv_used = _metric("llm_kv_blocks_used", "KV cache blocks in use", gauge)
        self._kv_total = _metric("llm_kv_blocks_total", "KV cache blocks in the pool", gauge)
        self._in_flight = _metric("llm_requests_in_flight", "requests awaiting their final response", gauge)
        self._running = _metric("llm_requests_running", "requests in the engine's batch", gauge)
        self._waiting = _metric("llm_requests_waiting", "requests queued for the batch", gauge)
        self._preemptions = _metric("llm_preemptions_total", "sequences preempted (recomputed later)", counter)
        self._responses = _metric("llm_responses_total", "responses sent", counter)
        self._tokens = _metric("llm_generated_tokens_total", "generated tokens sent", counter)
        self._published: tuple[int, ...] | None = None
        self._published_preemptions = 0
        self._pending_responses = 0
        self._pending_tokens = 0
        self._next = 0.0

    def count(self, tokens: int) -> None:
        self._pending_responses += 1
        self._pending_tokens += tokens

    def publish(self, snapshot: EngineSnapshot, in_flight: int) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + _METRICS_EVERY_S
        state = (
            snapshot.kv_blocks_used,
            snapshot.kv_blocks_total,
            in_flight,
            snapshot.requests_running,
            snapshot.requests_waiting,
        )
        if state != self._published:
            for metric, value in zip(
                (self._kv_used, self._kv_total, self._in_flight, self._running, self._waiting), state, strict=True
            ):
                metric.set(value)
            self._published = state
        if snapshot.num_preemptions > self._published_preemptions:
            self._preemptions.increment(snapshot.num_preemptions - self._published_preemptions)
            self._published_preemptions = snapshot.num_preemptions
        if self._pending_responses:
            self._responses.increment(self._pending_responses)
            self._tokens.increment(self._pending_tokens)
            self._pending_responses = self._pending_tokens = 0


_families: list = []  # a MetricFamily must outlive its Metric objects


def _release_metric_families() -> None:
    """Free the metrics while the stub still runs. Left to the interpreter's exit, a
    MetricFamily's destructor writes to the stub's shared memory after it is gone and
    the stub segfaults on every unload (measured: 10 of 12 server logs)."""
    _families.clear()
    gc.collect()


def _metric(name: str, description: str, kind):
    family = pb_utils.MetricFamily(name=name, description=description, kind=kind)
    _families.append(family)
    return family.Metric(labels={})
