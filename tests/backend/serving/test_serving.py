"""The Triton process's serving pipeline without Triton: the engine thread feeding the
live-request registry, the sender loop draining it, and the gauges it keeps."""

from __future__ import annotations

import threading
import time

import pytest

from backend.contract import (
    ContractError,
    EngineUnavailable,
    FinalEvent,
    FinishGuard,
    FinishReason,
    GenerationRequest,
    Logprob,
    ModelInfo,
    RequestOutput,
    SamplingParams,
)
from backend.serving.engine_thread import EngineSnapshot, EngineThread
from backend.serving.gauges import Gauges
from backend.serving.live import LiveRequests, Packet
from backend.serving.sender import SenderLoop
from backend.speculation.speculator import SpecStats


def _final(num_output_tokens: int, reason: FinishReason = FinishReason.LENGTH) -> FinalEvent:
    guard = FinishGuard.CANCELLED if reason is FinishReason.ABORT else FinishGuard.MAX_TOKENS
    return FinalEvent(reason, guard, 3, num_output_tokens, time_to_first_token_s=0.01, decode_time_s=0.02)


class FakeSender:
    """Stands for Triton's response sender: what a request's responses went to, and
    whether its client cancelled it."""

    def __init__(self, name: str = ""):
        self.name = name
        self.cancelled = False
        self.cancel_checks = 0
        self.outputs: list[tuple[RequestOutput, bool]] = []  # (output, final flag)
        self.errors: list[Exception] = []

    def is_cancelled(self) -> bool:
        self.cancel_checks += 1
        return self.cancelled

    def __repr__(self) -> str:
        return f"FakeSender({self.name!r})"


# ---------------------------------------------------------------------------
# LiveRequests: per-stream coalescing


def _live(*opened: tuple[str, bool]) -> tuple[LiveRequests, dict[str, FakeSender]]:
    live = LiveRequests()
    senders = {}
    for rid, stream in opened:
        senders[rid] = FakeSender(rid)
        live.open(rid, senders[rid], stream)
    return live, senders


def test_streaming_packs_all_pending_tokens_into_one_packet():
    live, s = _live(("a", True))
    live.push([RequestOutput("a", [1])])
    live.push([RequestOutput("a", [2, 3])])
    live.push([RequestOutput("a", [4])])
    assert live.take(0) == [Packet("a", s["a"], RequestOutput("a", [1, 2, 3, 4]))]
    assert live.take(0) == []
    live.push([RequestOutput("a", [5])])
    assert live.take(0) == [Packet("a", s["a"], RequestOutput("a", [5]))]


def test_final_rides_on_the_last_packet_and_closes_the_stream():
    live, s = _live(("a", True))
    final = _final(3)
    live.push([RequestOutput("a", [1, 2])])
    live.push([RequestOutput("a", [3], final=final)])
    packets = live.take(0)
    assert packets == [Packet("a", s["a"], RequestOutput("a", [1, 2, 3], final=final))]
    assert packets[0].is_last
    assert len(live) == 0
    live.push([RequestOutput("a", [9])])  # a closed stream drops late outputs
    assert live.take(0) == []


def test_non_streaming_request_is_sent_once_at_the_end():
    live, s = _live(("n", False))
    live.push([RequestOutput("n", [1])])
    live.push([RequestOutput("n", [2, 3])])
    assert live.take(0) == []
    final = _final(4, FinishReason.STOP)
    live.push([RequestOutput("n", [4], final=final)])
    assert live.take(0) == [Packet("n", s["n"], RequestOutput("n", [1, 2, 3, 4], final=final))]
    assert live.take(0) == []


def test_streams_are_independent_and_ordered_by_readiness():
    live, s = _live(("a", True), ("b", True), ("n", False))
    live.push([RequestOutput("b", [10]), RequestOutput("a", [20]), RequestOutput("n", [30])])
    live.push([RequestOutput("a", [21]), RequestOutput("b", [11])])
    assert live.take(0) == [
        Packet("b", s["b"], RequestOutput("b", [10, 11])),
        Packet("a", s["a"], RequestOutput("a", [20, 21])),
    ]
    assert sorted(rid for rid, _ in live.senders()) == ["a", "b", "n"]
    assert dict(live.senders()) == s


