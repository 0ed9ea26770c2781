"""Runs the engine loop in a background thread.

The engine is not thread-safe: this thread builds it and runs its steps, and is the
only one that changes it. Other threads talk to it through an inbox of commands
(submit, abort), drained at the top of every loop iteration; when there is nothing to
do the thread sleeps on a condition. Two exceptions, by design: `prepare` (a request's
grammar and adapter) runs on a thread of the request's own (`accept`,
backend.serving.preparer) and touches only the engine's thread-safe grammar compiler
and adapter registry, so a slow compilation stalls neither Triton's thread, nor the
batch, nor a request without a grammar; `adapter_command` (load, unload, ...) runs on
its caller's thread against that registry alone.

Failures never kill the thread. A request the engine refuses (`add_request` raises)
fails alone; an exception in `step()` fails every request in flight with a clear
message, and the thread keeps serving new requests.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.contract import (
    AdapterCommand,
    AdapterTable,
    ContractError,
    EngineUnavailable,
    GenerationRequest,
    ModelInfo,
    RequestOutput,
)
from backend.core.engine import Prepared, needs_preparing
from backend.serving.preparer import Preparer
from backend.speculation.speculator import SpecStats

log = logging.getLogger(__name__)

OnOutputs = Callable[[list[RequestOutput]], None]
OnFailure = Callable[[str, Exception], None]  # (request_id, error)

# How many steps shutdown allows for aborted requests to report their finals.
_SHUTDOWN_STEPS = 16


@dataclass(frozen=True, slots=True)
class _Submit:
    request_id: str
    request: GenerationRequest
    arrival_time: float
    prepared: Prepared


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine state as of the end of the last loop iteration (readable from any thread)."""

    requests_in_flight: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    requests_running: int = 0  # in the batch
    requests_waiting: int = 0  # queued for the batch (preempted ones included)
    num_preemptions: int = 0  # since start
    spec: SpecStats = field(default_factory=SpecStats)  # speculative decoding's counters, since start
    # LoRA: (running, waiting) sequences per adapter name that ever ran or waited; MAX_LORAS
    lora_requests: dict[str, tuple[int, int]] = field(default_factory=dict)
    max_loras: int = 0

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free


class EngineStepError(RuntimeError):
    """The engine failed during a step; every request in flight was failed with it."""


