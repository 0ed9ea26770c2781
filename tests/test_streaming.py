"""The output pipeline without Triton: the engine thread feeding the coalescer."""

from __future__ import annotations

import threading
import time

import pytest

from backend.contract import ContractError
from backend.engine_thread import EngineThread
from backend.request import EngineRequest, FinalStats, FinishReason, RequestOutput, StopGuard
from backend.streaming import Packet, StreamCoalescer


def _final(completion_tokens: int, reason: FinishReason = FinishReason.LENGTH) -> FinalStats:
    guard = StopGuard.CANCELLED if reason is FinishReason.ABORT else StopGuard.MAX_TOKENS
    return FinalStats(reason, guard, 3, completion_tokens, 0, 0.01, 0.02)


# ---------------------------------------------------------------------------
# StreamCoalescer


def test_streaming_packs_all_pending_tokens_into_one_packet():
    co = StreamCoalescer()
    co.open("a", stream=True)
    co.push([RequestOutput("a", [1])])
    co.push([RequestOutput("a", [2, 3])])
    co.push([RequestOutput("a", [4])])
    assert co.take(0) == [Packet("a", [1, 2, 3, 4])]
    assert co.take(0) == []
    co.push([RequestOutput("a", [5])])
    assert co.take(0) == [Packet("a", [5])]


def test_final_rides_on_the_last_packet_and_closes_the_stream():
    co = StreamCoalescer()
    co.open("a", stream=True)
    final = _final(3)
    co.push([RequestOutput("a", [1, 2])])
    co.push([RequestOutput("a", [3], final)])
    packets = co.take(0)
    assert packets == [Packet("a", [1, 2, 3], final)]
    assert packets[0].is_last
    assert len(co) == 0
    co.push([RequestOutput("a", [9])])  # a closed stream drops late outputs
    assert co.take(0) == []


def test_non_streaming_request_is_sent_once_at_the_end():
    co = StreamCoalescer()
    co.open("n", stream=False)
    co.push([RequestOutput("n", [1])])
    co.push([RequestOutput("n", [2, 3])])
    assert co.take(0) == []
    final = _final(4, FinishReason.STOP)
    co.push([RequestOutput("n", [4], final)])
    assert co.take(0) == [Packet("n", [1, 2, 3, 4], final)]
    assert co.take(0) == []


def test_streams_are_independent_and_ordered_by_readiness():
    co = StreamCoalescer()
    for rid, stream in (("a", True), ("b", True), ("n", False)):
        co.open(rid, stream)
    co.push([RequestOutput("b", [10]), RequestOutput("a", [20]), RequestOutput("n", [30])])
    co.push([RequestOutput("a", [21]), RequestOutput("b", [11])])
    assert co.take(0) == [Packet("b", [10, 11]), Packet("a", [20, 21])]
    assert sorted(co.open_ids()) == ["a", "b", "n"]


def test_final_without_tokens_is_a_packet():
    co = StreamCoalescer()
    co.open("a", stream=True)
    final = _final(0, FinishReason.ABORT)
    co.push([RequestOutput("a", [], final)])
    assert co.take(0) == [Packet("a", [], final)]


def test_failure_drops_pending_tokens_and_ends_the_stream():
    co = StreamCoalescer()
    co.open("a", stream=True)
    co.open("n", stream=False)
    co.push([RequestOutput("a", [1, 2]), RequestOutput("n", [7])])
    bad_prompt = ContractError("prompt_tokens", "must not be empty")
    engine_down = RuntimeError("the engine failed")
    co.fail("a", bad_prompt)
    co.fail("n", engine_down)
    packets = co.take(0)
    assert packets == [Packet("a", [], error=bad_prompt), Packet("n", [], error=engine_down)]
    assert all(p.is_last for p in packets)
    assert len(co) == 0
    co.fail("a", RuntimeError("again"))  # failing a closed stream is a no-op
    assert co.take(0) == []