def test_final_without_tokens_is_a_packet():
    live, s = _live(("a", True))
    final = _final(0, FinishReason.ABORT)
    live.push([RequestOutput("a", [], final=final)])
    assert live.take(0) == [Packet("a", s["a"], RequestOutput("a", [], final=final))]


def test_failure_drops_pending_tokens_and_ends_the_stream():
    live, s = _live(("a", True), ("n", False))
    live.push([RequestOutput("a", [1, 2]), RequestOutput("n", [7])])
    bad_prompt = ContractError("prompt_tokens", "must not be empty")
    engine_down = RuntimeError("the engine failed")
    live.fail("a", bad_prompt)
    live.fail("n", engine_down)
    packets = live.take(0)
    assert packets == [Packet("a", s["a"], error=bad_prompt), Packet("n", s["n"], error=engine_down)]
    assert all(p.is_last for p in packets)
    assert len(live) == 0
    live.fail("a", RuntimeError("again"))  # failing a closed stream is a no-op
    assert live.take(0) == []


def test_output_after_final_is_ignored():
    live, s = _live(("a", True))
    final = _final(1)
    live.push([RequestOutput("a", [1], final=final), RequestOutput("a", [2])])
    live.fail("a", RuntimeError("late"))
    assert live.take(0) == [Packet("a", s["a"], RequestOutput("a", [1], final=final))]


def test_logprobs_stay_aligned_with_their_tokens_when_packed():
    live, s = _live(("a", True))
    prompt = [Logprob(11, None, []), Logprob(12, -3.0, [(13, -1.0)])]
    first = Logprob(1, -0.1, [(1, -0.1), (2, -2.0)])
    fifth = Logprob(5, -0.5, [(5, -0.5), (6, -1.0)])
    live.push([RequestOutput("a", [1], [first], prompt_logprobs=prompt, starts_in_thinking=True)])
    live.push([RequestOutput("a", [5], [fifth])])
    [packet] = live.take(0)
    out = packet.output
    assert out.token_ids == [1, 5] and out.logprobs == [first, fifth]
    assert [e.token_id for e in out.logprobs] == out.token_ids
    assert out.prompt_logprobs == prompt and out.starts_in_thinking is True  # the first output's, kept
    seventh = Logprob(7, -0.7, [(7, -0.7), (8, -0.9)])
    live.push([RequestOutput("a", [7], [seventh])])
    assert live.take(0) == [Packet("a", s["a"], RequestOutput("a", [7], [seventh]))]


def test_open_twice_is_refused():
    live, _ = _live(("a", True))
    with pytest.raises(ValueError):
        live.open("a", FakeSender("again"), stream=False)


def test_request_abort_is_noted_once_and_hides_the_sender():
    live, s = _live(("a", True), ("b", True))
    assert live.request_abort("a")
    assert not live.request_abort("a")  # already asked
    assert not live.request_abort("never-seen")
    assert live.senders() == [("b", s["b"])]
    assert len(live) == 2  # still live: its abort final is still to be sent
    live.push([RequestOutput("a", [], final=_final(0, FinishReason.ABORT))])
    assert [p.request_id for p in live.take(0)] == ["a"] and len(live) == 1


def test_forget_all_returns_the_senders_never_finished():
    live, s = _live(("a", True), ("b", False))
    live.push([RequestOutput("a", [1]), RequestOutput("b", [2])])
    assert live.forget_all() == [s["a"], s["b"]]
    assert len(live) == 0 and live.take(0) == [] and live.senders() == []


def test_take_waits_for_a_push_from_another_thread():
    live, s = _live(("a", True))
    timer = threading.Timer(0.05, live.push, args=([RequestOutput("a", [1])],))
    timer.start()
    start = time.monotonic()
    assert live.take(5.0) == [Packet("a", s["a"], RequestOutput("a", [1]))]
    assert time.monotonic() - start < 2.0
    timer.join()