class EngineThread:
    """`make_engine` runs on the engine thread itself, so that every torch op — the
    model load included — comes from one thread. Torch's OpenMP keeps a thread team
    per calling thread; a second team (the model loaded on Triton's main thread)
    oversubscribes the 2 cores and made every decode step ~20% slower (measured)."""

    def __init__(self, make_engine, on_outputs: OnOutputs, on_failure: OnFailure, name: str = "engine", kv_events=None):
        """`kv_events`: a backend.serving.kv_events.KvEventSink, fed after every step (None: off)."""
        self._make_engine = make_engine
        self._kv_events = kv_events
        self._engine = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._on_outputs = on_outputs
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._inbox: list[_Submit | _Abort] = []
        self._preparer = Preparer(lambda request: self._engine.prepare(request), self.submit, on_outputs, on_failure)
        self._stopping = False
        self._stalled = False  # the last step failed: wait for new commands, don't spin
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.snapshot = EngineSnapshot()
        self.model_info: ModelInfo | None = None  # the engine's facts, once it is built

    # -- any thread ---------------------------------------------------------

    def start(self) -> None:
        """Start the thread and build the engine on it; raise what building raised."""
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    def accept(self, request_id: str, request: GenerationRequest, arrival_time: float) -> None:
        """Queue a request without waiting on its preparation: one with a grammar or an
        adapter is prepared on a thread of its own, then queued; one without, now."""
        if needs_preparing(request):
            self._preparer.start(request_id, request, arrival_time)
        else:
            self.submit(request_id, request, arrival_time, Prepared())

    def adapter_command(self, command: AdapterCommand) -> AdapterTable:
        """Run a LoRA adapter command on the caller's thread (thread-safe)."""
        if self._engine.adapters is None:
            if command.op == "list":
                return AdapterTable()  # max_loras 0: no adapters served
            raise ContractError("adapter_command", "this server serves no LoRA adapters (MAX_LORAS=0)")
        return self._engine.adapters.command(command)

    def submit(self, request_id: str, request: GenerationRequest, arrival_time: float, prepared: Prepared) -> None:
        """Queue a prepared request; its outputs or its failure come through the callbacks."""
        with self._cond:
            if not self._stopping:
                self._inbox.append(_Submit(request_id, request, arrival_time, prepared))
                self._cond.notify()
                return
        self._on_failure(request_id, EngineUnavailable("the server is shutting down"))

    def abort(self, request_id: str) -> None:
        """Abort a request; its final output (finish reason abort) follows."""
        if self._preparer.abort(request_id):
            return
        with self._cond:
            self._inbox.append(_Abort(request_id))
            self._cond.notify()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort what is in flight, deliver the finals, and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine thread --------------------------------------------------

    def _run(self) -> None:
        try:
            self._engine = self._make_engine()
            self.model_info = self._engine.model_info()
            self._take_snapshot()
        except BaseException as exc:
            self._startup_error = exc
            return
        finally:
            self._ready.set()
        while True:
            busy = self._engine.has_unfinished_requests() and not self._stalled
            with self._cond:
                if not busy and not self._inbox and not self._stopping:
                    self._cond.wait()
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            if commands:
                self._stalled = False
                self._apply(commands)
            if stopping:
                self._stop()
                return
            if self._engine.has_unfinished_requests() and not self._stalled:
                self._step()
            else:
                self._take_snapshot()
            if self._kv_events is not None:
                self._kv_events.publish(self._engine.take_kv_events())

    def _apply(self, commands: list[_Submit | _Abort]) -> None:
        for command in commands:
            if isinstance(command, _Submit):
                self._add(command)
            else:
                self._abort_quietly(command.request_id)

    def _add(self, command: _Submit) -> None:
        try:
            self._engine.add_request(command.request_id, command.request, command.arrival_time, command.prepared)
        except Exception as exc:  # a bad request fails alone
            self._on_failure(command.request_id, exc)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self._fail_in_flight(EngineStepError(f"the engine failed: {type(exc).__name__}: {exc}"))
            self._stalled = True
            outputs = []
        self._take_snapshot()  # before the outputs go: a finished request is in the figures its answer follows
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        try:
            self._on_outputs(outputs)
        except Exception:
            log.exception("output callback failed")

    def _fail_in_flight(self, error: Exception) -> None:
        """Fail every request in flight and abort it in the engine (best effort); the
        aborts' finals, if any come, reach streams that have already ended and are dropped."""
        for request_id in self._engine.request_ids():
            self._on_failure(request_id, error)
            self._abort_quietly(request_id)

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self._engine.abort_request(request_id)
        except Exception:
            log.exception("aborting %s failed", request_id)

    def _stop(self) -> None:
        for request_id in self._engine.request_ids():
            self._abort_quietly(request_id)
        for _ in range(_SHUTDOWN_STEPS):
            if not self._engine.has_unfinished_requests():
                break
            self._step()
        shut_down = RuntimeError("the server shut down before the request finished")
        self._fail_in_flight(shut_down)
        self._preparer.fail_all(shut_down)
        self._engine.close()  # the grammar compiler's worker processes
        self._take_snapshot()
        if self._kv_events is not None:
            self._kv_events.close()

    def _take_snapshot(self) -> None:
        self.snapshot = EngineSnapshot(
            requests_in_flight=len(self._engine.request_ids()),
            kv_blocks_free=self._engine.num_free_blocks(),
            kv_blocks_total=self._engine.num_total_blocks(),
            requests_running=self._engine.num_running(),
            requests_waiting=self._engine.num_waiting(),
            num_preemptions=self._engine.num_preemptions,
            spec=self._engine.spec_stats(),
            lora_requests=self._engine.lora_requests(),
            max_loras=self._engine.max_loras,
        )
