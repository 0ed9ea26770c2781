"""SCHEDULING_POLICY=priority (vLLM's `priority`: lower is sooner) against the default
first-come-first-served order, on a tiny random Llama; and cache_salt, a prefix-cache scope
within the tenant."""

from __future__ import annotations

import pytest

from backend.contract import ContractError, GenerationRequest, SamplingParams
from backend.core.engine import LLMEngine
from backend.settings.engine import EngineConfig
from tests.helpers.engine_runs import run_to_completion
from tests.helpers.lora_models import write_tiny_llama


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("priority") / "tiny-llama")


def engine_for(folder, policy: str, **overrides) -> LLMEngine:
    config = EngineConfig(str(folder), max_num_seqs=1, num_blocks=64, max_loras=0, speculative="off",
                          scheduling_policy=policy)  # fmt: skip
    for name, value in overrides.items():
        setattr(config, name, value)
    return LLMEngine(config)


def request(priority: int, max_tokens: int = 3) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerationRequest([5, 6, 7, 8], sampling, priority=priority)


def finish_order(engine: LLMEngine, arrivals: list[tuple[str, GenerationRequest]]) -> list[str]:
    """Add the requests one after another (later arrivals later), step until idle: the order
    their final outputs come out in (one sequence runs at a time: MAX_NUM_SEQS=1)."""
    for i, (request_id, req) in enumerate(arrivals):
        engine.add_request(request_id, req, arrival_time=float(i))
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.final is not None]
    return order


ARRIVALS = [("low-0", request(5)), ("low-1", request(5)), ("low-2", request(5)), ("high", request(-1)),
            ("mid", request(2))]  # fmt: skip


def test_a_high_priority_request_overtakes_a_queue_of_low_ones(folder):
    assert finish_order(engine_for(folder, "priority"), ARRIVALS) == ["high", "mid", "low-0", "low-1", "low-2"]


def test_fcfs_refuses_a_priority(folder):
    """As vLLM: a priority is meaningless without the priority policy, so it is refused."""
    engine = engine_for(folder, "fcfs")
    with pytest.raises(ContractError) as info:
        engine.add_request("r", request(1))
    assert info.value.field == "priority"
    arrivals = [(f"r{i}", request(0)) for i in range(3)]
    assert finish_order(engine, arrivals) == ["r0", "r1", "r2"]


def test_preemption_takes_the_lowest_priority_first(folder):
    """Two long requests share a pool too small for both to finish: the low-priority one
    is the one preempted, and the high-priority one never is."""
    engine = engine_for(folder, "priority", max_num_seqs=2, block_size=4, num_blocks=9)
    long = dict(max_tokens=24)
    engine.add_request("low", request(3, **long), arrival_time=0.0)
    engine.add_request("high", request(0, **long), arrival_time=1.0)
    preempted: set[str] = set()
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.final is not None:
                finals[out.request_id] = out.final
        preempted |= {s.request_id for s in engine.scheduler.waiting if s.num_preemptions}
    assert engine.num_preemptions >= 1 and preempted == {"low"}
    assert finals["high"].num_output_tokens == 24 and finals["low"].num_output_tokens == 24


def test_an_unknown_policy_is_refused(folder):
    with pytest.raises(ValueError, match="SCHEDULING_POLICY"):
        engine_for(folder, "shortest-first")


def test_cache_salt_scopes_the_prefix_cache_within_a_tenant(folder):
    engine = engine_for(folder, "fcfs", block_size=4, max_num_seqs=4)
    prompt = list(range(3, 40))

    def cached(salt: str, tenant: str = "t") -> int:
        req = GenerationRequest(prompt, SamplingParams(max_tokens=1), lookup_tenant=tenant, cache_salt=salt)
        _, finals = run_to_completion(engine, {f"r-{salt}-{tenant}-{len(engine.request_ids())}": req})
        return next(iter(finals.values())).num_cached_tokens

    assert cached("a") == 0
    assert cached("a") == 36  # the same salt: every full block but the last token's
    assert cached("b") == 0  # another salt, the same tenant: nothing shared
    assert cached("") == 0 and cached("") == 36  # no salt is a scope of its own
    assert cached("a", tenant="u") == 0  # a salt never reaches across tenants