def test_close_wakes_a_waiting_taker():
    live = LiveRequests()
    threading.Timer(0.05, live.close).start()
    start = time.monotonic()
    assert live.take(5.0) == []
    assert live.closed
    assert time.monotonic() - start < 2.0


# ---------------------------------------------------------------------------
# EngineThread, with a scripted fake engine


MODEL_INFO = ModelInfo(max_model_len=64, vocab_size=100)


class FakeEngine:
    """Emits one token per step per request, up to max_tokens; refuses a grammar kind
    it does not know (as the engine refuses what only it can judge); can be told to fail.
    Preparing a grammar spec "wait" waits for `release` (a slow compilation); a spec
    "bad" fails as a bad schema does."""

    def __init__(self, blocks: int = 8):
        self.requests: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.abort_calls: list[str] = []
        self.arrivals: dict[str, float] = {}
        self.grammars: dict[str, object] = {}
        self.prepared_on: list[int] = []
        self.release = threading.Event()
        self.closed = False
        self.fail_next_step = False
        self.steps = 0
        self.emitted = 0  # tokens over all requests: a figure each step changes, in spec_stats
        self.total = blocks
        self.thread_ids: set[int] = set()

    def model_info(self) -> ModelInfo:
        return MODEL_INFO

    def prepare(self, request: GenerationRequest):
        self.prepared_on.append(threading.get_ident())
        if request.grammar_spec == "wait":
            assert self.release.wait(10)
        if request.grammar_spec == "bad":
            raise ContractError("grammar_spec", "invalid json_schema grammar: bad")
        return ("compiled", request.grammar_kind) if request.grammar_kind else None

    def close(self) -> None:
        self.closed = True

    def add_request(self, request_id: str, request: GenerationRequest, arrival_time=None, prepared=None) -> None:
        self.thread_ids.add(threading.get_ident())
        if request.grammar_kind not in ("", "json_object"):
            raise ContractError("grammar_kind", f"{request.grammar_kind!r} is not a grammar kind")
        if request_id in self.requests:
            raise ContractError("request_id", f"{request_id!r} is already in flight")
        self.requests[request_id] = []
        self.limits[request_id] = request.sampling.max_tokens or 3
        self.arrivals[request_id] = arrival_time
        self.grammars[request_id] = prepared

    def lora_requests(self) -> dict:
        return {}

    max_loras = 0

    def abort_request(self, request_id: str) -> None:
        self.abort_calls.append(request_id)
        if request_id in self.requests:
            self.aborted.add(request_id)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        time.sleep(0.001)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")  # the requests stay in flight, as in the real engine
        outs = []
        for rid, tokens in list(self.requests.items()):
            if rid in self.aborted:
                outs.append(RequestOutput(rid, [], final=_final(len(tokens), FinishReason.ABORT)))
            else:
                tokens.append(len(tokens))
                self.emitted += 1
                done = len(tokens) >= self.limits[rid]
                outs.append(RequestOutput(rid, [tokens[-1]], final=_final(len(tokens)) if done else None))
                if not done:
                    continue
            del self.requests[rid]
            self.aborted.discard(rid)
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def num_free_blocks(self) -> int:
        return self.total - len(self.requests)

    def num_total_blocks(self) -> int:
        return self.total

    num_preemptions = 0

    def spec_stats(self) -> SpecStats:
        return SpecStats(num_accepted_tokens=self.emitted)

    def num_running(self) -> int:
        return len(self.requests)

    def num_waiting(self) -> int:
        return 0