def test_output_after_final_is_ignored():
    co = StreamCoalescer()
    co.open("a", stream=True)
    final = _final(1)
    co.push([RequestOutput("a", [1], final), RequestOutput("a", [2])])
    co.fail("a", RuntimeError("late"))
    assert co.take(0) == [Packet("a", [1], final)]


def test_logprobs_stay_aligned_with_their_tokens_when_packed():
    co = StreamCoalescer()
    co.open("a", stream=True)
    co.push(
        [RequestOutput("a", [1], logprobs=[-0.1], top_logprobs=[([1, 2], [-0.1, -2.0])], prompt_logprobs=[None, -3.0])]
    )
    co.push([RequestOutput("a", [5], logprobs=[-0.5], top_logprobs=[([5, 6], [-0.5, -1.0])])])
    packet = co.take(0)[0]
    assert packet.token_ids == [1, 5] and packet.logprobs == [-0.1, -0.5]
    assert packet.top_logprobs == [([1, 2], [-0.1, -2.0]), ([5, 6], [-0.5, -1.0])]
    assert packet.prompt_logprobs == [None, -3.0]
    co.push([RequestOutput("a", [7], logprobs=[-0.7], top_logprobs=[([7, 8], [-0.7, -0.9])])])
    assert co.take(0) == [Packet("a", [7], logprobs=[-0.7], top_logprobs=[([7, 8], [-0.7, -0.9])])]


def test_open_twice_is_refused():
    co = StreamCoalescer()
    co.open("a", stream=True)
    with pytest.raises(ValueError):
        co.open("a", stream=False)


def test_take_waits_for_a_push_from_another_thread():
    co = StreamCoalescer()
    co.open("a", stream=True)
    timer = threading.Timer(0.05, co.push, args=([RequestOutput("a", [1])],))
    timer.start()
    start = time.monotonic()
    assert co.take(5.0) == [Packet("a", [1])]
    assert time.monotonic() - start < 2.0
    timer.join()


def test_close_wakes_a_waiting_taker():
    co = StreamCoalescer()
    threading.Timer(0.05, co.close).start()
    start = time.monotonic()
    assert co.take(5.0) == []
    assert co.closed
    assert time.monotonic() - start < 2.0


# ---------------------------------------------------------------------------
# EngineThread, with a scripted fake engine


class FakeEngine:
    """Emits one token per step per request, up to max_tokens; can be told to fail."""

    def __init__(self, blocks: int = 8):
        self.requests: dict[str, list[int]] = {}
        self.limits: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.fail_next_step = False
        self.steps = 0
        self.total = blocks
        self.thread_ids: set[int] = set()

    def add_request(self, req: EngineRequest) -> None:
        self.thread_ids.add(threading.get_ident())
        if not req.prompt_token_ids:
            raise ContractError("prompt_tokens", "must not be empty")
        self.requests[req.request_id] = []
        self.limits[req.request_id] = req.sampling.max_tokens or 3

    def abort_request(self, request_id: str) -> None:
        if request_id in self.requests:
            self.aborted.add(request_id)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        time.sleep(0.001)
        if self.fail_next_step:
            self.fail_next_step = False
            self.requests.clear()
            raise RuntimeError("boom")
        outs = []
        for rid, tokens in list(self.requests.items()):
            if rid in self.aborted:
                outs.append(RequestOutput(rid, [], _final(len(tokens), FinishReason.ABORT)))
            else:
                tokens.append(len(tokens))
                done = len(tokens) >= self.limits[rid]
                outs.append(RequestOutput(rid, [tokens[-1]], _final(len(tokens)) if done else None))
                if not done:
                    continue
            del self.requests[rid]
            self.aborted.discard(rid)
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def num_free_blocks(self) -> int:
        return self.total - len(self.requests)

    def num_total_blocks(self) -> int:
        return self.total

    num_preemptions = 0

    def num_running(self) -> int:
        return len(self.requests)

    def num_waiting(self) -> int:
        return 0


