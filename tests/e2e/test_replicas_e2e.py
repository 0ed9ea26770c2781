"""Three tritonserver instances of the default model behind the frontend's router
(launcher/replica_stack.py: nats, Dynamo's discovery and KV-aware router, one shim per
instance), driven with the openai client. Where each request went is read from the
frontend's per-instance counters (`llm_router_requests_total`), as before and after.

The order matters only for speed: every test reads counter deltas, so each stands alone."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from launcher.procs import find_stubs
from launcher.replica_stack import ReplicaStack

pytestmark = pytest.mark.e2e

REPLICAS = 3
_ROUTED = re.compile(r'^llm_router_requests_total\{instance="([^"]+)",reason="([^"]+)"\} (\d+)', re.MULTILINE)
_UP = re.compile(r'^llm_router_instance_up\{instance="([^"]+)"\} (\d)', re.MULTILINE)


@pytest.fixture(scope="module")
def replicas(model_path):
    with ReplicaStack(model_path, replicas=REPLICAS) as stack:
        yield stack


def _client(stack: ReplicaStack, timeout: float = 120) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=timeout)


def _routed(stack: ReplicaStack) -> dict[tuple[str, str], int]:
    """(instance, reason) -> requests routed so far."""
    page = httpx.get(stack.metrics_url, timeout=10).text
    return {(m[1], m[2]): int(m[3]) for m in _ROUTED.finditer(page)}


def _delta(before: dict, after: dict) -> tuple[Counter, Counter]:
    """Per instance, and per reason, the requests routed between two readings."""
    by_instance, by_reason = Counter(), Counter()
    for (instance, reason), count in after.items():
        gained = count - before.get((instance, reason), 0)
        by_instance[instance] += gained
        by_reason[reason] += gained
    return +by_instance, +by_reason


def _system_prompt(family: int) -> str:
    rng = random.Random(family)
    words = "ledger harbor violet copper meadow signal orbit canvas thistle lantern quartz ember".split()
    rules = [f"Rule {i}: always mention the {rng.choice(words)} and the {rng.choice(words)}." for i in range(40)]
    return f"You are assistant number {family}. " + " ".join(rules)


def _chat(stack: ReplicaStack, messages: list[dict], max_tokens: int = 4, **extra):
    return _client(stack).chat.completions.create(
        model=stack.served_model_name, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra
    )


def _unrelated(seed: int) -> list[int]:
    """A prompt of random token ids: no block of it is cached anywhere."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(40)]


def _complete(stack: ReplicaStack, prompt: list[int], max_tokens: int = 8, **extra):
    return _client(stack).completions.create(
        model=stack.served_model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra
    )


def test_all_instances_are_in_rotation(replicas):
    assert replicas.in_rotation() == REPLICAS
    assert httpx.get(replicas.frontend.url + "/health", timeout=10).status_code == 200


def test_unrelated_prompts_spread_over_every_instance(replicas):
    before = _routed(replicas)
    with ThreadPoolExecutor(9) as pool:
        list(pool.map(lambda seed: _complete(replicas, _unrelated(seed), max_tokens=16), range(100, 109)))
    by_instance, by_reason = _delta(before, _routed(replicas))
    assert len(by_instance) == REPLICAS, by_instance
    assert max(by_instance.values()) <= 5, by_instance
    assert set(by_reason) == {"load"}, by_reason


def test_prefix_families_land_where_their_prefix_is_cached(replicas):
    """3 families x 10 questions under one long system prompt each: >= 90% of a family's
    requests on one instance, and the repeats find the prefix cached."""
    for family in range(3):
        system = {"role": "system", "content": _system_prompt(family)}
        before = _routed(replicas)
        first = _chat(replicas, [system, {"role": "user", "content": "Question 0: hello?"}])
        time.sleep(0.3)  # the first request's KV events reach the router
        questions = [
            [system, {"role": "user", "content": f"Question {q}: what is {q} times {q + 3}?"}] for q in range(9)
        ]
        with ThreadPoolExecutor(3) as pool:
            repeats = list(pool.map(lambda messages: _chat(replicas, messages), questions))
        by_instance, by_reason = _delta(before, _routed(replicas))
        assert max(by_instance.values()) >= 9, (family, by_instance)
        assert by_reason["kv"] >= 8, (family, by_reason)
        assert first.usage.prompt_tokens > 200
        cached = [r.usage.prompt_tokens_details.cached_tokens for r in repeats]
        assert sum(1 for c in cached if c >= 0.8 * first.usage.prompt_tokens) >= 8, cached


def test_a_burst_on_a_new_prefix_lands_where_its_first_request_went(replicas):
    """6 questions under a system prompt no instance has seen, sent at once: no engine
    has published its blocks yet, but the router remembers where it sent the first."""
    system = {"role": "system", "content": _system_prompt(7)}
    before = _routed(replicas)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda q: _chat(replicas, [system, {"role": "user", "content": f"Burst {q}: hi?"}]), range(6)))
    by_instance, by_reason = _delta(before, _routed(replicas))
    assert max(by_instance.values()) == 6, by_instance
    assert by_reason["kv"] == 5 and by_reason["load"] == 1, by_reason