class Pipeline:
    def __init__(self, engine: FakeEngine):
        self.engine = engine
        self.live = LiveRequests()
        self.thread = EngineThread(lambda: engine, self.live.push, self.live.fail)
        self.thread.start()

    def submit(self, rid: str, prompt: list[int], max_tokens: int = 3, stream: bool = True, **fields) -> FakeSender:
        sender = FakeSender(rid)
        request = GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens), stream=stream, **fields)
        self.live.open(rid, sender, stream)
        self.thread.accept(rid, request, time.monotonic())
        return sender

    def collect(self, rid: str, timeout: float = 5.0) -> list[Packet]:
        got: list[Packet] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got += [p for p in self.live.take(0.05) if p.request_id == rid]
            if got and got[-1].is_last:
                return got
        raise AssertionError(f"no final for {rid}: {got}")


@pytest.fixture
def pipe():
    p = Pipeline(FakeEngine())
    yield p
    p.thread.shutdown()


def test_engine_thread_streams_a_request_to_its_final(pipe):
    sender = pipe.submit("a", [1, 2], max_tokens=3)
    packets = pipe.collect("a")
    assert all(p.sender is sender for p in packets)
    assert [t for p in packets for t in p.output.token_ids] == [0, 1, 2]
    assert packets[-1].output.final.num_output_tokens == 3
    assert pipe.engine.thread_ids == {pipe.thread._thread.ident}


def test_engine_thread_passes_the_arrival_and_the_prepared_grammar(pipe):
    before = time.monotonic()
    pipe.submit("g", [1], max_tokens=1, grammar_kind="json_object")
    pipe.collect("g")
    assert pipe.engine.grammars["g"] == ("compiled", "json_object")
    [prepared_on] = pipe.engine.prepared_on  # on a thread of its own
    assert prepared_on not in (threading.get_ident(), pipe.thread._thread.ident)
    assert before <= pipe.engine.arrivals["g"] <= time.monotonic()
    assert pipe.thread.model_info == MODEL_INFO


def test_engine_thread_sleeps_when_idle(pipe):
    pipe.submit("a", [1], max_tokens=2)
    pipe.collect("a")
    time.sleep(0.05)
    steps = pipe.engine.steps
    time.sleep(0.2)
    assert pipe.engine.steps == steps
    assert pipe.thread.snapshot.kv_blocks_used == 0
    assert pipe.thread.snapshot.requests_in_flight == 0


def test_rejected_request_fails_alone(pipe):
    pipe.submit("ok", [1], max_tokens=20)
    pipe.submit("bad", [1], grammar_kind="yaml")
    (packet,) = pipe.collect("bad")
    assert isinstance(packet.error, ContractError) and packet.error.field == "grammar_kind"
    assert str(packet.error) == "grammar_kind: 'yaml' is not a grammar kind"
    assert pipe.collect("ok")[-1].output.final.num_output_tokens == 20


def test_abort_delivers_an_abort_final(pipe):
    pipe.submit("a", [1], max_tokens=10_000)
    time.sleep(0.05)
    pipe.thread.abort("a")
    packets = pipe.collect("a")
    assert packets[-1].output.final.finish_reason is FinishReason.ABORT
    pipe.thread.abort("a")  # aborting a finished request is harmless
    pipe.thread.abort("never-seen")


def test_step_exception_fails_in_flight_requests_and_keeps_serving(pipe):
    pipe.submit("a", [1], max_tokens=10_000)
    time.sleep(0.05)
    pipe.engine.fail_next_step = True
    packets = pipe.collect("a")
    assert str(packets[-1].error) == "the engine failed: RuntimeError: boom"
    pipe.submit("b", [1], max_tokens=2)
    assert pipe.collect("b")[-1].output.final.num_output_tokens == 2
    assert pipe.thread.alive
    assert "a" in pipe.engine.abort_calls and "a" not in pipe.engine.requests  # aborted in the engine too


def test_shutdown_aborts_in_flight_requests_with_finals():
    p = Pipeline(FakeEngine())
    p.submit("a", [1], max_tokens=10_000)
    time.sleep(0.05)
    p.thread.shutdown()
    assert not p.thread.alive
    packets = p.collect("a", timeout=1.0)
    assert packets[-1].output.final.finish_reason is FinishReason.ABORT
    sender = FakeSender("late")
    p.live.open("late", sender, True)
    p.thread.submit("late", GenerationRequest([1]), time.monotonic(), None)
    [late] = p.collect("late", timeout=1.0)
    assert isinstance(late.error, EngineUnavailable) and str(late.error) == "the server is shutting down"