class Pipeline:
    def __init__(self, engine: FakeEngine):
        self.co = StreamCoalescer()
        self.thread = EngineThread(lambda: engine, self.co.push, self.co.fail)
        self.thread.start()

    def submit(self, rid: str, prompt: list[int], max_tokens: int = 3, stream: bool = True) -> None:
        from backend.request import SamplingParams

        self.co.open(rid, stream)
        self.thread.submit(EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens)))

    def collect(self, rid: str, timeout: float = 5.0) -> list[Packet]:
        got: list[Packet] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got += [p for p in self.co.take(0.05) if p.request_id == rid]
            if got and got[-1].is_last:
                return got
        raise AssertionError(f"no final for {rid}: {got}")


@pytest.fixture
def pipe():
    engine = FakeEngine()
    p = Pipeline(engine)
    p.engine = engine
    yield p
    p.thread.shutdown()


def test_engine_thread_streams_a_request_to_its_final(pipe):
    pipe.submit("a", [1, 2], max_tokens=3)
    packets = pipe.collect("a")
    assert [t for p in packets for t in p.token_ids] == [0, 1, 2]
    assert packets[-1].final.completion_tokens == 3
    assert pipe.engine.thread_ids == {pipe.thread._thread.ident}


def test_engine_thread_sleeps_when_idle(pipe):
    pipe.submit("a", [1], max_tokens=2)
    pipe.collect("a")
    time.sleep(0.05)
    steps = pipe.engine.steps
    time.sleep(0.2)
    assert pipe.engine.steps == steps
    assert pipe.thread.snapshot.kv_blocks_used == 0


def test_rejected_request_fails_alone(pipe):
    pipe.submit("ok", [1], max_tokens=20)
    pipe.submit("bad", [])
    (packet,) = pipe.collect("bad")
    assert isinstance(packet.error, ContractError) and packet.error.field == "prompt_tokens"
    assert str(packet.error) == "prompt_tokens: must not be empty"
    assert pipe.collect("ok")[-1].final.completion_tokens == 20


def test_abort_delivers_an_abort_final(pipe):
    pipe.submit("a", [1], max_tokens=10_000)
    time.sleep(0.05)
    pipe.thread.abort("a")
    packets = pipe.collect("a")
    assert packets[-1].final.finish_reason is FinishReason.ABORT
    pipe.thread.abort("a")  # aborting a finished request is harmless
    pipe.thread.abort("never-seen")


def test_step_exception_fails_in_flight_requests_and_keeps_serving(pipe):
    pipe.submit("a", [1], max_tokens=10_000)
    time.sleep(0.05)
    pipe.engine.fail_next_step = True
    packets = pipe.collect("a")
    assert str(packets[-1].error) == "the engine failed: RuntimeError: boom"
    pipe.submit("b", [1], max_tokens=2)
    assert pipe.collect("b")[-1].final.completion_tokens == 2
    assert pipe.thread.alive


def test_shutdown_aborts_in_flight_requests_with_finals():
    engine = FakeEngine()
    p = Pipeline(engine)
    p.submit("a", [1], max_tokens=10_000)
    time.sleep(0.05)
    p.thread.shutdown()
    assert not p.thread.alive
    packets = p.collect("a", timeout=1.0)
    assert packets[-1].final.finish_reason is FinishReason.ABORT
    p.co.open("late", True)
    p.thread.submit(EngineRequest("late", [1]))
    assert str(p.collect("late", timeout=1.0)[-1].error) == "the server is shutting down"


def test_engine_is_built_on_the_engine_thread_and_build_errors_surface():
    built_on = []

    def make():
        built_on.append(threading.get_ident())
        return FakeEngine()

    thread = EngineThread(make, lambda outs: None, lambda rid, exc: None)
    thread.start()
    assert built_on == [thread._thread.ident]
    thread.shutdown()

    def broken():
        raise ValueError("no such model folder")

    failing = EngineThread(broken, lambda outs: None, lambda rid, exc: None)
    with pytest.raises(ValueError, match="no such model folder"):
        failing.start()
    assert not failing.alive