@pytest.mark.parametrize("field", ["session_id", "prompt_cache_key"])
def test_a_named_session_stays_on_one_instance(replicas, field):
    """Turns that share no prefix (random token prompts) but one session name stay on
    one instance, sent at once too; the same turns unnamed spread by load."""
    before = _routed(replicas)
    _complete(replicas, _unrelated(1000), **{field: f"conversation-{field}"})
    with ThreadPoolExecutor(4) as pool:
        list(
            pool.map(
                lambda t: _complete(replicas, _unrelated(1000 + t), **{field: f"conversation-{field}"}), range(1, 5)
            )
        )
    by_instance, by_reason = _delta(before, _routed(replicas))
    assert len(by_instance) == 1, by_instance
    assert by_reason["session"] == 4, by_reason
    before = _routed(replicas)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda t: _complete(replicas, _unrelated(2000 + t)), range(4)))
    unnamed, _ = _delta(before, _routed(replicas))
    assert len(unnamed) > 1, unnamed


def test_the_same_prompt_keeps_its_instance_by_its_hash(replicas):
    """No name given: the frontend's session_hash of the first prompt tokens is the key."""
    prompt = _unrelated(3000)
    before = _routed(replicas)
    for _ in range(4):
        _complete(replicas, prompt, max_tokens=2)
    by_instance, _ = _delta(before, _routed(replicas))
    assert len(by_instance) == 1, by_instance


class TestAnInstanceDies:
    """kill -9 of one instance's stub under load: every request ends (an answer or an
    explicit error), /health stays ready, the rest serve, the instance rejoins."""

    def test_kill_stub_under_load(self, replicas):
        victim = replicas.servers[0]
        results: list[object] = []
        lock = threading.Lock()

        def one(seed: int) -> None:
            try:
                stream = _client(replicas, timeout=90).completions.create(
                    model=replicas.served_model_name, prompt=_unrelated(seed), max_tokens=48, stream=True
                )
                text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
                outcome: object = text
            except openai.APIError as exc:  # an explicit error: a 503, or the stream's error event
                outcome = exc
            with lock:
                results.append(outcome)

        threads = [threading.Thread(target=one, args=(5000 + i,), daemon=True) for i in range(12)]
        for thread in threads:
            thread.start()
        _wait_until(lambda: _in_flight(replicas, victim.grpc_url) > 0, 30, "a request in flight on the victim")
        at_kill = _in_flight(replicas, victim.grpc_url)
        stubs = find_stubs(victim.process.pid)
        assert len(stubs) == 1
        os.kill(stubs[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        left = _watch_outage(replicas, victim.grpc_url, killed)
        for thread in threads:
            thread.join(timeout=max(1.0, killed + 120 - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "a request hangs"
        answered = [r for r in results if isinstance(r, str)]
        assert len(results) == 12 and len(answered) >= 12 - at_kill, (at_kill, results)
        assert all(isinstance(r, (str, openai.APIError)) for r in results)
        assert left <= 2.0, f"the dead instance left the rotation after {left:.1f} s"
        for seed in range(6):  # meanwhile and after: the survivors serve
            assert _complete(replicas, _unrelated(6000 + seed)).choices[0].text is not None
        replicas.wait_in_rotation(REPLICAS, timeout_s=150)
        before = _routed(replicas)
        with ThreadPoolExecutor(9) as pool:
            list(pool.map(lambda seed: _complete(replicas, _unrelated(seed), max_tokens=16), range(7000, 7009)))
        by_instance, _ = _delta(before, _routed(replicas))
        assert victim.grpc_url in by_instance, f"the restarted instance got no requests: {by_instance}"


def test_a_worker_whose_discovery_keys_expired_registers_again(replicas):
    """File discovery deletes keys not touched for 10 s (after a pause of the machine,
    every worker's at once): the shim notices and registers again, and requests reach
    its instance again."""
    worker = replicas.workers[1]
    found = re.search(r"worker (\d+): ", worker.process.log_path.read_text())
    suffix = f"{int(found[1]):x}"
    expired = [p for p in replicas.discovery.rglob("*") if p.is_file() and p.name.endswith(suffix)]
    assert expired, f"no discovery key of worker {found[1]} under {replicas.discovery}"
    for path in expired:
        path.unlink()
    instance = worker.triton.grpc_url
    _wait_until(lambda: not _up(replicas).get(instance, True), 10, "the instance out of the rotation")
    replicas.wait_in_rotation(REPLICAS, timeout_s=60)
    assert worker.process.poll() is None, "the shim exited instead of registering again"
    before = _routed(replicas)
    with ThreadPoolExecutor(9) as pool:
        list(pool.map(lambda seed: _complete(replicas, _unrelated(seed), max_tokens=4), range(8000, 8009)))
    by_instance, _ = _delta(before, _routed(replicas))
    assert instance in by_instance, f"the re-registered instance got no requests: {by_instance}"


def _up(stack: ReplicaStack) -> dict[str, bool]:
    return {m[1]: m[2] == "1" for m in _UP.finditer(httpx.get(stack.metrics_url, timeout=10).text)}


def _in_flight(stack: ReplicaStack, instance: str) -> int:
    page = httpx.get(stack.metrics_url, timeout=10).text
    found = re.search(rf'^llm_router_instance_in_flight\{{instance="{re.escape(instance)}"\}} (\d+)', page, re.M)
    return int(found[1]) if found else 0


def _watch_outage(stack: ReplicaStack, instance: str, killed: float) -> float:
    """Seconds from the kill until `instance` was out of the rotation; /health must stay
    200 all along (two others are up)."""
    left = None
    while time.monotonic() < killed + 10:
        if left is None and not _up(stack).get(instance, True):
            left = time.monotonic() - killed
        assert httpx.get(stack.frontend.url + "/health", timeout=10).status_code == 200
        if left is not None:
            return left
        time.sleep(0.05)
    raise AssertionError("the dead instance never left the rotation")


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