def test_a_request_being_prepared_holds_up_neither_the_caller_nor_a_request_without_a_grammar(pipe):
    start = time.monotonic()
    pipe.submit("g", [1], max_tokens=2, grammar_kind="json_object", grammar_spec="wait")
    pipe.submit("p", [1], max_tokens=2)
    assert pipe.collect("p")[-1].output.final.num_output_tokens == 2
    assert time.monotonic() - start < 5.0 and "g" not in pipe.engine.arrivals  # g still compiles
    pipe.engine.release.set()
    assert pipe.collect("g")[-1].output.final.num_output_tokens == 2
    assert pipe.engine.grammars["g"] == ("compiled", "json_object")


def test_a_bad_grammar_is_the_requests_one_error(pipe):
    pipe.submit("bad", [1], grammar_kind="json_schema", grammar_spec="bad")
    [packet] = pipe.collect("bad")
    assert isinstance(packet.error, ContractError) and packet.error.field == "grammar_spec"
    assert "bad" not in pipe.engine.arrivals


def test_an_abort_while_preparing_ends_the_request_at_once(pipe):
    pipe.submit("g", [1, 2, 3], grammar_kind="json_object", grammar_spec="wait")
    time.sleep(0.05)
    pipe.thread.abort("g")
    [packet] = pipe.collect("g")
    final = packet.output.final
    assert final.finish_reason is FinishReason.ABORT and final.finish_guard is FinishGuard.CANCELLED
    assert packet.output.token_ids == [] and final.num_prompt_tokens == 3 and final.num_output_tokens == 0
    pipe.thread.abort("g")  # again: nothing more
    pipe.engine.release.set()  # its grammar compiles after all: dropped, never in the engine
    pipe.submit("after", [1], max_tokens=1)
    pipe.collect("after")
    assert "g" not in pipe.engine.arrivals and pipe.engine.abort_calls == []
    assert pipe.live.take(0) == []


def test_shutdown_fails_requests_still_preparing_and_closes_the_engine():
    p = Pipeline(FakeEngine())
    p.submit("g", [1], grammar_kind="json_object", grammar_spec="wait")
    time.sleep(0.05)
    p.thread.shutdown()
    [packet] = p.collect("g", timeout=1.0)
    assert str(packet.error) == "the server shut down before the request finished"
    assert p.engine.closed
    p.engine.release.set()
    time.sleep(0.05)
    assert p.live.take(0) == [] and "g" not in p.engine.arrivals


def test_engine_is_built_on_the_engine_thread_and_build_errors_surface():
    built_on = []

    def make():
        built_on.append(threading.get_ident())
        return FakeEngine()

    thread = EngineThread(make, lambda outs: None, lambda rid, exc: None)
    thread.start()
    assert built_on == [thread._thread.ident]
    assert thread.model_info == MODEL_INFO
    thread.shutdown()

    def broken():
        raise ValueError("no such model folder")

    failing = EngineThread(broken, lambda outs: None, lambda rid, exc: None)
    with pytest.raises(ValueError, match="no such model folder"):
        failing.start()
    assert not failing.alive


# ---------------------------------------------------------------------------
# Gauges, with a fake make_metric


class FakeMetric:
    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self.calls: list[tuple[str, float]] = []

    def set(self, value) -> None:
        assert self.kind == "gauge", self.name
        self.calls.append(("set", value))

    def increment(self, value) -> None:
        assert self.kind == "counter", self.name
        self.calls.append(("increment", value))


class FakeMetrics:
    def __init__(self):
        self.made: dict[str, FakeMetric] = {}

    def __call__(self, name: str, description: str, kind: str, labels: dict[str, str] | None = None) -> FakeMetric:
        """Keyed as the series reads on a metrics page: name{label="value",...}."""
        key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        assert description and key not in self.made
        self.made[key] = FakeMetric(key, kind)
        return self.made[key]

    def calls(self) -> dict[str, list[tuple[str, float]]]:
        """Every metric's calls since the last look."""
        out = {name: list(m.calls) for name, m in self.made.items() if m.calls}
        for m in self.made.values():
            m.calls.clear()
        return out


GAUGE_NAMES = [
    "llm_kv_blocks_used",
    "llm_kv_blocks_total",
    "llm_requests_in_flight",
    "llm_requests_running",
    "llm_requests_waiting",
]


def _snapshot(free=6, running=2, waiting=1, preemptions=0) -> EngineSnapshot:
    return EngineSnapshot(
        requests_in_flight=running + waiting,
        kv_blocks_free=free,
        kv_blocks_total=8,
        requests_running=running,
        requests_waiting=waiting,
        num_preemptions=preemptions,
    )


def test_gauges_are_set_only_when_their_values_change():
    metrics = FakeMetrics()
    gauges = Gauges(metrics, every_s=0.0)
    assert {n: m.kind for n, m in metrics.made.items()} == {
        **dict.fromkeys(GAUGE_NAMES, "gauge"),
        "llm_preemptions_total": "counter",
        "llm_responses_total": "counter",
        "llm_generated_tokens_total": "counter",
        "llm_spec_decode_num_drafts_total": "counter",
        "llm_spec_decode_num_draft_tokens_total": "counter",
        "llm_spec_decode_num_accepted_tokens_total": "counter",
        "llm_lora_max_loras": "gauge",
    }
    gauges.publish(_snapshot(), in_flight=4)
    assert metrics.calls() == {
        "llm_kv_blocks_used": [("set", 2)],
        "llm_kv_blocks_total": [("set", 8)],
        "llm_requests_in_flight": [("set", 4)],
        "llm_requests_running": [("set", 2)],
        "llm_requests_waiting": [("set", 1)],
        "llm_lora_max_loras": [("set", 0)],
    }
    gauges.publish(_snapshot(), in_flight=4)
    assert metrics.calls() == {}  # nothing changed: no round trip
    gauges.publish(_snapshot(free=3, waiting=0), in_flight=4)
    calls = metrics.calls()
    assert calls["llm_kv_blocks_used"] == [("set", 5)] and calls["llm_requests_waiting"] == [("set", 0)]
    assert not any(op == "increment" for c in calls.values() for op, _ in c)
    gauges.publish(_snapshot(free=3, waiting=0), in_flight=4)
    assert metrics.calls() == {}


def test_counters_are_incremented_by_the_deltas():
    metrics = FakeMetrics()
    gauges = Gauges(metrics, every_s=0.0)
    gauges.publish(_snapshot(preemptions=2), in_flight=3)
    assert metrics.calls()["llm_preemptions_total"] == [("increment", 2)]
    gauges.count(3)
    gauges.count(0)  # a final without tokens is still a response
    gauges.count(5)
    gauges.publish(_snapshot(preemptions=2), in_flight=3)
    assert metrics.calls() == {
        "llm_responses_total": [("increment", 3)],
        "llm_generated_tokens_total": [("increment", 8)],
    }
    gauges.publish(_snapshot(preemptions=5), in_flight=3)
    assert metrics.calls() == {"llm_preemptions_total": [("increment", 3)]}  # the delta, not the total
    gauges.publish(_snapshot(preemptions=5), in_flight=3)
    assert metrics.calls() == {}


def test_speculation_counters_are_published_per_draft_position():
    metrics = FakeMetrics()
    gauges = Gauges(metrics, every_s=0.0)
    snapshot = _snapshot()
    snapshot.spec.num_drafts, snapshot.spec.num_draft_tokens, snapshot.spec.num_accepted_tokens = 3, 9, 5
    snapshot.spec.accepted_per_pos = [3, 2, 0]
    gauges.publish(snapshot, in_flight=3)
    calls = metrics.calls()
    assert {name: calls[name] for name in calls if "spec" in name} == {
        "llm_spec_decode_num_drafts_total": [("increment", 3)],
        "llm_spec_decode_num_draft_tokens_total": [("increment", 9)],
        "llm_spec_decode_num_accepted_tokens_total": [("increment", 5)],
        'llm_spec_decode_num_accepted_tokens_per_pos_total{position="0"}': [("increment", 3)],
        'llm_spec_decode_num_accepted_tokens_per_pos_total{position="1"}': [("increment", 2)],
    }
    assert metrics.made['llm_spec_decode_num_accepted_tokens_per_pos_total{position="2"}'].kind == "counter"
    snapshot.spec.num_drafts, snapshot.spec.accepted_per_pos = 4, [4, 2, 1]
    gauges.publish(snapshot, in_flight=3)
    assert metrics.calls() == {
        "llm_spec_decode_num_drafts_total": [("increment", 1)],
        'llm_spec_decode_num_accepted_tokens_per_pos_total{position="0"}': [("increment", 1)],
        'llm_spec_decode_num_accepted_tokens_per_pos_total{position="2"}': [("increment", 1)],
    }


def test_gauges_publish_at_most_every_interval():
    metrics = FakeMetrics()
    gauges = Gauges(metrics, every_s=60.0)
    gauges.publish(_snapshot(), in_flight=1)
    metrics.calls()
    gauges.count(4)
    gauges.publish(_snapshot(free=0, preemptions=1), in_flight=2)
    assert metrics.calls() == {}  # too soon: kept for the next publish


# ---------------------------------------------------------------------------
# SenderLoop: the real registry, engine thread and gauges; a fake responder and senders


class FakeResponder:
    """Records each response on its sender; the final flag as model.py sets it."""

    def __init__(self):
        self.lock = threading.Lock()

    def send_output(self, sender: FakeSender, output: RequestOutput) -> None:
        with self.lock:
            sender.outputs.append((output, output.finished))

    def send_error(self, sender: FakeSender, error: Exception) -> None:
        with self.lock:
            sender.errors.append(error)


class Serving:
    """The model's threads as model.py wires them, minus Triton."""

    def __init__(self, gauges_every_s: float = 0.0):
        self.pipe = Pipeline(FakeEngine())
        self.metrics = FakeMetrics()
        self.loop = SenderLoop(
            self.pipe.live,
            FakeResponder(),
            self.pipe.thread,
            Gauges(self.metrics, every_s=gauges_every_s),
            cancel_check_s=0.01,
            idle_wake_s=0.01,
        )
        self.sender_thread = threading.Thread(target=self.loop.run, daemon=True)
        self.sender_thread.start()

    def wait_for(self, condition, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.005)

    def stop(self) -> None:
        self.pipe.thread.shutdown()
        self.pipe.live.close()
        self.sender_thread.join(5.0)
        assert not self.sender_thread.is_alive()


@pytest.fixture
def serving():
    s = Serving()
    yield s
    s.stop()


def _finished(sender: FakeSender) -> bool:
    return bool(sender.errors) or bool(sender.outputs and sender.outputs[-1][1])


def test_sender_loop_sends_every_token_with_the_final_flag_on_the_last(serving):
    streamed = serving.pipe.submit("s", [1], max_tokens=5)
    whole = serving.pipe.submit("w", [1], max_tokens=4, stream=False)
    serving.wait_for(lambda: _finished(streamed) and _finished(whole))
    tokens = [t for out, _ in streamed.outputs for t in out.token_ids]
    assert tokens == [0, 1, 2, 3, 4]
    flags = [final for _, final in streamed.outputs]
    assert flags[-1] and not any(flags[:-1])
    assert streamed.outputs[-1][0].final.num_output_tokens == 5
    [(out, final)] = whole.outputs  # not streamed: one response
    assert final and out.token_ids == [0, 1, 2, 3] and out.final.finish_reason is FinishReason.LENGTH
    assert streamed.errors == whole.errors == []
    serving.wait_for(lambda: len(serving.pipe.live) == 0)
    # and the gauges counted what was sent
    serving.wait_for(lambda: sum(v for _, v in serving.metrics.made["llm_generated_tokens_total"].calls) == 9)
    responses = sum(v for _, v in serving.metrics.made["llm_responses_total"].calls)
    assert responses == len(streamed.outputs) + 1


def test_a_final_goes_out_after_the_figures_that_count_it():
    """Gauges throttled to once a minute: still, whoever has a whole answer finds its
    tokens (and the engine's figures of its last step) already published."""
    serving = Serving(gauges_every_s=60.0)
    try:
        for rid, max_tokens in (("a", 5), ("b", 3)):
            sender = serving.pipe.submit(rid, [1], max_tokens=max_tokens)
            serving.wait_for(lambda sender=sender: _finished(sender))
            total = lambda name: sum(v for _, v in serving.metrics.made[name].calls)  # noqa: E731
            assert total("llm_generated_tokens_total") == serving.pipe.engine.emitted
            assert total("llm_spec_decode_num_accepted_tokens_total") == serving.pipe.engine.emitted
    finally:
        serving.stop()


def test_a_failed_request_gets_its_error_as_the_last_response(serving):
    sender = serving.pipe.submit("bad", [1], grammar_kind="yaml")
    serving.wait_for(lambda: _finished(sender))
    [error] = sender.errors
    assert isinstance(error, ContractError) and error.field == "grammar_kind"
    assert sender.outputs == []


def test_a_cancelled_request_is_aborted_once_and_gets_its_abort_final(serving):
    cancelled = serving.pipe.submit("c", [1], max_tokens=100_000)
    running = serving.pipe.submit("r", [1], max_tokens=100_000)
    serving.wait_for(lambda: len(cancelled.outputs) >= 2)
    cancelled.cancelled = True
    serving.wait_for(lambda: _finished(cancelled))
    last, final = cancelled.outputs[-1]
    assert final and last.final.finish_reason is FinishReason.ABORT
    assert last.final.finish_guard is FinishGuard.CANCELLED
    assert not any(flag for _, flag in cancelled.outputs[:-1])
    checks = running.cancel_checks
    serving.wait_for(lambda: running.cancel_checks >= checks + 5)  # several more checks pass
    assert serving.pipe.engine.abort_calls == ["c"]  # aborted exactly once
    assert not _finished(running) and "r" in serving.pipe.engine.requests  # the other runs on


def test_a_request_cancelled_while_preparing_gets_one_abort_final(serving):
    sender = serving.pipe.submit("g", [1], grammar_kind="json_object", grammar_spec="wait")
    sender.cancelled = True
    serving.wait_for(lambda: _finished(sender))
    [(output, final)] = sender.outputs
    assert final and output.final.finish_reason is FinishReason.ABORT
    serving.pipe.engine.release.set()
    serving.wait_for(lambda: len(serving.pipe.live) == 0)
    time.sleep(0.05)
    assert len(sender.outputs) == 1 and sender.errors == [] and "g" not in serving.pipe.engine.arrivals


def test_abort_all_aborts_every_live_request(serving):
    senders = [serving.pipe.submit(rid, [1], max_tokens=100_000, stream=rid != "n") for rid in ("a", "b", "n")]
    serving.wait_for(lambda: serving.pipe.engine.steps >= 3)
    serving.loop.abort_all()
    serving.wait_for(lambda: all(_finished(s) for s in senders))
    for sender in senders:
        last, final = sender.outputs[-1]
        assert final and last.final.finish_reason is FinishReason.ABORT, sender
    assert sorted(serving.pipe.engine.abort_calls) == ["a", "b", "n"]
    serving.loop.abort_all()  # nothing live: nothing more to abort
    assert sorted(serving.pipe.engine.abort_calls) == ["a", "b", "n"]
    assert len(serving.pipe.live) == 0
